//! `autotune run`: tune, then train with the verified plan, in one command.
//!
//! The plan is written to `RUN_DIR/plan.json` before training starts, and checkpoints go to
//! `RUN_DIR/checkpoints`, so a stopped run can be resumed with
//! `autotune train --plan RUN_DIR/plan.json --checkpoint-dir RUN_DIR/checkpoints --resume`.

use serde::Serialize;

use autotune::plan::schema::Plan;
use autotune::train::run::RunSummary;

use super::args::RunArgs;
use super::printer::Printer;
use super::train::{train_with_plan, PlanTraining};
use super::tune::config::TuneConfig;
use super::tune::{emit, tune};
use super::Status;

#[derive(Serialize)]
struct RunReport<'a> {
    plan: &'a Plan,
    training: super::train::TrainReport<'a>,
}

pub fn run(args: RunArgs, printer: &Printer) -> anyhow::Result<Status> {
    std::fs::create_dir_all(&args.train.run_dir).map_err(|e| {
        anyhow::anyhow!(
            "cannot create run directory `{}`: {e}",
            args.train.run_dir.display()
        )
    })?;
    let tuned = tune(&TuneConfig::from_args(&args.tune)?, printer)?;
    let plan_path = args.train.run_dir.join("plan.json");
    // JSON output belongs to the combined report below, not to the tuning half.
    let quiet_json = Printer::new(false, false, false);
    let Some(plan) = &tuned.plan else {
        return emit(
            &tuned,
            None,
            if printer.is_json() {
                printer
            } else {
                &quiet_json
            },
        );
    };
    plan.save(&plan_path)?;
    printer.status(format!(
        "plan: {} ({:.0} tokens/s measured), written to {}",
        plan.knobs,
        plan.measured.tokens_per_s,
        plan_path.display()
    ));
    let training = PlanTraining {
        plan,
        plan_path: &plan_path,
        steps: args.train.steps,
        data: &args.train.data,
        checkpoint_dir: Some(args.train.run_dir.join("checkpoints")),
        checkpoint_every: args.train.checkpoint_every,
        eval_every: args.train.eval_every,
        seed: args.train.seed,
        resume: false,
    };
    let (summary, status): (RunSummary, Status) = train_with_plan(&training, printer)?;
    printer.data_json(&RunReport {
        plan,
        training: super::train::TrainReport::new(&plan.model, plan.knobs, &summary),
    });
    Ok(status)
}
