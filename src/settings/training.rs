//! The flags of a training run that `train` and `run` share (how long, on what data, where
//! its checkpoints go, the learning rate over it), and [`Training`], what they resolve to.

use std::path::PathBuf;

use clap::Args;

use crate::data::cache::default_dir as default_cache_dir;
use crate::data::examples::TrainOn;
use crate::data::format::{record_files, DataFormat, RecordFormat, TextTokens};
use crate::data::load::{HeldOut, RecordsSpec};
use crate::data::pack::PackChoice;
use crate::data::records::Columns;
use crate::data::source::{Data, DataSpec};
use crate::settings::model::holds_weights;
use crate::train::schedule::{LrDecay, LrSchedule};
use crate::{Error, Result};

/// The learning rate over a training run.
#[derive(Debug, Clone, Args)]
pub struct ScheduleArgs {
    /// Warm the learning rate up linearly over the first N steps (from lr / N to lr).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lr_warmup_steps: u64,
    /// After the warm-up: constant, or cosine (half a cosine down to --min-lr at the run's
    /// last step, --steps).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: LrDecay,
    /// The cosine's floor (default: a tenth of the model's learning rate).
    #[arg(long, value_name = "LR")]
    pub min_lr: Option<f64>,
}

impl ScheduleArgs {
    /// The schedule over a run of `total_steps` for a model whose rate is `base_lr`.
    pub fn schedule(&self, base_lr: f64, total_steps: u64) -> Result<LrSchedule> {
        let min_lr = self.min_lr.unwrap_or(base_lr / 10.0);
        if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= base_lr) {
            return Err(autotune_core::Error::InvalidFlag {
                flag: format!("--min-lr {min_lr}"),
                problem: format!(
                    "the cosine's floor must be a rate from 0 to the model's learning rate {base_lr}"
                ),
            }
            .into());
        }
        Ok(LrSchedule {
            decay: self.lr_schedule,
            warmup_steps: self.lr_warmup_steps,
            min_lr,
            decay_steps: total_steps,
        }
        .canonical())
    }
}

/// The flags of a training run, beside the model and its knobs.
#[derive(Debug, Clone, Args)]
pub struct TrainingArgs {
    /// Optimizer steps to train, in total counting resumed steps (default: 100 for train, 300
    /// for run).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Train for N passes over a dataset of records instead of a number of steps: each epoch
    /// takes every example once, in its own seeded order.
    #[arg(long, value_name = "N", conflicts_with = "steps", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub epochs: Option<u64>,
    /// Training data: `pattern` (learnable synthetic sequences, the default), `random` (the
    /// seed's random tokens: nothing to learn, for benchmarks), a token file (`.bin`/`.u16`:
    /// u16, `.u32`: u32; memory-mapped), or records read by the model's tokenizer: text
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
    /// Hold this share of a dataset's examples out of training (chosen by a draw the dataset
    /// seeds, the same in every run on it) and evaluate on them, every --eval-every steps.
    #[arg(long, value_name = "FRACTION")]
    pub eval_split: Option<f64>,
    /// Evaluate on the records of this file instead (read as the training data is).
    #[arg(long, value_name = "FILE", conflicts_with = "eval_split")]
    pub eval_data: Option<PathBuf>,
    /// Pack several examples into each sequence, each attending only to itself, so that no
    /// compute goes to padding (the default for records where the model allows it: rotary
    /// positions or none, on the explicit engines).
    #[arg(long, overrides_with = "no_pack")]
    pub pack: bool,
    /// Pad each example to the longest of its micro-batch instead of packing.
    #[arg(long, overrides_with = "pack")]
    pub no_pack: bool,
    /// Where tokenized datasets are cached, so that a later run on the same files, tokenizer
    /// and settings maps them at once (default: `$XDG_CACHE_HOME/autotune/tokens`, else
    /// `~/.cache/autotune/tokens`).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps, and always at the end and on Ctrl-C (default: 50 for
    /// train, 100 for run).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Evaluate on a held-out batch every N steps, 0 = never (default: 0 for train, 100 for
    /// run).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Seed for weights, data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Continue the run from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Start over where checkpoints of a run exist, removing them (without it, such a
    /// directory is refused unless --resume continues its run).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Keep only the newest N checkpoints (default: keep every one).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub keep_last: Option<u64>,
    /// Start from the weights of a Hugging Face checkpoint folder: `model.safetensors` or the
    /// shards of `model.safetensors.index.json`, in bf16, f16 or f32. Its `config.json`, if any,
    /// must describe the model trained.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub schedule: ScheduleArgs,
    /// Write one JSON line per step to FILE: step, loss, tokens/s, learning rate, loss scale,
    /// skipped, GPU and host memory (docs/metrics.schema.json). A resumed run continues it.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

/// What a command assumes where a training flag is not given.
#[derive(Debug, Clone, Copy)]
pub struct TrainingDefaults {
    /// Optimizer steps.
    pub steps: u64,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Steps between evaluations (0 = never).
    pub eval_every: u64,
}

impl TrainingDefaults {
    /// `train`'s.
    pub const TRAIN: Self = Self {
        steps: 100,
        checkpoint_every: 50,
        eval_every: 0,
    };

