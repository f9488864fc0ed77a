//! The flags of a training run that `train` and `run` share (how long, on what data, where
//! its checkpoints go, the learning rate over it), and [`Training`], what they resolve to.

use std::path::{Path, PathBuf};

use clap::Args;

use super::dataset::{DataChoice, DatasetArgs};
use crate::data::format::TextTokens;
use crate::data::load::HeldOut;
use crate::data::source::{Data, DataSpec};
use crate::settings::model::holds_weights;
use crate::train::schedule::{LrDecay, LrSchedule};
use crate::{Error, Knobs, Result};

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
    /// Optimizer steps to train, in total counting resumed steps (default: 100 for train; run
    /// trains a number of tokens, --tokens).
    #[arg(long, conflicts_with = "tokens")]
    pub steps: Option<u64>,
    /// Train on N tokens in total (sequence positions of every micro-batch, counting resumed
    /// steps): the steps are N over the tokens one step takes at the plan's batch, so the run
    /// is as long whichever batch the plan chose (default for run: 500000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub tokens: Option<u64>,
    /// Train for N passes over a dataset of records instead of a number of steps: each epoch
    /// takes every example once, in its own seeded order.
    #[arg(long, value_name = "N", conflicts_with_all = ["steps", "tokens"], value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub epochs: Option<u64>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub dataset: DatasetArgs,
    /// Hold this share of a dataset's examples out of training (chosen by a draw the dataset
    /// seeds, the same in every run on it) and evaluate on them, every --eval-every steps.
    #[arg(long, value_name = "FRACTION")]
    pub eval_split: Option<f64>,
    /// Evaluate on the records of this file instead (read as the training data is).
    #[arg(long, value_name = "FILE", conflicts_with = "eval_split")]
    pub eval_data: Option<PathBuf>,
    /// Save a checkpoint every N steps, and always at the end and on Ctrl-C (default: 50 for
    /// train, 100 for run).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Evaluate on a held-out batch every N steps, 0 = never (default: 0 for train, 100 for
    /// run).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Train with a plan tuned on other data (other files, tokenizer, or batching), though its
    /// memory was measured on other batches.
    #[arg(long)]
    pub allow_data_mismatch: bool,
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
    /// Tokens to train on, when the length is counted in tokens rather than steps.
    pub tokens: Option<u64>,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Steps between evaluations (0 = never).
    pub eval_every: u64,
}

impl TrainingDefaults {
    /// `train`'s.
    pub const TRAIN: Self = Self {
        steps: 100,
        tokens: None,
        checkpoint_every: 50,
        eval_every: 0,
    };

    /// `run`'s: a whole job of a fixed number of tokens (so its length and its final loss do not
    /// swing with the batch the plan chose), evaluated as it goes.
    pub const RUN: Self = Self {
        steps: 300,
        tokens: Some(500_000),
        checkpoint_every: 100,
        eval_every: 100,
    };
}

/// A training run's settings beside the model and its knobs.
#[derive(Debug, Clone)]
pub struct Training {
    /// Train until this many optimizer steps in total (resumed steps count), unless `epochs`
    /// or `tokens`.
    pub steps: u64,
    /// Train on this many tokens in total ([`Training::steps_at`] turns them into steps).
    pub tokens: Option<u64>,
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
    /// Train with a plan tuned on other data.
    pub allow_data_mismatch: bool,
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
        let dataset = &args.dataset;
        if let (Some(dir), true) = (&init_from, dataset.data.is_empty()) {
            return Err(Error::Usage(format!(
                "`{}` holds pretrained weights, and without --data they would train on \
                 synthetic `pattern` sequences; give --data FILE (or --data pattern to do that \
                 on purpose)",
                dir.display()
            )));
        }
        let folder = folder.or_else(|| args.init_from.clone());
        let DataChoice {
            data,
            spec: data_spec,
            text_tokens,
            cache_dir,
        } = dataset.resolve(folder, held_out(args)?)?;
        if let Some(metrics) = &args.metrics {
            let inputs: Vec<(&str, &Path)> = data
                .iter()
                .map(|d| ("--data", Path::new(d.as_str())))
                .collect();
            crate::outputs::check_outputs(&[("--metrics", metrics)], &inputs)?;
        }
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
            tokens: match (args.tokens, args.steps, args.epochs) {
                (Some(tokens), _, _) => Some(tokens),
                (None, None, None) => defaults.tokens,
                _ => None,
            },
            epochs: args.epochs,
            data_spec,
            data,
            text_tokens,
            cache_dir,
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
            allow_data_mismatch: args.allow_data_mismatch,
        })
    }

    /// The data trained on.
    pub fn data_choice(&self) -> DataChoice {
        DataChoice {
            data: self.data.clone(),
            spec: self.data_spec.clone(),
            text_tokens: self.text_tokens,
            cache_dir: self.cache_dir.clone(),
        }
    }

    /// The learning-rate schedule for a model whose rate is `base_lr`, over `steps`.
    pub fn lr_schedule(&self, base_lr: f64) -> Result<LrSchedule> {
        self.schedule.schedule(base_lr, self.steps)
    }

    /// The optimizer steps of a run at `knobs` on sequences of `seq_len` tokens, unless it
    /// counts epochs: its tokens over the tokens of one step (over all ranks), or `steps`.
    pub fn steps_at(&self, knobs: &Knobs, seq_len: usize) -> u64 {
        let per_step = (knobs.global_batch() * seq_len).max(1) as u64;
        match self.tokens {
            Some(tokens) => tokens.div_ceil(per_step).max(1),
            None => self.steps,
        }
    }

    /// The optimizer steps of the run on `data` at `knobs` on sequences of `seq_len` tokens:
    /// the epochs' steps when it counts epochs, else [`Training::steps_at`].
    pub fn total_steps(&self, data: &Data, knobs: &Knobs, seq_len: usize) -> Result<u64> {
        match (self.epochs, data.examples()) {
            (None, _) => Ok(self.steps_at(knobs, seq_len)),
            (Some(epochs), Some((dataset, _))) => {
                Ok(dataset.steps_for_epochs(self.seed, epochs, knobs.micro_batch))
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
