//! What can be detected of this machine: its GPUs through NVML, its host memory, and the
//! device a recorded profile names.

use crate::spec::device::DeviceSpec;
#[cfg(feature = "cuda")]
use crate::Error;
use crate::Result;

/// A profile of this machine's first GPU, read through NVML; `None` when this build has no
/// CUDA, NVML is unavailable, or there is no GPU.
pub fn detect_gpu_profile() -> Result<Option<DeviceSpec>> {
    #[cfg(feature = "cuda")]
    {
        let Ok(nvml) = nvml_wrapper::Nvml::init() else {
            tracing::warn!("NVML is unavailable; planning for the CPU");
            return Ok(None);
        };
        let Ok(gpu) = nvml.device_by_index(0) else {
            return Ok(None);
        };
        let name = gpu.name().unwrap_or_else(|_| "cuda".into());
        let memory = gpu.memory_info().map_err(|e| {
            Error::invalid(
                "device",
                "--device auto",
                format!("NVML cannot read GPU memory: {e}"),
            )
        })?;
        let driver = nvml.sys_driver_version().ok();
        // GPUs like the first one (same name and size) are the ones data parallelism can use.
        let count = nvml.device_count().unwrap_or(1);
        let alike = (0..count)
            .filter_map(|i| nvml.device_by_index(i).ok())
            .filter(|d| {
                d.name().ok().as_deref() == Some(name.as_str())
                    && d.memory_info().is_ok_and(|m| m.total == memory.total)
            })
            .count()
            .max(1);
        Ok(Some(DeviceSpec {
            name,
            kind: crate::spec::device::DeviceKind::Cuda,
            gpu_memory_bytes: Some(memory.total),
            gpu_count: alike,
            host_memory_bytes: host_memory_bytes().unwrap_or(32 << 30),
            host_to_device_gbps: None,
            fp8_tensor_cores: gpu
                .cuda_compute_capability()
                .is_ok_and(|c| crate::spec::device::has_fp8_tensor_cores_at(c.major, c.minor)),
            notes: Some(format!(
                "detected through NVML{}",
                driver.map(|d| format!(", driver {d}")).unwrap_or_default()
            )),
        }))
    }
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// CUDA devices this process can open (`CUDA_VISIBLE_DEVICES` applies); 0 without CUDA.
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
            .map_or(0, |n| n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// Total host memory from `/proc/meminfo`, where the platform has it.
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The machine trials run on, for recorded profiles: the target profile plus what is detected.
pub fn recorded_device(
    on_gpu: bool,
    target: &DeviceSpec,
) -> crate::profile::record::RecordedDevice {
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut recorded = crate::profile::record::RecordedDevice::new(
        target.clone(),
        if on_gpu { "cuda" } else { "cpu" },
    );
    #[cfg(feature = "cuda")]
    if on_gpu {
        if let Ok(nvml) = nvml_wrapper::Nvml::init() {
            if let Ok(gpu) = nvml.device_by_index(0) {
                recorded.name = gpu.name().unwrap_or_else(|_| "cuda".into());
                recorded.memory_bytes = gpu.memory_info().ok().map(|m| m.total);
            }
            recorded.driver = nvml.sys_driver_version().ok();
            recorded.cuda = nvml
                .sys_cuda_driver_version()
                .ok()
                .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
        }
    }
    recorded
}
