//! clap argument types. Nothing here touches the filesystem or a device: validation against the
//! environment happens in each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use autotune::knobs::Update;
use autotune::settings::export::ExportArgs;
use autotune::settings::export_weights::ExportWeightsArgs;
use autotune::settings::knobs::{KnobArgs, ModelArgs};
use autotune::settings::show::{CompletionsArgs, DeviceArgs, ReportArgs};
use autotune::settings::train::TrainArgs;
use autotune::settings::training::TrainingArgs;

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
    Run(Box<RunArgs>),
    /// Search for the fastest setting that fits the target device and write it as a plan.
    Tune(Box<TuneArgs>),
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
    Device(DeviceArgs),
    /// Write a plan or a recorded profile as an HTML report: memory and throughput against
    /// micro-batch per regime, the budget, the fits, the chosen setting.
    Report(ReportArgs),
    /// Print a completion script for a shell (bash, zsh, fish, powershell, elvish).
    Completions(CompletionsArgs),
    /// Train a model with explicit knobs, with progress, checkpoints and resume.
    Train(Box<TrainArgs>),
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

/// How search trials are isolated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProbeIsolation {
    /// In this process: fastest; an out-of-memory is caught and the device reused.
    InProcess,
    /// One child process per trial: survives sticky device errors and host allocation aborts,
    /// and every trial meets the device as training will, in a fresh process.
    Child,
    /// One child process serves trial after trial, and is replaced after any trial that
    /// crashed or left device memory behind: each trial starts from an empty memory pool,
    /// without paying a process start and a CUDA context.
    Worker,
}

impl ProbeIsolation {
    /// The default for a target: a worker process on a GPU, in-process on the CPU.
    ///
    /// Measured on an H200 (`benches/results/2026-12-03-h200-stream-order-pool/`): a worker's
    /// trials peak to the byte where fresh processes do (the pool reuses memory in stream order
    /// only, see `autotune::backend`) and cost what their own steps cost, where a fresh child
    /// per trial adds process start and CUDA context to each (gpt-124m tune: 7.8 s in a worker,
    /// 15.8 s with children, 7.4 s in-process, the same plan each). Against in-process trials a
    /// worker confines a crash or a sticky device error to a process that is replaced. The
    /// parent opens no device either way. On the CPU the heap is counted exactly in any process.
    pub fn default_for(kind: autotune::spec::device::DeviceKind) -> Self {
        match kind {
            autotune::spec::device::DeviceKind::Cuda => ProbeIsolation::Worker,
            autotune::spec::device::DeviceKind::Cpu => ProbeIsolation::InProcess,
        }
    }
}

/// Where trials are answered: `live`, `exec` or `replay:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Real trials on this machine, on autotune's engine.
    Live,
    /// Real trials on this machine, each asked of the trial runner given after `--` (any
    /// program that speaks the trial protocol, docs/trial-protocol.md).
    Exec,
    /// Answers from a recorded profile.
    Replay(PathBuf),
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "live" => Ok(Self::Live),
            None if s == "exec" => Ok(Self::Exec),
            Some(("replay", path)) if !path.is_empty() => Ok(Self::Replay(path.into())),
            _ => Err(format!(
                "unknown backend `{s}`; expected live, exec (then `-- RUNNER ARGS...`) or \
                 replay:PATH (a recorded profile)"
            )),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Live => f.write_str("live"),
            Self::Exec => f.write_str("exec"),
            Self::Replay(path) => write!(f, "replay:{}", path.display()),
        }
    }
}

