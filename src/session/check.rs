//! A check's fresh trials, from where its settings say (this machine, emulating the recorded
//! device; a trial runner; another recording), compared with the recording by the core's
//! verdicts ([`crate::profile::check`](mod@crate::profile::check)).

use candle_core::Device;

use crate::backend;
use crate::dist::probe::{ByDegree, DataParallelProber};
use crate::probe::exec::ExecProber;
use crate::probe::job::{device_name, TrialProcesses, TrialSetup};
use crate::probe::live::LiveProber;
use crate::probe::runner::RunningGroup;
use crate::probe::watchdog::Watchdog;
use crate::probe::Prober;
use crate::profile::check::{check, recheck, recorded_answers, CheckReport};
use crate::profile::record::Profile;
use crate::search::report::Reporter;
use crate::settings::check::{CheckSettings, FreshTrials};
use crate::spec::device::DeviceKind;
use crate::{Error, Result};

/// Receives what a check does as it goes.
pub trait CheckObserver {
    /// Fresh trials are about to run through a trial runner, in process group `group` (a
    /// group of its own, which a terminal's Ctrl-C does not reach).
    fn runner_starting(&self, group: RunningGroup);
    /// The checking GPU is another model than the recording's: differences may be the
    /// hardware's.
    fn other_hardware(&self, recorded: &str, here: &str);
    /// A reporter for the fresh trials, made before the first runs.
    fn trials_progress(&self) -> Box<dyn Reporter + '_>;
}

/// What a check found.
#[derive(Debug)]
pub struct Checked {
    /// Every setting's verdict.
    pub report: CheckReport,
    /// Where the fresh trials came from (`live:DEVICE`, `exec:RUNNER`, `replay:PATH`).
    pub backend: String,
}

/// Runs the check `settings` describe.
pub fn run(settings: &CheckSettings, observer: &dyn CheckObserver) -> Result<Checked> {
    let profile = &settings.profile;
    let (fresh, backend) = match &settings.fresh {
        FreshTrials::Replay { other, .. } => {
            (recorded_answers(profile, other), settings.backend.clone())
        }
        FreshTrials::Live { device } => {
            let (mut prober, name) = live_trials(device, profile, observer)?;
            let progress = observer.trials_progress();
            (recheck(profile, prober.as_mut(), progress.as_ref())?, name)
        }
        FreshTrials::Exec(runner) => {
            let name = format!("exec:{}", runner.display());
            let setup = TrialSetup::new(
                &profile.model,
                device_name(profile.device.target.kind),
                profile.budget.gpu_bytes,
                Some(profile.budget.host_bytes),
            );
            let exe = std::env::current_exe()
                .map_err(|e| Error::Usage(format!("cannot locate the autotune executable: {e}")))?;
            let mut exec = ExecProber::new(TrialProcesses::new(runner.clone(), setup))
                .expecting_engine(profile.engine_name())
                .watched_by(Watchdog::start(&exe)?);
            observer.runner_starting(exec.running_group());
            let progress = observer.trials_progress();
            (recheck(profile, &mut exec, progress.as_ref())?, name)
        }
    };
    Ok(Checked {
        report: check(profile, &fresh, settings.tolerance),
        backend,
    })
}

/// The prober of fresh trials on this machine, emulating the profile's device (data-parallel
/// settings on as many ranks as they were recorded on), and its name for the report.
fn live_trials(
    device: &str,
    profile: &Profile,
    observer: &dyn CheckObserver,
) -> Result<(Box<dyn Prober>, String)> {
    let device = open_device(device, profile, observer)?;
    let meter = backend::memory_meter(&device, profile.budget.gpu_bytes)?;
    let host_budget = Some(profile.budget.host_bytes);
    let single = LiveProber::new(&profile.model, &device, host_budget, meter);
    let exe = std::env::current_exe()
        .map_err(|e| Error::Usage(format!("cannot locate the autotune executable: {e}")))?;
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
fn open_device(name: &str, profile: &Profile, observer: &dyn CheckObserver) -> Result<Device> {
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
        return Err(Error::Usage(format!(
            "the profile was recorded on a {} device ({}), but --device {name} is a {}: their \
             trials are not comparable; pass --device {}",
            device_name(kind),
            profile.device.name,
            device_name(now),
            device_name(kind)
        )));
    }
    if kind == DeviceKind::Cuda {
        // Only for a warning: a GPU that cannot be named does not stop the check.
        if let Ok(Some(here)) = backend::detect_gpu_profile() {
            if here.name != profile.device.name {
                observer.other_hardware(&profile.device.name, &here.name);
            }
        }
    }
    Ok(device)
}
