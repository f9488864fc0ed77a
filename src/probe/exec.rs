//! Trials run by any program that speaks the trial protocol (`tune --backend exec -- CMD`):
//! the prober that asks a trial runner, and reads whatever it does as an outcome.
//!
//! Each trial is one [`RunnerRequest`] line to a runner process ([`super::runner`]) and one
//! reply. A runner that says it can serve again (`"reusable": true`) gets the next trial in
//! the same process, unless every trial is to start a fresh one; otherwise, and after any trial
//! that crashed, timed out or answered nonsense, the next trial starts a new runner. What a
//! runner does besides replying is an outcome, so the search goes on:
//!
//! | the runner | the outcome |
//! |---|---|
//! | replies `fits`, `out_of_memory` | that |
//! | replies `error` | crashed (infeasible) with its reason |
//! | replies `unsupported` | crashed, and so is every later trial of that regime, without a run |
//! | replies with fields that are wrong | crashed, naming the field |
//! | exits without a reply, killed by SIGKILL (the kernel's out-of-memory killer) | out of host memory |
//! | exits without a reply, its last words naming a CUDA out-of-memory status | out of GPU memory |
//! | exits without a reply otherwise (crash, garbage on stdout) | crashed, with its last words |
//! | replies nothing within the trial's time limit ([`TrialTimeout`](super::timeout::TrialTimeout)) | timed out; it is killed |
//!
//! Every request has an id of its own, which a reply of protocol 2 echoes: a reply to another
//! request is skipped, never taken for this trial's. A runner that wrote a reply nobody asked
//! for (the same reply twice) gets no further trial: its next reply could be the stale one.
//!
//! Some things are errors that end the search, because every trial would fail alike: a runner
//! that cannot be started at all, one that speaks another protocol version, and one that has
//! never replied while [`MAX_SILENT_TIMEOUTS`] trials timed out (each costs the whole time
//! limit). So is a runner whose engine changes between trials (a plan would mix two
//! frameworks' measurements), or is not the one expected ([`ExecProber::expecting_engine`],
//! to re-measure a recording).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::job::TrialProcesses;
use super::runner::{Ended, RunnerCommand, RunnerProcess, RunningGroup, Waited};
use super::watchdog::Watchdog;
use crate::knobs::Regime;
use crate::trial::{MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};
use crate::trial_protocol::{
    unsupported_reason, RunnerAnswer, RunnerIdentity, RunnerReply, RunnerRequest, PROTOCOL_VERSION,
};
use crate::Error;

/// How many trials of a runner that has never replied may time out before the search stops:
/// a runner that does not speak the protocol would otherwise cost every trial's whole limit.
pub const MAX_SILENT_TIMEOUTS: usize = 2;

/// Runs each trial through a trial runner.
pub struct ExecProber {
    /// The runner's command, the setup every trial asks for (its device as a kind: a runner
    /// opens the device itself) and the time limit.
    trials: TrialProcesses<RunnerCommand>,
    /// Start a new runner for every trial, whatever the runner says.
    fresh_per_trial: bool,
    /// The runner kept for the next trial.
    runner: Option<RunnerProcess>,
    running: RunningGroup,
    /// Who answered the first reply; every later one must be the same engine.
    identity: Option<RunnerIdentity>,
    /// The engine the replies must name, if one is expected.
    expected_engine: Option<String>,
    /// Regimes the runner cannot run, with its reason.
    unsupported: HashMap<Regime, String>,
    started: usize,
    /// The id of the last request written (ids start at 1).
    last_id: u64,
    /// Whether any runner has replied yet.
    replied: bool,
    /// Trials that timed out while no runner had replied.
    silent_timeouts: usize,
}

impl ExecProber {
    /// A prober of the trials of `trials.setup`, each asked of the runner `trials.program`.
    pub fn new(trials: TrialProcesses<RunnerCommand>) -> Self {
        Self {
            trials,
            fresh_per_trial: false,
            runner: None,
            running: RunningGroup::default(),
            identity: None,
            expected_engine: None,
            unsupported: HashMap::new(),
            started: 0,
            last_id: 0,
            replied: false,
            silent_timeouts: 0,
        }
    }

