//! `autotune train`: train with explicit knobs or a plan, rendering progress and handling Ctrl-C.
//!
//! With a data-parallel degree above 1 (`--data-parallel N`, or a plan that has one) this
//! process becomes the launcher of N ranks ([`super::launch`]); a process started as a rank
//! (the rank variables are set) trains as that rank instead.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::Device;
use indicatif::ProgressBar;
use serde::Serialize;

use autotune::backend as device;
use autotune::backend::host_memory;
use autotune::collective::{Collective, RankEnv};
use autotune::plan::schema::Plan;
use autotune::spec::device::DeviceKind;
use autotune::train::data::{Data, DataSpec};
use autotune::train::metrics::{MetricsLog, StepLine};
use autotune::train::run::{self, MemorySample, RunConfig, RunSummary, TrainEvent, TrainObserver};
use autotune::train::step::Trainer;
use autotune::train::{checkpoint, checkpoint_dir};
use autotune::{Knobs, ModelSpec};

use autotune::spec::limits;

use super::args::{ScheduleArgs, TrainArgs};
use super::printer::Printer;
use super::reporters::bytes;
use super::Status;
use autotune::settings::flags::{self, as_flag};

pub fn run(args: TrainArgs, printer: &Printer) -> anyhow::Result<Status> {
    let rank = RankEnv::from_env()?;
    if let Some(path) = &args.plan {
        let plan = Plan::load(path)?;
        let training = PlanTraining {
            plan: &plan,
            plan_path: path,
            steps: args.steps,
            data: &args.data,
            checkpoint_dir: args.checkpoint_dir.clone(),
            checkpoint_every: args.checkpoint_every,
            eval_every: args.eval_every,
            seed: args.model.seed,
            resume: args.resume,
            overwrite: args.overwrite,
            keep_last: args.keep_last.map(|n| n as usize),
            init_from: args.init_from.clone(),
            schedule: args.schedule.clone(),
            metrics: args.metrics.clone(),
        };
        if let Some(rank) = rank {
            return super::launch::run_rank(plan_job(&training, Some(&rank))?, rank);
        }
        let (summary, status) = train_with_plan(&training, printer)?;
        printer.data_json(&TrainReport::new(&plan.model, plan.knobs, &summary));
        return Ok(status);
    }
    let spec = ModelSpec::resolve(&args.model.model)?;
    let knobs = args.knobs.knobs();
    check_data_parallel_flags(&args)?;
    knobs
        .validate("knobs", "")
        .and_then(|()| limits::check_knobs(&spec, &knobs, "knobs", ""))
        .map_err(|e| as_flag(e, flags::TRAIN))?;
    let degree = knobs.data_parallel.degree;
    let schedule = args.schedule.schedule(spec.optimizer.lr, args.steps)?;
    if let Some(why) = beyond_this_host(&spec, knobs, &args.model.device) {
        printer.data_text(format!("does not fit: {why}"));
        return Ok(Status::Negative);
    }
    // The ranks of a launched run write into the directory their launcher holds.
    let _lock = match rank {
        None => claim_checkpoint_dir(
            args.checkpoint_dir.as_deref(),
            args.resume,
            args.overwrite,
            printer,
        )?,
        Some(_) => None,
    };
    if degree > 1 && rank.is_none() {
        let launched = super::launch::Launched {
            args: std::env::args_os().skip(1).collect(),
            degree,
            device: &args.model.device,
            total_steps: args.steps,
            metrics: args.metrics.as_deref(),
        };
        let summary = launched.run(printer)?;
        printer.data_json(&TrainReport::new(&spec, knobs, &summary));
        return Ok(status_of(&summary));
    }
    let device_name = match &rank {
        Some(r) => autotune::collective::rank::rank_device(&args.model.device, r.rank),
        None => args.model.device.clone(),
    };
    // Opening the device configures its memory pool (`backend::open`); with explicit knobs no
    // smaller card is emulated.
    let device = device::open(&device_name)?;
    let meter = device::memory_meter(&device, None)?;
    let job = Job {
        spec: &spec,
        knobs,
        device,
        data: &args.data,
        config: RunConfig {
            total_steps: args.steps,
            checkpoint_dir: args.checkpoint_dir.clone(),
            checkpoint_every: args.checkpoint_every,
            eval_every: args.eval_every,
            keep_last: args.keep_last.map(|n| n as usize),
            schedule,
        },
        seed: args.model.seed,
        resume: args.resume,
        init_from: args.init_from.clone(),
        engine: args.model.engine,
        host_limit: None,
        meter,
        metrics: args.metrics.clone(),
    };
    if let Some(rank) = rank {
        return super::launch::run_rank(job, rank);
    }
    let summary = job.run(printer)?;
    printer.data_json(&TrainReport::new(&spec, knobs, &summary));
    Ok(status_of(&summary))
}

