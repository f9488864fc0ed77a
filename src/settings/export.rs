//! `autotune export`'s flags and [`ExportSettings`]: a plan, the tool to export it to, and
//! the world it runs in, checked before anything is written.

use std::path::PathBuf;

use clap::Args;

use crate::plan::exports::{self, ExportFormat};
use crate::plan::schema::Plan;
use crate::Result;

/// The most processes a plan is exported for: a million GPUs, and DeepSpeed's
/// `train_batch_size` (micro-batch × accumulation × world size) still fits in 64 bits.
const MAX_WORLD_SIZE: usize = 1 << 20;

/// The flags of `autotune export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The plan file.
    #[arg(long)]
    pub plan: PathBuf,
    /// deepspeed (a ds_config.json), trainer (Hugging Face TrainingArguments as JSON),
    /// accelerate (an Accelerate config YAML) or lightning (Trainer keyword arguments as JSON).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
        ExportFormat::ALL.iter().map(|(name, _)| *name)
    ))]
    pub format: String,
    /// Export a plan measured on another engine than the target tool's (every plan tuned on
    /// autotune's own engine, for the PyTorch tools): its batch may then run out of memory
    /// there.
    #[arg(long)]
    pub allow_engine_mismatch: bool,
    /// Export a plan whose knobs the tool cannot run as measured (compact optimizer state, the
    /// update in backward): the export says what changed and what it costs in memory, on stderr
    /// and, in the Accelerate YAML, as comments.
    #[arg(long)]
    pub allow_lossy_export: bool,
    /// Data-parallel processes (DeepSpeed's train_batch_size = micro × accum × world size);
    /// default the plan's own data-parallel degree. More than that runs the plan's per-GPU
    /// setting on a larger cluster.
    #[arg(long)]
    pub world_size: Option<usize>,
}

/// A validated `export`.
#[derive(Debug)]
pub struct ExportSettings {
    /// The plan.
    pub plan: Plan,
    /// The tool's format.
    pub format: ExportFormat,
    /// Processes the export is for.
    pub world_size: usize,
    /// Warnings for people: an engine mismatch let through, a world size the format ignores.
    pub warnings: Vec<String>,
    /// What the export changes of the plan, let through by `--allow-lossy-export`, for the
    /// document too where its format has comments.
    pub lossy: Option<String>,
}

impl ExportSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &ExportArgs) -> Result<Self> {
        let plan = Plan::load(&args.plan)?;
        let world_size = args.world_size.unwrap_or(plan.knobs.data_parallel.degree);
        if !(1..=MAX_WORLD_SIZE).contains(&world_size) {
            return Err(invalid_flag(
                "--world-size",
                format!("({world_size}) is the number of processes; use 1 to {MAX_WORLD_SIZE}"),
            ));
        }
        let format = ExportFormat::parse(&args.format).ok_or_else(|| {
            invalid_flag(
                "--format",
                format!("({}) is not an export format", args.format),
            )
        })?;
        let mut warnings = Vec::new();
        if let Some(why) = exports::engine_mismatch(plan.provenance.as_ref(), format) {
            if !args.allow_engine_mismatch {
                return Err(crate::Error::invalid(
                    "plan",
                    "provenance.engine",
                    format!("(in {}): {why}", args.plan.display()),
                ));
            }
            warnings.push(format!("exporting anyway (--allow-engine-mismatch): {why}"));
        }
        let changes = exports::changes(&plan.model, &plan.knobs, format);
        let lossy = (!changes.is_faithful()).then(|| changes.describe());
        if let Some(what) = &lossy {
            if !args.allow_lossy_export {
                return Err(crate::Error::Usage(format!(
                    "plan `{}` cannot be exported to {} as it was measured: {what}, so its \
                     batch may not fit or run as fast there. Tune for what the tool can run \
                     (without --allow-compact-state, --update in-backward and --allow-fp8), or \
                     pass --allow-lossy-export to export it anyway",
                    args.plan.display(),
                    format.tool_name()
                )));
            }
            warnings.push(format!("exporting anyway (--allow-lossy-export): {what}"));
        }
        if args.world_size.is_some() && format != ExportFormat::DeepSpeed {
            warnings.push(format!(
                "--world-size only scales DeepSpeed's train_batch_size; the {} export is per \
                 device, so launch {world_size} processes",
                args.format
            ));
        }
        Ok(Self {
            plan,
            format,
            world_size,
            warnings,
            lossy,
        })
    }
}

fn invalid_flag(flag: &str, problem: String) -> crate::Error {
    autotune_core::Error::InvalidFlag {
        flag: flag.into(),
        problem,
    }
    .into()
}
