//! Lightning: the `Trainer` keyword arguments a plan determines.

use serde::{Deserialize, Serialize};

use super::Notes;
use crate::knobs::{Checkpointing, Knobs, Offload, Precision};

/// `lightning.Trainer(**kwargs)` for a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LightningArgs {
    /// `"bf16-mixed"`, `"16-mixed"` or `"32-true"`.
    pub precision: String,
    /// Micro-batches per optimizer step.
    pub accumulate_grad_batches: usize,
    /// `"auto"`, `"ddp"`, `"deepspeed_stage_1"` or `"deepspeed_stage_2_offload"`.
    pub strategy: String,
    /// GPUs of this host.
    pub devices: usize,
    /// The global gradient norm clipped to, absent for none.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub gradient_clip_val: Option<f64>,
}

/// The Lightning arguments for a plan whose optimizer clips to `grad_clip`, and what they
/// cannot carry (the batch size lives in the DataLoader, not the Trainer).
pub fn lightning_args(knobs: &Knobs, grad_clip: Option<f64>) -> (LightningArgs, Notes) {
    let degree = knobs.data_parallel.degree.max(1);
    let strategy = match (
        knobs.offload,
        knobs.data_parallel.shard_optimizer,
        degree > 1,
    ) {
        (Offload::Optimizer, _, _) => "deepspeed_stage_2_offload",
        (Offload::None, true, _) => "deepspeed_stage_1",
        (Offload::None, false, true) => "ddp",
        (Offload::None, false, false) => "auto",
    };
    let mut notes = vec![format!(
        "set the DataLoader's batch_size to {} (the Trainer has no batch-size argument)",
        knobs.micro_batch
    )];
    if knobs.checkpointing != Checkpointing::None {
        notes.push(
            "turn on activation checkpointing in the LightningModule (torch.utils.checkpoint \
             around the blocks the plan recomputes)"
                .into(),
        );
    }
    if knobs.precision == Precision::Fp8 {
        notes.push(super::hf::FP8_THROUGH_TRANSFORMER_ENGINE.into());
    }
    let args = LightningArgs {
        precision: match knobs.precision {
            Precision::Fp32 => "32-true",
            Precision::Bf16 => "bf16-mixed",
            Precision::Fp16 => "16-mixed",
            Precision::Fp8 => "transformer-engine",
        }
        .into(),
        accumulate_grad_batches: knobs.grad_accum,
        strategy: strategy.into(),
        devices: degree,
        gradient_clip_val: grad_clip,
    };
    (args, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_strategy_and_accumulation_follow_the_plan() {
        let k = Knobs {
            grad_accum: 4,
            ..Knobs::new(8, Precision::Bf16)
        };
        let (args, notes) = lightning_args(&k, None);
        assert_eq!(
            serde_json::to_value(&args).unwrap(),
            serde_json::json!({"precision": "bf16-mixed", "accumulate_grad_batches": 4,
                               "strategy": "auto", "devices": 1})
        );
        assert!(notes[0].contains("batch_size to 8"));
        let off = Knobs {
            offload: Offload::Optimizer,
            checkpointing: Checkpointing::EveryKth(1),
            ..Knobs::new(2, Precision::Fp16)
        };
        let (args, notes) = lightning_args(&off, Some(1.0));
        assert_eq!(args.precision, "16-mixed");
        assert_eq!(args.strategy, "deepspeed_stage_2_offload");
        assert_eq!(args.gradient_clip_val, Some(1.0));
        assert_eq!(notes.len(), 2);
        let (fp32, _) = lightning_args(&Knobs::new(1, Precision::Fp32), None);
        assert_eq!(fp32.precision, "32-true");
    }
}