/// Why training on this machine's CPU cannot fit its memory, when the model's state and one
/// micro-batch's logits alone exceed it (a GPU reports its own out-of-memory; on the CPU an
/// allocation larger than the machine would abort the process instead).
fn beyond_this_host(spec: &ModelSpec, knobs: Knobs, device: &str) -> Option<String> {
    let on_cpu =
        device == "cpu" || (device == "auto" && autotune::backend::cuda_device_count() == 0);
    if !on_cpu {
        return None;
    }
    let host = autotune::backend::host_memory_bytes()?;
    let ranks = knobs.data_parallel.degree as u64;
    let per_rank = host / ranks.max(1);
    let memory = if ranks > 1 {
        format!("host memory each of {ranks} ranks has")
    } else {
        "host memory this machine has".to_string()
    };
    limits::setting_exceeds(spec, &knobs, per_rank, &memory)
}

/// The data-parallel flags against each other and this machine, with the flag to change.
fn check_data_parallel_flags(args: &TrainArgs) -> anyhow::Result<()> {
    let degree = args.knobs.data_parallel;
    if degree == 0 {
        anyhow::bail!("`--data-parallel 0`: it is the number of GPUs to train on; use 1 or more");
    }
    if args.knobs.shard_optimizer && degree < 2 {
        anyhow::bail!(
            "`--shard-optimizer` splits the optimizer state between GPUs; add `--data-parallel N` with N of 2 or more"
        );
    }
    if args.knobs.shard_optimizer && args.knobs.offload == autotune::Offload::Optimizer {
        anyhow::bail!(
            "`--shard-optimizer` cannot be combined with `--offload optimizer` yet; drop one of them"
        );
    }
    autotune::dist::probe::check_degree(degree, &args.model.device, "--data-parallel")?;
    Ok(())
}

/// Training with a plan: its model and knobs, on the kind of device it was made for, inside
/// its memory limits (a smaller GPU emulated exactly as during tuning).
pub struct PlanTraining<'a> {
    pub plan: &'a Plan,
    /// Where the plan is, for the ranks of a data-parallel plan to read.
    pub plan_path: &'a std::path::Path,
    pub steps: u64,
    pub data: &'a str,
    pub checkpoint_dir: Option<PathBuf>,
    pub checkpoint_every: u64,
    pub eval_every: u64,
    pub seed: u64,
    pub resume: bool,
    /// Start over in a checkpoint directory that holds checkpoints, removing them.
    pub overwrite: bool,
    pub keep_last: Option<usize>,
    /// A Hugging Face checkpoint to start from.
    pub init_from: Option<PathBuf>,
    /// The learning rate over the run.
    pub schedule: ScheduleArgs,
    /// Where the per-step metrics go, if anywhere.
    pub metrics: Option<PathBuf>,
}

