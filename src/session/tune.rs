//! `tune`'s search session: a recording replayed offline, or a search on this machine, from
//! validated settings ([`TuneSettings`]) to what it found ([`Tuned`]). A [`SearchDriver`]
//! decides, a prober measures ([`super::prober`]), the plan is built from the history.
//!
//! The session prints nothing: what a person is told as it goes reaches a [`TuneObserver`],
//! and writing the plan, the recording and the report is the caller's.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use super::prober::live_prober;
use crate::backend;
use crate::estimate::Attention;
use crate::model::Engine;
use crate::plan::schema::Plan;
use crate::probe::runner::RunningGroup;
use crate::probe::Prober;
use crate::profile::record::{Profile, RecordedDevice};
use crate::profile::replay::ReplayProber;
use crate::search::decision::Decision;
use crate::search::driver::SearchDriver;
use crate::search::report::Reporter;
use crate::search::run::{run_search, SearchOutcome};
use crate::search::way_out::compact_way_out;
use crate::settings::tune::{LiveSettings, Source, TuneSettings};
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::trial::TrialResult;
use crate::trial_protocol::RunnerIdentity;

/// What a finished search produced.
pub struct Tuned {
    /// The model tuned.
    pub spec: ModelSpec,
    /// The machine planned for.
    pub target: DeviceSpec,
    /// The machine the trials ran on, as recorded.
    pub recorded: RecordedDevice,
    /// The driver that ran the search: its space, facts and budget.
    pub driver: SearchDriver,
    /// The verified plan, or `None` when nothing was feasible.
    pub plan: Option<Plan>,
    /// Every trial and the decision.
    pub outcome: SearchOutcome,
    /// The trial runner's engine, when one measured the trials (or measured the recording).
    pub measured_by: Option<RunnerIdentity>,
    /// The allocator setting the runner's trials ran under (`PYTORCH_CUDA_ALLOC_CONF`, empty for
    /// PyTorch's default), where autotune set it.
    pub allocator: Option<String>,
}

impl Tuned {
    /// The search as a recorded profile.
    pub fn record(&self) -> Profile {
        let profile = Profile::from_search(
            &self.driver,
            &self.outcome,
            &self.spec,
            self.recorded.clone(),
            backend::CANDLE_VERSION,
            now(),
        );
        match &self.measured_by {
            Some(runner) => profile
                .measured_by(&runner.engine, runner.engine_version.as_deref())
                .under_allocator(self.allocator.as_deref()),
            None => profile,
        }
    }
}

/// What a tune session tells its caller as it goes, for the caller to render.
pub trait TuneObserver {
    /// The recording `profile`, read from `path`, is about to be replayed.
    fn replaying(&self, path: &Path, profile: &Profile);
    /// A search of `settings` on this machine is about to run its first trial.
    fn tuning(&self, settings: &LiveSettings);
    /// Trials are about to run through a trial runner, in process group `group`: a group of
    /// its own, which a terminal's Ctrl-C does not reach, so an interrupt must stop it there.
    fn runner_starting(&self, group: RunningGroup);
    /// A reporter for the search loop's events, made as the loop starts and dropped as it
    /// ends.
    fn search_progress(&self) -> Box<dyn Reporter + '_>;
    /// A trial of one sequence of `tokens` at the plan's knobs, measuring the longest
    /// sequence the plan takes, found `result`: within the budget when `fits`.
    fn edge_trial(&self, tokens: usize, result: &TrialResult, fits: bool);
}

/// Runs the search `settings` describe: a replay of their recording, or trials here.
pub fn tune(settings: &TuneSettings, observer: &dyn TuneObserver) -> crate::Result<Tuned> {
    match &settings.source {
        Source::Replay { path, profile } => replay(path, profile, observer),
        Source::Live(live_settings) => live(live_settings, observer),
    }
}

/// Plans offline from a recorded profile: the recorded model, target, space and facts, with
/// every trial answered from the recording.
fn replay(path: &Path, profile: &Profile, observer: &dyn TuneObserver) -> crate::Result<Tuned> {
    let driver = profile.driver()?;
    let device = profile.device.clone();
    observer.replaying(path, profile);
    let mut prober = ReplayProber::new(profile.clone());
    let outcome = search(&driver, &mut prober, observer)?;
    let mut plan = Plan::from_search(&driver, &outcome, &profile.model, &device.target, now());
    let measured_by = profile.engine.as_ref().map(|engine| RunnerIdentity {
        engine: engine.clone(),
        engine_version: profile.engine_version.clone(),
        device: Some(device.name.clone()),
    });
    if let Some(plan) = plan.as_mut() {
        let mut provenance = backend::provenance("replay", &device.name);
        if let Some(runner) = &measured_by {
            // The recording's engine measured it; candle did not.
            provenance.engine = runner.engine.clone();
            provenance.engine_version = runner.engine_version.clone();
            provenance.candle_version = None;
            provenance.allocator = profile.allocator.clone();
        }
        plan.provenance = Some(provenance);
    }
    Ok(Tuned {
        spec: profile.model.clone(),
        target: device.target.clone(),
        recorded: device,
        driver,
        plan,
        outcome,
        measured_by,
        allocator: profile.allocator.clone(),
    })
}

