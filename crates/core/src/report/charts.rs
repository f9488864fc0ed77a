//! The report's charts: peak GPU and host memory against micro-batch (the budget, its
//! headroom, the fitted law, out-of-memory and failed settings), and tokens per second.

use super::svg::{Axis, Chart, Layer, Scale, Shape, Unit};
use super::{outcome_text, RegimeView, Report};
use crate::spec::budget::format_bytes;
use crate::spec::device::DeviceKind;
use crate::trial::{Measurement, MemoryKind, Outcome};

/// The micro-batch axis, spanning the regime's trials.
fn batch_axis(view: &RegimeView) -> Axis {
    let max = view
        .trials
        .iter()
        .map(|t| t.request.knobs.micro_batch)
        .max()
        .unwrap_or(1);
    Axis {
        label: "micro-batch (sequences)".into(),
        min: 1.0,
        max: (max as f64).max(2.0),
        scale: Scale::Log2,
        unit: Unit::Count,
    }
}

/// Peak `memory` against micro-batch: the budget and its headroom (or a note where the budget
/// is off the scale), the fitted law, each trial's peak or failure, and the chosen setting.
pub(super) fn memory_chart(report: &Report, view: &RegimeView, memory: MemoryKind) -> Chart {
    let budget = MemoryBudget::of(report, memory);
    let x = batch_axis(view);
    let highest = view
        .trials
        .iter()
        .filter_map(|t| t.outcome.measurement().map(|m| budget.peak(m)))
        .max()
        .unwrap_or(0);
    // A budget far above every peak (a small model on a large machine) would flatten the
    // points against the axis: the chart then shows the peaks and names the budget.
    let shows_budget = highest == 0 || budget.limit <= highest.saturating_mul(4);
    let y = peak_axis(budget.name, highest, budget.limit, shows_budget);
    let mut layers = Vec::new();
    let note = if shows_budget {
        layers.extend(budget_lines(report, &budget));
        None
    } else {
        Some(format!(
            "budget {}: off the scale",
            short_bytes(budget.limit as f64)
        ))
    };
    // Settings that ran out of memory or failed are drawn at the limit, or at the top.
    let limit_y = if shows_budget {
        budget.limit as f64
    } else {
        y.max
    };
    layers.extend(fitted_line(view, memory, &x));
    layers.extend(trial_points(report, view, &budget, limit_y));
    if let Some((b, m)) = chosen_point(report, view) {
        layers.push(Layer::Points {
            class: "chosen".into(),
            shape: Shape::Ring,
            points: vec![(b, budget.peak(&m) as f64, "the chosen setting".into())],
        });
    }
    Chart {
        class: format!("memory {}", budget.class),
        title: format!("Peak {} memory", budget.name),
        note,
        x,
        y,
        layers,
    }
}

/// One memory's names and limits, as a memory chart shows them.
struct MemoryBudget {
    memory: MemoryKind,
    /// The memory's name in labels: "GPU" or "host".
    name: &'static str,
    /// Its CSS class.
    class: &'static str,
    /// The budget's limit, bytes.
    limit: u64,
    /// What the headroom leaves of it, bytes.
    usable: u64,
}

impl MemoryBudget {
    fn of(report: &Report, memory: MemoryKind) -> Self {
        let (name, class, limit, usable) = match memory {
            MemoryKind::Gpu => (
                "GPU",
                "gpu",
                report.budget.gpu_bytes.unwrap_or(0),
                report.budget.usable_gpu_bytes().unwrap_or(0),
            ),
            MemoryKind::Host => (
                "host",
                "host",
                report.budget.host_bytes,
                report.budget.usable_host_bytes(),
            ),
        };
        Self {
            memory,
            name,
            class,
            limit,
            usable,
        }
    }

    /// A measurement's peak in this memory.
    fn peak(&self, m: &Measurement) -> u64 {
        match self.memory {
            MemoryKind::Gpu => m.peak_gpu_bytes,
            MemoryKind::Host => m.peak_host_bytes,
        }
    }
}

/// The peak axis: up to the budget or the highest peak, whichever is higher, with room above
/// for the labels; up to the highest peak alone when the budget is off the scale.
fn peak_axis(name: &str, highest: u64, limit: u64, shows_budget: bool) -> Axis {
    let top = if shows_budget {
        highest.max(limit) as f64 * 1.08
    } else {
        highest as f64 * 1.15
    };
    Axis {
        label: format!("peak {name} memory"),
        min: 0.0,
        max: top.max(1.0),
        scale: Scale::Linear,
        unit: bytes_unit(top),
    }
}

/// The budget's line and the line its headroom leaves usable.
fn budget_lines(report: &Report, budget: &MemoryBudget) -> [Layer; 2] {
    [
        Layer::HLine {
            class: "budget".into(),
            y: budget.limit as f64,
            label: format!("budget {}", short_bytes(budget.limit as f64)),
            below: false,
        },
        Layer::HLine {
            class: "usable".into(),
            y: budget.usable as f64,
            label: format!("headroom {:.0}%", report.budget.headroom * 100.0),
            below: true,
        },
    ]
}

