//! `autotune train`: resolve the flags ([`TrainSettings`]), run the training session, print how
//! it ended. A process started as a rank of a data-parallel run (the rank variables are set)
//! trains as that rank and reports to its launcher on stdout instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::Serialize;

use autotune::collective::RankEnv;
use autotune::dist::protocol::RankMessage;
use autotune::session::observer::{Notice, SessionObserver};
use autotune::session::train::{self, Trained};
use autotune::settings::train::{TrainArgs, TrainSettings, TrainSource};
use autotune::train::run::{RunSummary, TrainEvent, TrainObserver};
use autotune::{Knobs, ModelSpec};

use super::printer::Printer;
use super::reporters::train::{self as progress, TrainProgress};
use super::Status;

pub fn run(args: TrainArgs, printer: &Printer) -> anyhow::Result<Status> {
    let rank = RankEnv::from_env()?;
    let settings = TrainSettings::from_args(&args)?;
    for note in &settings.notes {
        printer.note(note);
    }
    if let Some(rank) = rank {
        return run_rank(&settings, rank);
    }
    let interrupt = interrupt_flag(printer);
    let progress = TrainProgress::new(printer, settings.training.steps);
    let trained = train::train(&settings, None, &progress, &interrupt);
    progress.finish();
    let (spec, knobs) = model_and_knobs(&settings.source);
    match trained? {
        Trained::DoesNotFit(why) => {
            printer.data_text(format!("does not fit: {why}"));
            Ok(Status::Negative)
        }
        Trained::Finished(summary) | Trained::AsRank(summary) => {
            progress::finished(printer, &summary);
            printer.data_json(&TrainReport::new(spec, knobs, &summary));
            Ok(status_of(&summary))
        }
    }
}

/// Trains as one rank of a launched group: progress (rank 0) and the summary (every rank) go to
/// the launcher as JSON lines on stdout; nothing else is printed there.
fn run_rank(settings: &TrainSettings, rank: RankEnv) -> anyhow::Result<Status> {
    let printer = Printer::new(true, false, true);
    let interrupt = interrupt_flag(&printer);
    let observer = ToLauncher(printer);
    let summary = match train::train(settings, Some(rank), &observer, &interrupt)? {
        Trained::AsRank(summary) | Trained::Finished(summary) => summary,
        Trained::DoesNotFit(why) => anyhow::bail!("does not fit: {why}"),
    };
    printer.data_json_line(&RankMessage::Finished(summary));
    // An interrupted run that saved its checkpoint ended as asked; the launcher reads
    // `interrupted` from the summary and exits 130 itself.
    Ok(Status::Success)
}

/// Sends rank 0's events to the launcher (the session passes only rank 0's on).
struct ToLauncher(Printer);

impl TrainObserver for ToLauncher {
    fn on_event(&self, event: &TrainEvent) {
        self.0.data_json_line(&RankMessage::Train(event.clone()));
    }
}

impl SessionObserver for ToLauncher {
    fn notice(&self, _: Notice) {}
}

/// The model and knobs a run trains.
pub fn model_and_knobs(source: &TrainSource) -> (&ModelSpec, Knobs) {
    match source {
        TrainSource::Plan { plan, .. } => (&plan.model, plan.knobs),
        TrainSource::Knobs { spec, knobs, .. } => (spec, *knobs),
    }
}

/// The exit status of a run that ended: diverged runs are a negative answer, interrupted ones
/// saved their checkpoint.
pub fn status_of(summary: &RunSummary) -> Status {
    if summary.diverged.is_some() {
        Status::Negative
    } else if summary.interrupted {
        Status::Interrupted
    } else {
        Status::Success
    }
}

/// The first interrupt (Ctrl-C, or SIGTERM or SIGHUP, what schedulers send on preemption) asks
/// the run to checkpoint after the current step and stop (exit 130); a second one exits at
/// once with 130 without saving, leaving `latest` at the checkpoint before (a save it cuts
/// short leaves only a temporary, which the next run on the directory removes).
pub fn interrupt_flag(printer: &Printer) -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    let flag = FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let handler_flag = flag.clone();
        let result = ctrlc::set_handler(move || {
            if handler_flag.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
            eprintln!(
                "\ninterrupt: saving a checkpoint after this step (interrupt again to quit now, without saving)"
            );
        });
        if let Err(e) = result {
            printer.warn(format!(
                "cannot install the interrupt handler ({e}); an interrupt will not save a checkpoint"
            ));
        }
        flag
    });
    flag.clone()
}

/// The JSON summary of a training run.
#[derive(Serialize)]
pub struct TrainReport<'a> {
    model: &'a str,
    knobs: Knobs,
    steps: u64,
    interrupted: bool,
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    tokens_per_s: f64,
    real_tokens_per_s: f64,
    skipped_steps: u64,
    checkpoint: Option<String>,
    diverged: Option<autotune::train::run::Divergence>,
}

impl<'a> TrainReport<'a> {
    pub fn new(spec: &'a ModelSpec, knobs: Knobs, summary: &RunSummary) -> Self {
        Self {
            model: &spec.name,
            knobs,
            steps: summary.steps,
            interrupted: summary.interrupted,
            last_loss: summary.last_loss,
            last_eval_loss: summary.last_eval_loss,
            tokens_per_s: summary.tokens_per_s,
            real_tokens_per_s: summary.real_tokens_per_s,
            skipped_steps: summary.skipped_steps,
            checkpoint: summary.checkpoint.as_ref().map(|p| p.display().to_string()),
            diverged: summary.diverged.clone(),
        }
    }
}
