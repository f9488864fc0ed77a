//! clap argument types. Nothing here touches the filesystem or a device: validation against the
//! environment happens in each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use autotune::knobs::{Checkpointing, Offload, Precision};

/// Find the fastest training plan that fits your GPU and host memory, and train with it.
#[derive(Debug, Parser)]
#[command(name = "autotune", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Print only errors and warnings on stderr.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// More log detail on stderr (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model with explicit knobs, with progress, checkpoints and resume.
    Train(TrainArgs),
    /// Measure one setting with real training steps: step time, tokens/s, peak memory.
    Probe(ProbeArgs),
    /// Run one trial described by JSON on stdin and print its result as one JSON line
    /// (the isolated-probe protocol; used by the search).
    #[command(hide = true)]
    ProbeOne,
}

impl Command {
    pub fn wants_json(&self) -> bool {
        match self {
            Command::Train(a) => a.json,
            Command::Probe(a) => a.json,
            Command::ProbeOne => true,
        }
    }
}

/// The model and where to run it.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Model preset (tiny, seed, gpt-124m, gpt-350m, gpt-1.3b) or a JSON spec file.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Where to run: cpu, cuda, or auto (cuda when built with it and a GPU is present).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Seed for weights, data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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
    /// fp32, bf16 or fp16.
    #[arg(long, default_value = "fp32")]
    pub precision: Precision,
    /// Activation checkpointing: none, all, or every-K.
    #[arg(long, default_value = "none")]
    pub checkpointing: Checkpointing,
    /// Optimizer offload: none or optimizer.
    #[arg(long, default_value = "none")]
    pub offload: Offload,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// Optimizer steps to train (in total, counting resumed steps).
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Training data: `random` (the seed's random tokens), `pattern` (learnable synthetic
    /// sequences), a text file (bytes), or a token file (`.bin`/`.u16`: u16, `.u32`: u32).
    #[arg(long, default_value = "random")]
    pub data: String,
    /// Directory for checkpoints (written atomically; `latest` points at the newest).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (and always at the end and on Ctrl-C).
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// Evaluate on a held-out batch every N steps (0 = never).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// Continue from the latest checkpoint in --checkpoint-dir.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// Untimed steps before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Host heap budget (e.g. 8GiB); exceeding it is an out-of-memory outcome.
    #[arg(long)]
    pub host_budget: Option<String>,
    /// Make the GPU behave as one of this size (e.g. 24564MiB for an RTX 4090) by holding back
    /// the rest, so out-of-memory happens where it would on the smaller card.
    #[arg(long)]
    pub gpu_capacity: Option<String>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

impl KnobArgs {
    pub fn knobs(&self) -> autotune::Knobs {
        autotune::Knobs {
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
            precision: self.precision,
            checkpointing: self.checkpointing,
            offload: self.offload,
        }
    }
}
