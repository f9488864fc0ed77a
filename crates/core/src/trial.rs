//! Trials: what one asks for, what it found, and the [`Prober`] that runs them.
//!
//! These types are the wire format between the search driver and a prober (in-process, a child
//! process speaking JSON, a worker, several ranks, or a replay of a recorded profile), so they
//! are plain serde data.

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::{Error, Result};

mod spread;
pub use spread::{MEDIAN_EFFICIENCY, Z_95};

/// The most warm-up or timed steps of one trial.
pub const MAX_TRIAL_STEPS: usize = 1 << 16;

/// The longest step time a measurement may record: eleven days is not a trial's step.
pub const MAX_STEP_TIME_S: f64 = 1e6;

/// The shortest step time a measurement reported by another program may have: no optimizer
/// step (forward, backward and update, each several kernels) runs within a microsecond; a
/// shorter one is a clock misread, not a measurement.
pub const MIN_STEP_TIME_S: f64 = 1e-6;

/// The most tokens a second one trial may report: above any accelerator's dense arithmetic for
/// a model worth tuning (10^15 FLOP/s at 6 FLOP a parameter a token is 10^10 tokens/s for a
/// model of 16 000 parameters); more is a misread clock or a miscount.
pub const MAX_TOKENS_PER_S: f64 = 1e10;

/// Runs trials for a search: in this process, in child processes, on several GPUs, from a
/// recording or a simulation. The search driver decides what to run; a prober only runs it.
pub trait Prober {
    /// Runs one trial. Expected outcomes (out of memory, a crashed trial process) are `Ok`
    /// results; an `Err` means no trial could be run and ends the search.
    fn probe(&mut self, request: &TrialRequest) -> Result<TrialResult>;
}

/// A function is a prober: the search's tests and one-off callers pass closures.
impl<F: FnMut(&TrialRequest) -> Result<TrialResult>> Prober for F {
    fn probe(&mut self, request: &TrialRequest) -> Result<TrialResult> {
        self(request)
    }
}

impl TrialRequest {
    /// Checks the knobs and that the trial's lengths are within [`MAX_TRIAL_STEPS`].
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> Result<()> {
        self.knobs
            .validate(what, &format!("{field_prefix}knobs."))?;
        for (field, steps) in [
            ("warmup_steps", self.warmup_steps),
            ("timed_steps", self.timed_steps),
        ] {
            if steps > MAX_TRIAL_STEPS {
                return Err(Error::invalid(
                    what,
                    format!("{field_prefix}{field}"),
                    format!("({steps}) must be at most {MAX_TRIAL_STEPS}"),
                ));
            }
        }
        Ok(())
    }
}

impl TrialResult {
    /// Checks a recorded trial: its request, its outcome's numbers and its wall time.
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> Result<()> {
        self.request
            .validate(what, &format!("{field_prefix}request."))?;
        self.outcome.validate(what, field_prefix)?;
        if !(self.wall_s.is_finite() && self.wall_s >= 0.0) {
            return Err(Error::invalid(
                what,
                format!("{field_prefix}wall_s"),
                format!(
                    "({}) must be a finite number of seconds, at least 0",
                    self.wall_s
                ),
            ));
        }
        Ok(())
    }
}

/// One trial: run `warmup_steps` untimed then `timed_steps` timed optimizer steps at `knobs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrialRequest {
    /// The setting to measure.
    pub knobs: Knobs,
    /// Steps run before timing starts (first-use allocations, kernel JIT, cuBLAS heuristics).
    pub warmup_steps: usize,
    /// Steps whose durations are recorded.
    pub timed_steps: usize,
    /// Whether this runs a search trial's knobs again, because its timing could not tell it
    /// from a neighbour's: its measurement is pooled with the earlier ones
    /// ([`Measurement::pooled`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remeasure: bool,
}

/// Which memory ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// Device memory.
    Gpu,
    /// Host memory (the budget, or the allocator).
    Host,
}

