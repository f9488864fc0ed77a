//! `tune`'s arguments resolved once into what the search needs: the model, the target, its
//! budget and search space, and how trials are isolated. Everything a flag can get wrong is
//! refused here, before a trial runs.

use std::path::PathBuf;

use autotune::probe::host_work::adam_update_floor_s;
use autotune::profile::record::Profile;
use autotune::search::setup::{Runtime, SearchSetup};
use autotune::search::space::{SearchSpace, SpaceRequest};
use autotune::search::MachineFacts;
use autotune::spec::budget::Budget;
use autotune::spec::device::DeviceSpec;
use autotune::ModelSpec;

use autotune::knobs::Update;
use autotune::probe::runner::RunnerCommand;
use autotune::probe::timeout::TrialTimeout;

use crate::cli::args::{Backend, ProbeIsolation, TuneArgs};
use crate::cli::flags::{self, as_flag};

/// A validated `tune`.
pub struct TuneConfig {
    /// Where the trials' answers come from.
    pub source: Source,
    /// Record every trial into this profile.
    pub record: Option<PathBuf>,
    /// Write the plan here.
    pub out: Option<PathBuf>,
    /// Write the search's HTML report here.
    pub report: Option<PathBuf>,
}

/// Where a search's trials are answered.
pub enum Source {
    /// Real trials on this machine.
    Live(Box<LiveSearch>),
    /// A recorded profile: its model, target and space, every trial answered from it.
    Replay {
        /// The profile's file, for messages.
        path: PathBuf,
        /// The profile.
        profile: Box<Profile>,
    },
}

/// A search run on this machine, on autotune's engine or through a trial runner.
pub struct LiveSearch {
    /// The model.
    pub spec: ModelSpec,
    /// The machine planned for (a smaller GPU is emulated on a larger one).
    pub target: DeviceSpec,
    /// The target's limits, with the requested headroom.
    pub budget: Budget,
    /// The settings to search.
    pub space: SearchSpace,
    /// What the search assumes of this machine and the target.
    pub facts: MachineFacts,
    /// How trials are isolated from this process and from each other.
    pub isolation: ProbeIsolation,
    /// How long a trial in another process may run.
    pub trial_timeout: TrialTimeout,
    /// The trial runner that measures every trial (`--backend exec -- RUNNER`); `None` for
    /// autotune's own engine.
    pub runner: Option<RunnerCommand>,
}

impl TuneConfig {
    /// Resolves and checks `args`.
    pub fn from_args(args: &TuneArgs) -> anyhow::Result<Self> {
        // Where the results go is checked first: a search can take long, and its plan must not
        // be lost to a typo in a path.
        for (flag, path) in [
            ("--out", &args.out),
            ("--record", &args.record),
            ("--report", &args.report),
        ] {
            if let Some(path) = path {
                autotune::atomic_file::check_writable(path).map_err(|e| {
                    anyhow::anyhow!("`{flag} {}` cannot be written: {e}", path.display())
                })?;
            }
        }
        let runner = runner_command(&args.backend, &args.runner)?;
        let source = match &args.backend {
            Backend::Replay(path) => Source::Replay {
                path: path.clone(),
                profile: Box::new(Profile::load(path)?),
            },
            Backend::Live | Backend::Exec => {
                Source::Live(Box::new(LiveSearch::from_args(args, runner)?))
            }
        };
        Ok(Self {
            source,
            record: args.record.clone(),
            out: args.out.clone(),
            report: args.report.clone(),
        })
    }
}

/// The trial runner `--backend exec` runs (the words after `--`), checked against the
/// backend: exec needs one, the others take none.
pub fn runner_command(backend: &Backend, argv: &[String]) -> anyhow::Result<Option<RunnerCommand>> {
    match (backend, RunnerCommand::new(argv)) {
        (Backend::Exec, Some(runner)) => Ok(Some(runner)),
        (Backend::Exec, None) => Err(autotune_core::Error::InvalidFlag {
            flag: "--backend exec".into(),
            problem: "needs the trial runner after `--`, e.g. `--backend exec -- python3 \
                      harness/examples/gpt_runner.py` (docs/trial-protocol.md)"
                .into(),
        }
        .into()),
        (_, None) => Ok(None),
        (other, Some(runner)) => Err(autotune_core::Error::InvalidFlag {
            flag: format!("-- {}", runner.display()),
            problem: format!(
                "a trial runner is only run by `--backend exec`, not by `--backend {other}`; \
                 add --backend exec, or drop what follows `--`"
            ),
        }
        .into()),
    }
}

