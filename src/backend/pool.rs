//! Device memory on CUDA: the memory pool's exact high-water mark, and capacity emulation.
//!
//! cudarc allocates every candle tensor from the device's default memory pool
//! (`cuMemAllocAsync`). The pool's `RESERVED_MEM_HIGH` attribute is the peak of memory the pool
//! took from the device, resettable before each trial. That, not `USED_MEM_HIGH` (bytes handed
//! to tensors), is what runs out: on the H200 emulating a 24 GiB card, a setting whose used
//! peak was 1.3 GiB below the capacity ran out of memory on a re-run, the difference being
//! fragmentation inside the pool's reservation. The CUDA context and cuBLAS workspaces live
//! outside the pool; they are measured as what the driver reports in use minus the pool's
//! reservation and the emulation hold-back, and added to the peak.
//!
//! Opening the device tells the pool to keep freed memory and to reuse it in stream order only
//! ([`super::open`]), so a trial's reservation grows as training's will and is the same in
//! every process, whatever ran before; each trial starts from an empty reservation because
//! [`DeviceMemory::reset_peak`] trims the pool first.
//!
//! Emulation: to plan for a smaller card on a larger one, the difference is allocated outside
//! the pool (`cuMemAlloc`) and held, so the pool itself runs out of memory at the target's size
//! and CUDA reports a real out-of-memory, exactly where the smaller card would.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext};
use candle_core::Device;

use super::memory::DeviceMemory;
use crate::{Error, Result};

/// In-use memory before emulation starts above which a warning is logged: more than this
/// process's context and libraries take.
const OTHER_USE_WARNING_BYTES: u64 = 2 << 30;

/// Pool peak measurement and optional capacity hold-back on one CUDA device.
pub struct PoolMemory {
    context: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    held: Option<sys::CUdeviceptr>,
    held_bytes: u64,
}

impl PoolMemory {
    /// Attaches to `device`'s default memory pool.
    #[allow(unsafe_code)]
    pub fn new(device: &Device) -> Result<Self> {
        let cuda = device.as_cuda_device()?;
        let context = cuda.cuda_stream().context().clone();
        let pool = default_pool(&context)?;
        Ok(Self {
            context,
            pool,
            held: None,
            held_bytes: 0,
        })
    }

    /// Total and free device bytes as the driver sees them.
    pub fn device_totals(&self) -> Result<(u64, u64)> {
        let (free, total) = self.context.mem_get_info().map_err(driver)?;
        Ok((total as u64, free as u64))
    }

    /// Makes the device behave as if it had `capacity` bytes in total, by holding the rest.
    /// Returns the bytes held. Fails if the device is smaller than `capacity`.
    #[allow(unsafe_code)]
    pub fn emulate_capacity(&mut self, capacity: u64) -> Result<u64> {
        self.release_hold()?;
        self.trim()?;
        let (total, free) = self.device_totals()?;
        // A target as large as this GPU (or larger: the card itself is the limit) needs no hold.
        let hold = total.saturating_sub(capacity);
        // Memory of other processes is not held back but still missing: the emulated card is
        // then smaller than the target, and trials run out of memory early.
        let in_use = total - free;
        if in_use > OTHER_USE_WARNING_BYTES {
            tracing::warn!(in_use, "the GPU already has memory in use (another process?); emulating {capacity} bytes will leave less than that");
        }
        if hold > 0 {
            if hold > free {
                return Err(Error::invalid(
                    "device spec",
                    "gpu_memory_bytes",
                    format!("emulation needs {hold} free bytes to hold back but only {free} are free; is another process using the GPU?"),
                ));
            }
            self.context.bind_to_thread().map_err(driver)?;
            // SAFETY: plain device allocation; freed in `release_hold`/`Drop`, never read or written.
            let ptr = unsafe { result::malloc_sync(hold as usize) }.map_err(driver)?;
            self.held = Some(ptr);
        }
        self.held_bytes = hold;
        Ok(hold)
    }

    #[allow(unsafe_code)]
    fn release_hold(&mut self) -> Result<()> {
        if let Some(ptr) = self.held.take() {
            self.context.bind_to_thread().map_err(driver)?;
            // SAFETY: `ptr` came from `malloc_sync` and is freed once.
            unsafe { result::free_sync(ptr) }.map_err(driver)?;
        }
        self.held_bytes = 0;
        Ok(())
    }

