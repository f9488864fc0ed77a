//! The `--model` flag of every command: a preset name from the core's one registry
//! ([`PRESETS`]), which its help and the shell completions list, or a path to a spec file.

use std::ffi::OsStr;

use clap::builder::{PossibleValue, TypedValueParser};

use crate::spec::model::{ModelSpec, NormKind, PRESETS};

/// Parses `--model`: any name or path is taken as it is (a path is only read when the
/// command resolves it), while the presets are offered as its possible values, so that
/// `--help` and the completion scripts list every one of them.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelName;

impl TypedValueParser for ModelName {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<String, clap::Error> {
        clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(PRESETS.iter().map(PossibleValue::new)))
    }
}

/// The Hugging Face model folder `model` names, when it names a folder: its config is the
/// model, its tokenizer the data's, and its weights (when it holds some) where a fresh run
/// starts, as `from_pretrained` does.
pub fn model_folder(model: &str) -> Option<std::path::PathBuf> {
    let path = std::path::Path::new(model);
    path.is_dir().then(|| path.to_path_buf())
}

/// The model `model` names, trained on sequences of `seq_len` tokens when given (else the
/// model's own length: its preset's, or its config's up to 2048).
pub fn resolve_model(model: &str, seq_len: Option<usize>) -> crate::Result<ModelSpec> {
    let mut spec = ModelSpec::resolve(model)?;
    if let Some(seq_len) = seq_len {
        spec.seq_len = seq_len;
        spec.validate().map_err(|e| {
            crate::Error::from(autotune_core::Error::InvalidFlag {
                flag: format!("--seq-len {seq_len}"),
                problem: format!("does not suit model `{model}`: {e}"),
            })
        })?;
    }
    Ok(spec)
}

/// Whether `folder` holds weights (`model.safetensors`, or the shards its index lists).
/// Whatever they are: a reader refuses weights that are no regular file, where skipping them
/// would train from random weights unasked.
pub fn holds_weights(folder: &std::path::Path) -> bool {
    let weights = ["model.safetensors", "model.safetensors.index.json"];
    weights.iter().any(|w| folder.join(w).exists())
}

/// The presets as a Markdown table, one row each from the registry: the README's table of
/// models is this text (a test holds it there).
pub fn presets_table() -> String {
    let mut table = String::from(
        "| preset | family | parameters | layers × width | heads (key/value) | vocabulary | sequence |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for name in PRESETS {
        let Ok(spec) = ModelSpec::preset(name) else {
            continue;
        };
        let family = match (spec.norm_kind, spec.causal) {
            (NormKind::Rms, _) => "Llama-style decoder",
            (NormKind::Layer, true) => "GPT-2-style decoder",
            (NormKind::Layer, false) => "encoder",
        };
        let kv = spec.n_kv_heads.unwrap_or(spec.n_heads);
        table.push_str(&format!(
            "| `{name}` | {family} | {:.1}M | {} × {} | {} ({kv}) | {} | {} |\n",
            spec.parameter_count() as f64 / 1e6,
            spec.n_layers,
            spec.d_model,
            spec.n_heads,
            spec.vocab_size,
            spec.seq_len,
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_offered_and_any_path_is_taken() {
        let offered: Vec<String> = ModelName
            .possible_values()
            .unwrap()
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(offered, PRESETS.map(String::from).to_vec());
        let cmd = clap::Command::new("t");
        let parsed = ModelName
            .parse_ref(&cmd, None, OsStr::new("models/llama/config.json"))
            .unwrap();
        assert_eq!(parsed, "models/llama/config.json");
    }
}
