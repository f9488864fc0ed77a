//! A training run from its settings to its summary: in this process, as one rank of a
//! data-parallel run, or as the launcher of its ranks ([`super::launch`]); with a plan (its
//! model, knobs and memory limits, a smaller card emulated exactly as during tuning) or with
//! knobs given by hand.

use std::ffi::OsString;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use candle_core::Device;

use super::launch::Launched;
use super::observer::{MetricsRecorder, Notice, SessionObserver};
use super::run_dir::claim_checkpoint_dir;
use crate::backend::host_memory;
use crate::backend::memory::DeviceMemory;
use crate::collective::{Collective, RankEnv};
use crate::data::format::TextTokens;
use crate::data::load::HeldOut;
use crate::data::load::{LoadEvent, Loading};
use crate::data::pack::PackChoice;
use crate::data::profile::run_data;
use crate::data::source::{Data, DataSpec};
use crate::model::Engine;
use crate::plan::schema::Plan;
use crate::settings::train::{TrainSettings, TrainSource};
use crate::settings::training::Training;
use crate::spec::device::DeviceKind;
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::train::checkpoint;
use crate::train::run::{self, RunConfig, RunSummary, TrainObserver};
use crate::train::schedule::LrSchedule;
use crate::train::step::Trainer;
use crate::{Error, Knobs, Result};

/// How a training session ended.
#[derive(Debug)]
pub enum Trained {
    /// The run ended (finished, interrupted after a checkpoint, or diverged: see the summary).
    Finished(RunSummary),
    /// This process trained as one rank of a launched run; its launcher reports the run.
    AsRank(RunSummary),
    /// The setting cannot fit this machine, so nothing ran: why.
    DoesNotFit(String),
}

/// Runs the training `settings` describe. `rank` is set when this process was launched as a
/// rank of a data-parallel run; `interrupt` asks the run to checkpoint and stop.
pub fn train(
    settings: &TrainSettings,
    rank: Option<RankEnv>,
    observer: &dyn SessionObserver,
    interrupt: &Arc<AtomicBool>,
) -> Result<Trained> {
    let training = &settings.training;
    match &settings.source {
        TrainSource::Plan { plan, path } => match rank {
            Some(rank) => Ok(Trained::AsRank(
                plan_job(plan, training, Some(&rank))?.run_as_rank(rank, observer, interrupt)?,
            )),
            None => Ok(Trained::Finished(train_with_plan(
                plan, path, training, observer, interrupt,
            )?)),
        },
        TrainSource::Knobs {
            spec,
            knobs,
            device,
            engine,
        } => {
            let by_hand = ByHand {
                spec,
                knobs: *knobs,
                device,
                engine: *engine,
            };
            by_hand.train(training, rank, observer, interrupt)
        }
    }
}

/// Trains with a plan in this process, or launches its data-parallel ranks.
pub fn train_with_plan(
    plan: &Plan,
    plan_path: &Path,
    training: &Training,
    observer: &dyn SessionObserver,
    interrupt: &AtomicBool,
) -> Result<RunSummary> {
    check_plan_data(plan, plan_path, training, observer)?;
    let _lock = claim_checkpoint_dir(
        training.checkpoint_dir.as_deref(),
        training.resume,
        training.overwrite,
        observer,
    )?;
    let degree = plan.knobs.data_parallel.degree;
    if degree > 1 {
        let device = match plan.device.kind {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        };
        crate::dist::probe::check_degree(degree, device, "knobs.data_parallel.degree")
            .map_err(|e| Error::Usage(format!("plan `{}`: {e}", plan_path.display())))?;
        tokenize_once(training, &plan.model, observer)?;
        let launched = Launched {
            args: plan_rank_args(plan, plan_path, training),
            degree,
            device,
            total_steps: training.steps_at(&plan.knobs, plan.model.seq_len),
            metrics: training.metrics.as_deref(),
        };
        return launched.run(observer, interrupt);
    }
    let summary = plan_job(plan, training, None)?.run(observer, interrupt)?;
    if host_memory::is_counting() && host_memory::limit_exceeded() {
        return Err(Error::Usage(format!(
            "training reached {} of host heap, over the plan's host budget of {}; re-tune with a larger --headroom",
            crate::spec::budget::format_bytes(host_memory::peak_bytes()),
            crate::spec::budget::format_bytes(plan.budget.host_bytes)
        )));
    }
    host_memory::set_soft_limit(None);
    Ok(summary)
}

