//! Choosing the candle device a command runs on.

use anyhow::{bail, Context};
use candle_core::Device;

/// `cpu`, `cuda` (or `cuda:N`), or `auto`: the first GPU when this build has CUDA and one is
/// present, else the CPU.
pub fn open(name: &str) -> anyhow::Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(cuda(0).unwrap_or(Device::Cpu)),
        _ => {
            let ordinal = match name.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|n| n.parse().ok())
                    .with_context(|| format!("`--device {name}`: expected cuda or cuda:N"))?,
                None => bail!("unknown `--device {name}`; expected cpu, cuda, cuda:N or auto"),
            };
            cuda(ordinal)
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> anyhow::Result<Device> {
    Device::new_cuda(ordinal).with_context(|| format!("cannot open CUDA device {ordinal}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> anyhow::Result<Device> {
    bail!("this build has no CUDA support; rebuild with `cargo build --release --features cuda`")
}

/// A short name for messages and JSON.
pub fn describe(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// The device-memory meter for `device`; with `capacity`, the GPU is made to behave as one of
/// that many bytes (the rest held back), so that out-of-memory happens where it would there.
pub fn memory_meter(
    device: &Device,
    capacity: Option<u64>,
) -> anyhow::Result<Box<dyn autotune::probe::live::DeviceMemory>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let mut meter = autotune::probe::gpu_memory::PoolMemory::new(device)?;
            if let Some(capacity) = capacity {
                let held = meter.emulate_capacity(capacity)?;
                tracing::info!(capacity, held, "emulating a smaller GPU");
            }
            Ok(Box::new(meter))
        }
        _ => {
            if capacity.is_some() {
                bail!("`--gpu-capacity` needs a CUDA device; this run is on {}", describe(device));
            }
            Ok(Box::new(autotune::probe::live::NoDeviceMemory))
        }
    }
}
