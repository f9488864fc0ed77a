//! Data-parallel `autotune train`: the launcher's side (start the ranks, draw rank 0's progress,
//! map how they ended to an exit code) and a rank's side (train as one rank, report on stdout).

use std::ffi::OsString;

use autotune::backend::host_memory;
use autotune::collective::{Collective, RankEnv};
use autotune::dist::launch::{self, Launch, LaunchEvent, RankExit, RankFailure, RankInput};
use autotune::dist::protocol::RankMessage;
use autotune::train::metrics::MetricsLog;
use autotune::train::run::{self, RunSummary, TrainEvent, TrainObserver};

use super::printer::Printer;
use super::reporters::bytes;
use super::train::{interrupt_flag, report, Job, Progress};
use super::Status;

/// A data-parallel run to launch: `degree` copies of this executable with `args`.
pub struct Launched<'a> {
    pub args: Vec<OsString>,
    pub degree: usize,
    /// `cpu`, `cuda` or `auto`, as the ranks get it.
    pub device: &'a str,
    pub total_steps: u64,
    /// Where rank 0's per-step metrics go, if anywhere.
    pub metrics: Option<&'a std::path::Path>,
}

impl Launched<'_> {
    /// Runs the ranks to the end; rank 0's summary, or an error naming the rank that failed.
    pub fn run(self, printer: &Printer) -> anyhow::Result<RunSummary> {
        let cuda = match self.device {
            "cpu" => false,
            "auto" => autotune::backend::cuda_device_count() > 0,
            _ => true,
        };
        let rendezvous = launch::rendezvous_for(cuda)?;
        let backend = match rendezvous {
            autotune::collective::Rendezvous::Tcp(_) => "tcp",
            autotune::collective::Rendezvous::Nccl(_) => "nccl",
        };
        printer.status(format!(
            "data parallel: {} ranks on {}, {backend} collectives",
            self.degree,
            if cuda { "cuda:0.." } else { "the cpu" },
        ));
        let program = std::env::current_exe()
            .map_err(|e| anyhow::anyhow!("cannot locate the autotune executable: {e}"))?;
        let spec = Launch {
            program,
            args: self.args,
            world_size: self.degree,
            rendezvous,
            input: RankInput::Interrupts,
            grace_after_exit: None,
            deadline: None,
        };
        let interrupt = interrupt_flag(printer);
        let metrics = self.metrics.map(MetricsLog::new).transpose()?;
        let progress = Progress::new(printer, self.total_steps, metrics);
        let mut summaries: Vec<Option<RunSummary>> = vec![None; self.degree];
        let outcome = launch::run(&spec, &interrupt, &mut |event| {
            relay(event, &progress, printer, &mut summaries)
        })?;
        progress.bar.finish_and_clear();
        let interrupted = interrupt.load(std::sync::atomic::Ordering::SeqCst);
        if let Some(failure) = &outcome.failure {
            return Err(failed(failure, &outcome.exits, interrupted));
        }
        let summary = agreed_summary(&summaries)?;
        report(printer, &summary);
        Ok(summary)
    }
}

/// What the launcher shows of a rank's event: rank 0's progress, every rank's log lines; and
/// each rank's final summary, kept for [`agreed_summary`].
fn relay(
    event: LaunchEvent,
    progress: &Progress,
    printer: &Printer,
    summaries: &mut [Option<RunSummary>],
) {
    match event {
        LaunchEvent::Started { rank, pid } => progress
            .bar
            .suspend(|| printer.status(format!("rank {rank}: started, pid {pid}"))),
        LaunchEvent::Output { rank, line } => match RankMessage::parse(&line) {
            Some(RankMessage::Train(event)) if rank == 0 => progress.on_event(&event),
            Some(RankMessage::Finished(summary)) => summaries[rank] = Some(summary),
            _ => {}
        },
        LaunchEvent::Log { rank, line } => progress
            .bar
            .suspend(|| printer.status(format!("rank {rank}: {line}"))),
        LaunchEvent::Exited { .. } => {}
    }
}

/// The error of a launch in which a rank failed; a second Ctrl-C, which ends the ranks at once
/// (exit 130), is an interruption.
fn failed(failure: &RankFailure, exits: &[RankExit], interrupted: bool) -> anyhow::Error {
    let all_stopped_by_hand = interrupted
        && exits
            .iter()
            .all(|e| matches!(e, RankExit::Code(0 | 130) | RankExit::Stopped));
    if all_stopped_by_hand {
        return anyhow::anyhow!("interrupted before the ranks could save a checkpoint");
    }
    anyhow::anyhow!(
        "data-parallel training failed: {failure}; the other ranks were stopped{}",
        hint(failure.exit)
    )
}

/// Rank 0's summary, once every rank ended at the same step with the same loss.
fn agreed_summary(summaries: &[Option<RunSummary>]) -> anyhow::Result<RunSummary> {
    let summary = summaries[0].clone().ok_or_else(|| {
        anyhow::anyhow!("data-parallel training: rank 0 ended without reporting its summary")
    })?;
    for (rank, other) in summaries.iter().enumerate().skip(1) {
        let same = other
            .as_ref()
            .map(|s| (s.steps, s.last_loss.map(f64::to_bits)))
            == Some((summary.steps, summary.last_loss.map(f64::to_bits)));
        if !same {
            anyhow::bail!(
                "data-parallel training: rank {rank} ended at {:?} while rank 0 ended at step {} with loss {:?}; the ranks diverged",
                other.as_ref().map(|s| (s.steps, s.last_loss)),
                summary.steps,
                summary.last_loss
            );
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

/// Trains as one rank of a launched group: progress (rank 0) and the summary (every rank) go to
/// the launcher as JSON lines on stdout; nothing else is printed there.
pub fn run_rank(mut job: Job, env: RankEnv) -> anyhow::Result<Status> {
    if job.knobs.data_parallel.degree != env.world_size {
        anyhow::bail!(
            "this process is rank {} of {}, but its knobs ask for --data-parallel {}",
            env.rank,
            env.world_size,
            job.knobs.data_parallel.degree
        );
    }
    let printer = Printer::new(true, false, true);
    let group = Collective::join(&env, &job.device)?;
    let (data_spec, data, mut trainer) = job.prepare(group)?;
    let interrupt = interrupt_flag(&printer);
    launch::watch_launcher(interrupt.clone());
    let observer = ToLauncher {
        root: env.rank == 0,
        printer,
    };
    let summary = run::run(
        &mut trainer,
        &data,
        &data_spec,
        &job.config,
        &interrupt,
        &mut *job.meter,
        &observer,
    )?;
    if let Some(limit) = job.host_limit {
        if host_memory::is_counting() && host_memory::limit_exceeded() {
            anyhow::bail!(
                "rank {} reached {} of host heap, over its share {} of the plan's host budget; re-tune with a larger --headroom",
                env.rank,
                bytes(host_memory::peak_bytes()),
                bytes(limit)
            );
        }
    }
    printer.data_json_line(&RankMessage::Finished(summary));
    // An interrupted run that saved its checkpoint ended as asked; the launcher reads
    // `interrupted` from the summary and exits 130 itself.
    Ok(Status::Success)
}

/// Sends rank 0's events to the launcher.
struct ToLauncher {
    root: bool,
    printer: Printer,
}

impl TrainObserver for ToLauncher {
    fn on_event(&self, event: &TrainEvent) {
        if self.root {
            self.printer
                .data_json_line(&RankMessage::Train(event.clone()));
        }
    }
}
