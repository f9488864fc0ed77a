//! Probes: short real training trials that measure one setting, or report that it ran out of memory.
//!
//! Where a trial runs: in this process ([`live`]), in a fresh child process ([`child`]), or in
//! a long-lived child that serves trial after trial while it stays clean ([`worker`]).

pub mod child;
#[cfg(feature = "cuda")]
pub mod gpu_memory;
pub mod host_memory;
pub mod host_work;
pub mod live;
pub mod outcome;
pub mod worker;