impl LiveSearch {
    fn from_args(args: &TuneArgs, runner: Option<RunnerCommand>) -> anyhow::Result<Self> {
        let spec = ModelSpec::resolve(&args.model)?;
        let target = target_profile(&args.device)?;
        let mut budget = Budget::from_device(&target);
        if let Some(h) = args.headroom {
            budget.headroom = h;
        }
        budget.validate().map_err(|e| as_flag(e, flags::TUNE))?;
        let mut request = space_request(args);
        if runner.is_some() {
            exec_space(&mut request)?;
        }
        let isolation_asked = runner_isolation(&runner, args.isolation);
        let trial_timeout = trial_timeout(args.trial_timeout);
        // A refused flag costs no measurement: the host floor is measured only when every flag
        // is valid, and the space's errors are still the first reported.
        let flags_valid = isolation_asked.is_ok() && trial_timeout.is_ok();
        let floor = |parameters| {
            flags_valid
                .then(|| adam_update_floor_s(parameters))
                .flatten()
        };
        let runtime = Runtime {
            flash_head_dims: &autotune::ops::FLASH_HEAD_DIMS,
            host_adam_floor_s: &floor,
        };
        let SearchSetup {
            space,
            facts,
            dropped,
        } = SearchSetup::resolve(&spec, &target, &budget, &request, &runtime)
            .map_err(|e| as_flag(e, flags::TUNE))?;
        if space.max_micro_batch < request.max_micro_batch {
            tracing::debug!(
                asked = request.max_micro_batch,
                reach = space.max_micro_batch,
                "largest micro-batch capped at what the budget can hold"
            );
        }
        for regime in dropped {
            tracing::info!(%regime, "not tried: its training state alone exceeds the budget");
        }
        if facts.target_link_gbps.is_some() {
            tracing::debug!(
                floor_s = facts.offload_host_floor_s,
                target_link_gbps = facts.target_link_gbps,
                "host update floor for offloaded regimes"
            );
        }
        let isolation = match isolation_asked? {
            Some(isolation) => isolation,
            None => isolation(args.isolation, &target, &space),
        };
        let trial_timeout = trial_timeout?;
        Ok(Self {
            spec,
            target,
            budget,
            space,
            facts,
            isolation,
            trial_timeout,
            runner,
        })
    }
}

/// The space a trial runner searches: one GPU (a runner trains in one process), and the
/// optimizer step after backward unless `--update` asks for more (the tools a runner's plan
/// is exported to have no update in backward).
fn exec_space(request: &mut SpaceRequest) -> anyhow::Result<()> {
    if let Some(&degree) = request.data_parallel.iter().find(|&&d| d > 1) {
        return Err(autotune_core::Error::InvalidFlag {
            flag: format!("--data-parallel {degree}"),
            problem: "a trial runner trains in one process on one GPU; data-parallel trials \
                      run on autotune's own engine (--backend live)"
                .into(),
        }
        .into());
    }
    request.data_parallel = vec![1];
    if request.updates.is_empty() {
        request.updates = vec![Update::AfterBackward];
    }
    Ok(())
}

/// The isolation a trial runner runs with, when one does: the one asked, a worker by
/// default; in-process is refused. `None` without a runner.
fn runner_isolation(
    runner: &Option<RunnerCommand>,
    asked: Option<ProbeIsolation>,
) -> anyhow::Result<Option<ProbeIsolation>> {
    match (runner, asked) {
        (Some(_), Some(ProbeIsolation::InProcess)) => Err(autotune_core::Error::InvalidFlag {
            flag: "--isolation in-process".into(),
            problem: "a trial runner always runs in its own process; use worker (a runner that \
                      says it can serve again runs the next trial too) or child (a new runner \
                      for every trial)"
                .into(),
        }
        .into()),
        (Some(_), asked) => Ok(Some(asked.unwrap_or(ProbeIsolation::Worker))),
        (None, _) => Ok(None),
    }
}

/// The trial time limit `--trial-timeout` sets, or the scaled default.
fn trial_timeout(seconds: Option<f64>) -> anyhow::Result<TrialTimeout> {
    match seconds {
        None => Ok(TrialTimeout::scaled()),
        Some(s) if s.is_finite() && s > 0.0 && s <= autotune::trial::MAX_STEP_TIME_S => {
            Ok(TrialTimeout::fixed(std::time::Duration::from_secs_f64(s)))
        }
        Some(s) => Err(autotune_core::Error::InvalidFlag {
            flag: "--trial-timeout".into(),
            problem: format!(
                "({s}) must be a number of seconds above 0 and at most {:e}",
                autotune::trial::MAX_STEP_TIME_S
            ),
        }
        .into()),
    }
}

/// `auto` (the local GPU, or the built-in CPU profile), a built-in name, or a JSON file.
pub fn target_profile(name: &str) -> anyhow::Result<DeviceSpec> {
    if name != "auto" {
        return Ok(DeviceSpec::resolve(name)?);
    }
    match autotune::backend::detect_gpu_profile()? {
        Some(profile) => Ok(profile),
        None => Ok(DeviceSpec::builtin("cpu")?),
    }
}

fn space_request(args: &TuneArgs) -> SpaceRequest {
    SpaceRequest {
        precisions: args.precision.clone(),
        checkpointing: args.checkpointing.clone(),
        offload: args.offload.clone(),
        updates: args.update.clone(),
        data_parallel: args.data_parallel.clone(),
        max_micro_batch: args.max_micro_batch,
        global_batch: args.global_batch,
        warmup_steps: args.warmup_steps,
        timed_steps: args.timed_steps,
        max_trials: args.max_trials,
        saturation_gain: args.saturation_gain,
        compact_state: args.allow_compact_state,
    }
}

/// The isolation asked for, or the target's default; a space with data-parallel regimes
/// always uses child processes: an in-process trial keeps its memory pool on GPU 0, where
/// rank 0 of the next data-parallel trial would find it missing.
fn isolation(
    asked: Option<ProbeIsolation>,
    target: &DeviceSpec,
    space: &SearchSpace,
) -> ProbeIsolation {
    if space.regimes.iter().any(|r| r.data_parallel.degree > 1) {
        return ProbeIsolation::Child;
    }
    asked.unwrap_or_else(|| ProbeIsolation::default_for(target.kind))
}