pub fn train_with_plan(
    t: &PlanTraining,
    printer: &Printer,
) -> anyhow::Result<(RunSummary, Status)> {
    let plan = t.plan;
    let _lock = claim_checkpoint_dir(t.checkpoint_dir.as_deref(), t.resume, t.overwrite, printer)?;
    let degree = plan.knobs.data_parallel.degree;
    if degree > 1 {
        // The ranks build the schedule too; a bad flag is refused here, before they start.
        t.schedule.schedule(plan.model.optimizer.lr, t.steps)?;
        let device = match plan.device.kind {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        };
        autotune::dist::probe::check_degree(degree, device, "knobs.data_parallel.degree")
            .map_err(|e| anyhow::anyhow!("plan `{}`: {e}", t.plan_path.display()))?;
        let launched = super::launch::Launched {
            args: t.rank_args(),
            degree,
            device,
            total_steps: t.steps,
            metrics: t.metrics.as_deref(),
        };
        let summary = launched.run(printer)?;
        let status = status_of(&summary);
        return Ok((summary, status));
    }
    let job = plan_job(t, None)?;
    let summary = job.run(printer)?;
    if host_memory::is_counting() && host_memory::limit_exceeded() {
        anyhow::bail!(
            "training reached {} of host heap, over the plan's host budget of {}; re-tune with a larger --headroom",
            bytes(host_memory::peak_bytes()),
            bytes(plan.budget.host_bytes)
        );
    }
    host_memory::set_soft_limit(None);
    let status = status_of(&summary);
    Ok((summary, status))
}

impl PlanTraining<'_> {
    /// The `autotune train` arguments a rank of this plan's data-parallel run gets.
    fn rank_args(&self) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec!["train".into(), "--plan".into()];
        args.push(self.plan_path.as_os_str().to_owned());
        for (flag, value) in [
            ("--steps", self.steps.to_string()),
            ("--data", self.data.to_string()),
            ("--checkpoint-every", self.checkpoint_every.to_string()),
            ("--eval-every", self.eval_every.to_string()),
            ("--seed", self.seed.to_string()),
            ("--warmup-steps", self.schedule.warmup_steps.to_string()),
            (
                "--lr-schedule",
                self.schedule.lr_schedule.as_str().to_string(),
            ),
        ] {
            args.push(flag.into());
            args.push(value.into());
        }
        if let Some(dir) = &self.checkpoint_dir {
            args.push("--checkpoint-dir".into());
            args.push(dir.as_os_str().to_owned());
        }
        if let Some(keep_last) = self.keep_last {
            args.push("--keep-last".into());
            args.push(keep_last.to_string().into());
        }
        if let Some(min_lr) = self.schedule.min_lr {
            args.push("--min-lr".into());
            args.push(min_lr.to_string().into());
        }
        if self.resume {
            args.push("--resume".into());
        }
        if let Some(dir) = &self.init_from {
            args.push("--init-from".into());
            args.push(dir.as_os_str().to_owned());
        }
        args
    }
}

/// The training job a plan describes, in this process or as one of its ranks: the plan's kind
/// of device (rank r on `cuda:r`), inside its memory limits (a smaller GPU emulated exactly as
/// during tuning; the ranks of one host share its host budget evenly).
fn plan_job<'a>(t: &'a PlanTraining, rank: Option<&RankEnv>) -> anyhow::Result<Job<'a>> {
    let plan = t.plan;
    let device = match (plan.device.kind, rank) {
        (DeviceKind::Cpu, _) => Device::Cpu,
        (DeviceKind::Cuda, None) => device::open("cuda")?,
        (DeviceKind::Cuda, Some(r)) => device::open(&format!("cuda:{}", r.rank))?,
    };
    // Holding back memory makes the run see the plan's card, so "fits in the plan" means
    // "fits on that card"; the meter must live as long as training does.
    let meter = device::memory_meter(&device, plan.device.gpu_memory_bytes)?;
    let schedule = t.schedule.schedule(plan.model.optimizer.lr, t.steps)?;
    let ranks = rank.map_or(1, |r| r.world_size) as u64;
    let host_limit = plan.budget.host_bytes / ranks;
    host_memory::set_soft_limit(Some(host_limit));
    Ok(Job {
        spec: &plan.model,
        knobs: plan.knobs,
        device,
        data: t.data,
        config: RunConfig {
            total_steps: t.steps,
            checkpoint_dir: t.checkpoint_dir.clone(),
            checkpoint_every: t.checkpoint_every,
            eval_every: t.eval_every,
            keep_last: t.keep_last,
            schedule,
        },
        seed: t.seed,
        resume: t.resume,
        init_from: t.init_from.clone(),
        // Plans are tuned with the default engine.
        engine: autotune::model::Engine::default(),
        host_limit: Some(host_limit),
        meter,
        metrics: t.metrics.clone(),
    })
}

