//! The DeepSpeed config a plan determines: batch, precision (with fp16 loss scaling as
//! autotune's step scales), the optimizer, gradient clipping, ZeRO offload or sharding, and
//! activation checkpointing.

use serde::{Deserialize, Serialize};

use super::Notes;
use crate::knobs::{Checkpointing, Knobs, Offload, Precision};
use crate::spec::model::{OptimizerKind, OptimizerSpec};

/// `{"enabled": bool}`, DeepSpeed's switch object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enabled {
    /// Whether the feature is on.
    pub enabled: bool,
}

/// DeepSpeed's `fp16` section: dynamic loss scaling with autotune's constants (start at 2^16,
/// halve on an overflowing step and skip it, double after 2000 clean steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fp16Section {
    /// Whether fp16 mixed precision is on.
    pub enabled: bool,
    /// `0` selects dynamic loss scaling; absent when disabled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<u32>,
    /// The first scale is 2^this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initial_scale_power: Option<u32>,
    /// Clean steps before the scale doubles.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale_window: Option<u32>,
    /// Overflows tolerated before the scale halves: 1, halve at the first, as autotune does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hysteresis: Option<u32>,
    /// DeepSpeed's floor for the scale (autotune's has none it reaches in practice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_loss_scale: Option<u32>,
}

/// DeepSpeed's `optimizer` section: the plan's Adam or AdamW. DeepSpeed builds it itself, so
/// a ZeRO-Offload config works without the user passing an optimizer to `initialize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSection {
    /// `"Adam"` or `"AdamW"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its parameters.
    pub params: OptimizerParams,
}

/// The optimizer's hyper-parameters, in DeepSpeed's spelling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerParams {
    /// Learning rate.
    pub lr: f64,
    /// `[beta1, beta2]`.
    pub betas: [f64; 2],
    /// Denominator epsilon.
    pub eps: f64,
    /// Weight decay (L2 for Adam, decoupled for AdamW).
    pub weight_decay: f64,
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

/// DeepSpeed's `activation_checkpointing` section. It configures `deepspeed.checkpointing`,
/// which recomputes only the blocks the model code wraps in
/// `deepspeed.checkpointing.checkpoint`; it turns nothing on by itself (see the notes).
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
    /// The global gradient norm the step clips to; 0 for none. DeepSpeed's default is 1.0,
    /// which the measured step did not do, so it is always written.
    pub gradient_clipping: f64,
    /// bf16 mixed precision.
    pub bf16: Enabled,
    /// fp16 mixed precision.
    pub fp16: Fp16Section,
    /// The optimizer, built by DeepSpeed.
    pub optimizer: OptimizerSection,
    /// Present only with optimizer offload or sharding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_optimization: Option<ZeroSection>,
    /// Present only with activation checkpointing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<ActivationCheckpointing>,
}

