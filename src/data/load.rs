//! A dataset of record files as training takes it: the files read by their format, each
//! record made an example by the model's tokenizer (and, for conversations, its chat
//! template), the examples cut to the sequence length. [`RecordsSpec`] is what a checkpoint
//! records of it, with a fingerprint of every input, so a resumed run is refused a dataset that
//! changed. Records are tokenized in parallel, once: the examples go to the token cache
//! ([`super::cache`]) under a key of the inputs, and a later run maps them from there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::cache::{Lookup, TokenCache};
use super::columnar;
use super::dataset::{Cut, Dataset, Example};
use super::examples::{plain, templated, TrainOn};
use super::format::{DataFormat, RecordFormat};
use super::pack::PackChoice;
use super::records::{self, Columns, Record};
use super::table::ExampleTable;
use super::template::ChatTemplate;
use super::tokenizer::Tokenizer;
use crate::plan::Truncation;
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

/// What loading a dataset is doing, for whoever shows progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadEvent {
    /// Tokenizing `total` records has begun.
    Tokenizing {
        /// Records to tokenize.
        total: usize,
    },
    /// Of the records being tokenized, `done` are.
    Tokenized {
        /// Records tokenized so far.
        done: usize,
    },
    /// The examples were stored in the token cache.
    Cached {
        /// The cache file.
        path: PathBuf,
    },
    /// The examples were found in the token cache, with nothing tokenized.
    FromCache {
        /// The cache file.
        path: PathBuf,
        /// Examples in it.
        examples: usize,
    },
    /// The token cache could not be used, and the data was tokenized without it.
    CacheSkipped {
        /// Why.
        reason: String,
    },
}

/// How a dataset is loaded: where its tokens are cached, and who hears how loading goes.
pub struct Loading<'a> {
    /// The token cache; `None` tokenizes every time.
    pub cache: Option<TokenCache>,
    /// Hears what loading is doing, on the thread that loads.
    pub events: &'a dyn Fn(LoadEvent),
}

impl<'a> Loading<'a> {
    /// Loading through the token cache in `dir`, telling `events`.
    pub fn cached(dir: &Path, events: &'a dyn Fn(LoadEvent)) -> Self {
        Loading {
            cache: Some(TokenCache::new(dir.to_path_buf())),
            events,
        }
    }

    /// Loading without a cache, telling no one.
    pub fn quiet() -> Loading<'static> {
        Loading {
            cache: None,
            events: &|_| {},
        }
    }
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
    /// The files' format when `--data-format` names it; `None`: what each file's name says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<RecordFormat>,
    /// Which examples are held out of training for its evaluation.
    #[serde(default, skip_serializing_if = "HeldOut::is_none")]
    pub held_out: HeldOut,
    /// Whether training packs several examples into a sequence.
    #[serde(default = "PackChoice::padded")]
    pub packing: PackChoice,
    /// What happens to examples longer than the sequence length.
    #[serde(default)]
    pub truncation: Truncation,
    /// SHA-256 of the files', the tokenizer's and its config's bytes and of the settings above.
    pub fingerprint: String,
    /// The token cache's key for the examples of `files`.
    #[serde(default)]
    pub examples_key: String,
    /// The token cache's key for the examples of the held-out files, if there are any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out_key: Option<String>,
}

/// A version of what turns records into examples: a change to it changes every cache key.
const EXAMPLES_VERSION: &str = concat!("autotune ", env!("CARGO_PKG_VERSION"), " examples 1");