/// Tokenizes a dataset of records into the token cache before a launcher starts its ranks, so
/// that they read it from there instead of each tokenizing it at once.
fn tokenize_once(
    training: &Training,
    spec: &ModelSpec,
    observer: &dyn SessionObserver,
) -> Result<()> {
    let DataSpec::Records(records) = &training.data_spec else {
        return Ok(());
    };
    let events = |event| observer.notice(Notice::Loading(event));
    let loading = Loading::cached(&training.cache_dir, &events);
    records.load(spec, &loading).map(drop)
}

/// Refuses to train with a plan tuned on other data than the run's (other files, tokenizer or
/// batching: its memory was measured on other batches), unless `--allow-data-mismatch` asks
/// to, which is then said.
fn check_plan_data(
    plan: &Plan,
    plan_path: &Path,
    training: &Training,
    observer: &dyn SessionObserver,
) -> Result<()> {
    let Some(tuned) = &plan.data else {
        return Ok(());
    };
    let data = training.data_choice();
    let records = data.records();
    let packs = match records {
        Some(records) => records.packing.packs(&plan.model, Engine::default())?,
        None => false,
    };
    let Err(mismatch) = tuned.check(run_data(records, packs)) else {
        return Ok(());
    };
    let what = mismatch.describe(tuned);
    if training.allow_data_mismatch {
        observer.notice(Notice::PlanDataDiffers { what });
        return Ok(());
    }
    Err(Error::Usage(format!(
        "plan `{}` {what}; train on the plan's data, tune on this data (`autotune tune --data \
         ...`), or pass --allow-data-mismatch to train with this plan anyway",
        plan_path.display()
    )))
}

/// The `autotune train` arguments a rank of a plan's data-parallel run gets: the run's
/// settings, and the optimizer's as this process resolved them (the ranks read the plan's
/// file, which the flags may have overridden).
fn plan_rank_args(plan: &Plan, plan_path: &Path, training: &Training) -> Vec<OsString> {
    let schedule = &training.schedule;
    let optimizer = &plan.model.optimizer;
    let mut args: Vec<OsString> = vec!["train".into(), "--plan".into()];
    args.push(plan_path.as_os_str().to_owned());
    let length = match training.epochs {
        Some(epochs) => ("--epochs", epochs.to_string()),
        None => (
            "--steps",
            training
                .steps_at(&plan.knobs, plan.model.seq_len)
                .to_string(),
        ),
    };
    for (flag, value) in [
        length,
        ("--checkpoint-every", training.checkpoint_every.to_string()),
        ("--eval-every", training.eval_every.to_string()),
        ("--seed", training.seed.to_string()),
        ("--lr-warmup-steps", schedule.lr_warmup_steps.to_string()),
        ("--lr-schedule", schedule.lr_schedule.as_str().to_string()),
        ("--lr", optimizer.lr.to_string()),
        ("--weight-decay", optimizer.weight_decay.to_string()),
        ("--beta1", optimizer.beta1.to_string()),
        ("--beta2", optimizer.beta2.to_string()),
    ] {
        args.push(flag.into());
        args.push(value.into());
    }
    let paths = [
        ("--checkpoint-dir", training.checkpoint_dir.as_deref()),
        ("--init-from", training.init_from.as_deref()),
    ];
    for (flag, path) in paths {
        if let Some(path) = path {
            args.push(flag.into());
            args.push(path.as_os_str().to_owned());
        }
    }
    if let Some(keep_last) = training.keep_last {
        args.push("--keep-last".into());
        args.push(keep_last.to_string().into());
    }
    if let Some(min_lr) = schedule.min_lr {
        args.push("--min-lr".into());
        args.push(min_lr.to_string().into());
    }
    if training.resume {
        args.push("--resume".into());
    }
    args.extend(data_flags(training));
    args
}

