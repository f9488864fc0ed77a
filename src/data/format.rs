//! What a `--data` path holds, told from its name (and a folder from what is in it), and what
//! autotune does with it: token files and synthetic data are read; text only as raw bytes when
//! `--tokenizer bytes` asks for it; datasets of records and tokenizer files are refused with
//! the fix, never read as bytes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The kinds of file a `--data` path may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataFormat {
    /// Little-endian u16 token ids (`.bin`, `.u16`).
    TokensU16,
    /// Little-endian u32 token ids (`.u32`).
    TokensU32,
    /// Plain text (`.txt`, `.text`, `.md`).
    Text,
    /// Records, one JSON object a line (`.jsonl`, `.ndjson`).
    JsonLines,
    /// A JSON document (`.json`): an array of records.
    Json,
    /// A Parquet table (`.parquet`).
    Parquet,
    /// Arrow files (`.arrow`), or a `datasets` `save_to_disk` folder.
    Arrow,
    /// A tokenizer's or a model's own file (`tokenizer.json`, `tokenizer_config.json`,
    /// `config.json`, `*.safetensors`, `*.model`): not data.
    ModelFile,
    /// A folder that is no `datasets` folder.
    Folder,
    /// Anything else, by its extension (empty: none).
    Unknown(String),
}

impl DataFormat {
    /// The format of `path`.
    pub fn of(path: &Path) -> Self {
        if path.is_dir() {
            let saved = ["dataset_info.json", "state.json", "dataset_dict.json"];
            return if saved.iter().any(|f| path.join(f).is_file()) {
                DataFormat::Arrow
            } else {
                DataFormat::Folder
            };
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let model_files = [
            "tokenizer.json",
            "tokenizer_config.json",
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
        ];
        if model_files.contains(&name) {
            return DataFormat::ModelFile;
        }
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        match extension.as_str() {
            "bin" | "u16" => DataFormat::TokensU16,
            "u32" => DataFormat::TokensU32,
            "txt" | "text" | "md" => DataFormat::Text,
            "jsonl" | "ndjson" => DataFormat::JsonLines,
            "json" => DataFormat::Json,
            "parquet" => DataFormat::Parquet,
            "arrow" => DataFormat::Arrow,
            "safetensors" | "model" | "gguf" | "pt" | "pth" => DataFormat::ModelFile,
            other => DataFormat::Unknown(other.to_string()),
        }
    }

    /// What the format is, for people.
    pub fn describe(&self) -> String {
        match self {
            DataFormat::TokensU16 => "a file of u16 token ids".into(),
            DataFormat::TokensU32 => "a file of u32 token ids".into(),
            DataFormat::Text => "plain text".into(),
            DataFormat::JsonLines => "JSON lines (records)".into(),
            DataFormat::Json => "a JSON document (records)".into(),
            DataFormat::Parquet => "a Parquet table (records)".into(),
            DataFormat::Arrow => "an Arrow dataset (records)".into(),
            DataFormat::ModelFile => "a model's or tokenizer's own file".into(),
            DataFormat::Folder => "a folder".into(),
            DataFormat::Unknown(ext) if ext.is_empty() => "a file without an extension".into(),
            DataFormat::Unknown(ext) => format!("a `.{ext}` file"),
        }
    }
}

/// The formats of record files (`--data-format`, which overrides what names say).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum RecordFormat {
    /// One JSON object a line.
    Jsonl,
    /// A JSON array of objects.
    Json,
    /// Plain text: documents between blank lines.
    Text,
    /// A Parquet table.
    Parquet,
    /// Arrow IPC files, or a `datasets` `save_to_disk` folder.
    Arrow,
}

impl RecordFormat {
    /// The record format of a file of `format`, if it is one.
    pub fn of(format: &DataFormat) -> Option<Self> {
        Some(match format {
            DataFormat::JsonLines => RecordFormat::Jsonl,
            DataFormat::Json => RecordFormat::Json,
            DataFormat::Text => RecordFormat::Text,
            DataFormat::Parquet => RecordFormat::Parquet,
            DataFormat::Arrow => RecordFormat::Arrow,
            _ => return None,
        })
    }
}

/// The record files of `paths`, in order: each file as it is, each folder's record files
/// (searched through its subfolders, hidden ones skipped, in name order), a `datasets` folder
/// whole. A folder that holds none, or a file that is no record file (unless `forced` names
/// the format), is an error naming it.
pub fn record_files(paths: &[PathBuf], forced: Option<RecordFormat>) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        match DataFormat::of(path) {
            DataFormat::Folder => {
                let found = folder_records(path)?;
                if found.is_empty() {
                    return Err(Error::Usage(format!(
                        "the folder `{}` holds no record file (.jsonl, .json, .txt, .parquet, \
                         .arrow); give the files, or a folder that holds them",
                        path.display()
                    )));
                }
                files.extend(found);
            }
            format if forced.is_some() || RecordFormat::of(&format).is_some() => {
                files.push(path.clone())
            }
            other => {
                return Err(Error::Usage(format!(
                    "`{}` is {}, and a dataset of several files or folders takes record files \
                     only (.jsonl, .json, .txt, .parquet, .arrow); name its format with \
                     --data-format if its name hides it",
                    path.display(),
                    other.describe()
                )))
            }
        }
    }
    Ok(files)
}

