//! The training loop: steps, periodic evaluation and checkpoints, resume, and interruption.
//!
//! The loop reads a shared interrupt flag once per step (set by the binary's Ctrl-C handler),
//! saves a checkpoint and returns, so stopping a run never loses more than the current step.
//! It reports progress as [`TrainEvent`]s; rendering them is the caller's business.
//!
//! A loss or weights that stop being finite numbers end the run as diverged: nothing
//! non-finite is saved, so `latest` keeps naming the last good checkpoint.
//!
//! As one rank of a data-parallel group, every rank runs this same loop in step: whether to
//! stop is agreed on (any rank's interrupt stops all of them after the same step), and only
//! the root rank writes checkpoints (all ranks take part in gathering a sharded optimizer).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::backend::host_memory;
use crate::backend::memory::DeviceMemory;
use crate::data::source::{Data, DataSpec};
use crate::train::checkpoint;
use crate::train::schedule::LrSchedule;
use crate::train::step::{StepReport, Trainer};
use crate::{Error, Result};

/// How long to train and where to keep checkpoints.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Train until this many optimizer steps have been taken in total (resumed steps count).
    pub total_steps: u64,
    /// Checkpoint directory; `None` disables checkpoints.
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every this many steps (and always at the end or on interruption).
    pub checkpoint_every: u64,
    /// Evaluate on a held-out batch every this many steps; 0 disables.
    pub eval_every: u64,
    /// Keep only this many of the newest checkpoints (and the one `latest` names); `None`
    /// keeps every one.
    pub keep_last: Option<usize>,
    /// The learning rate by step.
    pub schedule: LrSchedule,
}

/// Memory in use after a step, and the most in use so far in the process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemorySample {
    /// Device bytes in use (the memory pool's reservation and what the driver holds beside
    /// it); `None` on the CPU.
    pub gpu_bytes: Option<u64>,
    /// The most device bytes in use so far; `None` on the CPU.
    pub gpu_peak_bytes: Option<u64>,
    /// Live host heap bytes (0 where the heap is not counted).
    pub host_bytes: u64,
    /// The most live host heap bytes so far.
    pub host_peak_bytes: u64,
}

impl MemorySample {
    /// Reads `device`'s meter and the host heap's counters.
    pub fn read(device: &mut dyn DeviceMemory) -> Result<Self> {
        let gpu = device.current_bytes()?;
        let gpu_peak = match gpu {
            Some(_) => Some(device.peak_bytes()?),
            None => None,
        };
        Ok(Self {
            gpu_bytes: gpu,
            gpu_peak_bytes: gpu_peak,
            host_bytes: host_memory::current_bytes(),
            host_peak_bytes: host_memory::peak_bytes(),
        })
    }
}

/// Progress of a run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum TrainEvent {
    /// The loop starts at `start_step` (non-zero after resume) and will stop at `total_steps`.
    Started {
        /// First step to run.
        start_step: u64,
        /// Final step count.
        total_steps: u64,
    },
    /// One optimizer step finished.
    Step {
        /// Steps completed.
        step: u64,
        /// What the step did.
        report: StepReport,
        /// Throughput of this step.
        tokens_per_s: f64,
        /// Memory after the step.
        #[serde(default)]
        memory: MemorySample,
        /// The held-out loss after the step, when it was evaluated.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        eval_loss: Option<f64>,
    },
    /// A checkpoint was written.
    CheckpointSaved {
        /// Steps completed.
        step: u64,
        /// Its directory.
        path: PathBuf,
    },
}

/// Receives [`TrainEvent`]s.
pub trait TrainObserver {
    /// Called for each event, in order.
    fn on_event(&self, event: &TrainEvent);
}

/// Discards events.
pub struct NoObserver;

impl TrainObserver for NoObserver {
    fn on_event(&self, _: &TrainEvent) {}
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunSummary {
    /// Steps completed in total.
    pub steps: u64,
    /// Whether the interrupt flag stopped the run early.
    pub interrupted: bool,
    /// Loss of the last step run in this invocation.
    pub last_loss: Option<f64>,
    /// Last held-out loss.
    pub last_eval_loss: Option<f64>,
    /// Tokens per second over the steps run in this invocation.
    pub tokens_per_s: f64,
    /// Of those, the tokens of examples (not padding) per second.
    #[serde(default)]
    pub real_tokens_per_s: f64,
    /// Steps skipped by f16 loss scaling.
    pub skipped_steps: u64,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// Why the run stopped early because a number stopped being finite, if it did.
    #[serde(default)]
    pub diverged: Option<Divergence>,
}

/// A run stopped because its loss or weights stopped being finite numbers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Divergence {
    /// Steps completed when it was found.
    pub step: u64,
    /// What is not finite ("the loss (NaN)", "parameter `head.weight`").
    pub what: String,
}