/// The flags beside `--data` that say how the data is read, as the ranks must read it too.
fn data_flags(training: &Training) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    for data in &training.data {
        args.push("--data".into());
        args.push(data.into());
    }
    args.push("--cache-dir".into());
    args.push(training.cache_dir.as_os_str().to_owned());
    if training.allow_data_mismatch {
        args.push("--allow-data-mismatch".into());
    }
    match &training.data_spec {
        DataSpec::Records(records) => {
            if let Some(format) = records.format {
                args.push("--data-format".into());
                args.push(format!("{format:?}").to_lowercase().into());
            }
            args.push("--tokenizer".into());
            args.push(records.tokenizer.as_os_str().to_owned());
            if let Some(train_on) = records.train_on {
                args.push("--train-on".into());
                args.push(format!("{train_on:?}").to_lowercase().into());
            }
            match records.packing {
                PackChoice::Auto => {}
                PackChoice::Pack => args.push("--pack".into()),
                PackChoice::Pad => args.push("--no-pack".into()),
            }
            args.push("--truncate".into());
            args.push(records.truncation.as_str().into());
            match &records.held_out {
                HeldOut::None => {}
                HeldOut::PerMillion(share) => {
                    args.push("--eval-split".into());
                    args.push((f64::from(*share) / 1e6).to_string().into());
                }
                HeldOut::Files(files) => {
                    for file in files {
                        args.push("--eval-data".into());
                        args.push(file.as_os_str().to_owned());
                    }
                }
            }
            if !records.columns.is_empty() {
                let pairs: Vec<String> = records
                    .columns
                    .iter()
                    .map(|(f, c)| format!("{f}={c}"))
                    .collect();
                args.push("--columns".into());
                args.push(pairs.join(",").into());
            }
        }
        _ if training.text_tokens == TextTokens::Bytes => {
            args.push("--tokenizer".into());
            args.push("bytes".into());
        }
        _ => {}
    }
    args
}

/// The training job a plan describes, in this process or as one of its ranks: the plan's kind
/// of device (rank r on `cuda:r`), inside its memory limits (a smaller GPU emulated exactly as
/// during tuning; the ranks of one host share its host budget evenly).
fn plan_job<'a>(plan: &'a Plan, training: &'a Training, rank: Option<&RankEnv>) -> Result<Job<'a>> {
    let device = match (plan.device.kind, rank) {
        (DeviceKind::Cpu, _) => Device::Cpu,
        (DeviceKind::Cuda, None) => crate::backend::open("cuda")?,
        (DeviceKind::Cuda, Some(r)) => crate::backend::open(&format!("cuda:{}", r.rank))?,
    };
    // Holding back memory makes the run see the plan's card, so "fits in the plan" means
    // "fits on that card"; the meter must live as long as training does.
    let meter = crate::backend::memory_meter(&device, plan.device.gpu_memory_bytes)?;
    let schedule = training.lr_schedule(plan.model.optimizer.lr)?;
    let ranks = rank.map_or(1, |r| r.world_size) as u64;
    let host_limit = plan.budget.host_bytes / ranks;
    host_memory::set_soft_limit(Some(host_limit));
    Ok(Job {
        spec: &plan.model,
        knobs: plan.knobs,
        device,
        training,
        schedule,
        total_steps: training.steps_at(&plan.knobs, plan.model.seq_len),
        // Plans are tuned with the default engine.
        engine: crate::model::Engine::default(),
        host_limit: Some(host_limit),
        meter,
    })
}

/// Training with knobs given by hand, on the device named.
struct ByHand<'a> {
    spec: &'a ModelSpec,
    knobs: Knobs,
    device: &'a str,
    engine: crate::model::Engine,
}

impl ByHand<'_> {
    fn train(
        &self,
        training: &Training,
        rank: Option<RankEnv>,
        observer: &dyn SessionObserver,
        interrupt: &Arc<AtomicBool>,
    ) -> Result<Trained> {
        let schedule = training.lr_schedule(self.spec.optimizer.lr)?;
        if let Some(why) = beyond_this_host(self.spec, self.knobs, self.device) {
            return Ok(Trained::DoesNotFit(why));
        }
        // The ranks of a launched run write into the directory their launcher holds.
        let _lock = match rank {
            None => claim_checkpoint_dir(
                training.checkpoint_dir.as_deref(),
                training.resume,
                training.overwrite,
                observer,
            )?,
            Some(_) => None,
        };
        let degree = self.knobs.data_parallel.degree;
        if degree > 1 && rank.is_none() {
            tokenize_once(training, self.spec, observer)?;
            let launched = Launched {
                args: std::env::args_os().skip(1).collect(),
                degree,
                device: self.device,
                total_steps: training.steps_at(&self.knobs, self.spec.seq_len),
                metrics: training.metrics.as_deref(),
            };
            return Ok(Trained::Finished(launched.run(observer, interrupt)?));
        }
        let device_name = match &rank {
            Some(r) => crate::collective::rank::rank_device(self.device, r.rank),
            None => self.device.to_string(),
        };
        // Opening the device configures its memory pool (`backend::open`); with explicit knobs
        // no smaller card is emulated.
        let device = crate::backend::open(&device_name)?;
        let job = Job {
            spec: self.spec,
            knobs: self.knobs,
            meter: crate::backend::memory_meter(&device, None)?,
            device,
            training,
            schedule,
            total_steps: training.steps_at(&self.knobs, self.spec.seq_len),
            engine: self.engine,
            host_limit: None,
        };
        Ok(match rank {
            Some(rank) => Trained::AsRank(job.run_as_rank(rank, observer, interrupt)?),
            None => Trained::Finished(job.run(observer, interrupt)?),
        })
    }
}

