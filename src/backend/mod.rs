//! The tensor backend: opening the candle device a run uses, the dtype each precision computes
//! in, device memory as trials measure it ([`memory`], `pool` on CUDA), and what can be
//! detected of the machine ([`detect`]).

pub mod detect;
pub mod host_memory;
pub mod machine;
pub mod memory;
#[cfg(feature = "cuda")]
pub mod pool;

use candle_core::{DType, Device};

use crate::knobs::Precision;
use crate::{Error, Result};

pub use detect::{cuda_device_count, detect_gpu_profile, host_memory_bytes, recorded_device};
pub use memory::memory_meter;

/// The commit this binary was built from, when the build ran in a git checkout.
pub const GIT_REVISION: Option<&str> = option_env!("AUTOTUNE_GIT_REVISION");

/// The provenance of a plan measured by autotune's engine through `backend` (`"live"` or
/// `"replay"`) on the device detected as `device`.
pub fn provenance(backend: &str, device: &str) -> crate::plan::Provenance {
    crate::plan::Provenance {
        engine: crate::plan::Provenance::OWN_ENGINE.into(),
        engine_version: None,
        backend: backend.into(),
        candle_version: Some(CANDLE_VERSION.into()),
        git_revision: GIT_REVISION.map(str::to_string),
        device: device.into(),
        allocator: None,
    }
}

/// The candle release this build trains with, recorded in profiles so that a regression can be
/// traced to a backend upgrade, in plans' provenance and in `--version`. Kept by hand in step
/// with `Cargo.lock` (Cargo exposes no dependency versions at compile time); a test compares
/// the two.
pub const CANDLE_VERSION: &str = "0.11.1";

/// The dtype activations and matrix products run in at `precision`.
pub fn compute_dtype(precision: Precision) -> DType {
    match precision {
        Precision::Fp32 => DType::F32,
        // fp8 runs only the blocks' products in fp8; everything else is bf16.
        Precision::Bf16 | Precision::Fp8 => DType::BF16,
        Precision::Fp16 => DType::F16,
    }
}

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
/// (micro-batch 16). Trials still start from an empty reservation: the prober trims the pool
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
    let pool = pool::default_pool(cuda.cuda_stream().context())?;
    let mut unlimited: u64 = u64::MAX;
    // SAFETY: the release threshold is a `cuuint64_t`, read from `unlimited`.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut unlimited as *mut u64).cast(),
        )
    }
    .map_err(pool::driver)?;
    for policy in [
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
    ] {
        let mut off: i32 = 0;
        // SAFETY: the reuse policies are `int` flags, read from `off`.
        unsafe { result::mem_pool::set_attribute(pool, policy, (&mut off as *mut i32).cast()) }
            .map_err(pool::driver)?;
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
