//! Trials in a long-lived child process (`autotune probe-serve`), replaced when it is not clean.
//! Both halves of the protocol are here: [`WorkerProber`], the parent's, and [`serve`], the
//! worker's.
//!
//! A fresh child per trial ([`super::child`]) pays a process start, a CUDA context, cuBLAS
//! handles and module loads every time: about half a second per trial on an H200, more than
//! the steps of most trials. A worker pays them once and runs trial after trial, while the
//! parent still opens no device and survives whatever kills the worker.
//!
//! What makes a worker's trial measure what a fresh process would: each trial starts from an
//! empty device memory pool (the prober trims it before resetting the high-water marks), and
//! after each trial the worker reports the bytes its pool still holds once trimmed. A worker is
//! retired, and the next trial starts a new one, after any trial that
//!
//! - left device memory behind (a tensor that outlived its trial would sit in the next
//!   trial's pool and shift its peak), or
//! - crashed (the worker is gone, or its context may be poisoned).
//!
//! A trial that outlives its time limit ([`TrialTimeout`](super::timeout::TrialTimeout)) is [`Outcome::TimedOut`]: the worker
//! is killed (it may be stuck in a kernel or a collective) and the next trial starts a new one.
//!
//! An out-of-memory is neither: CUDA reports it as an ordinary error, everything the trial
//! held is dropped, and on an H200 the pool was empty at the start of every trial after one,
//! with the same memory outside the pool (`benches/results/2026-12-03-h200-worker-trials/`).
//!
//! Protocol: the parent writes one [`TrialJob`] per line on the worker's stdin (the same model,
//! device and budgets every time, only the request changes) and reads one [`WorkerReply`] per
//! line from its stdout. End of input ends the worker.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::child::{classify_exit, write_line, LastWords};
use super::job::{TrialJob, TrialProcesses};
use super::lifetime;
use super::live::LiveProber;
use crate::backend;
use crate::trial::{Outcome, Prober, TrialRequest, TrialResult};
use crate::{Error, Result};

/// A worker's answer to one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerReply {
    /// The trial.
    pub result: TrialResult,
    /// Device bytes the worker's memory pool still held after the trial, once trimmed; 0 when
    /// the next trial starts as in a fresh process.
    pub leftover_device_bytes: u64,
}

impl WorkerReply {
    /// Whether the worker may run the next trial (see the module docs).
    pub fn worker_stays(&self) -> bool {
        self.leftover_device_bytes == 0
            && !matches!(
                self.result.outcome,
                Outcome::Crashed { .. } | Outcome::TimedOut { .. }
            )
    }
}

/// Runs trials in a long-lived child of `program probe-serve`.
pub struct WorkerProber {
    trials: TrialProcesses,
    worker: Option<Worker>,
    started: usize,
}

impl WorkerProber {
    /// A prober that starts `trials.program` (normally the running `autotune`) as its worker.
    pub fn new(trials: TrialProcesses) -> Self {
        Self {
            trials,
            worker: None,
            started: 0,
        }
    }

    /// Workers started so far.
    pub fn workers_started(&self) -> usize {
        self.started
    }
}

impl Prober for WorkerProber {
    /// Runs one trial in the worker, starting one if none is alive; crashes and kills become
    /// outcomes.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        let line = serde_json::to_string(&self.trials.job(request)).expect("jobs always serialise");
        if self.worker.is_none() {
            self.worker = Some(Worker::start(&self.trials.program)?);
            self.started += 1;
        }
        let Some(worker) = self.worker.as_mut() else {
            return Err(Error::internal("the probe worker is missing after its start").into());
        };
        let started = Instant::now();
        let limit = self.trials.timeout.limit(request);
        match worker.ask(&line, limit) {
            Answer::Reply(reply) => {
                self.trials.timeout.observe(&reply.result);
                if !reply.worker_stays() {
                    tracing::debug!(
                        leftover = reply.leftover_device_bytes,
                        "retiring the probe worker"
                    );
                    if let Some(worker) = self.worker.take() {
                        worker.retire();
                    }
                }
                Ok(reply.result)
            }
            Answer::Gone => {
                let outcome = match self.worker.take() {
                    Some(worker) => worker.died(),
                    None => Outcome::Crashed {
                        reason: "the probe worker is gone".into(),
                    },
                };
                Ok(TrialResult {
                    request: *request,
                    outcome,
                    wall_s: started.elapsed().as_secs_f64(),
                })
            }
            Answer::TimedOut => {
                tracing::debug!(
                    limit_s = limit.as_secs_f64(),
                    "killing a probe worker that timed out"
                );
                if let Some(worker) = self.worker.take() {
                    worker.kill();
                }
                Ok(TrialResult {
                    request: *request,
                    outcome: Outcome::TimedOut {
                        after_s: limit.as_secs_f64(),
                    },
                    wall_s: started.elapsed().as_secs_f64(),
                })
            }
        }
    }
}

impl Drop for WorkerProber {
    fn drop(&mut self) {
        tracing::debug!(workers = self.started, "probe workers started");
        if let Some(worker) = self.worker.take() {
            worker.retire();
        }
    }
}

