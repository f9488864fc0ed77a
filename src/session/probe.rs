//! One trial of `probe`: in this process on the device asked for, or, data-parallel, as one
//! `probe-one` child per rank.

use crate::backend;
use crate::dist::probe::DataParallelProber;
use crate::probe::job::{TrialProcesses, TrialSetup};
use crate::probe::live::LiveProber;
use crate::probe::Prober;
use crate::settings::probe::ProbeSettings;
use crate::trial::TrialResult;
use crate::{Error, Result};

/// What a probe measured, and where.
#[derive(Debug)]
pub struct Probed {
    /// The trial's outcome.
    pub result: TrialResult,
    /// The device it ran on, as people know it (`cpu`, the GPU's name, or the ranks' kind).
    pub device: String,
}

/// Runs the trial `settings` describe; `starting` hears where it runs (the device's name, or
/// `N cpu ranks`) before it starts.
pub fn probe(settings: &ProbeSettings, starting: &dyn Fn(&str)) -> Result<Probed> {
    let degree = settings.request.knobs.data_parallel.degree;
    if degree > 1 {
        return on_ranks(settings, degree, starting);
    }
    let device = backend::open(&settings.device)?;
    let name = backend::describe(&device).to_string();
    starting(&name);
    let memory = backend::memory_meter(&device, settings.gpu_capacity)?;
    let result = LiveProber::new(&settings.spec, &device, settings.host_budget, memory)
        .with_engine(settings.engine)
        .probe(&settings.request)?;
    Ok(Probed {
        result,
        device: name,
    })
}

/// A data-parallel trial: the ranks run as `probe-one` children, one per GPU.
fn on_ranks(settings: &ProbeSettings, degree: usize, starting: &dyn Fn(&str)) -> Result<Probed> {
    let device = match settings.device.as_str() {
        "auto" if backend::cuda_device_count() > 0 => "cuda",
        "auto" | "cpu" => "cpu",
        _ => "cuda",
    };
    crate::dist::probe::check_degree(degree, device, "--data-parallel")?;
    starting(&format!("{degree} {device} ranks"));
    let exe = std::env::current_exe()
        .map_err(|e| Error::Usage(format!("cannot locate the autotune executable: {e}")))?;
    let setup = TrialSetup::new(
        &settings.spec,
        device,
        settings.gpu_capacity,
        settings.host_budget,
    );
    let mut prober = DataParallelProber::new(TrialProcesses::new(exe, setup));
    Ok(Probed {
        result: prober.probe(&settings.request)?,
        device: device.to_string(),
    })
}
