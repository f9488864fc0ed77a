//! autotune: finds the fastest training plan that fits a GPU and host memory budget.
//!
//! The pipeline, one module per stage:
//!
//! ```text
//! spec (what to train) ─▶ knobs (one setting) ─▶ probe (real trial steps → Outcome)
//!        ─▶ search (pure driver: history in, next probe out) ─▶ fit (memory/time models)
//!        ─▶ plan (fastest feasible setting, versioned JSON) ─▶ train (full run with the plan)
//! ```
//!
//! `model` is the Transformer and `train` the step that honours every knob; both run on
//! candle's CPU device and, with the `cuda` feature, on the GPU. `dist` spreads training over
//! several GPUs of one host (data parallelism, one process per GPU).

pub mod atomic_file;
pub mod backend;
pub mod dist;
pub mod error;
pub mod fit;
pub mod hash;
pub mod knobs;
pub mod model;
pub mod ops;
pub mod plan;
pub mod probe;
pub mod profile;
pub mod search;
pub mod spec;
pub mod train;

pub use error::{Error, Result};
pub use knobs::{Checkpointing, Knobs, Offload, Precision, Regime};
pub use spec::model::ModelSpec;
