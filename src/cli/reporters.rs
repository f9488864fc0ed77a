//! How searches, checks and trials read for people: the progress each command draws on stderr
//! while trials run, and the one way outcomes and budgets are written (bytes by the core's
//! formatter).

use autotune::probe::job::device_name;
use autotune::search::report::{Event, Purpose, Reporter};
use autotune::settings::tune::{LiveSettings, ProbeIsolation};
use autotune::spec::budget::Budget;
use autotune::trial::{MemoryKind, Outcome, TrialResult};

use super::printer::Printer;

/// Bytes for people: the core's one formatter.
pub use autotune::spec::budget::format_bytes as bytes;

/// "GPU" or "host".
pub fn memory_name(memory: MemoryKind) -> &'static str {
    match memory {
        MemoryKind::Gpu => "GPU",
        MemoryKind::Host => "host",
    }
}

/// A budget as one phrase: "GPU 24.00 GiB, host 32.00 GiB, headroom 5%".
pub fn budget(budget: &Budget) -> String {
    let host = format!("host {}", bytes(budget.host_bytes));
    match budget.gpu_bytes {
        Some(g) => format!(
            "GPU {}, {host}, headroom {:.0}%",
            bytes(g),
            budget.headroom * 100.0
        ),
        None => format!("{host}, headroom {:.0}%", budget.headroom * 100.0),
    }
}

/// The line that says what a search on this machine tunes for what, and where its trials run.
pub fn tuning(settings: &LiveSettings) -> String {
    let spec = &settings.spec;
    let isolation = match (&settings.runner, settings.isolation) {
        (Some(runner), ProbeIsolation::Child) => {
            format!(
                " through the trial runner `{}`, a new one per trial",
                runner.display()
            )
        }
        (Some(runner), _) => format!(" through the trial runner `{}`", runner.display()),
        (None, ProbeIsolation::InProcess) => String::new(),
        (None, ProbeIsolation::Child) => " in child processes".into(),
        (None, ProbeIsolation::Worker) => " in a worker process".into(),
    };
    format!(
        "tuning {} ({:.1}M parameters, seq {}) for {} ({}), probing on {}{isolation}",
        spec.name,
        spec.parameter_count() as f64 / 1e6,
        spec.seq_len,
        settings.target.name,
        budget(&settings.budget),
        device_name(settings.target.kind),
    )
}

/// What a finished search trial found, as its progress line says it.
pub fn trial_outcome(result: &TrialResult, feasible: bool) -> String {
    match &result.outcome {
        Outcome::Fits(m) => format!(
            "{} {:.0} tokens/s, peak GPU {}, host {}",
            if feasible {
                "fits,"
            } else {
                "fits but above the headroom,"
            },
            m.tokens_per_s,
            bytes(m.peak_gpu_bytes),
            bytes(m.peak_host_bytes)
        ),
        Outcome::OutOfMemory { memory, phase } => {
            format!("out of {} memory during {phase:?}", memory_name(*memory))
        }
        Outcome::Crashed { reason } => format!("crashed: {reason}"),
        Outcome::TimedOut { after_s } => format!("timed out after {after_s:.0} s"),
    }
}

/// A search's progress on stderr: a spinner while a trial runs, one line when it ends, and
/// with `-v` a line when a regime is done. The spinner is cleared when the progress is dropped.
pub struct SearchProgress {
    printer: Printer,
    bar: indicatif::ProgressBar,
}

impl SearchProgress {
    /// Starts the spinner (hidden unless stderr is a terminal).
    pub fn new(printer: &Printer) -> Self {
        Self {
            printer: *printer,
            bar: printer.spinner(),
        }
    }
}

impl Drop for SearchProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

impl Reporter for SearchProgress {
    fn report(&self, event: &Event) {
        match event {
            Event::TrialStarted {
                index,
                request,
                purpose,
            } => {
                let what = match purpose {
                    Purpose::Verify => "verifying",
                    Purpose::Search => "probing",
                };
                self.bar
                    .set_message(format!("[{}] {what} {}", index + 1, request.knobs));
            }
            Event::TrialFinished {
                index,
                result,
                feasible,
                ..
            } => {
                let line = format!(
                    "[{}] {}: {}",
                    index + 1,
                    result.request.knobs,
                    trial_outcome(result, *feasible)
                );
                self.bar.suspend(|| self.printer.status(line));
            }
            Event::RegimeDone {
                regime,
                end,
                trials,
                ..
            } => {
                let line = format!("  {regime}: {end:?} after {trials} trials");
                self.bar.suspend(|| self.printer.detail(line));
            }
            Event::Verified { .. } | Event::Finished { .. } => {}
        }
    }
}

/// A check's progress on stderr: with `-v` a line when a trial starts, and one when it ends.
pub struct CheckProgress {
    printer: Printer,
    total: usize,
    gpu: bool,
}

impl CheckProgress {
    /// Progress over `total` recorded trials; `gpu` when their peaks include device memory.
    pub fn new(printer: &Printer, total: usize, gpu: bool) -> Self {
        Self {
            printer: *printer,
            total,
            gpu,
        }
    }
}

impl Reporter for CheckProgress {
    fn report(&self, event: &Event) {
        let total = self.total;
        match event {
            Event::TrialStarted { index, request, .. } => {
                self.printer
                    .detail(format!("[{}/{total}] running {}", index + 1, request.knobs))
            }
            Event::TrialFinished { index, result, .. } => self.printer.status(format!(
                "[{}/{total}] {}: {}",
                index + 1,
                result.request.knobs,
                check_outcome(&result.outcome, self.gpu)
            )),
            _ => {}
        }
    }
}

/// A recorded or fresh outcome in a check's table: time and peaks, or what went wrong.
pub fn check_outcome(outcome: &Outcome, gpu: bool) -> String {
    match outcome {
        Outcome::Fits(m) if gpu => format!(
            "{:.1} ms, GPU {}, host {}",
            m.step_time_median_s * 1e3,
            bytes(m.peak_gpu_bytes),
            bytes(m.peak_host_bytes)
        ),
        Outcome::Fits(m) => format!(
            "{:.1} ms, host {}",
            m.step_time_median_s * 1e3,
            bytes(m.peak_host_bytes)
        ),
        Outcome::OutOfMemory { memory, .. } => format!("out of {} memory", memory_name(*memory)),
        Outcome::Crashed { .. } => "crashed".into(),
        Outcome::TimedOut { .. } => "timed out".into(),
    }
}
