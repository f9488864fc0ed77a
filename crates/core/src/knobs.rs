//! The settings a plan chooses: micro-batch, accumulation, precision, checkpointing, offload,
//! and data parallelism over several GPUs.
//!
//! [`Knobs`] is one point of the search space. [`Regime`] is a point with the batch sizes
//! removed: memory and step time are modelled per regime as functions of the micro-batch.
//! Micro-batch and accumulation are per GPU; [`DataParallel`] says how many GPUs run them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod strategy;

pub use strategy::{StrategyConflict, UpdateStrategy};

/// The largest micro-batch, in sequences: far above what any device holds, and small enough
/// that every count formed from it stays inside 64 bits.
pub const MAX_MICRO_BATCH: usize = 1 << 20;
/// The most micro-batches accumulated per optimizer step.
pub const MAX_GRAD_ACCUM: usize = 1 << 20;
/// The most data-parallel ranks (GPUs of one host, or processes a plan is exported for).
pub const MAX_DATA_PARALLEL: usize = 1 << 12;

/// Arithmetic precision of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    Fp32,
    /// f32 master weights and optimizer; forward and backward in bf16.
    Bf16,
    /// f32 master weights and optimizer; forward and backward in f16 with dynamic loss scaling.
    Fp16,
    /// As [`Precision::Bf16`], with the Transformer blocks' matrix products in fp8: E4M3
    /// weights and activations, E5M2 output gradients, each at a per-tensor scale from the
    /// largest magnitudes of its last conversions (delayed scaling), f32 accumulation. Masters, norms, attention, the head and the loss stay as in bf16. Needs
    /// fp8 tensor cores (Ada, Hopper); searched only when asked (`--allow-fp8`).
    Fp8,
}

impl Precision {
    /// All precisions, fastest-first on tensor-core GPUs.
    pub const ALL: [Precision; 4] = [
        Precision::Fp8,
        Precision::Bf16,
        Precision::Fp16,
        Precision::Fp32,
    ];

    /// The precision of everything but the blocks' matrix products: bf16 for fp8.
    pub fn compute(self) -> Precision {
        match self {
            Precision::Fp8 => Precision::Bf16,
            p => p,
        }
    }

    /// How an fp8 step differs from bf16's, for a plan's readers; `None` for the others.
    pub fn note(self) -> Option<&'static str> {
        (self == Precision::Fp8).then_some(
            "as bf16, with the Transformer blocks' matrix products in fp8: weights and \
             activations in E4M3, output gradients in E5M2, each scaled per tensor from the \
             largest magnitude of its last 16 conversions (delayed scaling; the first scales \
             itself), accumulated in f32; masters, norms, attention, the head and the \
             loss as in bf16. The loss differs from bf16's, by under 2 % over 300 steps of a \
             small model in the CPU's emulation",
        )
    }

    /// Whether the step needs dynamic loss scaling (f16's narrow exponent range).
    pub fn needs_loss_scaling(self) -> bool {
        self == Precision::Fp16
    }

    /// The lowercase name used in JSON and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::Fp16),
            "fp8" => Ok(Precision::Fp8),
            _ => Err(format!(
                "unknown precision `{s}`; expected fp32, bf16, fp16 or fp8"
            )),
        }
    }
}

/// Activation checkpointing: which Transformer blocks keep only their input and recompute in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(
    rename_all = "snake_case",
    tag = "mode",
    content = "k",
    deny_unknown_fields
)]
pub enum Checkpointing {
    /// Keep every activation.
    None,
    /// Recompute every k-th block (k = 1 recomputes all blocks).
    EveryKth(u32),
}

impl Checkpointing {
    /// Whether block `index` (0-based) is recomputed in backward.
    pub fn recomputes(self, index: usize) -> bool {
        match self {
            Checkpointing::None => false,
            Checkpointing::EveryKth(0) => false,
            Checkpointing::EveryKth(k) => index % k as usize == 0,
        }
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::None => f.write_str("none"),
            Checkpointing::EveryKth(1) => f.write_str("all"),
            Checkpointing::EveryKth(k) => write!(f, "every-{k}"),
        }
    }
}

