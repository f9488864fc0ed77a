//! `autotune check`: re-run a recorded profile's trials and report regressions.
//!
//! The verdicts and their tolerances are the library's ([`autotune::profile::check`]); this
//! file chooses where fresh trials come from, renders progress on stderr, and prints the
//! table (or one JSON document) on stdout. Exit code 1 when any setting regressed.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::Serialize;

use autotune::backend::{self, CANDLE_VERSION};
use autotune::dist::probe::{ByDegree, DataParallelProber};
use autotune::probe::live::LiveProber;
use autotune::probe::Prober;
use autotune::profile::check::{
    check, recheck, recorded_answers, CheckReport, SettingCheck, Tolerance, Verdict,
};
use autotune::profile::record::Profile;
use autotune::spec::device::DeviceKind;
use autotune::trial::Phase;

use autotune::probe::exec::ExecProber;
use autotune::probe::job::{device_name, TrialProcesses, TrialSetup};

use autotune::settings::tune::{runner_command, Backend};

use super::interrupt::stop_runner_on_interrupt;
use super::printer::Printer;
use super::reporters::{check_outcome, memory_name, CheckProgress};
use super::Status;

/// Arguments of `autotune check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The recorded profile to check (e.g. profiles/recorded/<device>/<model>.json).
    #[arg(long)]
    pub profile: PathBuf,
    /// Where fresh trials come from: `live` runs them on this machine, emulating the profile's
    /// device (its GPU capacity and host budget); `exec` asks them of the trial runner given
    /// after `--` (for a profile recorded through one); `replay:PATH` answers them from another
    /// recorded profile, to compare two recordings.
    #[arg(long, default_value = "live")]
    pub backend: Backend,
    /// The trial runner of `--backend exec` and its arguments, after `--`.
    #[arg(last = true, value_name = "RUNNER")]
    pub runner: Vec<String>,
    /// Device for live trials: auto (the kind the profile was recorded on), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Print the report as one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
    /// Smallest relative step-time change that counts: a change must exceed this fraction or 3
    /// standard errors of the medians, whichever is larger.
    #[arg(long, default_value_t = Tolerance::DEFAULT_TIME_THRESHOLD)]
    pub time_tolerance: f64,
    /// Smallest relative peak-memory change that counts: a change must exceed this fraction of
    /// the recorded peak or 64 MiB, whichever is larger.
    #[arg(long, default_value_t = Tolerance::DEFAULT_MEMORY_THRESHOLD)]
    pub memory_tolerance: f64,
}

/// The JSON document of `check --json`.
#[derive(Serialize)]
struct CheckOutput<'a> {
    profile: &'a Path,
    backend: String,
    passed: bool,
    #[serde(flatten)]
    report: &'a CheckReport,
}

/// `check`'s arguments, resolved and checked before any trial runs.
struct CheckConfig {
    profile: Profile,
    tolerance: Tolerance,
}

impl CheckConfig {
    fn from_args(args: &CheckArgs) -> anyhow::Result<Self> {
        for (flag, value) in [
            ("--time-tolerance", args.time_tolerance),
            ("--memory-tolerance", args.memory_tolerance),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                anyhow::bail!("{flag} ({value}) must be a non-negative fraction, e.g. 0.05 for 5%");
            }
        }
        let tolerance = Tolerance {
            time_threshold: args.time_tolerance,
            memory_threshold: args.memory_tolerance,
            ..Tolerance::default()
        };
        tolerance.validate()?;
        let profile = Profile::load(&args.profile)?;
        if profile.trials.is_empty() {
            anyhow::bail!(
                "`{}` holds no trials, so there is nothing to check against; record one with `autotune tune --record`",
                args.profile.display()
            );
        }
        Ok(Self { profile, tolerance })
    }
}

