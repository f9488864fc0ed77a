//! Data parallelism over the GPUs of one host: one process per GPU, gradients summed between
//! them every step.
//!
//! The pieces, one file each:
//!
//! - [`rank`]: who a process is (rank, world size, where the ranks meet), handed over by the
//!   launcher through environment variables.
//! - [`collective`]: the operations training needs from the group (sum, broadcast), over one of
//!   three backends: a single rank (no-op), [`tcp`] between processes (CPU runs and tests), or
//!   NCCL between GPUs (`nccl` feature).
//! - [`launch`]: `autotune train --data-parallel N` starts N ranks of itself, relays rank 0's
//!   progress, forwards Ctrl-C and turns a dead rank into a clear error.
//! - [`probe`]: a search trial of a data-parallel setting runs as N ranks too, so memory per
//!   GPU and scaling efficiency are measured rather than assumed.
//! - [`protocol`]: the JSON lines a rank sends its launcher.
//!
//! Why processes and not threads: one CUDA context per process is how NCCL and the drivers are
//! meant to be used, a rank that dies cannot take the others' memory with it, and each rank's
//! host-heap counter then measures exactly that rank.

pub mod collective;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod probe;
pub mod protocol;
pub mod rank;
pub mod tcp;

pub use collective::Collective;
pub use rank::{RankEnv, Rendezvous};
