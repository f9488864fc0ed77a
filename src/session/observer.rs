//! What a session tells the people watching it: the training loop's [`TrainEvent`]s, and
//! [`Notice`]s about everything around them (what trains where, a data-parallel launch, files
//! cleaned up). The binary renders both; the library never prints.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use crate::data::dataset::Cut;
use crate::data::load::LoadEvent;
use crate::knobs::Knobs;
use crate::train::metrics::{MetricsLog, StepLine};
use crate::train::run::{TrainEvent, TrainObserver};
use crate::train::schedule::LrSchedule;

/// Something a session did or found beside training steps, for people.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// Training starts in this process.
    Training {
        /// The model's name.
        model: String,
        /// Its parameters.
        parameters: usize,
        /// The device, as people know it.
        device: String,
        /// The knobs it trains with.
        knobs: Knobs,
        /// The data, as given.
        data: String,
        /// The model's learning rate.
        lr: f64,
        /// The rate's schedule over the run.
        schedule: LrSchedule,
    },
    /// Temporary files that an interrupted save left in a checkpoint directory were removed.
    SweptTemporaries {
        /// How many.
        count: usize,
        /// The directory.
        dir: PathBuf,
    },
    /// `--overwrite` removed the checkpoints of an earlier run.
    Overwrote {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A data-parallel run launches its ranks.
    Launching {
        /// How many ranks.
        ranks: usize,
        /// Whether they run on GPUs (`cuda:0..`) or CPU processes.
        cuda: bool,
        /// The collectives they sum over (`tcp`, `nccl`).
        backend: &'static str,
    },
    /// A rank's process started.
    RankStarted {
        /// The rank.
        rank: usize,
        /// Its process id.
        pid: u32,
    },
    /// A line a rank wrote to its stderr.
    RankLog {
        /// The rank.
        rank: usize,
        /// The line.
        line: String,
    },
    /// The metrics log could not be written; training goes on without it.
    MetricsDropped {
        /// The log's file.
        path: PathBuf,
        /// Why.
        problem: String,
    },
    /// Loading a dataset: tokenizing it, or mapping it from the token cache.
    Loading(LoadEvent),
    /// The run trains with a plan tuned on other data, as `--allow-data-mismatch` allows.
    PlanDataDiffers {
        /// How the data differs, in a sentence's words.
        what: String,
    },
    /// A dataset's examples are ready: how many were kept, cut and dropped, and their tokens.
    Examples(Cut),
    /// A run directory is resumed with its own plan.
    ResumingRun {
        /// The run directory.
        dir: PathBuf,
    },
}

/// Receives a session's events: the training loop's and the notices around it.
pub trait SessionObserver: TrainObserver {
    /// Called for each notice, in order.
    fn notice(&self, notice: Notice);
}

/// Writes each step to the per-step metrics log, then passes every event on to `inner`. A
/// log that cannot be written is dropped with a notice: training matters more than its log.
pub struct MetricsRecorder<'a> {
    log: RefCell<Option<MetricsLog>>,
    inner: &'a dyn SessionObserver,
}

impl<'a> MetricsRecorder<'a> {
    /// Records into `log` (none: only passes events on) for `inner`.
    pub fn new(log: Option<MetricsLog>, inner: &'a dyn SessionObserver) -> Self {
        Self {
            log: RefCell::new(log),
            inner,
        }
    }

    /// The log at `path`, checked writable now (a run must not fail at its first step for a
    /// typo in a path).
    pub fn open(path: Option<&Path>) -> crate::Result<Option<MetricsLog>> {
        path.map(MetricsLog::new).transpose()
    }

    fn record(&self, event: &TrainEvent) {
        let mut log = self.log.borrow_mut();
        let Some(metrics) = log.as_mut() else {
            return;
        };
        let written = match event {
            TrainEvent::Started { start_step, .. } => metrics.start(*start_step),
            TrainEvent::Step {
                step,
                report,
                tokens_per_s,
                memory,
                eval_loss,
            } => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let line = StepLine::new(*step, report, *tokens_per_s, memory, now);
                metrics.write(&line.with_eval(*eval_loss))
            }
            TrainEvent::CheckpointSaved { .. } => Ok(()),
        };
        if let Err(e) = written {
            let path = metrics.path().to_path_buf();
            *log = None;
            drop(log);
            self.inner.notice(Notice::MetricsDropped {
                path,
                problem: e.to_string(),
            });
        }
    }
}

impl TrainObserver for MetricsRecorder<'_> {
    fn on_event(&self, event: &TrainEvent) {
        self.record(event);
        self.inner.on_event(event);
    }
}

impl SessionObserver for MetricsRecorder<'_> {
    fn notice(&self, notice: Notice) {
        self.inner.notice(notice);
    }
}
