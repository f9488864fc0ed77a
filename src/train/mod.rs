//! Training: the optimizer's state ([`optimizer`]: on the device, offloaded to the host,
//! or compact), how a step updates the weights (`update`), the passes over a step's
//! micro-batches, loss scaling, the step that honours the knobs, checkpoints and the run loop.

pub mod checkpoint;
pub mod checkpoint_dir;
pub mod metrics;
pub mod optimizer;
pub(crate) mod passes;
pub mod run;
pub mod scaler;
pub mod schedule;
pub mod step;
pub mod tensor_file;
pub mod tensor_reader;
pub(crate) mod update;
