//! `autotune check`: re-run a recorded profile's trials and report regressions.
//!
//! The settings and the fresh trials are the library's ([`autotune::settings::check`],
//! [`autotune::session::check`]), the verdicts and their tolerances the core's
//! ([`autotune::profile::check`]); this file renders progress on stderr and prints the table
//! (or one JSON document) on stdout. Exit code 1 when any setting regressed.

use std::path::Path;

use serde::Serialize;

use autotune::probe::runner::RunningGroup;
use autotune::profile::check::CheckReport;
use autotune::search::report::Reporter;
use autotune::session::check::{self, CheckObserver};
use autotune::settings::check::{CheckArgs, CheckSettings};

use super::interrupt::stop_runner_on_interrupt;
use super::printer::Printer;
use super::reporters::check::{announce, table, CheckProgress};
use super::Status;

/// The JSON document of `check --json`.
#[derive(Serialize)]
struct CheckOutput<'a> {
    profile: &'a Path,
    backend: String,
    passed: bool,
    #[serde(flatten)]
    report: &'a CheckReport,
}

/// Runs `autotune check`.
pub fn run(args: CheckArgs, printer: &Printer) -> anyhow::Result<Status> {
    let settings = CheckSettings::from_args(&args)?;
    announce(&settings.profile, printer);
    let observer = OnStderr {
        printer: *printer,
        trials: settings.profile.trials.len(),
        gpu: settings.profile.budget.gpu_bytes.is_some(),
    };
    let checked = check::run(&settings, &observer)?;
    let report = &checked.report;
    printer.data_json(&CheckOutput {
        profile: &settings.path,
        backend: checked.backend,
        passed: report.passed(),
        report,
    });
    printer.data_text(table(report, observer.gpu));
    if report.passed() {
        printer.status("check passed: no regression beyond the tolerances");
        Ok(Status::Success)
    } else if report.compared() == 0 {
        printer.status(format!(
            "check failed: none of the {} settings could be compared (all missing)",
            report.settings.len()
        ));
        Ok(Status::Negative)
    } else {
        printer.status(format!(
            "check failed: {} of {} settings regressed",
            report.regressions,
            report.settings.len()
        ));
        Ok(Status::Negative)
    }
}

/// The check's news on stderr.
struct OnStderr {
    printer: Printer,
    trials: usize,
    gpu: bool,
}

impl CheckObserver for OnStderr {
    fn runner_starting(&self, group: RunningGroup) {
        stop_runner_on_interrupt(group, &self.printer);
    }

    fn other_hardware(&self, recorded: &str, here: &str) {
        self.printer.warn(format!(
            "recorded on {recorded}, checking on {here}: differences may be the hardware's"
        ));
    }

    fn trials_progress(&self) -> Box<dyn Reporter + '_> {
        Box::new(CheckProgress::new(&self.printer, self.trials, self.gpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotune::profile::check::Tolerance;

    #[test]
    fn the_help_states_the_tolerances_the_report_applies() {
        use clap::CommandFactory;
        let mut command = crate::cli::args::Cli::command();
        let check = command.find_subcommand_mut("check").expect("check exists");
        let help = check.render_long_help().to_string();
        let t = Tolerance::default();
        let z = format!("{} standard errors", t.significance_z);
        let floor = format!("{} MiB", t.memory_floor_bytes >> 20);
        assert!(help.contains(&z) && help.contains(&floor), "{help}");
        let report = table(
            &CheckReport {
                settings: Vec::new(),
                regressions: 0,
                improvements: 0,
                missing: 0,
                tolerance: t,
            },
            false,
        );
        assert!(report.contains(&z) && report.contains(&floor), "{report}");
    }
}