impl FromStr for Checkpointing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || format!("unknown checkpointing `{s}`; expected none, all or every-K (K ≥ 1)");
        match s {
            "none" => Ok(Checkpointing::None),
            "all" => Ok(Checkpointing::EveryKth(1)),
            _ => {
                let k: u32 = s
                    .strip_prefix("every-")
                    .ok_or_else(err)?
                    .parse()
                    .map_err(|_| err())?;
                if k == 0 {
                    return Err(err());
                }
                Ok(Checkpointing::EveryKth(k))
            }
        }
    }
}

/// Where optimizer state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Offload {
    /// Master weights and optimizer moments on the training device.
    None,
    /// f32 master weights and Adam moments in host memory; the update runs on the CPU.
    Optimizer,
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
        })
    }
}

impl FromStr for Offload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Offload::None),
            "optimizer" | "cpu" => Ok(Offload::Optimizer),
            _ => Err(format!("unknown offload `{s}`; expected none or optimizer")),
        }
    }
}

/// When the optimizer updates the weights.
///
/// `InBackward` applies each parameter's update as soon as its gradient is complete (after the
/// backward pass of the block that owns it) and frees the gradient, so the gradients of the
/// whole model never exist at once: 4 bytes per parameter less at the peak. That is exactly the
/// normal step only when nothing needs every gradient before the first update: no global-norm
/// clipping, no fp16 overflow check, no accumulation, no sum over data-parallel ranks, and the
/// optimizer on the device; [`Knobs::validate`] refuses the rest.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Update {
    /// One update of every parameter after the backward pass (all gradients held).
    #[default]
    AfterBackward,
    /// Each block's parameters updated as soon as its backward pass is done.
    InBackward,
}

impl Update {
    /// Whether this is the normal step (JSON omits it then).
    pub fn is_after_backward(&self) -> bool {
        *self == Update::AfterBackward
    }
}

impl fmt::Display for Update {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Update::AfterBackward => "after-backward",
            Update::InBackward => "in-backward",
        })
    }
}

impl FromStr for Update {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "after-backward" => Ok(Update::AfterBackward),
            "in-backward" => Ok(Update::InBackward),
            _ => Err(format!(
                "unknown update `{s}`; expected after-backward or in-backward"
            )),
        }
    }
}

/// How Adam's first and second moments are stored.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum MomentFormat {
    /// f32, exact: 8 bytes per parameter.
    #[default]
    F32,
    /// bf16 (rounded to nearest): 4 bytes per parameter.
    Bf16,
    /// 8-bit codes of a dynamic quantile map, one f32 scale per block of
    /// [`INT8_BLOCK`] elements and moment (the bitsandbytes block-wise scheme): 2 bytes per
    /// parameter plus 8 per block.
    Int8Blockwise,
}

/// Elements per block of [`MomentFormat::Int8Blockwise`]: each block's moments are scaled by
/// their own largest magnitude, so one outlier coarsens only its block.
pub const INT8_BLOCK: usize = 2048;

/// How the master weights (the values the optimizer updates) are stored.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum MasterFormat {
    /// f32 masters beside the half-precision working copies: exact mixed precision.
    #[default]
    F32,
    /// bf16 masters (the working copies themselves) with a bf16 Kahan compensation term that
    /// carries what each rounding lost into the next update: 4 bytes per parameter.
    Bf16Kahan,
    /// bf16 masters rounded stochastically, so that small updates survive on average:
    /// 2 bytes per parameter.
    Bf16Stochastic,
}

impl MasterFormat {
    /// Whether the masters are the bf16 working copies.
    pub fn is_half(self) -> bool {
        self != MasterFormat::F32
    }
}

/// Where the optimizer's moments live between updates.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum MomentPlace {
    /// In device memory.
    #[default]
    Device,
    /// In page-locked host memory: each part's moments are copied to the device for its
    /// update and back, so the device holds one part's at a time.
    Host,
}

