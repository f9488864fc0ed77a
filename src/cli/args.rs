//! clap argument types. Nothing here touches the filesystem or a device: validation against the
//! environment happens in each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use autotune::knobs::{Checkpointing, Offload, Precision, Update};
use autotune::plan::exports::ExportFormat;
use autotune::settings::tune::TuneArgs;

/// `--version`: the release, what the build can run on, the candle it trains with and the
/// commit it was built from, so that a report or a bug names the exact build.
fn version_line() -> &'static str {
    static LINE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let build = if cfg!(feature = "nccl") {
            "CUDA + NCCL build"
        } else if cfg!(feature = "cuda") {
            "CUDA build"
        } else {
            "CPU-only build"
        };
        let git = autotune::backend::GIT_REVISION.map_or(String::new(), |r| format!(", git {r}"));
        format!(
            "{} ({build}, candle {}{git})",
            env!("CARGO_PKG_VERSION"),
            autotune::backend::CANDLE_VERSION
        )
    });
    &LINE
}

/// Find the fastest training plan that fits your GPU and host memory, and train with it.
#[derive(Debug, Parser)]
#[command(name = "autotune", version = version_line(), about, propagate_version = true)]
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
    /// Tune, then train with the plan: the whole job in one command. With no flags it tunes and
    /// trains the tiny preset on learnable synthetic data, on the GPU if there is one.
    Run(RunArgs),
    /// Search for the fastest setting that fits the target device and write it as a plan.
    Tune(TuneArgs),
    /// Print a plan's setting as a DeepSpeed config or as Trainer/Accelerate arguments.
    Export(ExportArgs),
    /// Write a checkpoint's weights as a Hugging Face model folder (config.json and
    /// model.safetensors) that `transformers` loads.
    ExportWeights(ExportWeightsArgs),
    /// Re-measure a recorded profile's settings and report regressions (exit 1 on any).
    Check(super::check::CheckArgs),
    /// Estimate a setting's peak GPU and host memory without running anything (exit 1 when
    /// it does not fit the target).
    Estimate(super::estimate::EstimateArgs),
    /// Show this machine's GPUs (memory, driver, CUDA, PCIe link), host memory and build.
    Device(super::device::DeviceArgs),
    /// Write a plan or a recorded profile as an HTML report: memory and throughput against
    /// micro-batch per regime, the budget, the fits, the chosen setting.
    Report(super::report::ReportArgs),
    /// Print a completion script for a shell (bash, zsh, fish, powershell, elvish).
    Completions(super::completions::CompletionsArgs),
    /// Train a model with explicit knobs, with progress, checkpoints and resume.
    Train(TrainArgs),
    /// Measure one setting with real training steps: step time, tokens/s, peak memory.
    Probe(ProbeArgs),
    /// Run one trial described by JSON on stdin and print its result as one JSON line
    /// (the isolated-probe protocol; used by the search).
    #[command(hide = true)]
    ProbeOne,
    /// Run trials described by JSON lines on stdin, one JSON reply line each, until stdin ends
    /// (the probe-worker protocol; used by the search).
    #[command(hide = true)]
    ProbeServe,
}

impl Command {
    pub fn wants_json(&self) -> bool {
        match self {
            Command::Train(a) => a.json,
            Command::Probe(a) => a.json,
            Command::ProbeOne | Command::ProbeServe => true,
            Command::Tune(a) => a.json,
            Command::Run(a) => a.tune.json,
            Command::Export(_) => true,
            Command::ExportWeights(a) => a.json,
            Command::Check(a) => a.json,
            Command::Estimate(a) => a.json,
            Command::Device(a) => a.json,
            Command::Completions(_) => true,
            Command::Report(_) => false,
        }
    }
}

/// The model and where to run it.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Model preset (tiny, seed, gpt-124m, gpt-350m, gpt-1.3b, gpt-2b) or a JSON spec file.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Where to run: cpu, cuda, or auto (cuda when built with it and a GPU is present).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Seed for weights, data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training engine: explicit (the default, flash attention where the GPU has kernels for
    /// it), explicit-materialized (attention probabilities kept), or the autograd-based fused
    /// and composite references (for benchmarks and comparisons).
    #[arg(long, default_value = "explicit")]
    pub engine: autotune::model::Engine,
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
    pub moments: autotune::knobs::MomentFormat,
    /// Master weights: f32 (exact), bf16-kahan or bf16-sr (bf16 with a Kahan compensation, or
    /// rounded stochastically; both need --precision bf16).
    #[arg(long, default_value = "f32", value_name = "FORMAT")]
    pub masters: autotune::knobs::MasterFormat,
    /// Where the moments live: device, or host (page-locked, streamed through each part's
    /// update in backward).
    #[arg(long, default_value = "device", value_name = "PLACE")]
    pub moments_on: autotune::knobs::MomentPlace,
}

/// The learning rate over a training run (`train`).
#[derive(Debug, Clone, Args)]
pub struct ScheduleArgs {
    /// Warm the learning rate up linearly over the first N steps (from lr / N to lr).
    #[arg(
        long,
        visible_alias = "lr-warmup-steps",
        value_name = "N",
        default_value_t = 0
    )]
    pub warmup_steps: u64,
    /// After the warm-up: constant, or cosine (half a cosine down to --min-lr at the run's
    /// last step, --steps).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: autotune::train::schedule::LrDecay,
    /// The cosine's floor (default: a tenth of the model's learning rate).
    #[arg(long, value_name = "LR")]
    pub min_lr: Option<f64>,
}

