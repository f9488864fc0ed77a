//! `autotune export`: a plan's setting in the configuration language of other trainers.

use autotune::plan::exports::{deepspeed_config, trainer_args};
use autotune::plan::schema::Plan;

use super::args::ExportArgs;
use super::printer::Printer;
use super::Status;

/// The most processes a plan is exported for: a million GPUs, and DeepSpeed's
/// `train_batch_size` (micro-batch × accumulation × world size) still fits in 64 bits.
const MAX_WORLD_SIZE: usize = 1 << 20;

pub fn run(args: ExportArgs, printer: &Printer) -> anyhow::Result<Status> {
    let plan = Plan::load(&args.plan)?;
    let world_size = args.world_size.unwrap_or(plan.knobs.data_parallel.degree);
    if !(1..=MAX_WORLD_SIZE).contains(&world_size) {
        return Err(autotune_core::Error::InvalidFlag {
            flag: "--world-size".into(),
            problem: format!(
                "({world_size}) is the number of processes; use 1 to {MAX_WORLD_SIZE}"
            ),
        }
        .into());
    }
    match args.format.as_str() {
        "deepspeed" => printer.data_json(&deepspeed_config(&plan.knobs, world_size)),
        _ => printer.data_json(&trainer_args(&plan.knobs)),
    }
    Ok(Status::Success)
}
