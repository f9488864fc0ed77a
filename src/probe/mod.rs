//! Probes: short real training trials that measure one setting, or report that it ran out of memory.

pub mod child;
pub mod host_memory;
pub mod live;
pub mod outcome;
#[cfg(feature = "cuda")]
pub mod gpu_memory;
