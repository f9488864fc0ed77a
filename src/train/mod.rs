//! Training: data, the optimizer (on the device or offloaded to the host), loss scaling, the
//! step that honours the knobs, checkpoints and the run loop.

pub mod checkpoint;
pub mod checkpoint_dir;
pub mod compact;
pub mod data;
pub mod metrics;
pub mod offload;
pub mod optim;
pub mod run;
pub mod scaler;
pub mod schedule;
pub mod step;
pub mod tensor_file;
pub mod token_file;
