//! A search's progress and its opening line.

use autotune::plan::LongestSequence;
use autotune::probe::job::device_name;
use autotune::search::report::{Event, Purpose, Reporter};
use autotune::settings::tune::{LiveSettings, ProbeIsolation};
use autotune::trial::TrialResult;

use super::{budget, bytes, trial_outcome};
use crate::cli::printer::Printer;

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
                    Purpose::Remeasure => "remeasuring",
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
            Event::RuledOut(r) => {
                let line = format!(
                    "  {}: not verified: its trial peaked at {}, and accumulating adds about {} \
                     of summed gradients",
                    r.knobs,
                    bytes(r.measured_gpu_bytes),
                    bytes(r.added_bytes as u64)
                );
                self.bar.suspend(|| self.printer.status(line));
            }
            Event::Verified { .. } | Event::Finished { .. } => {}
        }
    }
}

/// A trial of one sequence of `tokens`, at the edge of what the plan takes, as a line.
pub fn edge_line(tokens: usize, result: &TrialResult, fits: bool) -> String {
    format!(
        "[edge] one sequence of {tokens} tokens: {}",
        trial_outcome(result, fits)
    )
}

/// The longest single sequence a plan takes, as a line.
pub fn longest_line(longest: &LongestSequence) -> String {
    format!("longest single sequence: {}", longest.describe())
}
