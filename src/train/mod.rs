//! Training: data, the optimizer, loss scaling, the step that honours the knobs, checkpoints and
//! the run loop.

pub mod checkpoint;
pub mod data;
pub mod optim;
pub mod run;
pub mod scaler;
pub mod step;
