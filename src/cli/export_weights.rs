//! `autotune export-weights`: a checkpoint's master weights as a Hugging Face folder
//! (`config.json`, `model.safetensors` with `format: pt`) for `transformers` to load.

use autotune::hf::{export_weights, ExportDtype};
use autotune::train::checkpoint;

use super::args::{ExportWeightsArgs, WeightsDtype};
use super::printer::Printer;
use super::Status;

pub fn run(args: ExportWeightsArgs, printer: &Printer) -> anyhow::Result<Status> {
    // A checkpoint directory stands for its newest checkpoint.
    let source = if args.checkpoint.join("state.json").is_file() {
        args.checkpoint.clone()
    } else {
        checkpoint::latest(&args.checkpoint)?.ok_or_else(|| {
            anyhow::anyhow!(
                "`{}` is neither a checkpoint (no state.json) nor a checkpoint directory (no \
                 `latest`); give --checkpoint DIR/step-NNNNNN or the directory train wrote",
                args.checkpoint.display()
            )
        })?
    };
    checkpoint::verify(&source)?;
    let dtype = match args.dtype {
        WeightsDtype::F32 => ExportDtype::F32,
        WeightsDtype::Bf16 => ExportDtype::Bf16,
    };
    let exported = export_weights(&source, &args.out, dtype)?;
    printer.status(format!(
        "wrote {} tensors of `{}` for {} into {}",
        exported.tensors,
        source.display(),
        exported.architecture,
        exported.folder.display()
    ));
    printer.data_json(&serde_json::json!({
        "checkpoint": source,
        "folder": exported.folder,
        "tensors": exported.tensors,
        "architecture": exported.architecture,
    }));
    Ok(Status::Success)
}
