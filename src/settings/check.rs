//! `autotune check`'s flags and [`CheckSettings`]: the recording to check, the tolerances, and
//! where fresh trials come from, every combination that cannot work refused before a trial.

use std::path::PathBuf;

use clap::Args;

use super::tune::{runner_command, Backend};
use crate::probe::runner::RunnerCommand;
use crate::profile::check::Tolerance;
use crate::profile::record::Profile;
use crate::trial_protocol::allocator;
use crate::{Error, Result};

/// The flags of `autotune check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The recorded profile to check (e.g. profiles/recorded/DEVICE/MODEL.json).
    #[arg(long)]
    pub profile: PathBuf,
    /// Where fresh trials come from: `live` runs them on this machine, emulating the profile's
    /// device (its GPU capacity and host budget); `exec` asks them of the trial runner given
    /// after `--` (for a profile recorded through one); `replay:PATH` answers them from another
    /// recorded profile, to compare two recordings.
    #[arg(long, default_value = "live")]
    pub backend: Backend,
    /// The trial runner of `--backend exec` and its arguments, after `--`.
    #[arg(last = true, value_name = "RUNNER")]
    pub runner: Vec<String>,
    /// Device for live trials: auto (the kind the profile was recorded on), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Print the report as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
    /// Smallest relative step-time change that counts: a change must exceed this fraction or 3
    /// standard errors of the medians, whichever is larger.
    #[arg(long, default_value_t = Tolerance::DEFAULT_TIME_THRESHOLD)]
    pub time_tolerance: f64,
    /// Smallest relative peak-memory change that counts: a change must exceed this fraction of
    /// the recorded peak or 64 MiB, whichever is larger.
    #[arg(long, default_value_t = Tolerance::DEFAULT_MEMORY_THRESHOLD)]
    pub memory_tolerance: f64,
}

/// Where a check's fresh trials come from.
#[derive(Debug)]
pub enum FreshTrials {
    /// Run on this machine, on autotune's engine, on the device named (`auto`: the kind the
    /// profile was recorded on).
    Live {
        /// The device, as given.
        device: String,
    },
    /// Asked of a trial runner.
    Exec(RunnerCommand),
    /// Answered from another recording of the same model on the same device.
    Replay {
        /// Its file.
        path: PathBuf,
        /// The recording.
        other: Box<Profile>,
    },
}

/// A validated `check`.
#[derive(Debug)]
pub struct CheckSettings {
    /// The recording's file.
    pub path: PathBuf,
    /// The recording to check against.
    pub profile: Profile,
    /// What counts as a change.
    pub tolerance: Tolerance,
    /// Where the fresh trials come from.
    pub fresh: FreshTrials,
    /// The backend as given, for the report.
    pub backend: String,
}

impl CheckSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &CheckArgs) -> Result<Self> {
        let tolerance = tolerance(args)?;
        let profile = Profile::load(&args.profile)?;
        if profile.trials.is_empty() {
            return Err(Error::Usage(format!(
                "`{}` holds no trials, so there is nothing to check against; record one with `autotune tune --record`",
                args.profile.display()
            )));
        }
        // A runner given to another backend is refused before any trial.
        let runner = runner_command(&args.backend, &args.runner)?;
        let fresh = match (&args.backend, runner) {
            (Backend::Replay(path), _) => {
                let other = Profile::load(path)?;
                if let Some(why) = profile.setup_differs(&other) {
                    return Err(Error::Usage(format!(
                        "cannot compare `{}` with `{}`: {why}; compare recordings of one model on one device",
                        args.profile.display(),
                        path.display()
                    )));
                }
                FreshTrials::Replay {
                    path: path.clone(),
                    other: Box::new(other),
                }
            }
            (Backend::Exec, Some(runner)) => {
                // Re-measured under the allocator setting the recording ran under.
                match profile.allocator.as_deref() {
                    Some(setting) => FreshTrials::Exec(
                        runner.with_env(allocator::VARIABLE, allocator::variable_value(setting)),
                    ),
                    None => FreshTrials::Exec(runner),
                }
            }
            (Backend::Exec, None) => {
                return Err(Error::Usage(
                    "--backend exec needs the trial runner after `--`".into(),
                ))
            }
            (Backend::Live, _) => live(args, &profile)?,
        };
        Ok(Self {
            path: args.profile.clone(),
            profile,
            tolerance,
            fresh,
            backend: args.backend.to_string(),
        })
    }
}

/// Live trials, refused for a recording that a trial runner measured on another engine.
fn live(args: &CheckArgs, profile: &Profile) -> Result<FreshTrials> {
    if let Some(engine) = &profile.engine {
        return Err(Error::Usage(format!(
            "`{}` was recorded through a trial runner on the {engine} engine, which \
             autotune's engine does not measure; re-measure it with the same runner: \
             `autotune check --profile {} --backend exec -- RUNNER ARGS...`",
            args.profile.display(),
            args.profile.display()
        )));
    }
    Ok(FreshTrials::Live {
        device: args.device.clone(),
    })
}

/// The tolerances the flags ask for.
fn tolerance(args: &CheckArgs) -> Result<Tolerance> {
    for (flag, value) in [
        ("--time-tolerance", args.time_tolerance),
        ("--memory-tolerance", args.memory_tolerance),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(Error::Usage(format!(
                "{flag} ({value}) must be a non-negative fraction, e.g. 0.05 for 5%"
            )));
        }
    }
    let tolerance = Tolerance {
        time_threshold: args.time_tolerance,
        memory_threshold: args.memory_tolerance,
        ..Tolerance::default()
    };
    tolerance.validate()?;
    Ok(tolerance)
}
