//! A simulated device: answers trials from closed-form memory and time laws.
//!
//! For tests of the search, benches of the planner, and dry runs of a space against a device
//! one expects: no model is built and no clock is read. A trial runs out of memory exactly when
//! its law exceeds the simulated limit, the way a real allocator fails.

use serde::{Deserialize, Serialize};

use crate::knobs::Regime;
use crate::spec::budget::Budget;
use crate::trial::{Measurement, MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};

/// `fixed + linear · b + quadratic · b²` of the micro-batch `b`.
///
/// The quadratic term lets a test bend a law away from the affine models the search fits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Law {
    /// Value at `b = 0`.
    pub fixed: f64,
    /// Coefficient of `b`.
    pub linear: f64,
    /// Coefficient of `b²`.
    #[serde(default)]
    pub quadratic: f64,
}

impl Law {
    /// An affine law.
    pub fn affine(fixed: f64, linear: f64) -> Self {
        Self {
            fixed,
            linear,
            quadratic: 0.0,
        }
    }

    /// The law at `b`.
    pub fn at(&self, b: usize) -> f64 {
        let b = b as f64;
        self.fixed + self.linear * b + self.quadratic * b * b
    }
}

/// The laws of one regime. Times are seconds per micro-batch step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimRegime {
    /// The regime these laws describe.
    pub regime: Regime,
    /// Peak device bytes.
    pub gpu_bytes: Law,
    /// Peak host bytes.
    pub host_bytes: Law,
    /// Seconds per micro-batch (forward, backward and the optimizer's share).
    pub step_time_s: Law,
}

/// A simulated device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Simulator {
    /// Device bytes at which a trial runs out of memory; `None` simulates a CPU (no device).
    pub gpu_limit_bytes: Option<u64>,
    /// Host bytes at which a trial runs out of memory.
    pub host_limit_bytes: u64,
    /// Tokens per sequence, for tokens/s.
    pub tokens_per_sample: usize,
    /// Extra device bytes when accumulating (`grad_accum > 1`): the summed-gradient buffer.
    #[serde(default)]
    pub accumulation_gpu_bytes: u64,
    /// Laws per regime; a trial of any other regime crashes.
    pub regimes: Vec<SimRegime>,
}

impl Simulator {
    /// A device whose limits are the budget's full (not usable) bytes, as a real device's are.
    pub fn with_budget(budget: &Budget, tokens_per_sample: usize, regimes: Vec<SimRegime>) -> Self {
        Self {
            gpu_limit_bytes: budget.gpu_bytes,
            host_limit_bytes: budget.host_bytes,
            tokens_per_sample,
            accumulation_gpu_bytes: 0,
            regimes,
        }
    }

    /// Runs one simulated trial.
    pub fn answer(&self, request: &TrialRequest) -> TrialResult {
        let knobs = request.knobs;
        let outcome = match self.regimes.iter().find(|r| r.regime == knobs.regime()) {
            None => Outcome::Crashed {
                reason: format!("regime {} is not simulated", knobs.regime()),
            },
            Some(laws) => self.outcome(laws, request),
        };
        let step = match &outcome {
            Outcome::Fits(m) => m.step_time_median_s,
            _ => 0.0,
        };
        TrialResult {
            request: *request,
            outcome,
            wall_s: step * (request.warmup_steps + request.timed_steps) as f64,
        }
    }

    fn outcome(&self, laws: &SimRegime, request: &TrialRequest) -> Outcome {
        let (b, accum) = (request.knobs.micro_batch, request.knobs.grad_accum.max(1));
        let extra = if accum > 1 {
            self.accumulation_gpu_bytes
        } else {
            0
        };
        let gpu = match self.gpu_limit_bytes {
            Some(_) => laws.gpu_bytes.at(b).max(0.0).round() as u64 + extra,
            None => 0,
        };
        let host = laws.host_bytes.at(b).max(0.0).round() as u64;
        if self.gpu_limit_bytes.is_some_and(|limit| gpu > limit) {
            return Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                phase: Phase::ForwardBackward,
            };
        }
        if host > self.host_limit_bytes {
            return Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                phase: Phase::OptimizerStep,
            };
        }
        let step = laws.step_time_s.at(b) * accum as f64;
        Outcome::Fits(Measurement {
            peak_gpu_bytes: gpu,
            peak_host_bytes: host,
            step_time_median_s: step,
            step_time_spread: 0.0,
            timed_steps: request.timed_steps,
            tokens_per_s: (b * accum * self.tokens_per_sample) as f64 / step,
            host_link: None,
        })
    }
}

impl Prober for Simulator {
    fn probe(&mut self, request: &TrialRequest) -> crate::Result<TrialResult> {
        Ok(self.answer(request))
    }
}

