//! `autotune train`: train with explicit knobs, rendering progress and handling Ctrl-C.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use indicatif::ProgressBar;
use serde::Serialize;

use autotune::train::checkpoint;
use autotune::train::data::{Data, DataSpec};
use autotune::train::run::{self, RunConfig, RunSummary, TrainEvent, TrainObserver};
use autotune::train::step::Trainer;
use autotune::{Knobs, ModelSpec};

use super::args::TrainArgs;
use super::printer::Printer;
use super::Status;
use autotune::backend as device;

pub fn run(args: TrainArgs, printer: &Printer) -> anyhow::Result<Status> {
    let spec = ModelSpec::resolve(&args.model.model)?;
    let knobs = args.knobs.knobs();
    knobs.validate("knobs", "--")?;
    let data_spec = DataSpec::parse(&args.data);
    let data = Data::open(&data_spec, &spec)?;
    let device = device::open(&args.model.device)?;
    let mut trainer = Trainer::new(&spec, knobs, &device, args.model.seed)?;
    if args.resume {
        resume(&args, &mut trainer, &data_spec, knobs)?;
    }
    printer.status(format!(
        "training {} ({:.1}M parameters) on {} with {knobs}, data {data_spec}",
        spec.name,
        trainer.model().params().element_count() as f64 / 1e6,
        device::describe(&device),
    ));

    let interrupt = interrupt_flag(printer);
    let config = RunConfig {
        total_steps: args.steps,
        checkpoint_dir: args.checkpoint_dir.clone(),
        checkpoint_every: args.checkpoint_every,
        eval_every: args.eval_every,
    };
    let progress = Progress::new(printer, args.steps);
    let summary = run::run(
        &mut trainer,
        &data,
        &data_spec,
        &config,
        &interrupt,
        &progress,
    )?;
    progress.bar.finish_and_clear();
    report(printer, &spec, knobs, &summary);
    Ok(if summary.interrupted {
        Status::Interrupted
    } else {
        Status::Success
    })
}

fn resume(
    args: &TrainArgs,
    trainer: &mut Trainer,
    data_spec: &DataSpec,
    knobs: Knobs,
) -> anyhow::Result<()> {
    let dir = args
        .checkpoint_dir
        .as_deref()
        .expect("clap requires --checkpoint-dir with --resume");
    let Some(path) = checkpoint::latest(dir)? else {
        anyhow::bail!(
            "`--resume`: no checkpoint in `{}` (no `latest` file); drop --resume to start afresh",
            dir.display()
        );
    };
    let state = checkpoint::restore(&path, trainer)?;
    if state.knobs != knobs || &state.data != data_spec || state.seed != trainer.seed() {
        anyhow::bail!(
            "`--resume`: checkpoint `{}` was trained with {} on `{}` (seed {}); pass the same knobs, data and seed",
            path.display(),
            state.knobs,
            state.data,
            state.seed
        );
    }
    Ok(())
}

/// First Ctrl-C asks the loop to checkpoint and stop; a second one exits at once.
fn interrupt_flag(printer: &Printer) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let handler_flag = flag.clone();
    let result = ctrlc::set_handler(move || {
        if handler_flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\ninterrupt: saving a checkpoint after this step (press Ctrl-C again to quit now)"
        );
    });
    if let Err(e) = result {
        printer.warn(format!(
            "cannot install the Ctrl-C handler ({e}); an interrupt will not save a checkpoint"
        ));
    }
    flag
}

struct Progress {
    bar: ProgressBar,
    printer: Printer,
    log_every: u64,
}

impl Progress {
    fn new(printer: &Printer, total: u64) -> Self {
        let bar = printer.progress(total, "{bar:30} {pos}/{len} steps  {msg}  ETA {eta}");
        Self {
            bar,
            printer: *printer,
            log_every: (total / 10).max(1),
        }
    }
}

impl TrainObserver for Progress {
    fn on_event(&self, event: &TrainEvent) {
        match event {
            TrainEvent::Started { start_step, .. } => {
                self.bar.set_position(*start_step);
                if *start_step > 0 {
                    self.printer
                        .status(format!("resuming at step {start_step}"));
                }
            }
            TrainEvent::Step {
                step,
                report,
                tokens_per_s,
            } => {
                let skipped = if report.skipped {
                    " (skipped: fp16 overflow)"
                } else {
                    ""
                };
                let msg = format!(
                    "loss {:.4}  {:.0} tok/s{skipped}",
                    report.loss, tokens_per_s
                );
                self.bar.set_position(*step);
                self.bar.set_message(msg.clone());
                if self.printer.log_progress() && step % self.log_every == 0 {
                    self.printer.status(format!("step {step}: {msg}"));
                }
            }
            TrainEvent::Eval { step, loss } => {
                self.bar.suspend(|| {
                    self.printer
                        .status(format!("step {step}: eval loss {loss:.4}"))
                });
            }
            TrainEvent::CheckpointSaved { step, path } => {
                tracing::debug!(step, path = %path.display(), "checkpoint saved");
            }
        }
    }
}

#[derive(Serialize)]
struct TrainReport<'a> {
    model: &'a str,
    knobs: Knobs,
    steps: u64,
    interrupted: bool,
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    tokens_per_s: f64,
    skipped_steps: u64,
    checkpoint: Option<String>,
}

fn report(printer: &Printer, spec: &ModelSpec, knobs: Knobs, summary: &RunSummary) {
    let checkpoint = summary.checkpoint.as_ref().map(|p| p.display().to_string());
    printer.data_json(&TrainReport {
        model: &spec.name,
        knobs,
        steps: summary.steps,
        interrupted: summary.interrupted,
        last_loss: summary.last_loss,
        last_eval_loss: summary.last_eval_loss,
        tokens_per_s: summary.tokens_per_s,
        skipped_steps: summary.skipped_steps,
        checkpoint: checkpoint.clone(),
    });
    let verb = if summary.interrupted {
        "interrupted at"
    } else {
        "finished"
    };
    let loss = summary.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
    printer.status(format!(
        "{verb} step {}: loss {loss}, {:.0} tokens/s{}",
        summary.steps,
        summary.tokens_per_s,
        checkpoint
            .map(|c| format!(", checkpoint {c}"))
            .unwrap_or_default()
    ));
}