/// Takes the checkpoint directory for this run: its lock (held until the run ends), its stale
/// temporaries swept, and, without `--resume`, its old checkpoints refused, or removed with
/// `--overwrite`, so two runs never mix in one directory.
pub fn claim_checkpoint_dir(
    dir: Option<&std::path::Path>,
    resume: bool,
    overwrite: bool,
    printer: &Printer,
) -> anyhow::Result<Option<checkpoint_dir::DirLock>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let lock = checkpoint_dir::lock(dir)?;
    let swept = checkpoint_dir::sweep_temporaries(dir)?;
    if swept > 0 {
        printer.status(format!(
            "removed {swept} temporary file(s) an interrupted save left in {}",
            dir.display()
        ));
    }
    if !resume && checkpoint_dir::holds_checkpoints(dir)? {
        if !overwrite {
            let newest = checkpoint_dir::checkpoints(dir)?
                .last()
                .map(|(step, _)| format!(" (up to step {step})"))
                .unwrap_or_default();
            anyhow::bail!(
                "`{}` already holds checkpoints of a run{newest}; pass --resume to continue it, --overwrite to start over and remove them, or use another directory",
                dir.display()
            );
        }
        checkpoint_dir::clear(dir)?;
        printer.status(format!(
            "--overwrite: removed the checkpoints in {}",
            dir.display()
        ));
    }
    Ok(Some(lock))
}

fn status_of(summary: &RunSummary) -> Status {
    if summary.diverged.is_some() {
        Status::Negative
    } else if summary.interrupted {
        Status::Interrupted
    } else {
        Status::Success
    }
}

/// One training run, however its knobs were chosen.
pub struct Job<'a> {
    pub spec: &'a ModelSpec,
    pub knobs: Knobs,
    pub device: Device,
    pub data: &'a str,
    pub config: RunConfig,
    pub seed: u64,
    pub resume: bool,
    /// A Hugging Face checkpoint whose weights a fresh run starts from.
    pub init_from: Option<PathBuf>,
    pub engine: autotune::model::Engine,
    /// The host heap limit in force (a plan's budget, or a rank's share of it).
    pub host_limit: Option<u64>,
    /// The device's memory meter, read after every step; with a plan on a GPU it also holds
    /// back what the plan's card lacks, so it must live as long as training does.
    pub meter: Box<dyn autotune::backend::memory::DeviceMemory>,
    /// Where the per-step metrics go (the launcher of a data-parallel run writes them).
    pub metrics: Option<PathBuf>,
}

impl Job<'_> {
    /// The data and a trainer in `group`, restored from the latest checkpoint when resuming.
    pub fn prepare(&self, group: Collective) -> anyhow::Result<(DataSpec, Data, Trainer)> {
        let data_spec = DataSpec::parse(self.data);
        let data = Data::open(&data_spec, self.spec)?;
        let mut trainer = Trainer::in_group(self.spec, self.knobs, &self.device, self.seed, group)?;
        trainer.set_engine(self.engine);
        trainer.set_schedule(self.config.schedule);
        if self.resume {
            let dir = self
                .config
                .checkpoint_dir
                .as_deref()
                .ok_or_else(|| anyhow::anyhow!("`--resume` needs `--checkpoint-dir`"))?;
            resume(dir, &mut trainer, &data_spec, self.knobs)?;
        } else if let Some(dir) = &self.init_from {
            autotune::hf::import_weights(dir, &mut trainer)?;
        }
        Ok((data_spec, data, trainer))
    }

    fn run(mut self, printer: &Printer) -> anyhow::Result<RunSummary> {
        let metrics = self.metrics.as_deref().map(MetricsLog::new).transpose()?;
        let (data_spec, data, mut trainer) = self.prepare(Collective::Single)?;
        printer.status(format!(
            "training {} ({:.1}M parameters) on {} with {}, data {data_spec}, learning rate {} ({})",
            self.spec.name,
            trainer.model().params().element_count() as f64 / 1e6,
            device::describe(&self.device),
            self.knobs,
            self.spec.optimizer.lr,
            self.config.schedule,
        ));
        let interrupt = interrupt_flag(printer);
        let progress = Progress::new(printer, self.config.total_steps, metrics);
        let summary = run::run(
            &mut trainer,
            &data,
            &data_spec,
            &self.config,
            &interrupt,
            &mut *self.meter,
            &progress,
        )?;
        progress.bar.finish_and_clear();
        report(printer, &summary);
        Ok(summary)
    }
}