/// The part of a trial that was running when memory ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Building the model and optimizer.
    Setup,
    /// Forward and backward passes.
    ForwardBackward,
    /// The optimizer update.
    OptimizerStep,
    /// The evaluation pass (no gradients).
    Eval,
    /// Writing a checkpoint.
    Checkpoint,
}

/// Measurements of a trial that fitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measurement {
    /// Peak device bytes over the whole trial: the memory pool's high-water mark plus what the
    /// driver holds outside it (context, cuBLAS workspaces). 0 on CPU.
    pub peak_gpu_bytes: u64,
    /// Peak host bytes attributable to the trial (heap high-water mark on CPU runs).
    pub peak_host_bytes: u64,
    /// Median wall time of one optimizer step (all micro-batches), seconds.
    pub step_time_median_s: f64,
    /// Spread of the timed steps: (p90 − p10) / median, a unitless noise figure.
    pub step_time_spread: f64,
    /// Number of timed steps behind the median.
    pub timed_steps: usize,
    /// Tokens processed per second at the median step time.
    pub tokens_per_s: f64,
    /// What an offloaded trial moved over the host link; absent without offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_link: Option<HostLink>,
}

/// The host-link traffic of an offloaded trial, so that its step time can be retimed for a
/// target machine whose link is slower than the one the trial ran on (a 4090's PCIe 4 against
/// a server's PCIe 5): an offload that pays off here may lose there.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLink {
    /// Bytes copied between host and device per optimizer step (both directions).
    pub bytes_per_step: u64,
    /// The link's measured speed where the trial ran, GB/s (10^9 bytes), both directions.
    pub measured_gbps: f64,
    /// Seconds added to the measured median step for the target's link (see
    /// [`Measurement::retimed_for_link`]); 0 when the target is as fast or unknown.
    #[serde(default)]
    pub added_s: f64,
}

