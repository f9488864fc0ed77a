//! `tune`: its flags ([`TuneArgs`]) resolved once into what the search needs
//! ([`TuneSettings`]): where the trials' answers come from, and for a search on this machine
//! the model, the target, its budget, the search space and the machine's facts, and how trials
//! are isolated. Everything a flag can get wrong is refused here, before a trial runs.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::data::profile::DataShape;
use crate::knobs::{Precision, Update};
use crate::ops::FLASH_HEAD_DIMS;
use crate::probe::host_work::adam_update_floor_s;
use crate::probe::runner::RunnerCommand;
use crate::probe::timeout::TrialTimeout;
use crate::profile::record::Profile;
use crate::search::setup::{Runtime, SearchSetup};
use crate::search::space::{SearchSpace, SpaceRequest};
use crate::search::MachineFacts;
use crate::spec::budget::Budget;
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::model::ModelSpec;
use crate::trial_protocol::allocator;

use super::allocator::{runner_allocator, Allocator};
use super::dataset::DatasetArgs;
use super::flags::{self, as_flag};
use super::model::model_folder;
use super::optimizer::OptimizerArgs;
use super::target::TargetArgs;

/// `tune`'s flags (also the tuning half of `run`'s).
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub planned: TargetArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub optimizer: OptimizerArgs,
    /// Sequences per optimizer step; the plan's micro-batch × accumulation equals it.
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// Largest micro-batch to try.
    #[arg(long, default_value_t = 1024)]
    pub max_micro_batch: usize,
    /// Precisions to consider (repeatable); default bf16 on a GPU, fp32 on a CPU.
    #[arg(long)]
    pub precision: Vec<crate::Precision>,
    /// Activation checkpointing settings to consider (repeatable: none, all, every-K); default
    /// none and all.
    #[arg(long)]
    pub checkpointing: Vec<crate::Checkpointing>,
    /// Optimizer offload settings to consider (repeatable: none, optimizer); default both on a
    /// GPU, none on a CPU.
    #[arg(long)]
    pub offload: Vec<crate::Offload>,
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
    #[arg(long, default_value_t = crate::search::space::SearchSpace::DEFAULT_SATURATION_GAIN)]
    pub saturation_gain: f64,
    /// Also consider compact optimizer state: 8-bit block-wise moments with bf16 masters
    /// rounded stochastically, the moments on the GPU or streamed from host memory. Not exactly
    /// AdamW; the plan says so. What makes models past ~1.5B parameters trainable on a 24 GB
    /// card without offloading the update to the CPU.
    #[arg(long)]
    pub allow_compact_state: bool,
    /// Also search fp8 matrix products in the Transformer blocks (E4M3 weights and
    /// activations, E5M2 gradients, per-tensor scaling), which GPUs with fp8 tensor cores (RTX
    /// 40xx, L4, L40, H100, H200) multiply at twice bf16's rate; the loss differs from bf16's
    /// (within 2 % over 300 steps of a small model, emulated), and the plan says so. Tried only
    /// where both the target and this machine's GPU have them; otherwise the tune says why.
    #[arg(long)]
    pub allow_fp8: bool,
    /// Untimed steps at the start of each trial (default 1).
    #[arg(long, value_name = "N")]
    pub trial_warmup_steps: Option<usize>,
    /// The trials' untimed steps, by their earlier name (now `--trial-warmup-steps`;
    /// `--lr-warmup-steps` warms up the learning rate).
    #[arg(
        long,
        value_name = "N",
        hide = true,
        conflicts_with = "trial_warmup_steps"
    )]
    pub warmup_steps: Option<usize>,
    /// Trials spent measuring the longest single sequence the plan can take, after the search
    /// (0: predict it only).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(0..=16))]
    pub edge_trials: u64,
    /// Timed steps of each trial (default 3).
    #[arg(long, value_name = "N")]
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
    /// With `--backend exec`: PyTorch's CUDA allocator setting the runner's trials run under,
    /// given to it as PYTORCH_CUDA_ALLOC_CONF and carried by the plan to its exports. Default:
    /// the PYTORCH_CUDA_ALLOC_CONF of this environment if set, else expandable segments.
    #[arg(long, value_enum)]
    pub allocator: Option<Allocator>,
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

