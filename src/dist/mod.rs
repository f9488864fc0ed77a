//! Data parallelism over the GPUs of one host, the processes' side: one process per GPU, started
//! and watched by a launcher, with gradients summed between them every step through
//! [`crate::collective`].
//!
//! - [`launch`]: `autotune train --data-parallel N` starts N ranks of itself, relays rank 0's
//!   progress, forwards Ctrl-C and turns a dead rank into a clear error.
//! - [`probe`]: a search trial of a data-parallel setting runs as N ranks too, so memory per
//!   GPU and scaling efficiency are measured rather than assumed.
//! - [`protocol`]: the JSON lines a rank sends its launcher.
//!
//! Why processes and not threads: one CUDA context per process is how NCCL and the drivers are
//! meant to be used, a rank that dies cannot take the others' memory with it, and each rank's
//! host-heap counter then measures exactly that rank.

pub mod launch;
pub mod probe;
pub mod protocol;
