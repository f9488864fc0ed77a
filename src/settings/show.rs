//! The flags of the commands that show something and change nothing: `device` (this machine),
//! `completions` (a shell's completion script) and `report` (a plan or profile as a page).

use std::path::PathBuf;

use clap::Args;

/// The flags of `autotune device`.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// Print one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The flags of `autotune completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, powershell or elvish.
    pub shell: clap_complete::Shell,
}

/// The flags of `autotune report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A plan (`tune --out`), a recorded profile (`tune --record`), or a training run's
    /// metrics log (`--metrics`), drawn as its loss curves.
    #[arg(value_name = "PLAN_PROFILE_OR_METRICS")]
    pub input: PathBuf,
    /// Write the page here (default: stdout).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}
