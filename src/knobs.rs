//! The settings a plan chooses: micro-batch, accumulation, precision, checkpointing, offload.
//!
//! [`Knobs`] is one point of the search space. [`Regime`] is a point with the batch sizes
//! removed: memory and step time are modelled per regime as functions of the micro-batch.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

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
}

impl Precision {
    /// All precisions, fastest-first on tensor-core GPUs.
    pub const ALL: [Precision; 3] = [Precision::Bf16, Precision::Fp16, Precision::Fp32];

    /// The dtype activations and matrix products run in.
    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            Precision::Fp32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::Fp16 => candle_core::DType::F16,
        }
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
            _ => Err(format!(
                "unknown precision `{s}`; expected fp32, bf16 or fp16"
            )),
        }
    }
}

/// Activation checkpointing: which Transformer blocks keep only their input and recompute in backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "k")]
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

/// The batch-independent part of a plan: memory and time are modelled per regime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Regime {
    /// Arithmetic precision.
    pub precision: Precision,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// Optimizer placement.
    pub offload: Offload,
}

impl fmt::Display for Regime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ckpt={} offload={}",
            self.precision, self.checkpointing, self.offload
        )
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
        }
    }

    /// Sequences per optimizer step.
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.grad_accum
    }

    /// The batch-independent part.
    pub fn regime(&self) -> Regime {
        Regime {
            precision: self.precision,
            checkpointing: self.checkpointing,
            offload: self.offload,
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
        }
    }

    /// Checks the knobs on their own; `field_prefix` names where they came from in error messages.
    pub fn validate(&self, what: &'static str, field_prefix: &str) -> crate::Result<()> {
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
        assert!("fp8".parse::<Precision>().is_err());
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
}
