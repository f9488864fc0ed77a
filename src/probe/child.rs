//! Isolated probes: each trial runs in a child process (`autotune probe-one`).
//!
//! A child guards the search against what an in-process trial cannot survive: a sticky CUDA
//! error that poisons the context, a host allocation failure (Rust aborts), or the kernel's
//! out-of-memory killer. The parent writes one [`ChildJob`] as JSON on the child's stdin and
//! reads one [`ProbeResult`] as a JSON line from its stdout; anything else is an outcome too.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::probe::outcome::{MemoryKind, Outcome, Phase, ProbeRequest, ProbeResult};
use crate::spec::model::ModelSpec;
use crate::{Error, Result};

/// Everything a child needs to run one trial.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildJob {
    /// The model.
    pub model: ModelSpec,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: String,
    /// Emulated GPU capacity in bytes.
    pub gpu_capacity: Option<u64>,
    /// Host heap budget in bytes.
    pub host_budget: Option<u64>,
    /// The trial.
    pub request: ProbeRequest,
}

impl ChildJob {
    /// The job for trials of `model` on `device`; each trial sets its own `request`.
    pub fn new(
        model: &ModelSpec,
        device: &str,
        gpu_capacity: Option<u64>,
        host_budget: Option<u64>,
    ) -> Self {
        Self {
            model: model.clone(),
            device: device.to_string(),
            gpu_capacity,
            host_budget,
            request: ProbeRequest {
                knobs: crate::Knobs::new(1, crate::Precision::Fp32),
                warmup_steps: 0,
                timed_steps: 0,
            },
        }
    }
}

/// Runs trials in child processes of `executable probe-one`.
pub struct ChildProber {
    executable: PathBuf,
    job: ChildJob,
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
            job: ChildJob::new(model, device, gpu_capacity, host_budget),
        }
    }

    /// Runs one trial in a fresh child; crashes and kills become outcomes.
    pub fn probe(&mut self, request: &ProbeRequest) -> Result<ProbeResult> {
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
            if let Ok(result) = serde_json::from_str::<ProbeResult>(line) {
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
        Ok(ProbeResult {
            request: *request,
            outcome: classify_exit(&output.status, last_line),
            wall_s: started.elapsed().as_secs_f64(),
        })
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