/// The learning rate over `run`'s training (its `--warmup-steps` are the trials').
#[derive(Debug, Args)]
pub struct RunScheduleArgs {
    /// Warm the learning rate up linearly over the first N steps (train's --warmup-steps).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lr_warmup_steps: u64,
    /// After the warm-up: constant, or cosine (down to --min-lr at the last step).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: autotune::train::schedule::LrDecay,
    /// The cosine's floor (default: a tenth of the model's learning rate).
    #[arg(long, value_name = "LR")]
    pub min_lr: Option<f64>,
}

impl From<&RunScheduleArgs> for ScheduleArgs {
    fn from(run: &RunScheduleArgs) -> Self {
        Self {
            warmup_steps: run.lr_warmup_steps,
            lr_schedule: run.lr_schedule,
            min_lr: run.min_lr,
        }
    }
}

impl ScheduleArgs {
    /// The schedule over a run of `total_steps` for a model whose rate is `base_lr`.
    pub fn schedule(
        &self,
        base_lr: f64,
        total_steps: u64,
    ) -> anyhow::Result<autotune::train::schedule::LrSchedule> {
        let min_lr = self.min_lr.unwrap_or(base_lr / 10.0);
        if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= base_lr) {
            anyhow::bail!(
                "`--min-lr {min_lr}`: the cosine's floor must be a rate from 0 to the model's learning rate {base_lr}"
            );
        }
        Ok(autotune::train::schedule::LrSchedule {
            decay: self.lr_schedule,
            warmup_steps: self.warmup_steps,
            min_lr,
            decay_steps: total_steps,
        }
        .canonical())
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub tune: TuneArgs,
    #[command(flatten)]
    pub train: RunTrainArgs,
}

/// The training half of `run`.
#[derive(Debug, Args)]
pub struct RunTrainArgs {
    /// Optimizer steps to train.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Training data (see `train --data`).
    #[arg(long, default_value = "pattern")]
    pub data: String,
    /// Directory for the plan and checkpoints.
    #[arg(long, default_value = "autotune-run")]
    pub run_dir: PathBuf,
    /// Save a checkpoint every N steps.
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// Evaluate on a held-out batch every N steps (0 = never).
    #[arg(long, default_value_t = 100)]
    pub eval_every: u64,
    /// Seed for weights, data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Continue the run in --run-dir: train with its plan.json (no tuning; the tuning flags
    /// are not used) from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Start over in a --run-dir that holds a run, replacing its plan and checkpoints (without
    /// it, such a directory is refused unless --resume continues it).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Keep only the newest N checkpoints (default: keep every one).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub keep_last: Option<u64>,
    /// Start from the weights of a Hugging Face checkpoint folder (see `train --init-from`).
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    #[command(flatten)]
    pub schedule: RunScheduleArgs,
    /// Write one JSON line per step to FILE (see `train --metrics`).
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ExportWeightsArgs {
    /// A checkpoint (`DIR/step-000100`), or a checkpoint directory (its `latest` is exported).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The folder to write `config.json` and `model.safetensors` into.
    #[arg(long)]
    pub out: PathBuf,
    /// The weights' dtype in the file: f32 (the masters as they are) or bf16.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: WeightsDtype,
    /// Print what was written as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The dtype of exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsDtype {
    /// f32, exactly the master weights.
    F32,
    /// bf16, rounded to nearest even (half the size).
    Bf16,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The plan file.
    #[arg(long)]
    pub plan: PathBuf,
    /// deepspeed (a ds_config.json), trainer (Hugging Face TrainingArguments as JSON),
    /// accelerate (an Accelerate config YAML) or lightning (Trainer keyword arguments as JSON).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
        ExportFormat::ALL.iter().map(|(name, _)| *name)
    ))]
    pub format: String,
    /// Export a plan measured on another engine than the target tool's (every plan tuned on
    /// autotune's own engine, for the PyTorch tools): its batch may then run out of memory
    /// there.
    #[arg(long)]
    pub allow_engine_mismatch: bool,
    /// Data-parallel processes (DeepSpeed's train_batch_size = micro × accum × world size);
    /// default the plan's own data-parallel degree. More than that runs the plan's per-GPU
    /// setting on a larger cluster.
    #[arg(long)]
    pub world_size: Option<usize>,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// Train with a plan from `autotune tune`: its model, knobs and device limits (knob and
    /// model flags are then ignored).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Optimizer steps to train (in total, counting resumed steps).
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Training data: `pattern` (learnable synthetic sequences), `random` (the seed's random
    /// tokens: nothing to learn, for benchmarks), a text file (bytes), or a token file
    /// (`.bin`/`.u16`: u16, `.u32`: u32; memory-mapped).
    #[arg(long, default_value = "pattern")]
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
    /// Start over in a --checkpoint-dir that holds checkpoints, removing them (without it, such
    /// a directory is refused unless --resume continues its run).
    #[arg(long, requires = "checkpoint_dir", conflicts_with = "resume")]
    pub overwrite: bool,
    /// Keep only the newest N checkpoints (default: keep every one).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub keep_last: Option<u64>,
    /// Start from the weights of a Hugging Face checkpoint folder: `model.safetensors` or the
    /// shards of `model.safetensors.index.json`, in bf16, f16 or f32. Its `config.json`, if any,
    /// must describe the model trained.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Write one JSON line per step to FILE: step, loss, tokens/s, learning rate, loss scale,
    /// skipped, GPU and host memory (docs/metrics.schema.json). A resumed run continues it.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
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
            update: self.update,
            data_parallel: autotune::knobs::DataParallel {
                degree: self.data_parallel,
                shard_optimizer: self.shard_optimizer,
            },
            state: autotune::knobs::StateLayout {
                moments: self.moments,
                masters: self.masters,
                moments_on: self.moments_on,
            },
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
