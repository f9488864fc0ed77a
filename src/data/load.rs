//! A dataset of record files as training takes it: the files read by their format, each
//! record made an example by the model's tokenizer (and, for conversations, its chat
//! template), the examples cut to the sequence length. [`RecordsSpec`] is what a checkpoint
//! records of it, with a fingerprint of every input, so a resumed run is refused a dataset that
//! changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
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

/// Examples held out of training, to evaluate it on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeldOut {
    /// None: the evaluation takes a batch of the training examples.
    #[default]
    None,
    /// This many examples in a million, chosen by a seeded draw (`--eval-split`).
    PerMillion(u32),
    /// The examples of these files (`--eval-data`).
    Files(Vec<PathBuf>),
}

impl HeldOut {
    /// Whether nothing is held out.
    pub fn is_none(&self) -> bool {
        *self == HeldOut::None
    }
}

/// A dataset loaded for a model: the examples training takes, what cutting them did, and the
/// examples held out for its evaluation.
pub struct Loaded {
    /// The training examples.
    pub train: Dataset,
    /// What cutting every example to the sequence did.
    pub cut: Cut,
    /// The held-out examples, if any.
    pub held_out: Option<Dataset>,
}

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
    /// Which examples are held out of training for its evaluation.
    #[serde(default, skip_serializing_if = "HeldOut::is_none")]
    pub held_out: HeldOut,
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
        held_out: HeldOut,
    ) -> Result<Self> {
        let columns = columns.pairs().clone();
        let mut hash = Sha256::new();
        let eval_files = match &held_out {
            HeldOut::Files(files) => files.clone(),
            _ => Vec::new(),
        };
        let inputs = files.iter().chain(&eval_files).cloned();
        for file in inputs.chain(tokenizer_files(&tokenizer)) {
            let bytes = std::fs::read(&file).map_err(|e| Error::file("cannot read", &file, e))?;
            hash.update((bytes.len() as u64).to_le_bytes());
            hash.update(&bytes);
        }
        hash.update(format!("{train_on:?}{columns:?}{held_out:?}").as_bytes());
        let fingerprint = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            files,
            tokenizer,
            train_on,
            columns,
            held_out,
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
        read_records(&self.files, &Columns::from_pairs(self.columns.clone()))
    }

    /// The examples of every record, tokenized for `model` (whose vocabulary must hold the
    /// tokenizer's), cut to its sequence length, and those held out for the evaluation.
    pub fn load(&self, model: &ModelSpec) -> Result<Loaded> {
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
        let pad = tokenizer
            .pad()
            .or(tokenizer.eos())
            .map_or(0, |token| token.id);
        let mut examples = self.examples(&tokenizer)?;
        let held_out = match &self.held_out {
            HeldOut::None => None,
            HeldOut::PerMillion(share) => Some(self.split(&mut examples, *share)?),
            HeldOut::Files(files) => {
                let records = read_records(files, &Columns::from_pairs(self.columns.clone()))?;
                Some(self.examples_of(&records, &tokenizer)?)
            }
        };
        let (train, cut) = Dataset::new(examples, model.seq_len, pad)?;
        let held_out = match held_out {
            Some(examples) => Some(Dataset::new(examples, model.seq_len, pad)?.0),
            None => None,
        };
        Ok(Loaded {
            train,
            cut,
            held_out,
        })
    }

    /// Takes `share` in a million of `examples` out (at least one, and never all), chosen by a
    /// draw seeded by the dataset's fingerprint: the same examples in every run on it.
    fn split(&self, examples: &mut Vec<Example>, share: u32) -> Result<Vec<Example>> {
        let n = examples.len();
        let take = ((n as u64 * u64::from(share)).div_ceil(1_000_000) as usize).max(1);
        if take >= n {
            return Err(Error::Usage(format!(
                "--eval-split holds out {take} of {n} examples, leaving none to train on; \
                 hold out a smaller share"
            )));
        }
        let seed = u64::from_str_radix(&self.fingerprint[..16], 16).unwrap_or(0);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        let mut out: Vec<usize> = order[..take].to_vec();
        out.sort_unstable();
        let mut held = Vec::with_capacity(take);
        for i in out.into_iter().rev() {
            held.push(examples.remove(i));
        }
        held.reverse();
        Ok(held)
    }
}

/// Every record of `files`, in order.
fn read_records(files: &[PathBuf], columns: &Columns) -> Result<Vec<Record>> {
    let mut all = Vec::new();
    for file in files {
        let records = match DataFormat::of(file) {
            DataFormat::JsonLines => records::json_lines(file, columns)?,
            DataFormat::Json => records::json_array(file, columns)?,
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

impl RecordsSpec {
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
        self.examples_of(&self.records()?, tokenizer)
    }

    /// `records` as examples.
    fn examples_of(&self, records: &[Record], tokenizer: &Tokenizer) -> Result<Vec<Example>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, held_out: HeldOut) -> RecordsSpec {
        let file = dir.join("d.jsonl");
        let lines: Vec<String> = (0..20)
            .map(|i| serde_json::json!({"text": format!("document number {i}")}).to_string())
            .collect();
        std::fs::write(&file, lines.join("\n")).unwrap();
        let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/data/tokenizers/llama3");
        RecordsSpec::new(vec![file], tokenizer, None, &Columns::default(), held_out).unwrap()
    }

    #[test]
    fn a_split_holds_the_same_examples_out_of_training_in_every_run() {
        let dir = tempfile::tempdir().unwrap();
        let model = ModelSpec {
            vocab_size: 512,
            seq_len: 32,
            ..ModelSpec::tiny()
        };
        let all = spec(dir.path(), HeldOut::None).load(&model).unwrap().train;
        let split = spec(dir.path(), HeldOut::PerMillion(250_000));
        let (a, b) = (split.load(&model).unwrap(), split.load(&model).unwrap());
        let held = a.held_out.unwrap();
        assert_eq!(held.examples().len(), 5, "a quarter of twenty");
        assert_eq!(a.train.examples().len(), 15);
        for example in held.examples() {
            assert!(!a.train.examples().contains(example), "held out of training");
            assert!(all.examples().contains(example));
        }
        assert_eq!(held.examples(), b.held_out.unwrap().examples(), "the same in every run");
        assert_ne!(
            spec(dir.path(), HeldOut::None).fingerprint,
            split.fingerprint,
            "what is held out is part of the dataset"
        );
    }
}