/// The regime's fitted memory law in `memory`, if it has one.
fn fitted_line(view: &RegimeView, memory: MemoryKind, x: &Axis) -> Option<Layer> {
    let model = view.fit.memory.as_ref()?;
    let law = match memory {
        MemoryKind::Gpu => model.gpu,
        MemoryKind::Host => model.host,
    };
    Some(Layer::Line {
        class: "fit".into(),
        points: log_samples(x)
            .map(|b| (b, law.fixed_bytes + law.per_sample_bytes * b))
            .collect(),
    })
}

/// Each trial's mark: its peak, within the usable bytes or over them; or, at `limit_y`, that
/// it ran out of this memory, or crashed or timed out (drawn on the training device's memory).
fn trial_points(
    report: &Report,
    view: &RegimeView,
    budget: &MemoryBudget,
    limit_y: f64,
) -> [Layer; 4] {
    let (mut within, mut over, mut ooms, mut failed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for t in &view.trials {
        let b = t.request.knobs.micro_batch as f64;
        let label = format!("micro-batch {}", t.request.knobs.micro_batch);
        match &t.outcome {
            Outcome::Fits(m) => {
                let peak = budget.peak(m);
                let point = (b, peak as f64, format!("{label}: {}", format_bytes(peak)));
                if peak <= budget.usable {
                    within.push(point)
                } else {
                    over.push(point)
                }
            }
            Outcome::OutOfMemory {
                memory: ran_out, ..
            } if *ran_out == budget.memory => {
                let text = format!("{label}: out of {} memory", budget.name);
                ooms.push((b, limit_y, text));
            }
            Outcome::Crashed { .. } | Outcome::TimedOut { .. }
                if budget.memory == device_memory(report) =>
            {
                failed.push((b, limit_y, format!("{label}: {}", outcome_text(&t.outcome))));
            }
            _ => {}
        }
    }
    let points = |class: String, shape: Shape, points| Layer::Points {
        class,
        shape,
        points,
    };
    [
        points(format!("measured {}", budget.class), Shape::Circle, within),
        points(
            format!("measured over {}", budget.class),
            Shape::Circle,
            over,
        ),
        points("oom".into(), Shape::Cross, ooms),
        points("failed".into(), Shape::Square, failed),
    ]
}

/// Bytes in GiB at a chart's scale, or in MiB below 2 GiB.
fn bytes_unit(top: f64) -> Unit {
    if top >= 2.0 * (1u64 << 30) as f64 {
        Unit::Gib
    } else {
        Unit::Mib
    }
}

/// Bytes short enough for a chart label: one decimal of GiB, or whole MiB.
fn short_bytes(bytes: f64) -> String {
    let gib = bytes / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{:.0} MiB", bytes / (1u64 << 20) as f64)
    }
}

/// The memory a crash or time-out is drawn on: the training device's.
fn device_memory(report: &Report) -> MemoryKind {
    match report.target.kind {
        DeviceKind::Cuda => MemoryKind::Gpu,
        DeviceKind::Cpu => MemoryKind::Host,
    }
}

/// Tokens per second against micro-batch; `None` when no trial of the regime fitted.
pub(super) fn throughput_chart(report: &Report, view: &RegimeView) -> Option<Chart> {
    let x = batch_axis(view);
    let points: Vec<(f64, f64, String)> = view
        .trials
        .iter()
        .filter_map(|t| {
            let m = t.outcome.measurement()?;
            Some((
                t.request.knobs.micro_batch as f64,
                m.tokens_per_s,
                format!(
                    "micro-batch {}: {:.0} tokens/s",
                    t.request.knobs.micro_batch, m.tokens_per_s
                ),
            ))
        })
        .collect();
    if points.is_empty() {
        return None;
    }
    let top = points.iter().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let y = Axis {
        label: "tokens/s".into(),
        min: 0.0,
        max: top.max(1.0),
        scale: Scale::Linear,
        unit: Unit::Count,
    };
    let mut layers = Vec::new();
    if let Some(time) = &view.fit.time {
        let s = report.model.seq_len;
        layers.push(Layer::Line {
            class: "fit".into(),
            // Throughput b·s / (fixed + per_sample·b), between the micro-batches too.
            points: log_samples(&x)
                .map(|b| {
                    let step_s = (time.fixed_s + time.per_sample_s * b).max(1e-12);
                    (b, b * s as f64 / step_s)
                })
                .collect(),
        });
    }
    layers.push(Layer::Points {
        class: "measured rate".into(),
        shape: Shape::Circle,
        points,
    });
    if let Some((b, m)) = chosen_point(report, view) {
        layers.push(Layer::Points {
            class: "chosen".into(),
            shape: Shape::Ring,
            points: vec![(b, m.tokens_per_s, "the chosen setting".into())],
        });
    }
    Some(Chart {
        class: "throughput".into(),
        title: "Tokens per second".into(),
        note: None,
        x,
        y,
        layers,
    })
}

/// Where the chosen setting sits in this regime's charts: its micro-batch and measurement.
fn chosen_point(report: &Report, view: &RegimeView) -> Option<(f64, Measurement)> {
    let knobs = report.chosen.filter(|_| view.chosen)?;
    Some((knobs.micro_batch as f64, report.chosen_measurement()?))
}

/// Forty points spread evenly over a log axis.
fn log_samples(axis: &Axis) -> impl Iterator<Item = f64> + '_ {
    let (lo, hi) = (axis.min.log2(), axis.max.log2());
    (0..=40).map(move |i| (lo + (hi - lo) * i as f64 / 40.0).exp2())
}