/// The layout of the optimizer state: exact f32 AdamW (the default), or a compact one the
/// search explores only when asked to (`--allow-compact-state`).
///
/// Vectors (norm weights, biases) always keep exact f32 state: they are a tiny share of the
/// parameters, and bitsandbytes leaves small tensors in 32 bits for the same reason.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(deny_unknown_fields)]
pub struct StateLayout {
    /// Moments' storage.
    #[serde(default)]
    pub moments: MomentFormat,
    /// Masters' storage.
    #[serde(default)]
    pub masters: MasterFormat,
    /// Where the moments live.
    #[serde(default)]
    pub moments_on: MomentPlace,
}

impl StateLayout {
    /// Exact mixed-precision AdamW, moments on the device.
    pub const EXACT: StateLayout = StateLayout {
        moments: MomentFormat::F32,
        masters: MasterFormat::F32,
        moments_on: MomentPlace::Device,
    };

    /// Whether this is the exact layout on the device (JSON omits it then).
    pub fn is_exact(&self) -> bool {
        *self == Self::EXACT
    }

    /// Whether the arithmetic differs from exact AdamW (placement alone changes nothing).
    pub fn is_compact(&self) -> bool {
        self.moments != MomentFormat::F32 || self.masters != MasterFormat::F32
    }

    /// How this layout's updates differ from exact AdamW's, for a plan's reader; `None` when
    /// they do not.
    pub fn difference(&self) -> Option<String> {
        if !self.is_compact() {
            return None;
        }
        let mut parts = Vec::new();
        match self.moments {
            MomentFormat::F32 => {}
            MomentFormat::Bf16 => parts.push(
                "the moments are rounded to bf16 after each update (8 significant bits)"
                    .to_string(),
            ),
            MomentFormat::Int8Blockwise => parts.push(format!(
                "the moments are stored as 8-bit codes of a dynamic quantile map with one scale per {INT8_BLOCK} elements (bitsandbytes' block-wise scheme)"
            )),
        }
        match self.masters {
            MasterFormat::F32 => {}
            MasterFormat::Bf16Kahan => parts.push(
                "the weights are kept in bf16 with a bf16 Kahan compensation instead of f32 masters"
                    .to_string(),
            ),
            MasterFormat::Bf16Stochastic => parts.push(
                "the weights are kept in bf16, rounded stochastically, instead of f32 masters"
                    .to_string(),
            ),
        }
        Some(format!(
            "not exact AdamW: {}; vectors (norms, biases) keep exact f32 state",
            parts.join("; ")
        ))
    }
}

impl fmt::Display for StateLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let moments = match self.moments {
            MomentFormat::F32 => "f32",
            MomentFormat::Bf16 => "bf16",
            MomentFormat::Int8Blockwise => "int8",
        };
        let masters = match self.masters {
            MasterFormat::F32 => "f32",
            MasterFormat::Bf16Kahan => "bf16-kahan",
            MasterFormat::Bf16Stochastic => "bf16-sr",
        };
        write!(f, "moments={moments} masters={masters}")?;
        if self.moments_on == MomentPlace::Host {
            f.write_str(" moments-on=host")?;
        }
        Ok(())
    }
}

impl FromStr for MomentFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(MomentFormat::F32),
            "bf16" => Ok(MomentFormat::Bf16),
            "int8" | "int8-blockwise" => Ok(MomentFormat::Int8Blockwise),
            _ => Err(format!(
                "unknown moment format `{s}`; expected f32, bf16 or int8"
            )),
        }
    }
}

impl FromStr for MasterFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(MasterFormat::F32),
            "bf16-kahan" => Ok(MasterFormat::Bf16Kahan),
            "bf16-sr" | "bf16-stochastic" => Ok(MasterFormat::Bf16Stochastic),
            _ => Err(format!(
                "unknown master format `{s}`; expected f32, bf16-kahan or bf16-sr"
            )),
        }
    }
}

impl FromStr for MomentPlace {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "device" | "gpu" => Ok(MomentPlace::Device),
            "host" => Ok(MomentPlace::Host),
            _ => Err(format!(
                "unknown moment place `{s}`; expected device or host"
            )),
        }
    }
}

