//! `autotune tune`: search for the fastest feasible plan and write it.
//!
//! The pieces are the library's: a [`SearchDriver`] decides, a [`Prober`] measures, the plan
//! is built from the history. This module resolves the arguments once ([`config`]), chooses
//! the prober ([`prober`]), and writes the outputs; [`crate::cli::reporters`] renders the
//! search for people.

pub mod config;
pub mod prober;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use autotune::backend;
use autotune::plan::schema::Plan;
use autotune::probe::job::device_name;
use autotune::probe::Prober;
use autotune::profile::record::{Profile, RecordedDevice};
use autotune::profile::replay::ReplayProber;
use autotune::search::decision::Decision;
use autotune::search::driver::SearchDriver;
use autotune::search::run::{run_search, SearchOutcome};
use autotune::spec::device::{DeviceKind, DeviceSpec};
use autotune::spec::limits;
use autotune::trial::TrialResult;
use autotune::trial_protocol::RunnerIdentity;
use autotune::ModelSpec;

use self::config::{LiveSearch, Source, TuneConfig};
use super::args::{ProbeIsolation, TuneArgs};
use super::printer::Printer;
use super::reporters::{self, SearchProgress};
use super::Status;

/// What a finished search produced.
pub struct Tuned {
    pub spec: ModelSpec,
    pub target: DeviceSpec,
    pub recorded: RecordedDevice,
    pub driver: SearchDriver,
    pub plan: Option<Plan>,
    pub outcome: SearchOutcome,
    /// The trial runner's engine, when one measured the trials (or measured the recording).
    pub measured_by: Option<RunnerIdentity>,
}

impl Tuned {
    /// The search as a recorded profile.
    fn record(&self) -> Profile {
        let profile = Profile::from_search(
            &self.driver,
            &self.outcome,
            &self.spec,
            self.recorded.clone(),
            backend::CANDLE_VERSION,
            now(),
        );
        match &self.measured_by {
            Some(runner) => profile.measured_by(&runner.engine, runner.engine_version.as_deref()),
            None => profile,
        }
    }
}

pub fn run(args: TuneArgs, printer: &Printer) -> anyhow::Result<Status> {
    run_config(&TuneConfig::from_args(&args)?, printer)
}

/// Searches, writes the plan, then the recording.
fn run_config(config: &TuneConfig, printer: &Printer) -> anyhow::Result<Status> {
    let tuned = search_only(config, printer)?;
    // The plan first: a recording that cannot be written must not cost the plan.
    let status = emit(&tuned, config.out.as_ref(), printer)?;
    record(&tuned, config, printer)?;
    report(&tuned, config, printer)?;
    Ok(status)
}

/// Runs the search `config` describes.
pub fn search_only(config: &TuneConfig, printer: &Printer) -> anyhow::Result<Tuned> {
    Ok(match &config.source {
        Source::Replay { path, profile } => replay(path, profile, printer)?,
        Source::Live(search) => live(search, printer)?,
    })
}

/// Writes the search's profile where `--record` asks.
pub fn record(tuned: &Tuned, config: &TuneConfig, printer: &Printer) -> anyhow::Result<()> {
    if let Some(path) = &config.record {
        tuned.record().save(path)?;
        printer.status(format!("profile recorded to {}", path.display()));
    }
    Ok(())
}

/// Writes the search's HTML report where `--report` asks: every trial, and the plan's choice.
pub fn report(tuned: &Tuned, config: &TuneConfig, printer: &Printer) -> anyhow::Result<()> {
    if let Some(path) = &config.report {
        let report = autotune::report::Report::from_search(&tuned.record(), tuned.plan.as_ref());
        super::report::write(path, &report.to_html())?;
        printer.status(format!("report written to {}", path.display()));
    }
    Ok(())
}

/// Plans offline from a recorded profile: the recorded model, target and search space, with
/// every trial answered from the recording.
fn replay(path: &Path, profile: &Profile, printer: &Printer) -> anyhow::Result<Tuned> {
    let driver = profile.driver()?;
    let device = profile.device.clone();
    printer.status(format!(
        "replaying {} on {} from {} ({} recorded trials)",
        profile.model.name,
        device.target.name,
        path.display(),
        profile.trials.len()
    ));
    let mut prober = ReplayProber::new(profile.clone());
    let outcome = search(&driver, &mut prober, printer)?;
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
    })
}