impl RecordsSpec {
    /// The dataset of `files` for the tokenizer at `tokenizer`; reads every input once to take
    /// its fingerprint.
    pub fn new(
        files: Vec<PathBuf>,
        tokenizer: PathBuf,
        train_on: Option<TrainOn>,
        columns: &Columns,
        held_out: HeldOut,
        format: Option<RecordFormat>,
    ) -> Result<Self> {
        let eval_files = match &held_out {
            HeldOut::Files(files) => files.clone(),
            _ => Vec::new(),
        };
        for file in files.iter().chain(&eval_files) {
            format_of(file, format)?;
        }
        let columns = columns.pairs().clone();
        let digests = |files: &[PathBuf]| files.iter().map(|f| digest(f)).collect::<Result<_>>();
        let data: Vec<String> = digests(&files)?;
        let shaping: Vec<String> = digests(&tokenizer_files(&tokenizer))?;
        let settings = format!("{train_on:?}{columns:?}{format:?}");
        let key = |data: &[String]| {
            hex(&[
                EXAMPLES_VERSION,
                &data.join(","),
                &shaping.join(","),
                &settings,
            ])
        };
        let held_out_key = match &held_out {
            HeldOut::Files(files) => Some(key(&digests(files)?)),
            _ => None,
        };
        let examples_key = key(&data);
        let fingerprint = hex(&[
            &examples_key,
            held_out_key.as_deref().unwrap_or(""),
            &format!("{held_out:?}"),
        ]);
        Ok(Self {
            files,
            tokenizer,
            train_on,
            columns,
            format,
            held_out,
            packing: PackChoice::Auto,
            truncation: Truncation::Cut,
            fingerprint,
            examples_key,
            held_out_key,
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

    /// The examples of every record, tokenized for `model` (whose vocabulary must hold the
    /// tokenizer's), cut to its sequence length, and those held out for the evaluation.
    pub fn load(&self, model: &ModelSpec, loading: &Loading) -> Result<Loaded> {
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
        let table = self.table(&tokenizer, loading)?;
        let (train, held) = match &self.held_out {
            HeldOut::PerMillion(share) => self.split(table.len(), *share)?,
            _ => ((0..table.len()).collect(), Vec::new()),
        };
        let held_out = match (&self.held_out, &self.held_out_key) {
            (HeldOut::None, _) => None,
            (HeldOut::PerMillion(_), _) => {
                Some(Dataset::new(table.clone(), held, model.seq_len, pad, self.truncation)?.0)
            }
            (HeldOut::Files(files), key) => {
                let key = key.as_deref().unwrap_or_default();
                let held = self.table_of(files, key, &tokenizer, loading)?;
                let all = 0..held.len();
                Some(Dataset::new(held.clone(), all, model.seq_len, pad, self.truncation)?.0)
            }
        };
        let (train, cut) = Dataset::new(table, train, model.seq_len, pad, self.truncation)?;
        Ok(Loaded {
            train,
            cut,
            held_out,
        })
    }

    /// Every example of the files, in order, before any cut: from the token cache when it
    /// holds them, else tokenized (and then cached).
    pub fn table(&self, tokenizer: &Tokenizer, loading: &Loading) -> Result<Arc<ExampleTable>> {
        self.table_of(&self.files, &self.examples_key, tokenizer, loading)
    }

    /// The examples of `files`, cached under `key`.
    fn table_of(
        &self,
        files: &[PathBuf],
        key: &str,
        tokenizer: &Tokenizer,
        loading: &Loading,
    ) -> Result<Arc<ExampleTable>> {
        let cache = loading.cache.as_ref().filter(|_| !key.is_empty());
        if let Some(cache) = cache {
            match cache.lookup(key)? {
                Lookup::Hit(table) => {
                    let path = cache.path(key);
                    (loading.events)(LoadEvent::FromCache {
                        path,
                        examples: table.len(),
                    });
                    return Ok(Arc::new(table));
                }
                Lookup::Missing => {}
                Lookup::Unreadable(reason) => (loading.events)(LoadEvent::CacheSkipped {
                    reason: format!(
                        "`{}`: {reason}; tokenizing again",
                        cache.path(key).display()
                    ),
                }),
            }
        }
        let columns = Columns::from_pairs(self.columns.clone());
        let records = read_records(files, &columns, self.format)?;
        let table = ExampleTable::new(&self.examples_of(&records, tokenizer, loading)?);
        if let Some(cache) = cache {
            match cache.store(key, &table) {
                Ok(path) => (loading.events)(LoadEvent::Cached { path }),
                // A cache that cannot be written costs the next run time, not this run.
                Err(e) => (loading.events)(LoadEvent::CacheSkipped {
                    reason: e.to_string(),
                }),
            }
        }
        Ok(Arc::new(table))
    }

    /// Splits `n` examples into those trained on and the `share` in a million held out (at
    /// least one, and never all), chosen by a draw seeded by the dataset's fingerprint: the
    /// same examples in every run on it.
    fn split(&self, n: usize, share: u32) -> Result<(Vec<usize>, Vec<usize>)> {
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
        let mut held = order[..take].to_vec();
        held.sort_unstable();
        let mut is_held = vec![false; n];
        for &i in &held {
            is_held[i] = true;
        }
        let train = (0..n).filter(|&i| !is_held[i]).collect();
        Ok((train, held))
    }
}

/// The SHA-256 of `file`'s bytes, in hex, read a block at a time; of a folder (a saved
/// dataset), of its files' names and bytes in name order.
fn digest(file: &Path) -> Result<String> {
    let mut hash = Sha256::new();
    if file.is_dir() {
        let entries = std::fs::read_dir(file).map_err(|e| Error::file("cannot read", file, e))?;
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            hash.update(name.unwrap_or_default().as_bytes());
            hash.update(digest(&path)?.as_bytes());
        }
        return Ok(hex_bytes(&hash.finalize()));
    }
    crate::input_file::open(file)
        .and_then(|mut f| std::io::copy(&mut f, &mut hash))
        .map_err(|e| Error::file("cannot read", file, e))?;
    Ok(hex_bytes(&hash.finalize()))
}

/// The SHA-256 of `parts`, each length-prefixed so that no two lists hash alike, in hex.
fn hex(parts: &[&str]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part.as_bytes());
    }
    hex_bytes(&hash.finalize())
}