/// Data parallelism: how many GPUs of one host (one process each) train on distinct slices of
/// every optimizer step's batch, and whether they split the optimizer state between them.
///
/// In JSON it is absent from knobs and regimes that train on one GPU, so single-GPU documents
/// read and write exactly as before; otherwise `{"degree": N, "shard_optimizer": bool}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataParallel {
    /// GPUs (ranks) per step; 1 = no data parallelism.
    pub degree: usize,
    /// ZeRO stage 1: each rank keeps the Adam moments of its share of the parameters only,
    /// updates that share, and the updated weights are broadcast to the other ranks.
    #[serde(default)]
    pub shard_optimizer: bool,
}

impl DataParallel {
    /// One GPU, nothing shared.
    pub const SINGLE: DataParallel = DataParallel {
        degree: 1,
        shard_optimizer: false,
    };

    /// `degree` ranks without sharding.
    pub fn replicated(degree: usize) -> Self {
        Self {
            degree,
            shard_optimizer: false,
        }
    }

    /// Whether this is one GPU without sharding (the JSON omits it then).
    pub fn is_single(&self) -> bool {
        *self == Self::SINGLE
    }
}

impl Default for DataParallel {
    fn default() -> Self {
        Self::SINGLE
    }
}

impl fmt::Display for DataParallel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={}", self.degree)?;
        if self.shard_optimizer {
            f.write_str(" zero1")?;
        }
        Ok(())
    }
}

/// The batch-independent part of a plan: memory and time are modelled per regime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Regime {
    /// Arithmetic precision.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Optimizer placement.
    pub offload: Offload,
    /// GPUs per step and optimizer sharding.
    #[serde(default, skip_serializing_if = "DataParallel::is_single")]
    pub data_parallel: DataParallel,
    /// When the optimizer updates; absent in JSON for the normal step after backward.
    #[serde(default, skip_serializing_if = "Update::is_after_backward")]
    pub update: Update,
    /// The optimizer state's layout; absent in JSON for exact AdamW on the device.
    #[serde(default, skip_serializing_if = "StateLayout::is_exact")]
    pub state: StateLayout,
}

impl Regime {
    /// Whether the regime saves memory beside the plain step (checkpointing, offload, sharding,
    /// or the update in backward).
    pub fn saves_memory(&self) -> bool {
        self.checkpointing != Checkpointing::None
            || self.offload != Offload::None
            || self.data_parallel.shard_optimizer
            || self.update == Update::InBackward
            || !self.state.is_exact()
    }
}

impl fmt::Display for Regime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ckpt={} offload={}",
            self.precision, self.checkpointing, self.offload
        )?;
        if !self.data_parallel.is_single() {
            write!(f, " {}", self.data_parallel)?;
        }
        if !self.update.is_after_backward() {
            write!(f, " update={}", self.update)?;
        }
        if !self.state.is_exact() {
            write!(f, " {}", self.state)?;
        }
        Ok(())
    }
}

/// One training configuration: everything a step needs besides the model and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Knobs {
    /// Sequences per forward/backward pass.
    pub micro_batch: usize,
    /// Micro-batches whose gradients are summed before one optimizer step.
    pub grad_accum: usize,
    /// Arithmetic precision.
    pub precision: Precision,
    /// Activation checkpointing.
    #[serde(default = "no_checkpointing")]
    pub checkpointing: Checkpointing,
    /// Optimizer placement.
    #[serde(default = "no_offload")]
    pub offload: Offload,
    /// GPUs per step and optimizer sharding; micro-batch and accumulation are per GPU.
    #[serde(default, skip_serializing_if = "DataParallel::is_single")]
    pub data_parallel: DataParallel,
    /// When the optimizer updates; absent in JSON for the normal step after backward.
    #[serde(default, skip_serializing_if = "Update::is_after_backward")]
    pub update: Update,
    /// The optimizer state's layout; absent in JSON for exact AdamW on the device.
    #[serde(default, skip_serializing_if = "StateLayout::is_exact")]
    pub state: StateLayout,
}

