//! The tokenizer's part of an exported model folder: the tokenizer's own files copied as they
//! are, the special tokens' ids in `config.json`, and a `generation_config.json` that stops at
//! the end of a turn, so that `AutoTokenizer` and `generate` work on the folder as they did on
//! the model it was fine-tuned from.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::data::source::DataSpec;
use crate::data::tokenizer::Tokenizer;
use crate::{Error, Result};

/// The files of a Hugging Face tokenizer that travel with a model.
const FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// The tokenizer a run's data was read with (record data records its tokenizer), as the folder
/// holding it.
pub fn used_by(data: &DataSpec) -> Option<PathBuf> {
    match data {
        DataSpec::Records(records) => Some(folder(&records.tokenizer)),
        _ => None,
    }
}

/// The folder holding the tokenizer `path` names (a `tokenizer.json`, or its folder).
pub fn folder(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    }
}

/// Copies the tokenizer of `from` (a folder) into `out`, sets its special tokens' ids in
/// `config` and writes `generation_config.json`; returns the files copied.
pub fn export(from: &Path, out: &Path, config: &mut Value) -> Result<Vec<String>> {
    let tokenizer = Tokenizer::from_folder(from)?;
    let mut copied = Vec::new();
    for name in FILES {
        let source = from.join(name);
        if source.is_file() {
            let target = out.join(name);
            let bytes = crate::input_file::read(&source, crate::input_file::TOKENIZER_LIMIT)
                .map_err(|e| Error::file("cannot read", &source, e))?;
            crate::atomic_file::write(&target, &bytes)
                .map_err(|e| Error::file("cannot write", &target, e))?;
            copied.push(name.to_string());
        }
    }
    let ids = TokenIds::of(&tokenizer);
    if let Some(c) = config.as_object_mut() {
        ids.set(c);
    }
    let mut generation = Map::new();
    ids.set(&mut generation);
    generation.insert("_from_model_config".into(), json!(true));
    let text = serde_json::to_string_pretty(&Value::Object(generation))
        .map_err(|e| Error::internal(e.to_string()))?;
    let path = out.join("generation_config.json");
    crate::atomic_file::write(&path, text.as_bytes())
        .map_err(|e| Error::file("cannot write", &path, e))?;
    Ok(copied)
}

/// The special tokens' ids a config names.
struct TokenIds {
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
}

impl TokenIds {
    fn of(tokenizer: &Tokenizer) -> Self {
        Self {
            bos: tokenizer.bos().map(|t| t.id),
            eos: tokenizer.eos().map(|t| t.id),
            pad: tokenizer.pad().map(|t| t.id),
        }
    }

    /// Sets `bos_token_id`, `eos_token_id` and `pad_token_id` where the tokenizer has them.
    fn set(&self, map: &mut Map<String, Value>) {
        for (key, id) in [
            ("bos_token_id", self.bos),
            ("eos_token_id", self.eos),
            ("pad_token_id", self.pad),
        ] {
            if let Some(id) = id {
                map.insert(key.into(), json!(id));
            }
        }
    }
}