/// Why training on this machine's CPU cannot fit its memory, when the model's state and one
/// micro-batch's logits alone exceed it (a GPU reports its own out-of-memory; on the CPU an
/// allocation larger than the machine would abort the process instead).
fn beyond_this_host(spec: &ModelSpec, knobs: Knobs, device: &str) -> Option<String> {
    let on_cpu = device == "cpu" || (device == "auto" && crate::backend::cuda_device_count() == 0);
    if !on_cpu {
        return None;
    }
    let host = crate::backend::host_memory_bytes()?;
    let ranks = knobs.data_parallel.degree as u64;
    let per_rank = host / ranks.max(1);
    let memory = if ranks > 1 {
        format!("host memory each of {ranks} ranks has")
    } else {
        "host memory this machine has".to_string()
    };
    limits::setting_exceeds(spec, &knobs, per_rank, &memory)
}

/// One training run in this process, however its knobs were chosen.
pub struct Job<'a> {
    spec: &'a ModelSpec,
    knobs: Knobs,
    device: Device,
    training: &'a Training,
    schedule: LrSchedule,
    /// The run's last step (known once the data is open, for a run of epochs).
    total_steps: u64,
    engine: crate::model::Engine,
    /// The host heap limit in force (a plan's budget, or a rank's share of it).
    host_limit: Option<u64>,
    /// The device's memory meter, read after every step; with a plan on a GPU it also holds
    /// back what the plan's card lacks, so it must live as long as training does.
    meter: Box<dyn DeviceMemory>,
}