/// The record files under `dir`, in name order.
fn folder_records(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::file("cannot read", dir, e))?;
    let mut paths: Vec<PathBuf> = entries
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .map_err(|e| Error::file("cannot read", dir, e))?;
    paths.sort();
    let mut files = Vec::new();
    for path in paths {
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        match DataFormat::of(&path) {
            DataFormat::Folder => files.extend(folder_records(&path)?),
            format if RecordFormat::of(&format).is_some() => files.push(path),
            _ => {}
        }
    }
    Ok(files)
}

/// How text becomes tokens (`--tokenizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TextTokens {
    /// No tokenizer was given: text is refused rather than guessed at.
    #[default]
    NotGiven,
    /// One token a byte (`--tokenizer bytes`), for byte-level models of 256 symbols or more.
    Bytes,
    /// The model's tokenizer: text and records become examples.
    Model,
}

/// Why `path`, of `format`, cannot be trained on as given, with the fix; `None` when it can.
pub fn refusal(path: &Path, format: &DataFormat, tokens: TextTokens) -> Option<String> {
    let what = format.describe();
    let token_file = "a token file of the model's ids (.bin or .u16: u16, .u32: u32)";
    match format {
        DataFormat::TokensU16 | DataFormat::TokensU32 => None,
        DataFormat::Text if tokens != TextTokens::NotGiven => None,
        DataFormat::JsonLines | DataFormat::Json | DataFormat::Parquet | DataFormat::Arrow
            if tokens == TextTokens::Model =>
        {
            None
        }
        DataFormat::Text => Some(format!(
            "`{}` is {what}, which needs a tokenizer: give the model's (--model DIR, a Hugging \
             Face folder, or --tokenizer PATH, its tokenizer.json), or pass --tokenizer bytes to \
             train on the raw bytes (one token a byte)",
            path.display()
        )),
        DataFormat::JsonLines | DataFormat::Json | DataFormat::Parquet | DataFormat::Arrow => {
            Some(format!(
                "`{}` is {what}, which needs the model's tokenizer (never its bytes): give \
                 --model DIR (a Hugging Face folder) or --tokenizer PATH (its tokenizer.json)",
                path.display()
            ))
        }
        DataFormat::ModelFile => Some(format!(
            "`{}` is {what}, not training data; a model folder goes to --model or \
             --init-from, and --data takes {token_file}",
            path.display()
        )),
        DataFormat::Folder | DataFormat::Unknown(_) => Some(format!(
            "`{}` is {what}, which is no data format autotune knows; --data takes pattern, \
             random, {token_file}, or text (.txt) with --tokenizer bytes",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_told_from_names_and_only_tokens_and_asked_for_bytes_pass() {
        let table: [(&str, DataFormat, bool, bool); 12] = [
            ("train.bin", DataFormat::TokensU16, true, true),
            ("train.u32", DataFormat::TokensU32, true, true),
            ("corpus.txt", DataFormat::Text, false, true),
            ("chat.jsonl", DataFormat::JsonLines, false, false),
            ("alpaca.json", DataFormat::Json, false, false),
            ("rows.PARQUET", DataFormat::Parquet, false, false),
            ("part-0.arrow", DataFormat::Arrow, false, false),
            ("tokenizer.json", DataFormat::ModelFile, false, false),
            ("model/config.json", DataFormat::ModelFile, false, false),
            ("model.safetensors", DataFormat::ModelFile, false, false),
            ("data.csv", DataFormat::Unknown("csv".into()), false, false),
            ("README", DataFormat::Unknown(String::new()), false, false),
        ];
        for (name, format, plain, with_bytes) in table {
            let path = Path::new(name);
            assert_eq!(DataFormat::of(path), format, "{name}");
            let passes = |t| refusal(path, &format, t).is_none();
            assert_eq!(passes(TextTokens::NotGiven), plain, "{name}");
            assert_eq!(passes(TextTokens::Bytes), with_bytes, "{name}");
            if let Some(why) = refusal(path, &format, TextTokens::NotGiven) {
                assert!(why.contains(name), "the refusal names the file: {why}");
            }
        }
    }

    #[test]
    fn folders_give_their_record_files_in_name_order_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for name in [
            "b.jsonl",
            "a.txt",
            "sub/c.parquet",
            "sub/.hidden.jsonl",
            "notes.csv",
            "tokens.bin",
            "tokenizer.json",
        ] {
            std::fs::create_dir_all(root.join(name).parent().unwrap()).unwrap();
            std::fs::write(root.join(name), "x").unwrap();
        }
        let files = record_files(&[root.to_path_buf()], None).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.strip_prefix(root).unwrap())
            .collect();
        assert_eq!(
            names,
            [
                Path::new("a.txt"),
                Path::new("b.jsonl"),
                Path::new("sub/c.parquet")
            ]
        );
        let empty = root.join("empty");
        std::fs::create_dir(&empty).unwrap();
        let why = record_files(&[empty], None).unwrap_err().to_string();
        assert!(why.contains("holds no record file"), "{why}");
        let csv = root.join("notes.csv");
        let why = record_files(std::slice::from_ref(&csv), None)
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("notes.csv") && why.contains("--data-format"),
            "{why}"
        );
        assert_eq!(
            record_files(std::slice::from_ref(&csv), Some(RecordFormat::Jsonl)).unwrap(),
            [csv]
        );
    }

    #[test]
    fn a_saved_dataset_folder_is_arrow_and_another_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(DataFormat::of(dir.path()), DataFormat::Folder);
        std::fs::write(dir.path().join("dataset_info.json"), "{}").unwrap();
        assert_eq!(DataFormat::of(dir.path()), DataFormat::Arrow);
    }
}