/// Trains `trainer` on `data` until `config.total_steps` or until `interrupt` is set, reading
/// `memory` after each step.
pub fn run(
    trainer: &mut Trainer,
    data: &Data,
    data_spec: &DataSpec,
    config: &RunConfig,
    interrupt: &AtomicBool,
    memory: &mut dyn DeviceMemory,
    observer: &dyn TrainObserver,
) -> Result<RunSummary> {
    observer.on_event(&TrainEvent::Started {
        start_step: trainer.steps(),
        total_steps: config.total_steps,
    });
    let tokens_per_step = (trainer.knobs().global_batch() * trainer.model().spec().seq_len) as u64;
    let mut tokens_seen = trainer.steps().saturating_mul(tokens_per_step);
    let mut summary = RunSummary {
        steps: trainer.steps(),
        interrupted: false,
        last_loss: None,
        last_eval_loss: None,
        tokens_per_s: 0.0,
        real_tokens_per_s: 0.0,
        skipped_steps: 0,
        checkpoint: None,
        diverged: None,
    };
    if let Some(name) = checkpoint::first_non_finite(trainer)? {
        summary.diverged = Some(Divergence {
            step: trainer.steps(),
            what: format!("parameter `{name}`"),
        });
        return Ok(summary);
    }
    let started = Instant::now();
    let mut tokens_this_run = 0u64;
    let mut real_tokens_this_run = 0u64;
    let stop = Stop {
        data_spec,
        config,
        observer,
    };
    while trainer.steps() < config.total_steps {
        if trainer.any_rank(interrupt.load(Ordering::SeqCst))? {
            summary.interrupted = true;
            break;
        }
        let stepped = timed_step(trainer, data, memory);
        let (report, tokens_per_s, memory_after) =
            stop.on_data_change(stepped, trainer, tokens_seen)?;
        tokens_seen = tokens_seen.saturating_add(report.tokens as u64);
        tokens_this_run = tokens_this_run.saturating_add(report.tokens as u64);
        real_tokens_this_run = real_tokens_this_run.saturating_add(report.real_tokens as u64);
        summary.last_loss = Some(report.loss);
        let run = Run {
            data,
            data_spec,
            config,
            observer,
        };
        let measured = (tokens_per_s, memory_after);
        let next = run.after_step(trainer, &report, measured, tokens_seen, &mut summary);
        if !stop.on_data_change(next, trainer, tokens_seen)? {
            break;
        }
    }
    summary.steps = trainer.steps();
    summary.skipped_steps = trainer.scaler().skipped_steps;
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    summary.tokens_per_s = tokens_this_run as f64 / seconds;
    summary.real_tokens_per_s = real_tokens_this_run as f64 / seconds;
    if summary.diverged.is_some() {
        return Ok(summary);
    }
    // Always leave a checkpoint of where the run stopped, finished or interrupted.
    match save(trainer, data_spec, config, tokens_seen, observer)? {
        Saved::To(path) => summary.checkpoint = path.or(summary.checkpoint),
        Saved::NotFinite(divergence) => summary.diverged = Some(divergence),
    }
    Ok(summary)
}

/// One step, timed to its end on the device: what it did, its throughput and the memory
/// after it.
fn timed_step(
    trainer: &mut Trainer,
    data: &Data,
    memory: &mut dyn DeviceMemory,
) -> Result<(StepReport, f64, MemorySample)> {
    let t0 = Instant::now();
    let report = trainer.step(data)?;
    trainer.device().synchronize()?;
    let dt = t0.elapsed().as_secs_f64();
    Ok((
        report,
        report.tokens as f64 / dt,
        MemorySample::read(memory)?,
    ))
}

/// What a run does between its steps.
struct Run<'a> {
    data: &'a Data,
    data_spec: &'a DataSpec,
    config: &'a RunConfig,
    observer: &'a dyn TrainObserver,
}

