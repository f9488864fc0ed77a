//! `autotune tune`: the flags resolved into the library's settings, its tune session run
//! ([`autotune::session::tune`]), and what it found written: the plan (or the negative answer)
//! on stdout, the status lines and the progress on stderr, the recording and the report where
//! asked.

use std::path::{Path, PathBuf};

use serde::Serialize;

use autotune::data::load::HeldOut;
use autotune::data::profile::DataShape;
use autotune::plan::schema::Plan;
use autotune::probe::runner::RunningGroup;
use autotune::profile::record::Profile;
use autotune::search::decision::Decision;
use autotune::search::report::Reporter;
use autotune::session::tune::{longest_context, tune, TuneObserver, Tuned};
use autotune::settings::dataset::DataChoice;
use autotune::settings::model::model_folder;
use autotune::settings::target::SeqLen;
use autotune::settings::tune::{LiveSettings, Source, TuneArgs, TuneCommandArgs, TuneSettings};
use autotune::trial::TrialResult;

use super::interrupt::stop_runner_on_interrupt;
use super::printer::Printer;
use super::reporters::search::{self, SearchProgress};
use super::reporters::train::with_load_progress;
use super::Status;

pub fn run(args: TuneCommandArgs, printer: &Printer) -> anyhow::Result<Status> {
    let folder = model_folder(&args.tune.planned.model);
    let data = args.dataset.resolve(folder, HeldOut::None)?;
    let shape = tuning_data(&args.tune, &data, printer)?;
    match settings_at_length(&args.tune, shape, printer)? {
        Some(settings) => run_settings(&settings, printer),
        None => Ok(Status::Negative),
    }
}

/// The search's settings; with `--seq-len auto`, at the longest sequence the target fits for
/// the model, found by trials first (`None`, said on stdout, when not even one token fits).
pub fn settings_at_length(
    args: &TuneArgs,
    shape: Option<DataShape>,
    printer: &Printer,
) -> anyhow::Result<Option<TuneSettings>> {
    let settings = TuneSettings::from_args(args, shape.clone())?;
    let Source::Live(live) = &settings.source else {
        return Ok(Some(settings));
    };
    if !args.planned.longest_asked() {
        return Ok(Some(settings));
    }
    printer.status(format!(
        "--seq-len auto: finding the longest sequence {} fits on {}",
        live.spec.name, live.target.name
    ));
    let Some(found) = longest_context(live, &OnStderr(*printer))? else {
        printer.data_text(format!(
            "no sequence of {} fits {}, not even one token, in any setting searched",
            live.spec.name, live.target.name
        ));
        return Ok(None);
    };
    printer.status(format!(
        "the longest sequence on {}: {} tokens ({} predicted), one a micro-batch at {}; \
         tuning at that length",
        live.target.name,
        found.tokens,
        found.sequence.predicted_tokens.unwrap_or(0),
        found.regime
    ));
    let mut fixed = args.clone();
    fixed.planned.seq_len = Some(SeqLen::Tokens(found.tokens));
    Ok(Some(TuneSettings::from_args(&fixed, shape)?))
}

/// The dataset `data` shaped for the trials of the search `args` describe, loaded (or mapped
/// from the token cache) with its progress on stderr; `None` when it is no dataset of records.
pub fn tuning_data(
    args: &TuneArgs,
    data: &DataChoice,
    printer: &Printer,
) -> anyhow::Result<Option<DataShape>> {
    let Some(records) = data.records() else {
        return Ok(None);
    };
    // A flag the data rules out is refused before the data is read.
    args.check_longest(true)?;
    let spec = args.planned.model_spec()?;
    let shape = with_load_progress(printer, |events| {
        autotune::session::data::shape(records, &data.data, &spec, &data.cache_dir, events)
    })?;
    let cut = shape.cut();
    printer.status(format!(
        "tuning on {} examples {} into sequences of {} tokens ({} cut to {}, {} dropped)",
        cut.kept,
        shape.batching().as_str(),
        shape.sequence_tokens(),
        cut.truncated,
        spec.seq_len,
        cut.dropped + cut.too_long,
    ));
    Ok(Some(shape))
}