/// What a worker did with a job.
enum Answer {
    /// It replied.
    Reply(WorkerReply),
    /// It is gone, or answered nonsense.
    Gone,
    /// It did not reply within the limit.
    TimedOut,
}

/// One running worker process.
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    /// The worker's stdout lines, read by a thread so that a reply can be waited for with a
    /// time limit.
    stdout: Receiver<String>,
    /// What the worker wrote on stderr that says why, if it dies.
    last_words: Arc<Mutex<LastWords>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl Worker {
    fn start(executable: &std::path::Path) -> Result<Self> {
        let mut command = Command::new(executable);
        command.arg("probe-serve");
        lifetime::name_this_process_as_parent(&mut command);
        // The worker's trial phases join this process's log when it logs them.
        let forward = tracing::enabled!(tracing::Level::DEBUG);
        if forward {
            command.arg("-v");
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::file("cannot start the probe worker", executable, e))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(Error::internal(
                "the probe worker started without its pipes".to_string(),
            ));
        };
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // The worker's stderr is drained all along, so that its logging never blocks it.
        let last_words = Arc::new(Mutex::new(LastWords::default()));
        let sink = Arc::clone(&last_words);
        let stderr_reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                if forward {
                    tracing::debug!("worker: {line}");
                }
                if let Ok(mut last) = sink.lock() {
                    last.hear(&line);
                }
            }
        });
        Ok(Self {
            child,
            stdin: Some(stdin),
            stdout: lines,
            last_words,
            stderr_reader: Some(stderr_reader),
        })
    }

    /// Sends one job and waits up to `limit` for the reply.
    fn ask(&mut self, job_line: &str, limit: Duration) -> Answer {
        let Some(stdin) = self.stdin.as_mut() else {
            return Answer::Gone;
        };
        let sent = stdin
            .write_all(job_line.as_bytes())
            .and_then(|()| stdin.write_all(b"\n"))
            .and_then(|()| stdin.flush());
        if sent.is_err() {
            return Answer::Gone;
        }
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                // Anything else a library might print on stdout is skipped; a reply is one object.
                Ok(line) if line.starts_with('{') => {
                    return match serde_json::from_str(line.trim_end()) {
                        Ok(reply) => Answer::Reply(reply),
                        Err(_) => Answer::Gone,
                    };
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => return Answer::TimedOut,
                Err(RecvTimeoutError::Disconnected) => return Answer::Gone,
            }
        }
    }

    /// Kills a worker stuck in a trial, and reaps it.
    fn kill(mut self) {
        drop(self.stdin.take());
        // Already gone is fine: it ended on its own just now.
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_stderr();
    }

    /// Ends the worker (end of its input) and waits for it.
    fn retire(mut self) {
        drop(self.stdin.take());
        // The worker exits at the end of its input; how it exits tells nothing more.
        let _ = self.child.wait();
        self.join_stderr();
    }

    /// The outcome of a trial whose worker stopped answering.
    fn died(mut self) -> Outcome {
        drop(self.stdin.take());
        let status = match self.child.wait() {
            Ok(status) => status,
            Err(e) => {
                return Outcome::Crashed {
                    reason: format!("the probe worker could not be waited for: {e}"),
                }
            }
        };
        self.join_stderr();
        let last_words = self
            .last_words
            .lock()
            .map(|words| words.said())
            .unwrap_or_default();
        classify_exit(&status, last_words)
    }

    fn join_stderr(&mut self) {
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
    }
}

/// The worker's side: jobs one per line on `input`, each answered by one [`WorkerReply`] line
/// on `output`, until the input ends. Every job must describe the same model, device and
/// budgets as the first (the device and its emulated capacity are set up once).
pub fn serve(input: impl BufRead, output: &mut dyn Write) -> Result<()> {
    let mut lines = input.lines();
    let parse = |line: std::io::Result<String>| -> Result<TrialJob> {
        let line = line.map_err(|e| Error::file("probe-serve: cannot read", "stdin", e))?;
        serde_json::from_str(&line)
            .map_err(|e| Error::file("probe-serve: cannot parse a trial job on", "stdin", e))
    };
    let Some(first) = lines.next() else {
        return Ok(());
    };
    let first = parse(first)?;
    let setup = &first.setup;
    let device = backend::open(&setup.device)?;
    let memory = backend::memory_meter(&device, setup.gpu_capacity)?;
    let mut prober = LiveProber::new(&setup.model, &device, setup.host_budget, memory);
    let mut job = first.clone();
    loop {
        if job.setup != first.setup {
            return Err(Error::invalid(
                "probe-serve job",
                "setup",
                "must be the first job's: a worker serves one setup",
            ));
        }
        let result = prober.probe(&job.request)?;
        let leftover_device_bytes = prober.leftover_device_bytes()?;
        write_line(
            output,
            &WorkerReply {
                result,
                leftover_device_bytes,
            },
        )?;
        match lines.next() {
            Some(line) => job = parse(line)?,
            None => return Ok(()),
        }
    }
}
