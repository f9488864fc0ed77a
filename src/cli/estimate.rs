//! `autotune estimate`: a setting's peak GPU and host memory by the core's analytic model,
//! without running anything; or, with `--profile`, the model against a recording's peaks.
//! Exit 1 when the setting is estimated not to fit the target.

use serde::Serialize;

use autotune::estimate::{Attention, Breakdown, Phase, RecordedError};
use autotune::profile::record::Profile;
use autotune::session;
use autotune::session::estimate::Comparison;
use autotune::settings::estimate::{EstimateArgs, EstimateSettings};
use autotune::spec::budget::Budget;
use autotune::spec::device::DeviceKind;
use autotune::Knobs;

use super::printer::Printer;
use super::reporters::bytes;
use super::reporters::estimate::{table, verdict};
use super::Status;

/// Bytes by component, with their total, as JSON.
#[derive(Serialize)]
struct Memory {
    #[serde(flatten)]
    parts: Breakdown,
    total: u64,
}

impl From<Breakdown> for Memory {
    fn from(parts: Breakdown) -> Self {
        Self {
            total: parts.total(),
            parts,
        }
    }
}

/// The JSON document of `estimate --json`.
#[derive(Serialize)]
struct EstimateOutput<'a> {
    model: &'a str,
    parameters: usize,
    device: &'a str,
    knobs: Knobs,
    attention: Attention,
    gpu: Option<Memory>,
    host: Memory,
    peak_phase: Phase,
    budget: Budget,
    fits: bool,
    /// The largest micro-batch at these knobs the estimate fits into the budget.
    largest_micro_batch: Option<usize>,
    /// The longest single sequence (one a micro-batch) at these knobs the estimate fits into
    /// the budget, in tokens.
    longest_sequence: Option<usize>,
}

/// The JSON document of `estimate --profile … --json`.
#[derive(Serialize)]
struct ComparisonOutput<'a> {
    profile: &'a std::path::Path,
    model: &'a str,
    device: &'a str,
    trials: Vec<RecordedError>,
    worst_relative_error: Option<f64>,
    mean_relative_error: Option<f64>,
    /// The host peaks of the GPU trials that keep state in host memory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    host_trials: Vec<RecordedError>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_worst_relative_error: Option<f64>,
}

pub fn run(args: EstimateArgs, printer: &Printer) -> anyhow::Result<Status> {
    let mut notes = Vec::new();
    let settings = EstimateSettings::from_args(&args, &mut notes)?;
    for note in &notes {
        printer.note(note);
    }
    let (model, target, knobs, attention, budget) = match settings {
        EstimateSettings::Recording {
            path,
            profile,
            engine,
        } => return compare(&path, &profile, engine, printer),
        EstimateSettings::Setting {
            model,
            target,
            knobs,
            attention,
            budget,
        } => (model, target, knobs, attention, budget),
    };
    let found = session::estimate::setting(&model, &target, &knobs, attention, &budget);
    let est = &found.estimate;
    printer.data_json(&EstimateOutput {
        model: &model.name,
        parameters: model.parameter_count(),
        device: &target.name,
        knobs,
        attention,
        gpu: est.gpu.map(Memory::from),
        host: est.host.into(),
        peak_phase: est.peak_phase,
        budget,
        fits: found.fits,
        largest_micro_batch: found.largest_micro_batch,
        longest_sequence: found.longest_sequence,
    });
    printer.data_text(table(&model, &target, &knobs, attention, est));
    printer.data_text(verdict(est, &budget, found.fits, found.largest_micro_batch));
    printer.data_text(match found.longest_sequence {
        Some(tokens) => format!(
            "the longest single sequence that fits at these knobs is {tokens} tokens (one a \
             step: micro-batch 1, no accumulation)"
        ),
        None => "not even one token fits at these knobs (micro-batch 1, no accumulation)".into(),
    });
    Ok(if found.fits {
        Status::Success
    } else {
        Status::Negative
    })
}

fn compare(
    path: &std::path::Path,
    profile: &Profile,
    engine: autotune::model::Engine,
    printer: &Printer,
) -> anyhow::Result<Status> {
    let target = &profile.device.target;
    let Comparison {
        trials,
        worst,
        mean,
        host_trials,
    } = session::estimate::against_recording(profile, engine)?;
    let memory = match target.kind {
        DeviceKind::Cuda => "GPU",
        DeviceKind::Cpu => "host",
    };
    let mut text = format!(
        "{} on {}: the estimate of each fitted trial's {memory} peak\n",
        profile.model.name, target.name
    );
    push_errors(&mut text, &trials, "no trial fitted, nothing to compare");
    let (host_worst, _) = session::estimate::worst_and_mean(&host_trials);
    if !host_trials.is_empty() {
        text.push_str("\nthe host peak of each that keeps state in host memory\n");
        push_errors(&mut text, &host_trials, "");
    }
    printer.data_json(&ComparisonOutput {
        profile: path,
        model: &profile.model.name,
        device: &target.name,
        trials,
        worst_relative_error: worst,
        mean_relative_error: mean,
        host_trials,
        host_worst_relative_error: host_worst,
    });
    printer.data_text(text);
    Ok(Status::Success)
}

/// One line per trial of `errors`, then their worst and mean (`none` where there are none).
fn push_errors(text: &mut String, errors: &[RecordedError], none: &str) {
    for t in errors {
        text.push_str(&format!(
            "{}: measured {}, estimated {} ({:+.1}%)\n",
            t.knobs,
            bytes(t.measured_bytes),
            bytes(t.estimated_bytes),
            t.relative_error * 100.0
        ));
    }
    match session::estimate::worst_and_mean(errors) {
        (Some(w), Some(m)) => text.push_str(&format!(
            "{} trials: worst {:.1}%, mean {:.1}%",
            errors.len(),
            w * 100.0,
            m * 100.0
        )),
        _ => text.push_str(none),
    }
}
