//! `autotune export-weights`: a checkpoint's master weights as a Hugging Face folder
//! (`config.json`, `model.safetensors` with `format: pt`) for `transformers` to load.

use autotune::hf::export_weights;
use autotune::settings::export_weights::{ExportWeightsArgs, ExportWeightsSettings};

use super::printer::Printer;
use super::Status;

pub fn run(args: ExportWeightsArgs, printer: &Printer) -> anyhow::Result<Status> {
    let settings = ExportWeightsSettings::from_args(&args)?;
    let source = &settings.checkpoint;
    let exported = export_weights(
        source,
        &settings.out,
        settings.dtype,
        settings.tokenizer.as_deref(),
    )?;
    printer.status(format!(
        "wrote {} tensors of `{}` for {} into {}",
        exported.tensors,
        source.display(),
        exported.architecture,
        exported.folder.display()
    ));
    match &exported.tokenizer {
        Some((from, files)) => printer.status(format!(
            "with the tokenizer of `{}` ({}) and generation_config.json",
            from.display(),
            files.join(", ")
        )),
        None => printer.note(
            "no tokenizer was known for this run, so the folder has none; give --tokenizer \
             DIR to include the model's",
        ),
    }
    printer.data_json(&serde_json::json!({
        "checkpoint": source,
        "folder": exported.folder,
        "tensors": exported.tensors,
        "architecture": exported.architecture,
        "tokenizer": exported.tokenizer.as_ref().map(|(from, _)| from),
    }));
    Ok(Status::Success)
}