    /// Returns the pool's unused reservation to the driver.
    fn trim(&self) -> Result<()> {
        trim(self.pool)
    }

    #[allow(unsafe_code)]
    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the size attributes are `cuuint64_t`, written into `value`.
        unsafe {
            result::mem_pool::get_attribute(self.pool, attr, (&mut value as *mut u64).cast())
        }
        .map_err(driver)?;
        Ok(value)
    }

    /// `(reserved, used)`: bytes the pool holds from the device now, and bytes of it handed out.
    fn pool_bytes(&self) -> Result<(u64, u64)> {
        Ok((
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        ))
    }

    /// Bytes the driver holds for this device outside the pool and the hold-back: the context,
    /// cuBLAS workspaces, modules (and any other process's memory).
    pub fn outside_pool_bytes(&self) -> Result<u64> {
        let (total, free) = self.device_totals()?;
        let reserved =
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        Ok((total - free).saturating_sub(reserved + self.held_bytes))
    }
}

impl DeviceMemory for PoolMemory {
    #[allow(unsafe_code)]
    fn reset_peak(&mut self) -> Result<()> {
        self.context.bind_to_thread().map_err(driver)?;
        // Start each trial from an empty reservation, so its peak is its own.
        self.trim()?;
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water marks may only be reset to zero, passed as a `cuuint64_t`.
            unsafe {
                result::mem_pool::set_attribute(self.pool, attr, (&mut zero as *mut u64).cast())
            }
            .map_err(driver)?;
        }
        // A trial should start from an empty pool; what an earlier trial left behind (still
        // allocated, or reserved and not released by the trim) would distort its peak.
        let (reserved, used) = self.pool_bytes()?;
        tracing::debug!(
            reserved,
            used,
            outside = self.outside_pool_bytes()?,
            "pool at trial start"
        );
        Ok(())
    }

    fn leftover_bytes(&mut self) -> Result<u64> {
        self.context.bind_to_thread().map_err(driver)?;
        self.trim()?;
        let (reserved, used) = self.pool_bytes()?;
        Ok(reserved.max(used))
    }

    fn current_bytes(&mut self) -> Result<Option<u64>> {
        let reserved =
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        Ok(Some(reserved + self.outside_pool_bytes()?))
    }

    fn trace_marks(&mut self, phase: &dyn std::fmt::Display) {
        if !tracing::enabled!(tracing::Level::TRACE) {
            return;
        }
        // A diagnostic: an unreadable attribute shows as 0 rather than failing the trial.
        let read = |attr| self.attribute(attr).unwrap_or(0);
        tracing::trace!(
            %phase,
            used_high = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
            reserved_high = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
            used = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            reserved = read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            outside = self.outside_pool_bytes().unwrap_or(0),
            "pool marks"
        );
    }

    fn peak_bytes(&mut self) -> Result<u64> {
        let high = self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?;
        let used_high = self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
        let outside = self.outside_pool_bytes()?;
        tracing::debug!(reserved_high = high, used_high, outside, "pool peaks");
        Ok(high + outside)
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        // Nothing useful can be done with a failure while dropping; the process is ending.
        let _ = self.release_hold();
    }
}

/// The default memory pool of `context`'s device, which every tensor comes from; binds the
/// context to this thread first.
#[allow(unsafe_code)]
pub(super) fn default_pool(context: &CudaContext) -> Result<sys::CUmemoryPool> {
    context.bind_to_thread().map_err(driver)?;
    // SAFETY: the device handle comes from the live context just bound.
    unsafe { result::device::get_default_mem_pool(context.cu_device()) }.map_err(driver)
}

/// Returns `pool`'s unused reservation to the driver.
#[allow(unsafe_code)]
fn trim(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: a device's default pool lives as long as its context.
    unsafe { result::mem_pool::trim_to(pool, 0) }.map_err(driver)
}

pub(super) fn driver(e: result::DriverError) -> Error {
    Error::Backend(candle_core::Error::Cuda(Box::new(e)))
}