    /// `run`'s: a whole job, evaluated as it goes.
    pub const RUN: Self = Self {
        steps: 300,
        checkpoint_every: 100,
        eval_every: 100,
    };
}

/// A training run's settings beside the model and its knobs.
#[derive(Debug, Clone)]
pub struct Training {
    /// Train until this many optimizer steps in total (resumed steps count), unless `epochs`.
    pub steps: u64,
    /// Train for this many passes over a dataset of records.
    pub epochs: Option<u64>,
    /// The data, as given (`pattern`, `random`, files or folders).
    pub data: Vec<String>,
    /// The data, resolved (its file checked to be one autotune reads).
    pub data_spec: DataSpec,
    /// How text becomes tokens.
    pub text_tokens: TextTokens,
    /// Where tokenized datasets are cached.
    pub cache_dir: PathBuf,
    /// Where checkpoints go; `None` keeps none.
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Steps between evaluations (0 = never).
    pub eval_every: u64,
    /// The seed of weights, data order and dropout.
    pub seed: u64,
    /// Continue from the latest checkpoint.
    pub resume: bool,
    /// Start over in a directory that holds checkpoints, removing them.
    pub overwrite: bool,
    /// Keep only this many of the newest checkpoints.
    pub keep_last: Option<usize>,
    /// A Hugging Face checkpoint to start from.
    pub init_from: Option<PathBuf>,
    /// The learning rate over the run, resolved against the model's rate when it is known.
    pub schedule: ScheduleArgs,
    /// Where the per-step metrics go, if anywhere.
    pub metrics: Option<PathBuf>,
}

impl Training {
    /// The settings `args` give, with `defaults` for what they leave out and checkpoints in
    /// `checkpoint_dir`; `folder` is the model's Hugging Face folder, if the model is one: its
    /// tokenizer reads the data, and its weights are where a fresh run starts when
    /// `--init-from` names none.
    pub fn resolve(
        args: &TrainingArgs,
        defaults: TrainingDefaults,
        checkpoint_dir: Option<PathBuf>,
        folder: Option<PathBuf>,
    ) -> Result<Self> {
        let weights = folder.clone().filter(|f| holds_weights(f));
        let init_from = match (&args.init_from, args.resume) {
            (Some(dir), _) => Some(dir.clone()),
            (None, false) => weights,
            (None, true) => None,
        };
        let tokenizer = tokenizer_source(args, folder.or_else(|| args.init_from.clone()))?;
        if let (Some(dir), true) = (&init_from, args.data.is_empty()) {
            return Err(Error::Usage(format!(
                "`{}` holds pretrained weights, and without --data they would train on \
                 synthetic `pattern` sequences; give --data FILE (or --data pattern to do that \
                 on purpose)",
                dir.display()
            )));
        }
        let data = match args.data.as_slice() {
            [] => vec!["pattern".to_string()],
            given => given.to_vec(),
        };
        let columns = match &args.columns {
            Some(text) => Columns::parse(text)?,
            None => Columns::default(),
        };
        let records = RecordsArgs {
            train_on: args.train_on,
            columns,
            held_out: held_out(args)?,
            format: args.data_format,
            packing: match (args.pack, args.no_pack) {
                (true, _) => PackChoice::Pack,
                (_, true) => PackChoice::Pad,
                _ => PackChoice::Auto,
            },
        };
        let data_spec = data_spec(&data, &tokenizer, records)?;
        if args.epochs.is_some() && !matches!(data_spec, DataSpec::Records(_)) {
            return Err(autotune_core::Error::InvalidFlag {
                flag: "--epochs".into(),
                problem: format!(
                    "counts passes over a dataset of records, and `{}` is none; give --steps",
                    data.join(", ")
                ),
            }
            .into());
        }
        Ok(Self {
            steps: args.steps.unwrap_or(defaults.steps),
            epochs: args.epochs,
            data_spec,
            data,
            text_tokens: tokenizer.text_tokens(),
            cache_dir: args.cache_dir.clone().unwrap_or_else(default_cache_dir),
            checkpoint_dir,
            checkpoint_every: args.checkpoint_every.unwrap_or(defaults.checkpoint_every),
            eval_every: args.eval_every.unwrap_or(defaults.eval_every),
            seed: args.seed,
            resume: args.resume,
            overwrite: args.overwrite,
            keep_last: args.keep_last.map(|n| n as usize),
            init_from,
            schedule: args.schedule.clone(),
            metrics: args.metrics.clone(),
        })
    }

