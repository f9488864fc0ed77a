//! Probes: short real training trials that measure one setting, or report that it ran out of memory.

pub mod child;
#[cfg(feature = "cuda")]
pub mod gpu_memory;
pub mod host_memory;
pub mod live;
pub mod outcome;
