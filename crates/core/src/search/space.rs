//! `SearchSpace`: which settings the search may try, and how long each trial runs.
//!
//! On a host with several GPUs the regimes also range over the data-parallel degree (and
//! optimizer sharding): a regime at degree N is probed on N GPUs, so its memory per GPU and its
//! throughput are measured like any other regime's. With one GPU nothing changes.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::knobs::{
    Checkpointing, DataParallel, Knobs, MasterFormat, MomentFormat, MomentPlace, Offload,
    Precision, Regime, StateLayout, Update,
};
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::model::ModelSpec;
use crate::trial::TrialRequest;
use crate::{Error, Result};

const WHAT: &str = "search space";

/// The error of a space whose `field` has `problem`.
fn invalid(field: &str, problem: String) -> Result<()> {
    Err(Error::invalid(WHAT, field, problem))
}

/// What a user asks of a search, beside the target's defaults: the settings to consider (an
/// empty list keeps the defaults) and the trials' lengths and limits.
#[derive(Debug, Clone, PartialEq)]
pub struct SpaceRequest {
    /// Precisions to consider.
    pub precisions: Vec<Precision>,
    /// Activation checkpointing settings to consider.
    pub checkpointing: Vec<Checkpointing>,
    /// Offload settings to consider.
    pub offload: Vec<Offload>,
    /// When to update, among those exact for the model and space: empty for both where the
    /// update in backward is exact (see [`Update`]), else the normal step.
    pub updates: Vec<Update>,
    /// Data-parallel degrees to consider.
    pub data_parallel: Vec<usize>,
    /// The largest micro-batch to try.
    pub max_micro_batch: usize,
    /// Sequences per optimizer step, if fixed.
    pub global_batch: Option<usize>,
    /// Untimed steps per trial; `None` for the target's default.
    pub warmup_steps: Option<usize>,
    /// Timed steps per trial; `None` for the target's default.
    pub timed_steps: Option<usize>,
    /// Stop after this many search trials.
    pub max_trials: Option<usize>,
    /// See [`SearchSpace::saturation_gain`].
    pub saturation_gain: f64,
    /// Whether the search may also try compact optimizer-state layouts, whose updates are not
    /// exactly AdamW's ([`SearchSpace::compact_layouts`]).
    pub compact_state: bool,
    /// Whether the search may also try fp8 products in the blocks ([`Precision::Fp8`]), on a
    /// target with fp8 tensor cores ([`SearchSpace::fp8_not_searched`]).
    pub fp8: bool,
}

impl Default for SpaceRequest {
    /// The target's default space.
    fn default() -> Self {
        Self {
            precisions: Vec::new(),
            checkpointing: Vec::new(),
            offload: Vec::new(),
            updates: Vec::new(),
            data_parallel: Vec::new(),
            max_micro_batch: SearchSpace::DEFAULT_MAX_MICRO_BATCH,
            global_batch: None,
            warmup_steps: None,
            timed_steps: None,
            max_trials: None,
            saturation_gain: SearchSpace::DEFAULT_SATURATION_GAIN,
            compact_state: false,
            fp8: false,
        }
    }
}