    /// The learning-rate schedule for a model whose rate is `base_lr`, over `steps`.
    pub fn lr_schedule(&self, base_lr: f64) -> Result<LrSchedule> {
        self.schedule.schedule(base_lr, self.steps)
    }

    /// The optimizer steps of the run on `data` at `micro_batch` sequences a micro-batch: the
    /// epochs' steps when it counts epochs, else `steps`.
    pub fn total_steps(&self, data: &Data, micro_batch: usize) -> Result<u64> {
        match (self.epochs, data.examples()) {
            (None, _) => Ok(self.steps),
            (Some(epochs), Some((dataset, _))) => {
                Ok(dataset.steps_for_epochs(self.seed, epochs, micro_batch))
            }
            (Some(_), None) => Err(Error::Usage(
                "--epochs counts passes over a dataset of records".into(),
            )),
        }
    }

    /// Refuses a resume or an overwrite without a checkpoint directory (`train` keeps none
    /// unless asked).
    pub fn require_checkpoint_dir(&self) -> Result<()> {
        for (asked, flag) in [(self.resume, "--resume"), (self.overwrite, "--overwrite")] {
            if asked && self.checkpoint_dir.is_none() {
                return Err(Error::from(autotune_core::Error::InvalidFlag {
                    flag: flag.into(),
                    problem: "needs `--checkpoint-dir DIR`, the directory of the run's checkpoints"
                        .into(),
                }));
            }
        }
        Ok(())
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
fn tokenizer_source(args: &TrainingArgs, folder: Option<PathBuf>) -> Result<TokenizerSource> {
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

/// What `--eval-split` or `--eval-data` hold out.
fn held_out(args: &TrainingArgs) -> Result<HeldOut> {
    if let Some(share) = args.eval_split {
        if !(share > 0.0 && share < 1.0) {
            return Err(autotune_core::Error::InvalidFlag {
                flag: format!("--eval-split {share}"),
                problem: "is the share of the examples held out: above 0 and below 1, e.g. 0.05"
                    .into(),
            }
            .into());
        }
        return Ok(HeldOut::PerMillion((share * 1e6).round().max(1.0) as u32));
    }
    Ok(match &args.eval_data {
        Some(file) if !file.is_file() => {
            let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
            return Err(Error::file("cannot read evaluation data", file, missing));
        }
        Some(file) => HeldOut::Files(vec![file.clone()]),
        None => HeldOut::None,
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
