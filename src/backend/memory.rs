//! What a trial reads of device memory: a peak since a reset, and what is left once released.
//! On CUDA the memory pool answers exactly (`pool::PoolMemory`); the CPU has none.

use candle_core::Device;

use crate::{Error, Result};

/// Measures device memory for trials; the CPU has none.
pub trait DeviceMemory {
    /// Starts a new peak measurement.
    fn reset_peak(&mut self) -> Result<()>;
    /// Peak device bytes since the last reset, including what the driver holds outside the pool.
    fn peak_bytes(&mut self) -> Result<u64>;
    /// Device bytes still held once everything unused is released: 0 when the next trial
    /// starts as it would in a fresh process.
    fn leftover_bytes(&mut self) -> Result<u64>;
    /// Device bytes in use now (what [`DeviceMemory::peak_bytes`] counts); `None` where there
    /// is no device memory.
    fn current_bytes(&mut self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Logs the high-water marks so far at trace level, labelled with the trial's phase, to
    /// see which phase of a trial sets its peak.
    fn trace_marks(&mut self, _phase: &dyn std::fmt::Display) {}
}

/// No device memory to measure (CPU runs).
pub struct NoDeviceMemory;

impl DeviceMemory for NoDeviceMemory {
    fn reset_peak(&mut self) -> Result<()> {
        Ok(())
    }
    fn peak_bytes(&mut self) -> Result<u64> {
        Ok(0)
    }
    fn leftover_bytes(&mut self) -> Result<u64> {
        Ok(0)
    }
}

/// The device-memory meter for `device`. With `capacity`, the GPU is made to behave as one of
/// that many bytes (the rest held back), so out-of-memory happens where it would on that card.
pub fn memory_meter(device: &Device, capacity: Option<u64>) -> Result<Box<dyn DeviceMemory>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let mut meter = super::pool::PoolMemory::new(device)?;
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
                    super::describe(device)
                ),
            )),
            None => Ok(Box::new(NoDeviceMemory)),
        },
    }
}