fn no_checkpointing() -> Checkpointing {
    Checkpointing::None
}

fn no_offload() -> Offload {
    Offload::None
}

impl Knobs {
    /// Plain knobs: no accumulation, no checkpointing, no offload.
    pub fn new(micro_batch: usize, precision: Precision) -> Self {
        Self {
            micro_batch,
            grad_accum: 1,
            precision,
            checkpointing: Checkpointing::None,
            offload: Offload::None,
            data_parallel: DataParallel::SINGLE,
            update: Update::AfterBackward,
            state: StateLayout::EXACT,
        }
    }

    /// Sequences per optimizer step over all GPUs: micro-batch × accumulation × degree
    /// (saturating for knobs that [`Knobs::validate`] refuses).
    pub fn global_batch(&self) -> usize {
        self.per_rank_batch()
            .saturating_mul(self.data_parallel.degree)
    }

    /// Sequences one GPU (rank) runs per optimizer step: micro-batch × accumulation.
    pub fn per_rank_batch(&self) -> usize {
        self.micro_batch.saturating_mul(self.grad_accum)
    }

    /// The batch-independent part.
    pub fn regime(&self) -> Regime {
        Regime {
            precision: self.precision,
            checkpointing: self.checkpointing,
            offload: self.offload,
            data_parallel: self.data_parallel,
            update: self.update,
            state: self.state,
        }
    }

    /// The same regime at another micro-batch and accumulation.
    pub fn with_batch(regime: Regime, micro_batch: usize, grad_accum: usize) -> Self {
        Self {
            micro_batch,
            grad_accum,
            precision: regime.precision,
            checkpointing: regime.checkpointing,
            offload: regime.offload,
            data_parallel: regime.data_parallel,
            update: regime.update,
            state: regime.state,
        }
    }

