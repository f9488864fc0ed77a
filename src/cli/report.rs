//! `autotune report`: a plan or a recorded profile as one self-contained HTML page (the core's
//! [`autotune::report`]), or a training run's metrics log as its loss curves, written
//! atomically, or on stdout without `--out`.

use std::path::Path;

use autotune::outputs::check_outputs;
use autotune::plan::schema::Plan;
use autotune::profile::record::{Profile, PROFILE_KIND};
use autotune::report::curves::{CurvePoint, TrainingCurves};
use autotune::report::Report;
use autotune::settings::show::ReportArgs;
use autotune::train::metrics::parse_log;

use super::printer::Printer;
use super::Status;

pub fn run(args: ReportArgs, printer: &Printer) -> anyhow::Result<Status> {
    if let Some(out) = &args.out {
        check_outputs(&[("--out", out)], &[("`autotune report`", &args.input)])?;
    }
    let (html, what) = match read_metrics(&args.input)? {
        Some(curves) => (curves.to_html(), format!("{} steps", curves.points.len())),
        None => {
            let report = read(&args.input)?;
            (report.to_html(), format!("{} trials", report.trials.len()))
        }
    };
    match &args.out {
        Some(path) => {
            write(path, &html)?;
            printer.status(format!(
                "report of {} ({what}) written to {}",
                args.input.display(),
                path.display()
            ));
        }
        None => printer.document(html.trim_end()),
    }
    Ok(Status::Success)
}

/// The curves of a metrics log; `None` when the file is no metrics log (its first line is
/// no JSON object with a `step`): a plan or a profile.
fn read_metrics(path: &Path) -> anyhow::Result<Option<TrainingCurves>> {
    let text = autotune::input_file::read_to_string(path, autotune::input_file::WHOLE)
        .map_err(|e| autotune::Error::file("cannot read plan, profile or metrics log", path, e))?;
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let is_step = serde_json::from_str::<serde_json::Value>(first)
        .ok()
        .is_some_and(|v| v.get("step").is_some() && v.get("tokens_per_s").is_some());
    if !is_step {
        return Ok(None);
    }
    let points = parse_log(&text, path)?
        .iter()
        .map(|line| CurvePoint {
            step: line.step,
            loss: line.loss,
            eval_loss: line.eval_loss,
            lr: line.lr,
            tokens_per_s: line.tokens_per_s,
        })
        .collect();
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(Some(TrainingCurves { name, points }))
}

/// The report of a plan or a profile, told apart by the profile's `kind` tag.
fn read(path: &Path) -> anyhow::Result<Report> {
    let text = autotune::input_file::read_to_string(path, autotune::input_file::DOCUMENT_LIMIT)
        .map_err(|e| autotune::Error::file("cannot read plan or profile", path, e))?;
    let is_profile = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .is_some_and(|v| v.get("kind").and_then(|k| k.as_str()) == Some(PROFILE_KIND));
    let invalid = |what: &'static str, e: autotune_core::Error| {
        autotune_core::Error::file(
            what,
            path,
            Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
        )
    };
    Ok(if is_profile {
        Report::from_profile(&Profile::from_json(&text).map_err(|e| invalid("invalid profile", e))?)
    } else {
        Report::from_plan(&Plan::from_json(&text).map_err(|e| invalid("invalid plan", e))?)
    })
}

/// Writes `html` to `path` atomically.
pub fn write(path: &Path, html: &str) -> anyhow::Result<()> {
    autotune::atomic_file::write(path, html.as_bytes())
        .map_err(|e| autotune::Error::file("cannot write report", path, e))?;
    Ok(())
}
