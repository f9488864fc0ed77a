//! The flags that name a model and its knobs by hand, which `train`, `probe` and `estimate`
//! share.

use clap::Args;

use super::model::ModelName;
use crate::knobs::{Checkpointing, Offload, Precision, Update};

/// The model and where to run it.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Model: a preset, a JSON spec file, a Hugging Face `config.json`, or a Hugging Face model
    /// folder (its config, and its weights to start from).
    #[arg(long, default_value = "tiny", value_parser = ModelName)]
    pub model: String,
    /// Train on sequences of N tokens (default: the model's length: its preset's, or its
    /// config's `max_position_embeddings` up to 2048). With --data, the longest a sequence may
    /// be: longer examples are cut or dropped (--truncate).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub seq_len: Option<u64>,
    /// Where to run: cpu, cuda, or auto (cuda when built with it and a GPU is present).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Training engine: explicit (the default, flash attention where the GPU has kernels for
    /// it), explicit-materialized (attention probabilities kept), or the autograd-based fused
    /// and composite references (for benchmarks and comparisons).
    #[arg(long, default_value = "explicit")]
    pub engine: crate::model::Engine,
}

/// A model and its knobs given by hand, on a device: the flags `train` and `probe` share.
#[derive(Debug, Args)]
pub struct ByHandArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub knobs: KnobArgs,
}

/// The knobs a plan would choose, given by hand.
#[derive(Debug, Args)]
pub struct KnobArgs {
    /// Sequences per forward/backward pass.
    #[arg(long, default_value_t = 8)]
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// fp32, bf16, fp16, or fp8: bf16 with the Transformer blocks' matrix products in fp8 (on
    /// a GPU with fp8 tensor cores, compute capability 8.9 or newer; emulated on the CPU).
    #[arg(long, default_value = "fp32")]
    pub precision: Precision,
    /// Activation checkpointing: none, all, or every-K.
    #[arg(long, default_value = "none")]
    pub checkpointing: Checkpointing,
    /// Optimizer offload: none or optimizer.
    #[arg(long, default_value = "none")]
    pub offload: Offload,
    /// When the optimizer updates: after-backward, or in-backward (each block's parameters as
    /// soon as their gradients are complete, so the whole model's gradients never exist at
    /// once; only without accumulation, fp16, offload, data parallelism or gradient clipping).
    #[arg(long, default_value = "after-backward")]
    pub update: Update,
    /// Data parallelism: train on N GPUs of this host (`cuda:0` … `cuda:N-1`, or N CPU processes
    /// with `--device cpu`), one process per GPU launched by autotune; micro-batch and
    /// accumulation are per GPU, so a step takes micro-batch × accumulation × N sequences.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub data_parallel: usize,
    /// With `--data-parallel`: shard the Adam moments over the GPUs (ZeRO stage 1).
    #[arg(long)]
    pub shard_optimizer: bool,
    /// Adam moments' storage: f32 (exact), bf16, or int8 (8-bit block-wise codes, as
    /// bitsandbytes); anything but f32 is not exactly AdamW.
    #[arg(long, default_value = "f32", value_name = "FORMAT")]
    pub moments: crate::knobs::MomentFormat,
    /// Master weights: f32 (exact), bf16-kahan or bf16-sr (bf16 with a Kahan compensation, or
    /// rounded stochastically; both need --precision bf16).
    #[arg(long, default_value = "f32", value_name = "FORMAT")]
    pub masters: crate::knobs::MasterFormat,
    /// Where the moments live: device, or host (page-locked, streamed through each part's
    /// update in backward).
    #[arg(long, default_value = "device", value_name = "PLACE")]
    pub moments_on: crate::knobs::MomentPlace,
}

impl KnobArgs {
    /// The knobs the flags give.
    pub fn knobs(&self) -> crate::Knobs {
        crate::Knobs {
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
            precision: self.precision,
            checkpointing: self.checkpointing,
            offload: self.offload,
            update: self.update,
            data_parallel: crate::knobs::DataParallel {
                degree: self.data_parallel,
                shard_optimizer: self.shard_optimizer,
            },
            state: crate::knobs::StateLayout {
                moments: self.moments,
                masters: self.masters,
                moments_on: self.moments_on,
            },
        }
    }
}
