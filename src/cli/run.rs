//! `autotune run`: tune, then train with the verified plan, in one command.
//!
//! The plan is written to `RUN_DIR/plan.json` before training starts, and checkpoints go to
//! `RUN_DIR/checkpoints`, so a stopped run can be resumed with `autotune run --resume` (the
//! same as `autotune train --plan RUN_DIR/plan.json --checkpoint-dir RUN_DIR/checkpoints
//! --resume`). One run owns a run directory at a time (a lock), and a directory that holds a
//! run is refused unless `--resume` continues it or `--overwrite` starts over.

use serde::Serialize;

use autotune::plan::schema::Plan;
use autotune::train::checkpoint_dir;
use autotune::train::run::RunSummary;

use autotune::settings::tune::{Backend, TuneSettings};

use super::args::RunArgs;
use super::printer::Printer;
use super::train::{train_with_plan, PlanTraining};
use super::tune::{emit, record, report, search_only};
use super::Status;

#[derive(Serialize)]
struct RunReport<'a> {
    plan: &'a Plan,
    training: super::train::TrainReport<'a>,
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
    let run_dir = &args.train.run_dir;
    // The directory is created and locked before tuning: a location that cannot be written
    // fails now, not after the search.
    let _lock = checkpoint_dir::lock(run_dir)?;
    let plan_path = run_dir.join("plan.json");
    let checkpoints = run_dir.join("checkpoints");
    let resume = args.train.resume;
    let tuned;
    let plan = if resume {
        if !plan_path.exists() {
            anyhow::bail!(
                "`run --resume`: `{}` holds no plan.json, so there is no run to continue; drop --resume to start one",
                run_dir.display()
            );
        }
        printer.status(format!(
            "resuming the run in {} with its plan (the tuning flags are not used)",
            run_dir.display()
        ));
        Plan::load(&plan_path)?
    } else {
        let holds_run = plan_path.exists() || checkpoint_dir::holds_checkpoints(&checkpoints)?;
        if holds_run && !args.train.overwrite {
            anyhow::bail!(
                "`{}` already holds a run (plan.json, checkpoints); pass --resume to continue it, --overwrite to start over and replace it, or use another --run-dir",
                run_dir.display()
            );
        }
        let settings = TuneSettings::from_args(&args.tune)?;
        tuned = search_only(&settings, printer)?;
        // JSON output belongs to the combined report below, not to the tuning half.
        let quiet_json = Printer::new(false, false, false);
        let Some(plan) = &tuned.plan else {
            let status = emit(
                &tuned,
                None,
                if printer.is_json() {
                    printer
                } else {
                    &quiet_json
                },
            );
            record(&tuned, &settings, printer)?;
            report(&tuned, &settings, printer)?;
            return status;
        };
        // The plan first: a recording that cannot be written must not cost the plan.
        plan.save(&plan_path)?;
        record(&tuned, &settings, printer)?;
        report(&tuned, &settings, printer)?;
        printer.status(format!(
            "plan: {} ({:.0} tokens/s measured), written to {}",
            plan.knobs,
            plan.measured.tokens_per_s,
            plan_path.display()
        ));
        plan.clone()
    };
    let training = PlanTraining {
        plan: &plan,
        plan_path: &plan_path,
        steps: args.train.steps,
        data: &args.train.data,
        checkpoint_dir: Some(checkpoints.clone()),
        checkpoint_every: args.train.checkpoint_every,
        eval_every: args.train.eval_every,
        seed: args.train.seed,
        // A run stopped before its first checkpoint resumes from its plan alone.
        resume: resume && checkpoint_dir::holds_checkpoints(&checkpoints)?,
        overwrite: args.train.overwrite,
        keep_last: args.train.keep_last.map(|n| n as usize),
        init_from: args.train.init_from.clone(),
        schedule: (&args.train.schedule).into(),
        metrics: args.train.metrics.clone(),
    };
    let (summary, status): (RunSummary, Status) = train_with_plan(&training, printer)?;
    printer.data_json(&RunReport {
        plan: &plan,
        training: super::train::TrainReport::new(&plan.model, plan.knobs, &summary),
    });
    Ok(status)
}
