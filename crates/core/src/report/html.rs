//! The report's page: a header, the chosen setting and its alternatives, an overview of the
//! regimes, and one section per regime with its charts and trials. Styles are inline; there is
//! no script.

use std::fmt::Write;

use super::charts::{memory_chart, throughput_chart};
use super::svg::escape;
use super::{outcome_text, Choice, RegimeView, Report, Source};
use crate::fit::MemoryModel;
use crate::spec::budget::format_bytes;
use crate::spec::device::DeviceKind;
use crate::trial::{MemoryKind, Outcome, TrialResult};

pub(super) const STYLE: &str = "
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1290px; color: #1d2430; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #d9dee7; }
h3 { font-size: 15px; margin: 16px 0 6px; }
.summary, .fit, .note { color: #4a5568; margin: 4px 0; }
table { border-collapse: collapse; margin: 6px 0 12px; } th, td { padding: 3px 10px; border-bottom: 1px solid #eceff4; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen td { font-weight: 600; background: #f3f7ff; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg.chart { background: #fbfcfe; border: 1px solid #e2e6ee; }
svg .title { font-size: 13px; font-weight: 600; fill: #1d2430; } svg .chart-note { font-size: 10px; fill: #c53030; }
svg .axis { fill: none; stroke: #59616e; stroke-width: 1; }
svg .tick { stroke: #59616e; } svg .grid { stroke: #e6e9ef; }
svg .tick-label, svg .axis-label, svg .line-label { font-size: 11px; fill: #4a5568; }
svg .budget { stroke: #c53030; stroke-width: 1.5; } svg .line-label.budget { fill: #c53030; }
svg .usable { stroke: #dd6b20; stroke-width: 1.2; stroke-dasharray: 6 4; } svg .line-label.usable { fill: #dd6b20; }
svg .fit { fill: none; stroke: #718096; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg .measured.gpu { fill: #2b6cb0; } svg .measured.host { fill: #2f855a; } svg .measured.rate { fill: #6b46c1; }
svg .over { fill: #dd6b20; }
svg .oom { stroke: #c53030; stroke-width: 2.2; fill: none; }
svg .failed { stroke: #718096; stroke-width: 1.5; fill: none; }
svg .chosen { fill: none; stroke: #1d2430; stroke-width: 2; }
footer { margin-top: 32px; color: #718096; font-size: 12px; }
rect.bar { fill: #2b6cb0; }
";

/// The whole page.
pub(super) fn page(report: &Report) -> String {
    let regimes = report.regimes();
    let mut s = String::new();
    let title = format!("{} on {}", report.model.name, report.target.name);
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>autotune report: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    header(&mut s, report, &regimes, &title);
    chosen_section(&mut s, report);
    super::data::data_section(&mut s, report);
    overview(&mut s, report, &regimes);
    for (i, view) in regimes.iter().enumerate() {
        regime_section(&mut s, report, view, i);
    }
    let _ = write!(
        s,
        "<footer>Made by autotune {} from a {}. Markers: filled, a measured peak; cross, out of memory; square, crashed or timed out; ring, the chosen setting. Dashed grey: the memory model fitted to the trials.</footer>\n</body>\n</html>\n",
        escape(env!("CARGO_PKG_VERSION")),
        match report.source {
            Source::Plan => "plan",
            Source::Profile => "recorded profile",
            Source::Search => "search",
        }
    );
    s
}

fn header(s: &mut String, report: &Report, regimes: &[RegimeView], title: &str) {
    let budget = &report.budget;
    let gpu = budget
        .gpu_bytes
        .map(|g| format!("GPU {}, ", format_bytes(g)))
        .unwrap_or_default();
    let ran_on = report
        .ran_on
        .as_ref()
        .map(|d| format!(", measured on {d}"))
        .unwrap_or_default();
    let _ = write!(
        s,
        "<header>\n<h1>{}</h1>\n<p class=\"summary\">{:.1}M parameters, sequences of {}; budget {gpu}host {}, headroom {:.0}%{}; {} trials in {} regimes.</p>\n</header>\n",
        escape(title),
        report.model.parameter_count() as f64 / 1e6,
        report.model.seq_len,
        format_bytes(budget.host_bytes),
        budget.headroom * 100.0,
        escape(&ran_on),
        report.trials.len(),
        regimes.len()
    );
}

/// Where memory did not grow with the batch, if anywhere.
fn non_monotone_list(s: &mut String, choice: &Choice) {
    if choice.non_monotone.is_empty() {
        return;
    }
    s.push_str("<h3 id=\"non-monotone\">Where memory did not grow with the batch</h3>\n<ul class=\"note\">\n");
    for n in &choice.non_monotone {
        let _ = writeln!(
            s,
            "<li>{}: micro-batch {} to {}: {}</li>",
            escape(&n.regime.to_string()),
            n.smaller,
            n.larger,
            escape(&n.what)
        );
    }
    s.push_str("</ul>\n");
}

/// The settings whose accumulation was predicted not to fit, if any: their trials fitted, so
/// the evidence alone would not say why they were passed over.
fn ruled_out_list(s: &mut String, choice: &Choice) {
    if choice.ruled_out.is_empty() {
        return;
    }
    s.push_str(
        "<h3 id=\"ruled-out\">Not verified: accumulation would not fit</h3>\n<ul class=\"note\">\n",
    );
    for r in &choice.ruled_out {
        let _ = writeln!(
            s,
            "<li>{}: its trial peaked at {}, and accumulating adds about {} of summed gradients</li>",
            escape(&r.knobs.to_string()),
            format_bytes(r.measured_gpu_bytes),
            format_bytes(r.added_bytes as u64)
        );
    }
    s.push_str("</ul>\n");
}

fn chosen_section(s: &mut String, report: &Report) {
    s.push_str("<section id=\"plan\">\n<h2>The chosen setting</h2>\n");
    let Some(knobs) = report.chosen else {
        s.push_str("<p class=\"note\" id=\"no-plan\">No feasible setting was found: every trial ran out of memory, failed, or peaked above the usable budget.</p>\n</section>\n");
        return;
    };
    let mut rows: Vec<(String, String)> = vec![("setting".into(), knobs.to_string())];
    if let Some(m) = report.chosen_measurement() {
        rows.push((
            "measured".into(),
            format!(
                "{:.0} tokens/s{}, {:.1} ms a step, {}",
                m.tokens_per_s,
                m.interval_text(),
                m.step_time_median_s * 1e3,
                peaks(report, Some(m.peak_gpu_bytes), Some(m.peak_host_bytes))
            ),
        ));
    }
    if let Some(choice) = &report.choice {
        choice_rows(&mut rows, choice, report);
    }
    table(
        s,
        "plan",
        &["", ""],
        &rows
            .iter()
            .map(|(a, b)| vec![a.clone(), b.clone()])
            .collect::<Vec<_>>(),
        None,
    );
    if let Some(choice) = &report.choice {
        non_monotone_list(s, choice);
        ruled_out_list(s, choice);
    }
    match &report.choice {
        Some(choice) if !choice.alternatives.is_empty() => {
            s.push_str("<h3>Alternatives</h3>\n");
            let rows: Vec<Vec<String>> = choice
                .alternatives
                .iter()
                .map(|a| {
                    vec![
                        a.knobs.to_string(),
                        match a.tokens_per_s_interval {
                            Some([low, high]) if high > low => format!(
                                "{:.0} ±{:.1} %",
                                a.tokens_per_s,
                                50.0 * (high - low) / a.tokens_per_s.max(f64::MIN_POSITIVE)
                            ),
                            _ => format!("{:.0}", a.tokens_per_s),
                        },
                        format_bytes(a.peak_gpu_bytes),
                        format_bytes(a.peak_host_bytes),
                    ]
                })
                .collect();
            let (head, rows) = gpu_column(
                report,
                2,
                &["setting", "tokens/s", "peak GPU", "peak host"],
                rows,
            );
            table(s, "alternatives", &head, &rows, None);
        }
        Some(_) => s.push_str("<p class=\"note\">The plan lists no other feasible setting.</p>\n"),
        None => s.push_str("<p class=\"note\">A recorded profile keeps no alternatives; the regimes below show every trial.</p>\n"),
    }
    s.push_str("</section>\n");
}

fn choice_rows(rows: &mut Vec<(String, String)>, choice: &Choice, report: &Report) {
    let p = &choice.predicted;
    let opt = |b: Option<u64>| b.map_or("-".to_string(), format_bytes);
    rows.push((
        "predicted".into(),
        format!(
            "{} tokens/s, {}",
            p.tokens_per_s
                .map_or("-".to_string(), |t| format!("{t:.0}")),
            peaks(report, p.peak_gpu_bytes, p.peak_host_bytes)
        ),
    ));
    rows.push((
        "headroom left".into(),
        match report.target.kind {
            DeviceKind::Cuda => format!(
                "GPU {}, host {}",
                opt(choice.headroom.gpu_bytes),
                format_bytes(choice.headroom.host_bytes)
            ),
            DeviceKind::Cpu => format!("host {}", format_bytes(choice.headroom.host_bytes)),
        },
    ));
    let pct = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{:.1}%", e * 100.0));
    rows.push((
        "model error (leave-one-out)".into(),
        format!(
            "memory {}, step time {}",
            pct(choice.model_error.memory_loo_rel_error),
            pct(choice.model_error.time_loo_rel_error)
        ),
    ));
    if let Some(p) = &choice.provenance {
        rows.push((
            "measured by".into(),
            format!("{} ({}) on {}", p.engine, p.backend, p.device),
        ));
    }
}

/// "peak GPU …, peak host …", or only the host's where training runs on the CPU.
fn peaks(report: &Report, gpu: Option<u64>, host: Option<u64>) -> String {
    let opt = |b: Option<u64>| b.map_or("-".to_string(), format_bytes);
    match report.target.kind {
        DeviceKind::Cuda => format!("peak GPU {}, peak host {}", opt(gpu), opt(host)),
        DeviceKind::Cpu => format!("peak host {}", opt(host)),
    }
}

/// A table's header and rows without its GPU column (`index`) where training runs on the CPU.
fn gpu_column<'a>(
    report: &Report,
    index: usize,
    head: &[&'a str],
    mut rows: Vec<Vec<String>>,
) -> (Vec<&'a str>, Vec<Vec<String>>) {
    let mut head = head.to_vec();
    if report.target.kind == DeviceKind::Cpu {
        head.remove(index);
        for row in &mut rows {
            row.remove(index);
        }
    }
    (head, rows)
}

fn overview(s: &mut String, report: &Report, regimes: &[RegimeView]) {
    s.push_str("<section id=\"regimes\">\n<h2>Regimes</h2>\n");
    let rows: Vec<Vec<String>> = regimes
        .iter()
        .map(|v| {
            let fits = v
                .trials
                .iter()
                .filter(|t| t.outcome.measurement().is_some())
                .count();
            vec![
                format!(
                    "<a href=\"#regime-{}\">{}</a>",
                    v.slug(),
                    escape(&v.regime.to_string())
                ),
                v.trials.len().to_string(),
                fits.to_string(),
                v.first_oom.map_or("-".to_string(), |b| b.to_string()),
                v.best
                    .map_or("-".to_string(), |(b, r)| format!("{r:.0} at {b}")),
                memory_error(v.fit.memory.as_ref(), report),
            ]
        })
        .collect();
    let chosen = regimes.iter().position(|v| v.chosen);
    table_raw(
        s,
        "overview",
        &[
            "regime",
            "trials",
            "fitted",
            "first OOM",
            "best tokens/s",
            "memory model error",
        ],
        &rows,
        chosen,
    );
    s.push_str("</section>\n");
}

fn memory_error(model: Option<&MemoryModel>, report: &Report) -> String {
    match model.and_then(|m| m.loo_rel_error(&report.budget)) {
        Some(e) => format!("{:.1}%", e * 100.0),
        None => "-".into(),
    }
}

fn regime_section(s: &mut String, report: &Report, view: &RegimeView, index: usize) {
    let _ = write!(
        s,
        "<section class=\"regime{}\" id=\"regime-{}\" data-regime=\"{}\" data-index=\"{index}\">\n<h2>{}{}</h2>\n",
        if view.chosen { " chosen" } else { "" },
        view.slug(),
        escape(&view.regime.to_string()),
        escape(&view.regime.to_string()),
        if view.chosen { " (chosen)" } else { "" }
    );
    let _ = write!(
        s,
        "<p class=\"fit\">{}</p>\n<div class=\"charts\">\n",
        escape(&fit_sentence(view, report))
    );
    let on_gpu = report.target.kind == DeviceKind::Cuda;
    if on_gpu {
        s.push_str(&memory_chart(report, view, MemoryKind::Gpu).to_svg());
        s.push('\n');
    }
    s.push_str(&memory_chart(report, view, MemoryKind::Host).to_svg());
    s.push('\n');
    match throughput_chart(report, view) {
        Some(chart) => s.push_str(&chart.to_svg()),
        None => s.push_str(
            "<p class=\"note\">No trial of this regime fitted: no throughput to show.</p>",
        ),
    }
    s.push_str("\n</div>\n");
    let rows: Vec<Vec<String>> = view.trials.iter().map(trial_row).collect();
    let chosen = report
        .chosen
        .and_then(|k| view.trials.iter().rposition(|t| t.request.knobs == k));
    let (head, rows) = gpu_column(
        report,
        4,
        &[
            "micro-batch",
            "accumulation",
            "outcome",
            "tokens/s",
            "peak GPU",
            "peak host",
        ],
        rows,
    );
    table(s, "trials", &head, &rows, chosen);
    s.push_str("</section>\n");
}

fn fit_sentence(view: &RegimeView, report: &Report) -> String {
    let Some(model) = &view.fit.memory else {
        return "Too few micro-batches fitted for a memory model (it needs two).".into();
    };
    let law = |fixed: f64, per: f64| {
        format!(
            "{} + {} per sequence",
            format_bytes(fixed.max(0.0) as u64),
            format_bytes(per.max(0.0) as u64)
        )
    };
    let error = |e: Option<f64>| {
        e.map_or("not enough points to hold one out".to_string(), |e| {
            format!("leave-one-out error {:.1}%", e * 100.0)
        })
    };
    let host = format!(
        "host {} ({})",
        law(model.host.fixed_bytes, model.host.per_sample_bytes),
        error(model.host_loo_rel_error)
    );
    if report.target.kind == DeviceKind::Cuda {
        format!(
            "Memory model over {} trials: GPU {} ({}); {host}.",
            model.points,
            law(model.gpu.fixed_bytes, model.gpu.per_sample_bytes),
            error(model.gpu_loo_rel_error)
        )
    } else {
        format!("Memory model over {} trials: {host}.", model.points)
    }
}

fn trial_row(t: &TrialResult) -> Vec<String> {
    let k = &t.request.knobs;
    let (rate, gpu, host) = match &t.outcome {
        Outcome::Fits(m) => (
            format!("{:.0}{}", m.tokens_per_s, m.interval_text()),
            format_bytes(m.peak_gpu_bytes),
            format_bytes(m.peak_host_bytes),
        ),
        _ => ("-".into(), "-".into(), "-".into()),
    };
    vec![
        k.micro_batch.to_string(),
        k.grad_accum.to_string(),
        outcome_text(&t.outcome),
        rate,
        gpu,
        host,
    ]
}

/// A table of text cells (escaped); `chosen` marks one row.
fn table(s: &mut String, class: &str, head: &[&str], rows: &[Vec<String>], chosen: Option<usize>) {
    let escaped: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| escape(c)).collect())
        .collect();
    table_raw(s, class, head, &escaped, chosen);
}

/// A table of cells that are already HTML.
fn table_raw(
    s: &mut String,
    class: &str,
    head: &[&str],
    rows: &[Vec<String>],
    chosen: Option<usize>,
) {
    let _ = write!(s, "<table class=\"{class}\">\n<thead><tr>");
    for h in head {
        let _ = write!(s, "<th>{}</th>", escape(h));
    }
    s.push_str("</tr></thead>\n<tbody>\n");
    for (i, row) in rows.iter().enumerate() {
        let mark = if chosen == Some(i) {
            " class=\"chosen\""
        } else {
            ""
        };
        let _ = write!(s, "<tr{mark}>");
        for cell in row {
            let numeric =
                cell.chars().next().is_some_and(|c| c.is_ascii_digit()) && !cell.contains(' ');
            let _ = write!(
                s,
                "<td{}>{cell}</td>",
                if numeric { " class=\"num\"" } else { "" }
            );
        }
        s.push_str("</tr>\n");
    }
    s.push_str("</tbody>\n</table>\n");
}
