//! `autotune estimate`: a setting's peak GPU and host memory by the core's analytic model,
//! without running anything; or, with `--profile`, the model against a recording's peaks.
//! Exit 1 when the setting is estimated not to fit the target.

use std::path::PathBuf;

use serde::Serialize;

use autotune::estimate::{self, Attention, Breakdown, Estimate, Phase, RecordedError};
use autotune::profile::record::Profile;
use autotune::spec::budget::Budget;
use autotune::spec::device::{DeviceKind, DeviceSpec};
use autotune::spec::limits;
use autotune::{Knobs, ModelSpec, Precision};

use super::printer::Printer;
use super::reporters::bytes;
use super::Status;
use autotune::settings::flags::{self, as_flag};
use autotune::settings::knobs::KnobArgs;

/// Arguments of `autotune estimate`.
#[derive(Debug, clap::Args)]
pub struct EstimateArgs {
    /// Model preset (tiny, seed, gpt-124m, gpt-350m, gpt-1.3b, gpt-2b) or a JSON spec file.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Target machine: auto (this machine's GPU, else the CPU), a built-in profile
    /// (rtx4090-32g, h200, cpu) or a JSON profile file.
    #[arg(long, default_value = "auto")]
    pub device: String,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// The engine to estimate: explicit (flash attention where the GPU has kernels for it) or
    /// explicit-materialized (attention probabilities kept).
    #[arg(long, default_value = "explicit")]
    pub engine: autotune::model::Engine,
    /// Fraction of each memory kept free when saying whether the setting fits (default 0.05).
    #[arg(long)]
    pub headroom: Option<f64>,
    /// Compare the estimate with every fitted trial of this recorded profile instead (its
    /// model and device; the knob flags are not used).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Print one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

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
}

pub fn run(args: EstimateArgs, printer: &Printer) -> anyhow::Result<Status> {
    if let Some(path) = &args.profile {
        return compare(&args, path, printer);
    }
    let model = ModelSpec::resolve(&args.model)?;
    let target = autotune::settings::tune::target_profile(&args.device)?;
    let knobs = args.knobs.knobs();
    knobs
        .validate("knobs", "")
        .and_then(|()| limits::check_knobs(&model, &knobs, "knobs", ""))
        .map_err(|e| as_flag(e, flags::TRAIN))?;
    let mut budget = Budget::from_device(&target);
    if let Some(h) = args.headroom {
        budget.headroom = h;
    }
    budget
        .validate()
        .map_err(|e| as_flag(e, &[("headroom", "--headroom")]))?;
    let attention = attention(args.engine, &model, &target, knobs.precision)?;
    let est = estimate::estimate(&model, &knobs, target.kind, attention);
    let fits = est.fits(&budget);
    let largest = estimate::largest_micro_batch(&model, &knobs, target.kind, attention, &budget);
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
        fits,
        largest_micro_batch: largest,
    });
    printer.data_text(table(&model, &target, &knobs, attention, &est));
    printer.data_text(verdict(&est, &budget, fits, largest));
    Ok(if fits {
        Status::Success
    } else {
        Status::Negative
    })
}

/// Whether the engine keeps attention probabilities on `target` at `precision`: the explicit
/// engine runs flash attention on the CPU, and on a GPU in half precision for the head widths
/// its kernels cover.
fn attention(
    engine: autotune::model::Engine,
    model: &ModelSpec,
    target: &DeviceSpec,
    precision: Precision,
) -> anyhow::Result<Attention> {
    use autotune::model::Engine;
    match engine {
        Engine::Explicit => {
            let flash = target.kind == DeviceKind::Cpu
                || (precision != Precision::Fp32
                    && autotune::ops::FLASH_HEAD_DIMS.contains(&model.head_dim()));
            Ok(if flash {
                Attention::Flash
            } else {
                Attention::Materialized
            })
        }
        Engine::ExplicitMaterialized => Ok(Attention::Materialized),
        Engine::Fused | Engine::Composite => anyhow::bail!(
            "`--engine`: the estimate describes the explicit engine; use explicit or explicit-materialized"
        ),
    }
}

