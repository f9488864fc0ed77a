//! Device memory on CUDA: the memory pool's exact high-water mark, and capacity emulation.
//!
//! cudarc allocates every candle tensor from the device's default memory pool
//! (`cuMemAllocAsync`). The pool's `RESERVED_MEM_HIGH` attribute is the peak of memory the pool
//! took from the device, resettable before each probe. That, not `USED_MEM_HIGH` (bytes handed
//! to tensors), is what runs out: on the H200 emulating a 24 GiB card, a setting whose used
//! peak was 1.3 GiB below the capacity ran out of memory on a re-run, the difference being
//! fragmentation inside the pool's reservation. The CUDA context and cuBLAS workspaces live
//! outside the pool; they are measured as what the driver reports in use minus the pool's
//! reservation and the emulation hold-back, and added to the peak.
//!
//! Opening the device tells the pool to keep freed memory (`crate::backend`), as PyTorch's
//! caching allocator does, so a trial's reservation grows as training's will.
//!
//! Each trial gets a new pool ([`DeviceMemory::reset_peak`] creates one and makes it the
//! device's current pool, which every `cuMemAllocAsync` draws from). Trimming the one pool
//! between trials was not enough: on an H200, trials in a long-lived process started from an
//! empty, trimmed pool and still reserved up to 20 % more than the same setting in a fresh
//! process (gpt-124m micro-batch 32: 19.2 GiB against 16.0–16.1 GiB in four fresh processes),
//! so the pool keeps some layout of its earlier reservations. A new pool has none.
//!
//! Emulation: to plan for a smaller card on a larger one, the difference is allocated outside
//! the pool (`cuMemAlloc`) and held, so the pool itself runs out of memory at the target's size
//! and CUDA reports a real out-of-memory, exactly where the smaller card would.
#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext};
use candle_core::Device;

use crate::probe::live::DeviceMemory;
use crate::{Error, Result};

/// In-use memory before emulation starts above which a warning is logged: more than this
/// process's context and libraries take.
const OTHER_USE_WARNING_BYTES: u64 = 2 << 30;

/// Pool peak measurement and optional capacity hold-back on one CUDA device.
pub struct PoolMemory {
    context: Arc<CudaContext>,
    /// The pool allocations come from: the device's default pool until the first trial, then
    /// the trial's own.
    pool: sys::CUmemoryPool,
    /// Whether `pool` was created here (and is destroyed when the next trial replaces it).
    pool_is_own: bool,
    held: Option<sys::CUdeviceptr>,
    held_bytes: u64,
}

impl PoolMemory {
    /// Attaches to `device`'s default memory pool.
    pub fn new(device: &Device) -> Result<Self> {
        let cuda = device.as_cuda_device()?;
        let context = cuda.cuda_stream().context().clone();
        context.bind_to_thread().map_err(driver)?;
        // SAFETY: the device handle comes from a live context.
        let pool =
            unsafe { result::device::get_default_mem_pool(context.cu_device()) }.map_err(driver)?;
        Ok(Self {
            context,
            pool,
            pool_is_own: false,
            held: None,
            held_bytes: 0,
        })
    }

    /// Makes a new pool, which keeps freed memory as the default pool is told to, the
    /// device's current pool, and destroys the previous one if it was made here. Everything
    /// the previous pool handed out must have been freed: its destruction waits for that
    /// otherwise, and its memory counts as outside the pool until then.
    fn start_new_pool(&mut self) -> Result<()> {
        // SAFETY: an all-zero `CUmemPoolProps` is its documented default (no export handles, no
        // maximum size); the fields set below make it a device-local pinned pool.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let ordinal = i32::try_from(self.context.ordinal())
            .map_err(|_| Error::internal("the device ordinal does not fit an int".to_string()))?;
        // SAFETY: `CUmemLocation` is a 4-byte location type followed by the 4-byte device id
        // (a plain field in some CUDA headers, the first member of a union in newer ones), so
        // the int after the type is the id in every layout.
        unsafe {
            std::ptr::addr_of_mut!(props.location)
                .cast::<i32>()
                .add(1)
                .write(ordinal)
        };
        // SAFETY: `props` is a valid, initialised `CUmemPoolProps`.
        let fresh = unsafe { result::mem_pool::create(&props) }.map_err(driver)?;
        let mut unlimited: u64 = u64::MAX;
        // SAFETY: the release threshold is a `cuuint64_t`, read from `unlimited`; the device
        // handle and the pool belong to the live context.
        let made_current = unsafe {
            result::mem_pool::set_attribute(
                fresh,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut unlimited as *mut u64).cast(),
            )
            .and_then(|()| result::device::set_mem_pool(self.context.cu_device(), fresh))
        };
        if let Err(e) = made_current {
            // SAFETY: `fresh` was created above, never became current, and is destroyed once.
            let _ = unsafe { result::mem_pool::destroy(fresh) };
            return Err(driver(e));
        }
        let previous = std::mem::replace(&mut self.pool, fresh);
        if std::mem::replace(&mut self.pool_is_own, true) {
            // SAFETY: `previous` was created by `start_new_pool` and is destroyed once; it is no
            // longer the device's current pool.
            unsafe { result::mem_pool::destroy(previous) }.map_err(driver)?;
        }
        Ok(())
    }

    /// Total and free device bytes as the driver sees them.
    pub fn device_totals(&self) -> Result<(u64, u64)> {
        let (free, total) = self.context.mem_get_info().map_err(driver)?;
        Ok((total as u64, free as u64))
    }

    /// Makes the device behave as if it had `capacity` bytes in total, by holding the rest.
    /// Returns the bytes held. Fails if the device is smaller than `capacity`.
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
                    "device profile",
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
        // SAFETY: the pool belongs to the live context's device.
        unsafe { result::mem_pool::trim_to(self.pool, 0) }.map_err(driver)
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the size attributes are `cuuint64_t`, written into `value`.
        unsafe {
            result::mem_pool::get_attribute(self.pool, attr, (&mut value as *mut u64).cast())
        }
        .map_err(driver)?;
        Ok(value)
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
    fn reset_peak(&mut self) -> Result<()> {
        self.context.bind_to_thread().map_err(driver)?;
        // Start each trial from a new, empty pool, so its peak is its own; what the previous
        // pool still reserves goes back to the driver first.
        self.trim()?;
        if let Err(e) = self.start_new_pool() {
            // The trimmed pool still measures, if less exactly after earlier trials.
            tracing::warn!("cannot give this trial a memory pool of its own: {e}");
        }
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
        tracing::debug!(
            reserved =
                self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            used = self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            outside = self.outside_pool_bytes()?,
            "pool at trial start"
        );
        Ok(())
    }

    fn leftover_bytes(&mut self) -> Result<u64> {
        self.context.bind_to_thread().map_err(driver)?;
        self.trim()?;
        let reserved =
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(reserved.max(used))
    }

    fn peak_bytes(&mut self) -> Result<u64> {
        let high = self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?;
        Ok(high + self.outside_pool_bytes()?)
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        // Nothing useful can be done with a failure while dropping; the process is ending.
        let _ = self.release_hold();
    }
}

fn driver(e: result::DriverError) -> Error {
    Error::Backend(candle_core::Error::Cuda(Box::new(e)))
}
