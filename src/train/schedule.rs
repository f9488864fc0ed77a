//! The learning rate over a run: a linear warm-up, then constant or a cosine decay to a floor.
//!
//! [`LrSchedule::lr`] is a pure function of the step, so a resumed run (which restores its
//! step count and its schedule from the checkpoint) continues exactly where it stopped.
//!
//! With base rate `η`, warm-up `W` steps, floor `η_min` and horizon `N` (the run's total
//! steps), the step with 0-based index `t` runs at:
//!
//! - `η · (t + 1) / W` while `t < W` (the first step already moves the weights);
//! - constant: `η`;
//! - cosine: `η_min + (η − η_min) · (1 + cos(π · p)) / 2` with `p = (t − W) / (N − W)`,
//!   clamped to `[0, 1]`: `η` right after the warm-up, `η_min` from step `N` on.

use serde::{Deserialize, Serialize};

/// What the rate does after the warm-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecay {
    /// Stays at the base rate.
    #[default]
    Constant,
    /// Falls along half a cosine to the floor at the run's last step.
    Cosine,
}

impl LrDecay {
    /// The name on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            LrDecay::Constant => "constant",
            LrDecay::Cosine => "cosine",
        }
    }
}

impl std::str::FromStr for LrDecay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(LrDecay::Constant),
            "cosine" => Ok(LrDecay::Cosine),
            _ => Err(format!(
                "unknown learning-rate schedule `{s}`; expected constant or cosine"
            )),
        }
    }
}

/// A learning-rate schedule; the base rate is the model spec's `optimizer.lr`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// After the warm-up.
    pub decay: LrDecay,
    /// Steps of linear warm-up from `lr / warmup_steps` to the base rate.
    pub warmup_steps: u64,
    /// The cosine's floor (unused when constant).
    pub min_lr: f64,
    /// The step at which the cosine reaches its floor: the run's total steps (unused when
    /// constant).
    pub decay_steps: u64,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self::CONSTANT
    }
}

impl LrSchedule {
    /// The base rate throughout: what training did before schedules existed.
    pub const CONSTANT: LrSchedule = LrSchedule {
        decay: LrDecay::Constant,
        warmup_steps: 0,
        min_lr: 0.0,
        decay_steps: 0,
    };

    /// The rate of the step with 0-based index `step` for base rate `base`.
    pub fn lr(&self, base: f64, step: u64) -> f64 {
        if step < self.warmup_steps {
            // The fraction first, so that the last warm-up step runs at exactly the base rate.
            return base * ((step + 1) as f64 / self.warmup_steps as f64);
        }
        match self.decay {
            LrDecay::Constant => base,
            LrDecay::Cosine => {
                let span = self.decay_steps.saturating_sub(self.warmup_steps);
                let progress = if span == 0 {
                    1.0
                } else {
                    ((step - self.warmup_steps) as f64 / span as f64).min(1.0)
                };
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.min_lr + (base - self.min_lr) * cosine
            }
        }
    }

    /// The schedule with the fields its decay does not read cleared, so that two schedules
    /// that give the same rates compare equal (a constant one ignores floor and horizon).
    pub fn canonical(&self) -> LrSchedule {
        match self.decay {
            LrDecay::Constant => LrSchedule {
                min_lr: 0.0,
                decay_steps: 0,
                ..*self
            },
            LrDecay::Cosine => *self,
        }
    }

    /// Checks the floor is a rate (finite, at least 0); `what` names the document.
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> autotune_core::Result<()> {
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0) {
            return Err(autotune_core::Error::invalid(
                what,
                format!("{field_prefix}min_lr"),
                format!("({}) must be a finite rate, at least 0", self.min_lr),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.decay {
            LrDecay::Constant => f.write_str("constant")?,
            LrDecay::Cosine => write!(
                f,
                "cosine to {:.3e} at step {}",
                self.min_lr, self.decay_steps
            )?,
        }
        if self.warmup_steps > 0 {
            write!(f, " after {} warm-up steps", self.warmup_steps)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(warmup_steps: u64, decay_steps: u64) -> LrSchedule {
        LrSchedule {
            decay: LrDecay::Cosine,
            warmup_steps,
            min_lr: 0.1,
            decay_steps,
        }
    }

    #[test]
    fn the_rate_follows_the_table() {
        let warm_constant = LrSchedule {
            warmup_steps: 4,
            ..LrSchedule::CONSTANT
        };
        // (schedule, step, rate) for a base rate of 1.
        let table = [
            (LrSchedule::CONSTANT, 0, 1.0),
            (LrSchedule::CONSTANT, 1_000_000, 1.0),
            (warm_constant, 0, 0.25),
            (warm_constant, 1, 0.5),
            (warm_constant, 3, 1.0),
            (warm_constant, 4, 1.0),
            (warm_constant, 99, 1.0),
            // Warm-up 10, cosine over steps 10..110 to 0.1.
            (cosine(10, 110), 0, 0.1),
            (cosine(10, 110), 9, 1.0),
            (cosine(10, 110), 10, 1.0),
            (cosine(10, 110), 60, 0.55),
            (
                cosine(10, 110),
                35,
                0.1 + 0.9 * (0.5 + 0.5 * (0.25 * std::f64::consts::PI).cos()),
            ),
            (cosine(10, 110), 110, 0.1),
            (cosine(10, 110), 500, 0.1),
            // No warm-up: the first step runs at the base rate.
            (cosine(0, 100), 0, 1.0),
            (cosine(0, 100), 50, 0.55),
            // A horizon inside the warm-up: the floor right after it.
            (cosine(10, 5), 10, 0.1),
        ];
        for (schedule, step, want) in table {
            let got = schedule.lr(1.0, step);
            assert!(
                (got - want).abs() < 1e-12,
                "{schedule} at step {step}: {got}, expected {want}"
            );
        }
    }

    #[test]
    fn the_rate_never_rises_after_the_warm_up_nor_falls_below_the_floor() {
        let s = cosine(7, 60);
        let rates: Vec<f64> = (7..80).map(|t| s.lr(1.0, t)).collect();
        assert!(rates.windows(2).all(|w| w[1] <= w[0]));
        assert_eq!(rates[0], 1.0);
        assert!(rates.iter().all(|&r| r >= 0.1 - 1e-12));
        let warm: Vec<f64> = (0..7).map(|t| s.lr(1.0, t)).collect();
        assert!(warm.windows(2).all(|w| w[1] > w[0]));
    }

    #[test]
    fn constant_schedules_compare_equal_whatever_their_unused_fields() {
        let a = LrSchedule {
            min_lr: 0.5,
            decay_steps: 10,
            ..LrSchedule::CONSTANT
        };
        assert_eq!(a.canonical(), LrSchedule::CONSTANT);
        assert_ne!(cosine(0, 10).canonical(), cosine(0, 11).canonical());
    }
}
