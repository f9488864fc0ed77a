//! `SearchSpace`: which settings the search may try, and how long each trial runs.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::knobs::{Checkpointing, Knobs, Offload, Precision, Regime};
use crate::probe::outcome::ProbeRequest;
use crate::spec::device::DeviceKind;
use crate::{Error, Result};

const WHAT: &str = "search space";

/// The settings a search may try.
///
/// Regimes are explored one after the other in the given order, so put the regime expected to
/// be fastest first: its result lets later regimes be pruned early. Within a regime the
/// micro-batch ranges over [`SearchSpace::candidates`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSpace {
    /// Regimes in priority order (no duplicates).
    pub regimes: Vec<Regime>,
    /// The first micro-batch tried in each regime (rounded up to a candidate).
    #[serde(default = "one")]
    pub start_micro_batch: usize,
    /// The largest micro-batch tried.
    pub max_micro_batch: usize,
    /// Sequences per optimizer step, if fixed: only micro-batches that divide it are tried, and
    /// a plan accumulates `global_batch / micro_batch` micro-batches per step.
    #[serde(default)]
    pub global_batch: Option<usize>,
    /// Untimed steps at the start of each trial.
    pub warmup_steps: usize,
    /// Timed steps of each search trial.
    pub timed_steps: usize,
    /// Timed steps of the verification trial of the chosen setting.
    #[serde(default = "ten")]
    pub verify_timed_steps: usize,
    /// Stop exploring after this many search trials and choose among what was measured.
    #[serde(default)]
    pub max_probes: Option<usize>,
    /// Stop growing a regime's micro-batch once a doubling gains less than this fraction of
    /// throughput. DeepSpeed's autotuner stops at 5 %; 3 % keeps the chosen plan within a few
    /// percent of the best while sparing the slow, memory-hungry trials at large batches.
    /// 0 disables the rule (growth continues to the memory boundary).
    #[serde(default = "default_saturation_gain")]
    pub saturation_gain: f64,
}

fn default_saturation_gain() -> f64 {
    SearchSpace::DEFAULT_SATURATION_GAIN
}

fn one() -> usize {
    1
}

fn ten() -> usize {
    10
}

impl SearchSpace {
    /// Default largest micro-batch: DeepSpeed autotuning's `max_train_micro_batch_size_per_gpu`.
    pub const DEFAULT_MAX_MICRO_BATCH: usize = 1024;

    /// Default [`SearchSpace::saturation_gain`].
    pub const DEFAULT_SATURATION_GAIN: f64 = 0.03;

    /// A space over `regimes` with default trial lengths (2 warm-up, 5 timed, 10 to verify),
    /// micro-batches 1 to [`Self::DEFAULT_MAX_MICRO_BATCH`], no global batch, no probe limit.
    pub fn new(regimes: Vec<Regime>) -> Self {
        Self {
            regimes,
            start_micro_batch: 1,
            max_micro_batch: Self::DEFAULT_MAX_MICRO_BATCH,
            global_batch: None,
            warmup_steps: 2,
            timed_steps: 5,
            verify_timed_steps: 10,
            max_probes: None,
            saturation_gain: Self::DEFAULT_SATURATION_GAIN,
        }
    }

    /// Regimes worth trying on a kind of device, fastest-expected first.
    ///
    /// On a GPU: bf16 (tensor cores, half the activation bytes), then bf16 with every block
    /// recomputed (about a third more compute, far fewer activation bytes), then each with the
    /// optimizer offloaded to the host (slower steps, 12 fewer device bytes per parameter). fp16
    /// and fp32 are left out: fp16 is no faster than bf16 and needs loss scaling, and fp32 is
    /// slower and larger. On a CPU: fp32 (bf16 is emulated there), then fp32 with recompute;
    /// offload is meaningless without a device.
    pub fn default_regimes(kind: DeviceKind) -> Vec<Regime> {
        let regime = |precision, checkpointing, offload| Regime {
            precision,
            checkpointing,
            offload,
            data_parallel: crate::knobs::DataParallel::SINGLE,
        };
        let all = Checkpointing::EveryKth(1);
        match kind {
            DeviceKind::Cuda => vec![
                regime(Precision::Bf16, Checkpointing::None, Offload::None),
                regime(Precision::Bf16, all, Offload::None),
                regime(Precision::Bf16, Checkpointing::None, Offload::Optimizer),
                regime(Precision::Bf16, all, Offload::Optimizer),
            ],
            DeviceKind::Cpu => vec![
                regime(Precision::Fp32, Checkpointing::None, Offload::None),
                regime(Precision::Fp32, all, Offload::None),
            ],
        }
    }