impl Measurement {
    /// The measurement of a trial whose timed steps took `times` seconds each: their median,
    /// their spread ((p90 − p10) / median, linearly interpolated quantiles), and tokens/s at
    /// the median for `tokens_per_step` tokens a step (0 without timed steps).
    pub fn from_step_times(
        times: &[f64],
        tokens_per_step: f64,
        peak_gpu_bytes: u64,
        peak_host_bytes: u64,
    ) -> Self {
        let mut sorted = times.to_vec();
        sorted.sort_by(f64::total_cmp);
        let quantile = |q: f64| {
            if sorted.is_empty() {
                return 0.0;
            }
            let pos = q * (sorted.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        };
        let median = quantile(0.5);
        Self {
            peak_gpu_bytes,
            peak_host_bytes,
            step_time_median_s: median,
            step_time_spread: if median > 0.0 {
                (quantile(0.9) - quantile(0.1)) / median
            } else {
                0.0
            },
            timed_steps: times.len(),
            tokens_per_s: if median > 0.0 {
                tokens_per_step / median
            } else {
                0.0
            },
            host_link: None,
        }
    }

    /// This measurement as it would be on a target whose link runs at `target_gbps`.
    ///
    /// Copies share the device's one stream with the kernels, so every byte's extra time at a
    /// slower link lengthens the step: `bytes · (1/target − 1/measured)`. Where the host, not the
    /// device, bounds the step the slower copies may hide behind it, so the retimed step errs
    /// slow, which keeps a plan from relying on a link the target lacks. A faster target adds
    /// nothing (the speed-up is not counted on). Idempotent: retiming starts from the measured
    /// step, so a recorded, already retimed trial retimes to the same values.
    pub fn retimed_for_link(&self, target_gbps: Option<f64>) -> Self {
        let Some(link) = self.host_link else {
            return *self;
        };
        let measured_s = self.step_time_median_s - link.added_s;
        let added_s = match target_gbps {
            Some(target) if target > 0.0 && target < link.measured_gbps => {
                link.bytes_per_step as f64 * (1.0 / target - 1.0 / link.measured_gbps) / 1e9
            }
            _ => 0.0,
        };
        let step = measured_s + added_s;
        let tokens_per_step = self.tokens_per_s * self.step_time_median_s;
        Self {
            step_time_median_s: step,
            tokens_per_s: if step > 0.0 {
                tokens_per_step / step
            } else {
                0.0
            },
            host_link: Some(HostLink { added_s, ..link }),
            ..*self
        }
    }
}

/// How a trial ended: expected outcomes, never errors. Unknown fields are refused in every
/// variant (a fit's [`Measurement`] refuses them itself), so a recorded trial is never half
/// understood.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome", deny_unknown_fields)]
pub enum Outcome {
    /// The setting ran; here is what it cost.
    Fits(Measurement),
    /// The setting ran out of memory.
    OutOfMemory {
        /// Which memory.
        memory: MemoryKind,
        /// Where in the trial.
        phase: Phase,
    },
    /// The trial died for another reason (a child process crashed, a sticky device error).
    Crashed {
        /// What was seen.
        reason: String,
    },
    /// The trial did not finish within its time limit and was stopped (a hung kernel or
    /// collective, a setting far slower than expected). The search treats it as infeasible,
    /// as a crash.
    TimedOut {
        /// The limit it ran into, seconds.
        after_s: f64,
    },
}

impl Outcome {
    /// Checks a recorded outcome's numbers: every time finite, positive where it was measured,
    /// and at most [`MAX_STEP_TIME_S`]; `field_prefix` names where it sits in the document.
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> Result<()> {
        let seconds = |field: &str, value: f64, positive: bool| {
            let ok = value.is_finite()
                && value <= MAX_STEP_TIME_S
                && if positive { value > 0.0 } else { value >= 0.0 };
            if ok {
                return Ok(());
            }
            let least = if positive { "above 0" } else { "at least 0" };
            Err(Error::invalid(
                what,
                format!("{field_prefix}{field}"),
                format!(
                    "({value}) must be a number of seconds {least} and at most {MAX_STEP_TIME_S:e}"
                ),
            ))
        };
        match self {
            Outcome::Fits(m) => {
                seconds(
                    "step_time_median_s",
                    m.step_time_median_s,
                    m.timed_steps > 0,
                )?;
                for (field, value) in [
                    ("step_time_spread", m.step_time_spread),
                    ("tokens_per_s", m.tokens_per_s),
                ] {
                    if !(value.is_finite() && value >= 0.0) {
                        return Err(Error::invalid(
                            what,
                            format!("{field_prefix}{field}"),
                            format!("({value}) must be a finite number, at least 0"),
                        ));
                    }
                }
                Ok(())
            }
            Outcome::TimedOut { after_s } => seconds("after_s", *after_s, true),
            Outcome::OutOfMemory { .. } | Outcome::Crashed { .. } => Ok(()),
        }
    }

    /// The measurement, if the setting fitted.
    pub fn measurement(&self) -> Option<&Measurement> {
        match self {
            Outcome::Fits(m) => Some(m),
            _ => None,
        }
    }
}

/// A request together with its outcome: one entry of the search history and of a recorded profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialResult {
    /// What was asked.
    pub request: TrialRequest,
    /// What happened.
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Wall time the trial took, including setup, seconds.
    pub wall_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::Precision;