fn resume(
    dir: &std::path::Path,
    trainer: &mut Trainer,
    data_spec: &DataSpec,
    knobs: Knobs,
) -> anyhow::Result<()> {
    let Some(path) = checkpoint::latest(dir)? else {
        anyhow::bail!(
            "`--resume`: no checkpoint in `{}` (no `latest` file); drop --resume to start afresh",
            dir.display()
        );
    };
    let state = checkpoint::restore(&path, trainer)?;
    if state.schedule.canonical() != trainer.schedule().canonical() {
        anyhow::bail!(
            "`--resume`: checkpoint `{}` was trained with the learning rate {}, and this run asks for {}; pass the same --warmup-steps, --lr-schedule, --min-lr and (with cosine) --steps, so that the schedule continues",
            path.display(),
            state.schedule,
            trainer.schedule()
        );
    }
    if state.knobs != knobs || &state.data != data_spec || state.seed != trainer.seed() {
        anyhow::bail!(
            "`--resume`: checkpoint `{}` was trained with {} on `{}` (seed {}); pass the same knobs, data and seed",
            path.display(),
            state.knobs,
            state.data,
            state.seed
        );
    }
    Ok(())
}

/// The first interrupt (Ctrl-C, or SIGTERM or SIGHUP, what schedulers send on preemption) asks
/// the loop to checkpoint after the current step and stop (exit 130); a second one exits at
/// once with 130 without saving, leaving `latest` at the checkpoint before (a save it cuts
/// short leaves only a temporary, which the next run on the directory removes).
pub fn interrupt_flag(printer: &Printer) -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    let flag = FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let handler_flag = flag.clone();
        let result = ctrlc::set_handler(move || {
            if handler_flag.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
            eprintln!(
                "\ninterrupt: saving a checkpoint after this step (interrupt again to quit now, without saving)"
            );
        });
        if let Err(e) = result {
            printer.warn(format!(
                "cannot install the interrupt handler ({e}); an interrupt will not save a checkpoint"
            ));
        }
        flag
    });
    flag.clone()
}

pub struct Progress {
    pub bar: ProgressBar,
    printer: Printer,
    log_every: u64,
    /// The first step this run takes: its line is always logged, so a log shows at once that
    /// training started (and a watcher can wait for it).
    first_step: std::cell::Cell<u64>,
    /// The per-step metrics log; dropped (with a warning) when it cannot be written, since
    /// training matters more than its log.
    metrics: std::cell::RefCell<Option<MetricsLog>>,
}

impl Progress {
    pub fn new(printer: &Printer, total: u64, metrics: Option<MetricsLog>) -> Self {
        let bar = printer.progress(total, "{bar:30} {pos}/{len} steps  {msg}  ETA {eta}");
        Self {
            bar,
            printer: *printer,
            log_every: (total / 10).max(1),
            first_step: std::cell::Cell::new(1),
            metrics: std::cell::RefCell::new(metrics),
        }
    }

    /// Runs `write` on the metrics log, if there is one; a failure warns and ends the log.
    fn log_metrics(&self, write: impl FnOnce(&mut MetricsLog) -> autotune::Result<()>) {
        let mut metrics = self.metrics.borrow_mut();
        if let Some(log) = metrics.as_mut() {
            if let Err(e) = write(log) {
                self.bar.suspend(|| {
                    self.printer.warn(format!(
                        "{e}; training goes on without the metrics log `{}`",
                        log.path().display()
                    ))
                });
                *metrics = None;
            }
        }
    }
}