/// Runs `autotune check`.
pub fn run(args: CheckArgs, printer: &Printer) -> anyhow::Result<Status> {
    let CheckConfig { profile, tolerance } = CheckConfig::from_args(&args)?;
    // A runner given to another backend is refused before any trial.
    runner_command(&args.backend, &args.runner)?;
    announce(&profile, printer);
    let gpu = profile.budget.gpu_bytes.is_some();
    let (fresh, backend_name) = match &args.backend {
        Backend::Replay(path) => {
            let other = Profile::load(path)?;
            if let Some(why) = profile.setup_differs(&other) {
                anyhow::bail!(
                    "cannot compare `{}` with `{}`: {why}; compare recordings of one model on one device",
                    args.profile.display(),
                    path.display()
                );
            }
            (recorded_answers(&profile, &other), args.backend.to_string())
        }
        Backend::Live => {
            if let Some(engine) = &profile.engine {
                anyhow::bail!(
                    "`{}` was recorded through a trial runner on the {engine} engine, which \
                     autotune's engine does not measure; re-measure it with the same runner: \
                     `autotune check --profile {} --backend exec -- RUNNER ARGS...`",
                    args.profile.display(),
                    args.profile.display()
                );
            }
            let reporter = CheckProgress::new(printer, profile.trials.len(), gpu);
            let (mut prober, name) = live_trials(&args, &profile, printer)?;
            (recheck(&profile, prober.as_mut(), &reporter)?, name)
        }
        Backend::Exec => {
            let Some(runner) = runner_command(&args.backend, &args.runner)? else {
                anyhow::bail!("--backend exec needs the trial runner after `--`");
            };
            let name = format!("exec:{}", runner.display());
            let setup = TrialSetup::new(
                &profile.model,
                device_name(profile.device.target.kind),
                profile.budget.gpu_bytes,
                Some(profile.budget.host_bytes),
            );
            let mut exec = ExecProber::new(TrialProcesses::new(runner, setup))
                .expecting_engine(profile.engine_name());
            stop_runner_on_interrupt(exec.running_group(), printer);
            let reporter = CheckProgress::new(printer, profile.trials.len(), gpu);
            (recheck(&profile, &mut exec, &reporter)?, name)
        }
    };
    let report = check(&profile, &fresh, tolerance);
    printer.data_json(&CheckOutput {
        profile: &args.profile,
        backend: backend_name,
        passed: report.passed(),
        report: &report,
    });
    printer.data_text(table(&report, gpu));
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

/// What is checked, against which build.
fn announce(profile: &Profile, printer: &Printer) {
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

/// The prober of fresh trials on this machine, emulating the profile's device (data-parallel
/// settings on as many ranks as they were recorded on), and its name for the report.
fn live_trials(
    args: &CheckArgs,
    profile: &Profile,
    printer: &Printer,
) -> anyhow::Result<(Box<dyn Prober>, String)> {
    let device = open_device(&args.device, profile, printer)?;
    let meter = backend::memory_meter(&device, profile.budget.gpu_bytes)?;
    let host_budget = Some(profile.budget.host_bytes);
    let single = LiveProber::new(&profile.model, &device, host_budget, meter);
    let exe = std::env::current_exe()
        .map_err(|e| anyhow::anyhow!("cannot locate the autotune executable: {e}"))?;
    let setup = TrialSetup::new(
        &profile.model,
        backend::describe(&device),
        profile.budget.gpu_bytes,
        host_budget,
    );
    let ranks = DataParallelProber::new(TrialProcesses::new(exe, setup));
    let name = format!("live:{}", backend::describe(&device));
    Ok((Box::new(ByDegree::new(Box::new(single), ranks)), name))
}

/// Opens the device for live trials; `auto` means the kind the profile was recorded on, and a
/// device of another kind is refused (its numbers would not be comparable).
fn open_device(name: &str, profile: &Profile, printer: &Printer) -> anyhow::Result<Device> {
    let kind = profile.device.target.kind;
    let name = match (name, kind) {
        ("auto", DeviceKind::Cpu) => "cpu",
        ("auto", DeviceKind::Cuda) => "cuda",
        (name, _) => name,
    };
    let device = backend::open(name)?;
    let now = match &device {
        Device::Cpu => DeviceKind::Cpu,
        _ => DeviceKind::Cuda,
    };
    if now != kind {
        anyhow::bail!(
            "the profile was recorded on a {} device ({}), but --device {name} is a {}: their \
             trials are not comparable; pass --device {}",
            kind_name(kind),
            profile.device.name,
            kind_name(now),
            kind_name(kind)
        );
    }
    if kind == DeviceKind::Cuda {
        // Only for a warning: a GPU that cannot be named does not stop the check.
        if let Ok(Some(here)) = backend::detect_gpu_profile() {
            if here.name != profile.device.name {
                printer.warn(format!(
                    "recorded on {}, checking on {}: differences may be the hardware's",
                    profile.device.name, here.name
                ));
            }
        }
    }
    Ok(device)
}

fn kind_name(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
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
fn table(report: &CheckReport, gpu: bool) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
