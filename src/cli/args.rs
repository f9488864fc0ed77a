//! clap argument types. Nothing here touches the filesystem or a device: validation against the
//! environment happens in each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use autotune::settings::check::CheckArgs;
use autotune::settings::data::DataArgs;
use autotune::settings::estimate::EstimateArgs;
use autotune::settings::export::ExportArgs;
use autotune::settings::export_weights::ExportWeightsArgs;
use autotune::settings::probe::ProbeArgs;
use autotune::settings::show::{CompletionsArgs, DeviceArgs, ReportArgs};
use autotune::settings::train::TrainArgs;
use autotune::settings::training::TrainingArgs;
use autotune::settings::tune::{TuneArgs, TuneCommandArgs};

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
    /// Write an output named through a symbolic link (`--out`, `--record`, `--report`,
    /// `--metrics`) to the file the link points to; without it such an output is refused.
    #[arg(long, global = true)]
    pub follow_symlinks: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tune, then train with the plan: the whole job in one command. With no flags it tunes and
    /// trains the tiny preset on learnable synthetic data, on the GPU if there is one.
    Run(Box<RunArgs>),
    /// Search for the fastest setting that fits the target device and write it as a plan.
    Tune(Box<TuneCommandArgs>),
    /// Print a plan's setting as a DeepSpeed config or as Trainer/Accelerate arguments.
    Export(ExportArgs),
    /// Write a checkpoint's weights as a Hugging Face model folder (config.json and
    /// model.safetensors) that `transformers` loads.
    ExportWeights(ExportWeightsArgs),
    /// Re-measure a recorded profile's settings and report regressions (exit 1 on any).
    Check(CheckArgs),
    /// Estimate a setting's peak GPU and host memory without running anything (exit 1 when
    /// it does not fit the target).
    Estimate(EstimateArgs),
    /// Show this machine's GPUs (memory, driver, CUDA, PCIe link), host memory and build.
    Device(DeviceArgs),
    /// Write a plan or a recorded profile as an HTML report: memory and throughput against
    /// micro-batch per regime, the budget, the fits, the chosen setting.
    Report(ReportArgs),
    /// Print a completion script for a shell (bash, zsh, fish, powershell, elvish).
    Completions(CompletionsArgs),
    /// Show what training would see of a dataset: examples as text with the trained spans
    /// marked, the counts (examples, tokens, trained tokens, cut, dropped, padding), or with
    /// --json one line per example with its input ids and labels.
    Data(DataArgs),
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
    /// Hold the trial runners named on stdin, and kill those still held when stdin ends (the
    /// runner watchdog; started by a tune or check through a runner).
    #[command(hide = true, name = "runner-watchdog")]
    RunnerWatchdog,
}

impl Command {
    pub fn wants_json(&self) -> bool {
        match self {
            Command::Train(a) => a.json,
            Command::Probe(a) => a.json,
            Command::ProbeOne | Command::ProbeServe | Command::RunnerWatchdog => true,
            Command::Tune(a) => a.tune.json,
            Command::Run(a) => a.tune.json,
            Command::Export(_) => true,
            Command::ExportWeights(a) => a.json,
            Command::Check(a) => a.json,
            Command::Estimate(a) => a.json,
            Command::Device(a) => a.json,
            Command::Completions(_) => true,
            Command::Data(a) => a.json,
            Command::Report(_) => false,
        }
    }
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

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