/// Memory for the progress line: the GPU's in use and at most so far, or on the CPU the host
/// heap's (nothing where the heap is not counted).
fn memory_phrase(memory: &MemorySample) -> String {
    match (memory.gpu_bytes, memory.gpu_peak_bytes) {
        (Some(now), Some(peak)) => format!("  GPU {} (peak {})", bytes(now), bytes(peak)),
        _ if memory.host_peak_bytes > 0 => format!(
            "  host {} (peak {})",
            bytes(memory.host_bytes),
            bytes(memory.host_peak_bytes)
        ),
        _ => String::new(),
    }
}

impl TrainObserver for Progress {
    fn on_event(&self, event: &TrainEvent) {
        match event {
            TrainEvent::Started { start_step, .. } => {
                self.bar.set_position(*start_step);
                self.first_step.set(start_step.saturating_add(1));
                if *start_step > 0 {
                    self.printer
                        .status(format!("resuming at step {start_step}"));
                }
                self.log_metrics(|log| log.start(*start_step));
            }
            TrainEvent::Step {
                step,
                report,
                tokens_per_s,
                memory,
            } => {
                let skipped = if report.skipped {
                    " (skipped: fp16 overflow)"
                } else {
                    ""
                };
                let msg = format!(
                    "loss {:.4}  {:.0} tok/s  lr {:.3e}{}{skipped}",
                    report.loss,
                    tokens_per_s,
                    report.lr,
                    memory_phrase(memory)
                );
                self.bar.set_position(*step);
                self.bar.set_message(msg.clone());
                let due = step % self.log_every == 0 || *step == self.first_step.get();
                if self.printer.log_progress() && due {
                    self.printer.status(format!("step {step}: {msg}"));
                }
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                self.log_metrics(|log| {
                    log.write(&StepLine::new(*step, report, *tokens_per_s, memory, now))
                });
            }
            TrainEvent::Eval { step, loss } => {
                self.bar.suspend(|| {
                    self.printer
                        .status(format!("step {step}: eval loss {loss:.4}"))
                });
            }
            TrainEvent::CheckpointSaved { step, path } => {
                tracing::debug!(step, path = %path.display(), "checkpoint saved");
            }
        }
    }
}

/// The JSON summary of a training run.
#[derive(Serialize)]
pub struct TrainReport<'a> {
    model: &'a str,
    knobs: Knobs,
    steps: u64,
    interrupted: bool,
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    tokens_per_s: f64,
    skipped_steps: u64,
    checkpoint: Option<String>,
    diverged: Option<autotune::train::run::Divergence>,
}

impl<'a> TrainReport<'a> {
    pub fn new(spec: &'a ModelSpec, knobs: Knobs, summary: &RunSummary) -> Self {
        Self {
            model: &spec.name,
            knobs,
            steps: summary.steps,
            interrupted: summary.interrupted,
            last_loss: summary.last_loss,
            last_eval_loss: summary.last_eval_loss,
            tokens_per_s: summary.tokens_per_s,
            skipped_steps: summary.skipped_steps,
            checkpoint: summary.checkpoint.as_ref().map(|p| p.display().to_string()),
            diverged: summary.diverged.clone(),
        }
    }
}

pub fn report(printer: &Printer, summary: &RunSummary) {
    if let Some(d) = &summary.diverged {
        let kept = summary
            .checkpoint
            .as_ref()
            .map(|c| format!("; the last good checkpoint is {}", c.display()))
            .unwrap_or_default();
        printer.status(format!(
            "diverged at step {}: {} is not finite, so nothing more was saved{kept}; lower the learning rate, or resume from an earlier checkpoint",
            d.step, d.what
        ));
        return;
    }
    let verb = if summary.interrupted {
        "interrupted at"
    } else {
        "finished"
    };
    let loss = summary.last_loss.map_or("-".into(), |l| format!("{l:.4}"));
    let eval = summary
        .last_eval_loss
        .map(|l| format!(", eval loss {l:.4}"))
        .unwrap_or_default();
    let checkpoint = summary
        .checkpoint
        .as_ref()
        .map(|c| format!(", checkpoint {}", c.display()))
        .unwrap_or_default();
    printer.status(format!(
        "{verb} step {}: loss {loss}{eval}, {:.0} tokens/s{checkpoint}",
        summary.steps, summary.tokens_per_s
    ));
}