/// The settings a search may try. What the search may assume of the machine and the target
/// is apart, in [`MachineFacts`](super::MachineFacts); [`SearchSetup`](super::SearchSetup)
/// resolves both.
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
    /// Stop exploring after this many search trials and choose among what was measured
    /// (`max_probes` in recorded profiles, its name since their version 1).
    #[serde(default, rename = "max_probes")]
    pub max_trials: Option<usize>,
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
            max_trials: None,
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
            update: Update::AfterBackward,
            state: StateLayout::EXACT,
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

    /// The space a search of `model` on `target` runs: the target's default regimes narrowed
    /// or widened by `request` ([`Self::combine_regimes`]), each followed by its update in
    /// backward where that is exact ([`Self::with_updates`]), at every data-parallel degree
    /// asked for, with the target's trial lengths unless the request sets them. Errors name the
    /// flag to change.
    pub fn for_target(
        target: &DeviceSpec,
        model: &ModelSpec,
        request: &SpaceRequest,
    ) -> Result<Self> {
        let regimes = Self::combine_regimes(
            Self::default_regimes(target.kind),
            &request.precisions,
            &request.checkpointing,
            &request.offload,
        );
        let exact = model.optimizer.grad_clip.is_none() && request.global_batch.is_none();
        let regimes = Self::with_updates(&regimes, &request.updates, exact)?;
        let degrees = Self::data_parallel_degrees(
            &request.data_parallel,
            target.gpu_count,
            request.global_batch,
        )?;
        let mut regimes = Self::with_data_parallel(&regimes, &degrees);
        if request.compact_state {
            regimes.extend(Self::compact_layouts(&regimes));
        }
        if request.fp8 && Self::fp8_not_searched(target).is_none() {
            regimes.extend(Self::fp8_regimes(&regimes));
        }
        // One warm-up step takes a trial's first-use costs out of its timing (the memory pool's
        // first reservation, since every trial starts from a trimmed pool, cuBLAS's heuristics,
        // module loads); three timed steps give a median. The chosen setting's verification
        // times more.
        let (warmup, timed, verify) = match target.kind {
            DeviceKind::Cpu => (1, 3, 5),
            DeviceKind::Cuda => (1, 3, 6),
        };
        let space = Self {
            max_micro_batch: request.max_micro_batch,
            global_batch: request.global_batch,
            warmup_steps: request.warmup_steps.unwrap_or(warmup),
            timed_steps: request.timed_steps.unwrap_or(timed),
            verify_timed_steps: verify,
            max_trials: request.max_trials,
            saturation_gain: request.saturation_gain,
            ..Self::new(regimes)
        };
        space.validate()?;
        space.validate_tokens_per_step(model)?;
        Ok(space)
    }

    /// Why fp8 products are not searched for `target`, if they are not: only a GPU with fp8
    /// tensor cores runs them faster than bf16 (on others they would be emulated).
    pub fn fp8_not_searched(target: &DeviceSpec) -> Option<String> {
        match (target.kind, target.fp8_tensor_cores) {
            (DeviceKind::Cuda, true) => None,
            (DeviceKind::Cpu, _) => Some(format!(
                "fp8 is not searched for `{}`: a CPU has no fp8 tensor cores (it would only \
                 emulate the products, slower than its own precision)",
                target.name
            )),
            (DeviceKind::Cuda, false) => Some(format!(
                "fp8 is not searched for `{}`: its device spec does not say it has fp8 tensor \
                 cores (compute capability 8.9 or newer; add \"fp8_tensor_cores\": true to the \
                 spec if it has)",
                target.name
            )),
        }
    }

    /// Each bf16 regime of `regimes` again with fp8 products, in the same order: searched
    /// after every other regime, so that they are measured against the best of those.
    pub fn fp8_regimes(regimes: &[Regime]) -> Vec<Regime> {
        regimes
            .iter()
            .filter(|r| r.precision == Precision::Bf16)
            .map(|r| Regime {
                precision: Precision::Fp8,
                ..*r
            })
            .collect()
    }

    /// A global batch whose step, of `model`'s sequences, takes no more tokens than a step may
    /// ([`crate::spec::limits::MAX_TOKENS_PER_STEP`]): so that every plan the search can
    /// choose also trains.
    fn validate_tokens_per_step(&self, model: &ModelSpec) -> Result<()> {
        let Some(n) = self.global_batch else {
            return Ok(());
        };
        let max = crate::spec::limits::MAX_TOKENS_PER_STEP;
        let most = max / (model.seq_len.max(1) as u64);
        if (n as u64).saturating_mul(model.seq_len as u64) > max {
            return invalid(
                "global_batch",
                format!(
                    "({n}) makes {} tokens per step at {} tokens a sequence, over the {max} a step may take; use at most {most}",
                    (n as u64).saturating_mul(model.seq_len as u64),
                    model.seq_len
                ),
            );
        }
        Ok(())
    }

    /// The compact-state regimes a search opted into them adds after `regimes`: every
    /// single-GPU bf16 regime that keeps the optimizer on the device, with the bitsandbytes
    /// layout (8-bit block-wise moments, bf16 masters rounded stochastically: 4 bytes per
    /// parameter instead of 16), its moments on the device and, where its update runs in
    /// backward, in host memory (2 bytes per parameter on the device).
    pub fn compact_layouts(regimes: &[Regime]) -> Vec<Regime> {
        let compact = |moments_on| StateLayout {
            moments: MomentFormat::Int8Blockwise,
            masters: MasterFormat::Bf16Stochastic,
            moments_on,
        };
        let mut out = Vec::new();
        for r in regimes.iter().filter(|r| {
            r.precision == Precision::Bf16
                && r.offload == Offload::None
                && r.data_parallel.is_single()
                && r.state.is_exact()
        }) {
            for place in [MomentPlace::Device, MomentPlace::Host] {
                let c = Regime {
                    state: compact(place),
                    ..*r
                };
                let valid = Knobs::with_batch(c, 1, 1).validate("knobs", "").is_ok();
                if valid && !regimes.contains(&c) && !out.contains(&c) {
                    out.push(c);
                }
            }
        }
        out
    }

    /// `regimes` with the updates asked for (`updates`; empty means both): each regime for
    /// which the update in backward is exact is followed by its in-backward twin, which saves
    /// the gradients' memory at the same speed. `exact` says whether the model and the space
    /// allow it at all (no gradient clipping, no fixed global batch that may accumulate).
    pub fn with_updates(
        regimes: &[Regime],
        updates: &[Update],
        exact: bool,
    ) -> Result<Vec<Regime>> {
        let wanted = |u: Update| updates.is_empty() || updates.contains(&u);
        let mut out = Vec::new();
        for r in regimes {
            if wanted(Update::AfterBackward) {
                out.push(*r);
            }
            let twin = Regime {
                update: Update::InBackward,
                ..*r
            };
            let valid = exact
                && Knobs::with_batch(twin, 1, 1)
                    .in_backward_conflict()
                    .is_none();
            if wanted(Update::InBackward) && valid {
                out.push(twin);
            }
        }
        if out.is_empty() {
            return Err(Error::invalid(
                WHAT,
                "--update",
                "in-backward is exact for none of the searched regimes (it needs no gradient \
                 clipping, no --global-batch, no fp16, no offload and one GPU); add \
                 --update after-backward",
            ));
        }
        Ok(out)
    }

    /// The regimes to search: every combination of the given precisions, checkpointing and
    /// offload settings (an empty list means those of `defaults`), the `defaults` that remain
    /// first in their priority order, then the others.
    pub fn combine_regimes(
        defaults: Vec<Regime>,
        precisions: &[Precision],
        checkpointing: &[Checkpointing],
        offload: &[Offload],
    ) -> Vec<Regime> {
        fn or_defaults<T: Copy + PartialEq>(
            given: &[T],
            defaults: impl Iterator<Item = T>,
        ) -> Vec<T> {
            if !given.is_empty() {
                return given.to_vec();
            }
            let mut out = Vec::new();
            for d in defaults {
                if !out.contains(&d) {
                    out.push(d);
                }
            }
            out
        }
        let p = or_defaults(precisions, defaults.iter().map(|r| r.precision));
        let c = or_defaults(checkpointing, defaults.iter().map(|r| r.checkpointing));
        let o = or_defaults(offload, defaults.iter().map(|r| r.offload));
        let wanted = |r: &Regime| {
            p.contains(&r.precision) && c.contains(&r.checkpointing) && o.contains(&r.offload)
        };
        let mut out: Vec<Regime> = defaults.into_iter().filter(wanted).collect();
        for &precision in &p {
            for &checkpointing in &c {
                for &offload in &o {
                    let r = Regime {
                        precision,
                        checkpointing,
                        offload,
                        data_parallel: DataParallel::SINGLE,
                        update: Update::AfterBackward,
                        state: StateLayout::EXACT,
                    };
                    if !out.contains(&r) {
                        out.push(r);
                    }
                }
            }
        }
        out
    }

    /// The data-parallel degrees worth trying on a host with `gpu_count` GPUs, largest (expected
    /// fastest) first: every GPU, then the powers of two below, down to one GPU.
    pub fn default_degrees(gpu_count: usize) -> Vec<usize> {
        let mut degrees = vec![gpu_count.max(1)];
        let mut d = gpu_count.max(1).next_power_of_two();
        while d > 1 {
            d /= 2;
            if d < degrees[0] {
                degrees.push(d);
            }
        }
        degrees
    }

    /// The single-GPU `regimes` at each of `degrees`, in that order: at a degree above 1 every
    /// regime, each regime that keeps the optimizer on the GPU followed by its sharded
    /// variant (ZeRO-1 saves optimizer memory for a little communication). With `[1]` the
    /// regimes come back unchanged.
    pub fn with_data_parallel(regimes: &[Regime], degrees: &[usize]) -> Vec<Regime> {
        let mut out = Vec::new();
        for &degree in degrees {
            // The update in backward runs before the gradients could be summed over GPUs.
            for r in regimes
                .iter()
                .filter(|r| degree == 1 || r.update.is_after_backward())
            {
                let at = |data_parallel| Regime {
                    data_parallel,
                    ..*r
                };
                out.push(at(DataParallel::replicated(degree)));
                if degree > 1 && r.offload == Offload::None {
                    out.push(at(DataParallel {
                        degree,
                        shard_optimizer: true,
                    }));
                }
            }
        }
        out
    }

    /// Checks requested data-parallel `degrees` (empty: [`Self::default_degrees`]) against a
    /// host with `gpu_count` GPUs and against the global batch; errors name the flag to change.
    pub fn data_parallel_degrees(
        requested: &[usize],
        gpu_count: usize,
        global_batch: Option<usize>,
    ) -> Result<Vec<usize>> {
        let degrees = if requested.is_empty() {
            Self::default_degrees(gpu_count)
        } else {
            requested.to_vec()
        };
        let mut seen = HashSet::new();
        for &d in &degrees {
            if d == 0 || d > gpu_count {
                return Err(Error::invalid(
                    WHAT,
                    "--data-parallel",
                    format!(
                        "{d} is not between 1 and the device spec's gpu_count ({gpu_count}); use 1..={gpu_count}, or a profile with more GPUs"
                    ),
                ));
            }
            if !seen.insert(d) {
                return Err(Error::invalid(
                    WHAT,
                    "--data-parallel",
                    format!("{d} is given twice"),
                ));
            }
            if let Some(n) = global_batch.filter(|n| n % d != 0) {
                return Err(Error::invalid(
                    WHAT,
                    "--global-batch",
                    format!(
                        "{n} sequences cannot be split evenly over {d} GPUs; use a multiple of {d}, or drop --data-parallel {d}"
                    ),
                ));
            }
        }
        Ok(degrees)
    }

    /// The least common multiple of the regimes' data-parallel degrees: a micro-batch must
    /// divide `global_batch / lcm` for every regime to reach the global batch with a whole
    /// accumulation count.
    fn degree_lcm(&self) -> usize {
        fn gcd(a: usize, b: usize) -> usize {
            if b == 0 {
                a
            } else {
                gcd(b, a % b)
            }
        }
        self.regimes
            .iter()
            .map(|r| r.data_parallel.degree.max(1))
            .fold(1, |l, d| l / gcd(l, d) * d)
    }

    /// Checks the space can be searched; errors name the field.
    pub fn validate(&self) -> Result<()> {
        self.validate_regimes()?;
        self.validate_bounds()?;
        self.validate_batches()?;
        if self.timed_steps == 0 || self.verify_timed_steps == 0 {
            return invalid(
                "timed_steps",
                "timed_steps and verify_timed_steps must be at least 1".into(),
            );
        }
        if self.max_trials == Some(0) {
            return invalid("max_probes", "must be at least 1".into());
        }
        Ok(())
    }

    /// At least one regime, none twice, each valid knobs on its own.
    fn validate_regimes(&self) -> Result<()> {
        if self.regimes.is_empty() {
            return invalid("regimes", "must list at least one regime".into());
        }
        let mut seen = HashSet::new();
        for (i, regime) in self.regimes.iter().enumerate() {
            if !seen.insert(*regime) {
                return invalid(
                    &format!("regimes[{i}]"),
                    format!("({regime}) is listed twice"),
                );
            }
            Knobs::with_batch(*regime, 1, 1).validate(WHAT, &format!("regimes[{i}]."))?;
        }
        Ok(())
    }

    /// Every size and count within its bound, so that the candidates (up to `max_micro_batch`
    /// of them) stay a small list and trials a bounded length; the saturation gain a fraction.
    fn validate_bounds(&self) -> Result<()> {
        if self.max_micro_batch == 0 {
            return invalid("max_micro_batch", "must be at least 1".into());
        }
        let steps = crate::trial::MAX_TRIAL_STEPS;
        let bounds = [
            (
                "max_micro_batch",
                self.max_micro_batch,
                crate::knobs::MAX_MICRO_BATCH,
            ),
            (
                "global_batch",
                self.global_batch.unwrap_or(0),
                crate::spec::limits::MAX_GLOBAL_BATCH,
            ),
            ("warmup_steps", self.warmup_steps, steps),
            ("timed_steps", self.timed_steps, steps),
            ("verify_timed_steps", self.verify_timed_steps, steps),
        ];
        for (field, value, max) in bounds {
            if value > max {
                return invalid(field, format!("({value}) must be at most {max}"));
            }
        }
        if !(self.saturation_gain.is_finite() && self.saturation_gain >= 0.0) {
            return invalid(
                "saturation_gain",
                format!("({}) must be a fraction, at least 0", self.saturation_gain),
            );
        }
        Ok(())
    }

    /// The first micro-batch within the range, and a global batch that every regime's degree
    /// divides and that leaves a candidate at or above the first micro-batch.
    fn validate_batches(&self) -> Result<()> {
        if !(1..=self.max_micro_batch).contains(&self.start_micro_batch) {
            return invalid(
                "start_micro_batch",
                format!(
                    "must be between 1 and max_micro_batch ({})",
                    self.max_micro_batch
                ),
            );
        }
        let Some(n) = self.global_batch else {
            return Ok(());
        };
        if n == 0 {
            return invalid("global_batch", "must be at least 1".into());
        }
        if let Some((i, r)) = self
            .regimes
            .iter()
            .enumerate()
            .find(|(_, r)| n % r.data_parallel.degree.max(1) != 0)
        {
            return invalid(
                "global_batch",
                format!(
                    "({n}) is not divisible by regimes[{i}]'s data-parallel degree {}",
                    r.data_parallel.degree
                ),
            );
        }
        if self
            .candidates()
            .iter()
            .all(|&b| b < self.start_micro_batch)
        {
            return invalid(
                "start_micro_batch",
                format!(
                    "({}) is above every divisor of global_batch ({n})",
                    self.start_micro_batch
                ),
            );
        }
        Ok(())
    }

    /// The micro-batches that may be tried, ascending: the divisors of the global batch up to
    /// `max_micro_batch`, or every size from 1 to `max_micro_batch`. With data-parallel regimes
    /// the global batch is first divided by the degrees' least common multiple, so that every
    /// candidate splits evenly in every regime (on one GPU that divisor is 1).
    pub fn candidates(&self) -> Vec<usize> {
        let per_rank = self.global_batch.map(|n| n / self.degree_lcm());
        let top = match per_rank {
            Some(n) => n.min(self.max_micro_batch),
            None => self.max_micro_batch,
        };
        (1..=top)
            .filter(|b| per_rank.is_none_or(|n| n % b == 0))
            .collect()
    }

    /// The space without the regimes whose training state alone, at one sequence, cannot fit
    /// `budget` (the device's usable bytes, or the host's), and those regimes: no trial of
    /// theirs could fit, so none is run. The state's bytes are exact by layout
    /// ([`crate::spec::state::StateBytes`]); activations only add to them. When no regime would
    /// remain the space is left whole, so that the search still reports that nothing fits.
    pub fn without_oversized_state(
        mut self,
        model: &ModelSpec,
        budget: &crate::spec::budget::Budget,
    ) -> (Self, Vec<Regime>) {
        let gpu = budget.usable_gpu_bytes();
        let host = budget.usable_host_bytes();
        let too_big = |r: &Regime| {
            let state = crate::spec::state::StateBytes::of(model, &Knobs::with_batch(*r, 1, 1));
            let device = state.device.total();
            match gpu {
                Some(gpu) => device > gpu || state.host.total() > host,
                None => device + state.host.total() > host,
            }
        };
        let (dropped, kept): (Vec<Regime>, Vec<Regime>) =
            self.regimes.iter().partition(|r| too_big(r));
        if kept.is_empty() || dropped.is_empty() {
            return (self, Vec::new());
        }
        self.regimes = kept;
        (self, dropped)
    }

    /// Micro-batches accumulated per optimizer step at `micro_batch`: `global_batch /
    /// micro_batch`, or 1 without a global batch.
    pub fn grad_accum_for(&self, micro_batch: usize) -> usize {
        self.global_batch.map_or(1, |n| n / micro_batch.max(1))
    }

    /// The knobs a plan runs: `regime` at `micro_batch` with the real accumulation (per GPU:
    /// micro-batch × accumulation × degree is the global batch).
    pub fn plan_knobs(&self, regime: Regime, micro_batch: usize) -> Knobs {
        let degree = regime.data_parallel.degree.max(1);
        let accum = self
            .global_batch
            .map_or(1, |n| n / (micro_batch.max(1) * degree));
        Knobs::with_batch(regime, micro_batch, accum.max(1))
    }

    /// A search trial: `regime` at `micro_batch` without accumulation (memory and speed per
    /// micro-batch do not depend on it, and the trial is `grad_accum` times shorter).
    pub fn search_request(&self, regime: Regime, micro_batch: usize) -> TrialRequest {
        TrialRequest {
            knobs: Knobs::with_batch(regime, micro_batch, 1),
            warmup_steps: self.warmup_steps,
            timed_steps: self.timed_steps,
            remeasure: false,
        }
    }

    /// The verification trial of `knobs`, exactly as a plan would run them.
    pub fn verify_request(&self, knobs: Knobs) -> TrialRequest {
        TrialRequest {
            knobs,
            warmup_steps: self.warmup_steps,
            timed_steps: self.verify_timed_steps,
            remeasure: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::model::OptimizerSpec;

    fn r(precision: Precision, checkpointing: Checkpointing, offload: Offload) -> Regime {
        Regime {
            precision,
            checkpointing,
            offload,
            data_parallel: DataParallel::SINGLE,
            update: Update::AfterBackward,
            state: Default::default(),
        }
    }

    /// `regime` updating in backward.
    fn in_backward(regime: Regime) -> Regime {
        Regime {
            update: Update::InBackward,
            ..regime
        }
    }

    /// The GPU's default regimes, each that can update in backward followed by that twin.
    fn gpu_defaults_with_updates() -> Vec<Regime> {
        let d = gpu_defaults();
        vec![d[0], in_backward(d[0]), d[1], in_backward(d[1]), d[2], d[3]]
    }

    fn gpu_defaults() -> Vec<Regime> {
        SearchSpace::default_regimes(DeviceKind::Cuda)
    }

    #[test]
    fn empty_filters_keep_the_default_space() {
        assert_eq!(
            SearchSpace::combine_regimes(gpu_defaults(), &[], &[], &[]),
            gpu_defaults()
        );
    }

    #[test]
    fn filters_narrow_the_default_space_in_its_order() {
        let plain = SearchSpace::combine_regimes(
            gpu_defaults(),
            &[],
            &[Checkpointing::None],
            &[Offload::None],
        );
        assert_eq!(plain, vec![gpu_defaults()[0]]);
        let no_offload = SearchSpace::combine_regimes(gpu_defaults(), &[], &[], &[Offload::None]);
        assert_eq!(no_offload, gpu_defaults()[..2].to_vec());
    }

    #[test]
    fn new_values_combine_with_the_others_after_the_defaults() {
        let got = SearchSpace::combine_regimes(
            gpu_defaults(),
            &[Precision::Bf16, Precision::Fp16],
            &[Checkpointing::None, Checkpointing::EveryKth(2)],
            &[Offload::None],
        );
        assert_eq!(
            got,
            vec![
                gpu_defaults()[0],
                r(Precision::Bf16, Checkpointing::EveryKth(2), Offload::None),
                r(Precision::Fp16, Checkpointing::None, Offload::None),
                r(Precision::Fp16, Checkpointing::EveryKth(2), Offload::None),
            ]
        );
    }

    #[test]
    fn a_target_space_takes_the_targets_trial_lengths_unless_asked() {
        let gpu = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let model = ModelSpec::tiny();
        let space = SearchSpace::for_target(&gpu, &model, &SpaceRequest::default()).unwrap();
        assert_eq!(space.regimes, gpu_defaults_with_updates());
        assert_eq!(
            (
                space.warmup_steps,
                space.timed_steps,
                space.verify_timed_steps
            ),
            (1, 3, 6)
        );
        let asked = SpaceRequest {
            timed_steps: Some(7),
            offload: vec![Offload::None],
            updates: vec![Update::AfterBackward],
            ..SpaceRequest::default()
        };
        let space = SearchSpace::for_target(&gpu, &model, &asked).unwrap();
        assert_eq!((space.warmup_steps, space.timed_steps), (1, 7));
        assert_eq!(space.regimes, gpu_defaults()[..2].to_vec());
        let cpu = DeviceSpec::builtin("cpu").unwrap();
        let space = SearchSpace::for_target(&cpu, &model, &SpaceRequest::default()).unwrap();
        assert_eq!(
            (
                space.warmup_steps,
                space.timed_steps,
                space.verify_timed_steps
            ),
            (1, 3, 5)
        );
    }

    /// The update in backward is searched only where it is exactly the normal step.
    #[test]
    fn fp8_is_searched_only_when_asked_on_a_target_with_fp8_tensor_cores() {
        let model = ModelSpec::tiny();
        let gpu = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let asked = SpaceRequest {
            fp8: true,
            ..SpaceRequest::default()
        };
        let regimes = |target: &DeviceSpec, request: &SpaceRequest| {
            SearchSpace::for_target(target, &model, request)
                .unwrap()
                .regimes
        };
        let plain = regimes(&gpu, &SpaceRequest::default());
        let with = regimes(&gpu, &asked);
        // Every regime as before, first; then each bf16 one again with fp8 products.
        assert_eq!(with[..plain.len()], plain[..]);
        let expected: Vec<Regime> = plain
            .iter()
            .filter(|r| r.precision == Precision::Bf16)
            .map(|r| Regime {
                precision: Precision::Fp8,
                ..*r
            })
            .collect();
        assert!(!expected.is_empty());
        assert_eq!(with[plain.len()..], expected[..]);
        assert!(SearchSpace::fp8_not_searched(&gpu).is_none());
        // A GPU without fp8 tensor cores, and a CPU: not searched, and why.
        let ampere = DeviceSpec {
            name: "rtx3090".into(),
            fp8_tensor_cores: false,
            ..gpu.clone()
        };
        assert_eq!(regimes(&ampere, &asked), plain);
        let why = SearchSpace::fp8_not_searched(&ampere).unwrap();
        assert!(
            why.contains("rtx3090") && why.contains("fp8_tensor_cores"),
            "{why}"
        );
        let cpu = DeviceSpec::builtin("cpu").unwrap();
        assert_eq!(
            regimes(&cpu, &asked),
            regimes(&cpu, &SpaceRequest::default())
        );
        assert!(SearchSpace::fp8_not_searched(&cpu).unwrap().contains("CPU"));
        // fp8 with compact state keeps bf16 masters (fp8 computes in bf16 elsewhere).
        let compact = SpaceRequest {
            compact_state: true,
            ..asked
        };
        let both = regimes(&gpu, &compact);
        assert!(both
            .iter()
            .any(|r| r.precision == Precision::Fp8 && !r.state.is_exact()));
        for r in both {
            Knobs::with_batch(r, 1, 1).validate("knobs", "").unwrap();
        }
    }

    #[test]
    fn the_update_in_backward_is_searched_only_where_exact() {
        let gpu = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let model = ModelSpec::tiny();
        let plain = gpu_defaults()[0];
        let only = |updates: Vec<Update>| SpaceRequest {
            checkpointing: vec![Checkpointing::None],
            offload: vec![Offload::None],
            updates,
            ..SpaceRequest::default()
        };
        let regimes = |model: &ModelSpec, request: &SpaceRequest| {
            SearchSpace::for_target(&gpu, model, request).map(|s| s.regimes)
        };
        // (model, request, expected regimes; None: refused naming --update)
        let clipped = ModelSpec {
            optimizer: OptimizerSpec {
                grad_clip: Some(1.0),
                ..model.optimizer
            },
            ..model.clone()
        };
        let fixed_batch = SpaceRequest {
            global_batch: Some(64),
            ..only(vec![])
        };
        let fp16 = SpaceRequest {
            precisions: vec![Precision::Fp16],
            ..only(vec![])
        };
        let fp16_plain = Regime {
            precision: Precision::Fp16,
            ..plain
        };
        let table: Vec<(&ModelSpec, SpaceRequest, Option<Vec<Regime>>)> = vec![
            (&model, only(vec![]), Some(vec![plain, in_backward(plain)])),
            (
                &model,
                only(vec![Update::InBackward]),
                Some(vec![in_backward(plain)]),
            ),
            (&model, only(vec![Update::AfterBackward]), Some(vec![plain])),
            (&clipped, only(vec![]), Some(vec![plain])),
            (&clipped, only(vec![Update::InBackward]), None),
            (&model, fixed_batch, Some(vec![plain])),
            (&model, fp16, Some(vec![fp16_plain])),
        ];
        for (model, request, expected) in table {
            match (regimes(model, &request), expected) {
                (Ok(got), Some(want)) => assert_eq!(got, want, "{request:?}"),
                (Err(Error::InvalidSpec { field, .. }), None) => assert_eq!(field, "--update"),
                (got, want) => panic!("{request:?}: got {got:?}, expected {want:?}"),
            }
        }
        // Offloaded regimes never update in backward, and neither do data-parallel ones.
        let offload = SearchSpace::for_target(
            &gpu,
            &model,
            &SpaceRequest {
                offload: vec![Offload::Optimizer],
                ..SpaceRequest::default()
            },
        )
        .unwrap();
        assert!(offload.regimes.iter().all(|r| r.update.is_after_backward()));
        let two = SearchSpace::with_data_parallel(&gpu_defaults_with_updates(), &[2, 1]);
        assert!(two
            .iter()
            .all(|r| r.data_parallel.degree == 1 || r.update.is_after_backward()));
        assert!(two.iter().any(|r| !r.update.is_after_backward()));
    }

    #[test]
    fn a_target_space_refuses_more_gpus_than_the_target_has() {
        let gpu = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let asked = SpaceRequest {
            data_parallel: vec![2],
            ..SpaceRequest::default()
        };
        match SearchSpace::for_target(&gpu, &ModelSpec::tiny(), &asked) {
            Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, "--data-parallel"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

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
                max_trials: Some(0),
                ..space()
            }),
            "max_probes"
        );
        for (huge, expected) in [
            (
                SearchSpace {
                    max_micro_batch: 1 << 30,
                    ..space()
                },
                "max_micro_batch",
            ),
            (
                SearchSpace {
                    global_batch: Some(usize::MAX),
                    ..space()
                },
                "global_batch",
            ),
            (
                SearchSpace {
                    timed_steps: usize::MAX,
                    ..space()
                },
                "timed_steps",
            ),
            (
                SearchSpace {
                    saturation_gain: f64::NAN,
                    ..space()
                },
                "saturation_gain",
            ),
        ] {
            assert_eq!(field(huge), expected);
        }
    }

    #[test]
    fn one_gpu_keeps_the_regimes_and_several_add_degrees_and_sharding() {
        assert_eq!(SearchSpace::default_degrees(1), vec![1]);
        assert_eq!(SearchSpace::default_degrees(8), vec![8, 4, 2, 1]);
        assert_eq!(SearchSpace::default_degrees(6), vec![6, 4, 2, 1]);
        let base = SearchSpace::default_regimes(DeviceKind::Cuda);
        assert_eq!(SearchSpace::with_data_parallel(&base, &[1]), base);
        let dp = SearchSpace::with_data_parallel(&base, &[2, 1]);
        // Two regimes keep the optimizer on the GPU and gain a sharded variant at degree 2.
        assert_eq!(dp.len(), base.len() + 2 + base.len());
        assert_eq!(dp[0].data_parallel, DataParallel::replicated(2));
        assert!(dp[1].data_parallel.shard_optimizer);
        assert_eq!(&dp[dp.len() - base.len()..], &base[..]);
        SearchSpace::new(dp).validate().unwrap();
    }

    #[test]
    fn data_parallel_batches_split_the_global_batch_per_gpu() {
        let base = SearchSpace::default_regimes(DeviceKind::Cuda);
        let s = SearchSpace {
            global_batch: Some(48),
            ..SearchSpace::new(SearchSpace::with_data_parallel(&base[..1], &[4, 1]))
        };
        // Every candidate divides 48 / 4, so both degrees reach 48 with whole accumulations.
        assert_eq!(s.candidates(), vec![1, 2, 3, 4, 6, 12]);
        let four = s.plan_knobs(s.regimes[0], 3);
        assert_eq!((four.grad_accum, four.global_batch()), (4, 48));
        let one = s.plan_knobs(*s.regimes.last().unwrap(), 3);
        assert_eq!((one.grad_accum, one.global_batch()), (16, 48));
        let odd = SearchSpace {
            global_batch: Some(6),
            ..s.clone()
        };
        assert!(odd.validate().is_err());
    }

    #[test]
    fn data_parallel_degrees_are_checked_against_the_profile_and_the_global_batch() {
        let field = |r: Result<Vec<usize>>| match r {
            Err(Error::InvalidSpec { field, problem, .. }) => (field, problem),
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(
            SearchSpace::data_parallel_degrees(&[], 4, None).unwrap(),
            vec![4, 2, 1]
        );
        let (f, problem) = field(SearchSpace::data_parallel_degrees(&[8], 4, None));
        assert_eq!(f, "--data-parallel");
        assert!(problem.contains("gpu_count (4)"), "{problem}");
        let (f, problem) = field(SearchSpace::data_parallel_degrees(&[4], 4, Some(6)));
        assert_eq!(f, "--global-batch");
        assert!(problem.contains("multiple of 4"), "{problem}");
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
