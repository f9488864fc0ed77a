//! `autotune run`: tune, then train with the verified plan, in one command.
//!
//! The plan is written to `RUN_DIR/plan.json` before training starts, and checkpoints go to
//! `RUN_DIR/checkpoints`, so a stopped run can be resumed with `autotune run --resume` (the
//! same as `autotune train --plan RUN_DIR/plan.json --checkpoint-dir RUN_DIR/checkpoints
//! --resume`). One run owns a run directory at a time (a lock), and a directory that holds a
//! run is refused unless `--resume` continues it or `--overwrite` starts over.

use serde::Serialize;

use autotune::plan::schema::Plan;
use autotune::session::observer::{Notice, SessionObserver};
use autotune::session::run_dir::RunDir;
use autotune::session::train::train_with_plan;
use autotune::settings::model::model_folder;
use autotune::settings::training::{Training, TrainingDefaults};

use autotune::settings::tune::Backend;

use super::args::RunArgs;
use super::printer::Printer;
use super::reporters::train::{self as progress, TrainProgress};
use super::train::{interrupt_flag, status_of, TrainReport};
use super::tune::{emit, record, report, search_only, settings_at_length, tuning_data};
use super::Status;

/// What the tuning half of a run ended with.
enum TuningHalf {
    /// A verified plan, written into the run directory.
    Planned(Box<Plan>),
    /// No feasible plan: what was found is reported, and the run ends with this status.
    NoPlan(Status),
}

/// Tunes on the run's data and writes the plan into the run directory.
fn tune_into(
    args: &RunArgs,
    training: &Training,
    run_dir: &RunDir,
    printer: &Printer,
) -> anyhow::Result<TuningHalf> {
    let shape = tuning_data(&args.tune, &training.data_choice(), printer)?;
    let Some(settings) = settings_at_length(&args.tune, shape, printer)? else {
        return Ok(TuningHalf::NoPlan(Status::Negative));
    };
    for note in &settings.notes {
        printer.note(note);
    }
    let tuned = search_only(&settings, printer)?;
    // JSON output belongs to the combined report below, not to the tuning half.
    let quiet_json = Printer::new(false, false, false);
    let Some(plan) = &tuned.plan else {
        let printer_for_plan = if printer.is_json() {
            printer
        } else {
            &quiet_json
        };
        let status = emit(&tuned, None, printer_for_plan)?;
        record(&tuned, &settings, printer)?;
        report(&tuned, &settings, printer)?;
        return Ok(TuningHalf::NoPlan(status));
    };
    // The plan first: a recording that cannot be written must not cost the plan.
    plan.save(&run_dir.plan_path())?;
    record(&tuned, &settings, printer)?;
    report(&tuned, &settings, printer)?;
    printer.status(format!(
        "plan: {} ({:.0} tokens/s measured), written to {}",
        plan.knobs,
        plan.measured.tokens_per_s,
        run_dir.plan_path().display()
    ));
    Ok(TuningHalf::Planned(Box::new(plan.clone())))
}

#[derive(Serialize)]
struct RunReport<'a> {
    plan: &'a Plan,
    training: TrainReport<'a>,
}

pub fn run(args: RunArgs, printer: &Printer) -> anyhow::Result<Status> {
    if args.tune.backend == Backend::Exec {
        // A runner's plan is measured in its framework; `run` trains on autotune's engine.
        return Err(autotune_core::Error::InvalidFlag {
            flag: "--backend exec".into(),
            problem: "`run` trains on autotune's own engine, where a trial runner's plan was not \
                      measured; tune with `autotune tune --backend exec --out plan.json -- \
                      RUNNER` and train in the runner's framework (`autotune export --plan \
                      plan.json --format deepspeed|trainer|accelerate|lightning`)"
                .into(),
        }
        .into());
    }
    let run_dir = RunDir::claim(&args.run_dir)?;
    let mut training = Training::resolve(
        &args.training,
        TrainingDefaults::RUN,
        Some(run_dir.checkpoints()),
        model_folder(&args.tune.planned.model),
    )?;
    let progress = TrainProgress::new(printer, training.steps);
    let plan = if training.resume {
        let plan = run_dir.resumed_plan()?;
        progress.notice(Notice::ResumingRun {
            dir: args.run_dir.clone(),
        });
        plan
    } else {
        run_dir.check_fresh(training.overwrite)?;
        match tune_into(&args, &training, &run_dir, printer)? {
            TuningHalf::Planned(plan) => *plan,
            TuningHalf::NoPlan(status) => return Ok(status),
        }
    };
    // A run stopped before its first checkpoint resumes from its plan alone.
    training.resume = training.resume && run_dir.has_checkpoints()?;
    let interrupt = interrupt_flag(printer);
    let summary = train_with_plan(
        &plan,
        &run_dir.plan_path(),
        &training,
        &progress,
        &interrupt,
    );
    progress.finish();
    let summary = summary?;
    progress::finished(printer, &summary);
    printer.data_json(&RunReport {
        plan: &plan,
        training: TrainReport::new(&plan.model, plan.knobs, &summary),
    });
    Ok(status_of(&summary))
}
