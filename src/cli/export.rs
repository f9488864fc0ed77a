//! `autotune export`: a plan's setting in the configuration language of other trainers.

use autotune::plan::exports::{deepspeed_config, trainer_args};
use autotune::plan::schema::Plan;

use super::args::ExportArgs;
use super::printer::Printer;
use super::Status;

pub fn run(args: ExportArgs, printer: &Printer) -> anyhow::Result<Status> {
    let plan = Plan::load(&args.plan)?;
    if args.world_size == Some(0) {
        anyhow::bail!("`--world-size 0`: there must be at least one process");
    }
    let world_size = args.world_size.unwrap_or(plan.knobs.data_parallel.degree);
    match args.format.as_str() {
        "deepspeed" => printer.data_json(&deepspeed_config(&plan.knobs, world_size)),
        _ => printer.data_json(&trainer_args(&plan.knobs)),
    }
    Ok(Status::Success)
}