#[derive(Debug, Args)]
pub struct TuneArgs {
    /// Model preset (tiny, seed, gpt-124m, gpt-350m, gpt-1.3b, gpt-2b) or a JSON spec file.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Target machine: auto (this machine's GPU, else the CPU), a built-in profile
    /// (rtx4090-32g, h200, cpu) or a JSON profile file. A smaller GPU is emulated on a larger one.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Sequences per optimizer step; the plan's micro-batch × accumulation equals it.
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Largest micro-batch to try.
    #[arg(long, default_value_t = 1024)]
    pub max_micro_batch: usize,
    /// Precisions to consider (repeatable); default bf16 on a GPU, fp32 on a CPU.
    #[arg(long)]
    pub precision: Vec<autotune::Precision>,
    /// Activation checkpointing settings to consider (repeatable: none, all, every-K); default
    /// none and all.
    #[arg(long)]
    pub checkpointing: Vec<autotune::Checkpointing>,
    /// Optimizer offload settings to consider (repeatable: none, optimizer); default both on a
    /// GPU, none on a CPU.
    #[arg(long)]
    pub offload: Vec<autotune::Offload>,
    /// When the optimizer updates (repeatable: after-backward, in-backward); default both where
    /// the update in backward is exactly the normal step (no gradient clipping, no
    /// --global-batch, no fp16 or offload, one GPU).
    #[arg(long)]
    pub update: Vec<Update>,
    /// Data-parallel degrees to consider (repeatable, each at most the profile's gpu_count);
    /// default every GPU of the profile and the powers of two below. `--global-batch` is then
    /// the batch over all GPUs.
    #[arg(long, value_name = "N")]
    pub data_parallel: Vec<usize>,
    /// Fraction of each memory budget kept free (default 0.05).
    #[arg(long)]
    pub headroom: Option<f64>,
    /// Stop after this many search trials and choose among what was measured.
    #[arg(long, alias = "max-probes")]
    pub max_trials: Option<usize>,
    /// Stop growing a micro-batch once doubling it gains less than this fraction of throughput
    /// (0 = grow to the memory boundary).
    #[arg(long, default_value_t = autotune::search::space::SearchSpace::DEFAULT_SATURATION_GAIN)]
    pub saturation_gain: f64,
    /// Also consider compact optimizer state: 8-bit block-wise moments with bf16 masters
    /// rounded stochastically, the moments on the GPU or streamed from host memory. Not exactly
    /// AdamW; the plan says so. What makes models past ~1.5B parameters trainable on a 24 GB
    /// card without offloading the update to the CPU.
    #[arg(long)]
    pub allow_compact_state: bool,
    /// Untimed steps per trial (default 1).
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Timed steps per trial (default 3).
    #[arg(long)]
    pub timed_steps: Option<usize>,
    /// How trials are isolated (default: a worker process on a GPU, in-process on the CPU).
    /// With `--backend exec`: `worker` (the default) lets a runner that says it can serve
    /// again run the next trial too, `child` starts a new runner for every trial.
    #[arg(long, value_enum)]
    pub isolation: Option<ProbeIsolation>,
    /// Seconds a child, worker or data-parallel trial may run before it is stopped as timed
    /// out (an infeasible setting; a worker is then replaced). Default: 900 s until a trial
    /// fits, then ten times what the slowest trial so far predicts, at least 120 s. In-process
    /// trials cannot be stopped.
    #[arg(long, value_name = "SECONDS")]
    pub trial_timeout: Option<f64>,
    /// Where trials run: `live` (this machine, autotune's engine), `exec` (this machine, each
    /// trial asked of the trial runner given after `--`, e.g. a PyTorch script built on
    /// harness/autotune_harness; see docs/trial-protocol.md) or `replay:PROFILE` (answered from
    /// a recorded profile, offline and deterministic; the profile's model, device and space
    /// are used).
    #[arg(long, default_value = "live")]
    pub backend: Backend,
    /// The trial runner of `--backend exec` and its arguments, after `--`.
    #[arg(last = true, value_name = "RUNNER")]
    pub runner: Vec<String>,
    /// Record every trial into a profile file (for `autotune check` and replays).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Write the plan here (atomically).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write an HTML report of the search here (see `autotune report`).
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Print the plan as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub tune: TuneArgs,
    /// Directory for the plan and checkpoints.
    #[arg(long, default_value = "autotune-run")]
    pub run_dir: PathBuf,
    #[command(flatten)]
    pub training: TrainingArgs,
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

#[cfg(test)]
mod tests {
    use super::Backend;

    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    #[test]
    fn backends_parse() {
        assert_eq!("live".parse::<Backend>(), Ok(Backend::Live));
        assert_eq!("exec".parse::<Backend>(), Ok(Backend::Exec));
        assert!("exec:python3".parse::<Backend>().is_err());
        assert_eq!(
            "replay:p/x.json".parse::<Backend>(),
            Ok(Backend::Replay("p/x.json".into()))
        );
        assert!("replay:".parse::<Backend>().is_err());
        assert!("sim".parse::<Backend>().is_err());
        assert_eq!(
            Backend::Replay("p/x.json".into()).to_string(),
            "replay:p/x.json"
        );
    }
}