/// The DeepSpeed config for `knobs` and `optimizer` on `world_size` data-parallel GPUs (the
/// plan's own degree, or more to run the same per-GPU setting on a larger cluster), and what
/// the user must still do.
pub fn deepspeed_config(
    knobs: &Knobs,
    optimizer: &OptimizerSpec,
    world_size: usize,
) -> (DeepSpeedConfig, Notes) {
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
    let mut notes = Notes::new();
    if knobs.checkpointing != Checkpointing::None {
        notes.push(
            "activation_checkpointing configures deepspeed.checkpointing but recomputes nothing by              itself: wrap each transformer block's forward in deepspeed.checkpointing.checkpoint              (or call model.gradient_checkpointing_enable() on a Hugging Face model)"
                .into(),
        );
    }
    if let Checkpointing::EveryKth(k) = knobs.checkpointing {
        if k > 1 {
            notes.push(format!(
                "the plan recomputes every {k}-th block only: wrap those blocks, not all of them"
            ));
        }
    }
    let config = DeepSpeedConfig {
        train_micro_batch_size_per_gpu: knobs.micro_batch,
        gradient_accumulation_steps: knobs.grad_accum,
        train_batch_size: knobs.per_rank_batch() * world_size,
        gradient_clipping: optimizer.grad_clip.unwrap_or(0.0),
        bf16: Enabled {
            // DeepSpeed has no fp8 products: an fp8 plan trains in bf16 there (`fidelity`).
            enabled: knobs.precision.compute() == Precision::Bf16,
        },
        fp16: Fp16Section {
            enabled: fp16,
            loss_scale: fp16.then_some(0),
            initial_scale_power: fp16.then_some(16),
            loss_scale_window: fp16.then_some(2000),
            hysteresis: fp16.then_some(1),
            min_loss_scale: fp16.then_some(1),
        },
        optimizer: OptimizerSection {
            kind: match optimizer.kind {
                OptimizerKind::Adam => "Adam",
                OptimizerKind::AdamW => "AdamW",
            }
            .into(),
            params: OptimizerParams {
                lr: optimizer.lr,
                betas: [optimizer.beta1, optimizer.beta2],
                eps: optimizer.eps,
                weight_decay: optimizer.weight_decay,
            },
        },
        zero_optimization,
        activation_checkpointing: (knobs.checkpointing != Checkpointing::None).then_some(
            ActivationCheckpointing {
                partition_activations: false,
                cpu_checkpointing: false,
                contiguous_memory_optimization: false,
            },
        ),
    };
    (config, notes)
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
    fn a_plain_plan_carries_its_optimizer_and_no_clipping() {
        let (config, notes) = deepspeed_config(
            &knobs(8, 4, Precision::Fp32),
            &OptimizerSpec::adamw(3e-4),
            1,
        );
        assert_eq!(
            serde_json::to_value(config).unwrap(),
            json!({
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 4,
                "train_batch_size": 32,
                "gradient_clipping": 0.0,
                "bf16": {"enabled": false},
                "fp16": {"enabled": false},
                "optimizer": {"type": "AdamW", "params": {
                    "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
            })
        );
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn offload_recompute_clipping_and_fp16_are_stated() {
        let k = Knobs {
            checkpointing: Checkpointing::EveryKth(2),
            offload: Offload::Optimizer,
            ..knobs(4, 2, Precision::Bf16)
        };
        let mut adam = OptimizerSpec::adam(1e-3);
        adam.grad_clip = Some(0.5);
        let (config, notes) = deepspeed_config(&k, &adam, 8);
        let v = serde_json::to_value(&config).unwrap();
        assert_eq!(v["train_batch_size"], 64);
        assert_eq!(v["gradient_clipping"], 0.5);
        assert_eq!(v["optimizer"]["type"], "Adam");
        assert_eq!(
            v["zero_optimization"],
            json!({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}})
        );
        assert!(v["activation_checkpointing"].is_object());
        assert!(notes
            .iter()
            .any(|n| n.contains("deepspeed.checkpointing.checkpoint")));
        assert!(notes.iter().any(|n| n.contains("every 2-th")), "{notes:?}");
        let (fp16, _) = deepspeed_config(&knobs(1, 1, Precision::Fp16), &adam, 1);
        assert_eq!(
            serde_json::to_value(fp16.fp16).unwrap(),
            json!({"enabled": true, "loss_scale": 0, "initial_scale_power": 16,
                   "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1})
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
        let adamw = OptimizerSpec::adamw(1e-4);
        let (config, _) = deepspeed_config(&k, &adamw, k.data_parallel.degree);
        assert_eq!(config.train_batch_size, 64);
        assert_eq!(
            serde_json::to_value(config.zero_optimization).unwrap(),
            json!({"stage": 1})
        );
        // Sixteen GPUs of a cluster keep the per-GPU setting and scale the batch.
        assert_eq!(deepspeed_config(&k, &adamw, 16).0.train_batch_size, 256);
    }
}