/// Searches, writes the plan, then the recording.
fn run_settings(settings: &TuneSettings, printer: &Printer) -> anyhow::Result<Status> {
    for note in &settings.notes {
        printer.note(note);
    }
    let tuned = search_only(settings, printer)?;
    // The plan first: a recording that cannot be written must not cost the plan.
    let status = emit(&tuned, settings.out.as_ref(), printer)?;
    record(&tuned, settings, printer)?;
    report(&tuned, settings, printer)?;
    Ok(status)
}

/// Runs the search `settings` describe, telling people on stderr what it does.
pub fn search_only(settings: &TuneSettings, printer: &Printer) -> anyhow::Result<Tuned> {
    Ok(tune(settings, &OnStderr(*printer))?)
}

/// The session's news as status lines and progress on stderr.
struct OnStderr(Printer);

impl TuneObserver for OnStderr {
    fn replaying(&self, path: &Path, profile: &Profile) {
        self.0.status(format!(
            "replaying {} on {} from {} ({} recorded trials)",
            profile.model.name,
            profile.device.target.name,
            path.display(),
            profile.trials.len()
        ));
    }

    fn tuning(&self, settings: &LiveSettings) {
        self.0.status(search::tuning(settings));
    }

    fn runner_starting(&self, group: RunningGroup) {
        stop_runner_on_interrupt(group, &self.0);
    }

    fn search_progress(&self) -> Box<dyn Reporter + '_> {
        Box::new(SearchProgress::new(&self.0))
    }

    fn edge_trial(&self, tokens: usize, result: &TrialResult, fits: bool) {
        self.0.status(search::edge_line(tokens, result, fits));
    }
}

/// Writes the search's profile where `--record` asks.
pub fn record(tuned: &Tuned, settings: &TuneSettings, printer: &Printer) -> anyhow::Result<()> {
    if let Some(path) = &settings.record {
        tuned.record().save(path)?;
        printer.status(format!("profile recorded to {}", path.display()));
    }
    Ok(())
}

/// Writes the search's HTML report where `--report` asks: every trial, and the plan's choice.
pub fn report(tuned: &Tuned, settings: &TuneSettings, printer: &Printer) -> anyhow::Result<()> {
    if let Some(path) = &settings.report {
        let report = autotune::report::Report::from_search(&tuned.record(), tuned.plan.as_ref());
        super::report::write(path, &report.to_html())?;
        printer.status(format!("report written to {}", path.display()));
    }
    Ok(())
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
        "plan: {}\n  measured {:.0} tokens/s{} ({:.1} ms/step), peak GPU {}, peak host {}\n  {} trials",
        plan.knobs,
        m.tokens_per_s,
        m.interval_text(),
        m.step_time_median_s * 1e3,
        super::reporters::bytes(m.peak_gpu_bytes),
        super::reporters::bytes(m.peak_host_bytes),
        plan.evidence.len(),
    );
    if let Some(e) = plan.model_error.memory_loo_rel_error {
        text.push_str(&format!(", memory model held-out error {:.1}%", e * 100.0));
    }
    if let Some(data) = &plan.data {
        text.push_str(&format!(
            "\n  tuned on {} ({} examples {} into sequences of {} tokens, {:.1}% of positions \
             real tokens; the longest {} tokens)\n  lengths: {}",
            data.files.join(", "),
            data.examples,
            data.batching.as_str(),
            data.sequence_tokens,
            100.0 * data.fill,
            data.longest,
            super::data::histogram(&data.lengths),
        ));
    }
    if let Some(larger) = plan.larger_batch_measured_slower() {
        text.push_str(&format!(
            "\n  micro-batch {} also fits, at {:.0} tokens/s ({:.1} % slower): the plan is the \
             faster",
            larger.knobs.micro_batch,
            larger.tokens_per_s,
            100.0 * (1.0 - larger.tokens_per_s / m.tokens_per_s),
        ));
    }
    for n in &plan.non_monotone {
        text.push_str(&format!(
            "\n  memory did not grow with the batch: {} micro-batch {} to {}: {}",
            n.regime, n.smaller, n.larger, n.what
        ));
    }
    if let Some(longest) = &plan.longest_sequence {
        text.push_str(&format!("\n  {}", search::longest_line(longest)));
    }
    text
}

#[cfg(test)]
mod tests;
