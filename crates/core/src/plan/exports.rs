//! A plan's knobs in other tools' vocabularies: a DeepSpeed config fragment, and the arguments
//! Hugging Face Accelerate / `TrainingArguments` and Lightning users set by hand.
//!
//! These are translations of the chosen setting, not guarantees: the memory and speed were
//! measured on autotune's own training step, and another framework allocates differently.
//!
//! A data-parallel plan's micro-batch and accumulation are per GPU, as in DeepSpeed, so a plan
//! measured on the GPUs of one host carries over to a cluster of such hosts by raising the
//! world size: `train_batch_size` grows with it and the per-GPU memory stays what was measured.

use serde::{Deserialize, Serialize};

use crate::knobs::{Checkpointing, Knobs, Offload, Precision};

/// `{"enabled": bool}`, DeepSpeed's switch object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enabled {
    /// Whether the feature is on.
    pub enabled: bool,
}

/// DeepSpeed's `fp16` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fp16Section {
    /// Whether fp16 mixed precision is on.
    pub enabled: bool,
    /// `0` selects dynamic loss scaling, as autotune's fp16 step uses; absent when disabled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<u32>,
}

/// DeepSpeed's `zero_optimization.offload_optimizer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadOptimizer {
    /// Always `"cpu"`.
    pub device: String,
    /// Page-locked host buffers, for full-speed transfers.
    pub pin_memory: bool,
}

/// DeepSpeed's `zero_optimization` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroSection {
    /// ZeRO stage: 2 when offloading (ZeRO-Offload is built on stage 2), 1 when the optimizer
    /// state is sharded over the GPUs.
    pub stage: u8,
    /// Where the optimizer state and update live; present only with offload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload_optimizer: Option<OffloadOptimizer>,
}

/// DeepSpeed's `activation_checkpointing` section (read by `deepspeed.checkpointing`, which the
/// model code must call for the blocks to recompute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationCheckpointing {
    /// Split checkpoints across model-parallel ranks (off: one GPU).
    pub partition_activations: bool,
    /// Move checkpoints to host memory (off: autotune keeps them on the device).
    pub cpu_checkpointing: bool,
    /// Copy checkpoints into one buffer (off).
    pub contiguous_memory_optimization: bool,
}

/// The DeepSpeed config keys a plan determines; merge into a full `ds_config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepSpeedConfig {
    /// Sequences per forward/backward pass on each GPU.
    pub train_micro_batch_size_per_gpu: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Sequences per optimizer step over all GPUs: micro-batch × accumulation × GPUs.
    pub train_batch_size: usize,
    /// bf16 mixed precision.
    pub bf16: Enabled,
    /// fp16 mixed precision.
    pub fp16: Fp16Section,
    /// Present only with optimizer offload or sharding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_optimization: Option<ZeroSection>,
    /// Present only with activation checkpointing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The DeepSpeed fragment for `knobs` on `world_size` data-parallel GPUs (the plan's own
/// degree, or more to run the same per-GPU setting on a larger cluster).
pub fn deepspeed_config(knobs: &Knobs, world_size: usize) -> DeepSpeedConfig {
    let fp16 = knobs.precision == Precision::Fp16;
    let world_size = world_size.max(1);
    let zero_optimization = match (knobs.offload, knobs.data_parallel.shard_optimizer) {
        (Offload::Optimizer, _) => Some(ZeroSection {
            stage: 2,
            offload_optimizer: Some(OffloadOptimizer {
                device: "cpu".into(),
                pin_memory: true,
            }),
        }),
        (Offload::None, true) => Some(ZeroSection {
            stage: 1,
            offload_optimizer: None,
        }),
        (Offload::None, false) => None,
    };
    DeepSpeedConfig {
        train_micro_batch_size_per_gpu: knobs.micro_batch,
        gradient_accumulation_steps: knobs.grad_accum,
        train_batch_size: knobs.per_rank_batch() * world_size,
        bf16: Enabled {
            enabled: knobs.precision == Precision::Bf16,
        },
        fp16: Fp16Section {
            enabled: fp16,
            loss_scale: fp16.then_some(0),
        },
        zero_optimization,
        activation_checkpointing: (knobs.checkpointing != Checkpointing::None).then_some(
            ActivationCheckpointing {
                partition_activations: false,
                cpu_checkpointing: false,
                contiguous_memory_optimization: false,
            },
        ),
    }
}

/// The arguments Accelerate, `transformers.TrainingArguments` and Lightning users set by hand.
///
/// Lightning spells them `accumulate_grad_batches` and `precision="bf16-mixed"`; the names
/// here are Hugging Face's. `warnings` lists what these tools cannot express.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerArgs {
    /// Sequences per forward/backward pass on each device.
    pub per_device_train_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// `"no"`, `"bf16"` or `"fp16"` (Accelerate's values).
    pub mixed_precision: String,
    /// Recompute activations in backward (every layer: these tools have no every-k-th).
    pub gradient_checkpointing: bool,
    /// Processes (one per GPU): `accelerate launch --num_processes N`, `torchrun
    /// --nproc-per-node N`; absent for one.
    #[serde(skip_serializing_if = "is_one", default = "one")]
    pub num_processes: usize,
    /// Parts of the plan these arguments do not carry; empty when they carry all of it.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub warnings: Vec<String>,
}

