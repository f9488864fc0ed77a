//! The one prober a live search runs its trials with, chosen from the target, the isolation
//! and the backend: autotune's engine, or a trial runner.

use anyhow::Context;
use candle_core::Device;

use autotune::backend;
use autotune::dist::probe::{ByDegree, DataParallelProber};
use autotune::plan::Provenance;
use autotune::probe::child::ChildProber;
use autotune::probe::exec::ExecProber;
use autotune::probe::job::{device_name, TrialProcesses, TrialSetup};
use autotune::probe::live::LiveProber;
use autotune::probe::worker::WorkerProber;
use autotune::probe::Prober;
use autotune::spec::device::DeviceKind;

use super::config::LiveSearch;
use crate::cli::args::ProbeIsolation;
use crate::cli::printer::Printer;

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
                }
            }
        }
    }

    /// Stops a running trial runner, and everything it started, when autotune is interrupted
    /// (Ctrl-C, SIGTERM, SIGHUP), then exits with 130: the runner runs in a process group of
    /// its own, which the terminal's Ctrl-C does not reach.
    pub fn stop_runner_on_interrupt(&self, printer: &Printer) {
        let Trials::Runner(exec) = self else {
            return;
        };
        let group = exec.running_group();
        let quiet = *printer;
        let installed = ctrlc::set_handler(move || {
            group.stop();
            quiet.status("\ninterrupt: the trial runner was stopped; no plan written");
            std::process::exit(130);
        });
        if let Err(e) = installed {
            printer.warn(format!(
                "cannot install the interrupt handler ({e}); an interrupt may leave the trial \
                 runner running"
            ));
        }
    }
}

/// One-GPU trials isolated as `search.isolation` says; data-parallel trials on their ranks,
/// one process per GPU; or every trial through the search's trial runner.
///
/// Only in-process trials open a device here: with child or worker trials, or a runner, this
/// process opens none, so its CUDA context takes no memory from the trials' (emulated) card.
pub fn live_prober(search: &LiveSearch) -> anyhow::Result<Trials> {
    let target = &search.target;
    let gpu_capacity = target.gpu_memory_bytes;
    let host_budget = Some(target.host_memory_bytes);
    let setup = TrialSetup::new(
        &search.spec,
        device_name(target.kind),
        gpu_capacity,
        host_budget,
    );
    if let Some(runner) = &search.runner {
        let trials =
            TrialProcesses::new(runner.clone(), setup).with_timeout(search.trial_timeout.clone());
        let exec =
            ExecProber::new(trials).fresh_per_trial(search.isolation == ProbeIsolation::Child);
        return Ok(Trials::Runner(Box::new(exec)));
    }
    let exe = std::env::current_exe().context("cannot locate the autotune executable")?;
    if target.kind == DeviceKind::Cuda && search.isolation != ProbeIsolation::InProcess {
        backend::require_cuda_build()?;
    }
    let processes = TrialProcesses::new(exe, setup).with_timeout(search.trial_timeout.clone());
    let single: Box<dyn Prober> = match search.isolation {
        ProbeIsolation::InProcess => {
            let device = match target.kind {
                DeviceKind::Cuda => backend::open("cuda")?,
                DeviceKind::Cpu => Device::Cpu,
            };
            let meter = backend::memory_meter(&device, gpu_capacity)?;
            Box::new(LiveProber::new(&search.spec, &device, host_budget, meter))
        }
        ProbeIsolation::Child => Box::new(ChildProber::new(processes.clone())),
        ProbeIsolation::Worker => Box::new(WorkerProber::new(processes.clone())),
    };
    let ranks = DataParallelProber::new(processes);
    Ok(Trials::Engine(Box::new(ByDegree::new(single, ranks))))
}
