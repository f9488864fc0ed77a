//! Isolated trials: each runs in a child process (`autotune probe-one`). Both halves of the
//! protocol are here: [`ChildProber`], the parent's, and [`serve_one`], the child's.
//!
//! A child guards the search against what an in-process trial cannot survive: a sticky CUDA
//! error that poisons the context, a host allocation failure (Rust aborts), or the kernel's
//! out-of-memory killer. The parent writes one [`TrialJob`] as JSON on the child's stdin and
//! reads one [`TrialResult`] as a JSON line from its stdout; anything else is an outcome too,
//! and so is a child that outlives its time limit
//! ([`TrialTimeout`](super::timeout::TrialTimeout)): it is killed, and the
//! trial is [`Outcome::TimedOut`].

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::job::{TrialJob, TrialProcesses};
use super::lifetime;
use super::live::LiveProber;
use crate::backend;
use crate::collective::rank::{rank_device, RankEnv};
use crate::collective::Collective;
use crate::trial::{MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};
use crate::{Error, Result};

/// Runs trials in child processes of `program probe-one`.
pub struct ChildProber {
    trials: TrialProcesses,
}

impl ChildProber {
    /// A prober that re-executes `trials.program` (normally the running `autotune`) for each
    /// trial.
    pub fn new(trials: TrialProcesses) -> Self {
        Self { trials }
    }
}

impl Prober for ChildProber {
    /// Runs one trial in a fresh child; crashes and kills become outcomes.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        let started = Instant::now();
        let executable = &self.trials.program;
        let spawn_err = |e: std::io::Error| Error::file("cannot start probe child", executable, e);
        let mut command = Command::new(executable);
        lifetime::name_this_process_as_parent(&mut command);
        let mut child = command
            .arg("probe-one")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        let job = serde_json::to_vec(&self.trials.job(request)).expect("jobs always serialise");
        if let Some(mut stdin) = child.stdin.take() {
            // A child that died at once has closed its stdin; its exit tells the story.
            let _ = stdin.write_all(&job);
        }
        let limit = self.trials.timeout.limit(request);
        let Some(output) = wait_within(child, limit).map_err(spawn_err)? else {
            return Ok(TrialResult {
                request: *request,
                outcome: Outcome::TimedOut {
                    after_s: limit.as_secs_f64(),
                },
                wall_s: started.elapsed().as_secs_f64(),
            });
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        if let Some(line) = stdout.lines().rev().find(|l| l.starts_with('{')) {
            if let Ok(result) = serde_json::from_str::<TrialResult>(line) {
                self.trials.timeout.observe(&result);
                return Ok(result);
            }
        }
        let mut last_words = LastWords::default();
        String::from_utf8_lossy(&output.stderr)
            .lines()
            .for_each(|l| last_words.hear(l));
        Ok(TrialResult {
            request: *request,
            outcome: classify_exit(&output.status, last_words.said()),
            wall_s: started.elapsed().as_secs_f64(),
        })
    }
}

/// Waits for `child` to end and collects its output; `None` if it outlived `limit`, in which
/// case it is killed (and reaped).
fn wait_within(
    child: std::process::Child,
    limit: Duration,
) -> std::io::Result<Option<std::process::Output>> {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(output) => {
            let _ = waiter.join();
            output.map(Some)
        }
        Err(_) => {
            // The waiter has not reaped the child yet, so its pid is still the child's.
            kill(pid);
            let _ = waiter.join();
            Ok(None)
        }
    }
}

