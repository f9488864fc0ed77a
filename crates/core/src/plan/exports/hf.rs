//! Hugging Face: `TrainingArguments` that `HfArgumentParser.parse_dict` accepts, and an
//! Accelerate config file that `accelerate launch --config_file` loads.

use serde::{Deserialize, Serialize};

use super::Notes;
use crate::knobs::{Checkpointing, Knobs, Offload, Precision};
use crate::spec::model::{OptimizerKind, OptimizerSpec};

/// Where [`trainer_args`] points `deepspeed` when the plan needs DeepSpeed: the file the user
/// writes the DeepSpeed export to.
pub const DEEPSPEED_CONFIG_FILE: &str = "ds_config.json";

/// `transformers.TrainingArguments` fields a plan determines, by their own names; every key is
/// one of its dataclass fields, so `HfArgumentParser(TrainingArguments).parse_dict` takes the
/// document once the user adds `output_dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerArgs {
    /// Sequences per forward/backward pass on each device.
    pub per_device_train_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// bf16 mixed precision.
    pub bf16: bool,
    /// fp16 mixed precision (with a dynamic loss scale).
    pub fp16: bool,
    /// Learning rate.
    pub learning_rate: f64,
    /// First-moment decay.
    pub adam_beta1: f64,
    /// Second-moment decay.
    pub adam_beta2: f64,
    /// Denominator epsilon.
    pub adam_epsilon: f64,
    /// Weight decay (decoupled: the Trainer's optimizer is AdamW).
    pub weight_decay: f64,
    /// The global gradient norm clipped to; 0 for none (the Trainer's default is 1.0).
    pub max_grad_norm: f64,
    /// Recompute activations in backward (every layer: the Trainer has no every-k-th).
    pub gradient_checkpointing: bool,
    /// The optimizer, when the plan's state is bitsandbytes' 8-bit AdamW's
    /// ([`super::fidelity::trainer_optim`]); absent for the Trainer's default AdamW.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub optim: Option<String>,
    /// The DeepSpeed config file, when the plan offloads or shards the optimizer.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub deepspeed: Option<String>,
}

/// The `TrainingArguments` for a plan, and what they cannot carry.
pub fn trainer_args(knobs: &Knobs, optimizer: &OptimizerSpec) -> (TrainerArgs, Notes) {
    let mut notes = shared_notes(knobs);
    if optimizer.kind == OptimizerKind::Adam && optimizer.weight_decay > 0.0 {
        notes.push(
            "the plan's optimizer is Adam with L2 weight decay; the Trainer's is AdamW, whose \
             decay is decoupled, so weight_decay acts differently"
                .into(),
        );
    }
    let needs_deepspeed = needs_deepspeed(knobs);
    if needs_deepspeed {
        notes.push(format!(
            "write `autotune export --format deepspeed` to {DEEPSPEED_CONFIG_FILE}: `deepspeed` \
             points there for the optimizer offload or sharding"
        ));
    }
    if knobs.data_parallel.degree > 1 {
        notes.push(format!(
            "launch {} processes (torchrun --nproc-per-node {0}, or accelerate launch \
             --num_processes {0})",
            knobs.data_parallel.degree
        ));
    }
    let args = TrainerArgs {
        per_device_train_batch_size: knobs.micro_batch,
        gradient_accumulation_steps: knobs.grad_accum,
        // The Trainer has no fp8 products: an fp8 plan trains in bf16 there (see `fidelity`).
        bf16: knobs.precision.compute() == Precision::Bf16,
        fp16: knobs.precision == Precision::Fp16,
        learning_rate: optimizer.lr,
        adam_beta1: optimizer.beta1,
        adam_beta2: optimizer.beta2,
        adam_epsilon: optimizer.eps,
        weight_decay: optimizer.weight_decay,
        max_grad_norm: optimizer.grad_clip.unwrap_or(0.0),
        gradient_checkpointing: knobs.checkpointing != Checkpointing::None,
        optim: super::fidelity::trainer_optim(knobs).map(str::to_string),
        deepspeed: needs_deepspeed.then(|| DEEPSPEED_CONFIG_FILE.to_string()),
    };
    (args, notes)
}

/// Whether the plan needs DeepSpeed under the Hugging Face tools: they offload or shard the
/// optimizer only through it.
fn needs_deepspeed(knobs: &Knobs) -> bool {
    knobs.offload == Offload::Optimizer || knobs.data_parallel.shard_optimizer
}

/// What neither Hugging Face tool can say about a plan.
fn shared_notes(knobs: &Knobs) -> Notes {
    let mut notes = Notes::new();
    if let Checkpointing::EveryKth(k) = knobs.checkpointing {
        if k > 1 {
            notes.push(format!(
                "the plan recomputes every {k}-th block; gradient checkpointing recomputes all of \
                 them (less memory, slower)"
            ));
        }
    }
    notes
}

/// What Accelerate's and Lightning's fp8 differ in from the plan's.
pub(crate) const FP8_THROUGH_TRANSFORMER_ENGINE: &str =
    "fp8 runs through NVIDIA Transformer Engine (install transformer-engine): it replaces the \
     model's linear layers with its own and scales each tensor from the largest magnitude of \
     its last 16 steps, where the plan's scale comes from its last 16 conversions (a layer's \
     input and weight are converted twice a step, its output gradient once)";