fn table(
    model: &ModelSpec,
    target: &DeviceSpec,
    knobs: &Knobs,
    attention: Attention,
    est: &Estimate,
) -> String {
    let attention = match attention {
        Attention::Flash => "flash attention",
        Attention::Materialized => "attention probabilities kept",
    };
    let mut text = format!(
        "{} ({:.1}M parameters) at {knobs} on {}, {attention}\n\n{:<16} {:>12} {:>12}\n",
        model.name,
        model.parameter_count() as f64 / 1e6,
        target.name,
        "",
        "GPU",
        "host"
    );
    let gpu = est.gpu.map(|g| g.parts());
    for (i, (name, host)) in est.host.parts().into_iter().enumerate() {
        let on_gpu = gpu.map_or("-".to_string(), |g| bytes(g[i].1));
        text.push_str(&format!("{name:<16} {on_gpu:>12} {:>12}\n", bytes(host)));
    }
    let total = est.gpu.map_or("-".to_string(), |g| bytes(g.total()));
    text.push_str(&format!(
        "{:<16} {total:>12} {:>12}",
        "total",
        bytes(est.host.total())
    ));
    text
}

fn verdict(est: &Estimate, budget: &Budget, fits: bool, largest: Option<usize>) -> String {
    let phase = match est.peak_phase {
        Phase::Head => "the head's loss and gradient, after the forward pass",
        Phase::BackwardStart => "the start of the backward pass",
        Phase::BackwardEnd => "the end of the backward pass",
        Phase::AfterBackward => "after the backward pass, every gradient held",
    };
    let usable = match budget.usable_gpu_bytes() {
        Some(g) => format!(
            "GPU {}, host {}",
            bytes(g),
            bytes(budget.usable_host_bytes())
        ),
        None => format!("host {}", bytes(budget.usable_host_bytes())),
    };
    let answer = if fits { "fits" } else { "does not fit" };
    let largest = largest.map_or("no micro-batch fits".to_string(), |b| {
        format!("the largest micro-batch that fits is {b}")
    });
    format!(
        "\npeak at {phase}\n{answer} the usable {usable} (headroom {:.0}%); {largest}",
        budget.headroom * 100.0
    )
}

fn compare(
    args: &EstimateArgs,
    path: &std::path::Path,
    printer: &Printer,
) -> anyhow::Result<Status> {
    let profile = Profile::load(path)?;
    let target = &profile.device.target;
    // Each trial's precision decides whether its attention ran flash.
    let mut trials = Vec::new();
    for trial in &profile.trials {
        let precision = trial.request.knobs.precision;
        let at = attention(args.engine, &profile.model, target, precision)?;
        trials.extend(estimate::compare(
            &profile.model,
            target.kind,
            at,
            std::slice::from_ref(trial),
        ));
    }
    let errors: Vec<f64> = trials.iter().map(|t| t.relative_error.abs()).collect();
    let worst = errors.iter().copied().reduce(f64::max);
    let mean = (!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64);
    let memory = match target.kind {
        DeviceKind::Cuda => "GPU",
        DeviceKind::Cpu => "host",
    };
    let mut text = format!(
        "{} on {}: the estimate of each fitted trial's {memory} peak\n",
        profile.model.name, target.name
    );
    for t in &trials {
        text.push_str(&format!(
            "{}: measured {}, estimated {} ({:+.1}%)\n",
            t.knobs,
            bytes(t.measured_bytes),
            bytes(t.estimated_bytes),
            t.relative_error * 100.0
        ));
    }
    match (worst, mean) {
        (Some(w), Some(m)) => text.push_str(&format!(
            "{} trials: worst {:.1}%, mean {:.1}%",
            trials.len(),
            w * 100.0,
            m * 100.0
        )),
        _ => text.push_str("no trial fitted, nothing to compare"),
    }
    printer.data_json(&ComparisonOutput {
        profile: path,
        model: &profile.model.name,
        device: &target.name,
        trials,
        worst_relative_error: worst,
        mean_relative_error: mean,
    });
    printer.data_text(text);
    Ok(Status::Success)
}
