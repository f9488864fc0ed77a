//! The data flags that `tune`, `train` and `run` share (which files, read by which tokenizer,
//! how records become examples and examples batches), and [`DataChoice`], what they resolve to.

use std::path::PathBuf;

use clap::Args;

use super::data::parse_truncation;
use crate::data::cache::default_dir as default_cache_dir;
use crate::data::examples::TrainOn;
use crate::data::format::{record_files, DataFormat, RecordFormat, TextTokens};
use crate::data::load::{HeldOut, RecordsSpec};
use crate::data::pack::PackChoice;
use crate::data::records::Columns;
use crate::data::source::DataSpec;
use crate::plan::Truncation;
use crate::{Error, Result};

/// The flags of the data trained on (or tuned on).
#[derive(Debug, Clone, Args)]
pub struct DatasetArgs {
    /// Training data: `pattern` (learnable synthetic sequences, the default), `random` (the
    /// seed's random tokens: nothing to learn, for benchmarks), a token file (`.bin`/`.u16`:
    /// u16, `.u32`: u32; read a window at a time), or records read by the model's tokenizer: text
    /// (`.txt`), JSON lines, JSON, Parquet, Arrow (a `datasets` `save_to_disk` folder), or a
    /// folder of them; repeat it for several files. Text is read as raw bytes only with
    /// `--tokenizer bytes`, and model files never.
    #[arg(long, value_name = "FILE|DIR|pattern|random")]
    pub data: Vec<String>,
    /// The format of the --data files, when their names do not say it.
    #[arg(long, value_enum)]
    pub data_format: Option<RecordFormat>,
    /// The tokenizer of record data (text, JSON lines, JSON, Parquet, Arrow): a
    /// `tokenizer.json`, or the folder holding it with its `tokenizer_config.json` (default: the
    /// --model or --init-from folder's); or `bytes`, to train on a text's raw bytes, one token
    /// a byte.
    #[arg(long, value_name = "PATH|bytes")]
    pub tokenizer: Option<String>,
    /// What the loss trains on: all (every token), completion (a completion's or an
    /// instruction's response, not the prompt) or assistant (a conversation's assistant turns).
    /// Default: what each record's schema says (documents all, prompt/completion and
    /// instructions completion, conversations assistant).
    #[arg(long, value_enum)]
    pub train_on: Option<TrainOn>,
    /// The columns of record data that hold the fields autotune reads, when they are named
    /// otherwise: `field=column` pairs, e.g. `prompt=question,completion=answer`.
    #[arg(long, value_name = "FIELD=COLUMN,...")]
    pub columns: Option<String>,
    /// Pack several examples into each sequence, each attending only to itself, so that no
    /// compute goes to padding (the default for records where the model allows it: rotary
    /// positions or none, on the explicit engines).
    #[arg(long, overrides_with = "no_pack")]
    pub pack: bool,
    /// Pad each example to the longest of its micro-batch instead of packing.
    #[arg(long, overrides_with = "pack")]
    pub no_pack: bool,
    /// What happens to an example longer than the sequence length (--seq-len, or the
    /// model's): cut (its first tokens kept) or drop. Either way the count is reported.
    #[arg(long, default_value = "cut", value_parser = parse_truncation)]
    pub truncate: Truncation,
    /// Where tokenized datasets are cached, so that a later run on the same files, tokenizer
    /// and settings maps them at once (default: `$XDG_CACHE_HOME/autotune/tokens`, else
    /// `~/.cache/autotune/tokens`).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
}

/// The data a run trains on, resolved.
#[derive(Debug, Clone)]
pub struct DataChoice {
    /// The data, as given (`pattern`, `random`, files or folders).
    pub data: Vec<String>,
    /// The data, resolved (its file checked to be one autotune reads).
    pub spec: DataSpec,
    /// How text becomes tokens.
    pub text_tokens: TextTokens,
    /// Where tokenized datasets are cached.
    pub cache_dir: PathBuf,
}

impl DataChoice {
    /// The dataset of records, when the data is one.
    pub fn records(&self) -> Option<&RecordsSpec> {
        match &self.spec {
            DataSpec::Records(records) => Some(records),
            _ => None,
        }
    }
}

impl DatasetArgs {
    /// What the flags name, with `held_out` examples held out of a dataset of records;
    /// `folder` is the model's Hugging Face folder, whose tokenizer reads records unless
    /// `--tokenizer` names another.
    pub fn resolve(&self, folder: Option<PathBuf>, held_out: HeldOut) -> Result<DataChoice> {
        let tokenizer = tokenizer_source(self, folder)?;
        let data = match self.data.as_slice() {
            [] => vec!["pattern".to_string()],
            given => given.to_vec(),
        };
        let columns = match &self.columns {
            Some(text) => Columns::parse(text)?,
            None => Columns::default(),
        };
        let records = RecordsArgs {
            train_on: self.train_on,
            columns,
            held_out,
            format: self.data_format,
            packing: match (self.pack, self.no_pack) {
                (true, _) => PackChoice::Pack,
                (_, true) => PackChoice::Pad,
                _ => PackChoice::Auto,
            },
            truncation: self.truncate,
        };
        let spec = data_spec(&data, &tokenizer, records)?;
        Ok(DataChoice {
            data,
            spec,
            text_tokens: tokenizer.text_tokens(),
            cache_dir: self.cache_dir.clone().unwrap_or_else(default_cache_dir),
        })
    }
}