impl Run<'_> {
    /// After a step: evaluate when due, tell the step (with its held-out loss), stop on a loss
    /// that is not finite, checkpoint when due. Whether the run goes on.
    fn after_step(
        &self,
        trainer: &mut Trainer,
        report: &StepReport,
        (tokens_per_s, memory): (f64, MemorySample),
        tokens_seen: u64,
        summary: &mut RunSummary,
    ) -> Result<bool> {
        let step = trainer.steps();
        let config = self.config;
        let due = config.eval_every > 0 && step % config.eval_every == 0;
        let eval_loss = if due && report.loss.is_finite() {
            let loss = eval(trainer, self.data)?;
            summary.last_eval_loss = Some(loss);
            Some(loss)
        } else {
            None
        };
        self.observer.on_event(&TrainEvent::Step {
            step,
            report: *report,
            tokens_per_s,
            memory,
            eval_loss,
        });
        if !report.loss.is_finite() {
            summary.diverged = Some(Divergence {
                step,
                what: format!("the loss ({})", report.loss),
            });
            return Ok(false);
        }
        let due = config.checkpoint_every > 0 && step % config.checkpoint_every == 0;
        if due && step < config.total_steps {
            match save(trainer, self.data_spec, config, tokens_seen, self.observer)? {
                Saved::To(path) => summary.checkpoint = path.or(summary.checkpoint.take()),
                Saved::NotFinite(divergence) => {
                    summary.diverged = Some(divergence);
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

/// The held-out loss: the mean over the counted targets of the batches no training step draws
/// (a dataset's held-out examples, else one batch of the source's).
pub fn eval(trainer: &mut Trainer, data: &Data) -> Result<f64> {
    let micro_batch = trainer.knobs().micro_batch;
    let batches = data.eval_batches(trainer.seed(), micro_batch, trainer.device());
    let batches = trainer.agree_on_data(batches, data)?;
    let (mut total, mut counted) = (0.0, 0.0);
    for batch in &batches {
        let weight = batch.reduction().divisor();
        total += trainer.eval_loss(batch)? * weight;
        counted += weight;
    }
    Ok(total / f64::max(counted, 1.0))
}

/// How a run stops when its data changed under it.
struct Stop<'a> {
    data_spec: &'a DataSpec,
    config: &'a RunConfig,
    observer: &'a dyn TrainObserver,
}

impl Stop<'_> {
    /// `result`; where the data changed under the run, the same error once a checkpoint of the
    /// steps done is saved, so that restoring the file and resuming loses nothing. Every rank
    /// meets the change at the same step ([`Trainer::agree_on_data`]), so they save together.
    fn on_data_change<T>(
        &self,
        result: Result<T>,
        trainer: &mut Trainer,
        tokens_seen: u64,
    ) -> Result<T> {
        let Err(Error::DataChanged { path, problem, .. }) = result else {
            return result;
        };
        let saved = save(
            trainer,
            self.data_spec,
            self.config,
            tokens_seen,
            self.observer,
        )?;
        let checkpoint = match saved {
            Saved::To(path) if trainer.group().world_size() > 1 => {
                // Rank 0 writes the checkpoint. The others wait until it has, because the
                // launcher stops every rank once one exits, and name it as rank 0 does.
                trainer.any_rank(false)?;
                let dir = self.config.checkpoint_dir.as_deref();
                path.or_else(|| dir.map(|d| checkpoint::path_for_step(d, trainer.steps())))
            }
            Saved::To(path) => path,
            Saved::NotFinite(_) => None,
        };
        Err(Error::DataChanged {
            path,
            problem,
            checkpoint,
        })
    }
}

/// What a save did.
enum Saved {
    /// Wrote this checkpoint (`None`: checkpoints are off, or another rank writes them).
    To(Option<PathBuf>),
    /// Wrote nothing: the weights are not finite.
    NotFinite(Divergence),
}

fn save(
    trainer: &mut Trainer,
    data_spec: &DataSpec,
    config: &RunConfig,
    tokens_seen: u64,
    observer: &dyn TrainObserver,
) -> Result<Saved> {
    let Some(dir) = &config.checkpoint_dir else {
        return Ok(Saved::To(None));
    };
    // Every rank looks (their weights are the same), so that all of them stop together.
    if let Some(name) = checkpoint::first_non_finite(trainer)? {
        return Ok(Saved::NotFinite(Divergence {
            step: trainer.steps(),
            what: format!("parameter `{name}`"),
        }));
    }
    let gathered = trainer.gather_optimizer_state()?;
    if !trainer.is_root() {
        return Ok(Saved::To(None));
    }
    let path = checkpoint::save_with_moments(dir, trainer, data_spec, tokens_seen, gathered)?;
    if let Some(keep_last) = config.keep_last {
        crate::train::checkpoint_dir::prune(dir, keep_last, &path)?;
    }
    observer.on_event(&TrainEvent::CheckpointSaved {
        step: trainer.steps(),
        path: path.clone(),
    });
    Ok(Saved::To(Some(path)))
}