fn hex_bytes(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The record format of `file`: `forced`, else what its name says; a file of no record
/// format is an error naming the file.
fn format_of(file: &Path, forced: Option<RecordFormat>) -> Result<RecordFormat> {
    let detected = DataFormat::of(file);
    forced
        .or_else(|| RecordFormat::of(&detected))
        .ok_or_else(|| {
            Error::Usage(format!(
                "`{}` is {}, which is no record format autotune reads; name its format with \
             --data-format",
                file.display(),
                detected.describe()
            ))
        })
}

/// Every record of `files`, in order.
fn read_records(
    files: &[PathBuf],
    columns: &Columns,
    forced: Option<RecordFormat>,
) -> Result<Vec<Record>> {
    let mut all = Vec::new();
    for file in files {
        let records = match format_of(file, forced)? {
            RecordFormat::Jsonl => records::json_lines(file, columns)?,
            RecordFormat::Json => records::json_array(file, columns)?,
            RecordFormat::Text => records::text_documents(file)?,
            RecordFormat::Parquet => columnar::parquet(file, columns)?,
            RecordFormat::Arrow => columnar::arrow(file, columns)?,
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

    /// `records` as examples, in order, tokenized in parallel: conversations (and
    /// instructions, when there is a template) through the model's chat template, the rest as
    /// documents.
    fn examples_of(
        &self,
        records: &[Record],
        tokenizer: &Tokenizer,
        loading: &Loading,
    ) -> Result<Vec<Example>> {
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
        (loading.events)(LoadEvent::Tokenizing {
            total: records.len(),
        });
        // Workers tokenize; this thread reports their count, so that whoever hears the
        // progress needs to be reachable from this thread only.
        let done = AtomicUsize::new(0);
        let tokenize = || -> Result<Vec<Example>> {
            records
                .par_iter()
                .map(|record| {
                    let example = self.example(record, tokenizer, template.as_ref());
                    done.fetch_add(1, Ordering::Relaxed);
                    example
                })
                .collect()
        };
        let reporter = std::thread::current();
        std::thread::scope(|scope| {
            let workers = scope.spawn(|| {
                let examples = tokenize();
                reporter.unpark();
                examples
            });
            while !workers.is_finished() {
                std::thread::park_timeout(std::time::Duration::from_millis(100));
                (loading.events)(LoadEvent::Tokenized {
                    done: done.load(Ordering::Relaxed),
                });
            }
            workers
                .join()
                .unwrap_or_else(|_| Err(Error::internal("a tokenizing thread panicked")))
        })
    }

    /// The example of one record.
    fn example(
        &self,
        record: &Record,
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
    ) -> Result<Example> {
        let train_on = self
            .train_on
            .unwrap_or_else(|| TrainOn::default_for(record));
        if let Some(template) = template {
            if let Some(example) = templated(tokenizer, template, record, train_on)? {
                return Ok(example);
            }
        }
        plain(tokenizer, record, train_on)?
            .ok_or_else(|| Error::internal("a conversation without a chat template"))
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
        let tokenizer =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/tokenizers/llama3");
        let columns = Columns::default();
        RecordsSpec::new(vec![file], tokenizer, None, &columns, held_out, None).unwrap()
    }

    #[test]
    fn a_split_holds_the_same_examples_out_of_training_in_every_run() {
        let dir = tempfile::tempdir().unwrap();
        let model = ModelSpec {
            vocab_size: 512,
            seq_len: 32,
            ..ModelSpec::tiny()
        };
        let quiet = Loading::quiet();
        let all = spec(dir.path(), HeldOut::None)
            .load(&model, &quiet)
            .unwrap()
            .train;
        let all: Vec<Example> = (0..all.len()).map(|i| all.example(i).unwrap()).collect();
        let split = spec(dir.path(), HeldOut::PerMillion(250_000));
        let (a, b) = (
            split.load(&model, &quiet).unwrap(),
            split.load(&model, &quiet).unwrap(),
        );
        let held = a.held_out.unwrap();
        assert_eq!(held.len(), 5, "a quarter of twenty");
        assert_eq!(a.train.len(), 15);
        let train: Vec<Example> = (0..15).map(|i| a.train.example(i).unwrap()).collect();
        let b_held = b.held_out.unwrap();
        for i in 0..held.len() {
            let example = held.example(i).unwrap();
            assert!(!train.contains(&example), "held out of training");
            assert!(all.contains(&example));
            assert_eq!(example, b_held.example(i).unwrap(), "the same in every run");
        }
        assert_ne!(
            spec(dir.path(), HeldOut::None).fingerprint,
            split.fingerprint,
            "what is held out is part of the dataset"
        );
    }
}
