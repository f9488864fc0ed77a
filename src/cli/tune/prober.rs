//! The one prober a live search runs its trials with, chosen from the target and the isolation.

use anyhow::Context;
use candle_core::Device;

use autotune::backend;
use autotune::dist::probe::{ByDegree, DataParallelProber};
use autotune::probe::child::ChildProber;
use autotune::probe::live::LiveProber;
use autotune::probe::worker::WorkerProber;
use autotune::probe::Prober;
use autotune::spec::device::DeviceKind;

use super::config::{device_name, LiveSearch};
use crate::cli::args::ProbeIsolation;

/// One-GPU trials isolated as `search.isolation` says; data-parallel trials on their ranks,
/// one process per GPU.
///
/// Only in-process trials open a device here: with child or worker trials this process opens
/// none, so its CUDA context takes no memory from the children's (emulated) card.
pub fn live_prober(search: &LiveSearch) -> anyhow::Result<Box<dyn Prober>> {
    let target = &search.target;
    let device = device_name(target.kind);
    let gpu_capacity = target.gpu_memory_bytes;
    let host_budget = Some(target.host_memory_bytes);
    let exe = std::env::current_exe().context("cannot locate the autotune executable")?;
    if target.kind == DeviceKind::Cuda && search.isolation != ProbeIsolation::InProcess {
        backend::require_cuda_build()?;
    }
    let single: Box<dyn Prober> = match search.isolation {
        ProbeIsolation::InProcess => {
            let device = match target.kind {
                DeviceKind::Cuda => backend::open("cuda")?,
                DeviceKind::Cpu => Device::Cpu,
            };
            let meter = backend::memory_meter(&device, gpu_capacity)?;
            Box::new(LiveProber::new(&search.spec, &device, host_budget, meter))
        }
        ProbeIsolation::Child => Box::new(
            ChildProber::new(exe.clone(), &search.spec, device, gpu_capacity, host_budget)
                .with_timeout(search.trial_timeout.clone()),
        ),
        ProbeIsolation::Worker => Box::new(
            WorkerProber::new(exe.clone(), &search.spec, device, gpu_capacity, host_budget)
                .with_timeout(search.trial_timeout.clone()),
        ),
    };
    let ranks = DataParallelProber::new(exe, &search.spec, device, gpu_capacity, host_budget)
        .with_timeout(search.trial_timeout.clone());
    Ok(Box::new(ByDegree::new(single, ranks)))
}
