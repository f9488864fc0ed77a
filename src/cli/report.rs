//! `autotune report`: a plan or a recorded profile as one self-contained HTML page (the core's
//! [`autotune::report`]), written atomically, or on stdout without `--out`.

use std::path::Path;

use autotune::plan::schema::Plan;
use autotune::profile::record::{Profile, PROFILE_KIND};
use autotune::report::Report;
use autotune::settings::show::ReportArgs;

use super::printer::Printer;
use super::Status;

pub fn run(args: ReportArgs, printer: &Printer) -> anyhow::Result<Status> {
    let report = read(&args.input)?;
    let html = report.to_html();
    match &args.out {
        Some(path) => {
            write(path, &html)?;
            printer.status(format!(
                "report of {} ({} trials) written to {}",
                args.input.display(),
                report.trials.len(),
                path.display()
            ));
        }
        None => printer.document(html.trim_end()),
    }
    Ok(Status::Success)
}

/// The report of a plan or a profile, told apart by the profile's `kind` tag.
fn read(path: &Path) -> anyhow::Result<Report> {
    let text = std::fs::read_to_string(path)
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