impl Job<'_> {
    /// The data and a trainer in `group`, restored from the latest checkpoint when resuming.
    fn prepare(
        &mut self,
        group: Collective,
        events: &dyn Fn(LoadEvent),
    ) -> Result<(DataSpec, Data, Trainer)> {
        let data_spec = self.training.data_spec.clone();
        let loading = Loading::cached(&self.training.cache_dir, events);
        let mut data = Data::open_with(&data_spec, self.spec, &loading)?;
        if let DataSpec::Records(records) = &data_spec {
            let packs = records.packing.packs(self.spec, self.engine)?;
            data.set_packing(packs.then_some(self.spec.seq_len));
        }
        data.set_micros_per_step(self.knobs.grad_accum * self.knobs.data_parallel.degree);
        // A run of epochs knows its steps, and the schedule its end, once the data is open.
        self.total_steps = self
            .training
            .total_steps(&data, &self.knobs, self.spec.seq_len)?;
        self.schedule = self
            .training
            .schedule
            .schedule(self.spec.optimizer.lr, self.total_steps)?;
        let seed = self.training.seed;
        let mut trainer = Trainer::in_group(self.spec, self.knobs, &self.device, seed, group)?;
        trainer.set_engine(self.engine);
        trainer.set_schedule(self.schedule);
        if self.training.resume {
            let dir =
                self.training.checkpoint_dir.as_deref().ok_or_else(|| {
                    Error::Usage("`--resume` needs `--checkpoint-dir`".to_string())
                })?;
            resume(dir, &mut trainer, &data_spec, self.knobs)?;
        } else if let Some(dir) = &self.training.init_from {
            crate::hf::import_weights(dir, &mut trainer)?;
        }
        Ok((data_spec, data, trainer))
    }

    fn config(&self) -> RunConfig {
        RunConfig {
            total_steps: self.total_steps,
            checkpoint_dir: self.training.checkpoint_dir.clone(),
            checkpoint_every: self.training.checkpoint_every,
            eval_every: self.training.eval_every,
            keep_last: self.training.keep_last,
            schedule: self.schedule,
        }
    }

    /// Trains in this process to the end, recording the metrics log.
    fn run(mut self, observer: &dyn SessionObserver, interrupt: &AtomicBool) -> Result<RunSummary> {
        let metrics = MetricsRecorder::open(self.training.metrics.as_deref())?;
        let loading = |event| observer.notice(Notice::Loading(event));
        let (data_spec, data, mut trainer) = self.prepare(Collective::Single, &loading)?;
        if let Some((_, cut)) = data.examples() {
            observer.notice(Notice::Examples(*cut));
        }
        observer.notice(Notice::Training {
            model: self.spec.name.clone(),
            parameters: trainer.model().params().element_count(),
            device: crate::backend::describe(&self.device).to_string(),
            knobs: self.knobs,
            data: data_spec.to_string(),
            lr: self.spec.optimizer.lr,
            schedule: self.schedule,
        });
        let recorder = MetricsRecorder::new(metrics, observer);
        self.run_loop(&mut trainer, &data, &data_spec, interrupt, &recorder)
    }

    /// The training loop over `data`, to the run's last step or an interrupt.
    fn run_loop(
        &mut self,
        trainer: &mut Trainer,
        data: &Data,
        data_spec: &DataSpec,
        interrupt: &AtomicBool,
        observer: &dyn TrainObserver,
    ) -> Result<RunSummary> {
        let config = self.config();
        let meter = &mut *self.meter;
        run::run(
            trainer, data, data_spec, &config, interrupt, meter, observer,
        )
    }

    /// Trains as one rank of a launched group: `observer` gets rank 0's events only (the
    /// launcher draws its progress), and the launcher records the metrics.
    fn run_as_rank(
        mut self,
        env: RankEnv,
        observer: &dyn TrainObserver,
        interrupt: &Arc<AtomicBool>,
    ) -> Result<RunSummary> {
        if self.knobs.data_parallel.degree != env.world_size {
            return Err(Error::Usage(format!(
                "this process is rank {} of {}, but its knobs ask for --data-parallel {}",
                env.rank, env.world_size, self.knobs.data_parallel.degree
            )));
        }
        let group = Collective::join(&env, &self.device)?;
        // Rank 0's launcher shows the progress; the ranks load quietly.
        let (data_spec, data, mut trainer) = self.prepare(group, &|_| {})?;
        // A rank whose launcher is gone stops as if interrupted, saving its checkpoint.
        crate::dist::launch::watch_launcher(interrupt.clone());
        let quiet = run::NoObserver;
        let events: &dyn TrainObserver = if env.rank == 0 { observer } else { &quiet };
        let summary = self.run_loop(&mut trainer, &data, &data_spec, interrupt, events)?;
        if let Some(limit) = self.host_limit {
            if host_memory::is_counting() && host_memory::limit_exceeded() {
                return Err(Error::Usage(format!(
                    "rank {} reached {} of host heap, over its share {} of the plan's host budget; re-tune with a larger --headroom",
                    env.rank,
                    crate::spec::budget::format_bytes(host_memory::peak_bytes()),
                    crate::spec::budget::format_bytes(limit)
                )));
            }
        }
        Ok(summary)
    }
}

/// Restores the latest checkpoint of `dir` into `trainer`, refusing one trained with other
/// settings than this run's: a resumed run continues its run exactly or not at all.
fn resume(dir: &Path, trainer: &mut Trainer, data_spec: &DataSpec, knobs: Knobs) -> Result<()> {
    let Some(path) = checkpoint::latest(dir)? else {
        return Err(Error::Usage(format!(
            "`--resume`: no checkpoint in `{}` (no `latest` file); drop --resume to start afresh",
            dir.display()
        )));
    };
    let state = checkpoint::restore(&path, trainer)?;
    if state.schedule.canonical() != trainer.schedule().canonical() {
        return Err(Error::Usage(format!(
            "`--resume`: checkpoint `{}` was trained with the learning rate {}, and this run asks for {}; pass the same --lr-warmup-steps, --lr-schedule, --min-lr and (with cosine) --steps, so that the schedule continues",
            path.display(),
            state.schedule,
            trainer.schedule()
        )));
    }
    if state.knobs != knobs || &state.data != data_spec || state.seed != trainer.seed() {
        return Err(Error::Usage(format!(
            "`--resume`: checkpoint `{}` was trained with {} on `{}` (seed {}); pass the same knobs, data and seed",
            path.display(),
            state.knobs,
            state.data,
            state.seed
        )));
    }
    Ok(())
}
