//! `autotune export-weights`'s flags and what they resolve to: the checkpoint to export (a
//! checkpoint directory stands for its newest), verified, and the folder and dtype to write.

use std::path::PathBuf;

use clap::Args;

use crate::hf::ExportDtype;
use crate::train::checkpoint;
use crate::{Error, Result};

/// The flags of `autotune export-weights`.
#[derive(Debug, Args)]
pub struct ExportWeightsArgs {
    /// A checkpoint (`DIR/step-000100`), or a checkpoint directory (its `latest` is exported).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The folder to write `config.json` and `model.safetensors` into.
    #[arg(long)]
    pub out: PathBuf,
    /// The weights' dtype in the file: f32 (the masters as they are) or bf16.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: WeightsDtype,
    /// The tokenizer to include (a folder or its `tokenizer.json`; default: the one the run's
    /// data was read with, when it was record data).
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// Print what was written as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The dtype of exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsDtype {
    /// f32, exactly the master weights.
    F32,
    /// bf16, rounded to nearest even (half the size).
    Bf16,
}

/// A validated `export-weights`.
#[derive(Debug)]
pub struct ExportWeightsSettings {
    /// The checkpoint, verified against its manifest.
    pub checkpoint: PathBuf,
    /// The folder to write.
    pub out: PathBuf,
    /// The weights' dtype in the file.
    pub dtype: ExportDtype,
    /// The tokenizer to include, when not the run's own.
    pub tokenizer: Option<PathBuf>,
}

impl ExportWeightsSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &ExportWeightsArgs) -> Result<Self> {
        // A checkpoint directory stands for its newest checkpoint.
        let checkpoint = if args.checkpoint.join("state.json").is_file() {
            args.checkpoint.clone()
        } else {
            checkpoint::latest(&args.checkpoint)?.ok_or_else(|| {
                Error::Usage(format!(
                    "`{}` is neither a checkpoint (no state.json) nor a checkpoint directory (no \
                     `latest`); give --checkpoint DIR/step-NNNNNN or the directory train wrote",
                    args.checkpoint.display()
                ))
            })?
        };
        checkpoint::verify(&checkpoint)?;
        // The checkpoint directory as a whole: an export inside it would sit among the
        // checkpoints that retention and resumes manage.
        let checkpoints = crate::outputs::parent_dir(&checkpoint);
        let mut inputs = vec![("--checkpoint", checkpoints)];
        if let Some(tokenizer) = &args.tokenizer {
            inputs.push(("--tokenizer", tokenizer));
        }
        crate::outputs::check_output_folder("--out", &args.out, &inputs)?;
        Ok(Self {
            checkpoint,
            out: args.out.clone(),
            dtype: match args.dtype {
                WeightsDtype::F32 => ExportDtype::F32,
                WeightsDtype::Bf16 => ExportDtype::Bf16,
            },
            tokenizer: args.tokenizer.clone(),
        })
    }
}
