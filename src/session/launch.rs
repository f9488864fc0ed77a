//! The launcher of a data-parallel training run: starts its ranks (copies of this executable),
//! passes rank 0's progress and every rank's log lines on, and turns how the ranks ended into
//! the run's summary or an error naming the rank that failed.

use std::ffi::OsString;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::observer::{MetricsRecorder, Notice, SessionObserver};
use crate::dist::launch::{self, Launch, LaunchEvent, RankExit, RankFailure, RankInput};
use crate::dist::protocol::RankMessage;
use crate::train::run::RunSummary;
use crate::{Error, Result};

/// A data-parallel run to launch: `degree` copies of this executable with `args`.
pub struct Launched<'a> {
    /// The `autotune` arguments every rank gets.
    pub args: Vec<OsString>,
    /// How many ranks.
    pub degree: usize,
    /// `cpu`, `cuda` or `auto`, as the ranks get it.
    pub device: &'a str,
    /// The run's last step, for its progress.
    pub total_steps: u64,
    /// Where rank 0's per-step metrics go, if anywhere.
    pub metrics: Option<&'a Path>,
}

impl Launched<'_> {
    /// Runs the ranks to the end; rank 0's summary, or an error naming the rank that failed.
    pub fn run(self, observer: &dyn SessionObserver, interrupt: &AtomicBool) -> Result<RunSummary> {
        let cuda = match self.device {
            "cpu" => false,
            "auto" => crate::backend::cuda_device_count() > 0,
            _ => true,
        };
        let rendezvous = launch::rendezvous_for(cuda)?;
        let backend = match rendezvous {
            crate::collective::Rendezvous::Tcp(_) => "tcp",
            crate::collective::Rendezvous::Nccl(_) => "nccl",
        };
        observer.notice(Notice::Launching {
            ranks: self.degree,
            cuda,
            backend,
        });
        let program = std::env::current_exe()
            .map_err(|e| Error::Usage(format!("cannot locate the autotune executable: {e}")))?;
        let spec = Launch {
            program,
            args: self.args,
            world_size: self.degree,
            rendezvous,
            input: RankInput::Interrupts,
            grace_after_exit: None,
            deadline: None,
        };
        let metrics = MetricsRecorder::open(self.metrics)?;
        let recorder = MetricsRecorder::new(metrics, observer);
        let mut summaries: Vec<Option<RunSummary>> = vec![None; self.degree];
        let outcome = launch::run(&spec, interrupt, &mut |event| {
            relay(event, &recorder, &mut summaries)
        })?;
        let interrupted = interrupt.load(Ordering::SeqCst);
        if let Some(failure) = &outcome.failure {
            return Err(failed(failure, &outcome.exits, interrupted));
        }
        agreed_summary(&summaries)
    }
}

/// What the launcher passes on of a rank's event: rank 0's progress, every rank's log lines;
/// and each rank's final summary, kept for [`agreed_summary`].
fn relay(event: LaunchEvent, observer: &dyn SessionObserver, summaries: &mut [Option<RunSummary>]) {
    match event {
        LaunchEvent::Started { rank, pid } => observer.notice(Notice::RankStarted { rank, pid }),
        LaunchEvent::Output { rank, line } => match RankMessage::parse(&line) {
            Some(RankMessage::Train(event)) if rank == 0 => observer.on_event(&event),
            Some(RankMessage::Finished(summary)) => summaries[rank] = Some(summary),
            _ => {}
        },
        LaunchEvent::Log { rank, line } => observer.notice(Notice::RankLog { rank, line }),
        LaunchEvent::Exited { .. } => {}
    }
}

/// The error of a launch in which a rank failed; a second Ctrl-C, which ends the ranks at once
/// (exit 130), is an interruption.
fn failed(failure: &RankFailure, exits: &[RankExit], interrupted: bool) -> Error {
    let all_stopped_by_hand = interrupted
        && exits
            .iter()
            .all(|e| matches!(e, RankExit::Code(0 | 130) | RankExit::Stopped));
    if all_stopped_by_hand {
        return Error::Usage("interrupted before the ranks could save a checkpoint".into());
    }
    Error::Usage(format!(
        "data-parallel training failed: {failure}; the other ranks were stopped{}",
        hint(failure.exit)
    ))
}

/// Rank 0's summary, once every rank ended at the same step with the same loss.
fn agreed_summary(summaries: &[Option<RunSummary>]) -> Result<RunSummary> {
    let summary = summaries[0].clone().ok_or_else(|| {
        Error::Usage("data-parallel training: rank 0 ended without reporting its summary".into())
    })?;
    for (rank, other) in summaries.iter().enumerate().skip(1) {
        let same = other
            .as_ref()
            .map(|s| (s.steps, s.last_loss.map(f64::to_bits)))
            == Some((summary.steps, summary.last_loss.map(f64::to_bits)));
        if !same {
            return Err(Error::Usage(format!(
                "data-parallel training: rank {rank} ended at {:?} while rank 0 ended at step {} with loss {:?}; the ranks diverged",
                other.as_ref().map(|s| (s.steps, s.last_loss)),
                summary.steps,
                summary.last_loss
            )));
        }
    }
    Ok(summary)
}

fn hint(exit: RankExit) -> &'static str {
    match exit {
        RankExit::Signal(9) => {
            " (hint: all ranks share the host's memory; fewer ranks or --offload none need less)"
        }
        _ => "",
    }
}
