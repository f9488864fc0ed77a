//! Dynamic loss scaling for f16 training, with PyTorch `GradScaler`'s defaults and rules.
//!
//! f16 gradients underflow below ~6e-8; multiplying the loss by a large scale keeps them
//! representable. When any gradient overflows to inf/NaN the step is skipped and the scale
//! halved; after `growth_interval` clean steps in a row it doubles.

use serde::{Deserialize, Serialize};

/// Loss-scale state; saved in checkpoints so resumed runs scale identically.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale.
    pub scale: f64,
    /// Clean steps since the last change.
    pub clean_steps: u64,
    /// Clean steps needed before the scale grows.
    pub growth_interval: u64,
    /// Steps skipped because of overflow, over the run.
    pub skipped_steps: u64,
}

/// What the scaler decided for one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDecision {
    /// Gradients are finite: apply the update.
    Apply,
    /// Gradients overflowed: skip the update (the scale has been lowered).
    Skip,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self {
            scale: 65536.0,
            clean_steps: 0,
            growth_interval: 2000,
            skipped_steps: 0,
        }
    }
}

impl LossScaler {
    /// A scaler that never scales (fp32 and bf16 steps).
    pub fn identity() -> Self {
        Self {
            scale: 1.0,
            growth_interval: u64::MAX,
            ..Self::default()
        }
    }

    /// Records whether this step's gradients were finite and updates the scale.
    pub fn update(&mut self, grads_finite: bool) -> ScaleDecision {
        if !grads_finite {
            self.scale = (self.scale * 0.5).max(f64::MIN_POSITIVE);
            self.clean_steps = 0;
            self.skipped_steps = self.skipped_steps.saturating_add(1);
            return ScaleDecision::Skip;
        }
        // Saturating: the counters come from checkpoints too, whatever they hold.
        self.clean_steps = self.clean_steps.saturating_add(1);
        if self.clean_steps >= self.growth_interval {
            self.scale = (self.scale * 2.0).min(f64::MAX);
            self.clean_steps = 0;
        }
        ScaleDecision::Apply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_and_grows_after_clean_interval() {
        let mut s = LossScaler {
            growth_interval: 3,
            ..LossScaler::default()
        };
        assert_eq!(s.update(false), ScaleDecision::Skip);
        assert_eq!(s.scale, 32768.0);
        for _ in 0..2 {
            assert_eq!(s.update(true), ScaleDecision::Apply);
        }
        assert_eq!(s.scale, 32768.0);
        s.update(true);
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.skipped_steps, 1);
    }
}
