//! A dataset of record files as training takes it: the files read by their format, each
//! record made an example by the model's tokenizer (and, for conversations, its chat
//! template), the examples cut to the sequence length. [`RecordsSpec`] is what a checkpoint
//! records of it, with a fingerprint of every input, so a resumed run is refused a dataset that
//! changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::dataset::{Cut, Dataset, Example};
use super::examples::{plain, templated, TrainOn};
use super::format::DataFormat;
use super::records::{self, Columns, Record};
use super::template::ChatTemplate;
use super::tokenizer::Tokenizer;
use crate::spec::model::ModelSpec;
use crate::{Error, Result};

/// Record files tokenized by a model's tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordsSpec {
    /// The files, in the order given.
    pub files: Vec<PathBuf>,
    /// The tokenizer: a `tokenizer.json`, or the model folder that holds one.
    pub tokenizer: PathBuf,
    /// What the loss trains on; `None`: what each record's schema says.
    pub train_on: Option<TrainOn>,
    /// The user's column names for the schemas' fields.
    pub columns: BTreeMap<String, String>,
    /// SHA-256 of the files', the tokenizer's and its config's bytes and of the settings above.
    pub fingerprint: String,
}

impl RecordsSpec {
    /// The dataset of `files` for the tokenizer at `tokenizer`; reads every input once to take
    /// its fingerprint.
    pub fn new(
        files: Vec<PathBuf>,
        tokenizer: PathBuf,
        train_on: Option<TrainOn>,
        columns: &Columns,
    ) -> Result<Self> {
        let columns = columns.pairs().clone();
        let mut hash = Sha256::new();
        for file in files.iter().chain(tokenizer_files(&tokenizer).iter()) {
            let bytes = std::fs::read(file).map_err(|e| Error::file("cannot read", file, e))?;
            hash.update((bytes.len() as u64).to_le_bytes());
            hash.update(&bytes);
        }
        hash.update(format!("{train_on:?}{columns:?}").as_bytes());
        let fingerprint = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            files,
            tokenizer,
            train_on,
            columns,
            fingerprint,
        })
    }

    /// The tokenizer.
    pub fn open_tokenizer(&self) -> Result<Tokenizer> {
        if self.tokenizer.is_dir() {
            Tokenizer::from_folder(&self.tokenizer)
        } else {
            Tokenizer::from_file(&self.tokenizer)
        }
    }

    /// Every record of the files, in order.
    pub fn records(&self) -> Result<Vec<Record>> {
        let columns = Columns::from_pairs(self.columns.clone());
        let mut all = Vec::new();
        for file in &self.files {
            let records = match DataFormat::of(file) {
                DataFormat::JsonLines => records::json_lines(file, &columns)?,
                DataFormat::Json => records::json_array(file, &columns)?,
                DataFormat::Text => records::text_documents(file)?,
                other => {
                    return Err(Error::Usage(format!(
                        "`{}` is {}, which is no record format autotune reads",
                        file.display(),
                        other.describe()
                    )))
                }
            };
            all.extend(records);
        }
        Ok(all)
    }

    /// The examples of every record, tokenized for `model` (whose vocabulary must hold the
    /// tokenizer's), cut to its sequence length.
    pub fn load(&self, model: &ModelSpec) -> Result<(Dataset, Cut)> {
        let tokenizer = self.open_tokenizer()?;
        if tokenizer.vocab_size() > model.vocab_size {
            return Err(Error::Usage(format!(
                "the tokenizer `{}` has {} tokens, more than model `{}`'s vocabulary of {}; \
                 give the model's own tokenizer",
                self.tokenizer.display(),
                tokenizer.vocab_size(),
                model.name,
                model.vocab_size
            )));
        }
        let examples = self.examples(&tokenizer)?;
        let pad = tokenizer
            .pad()
            .or(tokenizer.eos())
            .map_or(0, |token| token.id);
        Dataset::new(examples, model.seq_len, pad)
    }

    /// The folder holding the tokenizer's files (its chat template among them).
    fn tokenizer_folder(&self) -> PathBuf {
        if self.tokenizer.is_dir() {
            self.tokenizer.clone()
        } else {
            self.tokenizer
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        }
    }

    /// Every record as an example: conversations (and instructions, when there is one) through
    /// the model's chat template, the rest as documents.
    pub fn examples(&self, tokenizer: &Tokenizer) -> Result<Vec<Example>> {
        let records = self.records()?;
        let chats = records.iter().any(|r| matches!(r, Record::Chat(_)));
        let template = ChatTemplate::from_folder(&self.tokenizer_folder())?;
        if chats && template.is_none() {
            return Err(Error::Usage(format!(
                "`{}` holds conversations, and `{}` has no chat template to render them \
                 (chat_template.jinja, or chat_template in tokenizer_config.json); give the \
                 model's folder with --tokenizer",
                self.files.first().map_or(Path::new(""), |f| f).display(),
                self.tokenizer_folder().display()
            )));
        }
        records
            .iter()
            .map(|record| {
                let train_on = self
                    .train_on
                    .unwrap_or_else(|| TrainOn::default_for(record));
                if let Some(template) = &template {
                    if let Some(example) = templated(tokenizer, template, record, train_on)? {
                        return Ok(example);
                    }
                }
                plain(tokenizer, record, train_on)?
                    .ok_or_else(|| Error::internal("a conversation without a chat template"))
            })
            .collect()
    }
}

/// The files a tokenizer is read from: `tokenizer.json` and, beside it, its config.
fn tokenizer_files(tokenizer: &Path) -> Vec<PathBuf> {
    let json = if tokenizer.is_dir() {
        tokenizer.join("tokenizer.json")
    } else {
        tokenizer.to_path_buf()
    };
    let mut files = vec![json.clone()];
    for beside in ["tokenizer_config.json", "chat_template.jinja"] {
        let file = json.with_file_name(beside);
        if file.is_file() {
            files.push(file);
        }
    }
    files
}