/// Searches on this machine.
fn live(search_config: &LiveSearch, printer: &Printer) -> anyhow::Result<Tuned> {
    let LiveSearch {
        spec,
        target,
        budget,
        ..
    } = search_config;
    let driver = SearchDriver::new(
        search_config.space.clone(),
        search_config.facts.clone(),
        *budget,
    )?;
    announce(search_config, printer);
    let mut recorded = backend::recorded_device(target.kind == DeviceKind::Cuda, target);
    // A model whose state alone exceeds the budget is answered before any trial: building it
    // to find out would take more memory than the machine has.
    if let Some(hint) = limits::state_exceeds_budget(spec, budget, &driver.space().regimes) {
        return Ok(Tuned {
            spec: spec.clone(),
            target: target.clone(),
            recorded,
            driver,
            plan: None,
            outcome: SearchOutcome {
                history: Vec::new(),
                decision: Decision::NoFeasible { hint },
            },
            measured_by: None,
        });
    }
    let mut trials = prober::live_prober(search_config)?;
    trials.stop_runner_on_interrupt(printer);
    let outcome = search(&driver, trials.prober(), printer)?;
    let mut plan = Plan::from_search(&driver, &outcome, spec, target, now());
    if let Some(plan) = plan.as_mut() {
        // Scaling efficiency is measured, never assumed: one GPU's trial if the search ran none.
        plan.measure_scaling(driver.space(), trials.prober())?;
        plan.provenance = Some(trials.provenance(&recorded.name));
    }
    let measured_by = match &trials {
        prober::Trials::Runner(exec) => exec.identity().cloned(),
        prober::Trials::Engine(_) => None,
    };
    if let Some(seen) = measured_by.as_ref().and_then(|m| m.device.as_ref()) {
        // The runner saw the device; this process, which opened none, may only know its kind.
        recorded.name = seen.clone();
    }
    Ok(Tuned {
        spec: spec.clone(),
        target: target.clone(),
        recorded,
        driver,
        plan,
        outcome,
        measured_by,
    })
}

/// The search loop with its progress drawn on stderr.
fn search(
    driver: &SearchDriver,
    prober: &mut dyn Prober,
    printer: &Printer,
) -> anyhow::Result<SearchOutcome> {
    let progress = SearchProgress::new(printer);
    let outcome = run_search(driver, prober, &progress);
    progress.finish();
    Ok(outcome?)
}

/// The line that says what is tuned for what, and where trials run.
fn announce(search: &LiveSearch, printer: &Printer) {
    let spec = &search.spec;
    let isolation = match (&search.runner, search.isolation) {
        (Some(runner), ProbeIsolation::Child) => {
            format!(
                " through the trial runner `{}`, a new one per trial",
                runner.display()
            )
        }
        (Some(runner), _) => format!(" through the trial runner `{}`", runner.display()),
        (None, ProbeIsolation::InProcess) => String::new(),
        (None, ProbeIsolation::Child) => " in child processes".into(),
        (None, ProbeIsolation::Worker) => " in a worker process".into(),
    };
    printer.status(format!(
        "tuning {} ({:.1}M parameters, seq {}) for {} ({}), probing on {}{isolation}",
        spec.name,
        spec.parameter_count() as f64 / 1e6,
        spec.seq_len,
        search.target.name,
        reporters::budget(&search.budget),
        device_name(search.target.kind),
    ));
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes the plan (or the negative answer) and maps it to an exit status.
pub fn emit(tuned: &Tuned, out: Option<&PathBuf>, printer: &Printer) -> anyhow::Result<Status> {
    let Some(plan) = &tuned.plan else {
        let hint = match &tuned.outcome.decision {
            Decision::NoFeasible { hint } => hint.clone(),
            other => format!("the search ended without a verified plan ({other:?})"),
        };
        printer.data_json(&NoPlan {
            feasible: false,
            hint: &hint,
            evidence: &tuned.outcome.history,
        });
        printer.data_text(format!(
            "no feasible plan for {} on {}\nhint: {hint}",
            tuned.spec.name, tuned.target.name
        ));
        return Ok(Status::Negative);
    };
    if let Some(path) = out {
        plan.save(path)?;
        printer.status(format!("plan written to {}", path.display()));
    }
    printer.data_json(plan);
    printer.data_text(summary(plan));
    Ok(Status::Success)
}

#[derive(Serialize)]
struct NoPlan<'a> {
    feasible: bool,
    hint: &'a str,
    evidence: &'a [TrialResult],
}

fn summary(plan: &Plan) -> String {
    let m = &plan.measured;
    let mut text = format!(
        "plan: {}\n  measured {:.0} tokens/s ({:.1} ms/step), peak GPU {}, peak host {}\n  {} trials",
        plan.knobs,
        m.tokens_per_s,
        m.step_time_median_s * 1e3,
        reporters::bytes(m.peak_gpu_bytes),
        reporters::bytes(m.peak_host_bytes),
        plan.evidence.len(),
    );
    if let Some(e) = plan.model_error.memory_loo_rel_error {
        text.push_str(&format!(", memory model held-out error {:.1}%", e * 100.0));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_that_cannot_be_written_does_not_cost_the_plan() {
        let dir = tempfile::tempdir().unwrap();
        let recording = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("profiles/recorded/rtx4090-32g-on-h200/seed.json");
        let plan = dir.path().join("plan.json");
        // Under a file: no directory can be made there.
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").unwrap();
        let config = TuneConfig {
            source: Source::Replay {
                path: recording.clone(),
                profile: Box::new(Profile::load(&recording).unwrap()),
            },
            record: Some(blocker.join("profile.json")),
            out: Some(plan.clone()),
            report: None,
        };
        let quiet = Printer::new(true, false, false);
        let Err(err) = run_config(&config, &quiet) else {
            panic!("a recording that cannot be written is an error");
        };
        assert!(err.to_string().contains("profile"), "{err}");
        autotune::plan::schema::Plan::load(&plan).expect("the plan was written first");
    }
}
