//! A check's opening lines, its progress, and its table of verdicts.

use autotune::backend::CANDLE_VERSION;
use autotune::profile::check::{CheckReport, SettingCheck, Verdict};
use autotune::profile::record::Profile;
use autotune::search::report::{Event, Reporter};
use autotune::trial::{Outcome, Phase};

use super::{bytes, memory_name};
use crate::cli::printer::Printer;

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

/// What is checked, against which build.
pub fn announce(profile: &Profile, printer: &Printer) {
    let recorded_on = &profile.device;
    printer.status(format!(
        "checking {} trials of {} recorded on {} ({}) with autotune {} and candle {}",
        profile.trials.len(),
        profile.model.name,
        recorded_on.name,
        recorded_on.target.name,
        profile.tool.version,
        profile.candle_version,
    ));
    if let Some(engine) = &profile.engine {
        printer.status(format!(
            "its trials were measured on the {engine} engine{} through a trial runner",
            profile
                .engine_version
                .as_deref()
                .map_or(String::new(), |v| format!(" {v}"))
        ));
    } else if profile.candle_version != CANDLE_VERSION {
        printer.status(format!(
            "note: this build uses candle {CANDLE_VERSION}; differences may come from the upgrade"
        ));
    }
}

/// The snake-case name a phase has in JSON.
fn phase_name(phase: Phase) -> String {
    serde_json::to_value(phase)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_else(|| format!("{phase:?}"))
}

fn verdict_text(verdict: &Verdict) -> String {
    let pct = |change: f64| format!("{:+.1}%", change * 100.0);
    match verdict {
        Verdict::Unchanged => "unchanged".into(),
        Verdict::MoreMemory { memory, change, .. } => {
            format!(
                "MORE {} MEMORY {}",
                memory_name(*memory).to_uppercase(),
                pct(*change)
            )
        }
        Verdict::LessMemory { memory, change, .. } => {
            format!("less {} memory {}", memory_name(*memory), pct(*change))
        }
        Verdict::Slower { change, band, .. } => {
            format!("SLOWER {} (band ±{:.1}%)", pct(*change), band * 100.0)
        }
        Verdict::Faster { change, band, .. } => {
            format!("faster {} (band ±{:.1}%)", pct(*change), band * 100.0)
        }
        Verdict::NewlyOom { memory, phase } => {
            format!(
                "NEWLY OUT OF {} MEMORY (in {})",
                memory_name(*memory).to_uppercase(),
                phase_name(*phase)
            )
        }
        Verdict::NoLongerOom { .. } => "fits now (was out of memory)".into(),
        Verdict::Crashed { reason } => format!("CRASHED: {reason}"),
        Verdict::TimedOut { after_s } => format!("TIMED OUT after {after_s:.0} s"),
        Verdict::Missing => "missing".into(),
    }
}

/// The human report: one row per recorded trial, then a summary line.
pub fn table(report: &CheckReport, gpu: bool) -> String {
    let row = |i: usize, s: &SettingCheck| {
        [
            format!("{}", i + 1),
            s.request.knobs.to_string(),
            check_outcome(&s.recorded, gpu),
            s.now
                .as_ref()
                .map_or("-".into(), |now| check_outcome(now, gpu)),
            s.verdicts
                .iter()
                .map(verdict_text)
                .collect::<Vec<_>>()
                .join("; "),
        ]
    };
    let header = ["#", "setting", "recorded", "now", "verdict"].map(String::from);
    let rows: Vec<[String; 5]> = std::iter::once(header)
        .chain(report.settings.iter().enumerate().map(|(i, s)| row(i, s)))
        .collect();
    let mut widths = [0usize; 5];
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    for r in &rows {
        let cells: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        text.push_str(cells.join("  ").trim_end());
        text.push('\n');
    }
    let t = &report.tolerance;
    text.push_str(&format!(
        "{} settings: {} regressed, {} improved, {} missing (tolerance: time {:.0}% or {} standard \
         errors of the medians, whichever is larger; memory {:.0}% or {} MiB)",
        report.settings.len(),
        report.regressions,
        report.improvements,
        report.missing,
        t.time_threshold * 100.0,
        t.significance_z,
        t.memory_threshold * 100.0,
        t.memory_floor_bytes >> 20,
    ));
    text
}