/// An Accelerate config file for a plan (YAML, the format `accelerate config` writes), and its
/// notes. With offload or sharding it selects DeepSpeed with the DeepSpeed export's file.
pub fn accelerate_config(knobs: &Knobs) -> (String, Notes) {
    let mut notes = shared_notes(knobs);
    let processes = knobs.data_parallel.degree.max(1);
    let deepspeed = needs_deepspeed(knobs);
    let distributed = match (deepspeed, processes > 1) {
        (true, _) => "DEEPSPEED",
        (false, true) => "MULTI_GPU",
        (false, false) => "NO",
    };
    let precision = match knobs.precision {
        Precision::Fp32 => "no",
        Precision::Bf16 => "bf16",
        Precision::Fp16 => "fp16",
        Precision::Fp8 => "fp8",
    };
    let mut yaml = format!(
        "compute_environment: LOCAL_MACHINE\n\
         distributed_type: {distributed}\n\
         mixed_precision: {precision}\n\
         num_machines: 1\n\
         machine_rank: 0\n\
         num_processes: {processes}\n\
         use_cpu: false\n"
    );
    if knobs.precision == Precision::Fp8 {
        // Transformer Engine's recipe nearest the plan's: E4M3 forward, E5M2 gradients, each
        // scale from the largest magnitude over a history of 16.
        yaml.push_str(
            "fp8_config:\n  backend: TE\n  fp8_format: HYBRID\n  amax_history_length: 16\n  \
             amax_compute_algorithm: max\n  margin: 0\n  interval: 1\n",
        );
        notes.push(FP8_THROUGH_TRANSFORMER_ENGINE.into());
    }
    if deepspeed {
        yaml.push_str(&format!(
            "deepspeed_config:\n  deepspeed_config_file: {DEEPSPEED_CONFIG_FILE}\n  zero3_init_flag: false\n"
        ));
        notes.push(format!(
            "write `autotune export --format deepspeed` to {DEEPSPEED_CONFIG_FILE}: it holds the \
             batch, accumulation and offload"
        ));
    } else {
        notes.push(format!(
            "Accelerate's config has no batch size: use per-device batches of {} and \
             gradient_accumulation_steps={} in the Accelerator or the training loop",
            knobs.micro_batch, knobs.grad_accum
        ));
    }
    if knobs.checkpointing != Checkpointing::None {
        notes.push("turn on gradient checkpointing in the model code".into());
    }
    (yaml, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainer_arguments_use_only_trainer_fields_and_state_what_they_cannot_carry() {
        let k = Knobs {
            grad_accum: 2,
            ..Knobs::new(16, Precision::Bf16)
        };
        let (args, notes) = trainer_args(&k, &OptimizerSpec::adamw(3e-4));
        let v = serde_json::to_value(&args).unwrap();
        // The names TrainingArguments (transformers 4.x and 5.x) declares.
        let fields = [
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "bf16",
            "fp16",
            "learning_rate",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
            "weight_decay",
            "max_grad_norm",
            "gradient_checkpointing",
            "deepspeed",
        ];
        for key in v.as_object().unwrap().keys() {
            assert!(
                fields.contains(&key.as_str()),
                "{key} is not a TrainingArguments field"
            );
        }
        assert_eq!(v["bf16"], true);
        assert_eq!(v["max_grad_norm"], 0.0);
        assert!(v.get("deepspeed").is_none());
        assert!(notes.is_empty(), "{notes:?}");
        let off = Knobs {
            offload: Offload::Optimizer,
            checkpointing: Checkpointing::EveryKth(2),
            ..Knobs::new(4, Precision::Fp16)
        };
        let mut adam = OptimizerSpec::adam(1e-3);
        adam.grad_clip = Some(1.0);
        adam.weight_decay = 0.01;
        let (args, notes) = trainer_args(&off, &adam);
        assert_eq!(args.deepspeed.as_deref(), Some(DEEPSPEED_CONFIG_FILE));
        assert!(args.fp16 && !args.bf16 && args.gradient_checkpointing);
        assert_eq!(args.max_grad_norm, 1.0);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(notes.iter().any(|n| n.contains("decoupled")), "{notes:?}");
    }

    #[test]
    fn an_accelerate_config_picks_deepspeed_for_offload_and_multi_gpu_for_replicas() {
        let (plain, notes) = accelerate_config(&Knobs::new(8, Precision::Bf16));
        assert!(plain.contains("distributed_type: NO\n"), "{plain}");
        assert!(plain.contains("mixed_precision: bf16\n"));
        assert!(notes[0].contains("per-device batches of 8"));
        let off = Knobs {
            offload: Offload::Optimizer,
            ..Knobs::new(8, Precision::Fp32)
        };
        let (yaml, _) = accelerate_config(&off);
        assert!(yaml.contains("distributed_type: DEEPSPEED\n"), "{yaml}");
        assert!(yaml.contains("deepspeed_config_file: ds_config.json"));
        let dp = Knobs {
            data_parallel: crate::knobs::DataParallel {
                degree: 4,
                shard_optimizer: false,
            },
            ..Knobs::new(8, Precision::Bf16)
        };
        let (yaml, _) = accelerate_config(&dp);
        assert!(yaml.contains("distributed_type: MULTI_GPU\nmixed_precision: bf16\n"));
        assert!(yaml.contains("num_processes: 4\n"));
    }
}
