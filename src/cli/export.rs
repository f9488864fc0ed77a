//! `autotune export`: a plan's setting in the configuration language of other trainers. The
//! document goes to stdout as the tool loads it; what it cannot carry goes to stderr.

use autotune::plan::exports::{self, ExportFormat};
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
    let format =
        ExportFormat::parse(&args.format).ok_or_else(|| autotune_core::Error::InvalidFlag {
            flag: "--format".into(),
            problem: format!("({}) is not an export format", args.format),
        })?;
    if let Some(why) = exports::engine_mismatch(plan.provenance.as_ref(), format) {
        if !args.allow_engine_mismatch {
            return Err(autotune_core::Error::invalid(
                "plan",
                "provenance.engine",
                format!("(in {}): {why}", args.plan.display()),
            )
            .into());
        }
        printer.warn(format!("exporting anyway (--allow-engine-mismatch): {why}"));
    }
    if args.world_size.is_some() && format != ExportFormat::DeepSpeed {
        printer.warn(format!(
            "--world-size only scales DeepSpeed's train_batch_size; the {} export is per \
             device, so launch {world_size} processes",
            args.format
        ));
    }
    let knobs = &plan.knobs;
    let optimizer = &plan.model.optimizer;
    let notes = match format {
        ExportFormat::DeepSpeed => {
            let (config, notes) = exports::deepspeed_config(knobs, optimizer, world_size);
            printer.data_json(&config);
            notes
        }
        ExportFormat::Trainer => {
            let (config, notes) = exports::trainer_args(knobs, optimizer);
            printer.data_json(&config);
            notes
        }
        ExportFormat::Accelerate => {
            let (yaml, notes) = exports::accelerate_config(knobs);
            printer.document(yaml.trim_end());
            notes
        }
        ExportFormat::Lightning => {
            let (config, notes) = exports::lightning_args(knobs, optimizer.grad_clip);
            printer.data_json(&config);
            notes
        }
    };
    for note in notes {
        printer.note(note);
    }
    Ok(Status::Success)
}
