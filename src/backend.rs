//! Opening the candle device a run uses, and its device-memory meter.

use candle_core::Device;

use crate::probe::live::{DeviceMemory, NoDeviceMemory};
use crate::spec::device::DeviceProfile;
use crate::{Error, Result};

/// Opens `cpu`, `cuda` (or `cuda:N`), or `auto`: the first GPU when this build has CUDA and one
/// is present, else the CPU.
pub fn open(name: &str) -> Result<Device> {
    let bad = || {
        Error::invalid(
            "device",
            "--device",
            format!("`{name}`: expected cpu, cuda, cuda:N or auto"),
        )
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(cuda(0).unwrap_or(Device::Cpu)),
        _ => {
            let ordinal = match name.strip_prefix("cuda") {
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|n| n.parse().ok())
                    .ok_or_else(bad)?,
                None => return Err(bad()),
            };
            cuda(ordinal)
        }
    }
}

/// Fails as opening a GPU would when this build has no CUDA support; opens nothing.
pub fn require_cuda_build() -> Result<()> {
    if cfg!(feature = "cuda") {
        Ok(())
    } else {
        cuda(0).map(drop)
    }
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    if let Device::Cuda(cuda) = &device {
        // cudarc gives every allocation two CUDA events to order its uses across streams; a
        // training step allocates hundreds of tensors, and creating and destroying their events
        // showed up as idle GPU time. Everything here runs on candle's one stream.
        // SAFETY: no tensor is ever used on a stream other than the device's own, so there is
        // no cross-stream ordering for the events to enforce.
        #[allow(unsafe_code)]
        unsafe {
            cuda.disable_event_tracking()
        };
        configure_pool(cuda)?;
    }
    Ok(device)
}

/// Sets up the device's default memory pool, which every tensor comes from.
///
/// Freed memory is kept (release threshold: unlimited), as PyTorch's caching allocator does.
/// By default the pool returns everything unused to the driver at each synchronisation, and
/// the next step maps it again: on an H200 that cost ~9 ms of every 83 ms gpt-124m step
/// (micro-batch 16). Trials still start from an empty reservation: the probe trims the pool
/// before each one.
///
/// Freed memory is reused in stream order only. The default policy also reuses blocks whose
/// free the device has already passed, which makes what the pool reserves depend on how far
/// the host runs ahead: the same gpt-124m step reserved up to 4.5 GiB more than it used in one
/// run and 0.3 GiB in the next. Every tensor here lives on candle's one stream, so stream order
/// loses no reuse, and the reservation became the same to the byte in every process (0.1–0.3
/// GiB above use without checkpointing), at unchanged speed.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn configure_pool(cuda: &candle_core::CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let context = cuda.cuda_stream().context().clone();
    let failed = |e: result::DriverError| Error::Backend(candle_core::Error::Cuda(Box::new(e)));
    context.bind_to_thread().map_err(failed)?;
    // SAFETY: the device handle comes from the live context just bound.
    let pool =
        unsafe { result::device::get_default_mem_pool(context.cu_device()) }.map_err(failed)?;
    let mut unlimited: u64 = u64::MAX;
    // SAFETY: the release threshold is a `cuuint64_t`, read from `unlimited`.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut unlimited as *mut u64).cast(),
        )
    }
    .map_err(failed)?;
    for policy in [
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
    ] {
        let mut off: i32 = 0;
        // SAFETY: the reuse policies are `int` flags, read from `off`.
        unsafe { result::mem_pool::set_attribute(pool, policy, (&mut off as *mut i32).cast()) }
            .map_err(failed)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> Result<Device> {
    Err(Error::invalid(
        "device",
        "--device",
        "this build has no CUDA support; rebuild with `cargo build --release --features cuda`",
    ))
}

/// A short name for messages and JSON.
pub fn describe(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}

/// The device-memory meter for `device`. With `capacity`, the GPU is made to behave as one of
/// that many bytes (the rest held back), so out-of-memory happens where it would on that card.
pub fn memory_meter(device: &Device, capacity: Option<u64>) -> Result<Box<dyn DeviceMemory>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let mut meter = crate::probe::gpu_memory::PoolMemory::new(device)?;
            if let Some(capacity) = capacity {
                let held = meter.emulate_capacity(capacity)?;
                tracing::info!(capacity, held, "emulating a smaller GPU");
            }
            Ok(Box::new(meter))
        }
        _ => match capacity {
            Some(_) => Err(Error::invalid(
                "device",
                "gpu capacity",
                format!(
                    "emulating a GPU size needs a CUDA device; this run is on {}",
                    describe(device)
                ),
            )),
            None => Ok(Box::new(NoDeviceMemory)),
        },
    }
}

/// A profile of this machine's first GPU, read through NVML; `None` when this build has no
/// CUDA, NVML is unavailable, or there is no GPU.
pub fn detect_gpu_profile() -> Result<Option<DeviceProfile>> {
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
        Ok(Some(DeviceProfile {
            name,
            kind: crate::spec::device::DeviceKind::Cuda,
            gpu_memory_bytes: Some(memory.total),
            gpu_count: alike,
            host_memory_bytes: host_memory_bytes().unwrap_or(32 << 30),
            host_to_device_gbps: None,
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
    target: &DeviceProfile,
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