/// Searches on this machine.
fn live(settings: &LiveSettings, observer: &dyn TuneObserver) -> crate::Result<Tuned> {
    let LiveSettings {
        spec,
        target,
        budget,
        ..
    } = settings;
    let driver = SearchDriver::new(settings.space.clone(), settings.facts.clone(), *budget)?;
    observer.tuning(settings);
    let mut recorded = backend::recorded_device(target.kind == DeviceKind::Cuda, target);
    let tuned = |recorded, driver, plan, outcome, measured_by, allocator| Tuned {
        spec: spec.clone(),
        target: target.clone(),
        recorded,
        driver,
        plan,
        outcome,
        measured_by,
        allocator,
    };
    // A model whose state alone exceeds the budget is answered before any trial: building it
    // to find out would take more memory than the machine has.
    if let Some(hint) = limits::state_exceeds_budget(spec, budget, &driver.space().regimes) {
        let outcome = SearchOutcome {
            history: Vec::new(),
            decision: Decision::NoFeasible {
                hint: with_way_out(hint, settings),
            },
        };
        return Ok(tuned(recorded, driver, None, outcome, None, None));
    }
    let mut trials = live_prober(settings)?;
    if let Some(group) = trials.runner_group() {
        observer.runner_starting(group);
    }
    let searching = std::time::Instant::now();
    let mut outcome = search(&driver, trials.prober(), observer)?;
    let search_s = searching.elapsed().as_secs_f64();
    if let Decision::NoFeasible { hint } = &mut outcome.decision {
        *hint = with_way_out(std::mem::take(hint), settings);
    }
    let mut plan = Plan::from_search(&driver, &outcome, spec, target, now());
    if let Some(plan) = plan.as_mut() {
        // Scaling efficiency is measured, never assumed: one GPU's trial if the search ran none.
        plan.measure_scaling(driver.space(), trials.prober())?;
        plan.provenance = Some(trials.provenance(&recorded.name));
        plan.data = settings
            .data
            .as_ref()
            .map(|d| d.profile(plan.knobs.micro_batch));
        plan.model_folder = settings.model_folder.clone();
    }
    let measured_by = trials.runner_identity().cloned();
    let allocator = trials.runner_allocator();
    if let Some(seen) = measured_by.as_ref().and_then(|m| m.device.as_ref()) {
        // The runner saw the device; this process, which opened none, may only know its kind.
        recorded.name = seen.clone();
    }
    // The search's trial processes end first: the edge trials meet the card as training will.
    drop(trials);
    if let Some(plan) = plan.as_mut() {
        plan.longest_sequence = Some(longest::longest_sequence(
            settings, plan, search_s, observer,
        )?);
    }
    Ok(tuned(
        recorded,
        driver,
        plan,
        outcome,
        measured_by,
        allocator,
    ))
}

/// `hint` (why nothing searched fits), followed by the opt-in regime that would, when the
/// estimate fits one the search did not try (compact optimizer state).
fn with_way_out(hint: String, settings: &LiveSettings) -> String {
    let kind = settings.target.kind;
    let spec = &settings.spec;
    let attention = |precision| {
        crate::settings::estimate::attention(Engine::default(), spec, &settings.target, precision)
            .unwrap_or(Attention::Materialized)
    };
    let regimes = &settings.space.regimes;
    match compact_way_out(spec, kind, &settings.budget, regimes, &attention) {
        Some(way) => format!("{hint}; {}", way.describe(kind)),
        None => hint,
    }
}

/// The search loop, its events reported to the observer's progress for as long as it runs.
fn search(
    driver: &SearchDriver,
    prober: &mut dyn Prober,
    observer: &dyn TuneObserver,
) -> crate::Result<SearchOutcome> {
    let progress = observer.search_progress();
    let outcome = run_search(driver, prober, progress.as_ref());
    drop(progress);
    Ok(outcome?)
}

/// Seconds since the Unix epoch, for the plan and the recording.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

mod longest;
pub use longest::{longest_context, LongestContext};
#[cfg(test)]
mod tests;
