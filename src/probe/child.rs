//! Isolated trials: each runs in a child process (`autotune probe-one`). Both halves of the
//! protocol are here: [`ChildProber`], the parent's, and [`serve_one`], the child's.
//!
//! A child guards the search against what an in-process trial cannot survive: a sticky CUDA
//! error that poisons the context, a host allocation failure (Rust aborts), or the kernel's
//! out-of-memory killer. The parent writes one [`TrialJob`] as JSON on the child's stdin and
//! reads one [`TrialResult`] as a JSON line from its stdout; anything else is an outcome too.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use super::job::TrialJob;
use super::live::LiveProber;
use crate::backend;
use crate::collective::rank::{rank_device, RankEnv};
use crate::collective::Collective;
use crate::spec::model::ModelSpec;
use crate::trial::{MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};
use crate::{Error, Result};

/// Runs trials in child processes of `executable probe-one`.
pub struct ChildProber {
    executable: PathBuf,
    job: TrialJob,
}

impl ChildProber {
    /// A prober that re-executes `executable` (normally the running `autotune`).
    pub fn new(
        executable: PathBuf,
        model: &ModelSpec,
        device: &str,
        gpu_capacity: Option<u64>,
        host_budget: Option<u64>,
    ) -> Self {
        Self {
            executable,
            job: TrialJob::new(model, device, gpu_capacity, host_budget),
        }
    }
}

impl Prober for ChildProber {
    /// Runs one trial in a fresh child; crashes and kills become outcomes.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        let started = Instant::now();
        self.job.request = *request;
        let spawn_err =
            |e: std::io::Error| Error::file("cannot start probe child", &self.executable, e);
        let mut child = Command::new(&self.executable)
            .arg("probe-one")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        let job = serde_json::to_vec(&self.job).expect("jobs always serialise");
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(&job).map_err(spawn_err)?;
        }
        let output = child.wait_with_output().map_err(spawn_err)?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if let Some(line) = stdout.lines().rev().find(|l| l.starts_with('{')) {
            if let Ok(result) = serde_json::from_str::<TrialResult>(line) {
                return Ok(result);
            }
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last_line = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .to_string();
        Ok(TrialResult {
            request: *request,
            outcome: classify_exit(&output.status, last_line),
            wall_s: started.elapsed().as_secs_f64(),
        })
    }
}

/// The child's side: reads one [`TrialJob`] from `input`, runs it in this process and writes its
/// [`TrialResult`] as one JSON line to `output`. Started as a rank (the rank variables are set),
/// it runs the trial together with the other ranks of a data-parallel trial.
pub fn serve_one(input: impl Read, output: &mut dyn Write) -> Result<()> {
    let job: TrialJob = serde_json::from_reader(input)
        .map_err(|e| Error::file("probe-one: cannot parse the trial job on", "stdin", e))?;
    let rank = RankEnv::from_env()?;
    let device_name = match &rank {
        Some(r) => rank_device(&job.device, r.rank),
        None => job.device.clone(),
    };
    let device = backend::open(&device_name)?;
    let memory = backend::memory_meter(&device, job.gpu_capacity)?;
    let mut prober = LiveProber::new(&job.model, &device, job.host_budget, memory);
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
    if super::live::is_out_of_memory_text(&last_line) {
        return Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward,
        };
    }
    Outcome::Crashed {
        reason: format!("probe child exited with {status}: {last_line}"),
    }
}