    #[test]
    fn a_recorded_trial_with_an_unknown_field_is_refused_whatever_its_outcome() {
        let request = r#""request": {"knobs": {"micro_batch": 1, "grad_accum": 1, "precision": "bf16", "checkpointing": {"mode": "none"}, "offload": "none"}, "warmup_steps": 1, "timed_steps": 3}"#;
        let outcomes = [
            r#""outcome": "out_of_memory", "memory": "gpu", "phase": "forward_backward""#,
            r#""outcome": "crashed", "reason": "a sticky device error""#,
            r#""outcome": "timed_out", "after_s": 900.0"#,
            r#""outcome": "fits", "peak_gpu_bytes": 1, "peak_host_bytes": 1, "step_time_median_s": 1.0, "step_time_spread": 0.0, "timed_steps": 3, "tokens_per_s": 1.0"#,
        ];
        for outcome in outcomes {
            let good = format!("{{{request}, {outcome}, \"wall_s\": 1.0}}");
            assert!(serde_json::from_str::<TrialResult>(&good).is_ok(), "{good}");
            let spare = format!("{{{request}, {outcome}, \"spare\": 1, \"wall_s\": 1.0}}");
            assert!(
                serde_json::from_str::<TrialResult>(&spare).is_err(),
                "{spare}"
            );
        }
    }

    /// Retiming for a slower link adds each byte's extra time and scales tokens/s to match;
    /// a faster or unknown target, or a trial without offload, changes nothing; retiming twice
    /// (a recorded trial replayed) gives the first result.
    #[test]
    fn a_slower_target_link_lengthens_an_offloaded_step_by_its_bytes() {
        let measured = |link: Option<HostLink>| Measurement {
            peak_gpu_bytes: 1,
            peak_host_bytes: 2,
            step_time_median_s: 1.0,
            step_time_spread: 0.0,
            timed_steps: 3,
            tokens_per_s: 4096.0,
            host_link: link,
        };
        let link = HostLink {
            bytes_per_step: 10_000_000_000,
            measured_gbps: 50.0,
            added_s: 0.0,
        };
        // (target GB/s, expected step seconds)
        let table = [
            (Some(25.0), 1.0 + 10.0 * (1.0 / 25.0 - 1.0 / 50.0)),
            (Some(50.0), 1.0),
            (Some(100.0), 1.0),
            (None, 1.0),
        ];
        for (target, want) in table {
            let got = measured(Some(link)).retimed_for_link(target);
            assert!(
                (got.step_time_median_s - want).abs() < 1e-12,
                "{target:?}: {got:?}"
            );
            assert!((got.tokens_per_s * got.step_time_median_s - 4096.0).abs() < 1e-6);
            let again = got.retimed_for_link(target);
            assert!(
                (again.step_time_median_s - want).abs() < 1e-12,
                "{target:?} twice"
            );
            let back = got.retimed_for_link(None);
            assert!((back.step_time_median_s - 1.0).abs() < 1e-12, "undone");
        }
        assert_eq!(measured(None).retimed_for_link(Some(1.0)), measured(None));
        let json = serde_json::to_string(&measured(None)).unwrap();
        assert!(!json.contains("host_link"), "{json}");
    }

    #[test]
    fn a_timed_out_trial_is_recorded_and_read_back_and_older_outcomes_still_read() {
        let result = TrialResult {
            request: TrialRequest {
                knobs: Knobs::new(4, Precision::Bf16),
                warmup_steps: 1,
                timed_steps: 3,
                remeasure: false,
            },
            outcome: Outcome::TimedOut { after_s: 900.0 },
            wall_s: 900.5,
        };
        let json = serde_json::to_string(&result).unwrap();
        assert!(
            json.contains(r#""outcome":"timed_out","after_s":900.0"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<TrialResult>(&json).unwrap(), result);
        let older = r#"{"request": {"knobs": {"micro_batch": 4, "grad_accum": 1, "precision": "bf16"}, "warmup_steps": 1, "timed_steps": 3}, "outcome": "crashed", "reason": "gone", "wall_s": 1.0}"#;
        assert!(serde_json::from_str::<TrialResult>(older).is_ok());
        let bad = TrialResult {
            outcome: Outcome::TimedOut { after_s: -1.0 },
            ..result
        };
        assert!(bad.validate("profile", "probes[0].").is_err());
    }
}