    /// Whether every trial starts a new runner even when the runner could serve again.
    pub fn fresh_per_trial(mut self, fresh: bool) -> Self {
        self.fresh_per_trial = fresh;
        self
    }

    /// Each runner is also held by `watchdog`, which kills it if autotune is killed.
    pub fn watched_by(mut self, watchdog: Watchdog) -> Self {
        self.running = RunningGroup::watched_by(watchdog);
        self
    }

    /// Replies must name `engine` (a recording of it is re-measured); another is an error.
    pub fn expecting_engine(mut self, engine: &str) -> Self {
        self.expected_engine = Some(engine.to_string());
        self
    }

    /// The process group of the runner running now, for an interrupt handler.
    pub fn running_group(&self) -> RunningGroup {
        self.running.clone()
    }

    /// Who answered, once a runner has replied.
    pub fn identity(&self) -> Option<&RunnerIdentity> {
        self.identity.as_ref()
    }

    /// The command trials run, for messages.
    pub fn command(&self) -> &RunnerCommand {
        &self.trials.program
    }

    /// Runner processes started so far.
    pub fn runners_started(&self) -> usize {
        self.started
    }

    /// Checks that a reply's engine is the one every trial must have.
    fn same_engine(&mut self, identity: &RunnerIdentity) -> crate::Result<()> {
        let expected = self
            .identity
            .as_ref()
            .map(|i| i.engine.clone())
            .or_else(|| self.expected_engine.clone());
        match expected {
            Some(engine) if engine != identity.engine => Err(Error::invalid(
                "trial runner reply",
                "engine",
                format!(
                    "is \"{}\", but {} named \"{engine}\"; one search measures one framework \
                     (runner `{}`)",
                    identity.engine,
                    if self.identity.is_some() {
                        "an earlier reply"
                    } else {
                        "the recording"
                    },
                    self.command().display()
                ),
            )),
            _ => {
                if self.identity.is_none() {
                    self.identity = Some(identity.clone());
                }
                Ok(())
            }
        }
    }

    fn run(&mut self, request: &TrialRequest) -> crate::Result<TrialResult> {
        let started = Instant::now();
        let regime = request.knobs.regime();
        if let Some(reason) = self.unsupported.get(&regime) {
            return Ok(TrialResult {
                request: *request,
                outcome: Outcome::Crashed {
                    reason: unsupported_reason(&request.knobs, reason),
                },
                wall_s: 0.0,
            });
        }
        self.last_id += 1;
        let id = self.last_id;
        let setup = &self.trials.setup;
        let line = RunnerRequest::new(
            id,
            &setup.model,
            request,
            setup.device_kind(),
            setup.gpu_capacity,
            setup.host_budget,
        )
        .to_line();
        let mut runner = self.runner_for_trial()?;
        runner.send(&line, self.fresh_per_trial);
        let limit = self.trials.timeout.limit(request);
        let outcome = match runner.wait_reply(limit, id) {
            Waited::Reply(reply) => {
                self.replied = true;
                self.answered(runner, &reply, regime)?;
                reply
                    .outcome(&request.knobs, self.trials.setup.model.seq_len)
                    .unwrap_or_else(invalid_reply)
            }
            Waited::Invalid(e) => {
                self.replied = true;
                runner.kill();
                invalid_reply(e)
            }
            Waited::OtherVersion(found) => {
                runner.kill();
                return Err(self.other_version(&found));
            }
            Waited::Ended(ended) => ended_outcome(&ended),
            Waited::TimedOut => self.timed_out(limit)?,
        };
        let result = TrialResult {
            request: *request,
            outcome,
            wall_s: started.elapsed().as_secs_f64(),
        };
        self.trials.timeout.observe(&result);
        Ok(result)
    }