/// How a [`Scattered`] simulator's timings scatter: each trial is off by a factor drawn once
/// (what another process, clocks or temperature change from one run to the next), and each of
/// its steps by another; both log-normal with these relative standard deviations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scatter {
    /// From one trial to the next.
    pub between_trials: f64,
    /// From one step to the next within a trial.
    pub within_trial: f64,
}

/// A simulator whose step times scatter as a real device's do, reproducibly from a seed: the
/// search's and the check's handling of noise is tested against it. A trial's measurement is
/// taken from its scattered steps as a prober takes it ([`Measurement::from_step_times`]),
/// so its spread is as informative, or as misleading, as a real trial's few steps.
#[derive(Debug, Clone)]
pub struct Scattered {
    simulator: Simulator,
    scatter: Scatter,
    state: u64,
}

impl Scattered {
    /// `simulator`'s answers scattered by `scatter`, drawn from `seed`.
    pub fn new(simulator: Simulator, scatter: Scatter, seed: u64) -> Self {
        Self {
            simulator,
            scatter,
            state: seed,
        }
    }

    /// A uniform draw in [0, 1) (SplitMix64: small, and the same on every platform).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal draw (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(f64::MIN_POSITIVE), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

impl Prober for Scattered {
    fn probe(&mut self, request: &TrialRequest) -> crate::Result<TrialResult> {
        let mut result = self.simulator.answer(request);
        if let Outcome::Fits(m) = &mut result.outcome {
            let trial = (self.scatter.between_trials * self.normal()).exp();
            let times: Vec<f64> = (0..request.timed_steps)
                .map(|_| {
                    m.step_time_median_s * trial * (self.scatter.within_trial * self.normal()).exp()
                })
                .collect();
            let tokens_per_step = m.tokens_per_s * m.step_time_median_s;
            *m = Measurement::from_step_times(
                &times,
                tokens_per_step,
                m.peak_gpu_bytes,
                m.peak_host_bytes,
            );
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Knobs, Precision};

    const MIB: f64 = (1 << 20) as f64;
    const GIB: f64 = (1 << 30) as f64;

    fn sim() -> Simulator {
        let regime = Knobs::new(1, Precision::Bf16).regime();
        let laws = SimRegime {
            regime,
            gpu_bytes: Law::affine(GIB, 37.0 * MIB),
            host_bytes: Law::affine(2.0 * GIB, 0.0),
            step_time_s: Law::affine(0.01, 0.002),
        };
        let budget = Budget {
            gpu_bytes: Some(10 << 30),
            host_bytes: 32 << 30,
            headroom: 0.05,
        };
        Simulator {
            accumulation_gpu_bytes: 64 << 20,
            ..Simulator::with_budget(&budget, 128, vec![laws])
        }
    }

    fn request(micro_batch: usize, grad_accum: usize, precision: Precision) -> TrialRequest {
        let knobs = Knobs {
            grad_accum,
            ..Knobs::new(micro_batch, precision)
        };
        TrialRequest {
            knobs,
            warmup_steps: 1,
            timed_steps: 3,
            remeasure: false,
        }
    }

    #[test]
    fn laws_decide_fit_and_oom() {
        let s = sim();
        let fits = s.answer(&request(8, 1, Precision::Bf16));
        let m = fits.outcome.measurement().unwrap();
        assert_eq!(m.peak_gpu_bytes, (GIB + 8.0 * 37.0 * MIB) as u64);
        assert!((m.tokens_per_s - 8.0 * 128.0 / 0.026).abs() < 1e-6);
        assert!((fits.wall_s - 4.0 * 0.026).abs() < 1e-12);
        // 1 GiB + 37 MiB · 249 = 10237 MiB fits in 10 GiB; 250 does not.
        assert!(s
            .answer(&request(249, 1, Precision::Bf16))
            .outcome
            .measurement()
            .is_some());
        let oom = s.answer(&request(250, 1, Precision::Bf16));
        assert!(matches!(
            oom.outcome,
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                ..
            }
        ));
        // Accumulation's extra buffer tips 249 over.
        assert!(s
            .answer(&request(249, 2, Precision::Bf16))
            .outcome
            .measurement()
            .is_none());
        assert!(matches!(
            s.answer(&request(1, 1, Precision::Fp32)).outcome,
            Outcome::Crashed { .. }
        ));
    }

    #[test]
    fn accumulation_multiplies_step_time_not_throughput() {
        let s = sim();
        let one = *s
            .answer(&request(8, 1, Precision::Bf16))
            .outcome
            .measurement()
            .unwrap();
        let four = *s
            .answer(&request(8, 4, Precision::Bf16))
            .outcome
            .measurement()
            .unwrap();
        assert!((four.step_time_median_s - 4.0 * one.step_time_median_s).abs() < 1e-12);
        assert!((four.tokens_per_s - one.tokens_per_s).abs() < 1e-6);
    }
}