/// The trainer arguments for `knobs`.
pub fn trainer_args(knobs: &Knobs) -> TrainerArgs {
    let mut warnings = Vec::new();
    if let Checkpointing::EveryKth(k) = knobs.checkpointing {
        if k > 1 {
            warnings.push(format!(
                "the plan recomputes every {k}-th block; gradient_checkpointing recomputes all of them (less memory, \
                 slower)"
            ));
        }
    }
    if knobs.data_parallel.shard_optimizer {
        warnings.push(
            "the plan shards the optimizer state over the GPUs (ZeRO stage 1), which these arguments cannot \
             express; use the DeepSpeed export or Accelerate's DeepSpeed plugin with zero_stage 1"
                .into(),
        );
    }
    if knobs.offload == Offload::Optimizer {
        warnings.push(
            "the plan offloads the optimizer to host memory, which these arguments cannot express; use the \
             DeepSpeed export (zero_optimization.offload_optimizer) or the micro-batch will not fit"
                .into(),
        );
    }
    TrainerArgs {
        per_device_train_batch_size: knobs.micro_batch,
        gradient_accumulation_steps: knobs.grad_accum,
        mixed_precision: match knobs.precision {
            Precision::Fp32 => "no",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
        .into(),
        gradient_checkpointing: knobs.checkpointing != Checkpointing::None,
        num_processes: knobs.data_parallel.degree,
        warnings,
    }
}

fn one() -> usize {
    1
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn knobs(micro_batch: usize, grad_accum: usize, precision: Precision) -> Knobs {
        Knobs {
            grad_accum,
            ..Knobs::new(micro_batch, precision)
        }
    }

    #[test]
    fn deepspeed_fragment_for_a_plain_plan() {
        let config = deepspeed_config(&knobs(8, 4, Precision::Fp32), 1);
        assert_eq!(
            serde_json::to_value(config).unwrap(),
            json!({
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 4,
                "train_batch_size": 32,
                "bf16": {"enabled": false},
                "fp16": {"enabled": false},
            })
        );
    }

    #[test]
    fn deepspeed_fragment_with_offload_and_recompute() {
        let k = Knobs {
            checkpointing: Checkpointing::EveryKth(1),
            offload: Offload::Optimizer,
            ..knobs(4, 2, Precision::Bf16)
        };
        assert_eq!(
            serde_json::to_value(deepspeed_config(&k, 8)).unwrap(),
            json!({
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "train_batch_size": 64,
                "bf16": {"enabled": true},
                "fp16": {"enabled": false},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}},
                "activation_checkpointing": {
                    "partition_activations": false,
                    "cpu_checkpointing": false,
                    "contiguous_memory_optimization": false
                },
            })
        );
        let fp16 = deepspeed_config(&knobs(1, 1, Precision::Fp16), 1);
        assert_eq!(
            serde_json::to_value(fp16.fp16).unwrap(),
            json!({"enabled": true, "loss_scale": 0})
        );
    }

    #[test]
    fn data_parallel_plans_carry_their_layout() {
        let k = Knobs {
            data_parallel: crate::knobs::DataParallel {
                degree: 4,
                shard_optimizer: true,
            },
            ..knobs(8, 2, Precision::Bf16)
        };
        assert_eq!(
            serde_json::to_value(deepspeed_config(&k, k.data_parallel.degree)).unwrap(),
            json!({
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 2,
                "train_batch_size": 64,
                "bf16": {"enabled": true},
                "fp16": {"enabled": false},
                "zero_optimization": {"stage": 1},
            })
        );
        // Sixteen GPUs of a cluster keep the per-GPU setting and scale the batch.
        assert_eq!(deepspeed_config(&k, 16).train_batch_size, 256);
        let args = trainer_args(&k);
        assert_eq!(args.num_processes, 4);
        assert!(
            args.warnings[0].contains("ZeRO stage 1"),
            "{:?}",
            args.warnings
        );
    }

    #[test]
    fn trainer_args_translate_and_warn() {
        let plain = trainer_args(&knobs(16, 2, Precision::Bf16));
        assert_eq!(
            serde_json::to_value(&plain).unwrap(),
            json!({
                "per_device_train_batch_size": 16,
                "gradient_accumulation_steps": 2,
                "mixed_precision": "bf16",
                "gradient_checkpointing": false,
            })
        );
        let k = Knobs {
            checkpointing: Checkpointing::EveryKth(2),
            offload: Offload::Optimizer,
            ..knobs(1, 1, Precision::Fp32)
        };
        let args = trainer_args(&k);
        assert_eq!(args.mixed_precision, "no");
        assert!(args.gradient_checkpointing);
        assert_eq!(args.warnings.len(), 2);
    }
}