    /// Checks the space can be searched; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, problem: String| Err(Error::invalid(WHAT, field, problem));
        if self.regimes.is_empty() {
            return bad("regimes", "must list at least one regime".into());
        }
        let mut seen = HashSet::new();
        for (i, regime) in self.regimes.iter().enumerate() {
            if !seen.insert(*regime) {
                return bad(
                    &format!("regimes[{i}]"),
                    format!("({regime}) is listed twice"),
                );
            }
            Knobs::with_batch(*regime, 1, 1).validate(WHAT, &format!("regimes[{i}]."))?;
        }
        if self.max_micro_batch == 0 {
            return bad("max_micro_batch", "must be at least 1".into());
        }
        if !(1..=self.max_micro_batch).contains(&self.start_micro_batch) {
            return bad(
                "start_micro_batch",
                format!(
                    "must be between 1 and max_micro_batch ({})",
                    self.max_micro_batch
                ),
            );
        }
        if self.global_batch == Some(0) {
            return bad("global_batch", "must be at least 1".into());
        }
        if let Some(n) = self.global_batch {
            if self
                .candidates()
                .iter()
                .all(|&b| b < self.start_micro_batch)
            {
                return bad(
                    "start_micro_batch",
                    format!(
                        "({}) is above every divisor of global_batch ({n})",
                        self.start_micro_batch
                    ),
                );
            }
        }
        if self.timed_steps == 0 || self.verify_timed_steps == 0 {
            return bad(
                "timed_steps",
                "timed_steps and verify_timed_steps must be at least 1".into(),
            );
        }
        if self.max_probes == Some(0) {
            return bad("max_probes", "must be at least 1".into());
        }
        Ok(())
    }

    /// The micro-batches that may be tried, ascending: the divisors of the global batch up to
    /// `max_micro_batch`, or every size from 1 to `max_micro_batch`.
    pub fn candidates(&self) -> Vec<usize> {
        let top = match self.global_batch {
            Some(n) => n.min(self.max_micro_batch),
            None => self.max_micro_batch,
        };
        (1..=top)
            .filter(|b| self.global_batch.is_none_or(|n| n % b == 0))
            .collect()
    }

    /// Micro-batches accumulated per optimizer step at `micro_batch`: `global_batch /
    /// micro_batch`, or 1 without a global batch.
    pub fn grad_accum_for(&self, micro_batch: usize) -> usize {
        self.global_batch.map_or(1, |n| n / micro_batch.max(1))
    }

    /// The knobs a plan runs: `regime` at `micro_batch` with the real accumulation.
    pub fn plan_knobs(&self, regime: Regime, micro_batch: usize) -> Knobs {
        Knobs::with_batch(regime, micro_batch, self.grad_accum_for(micro_batch))
    }

    /// A search trial: `regime` at `micro_batch` without accumulation (memory and speed per
    /// micro-batch do not depend on it, and the trial is `grad_accum` times shorter).
    pub fn search_request(&self, regime: Regime, micro_batch: usize) -> ProbeRequest {
        ProbeRequest {
            knobs: Knobs::with_batch(regime, micro_batch, 1),
            warmup_steps: self.warmup_steps,
            timed_steps: self.timed_steps,
        }
    }

    /// The verification trial of `knobs`, exactly as a plan would run them.
    pub fn verify_request(&self, knobs: Knobs) -> ProbeRequest {
        ProbeRequest {
            knobs,
            warmup_steps: self.warmup_steps,
            timed_steps: self.verify_timed_steps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> SearchSpace {
        SearchSpace::new(SearchSpace::default_regimes(DeviceKind::Cuda))
    }

    #[test]
    fn candidates_follow_the_global_batch() {
        let s = SearchSpace {
            max_micro_batch: 8,
            ..space()
        };
        assert_eq!(s.candidates(), (1..=8).collect::<Vec<_>>());
        let s = SearchSpace {
            global_batch: Some(96),
            max_micro_batch: 40,
            ..space()
        };
        assert_eq!(s.candidates(), vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32]);
        assert_eq!(s.grad_accum_for(24), 4);
        let knobs = s.plan_knobs(s.regimes[0], 32);
        assert_eq!((knobs.micro_batch, knobs.grad_accum), (32, 3));
        let s = SearchSpace {
            global_batch: Some(6),
            ..space()
        };
        assert_eq!(s.candidates(), vec![1, 2, 3, 6]);
    }

    #[test]
    fn default_regimes_validate() {
        space().validate().unwrap();
        SearchSpace::new(SearchSpace::default_regimes(DeviceKind::Cpu))
            .validate()
            .unwrap();
    }

    #[test]
    fn invalid_spaces_name_the_field() {
        let field = |s: SearchSpace| match s.validate() {
            Err(Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected an invalid space, got {other:?}"),
        };
        assert_eq!(
            field(SearchSpace {
                regimes: vec![],
                ..space()
            }),
            "regimes"
        );
        let mut twice = space();
        twice.regimes.push(twice.regimes[0]);
        assert_eq!(field(twice), "regimes[4]");
        let mut zero_k = space();
        zero_k.regimes[1].checkpointing = Checkpointing::EveryKth(0);
        assert_eq!(field(zero_k), "regimes[1].checkpointing");
        assert_eq!(
            field(SearchSpace {
                start_micro_batch: 0,
                ..space()
            }),
            "start_micro_batch"
        );
        assert_eq!(
            field(SearchSpace {
                global_batch: Some(0),
                ..space()
            }),
            "global_batch"
        );
        assert_eq!(
            field(SearchSpace {
                global_batch: Some(7),
                start_micro_batch: 8,
                ..space()
            }),
            "start_micro_batch"
        );
        assert_eq!(
            field(SearchSpace {
                max_probes: Some(0),
                ..space()
            }),
            "max_probes"
        );
    }

    #[test]
    fn requests_carry_trial_lengths() {
        let s = SearchSpace {
            global_batch: Some(64),
            ..space()
        };
        let search = s.search_request(s.regimes[0], 16);
        assert_eq!((search.knobs.grad_accum, search.timed_steps), (1, 5));
        let verify = s.verify_request(s.plan_knobs(s.regimes[0], 16));
        assert_eq!((verify.knobs.grad_accum, verify.timed_steps), (4, 10));
    }
}
