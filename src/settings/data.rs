//! `autotune data`'s flags and [`DataSettings`]: a dataset of records and the model whose
//! tokenizer reads it, to show what training would see.

use std::path::PathBuf;

use clap::Args;

use super::model::{model_folder, resolve_model, ModelName};
use crate::data::cache::default_dir as default_cache_dir;
use crate::data::examples::TrainOn;
use crate::data::format::{record_files, RecordFormat};
use crate::data::load::{HeldOut, RecordsSpec};
use crate::data::records::Columns;
use crate::plan::Truncation;
use crate::spec::model::ModelSpec;
use crate::{Error, Result};

/// The flags of `autotune data`.
#[derive(Debug, Args)]
pub struct DataArgs {
    /// The model: a Hugging Face folder (its tokenizer reads the data, its config gives the
    /// sequence length), or a preset or spec file with --tokenizer.
    #[arg(long, value_parser = ModelName)]
    pub model: String,
    /// Train on sequences of N tokens (default: the model's length: its preset's, or its
    /// config's `max_position_embeddings` up to 2048). With --data, the longest a sequence may
    /// be: longer examples are cut or dropped (--truncate).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub seq_len: Option<u64>,
    /// The records: text (documents between blank lines), JSON lines, a JSON array, or a folder
    /// of them; repeat it for several.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// The format of the --data files, when their names do not say it.
    #[arg(long, value_enum)]
    pub data_format: Option<RecordFormat>,
    /// The tokenizer, when the model is no folder holding one: a `tokenizer.json` or its folder.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// What the loss trains on (as `train --train-on`).
    #[arg(long, value_enum)]
    pub train_on: Option<TrainOn>,
    /// The columns holding the fields autotune reads (as `train --columns`).
    #[arg(long, value_name = "FIELD=COLUMN,...")]
    pub columns: Option<String>,
    /// What happens to an example longer than the sequence length: cut (its first tokens
    /// kept) or drop.
    #[arg(long, default_value = "cut", value_parser = parse_truncation)]
    pub truncate: Truncation,
    /// Sequences per micro-batch, for the padding a batch of them wastes.
    #[arg(long, default_value_t = 8)]
    pub micro_batch: usize,
    /// How many examples to show as text (the counts cover all of them).
    #[arg(long, default_value_t = 3)]
    pub show: usize,
    /// One JSON line per example, in dataset order: `{"input_ids": [...], "labels": [...]}`,
    /// with -100 where the loss is masked.
    #[arg(long)]
    pub json: bool,
    /// Where tokenized datasets are cached (as `train --cache-dir`).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
}

/// A validated `data`.
#[derive(Debug)]
pub struct DataSettings {
    /// The dataset.
    pub records: RecordsSpec,
    /// The model (its sequence length cuts the examples).
    pub model: ModelSpec,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Examples shown as text.
    pub show: usize,
    /// Where tokenized datasets are cached.
    pub cache_dir: PathBuf,
}

impl DataSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &DataArgs) -> Result<Self> {
        let model = resolve_model(&args.model, args.seq_len.map(|n| n as usize))?;
        let tokenizer = match (&args.tokenizer, model_folder(&args.model)) {
            (Some(path), _) => path.clone(),
            (None, Some(folder)) if folder.join("tokenizer.json").is_file() => folder,
            _ => {
                return Err(Error::Usage(format!(
                    "`{}` has no tokenizer to read the data with; give --model a Hugging Face \
                     folder holding tokenizer.json, or --tokenizer PATH",
                    args.model
                )))
            }
        };
        let columns = match &args.columns {
            Some(text) => Columns::parse(text)?,
            None => Columns::default(),
        };
        if let Some(missing) = args.data.iter().find(|p| !p.exists()) {
            let error = std::io::Error::from(std::io::ErrorKind::NotFound);
            return Err(Error::file("cannot read training data", missing, error));
        }
        let mut records = RecordsSpec::new(
            record_files(&args.data, args.data_format)?,
            tokenizer,
            args.train_on,
            &columns,
            HeldOut::None,
            args.data_format,
        )?;
        records.truncation = args.truncate;
        Ok(Self {
            records,
            model,
            micro_batch: args.micro_batch.max(1),
            show: args.show,
            cache_dir: args.cache_dir.clone().unwrap_or_else(default_cache_dir),
        })
    }
}

/// Parses `--truncate`.
pub fn parse_truncation(text: &str) -> std::result::Result<Truncation, String> {
    text.parse()
}
