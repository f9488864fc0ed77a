//! Training: data, the optimizer (on the device or offloaded to the host), loss scaling,
//! activation checkpointing, the step that honours the knobs, checkpoints and the run loop.

pub mod checkpoint;
pub mod data;
pub mod host_math;
pub mod offload;
pub mod optim;
pub mod recompute;
pub mod run;
pub mod scaler;
pub mod step;
pub mod tensor_file;