/// `tune`'s flags: the search's, and the data it tunes on.
#[derive(Debug, Args)]
pub struct TuneCommandArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub tune: TuneArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub dataset: DatasetArgs,
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
    /// only, see `crate::backend`) and cost what their own steps cost, where a fresh child
    /// per trial adds process start and CUDA context to each (gpt-124m tune: 7.8 s in a worker,
    /// 15.8 s with children, 7.4 s in-process, the same plan each). Against in-process trials a
    /// worker confines a crash or a sticky device error to a process that is replaced. The
    /// parent opens no device either way. On the CPU the heap is counted exactly in any process.
    pub fn default_for(kind: DeviceKind) -> Self {
        match kind {
            DeviceKind::Cuda => ProbeIsolation::Worker,
            DeviceKind::Cpu => ProbeIsolation::InProcess,
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

/// `tune`'s validated settings.
pub struct TuneSettings {
    /// Where the trials' answers come from.
    pub source: Source,
    /// Record every trial into this profile.
    pub record: Option<PathBuf>,
    /// Write the plan here.
    pub out: Option<PathBuf>,
    /// Write the search's HTML report here.
    pub report: Option<PathBuf>,
    /// What people should know about the flags as given (a renamed flag's old name).
    pub notes: Vec<String>,
}

/// Where a search's trials are answered.
pub enum Source {
    /// Real trials on this machine.
    Live(Box<LiveSettings>),
    /// A recorded profile: its model, target and space, every trial answered from it.
    Replay {
        /// The profile's file, for messages.
        path: PathBuf,
        /// The profile.
        profile: Box<Profile>,
    },
}

/// A search run on this machine, on autotune's engine or through a trial runner.
pub struct LiveSettings {
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
    /// The dataset the search tunes on: its trials run its widest micro-batch, and the plan
    /// records it. `None`: synthetic sequences of the model's length.
    pub data: Option<DataShape>,
    /// The model's Hugging Face folder, as an absolute path, when it is one.
    pub model_folder: Option<PathBuf>,
    /// Trials spent measuring the longest sequence the plan takes.
    pub edge_trials: usize,
    /// What people should know about the space as searched (fp8 asked for but not tried).
    pub notes: Vec<String>,
}

impl TuneSettings {
    /// Resolves and checks `args`, for a search tuned on `data` when given (a dataset loaded
    /// for the model `args` name, [`crate::session::data::shape`]).
    pub fn from_args(args: &TuneArgs, data: Option<DataShape>) -> crate::Result<Self> {
        // Where the results go is checked first: a search can take long, and its plan must not
        // be lost to a typo in a path.
        let outputs: Vec<(&str, &Path)> = [
            ("--out", &args.out),
            ("--record", &args.record),
            ("--report", &args.report),
        ]
        .into_iter()
        .filter_map(|(flag, path)| Some((flag, path.as_deref()?)))
        .collect();
        let mut inputs: Vec<(&str, &Path)> = vec![("--model", Path::new(&args.planned.model))];
        if let Backend::Replay(profile) = &args.backend {
            inputs.push(("--backend replay", profile));
        }
        crate::outputs::check_outputs(&outputs, &inputs)?;
        for (flag, path) in [
            ("--out", &args.out),
            ("--record", &args.record),
            ("--report", &args.report),
        ] {
            if let Some(path) = path {
                crate::atomic_file::check_writable(path).map_err(|e| {
                    crate::Error::Usage(format!(
                        "`{flag} {}` cannot be written: {e}",
                        path.display()
                    ))
                })?;
            }
        }
        let runner = with_allocator(runner_command(&args.backend, &args.runner)?, args)?;
        args.check_longest(data.is_some())?;
        if let (Some(_), Backend::Replay(_) | Backend::Exec) = (&data, &args.backend) {
            return Err(autotune_core::Error::InvalidFlag {
                flag: format!("--backend {}", args.backend),
                problem: "tunes on what its recording or its trial runner trains on, not on \
                          --data; tune on a dataset with autotune's own engine (--backend live)"
                    .into(),
            }
            .into());
        }
        let mut notes = renamed_flags(args);
        let source = match &args.backend {
            Backend::Replay(path) => Source::Replay {
                path: path.clone(),
                profile: Box::new(Profile::load(path)?),
            },
            Backend::Live | Backend::Exec => {
                let live = LiveSettings::from_args(args, runner, data)?;
                notes.extend(live.notes.iter().cloned());
                Source::Live(Box::new(live))
            }
        };
        Ok(Self {
            source,
            record: args.record.clone(),
            out: args.out.clone(),
            report: args.report.clone(),
            notes,
        })
    }
}

/// The notes the renamed flags' old names leave, when they were used.
fn renamed_flags(args: &TuneArgs) -> Vec<String> {
    let mut notes = Vec::new();
    notes.extend(args.planned.note());
    if args.warmup_steps.is_some() {
        notes.push(flags::renamed("--warmup-steps", "--trial-warmup-steps"));
    }
    notes
}

impl TuneArgs {
    /// Refuses `--seq-len auto` where it cannot apply: with a dataset (`with_data`: its
    /// examples set the length), a replay or a trial runner.
    pub fn check_longest(&self, with_data: bool) -> crate::Result<()> {
        if !self.planned.longest_asked() {
            return Ok(());
        }
        let clash = match (with_data, &self.backend) {
            (true, _) => Some("--data: the data's examples set the length; give --seq-len N"),
            (_, Backend::Replay(_)) => Some("--backend replay: a recording holds one length"),
            (_, Backend::Exec) => {
                Some("--backend exec: the longest is measured on autotune's engine")
            }
            _ => None,
        };
        match clash {
            Some(problem) => Err(autotune_core::Error::InvalidFlag {
                flag: "--seq-len auto".into(),
                problem: format!("cannot be combined with {problem}"),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Untimed steps per trial, under their new name or their old one.
    pub fn trial_warmup_steps(&self) -> Option<usize> {
        self.trial_warmup_steps.or(self.warmup_steps)
    }
}

/// The trial runner `--backend exec` runs (the words after `--`), checked against the
/// backend: exec needs one, the others take none.
pub fn runner_command(backend: &Backend, argv: &[String]) -> crate::Result<Option<RunnerCommand>> {
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

/// `runner` with the allocator setting its trials run under in its environment; `--allocator`
/// without a runner is refused.
fn with_allocator(
    runner: Option<RunnerCommand>,
    args: &TuneArgs,
) -> crate::Result<Option<RunnerCommand>> {
    let Some(runner) = runner else {
        return match args.allocator {
            Some(_) => Err(autotune_core::Error::InvalidFlag {
                flag: "--allocator".into(),
                problem: "sets the allocator of a PyTorch trial runner; add --backend exec \
                          -- RUNNER, or drop it (autotune's engine has an allocator of its own)"
                    .into(),
            }
            .into()),
            None => Ok(None),
        };
    };
    let environment = std::env::var(allocator::VARIABLE).ok();
    let setting = runner_allocator(args.allocator, environment.as_deref());
    let value = allocator::variable_value(&setting);
    Ok(Some(runner.with_env(allocator::VARIABLE, value)))
}

impl LiveSettings {
    fn from_args(
        args: &TuneArgs,
        runner: Option<RunnerCommand>,
        data: Option<DataShape>,
    ) -> crate::Result<Self> {
        let mut spec = args.planned.model_spec()?;
        if let Some(data) = &data {
            spec.seq_len = data.sequence_tokens();
        }
        args.optimizer.apply(&mut spec)?;
        let target = args.planned.spec()?;
        let mut budget = Budget::from_device(&target);
        if let Some(h) = args.headroom {
            budget.headroom = h;
        }
        budget.validate().map_err(|e| as_flag(e, flags::TUNE))?;
        let mut request = space_request(args);
        if runner.is_some() {
            exec_space(&mut request)?;
        }
        let notes: Vec<String> = settle_fp8(&mut request, &target)?.into_iter().collect();
        let isolation_asked = runner_isolation(&runner, args.isolation);
        let trial_timeout = trial_timeout(args.trial_timeout);
        // A refused flag costs no measurement: the host floor is measured only when every flag
        // is valid, and the space's errors are still the first reported.
        let measure = isolation_asked.is_ok() && trial_timeout.is_ok();
        let own_engine = runner.is_none();
        let SearchSetup { space, facts, .. } =
            search_setup(&spec, &target, &budget, &request, measure, own_engine)?;
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
            data,
            model_folder: model_folder(&args.planned.model).and_then(|f| f.canonicalize().ok()),
            edge_trials: args.edge_trials as usize,
            notes,
        })
    }
}

/// fp8 in `request` as this machine and `target` can run it: `--allow-fp8` where neither has
/// fp8 tensor cores is dropped, with the note that says why; `--precision fp8` there is refused
/// (it names the only precision to search).
fn settle_fp8(request: &mut SpaceRequest, target: &DeviceSpec) -> crate::Result<Option<String>> {
    let named = request.precisions.contains(&Precision::Fp8);
    if !(request.fp8 || named) {
        return Ok(None);
    }
    match fp8_not_searched(target) {
        Some(why) if named => Err(autotune_core::Error::InvalidFlag {
            flag: "--precision fp8".into(),
            problem: why,
        }
        .into()),
        Some(why) => {
            request.fp8 = false;
            Ok(Some(why))
        }
        None => Ok(None),
    }
}

/// Why `--allow-fp8` searches nothing here, if it does not: the target has no fp8 tensor
/// cores, or this machine's first GPU, which runs the trials, has none (its products would
/// fail there).
fn fp8_not_searched(target: &DeviceSpec) -> Option<String> {
    if let Some(why) = SearchSpace::fp8_not_searched(target) {
        return Some(why);
    }
    match crate::backend::detect::detect_gpu_profile() {
        Ok(Some(gpu)) if !gpu.fp8_tensor_cores => Some(format!(
            "fp8 is not searched: this machine's GPU ({}) has no fp8 tensor cores (compute \
             capability 8.9 or newer) to measure it on",
            gpu.name
        )),
        _ => None,
    }
}

/// The search's space and facts, with this build's flash-attention kernels and, when
/// `measure` and an offloaded regime is searched, this machine's host update floor; what the
/// budget ruled out is logged. `own_engine`: the trials run autotune's engine, not a runner's.
fn search_setup(
    spec: &ModelSpec,
    target: &DeviceSpec,
    budget: &Budget,
    request: &SpaceRequest,
    measure: bool,
    own_engine: bool,
) -> crate::Result<SearchSetup> {
    let floor = |parameters| measure.then(|| adam_update_floor_s(parameters)).flatten();
    let runtime = Runtime {
        flash_head_dims: &FLASH_HEAD_DIMS,
        host_adam_floor_s: &floor,
        own_engine,
    };
    let setup = SearchSetup::resolve(spec, target, budget, request, &runtime)
        .map_err(|e| as_flag(e, flags::TUNE))?;
    if setup.space.max_micro_batch < request.max_micro_batch {
        tracing::debug!(
            asked = request.max_micro_batch,
            reach = setup.space.max_micro_batch,
            "largest micro-batch capped at what the budget can hold"
        );
    }
    for regime in &setup.dropped {
        tracing::info!(%regime, "not tried: its training state alone exceeds the budget");
    }
    if setup.facts.target_link_gbps.is_some() {
        tracing::debug!(
            floor_s = setup.facts.offload_host_floor_s,
            target_link_gbps = setup.facts.target_link_gbps,
            "host update floor for offloaded regimes"
        );
    }
    Ok(setup)
}

/// The space a trial runner searches: one GPU (a runner trains in one process), and the
/// optimizer step after backward unless `--update` asks for more (the tools a runner's plan
/// is exported to have no update in backward).
fn exec_space(request: &mut SpaceRequest) -> crate::Result<()> {
    if let Some(&degree) = request.data_parallel.iter().find(|&&d| d > 1) {
        return Err(autotune_core::Error::InvalidFlag {
            flag: format!("--data-parallel {degree}"),
            problem: "a trial runner trains in one process on one GPU; data-parallel trials \
                      run on autotune's own engine (--backend live)"
                .into(),
        }
        .into());
    }
    if request.fp8 || request.precisions.contains(&Precision::Fp8) {
        let flag = if request.fp8 {
            "--allow-fp8"
        } else {
            "--precision fp8"
        };
        return Err(autotune_core::Error::InvalidFlag {
            flag: flag.into(),
            problem: "fp8 products are autotune's own engine's; a trial runner trains with its \
                      own (drop it, or tune with --backend live)"
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
) -> crate::Result<Option<ProbeIsolation>> {
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
fn trial_timeout(seconds: Option<f64>) -> crate::Result<TrialTimeout> {
    match seconds {
        None => Ok(TrialTimeout::scaled()),
        Some(s) if s.is_finite() && s > 0.0 && s <= crate::trial::MAX_STEP_TIME_S => {
            Ok(TrialTimeout::fixed(std::time::Duration::from_secs_f64(s)))
        }
        Some(s) => Err(autotune_core::Error::InvalidFlag {
            flag: "--trial-timeout".into(),
            problem: format!(
                "({s}) must be a number of seconds above 0 and at most {:e}",
                crate::trial::MAX_STEP_TIME_S
            ),
        }
        .into()),
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
        warmup_steps: args.trial_warmup_steps(),
        timed_steps: args.timed_steps,
        max_trials: args.max_trials,
        saturation_gain: args.saturation_gain,
        compact_state: args.allow_compact_state,
        fp8: args.allow_fp8,
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

#[cfg(test)]
mod tests {
    use super::Backend;

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
