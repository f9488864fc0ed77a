//! `autotune train`'s flags and [`TrainSettings`], what they resolve to: a plan, or a model
//! and knobs given by hand, and the run's settings. Everything a flag can get wrong is
//! refused here, before a device is opened.

use std::path::{Path, PathBuf};

use clap::Args;

use super::flags::{self, as_flag};
use super::knobs::ByHandArgs;
use super::model::resolve_model;
use super::optimizer::OptimizerArgs;
use super::training::{Training, TrainingArgs, TrainingDefaults};
use crate::model::Engine;
use crate::plan::schema::Plan;
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::{Error, Knobs, Result};

/// The flags of `autotune train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub by_hand: ByHandArgs,
    /// Train with a plan from `autotune tune`: its model, knobs and device limits (knob and
    /// model flags are then ignored).
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Directory for checkpoints (written atomically; `latest` points at the newest).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub training: TrainingArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub optimizer: OptimizerArgs,
    /// The learning rate's warm-up, by its earlier name (now `--lr-warmup-steps`).
    #[arg(
        long,
        value_name = "N",
        hide = true,
        conflicts_with = "lr_warmup_steps"
    )]
    pub warmup_steps: Option<u64>,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Where a training run's model and knobs come from.
#[derive(Debug)]
pub enum TrainSource {
    /// A plan: its model, knobs and memory limits, on the kind of device it was made for.
    Plan {
        /// The plan.
        plan: Box<Plan>,
        /// Its file, which the ranks of a data-parallel plan read.
        path: PathBuf,
    },
    /// A model and knobs given by hand.
    Knobs {
        /// The model.
        spec: Box<ModelSpec>,
        /// The knobs.
        knobs: Knobs,
        /// The device to train on: `cpu`, `cuda`, `cuda:N` or `auto`.
        device: String,
        /// The engine.
        engine: Engine,
    },
}

/// A validated `train`.
#[derive(Debug)]
pub struct TrainSettings {
    /// The model and knobs.
    pub source: TrainSource,
    /// The run.
    pub training: Training,
    /// What people should know about the flags as given (a renamed flag's old name).
    pub notes: Vec<String>,
}

impl TrainSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &TrainArgs) -> Result<Self> {
        let mut raw = args.training.clone();
        let mut notes = Vec::new();
        if let Some(steps) = args.warmup_steps {
            raw.schedule.lr_warmup_steps = steps;
            notes.push(flags::renamed("--warmup-steps", "--lr-warmup-steps"));
        }
        let plan = match &args.plan {
            Some(path) => Some(Plan::load(path)?),
            None => None,
        };
        let folder = match &plan {
            None => super::model::model_folder(&args.by_hand.model.model),
            // Other weights to start from: the plan's folder is not needed.
            Some(_) if raw.init_from.is_some() => None,
            Some(plan) => plan_folder(plan, args.plan.as_deref().unwrap_or(Path::new("")))?,
        };
        let training = Training::resolve(
            &raw,
            TrainingDefaults::TRAIN,
            args.checkpoint_dir.clone(),
            folder,
        )?;
        training.require_checkpoint_dir()?;
        let source = match (plan, &args.plan) {
            (Some(mut plan), Some(path)) => {
                args.optimizer.apply(&mut plan.model)?;
                // The ranks build the schedule too; a bad flag is refused before they start.
                training.lr_schedule(plan.model.optimizer.lr)?;
                TrainSource::Plan {
                    plan: Box::new(plan),
                    path: path.clone(),
                }
            }
            _ => by_hand(args, &training)?,
        };
        Ok(Self {
            source,
            training,
            notes,
        })
    }
}

/// The Hugging Face folder a plan's model was read from, which must still be there: training
/// starts from its weights and reads the data with its tokenizer.
fn plan_folder(plan: &Plan, path: &Path) -> Result<Option<PathBuf>> {
    match &plan.model_folder {
        Some(folder) if !folder.join("config.json").is_file() => Err(Error::Usage(format!(
            "plan `{}` was tuned for the model folder `{}`, which holds no config.json any \
             more; restore the folder, or start from other weights with --init-from DIR",
            path.display(),
            folder.display()
        ))),
        folder => Ok(folder.clone()),
    }
}

/// The model and knobs the flags give, checked against each other and this machine.
fn by_hand(args: &TrainArgs, training: &Training) -> Result<TrainSource> {
    let mut spec = resolve_model(
        &args.by_hand.model.model,
        args.by_hand.model.seq_len.map(|n| n as usize),
    )?;
    args.optimizer.apply(&mut spec)?;
    let knobs = args.by_hand.knobs.knobs();
    check_data_parallel_flags(args)?;
    knobs
        .validate("knobs", "")
        .and_then(|()| limits::check_knobs(&spec, &knobs, "knobs", ""))
        .map_err(|e| as_flag(e, flags::TRAIN))?;
    training.lr_schedule(spec.optimizer.lr)?;
    Ok(TrainSource::Knobs {
        spec: Box::new(spec),
        knobs,
        device: args.by_hand.model.device.clone(),
        engine: args.by_hand.model.engine,
    })
}

/// The data-parallel flags against each other and this machine, with the flag to change.
fn check_data_parallel_flags(args: &TrainArgs) -> Result<()> {
    let degree = args.by_hand.knobs.data_parallel;
    let refuse = |flag: &str, problem: &str| -> Result<()> {
        Err(autotune_core::Error::InvalidFlag {
            flag: flag.into(),
            problem: problem.into(),
        }
        .into())
    };
    if degree == 0 {
        return refuse(
            "--data-parallel 0",
            "it is the number of GPUs to train on; use 1 or more",
        );
    }
    if args.by_hand.knobs.shard_optimizer && degree < 2 {
        return refuse(
            "--shard-optimizer",
            "splits the optimizer state between GPUs; add `--data-parallel N` with N of 2 or more",
        );
    }
    if args.by_hand.knobs.shard_optimizer && args.by_hand.knobs.offload == crate::Offload::Optimizer
    {
        return refuse(
            "--shard-optimizer",
            "cannot be combined with `--offload optimizer` yet; drop one of them",
        );
    }
    crate::dist::probe::check_degree(degree, &args.by_hand.model.device, "--data-parallel")?;
    Ok(())
}