/// Where record data's tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TokenizerSource {
    /// Nowhere: record data is refused.
    NotGiven,
    /// A text's raw bytes (`--tokenizer bytes`).
    Bytes,
    /// The model's tokenizer: a `tokenizer.json`, or the folder holding it.
    Model(PathBuf),
}

impl TokenizerSource {
    fn text_tokens(&self) -> TextTokens {
        match self {
            TokenizerSource::NotGiven => TextTokens::NotGiven,
            TokenizerSource::Bytes => TextTokens::Bytes,
            TokenizerSource::Model(_) => TextTokens::Model,
        }
    }
}

/// `--tokenizer`, or else the tokenizer of the model's folder (`folder`) when it holds one.
fn tokenizer_source(args: &DatasetArgs, folder: Option<PathBuf>) -> Result<TokenizerSource> {
    Ok(match args.tokenizer.as_deref() {
        Some("bytes") => TokenizerSource::Bytes,
        Some(path) => {
            let path = PathBuf::from(path);
            let json = if path.is_dir() {
                path.join("tokenizer.json")
            } else {
                path.clone()
            };
            if !json.is_file() {
                return Err(autotune_core::Error::InvalidFlag {
                    flag: format!("--tokenizer {}", path.display()),
                    problem: "names no tokenizer.json, nor a folder holding one; give the \
                              model's tokenizer.json or its folder, or `bytes`"
                        .into(),
                }
                .into());
            }
            TokenizerSource::Model(path)
        }
        None => match folder.filter(|f| f.join("tokenizer.json").is_file()) {
            Some(folder) => TokenizerSource::Model(folder),
            None => TokenizerSource::NotGiven,
        },
    })
}

/// Whether `spec` is a file of records (text read as bytes counts: its name says records).
fn is_record_kind(spec: &DataSpec) -> bool {
    matches!(spec, DataSpec::Text(_) | DataSpec::Records(_))
}

/// How records become examples, as the flags say.
struct RecordsArgs {
    train_on: Option<TrainOn>,
    columns: Columns,
    held_out: HeldOut,
    format: Option<RecordFormat>,
    packing: PackChoice,
    truncation: Truncation,
}

/// The data `data` names: a dataset of records for the model's tokenizer, or another source.
fn data_spec(
    data: &[String],
    tokenizer: &TokenizerSource,
    records: RecordsArgs,
) -> Result<DataSpec> {
    let paths: Vec<PathBuf> = data.iter().map(PathBuf::from).collect();
    let are_records = records.format.is_some()
        || paths.iter().all(|p| {
            let format = DataFormat::of(p);
            format == DataFormat::Folder || RecordFormat::of(&format).is_some()
        });
    match tokenizer {
        TokenizerSource::Model(tokenizer) if are_records => {
            for path in &paths {
                if !path.exists() {
                    let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
                    return Err(Error::file("cannot read training data", path, missing));
                }
            }
            let spec = RecordsSpec::new(
                record_files(&paths, records.format)?,
                tokenizer.clone(),
                records.train_on,
                &records.columns,
                records.held_out,
                records.format,
            )?;
            Ok(DataSpec::Records(Box::new(RecordsSpec {
                packing: records.packing,
                truncation: records.truncation,
                ..spec
            })))
        }
        _ if !records.held_out.is_none() => Err(Error::Usage(
            "--eval-split and --eval-data hold out examples of a dataset of records (text, JSON \
             lines, JSON, Parquet, Arrow read by the model's tokenizer)"
                .into(),
        )),
        other => {
            let specs = data
                .iter()
                .map(|d| DataSpec::resolve(d, other.text_tokens()))
                .collect::<Result<Vec<_>>>()?;
            match (specs.as_slice(), specs.iter().find(|s| !is_record_kind(s))) {
                ([one], _) => Ok(one.clone()),
                (_, Some(odd)) => Err(Error::Usage(format!(
                    "--data names {} sources, and `{odd}` is no record file: only records \
                     (text, JSON lines, JSON, Parquet, Arrow read by the model's tokenizer) come \
                     as several \
                     files; give a token file alone",
                    specs.len()
                ))),
                _ => Err(Error::Usage(format!(
                    "--data names {} sources of records, which need the model's tokenizer: \
                     give --model DIR (a Hugging Face folder) or --tokenizer PATH",
                    specs.len()
                ))),
            }
        }
    }
}