/// Kills process `pid` (a child not yet waited for).
pub(crate) fn kill(pid: u32) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        // Already gone is fine: it ended on its own just now.
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// The child's side: reads one [`TrialJob`] from `input`, runs it in this process and writes its
/// [`TrialResult`] as one JSON line to `output`. Started as a rank (the rank variables are set),
/// it runs the trial together with the other ranks of a data-parallel trial.
pub fn serve_one(input: impl Read, output: &mut dyn Write) -> Result<()> {
    let job: TrialJob = serde_json::from_reader(input)
        .map_err(|e| Error::file("probe-one: cannot parse the trial job on", "stdin", e))?;
    let rank = RankEnv::from_env()?;
    let setup = &job.setup;
    let device_name = match &rank {
        Some(r) => rank_device(&setup.device, r.rank),
        None => setup.device.clone(),
    };
    let device = backend::open(&device_name)?;
    let memory = backend::memory_meter(&device, setup.gpu_capacity)?;
    let mut prober = LiveProber::new(&setup.model, &device, setup.host_budget, memory);
    if let Some(rank) = &rank {
        prober = prober.with_group(Collective::join(rank, &device)?);
    }
    let result = prober.probe(&job.request)?;
    write_line(output, &result)
}

/// One protocol message as a JSON line, flushed so that the parent reads it at once.
pub(super) fn write_line<T: serde::Serialize>(output: &mut dyn Write, message: &T) -> Result<()> {
    let text = serde_json::to_string(message).expect("protocol messages always serialise");
    writeln!(output, "{text}")
        .and_then(|()| output.flush())
        .map_err(|e| Error::file("cannot write a trial reply to", "stdout", e))
}

/// What a trial process that died said last, heard line by line from its stderr: its error
/// line if it printed one (the causes and any backtrace after it do not say what went wrong,
/// and an out-of-memory is recognised by that line), else its last non-empty line.
#[derive(Debug, Default)]
pub(crate) struct LastWords {
    line: String,
    is_error: bool,
}

impl LastWords {
    /// One more line of the process's stderr.
    pub(crate) fn hear(&mut self, line: &str) {
        if self.is_error || line.trim().is_empty() {
            return;
        }
        self.is_error = line.starts_with("error:");
        self.line = line.to_string();
    }

    /// The line that says why the process ended.
    pub(crate) fn said(&self) -> String {
        self.line.clone()
    }
}

/// A child that died without a result: the OOM killer's SIGKILL and allocation aborts are host
/// out-of-memory; anything else is a crash with the child's last words.
pub(crate) fn classify_exit(status: &std::process::ExitStatus, last_line: String) -> Outcome {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if status.signal() == Some(9) || last_line.contains("memory allocation of") {
            return Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                phase: Phase::ForwardBackward,
            };
        }
    }
    if super::oom::names_out_of_memory_status(&last_line) {
        return Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward,
        };
    }
    Outcome::Crashed {
        reason: format!("probe child exited with {status}: {last_line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_childs_last_words_are_its_error_line_else_its_last_line() {
        use std::os::unix::process::ExitStatusExt;
        let heard = |lines: &[&str]| {
            let mut words = LastWords::default();
            lines.iter().for_each(|l| words.hear(l));
            words.said()
        };
        let error = "error: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";
        let cases: [(&[&str], &str); 5] = [
            (&[], ""),
            (&["loading", "step 1", "  ", ""], "step 1"),
            (
                &["loading", error, "   0: <unknown>", "  15: <unknown>", ""],
                error,
            ),
            (&[error, "  caused by: the pool", "error: later"], error),
            (
                &["memory allocation of 1024 bytes failed"],
                "memory allocation of 1024 bytes failed",
            ),
        ];
        for (lines, said) in cases {
            assert_eq!(heard(lines), said, "{lines:?}");
        }
        let failed = std::process::ExitStatus::from_raw(2 << 8);
        assert!(matches!(
            classify_exit(
                &failed,
                heard(&[error, "   0: <unknown>", "  15: <unknown>"])
            ),
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                ..
            }
        ));
    }

    #[test]
    fn a_dead_childs_words_mean_out_of_memory_only_when_they_name_the_status() {
        use std::os::unix::process::ExitStatusExt;
        let failed = std::process::ExitStatus::from_raw(2 << 8);
        let said = |line: &str| classify_exit(&failed, line.to_string());
        assert!(matches!(
            said("error: data `out of memory.txt`: empty"),
            Outcome::Crashed { .. }
        ));
        assert!(matches!(
            said("error: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"),
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                ..
            }
        ));
        assert!(matches!(
            said("memory allocation of 1099511627776 bytes failed"),
            Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                ..
            }
        ));
    }
}
