//! The one prober a live search runs its trials with, chosen from the target, the isolation
//! and the backend: autotune's engine, or a trial runner; and who measured its trials.

use candle_core::Device;

use crate::backend;
use crate::dist::probe::{ByDegree, DataParallelProber};
use crate::plan::Provenance;
use crate::probe::child::ChildProber;
use crate::probe::exec::ExecProber;
use crate::probe::job::{device_name, TrialProcesses, TrialSetup};
use crate::probe::live::LiveProber;
use crate::probe::runner::RunningGroup;
use crate::probe::watchdog::Watchdog;
use crate::probe::worker::WorkerProber;
use crate::probe::Prober;
use crate::settings::tune::{LiveSettings, ProbeIsolation};
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial_protocol::{allocator, RunnerIdentity};

/// Where a live search's trials run.
pub enum Trials {
    /// On autotune's engine, isolated as asked.
    Engine(Box<dyn Prober>),
    /// Through a trial runner.
    Runner(Box<ExecProber>),
}

impl Trials {
    /// The prober the search drives.
    pub fn prober(&mut self) -> &mut dyn Prober {
        match self {
            Trials::Engine(prober) => prober.as_mut(),
            Trials::Runner(exec) => exec.as_mut(),
        }
    }

    /// Who measured the trials, on `device` (as detected here): autotune's engine, or the
    /// engine the runner reported (and the device it saw, when it said).
    pub fn provenance(&self, device: &str) -> Provenance {
        match self {
            Trials::Engine(_) => backend::provenance("live", device),
            Trials::Runner(exec) => {
                let identity = exec.identity();
                Provenance {
                    engine: identity.map_or("unknown".into(), |i| i.engine.clone()),
                    engine_version: identity.and_then(|i| i.engine_version.clone()),
                    backend: "exec".into(),
                    candle_version: None,
                    git_revision: backend::GIT_REVISION.map(str::to_string),
                    device: identity
                        .and_then(|i| i.device.clone())
                        .unwrap_or_else(|| device.to_string()),
                    allocator: runner_allocator(exec),
                }
            }
        }
    }

    /// The process group of the trial runner running now, when trials run through one: it
    /// runs in a group of its own, which a terminal's Ctrl-C does not reach, so whoever handles
    /// an interrupt stops it there.
    pub fn runner_group(&self) -> Option<RunningGroup> {
        match self {
            Trials::Engine(_) => None,
            Trials::Runner(exec) => Some(exec.running_group()),
        }
    }

    /// The allocator setting the trial runner's trials ran under (see
    /// [`Provenance::allocator`]); `None` for autotune's engine.
    pub fn runner_allocator(&self) -> Option<String> {
        match self {
            Trials::Engine(_) => None,
            Trials::Runner(exec) => runner_allocator(exec),
        }
    }

    /// The engine the trial runner reported, and the device it saw, once it has replied;
    /// `None` for autotune's engine.
    pub fn runner_identity(&self) -> Option<&RunnerIdentity> {
        match self {
            Trials::Engine(_) => None,
            Trials::Runner(exec) => exec.identity(),
        }
    }
}

/// The allocator setting `exec`'s runner gets: the value autotune set, empty where it removed
/// the variable (PyTorch's default); `None` where it left the variable as it found it.
fn runner_allocator(exec: &ExecProber) -> Option<String> {
    exec.command()
        .env(allocator::VARIABLE)
        .map(|setting| setting.unwrap_or_default().to_string())
}

/// One-GPU trials isolated as `settings.isolation` says; data-parallel trials on their ranks,
/// one process per GPU; or every trial through the search's trial runner.
///
/// Only in-process trials open a device here: with child or worker trials, or a runner, this
/// process opens none, so its CUDA context takes no memory from the trials' (emulated) card.
pub fn live_prober(settings: &LiveSettings) -> crate::Result<Trials> {
    prober_for(settings, &settings.spec)
}

/// [`live_prober`] for another shape of the model (another sequence length).
pub fn prober_for(settings: &LiveSettings, spec: &ModelSpec) -> crate::Result<Trials> {
    let target = &settings.target;
    let gpu_capacity = target.gpu_memory_bytes;
    let host_budget = Some(target.host_memory_bytes);
    let setup = TrialSetup::new(spec, device_name(target.kind), gpu_capacity, host_budget);
    let exe = std::env::current_exe()
        .map_err(|e| crate::Error::Usage(format!("cannot locate the autotune executable: {e}")))?;
    if let Some(runner) = &settings.runner {
        let trials =
            TrialProcesses::new(runner.clone(), setup).with_timeout(settings.trial_timeout.clone());
        let exec = ExecProber::new(trials)
            .fresh_per_trial(settings.isolation == ProbeIsolation::Child)
            .watched_by(Watchdog::start(&exe)?);
        return Ok(Trials::Runner(Box::new(exec)));
    }
    if target.kind == DeviceKind::Cuda && settings.isolation != ProbeIsolation::InProcess {
        backend::require_cuda_build()?;
    }
    let processes = TrialProcesses::new(exe, setup).with_timeout(settings.trial_timeout.clone());
    let single: Box<dyn Prober> = match settings.isolation {
        ProbeIsolation::InProcess => {
            let device = match target.kind {
                DeviceKind::Cuda => backend::open("cuda")?,
                DeviceKind::Cpu => Device::Cpu,
            };
            let meter = backend::memory_meter(&device, gpu_capacity)?;
            Box::new(LiveProber::new(spec, &device, host_budget, meter))
        }
        ProbeIsolation::Child => Box::new(ChildProber::new(processes.clone())),
        ProbeIsolation::Worker => Box::new(WorkerProber::new(processes.clone())),
    };
    let ranks = DataParallelProber::new(processes);
    Ok(Trials::Engine(Box::new(ByDegree::new(single, ranks))))
}