    /// Checks the knobs on their own; `field_prefix` names where they came from in error messages.
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> crate::Result<()> {
        for (field, value, max) in [
            ("micro_batch", self.micro_batch, MAX_MICRO_BATCH),
            ("grad_accum", self.grad_accum, MAX_GRAD_ACCUM),
            (
                "data_parallel.degree",
                self.data_parallel.degree,
                MAX_DATA_PARALLEL,
            ),
        ] {
            if value > max {
                return Err(crate::Error::invalid(
                    what,
                    format!("{field_prefix}{field}"),
                    format!("({value}) must be at most {max}"),
                ));
            }
        }
        if self.micro_batch == 0 {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}micro_batch"),
                "must be at least 1",
            ));
        }
        if self.grad_accum == 0 {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}grad_accum"),
                "must be at least 1",
            ));
        }
        if self.checkpointing == Checkpointing::EveryKth(0) {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}checkpointing"),
                "k must be at least 1 (1 = every block)",
            ));
        }
        let dp = self.data_parallel;
        if dp.degree == 0 {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}data_parallel.degree"),
                "must be at least 1 (1 = one GPU)",
            ));
        }
        if dp.shard_optimizer && dp.degree == 1 {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}data_parallel.shard_optimizer"),
                "needs a data-parallel degree of at least 2 (one GPU has nothing to share the state with)",
            ));
        }
        if let Err(conflict) = UpdateStrategy::of(self, false) {
            return Err(crate::Error::invalid(
                what,
                format!("{field_prefix}{}", conflict.field),
                conflict.problem,
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Knobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "mb={} accum={} {}",
            self.micro_batch,
            self.grad_accum,
            self.regime()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in Precision::ALL {
            assert_eq!(p.as_str().parse::<Precision>().unwrap(), p);
        }
        for c in [
            Checkpointing::None,
            Checkpointing::EveryKth(1),
            Checkpointing::EveryKth(3),
        ] {
            assert_eq!(c.to_string().parse::<Checkpointing>().unwrap(), c);
        }
        assert!("every-0".parse::<Checkpointing>().is_err());
        assert!("fp4".parse::<Precision>().is_err());
        assert_eq!(Precision::Fp8.compute(), Precision::Bf16);
        assert!(Precision::Fp8.note().is_some() && Precision::Bf16.note().is_none());
    }

    #[test]
    fn batch_sizes_past_the_bounds_are_refused_and_products_saturate() {
        let field = |k: Knobs| match k.validate("knobs", "") {
            Err(crate::Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected invalid knobs, got {other:?}"),
        };
        let huge = Knobs::new(usize::MAX, Precision::Fp32);
        assert_eq!(field(huge), "micro_batch");
        assert_eq!(huge.global_batch(), usize::MAX);
        let accum = Knobs {
            grad_accum: usize::MAX,
            ..Knobs::new(1, Precision::Fp32)
        };
        assert_eq!(field(accum), "grad_accum");
        let degree = Knobs {
            data_parallel: DataParallel::replicated(usize::MAX),
            ..Knobs::new(1, Precision::Fp32)
        };
        assert_eq!(field(degree), "data_parallel.degree");
        Knobs::new(MAX_MICRO_BATCH, Precision::Fp32)
            .validate("knobs", "")
            .unwrap();
    }

    #[test]
    fn unknown_keys_inside_checkpointing_are_refused() {
        let json = |checkpointing: &str| {
            format!(
                r#"{{"micro_batch": 1, "grad_accum": 1, "precision": "fp32", "checkpointing": {checkpointing}}}"#
            )
        };
        assert!(serde_json::from_str::<Knobs>(&json(r#"{"mode": "every_kth", "k": 2}"#)).is_ok());
        let err = serde_json::from_str::<Knobs>(&json(r#"{"mode": "every_kth", "k": 2, "j": 3}"#))
            .unwrap_err();
        assert!(err.to_string().contains("\"j\""), "{err}");
        assert!(serde_json::from_str::<Regime>(
            r#"{"precision": "fp32", "checkpointing": {"mode": "none"}, "offload": "none", "extra": 1}"#
        )
        .is_err());
    }

    #[test]
    fn every_kth_selects_blocks() {
        let picked: Vec<usize> = (0..6)
            .filter(|&i| Checkpointing::EveryKth(2).recomputes(i))
            .collect();
        assert_eq!(picked, vec![0, 2, 4]);
        assert!(!(0..6).any(|i| Checkpointing::None.recomputes(i)));
    }

    #[test]
    fn knobs_json_is_stable() {
        let k = Knobs {
            grad_accum: 4,
            ..Knobs::new(8, Precision::Bf16)
        };
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(
            json,
            r#"{"micro_batch":8,"grad_accum":4,"precision":"bf16","checkpointing":{"mode":"none"},"offload":"none"}"#
        );
        let back: Knobs = serde_json::from_str(&json).unwrap();
        assert_eq!(back, k);
        assert_eq!(k.global_batch(), 32);
    }

    #[test]
    fn data_parallel_knobs_are_per_gpu_and_appear_only_when_used() {
        let k = Knobs {
            grad_accum: 4,
            data_parallel: DataParallel {
                degree: 2,
                shard_optimizer: true,
            },
            ..Knobs::new(8, Precision::Bf16)
        };
        let json = serde_json::to_string(&k).unwrap();
        assert!(
            json.ends_with(r#""data_parallel":{"degree":2,"shard_optimizer":true}}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Knobs>(&json).unwrap(), k);
        assert_eq!((k.per_rank_batch(), k.global_batch()), (32, 64));
        assert_eq!(
            k.to_string(),
            "mb=8 accum=4 bf16 ckpt=none offload=none dp=2 zero1"
        );
        assert!(k.regime().saves_memory());
        let field = |k: Knobs| match k.validate("knobs", "") {
            Err(crate::Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected invalid knobs, got {other:?}"),
        };
        let one = Knobs {
            data_parallel: DataParallel {
                degree: 1,
                shard_optimizer: true,
            },
            ..k
        };
        assert_eq!(field(one), "data_parallel.shard_optimizer");
        let zero = Knobs {
            data_parallel: DataParallel::replicated(0),
            ..k
        };
        assert_eq!(field(zero), "data_parallel.degree");
    }
}