    /// The runner kept from the last trial, if it is still running and wrote no reply that
    /// was not asked for; else a new one.
    fn runner_for_trial(&mut self) -> crate::Result<RunnerProcess> {
        if let Some(mut kept) = self.runner.take() {
            let unasked = kept.unasked_replies();
            if unasked > 0 {
                tracing::warn!(
                    unasked,
                    runner = %self.command().display(),
                    "the trial runner replied more often than asked; a new one serves next"
                );
            } else if kept.alive() {
                return Ok(kept);
            }
            // A kept runner that is not reused is killed, with its tree, as it drops.
        }
        self.started += 1;
        RunnerProcess::start(&self.trials.program, &self.running)
    }

    /// Takes in a valid reply for `regime`: checks its engine, learns an unsupported regime,
    /// and keeps the runner for the next trial or ends it.
    fn answered(
        &mut self,
        runner: RunnerProcess,
        reply: &RunnerReply,
        regime: Regime,
    ) -> crate::Result<()> {
        self.same_engine(&reply.identity)?;
        if let RunnerAnswer::Unsupported { reason } = &reply.answer {
            self.unsupported.insert(regime, reason.clone());
        }
        let serves_again = reply.reusable
            && !self.fresh_per_trial
            && !matches!(reply.answer, RunnerAnswer::Error { .. });
        if serves_again {
            self.runner = Some(runner);
        } else {
            runner.finish();
        }
        Ok(())
    }

    /// The error of a runner that speaks protocol `found`, which no trial can be read in.
    fn other_version(&self, found: &str) -> Error {
        Error::invalid(
            "trial runner reply",
            "protocol",
            format!(
                "is {found}, but this autotune speaks trial protocol 1 and {PROTOCOL_VERSION} \
                 (docs/trial-protocol.md); runner `{}`",
                self.command().display()
            ),
        )
    }

    /// A trial that timed out; an error once [`MAX_SILENT_TIMEOUTS`] have while no runner
    /// ever replied.
    fn timed_out(&mut self, limit: Duration) -> crate::Result<Outcome> {
        if !self.replied {
            self.silent_timeouts += 1;
            if self.silent_timeouts >= MAX_SILENT_TIMEOUTS {
                return Err(autotune_core::Error::trial(format!(
                    "the trial runner `{}` has not replied to any trial: {} trials timed out \
                     after {} s each. A runner reads one request line on stdin and writes one \
                     reply line on stdout, flushed, before it reads on \
                     (docs/trial-protocol.md); check it by hand with a request line, or give \
                     a first trial longer with `--trial-timeout SECONDS`",
                    self.command().display(),
                    self.silent_timeouts,
                    limit.as_secs_f64()
                ))
                .into());
            }
        }
        Ok(Outcome::TimedOut {
            after_s: limit.as_secs_f64(),
        })
    }
}

/// The outcome of a reply that cannot be used: a crash, naming the field.
fn invalid_reply(e: autotune_core::Error) -> Outcome {
    Outcome::Crashed {
        reason: format!("the trial runner's reply is not valid: {e}"),
    }
}

impl Prober for ExecProber {
    /// Runs one trial through the runner; whatever the runner does is an outcome, except the
    /// errors in the module docs.
    fn probe(&mut self, request: &TrialRequest) -> autotune_core::Result<TrialResult> {
        Ok(self.run(request)?)
    }
}

/// The outcome of a runner that ended without a reply (see the module docs).
fn ended_outcome(ended: &Ended) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    if ended.status.and_then(|s| s.signal()) == Some(9) {
        return Outcome::OutOfMemory {
            memory: MemoryKind::Host,
            phase: Phase::ForwardBackward,
        };
    }
    if super::oom::names_out_of_memory_status(&ended.last_stderr) {
        return Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward,
        };
    }
    let status = ended
        .status
        .map_or("with an unknown status".to_string(), |s| format!("({s})"));
    let mut reason = format!("the trial runner ended {status} without a reply");
    for (stream, words) in [
        ("stderr", &ended.last_stderr),
        ("stdout", &ended.last_stdout),
    ] {
        if !words.is_empty() {
            reason.push_str(&format!("; last on {stream}: {words}"));
        }
    }
    Outcome::Crashed { reason }
}
