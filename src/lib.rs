//! autotune: finds the fastest training plan that fits a GPU and host memory budget.
//!
//! The pipeline, one layer per stage, each pointing only down:
//!
//! ```text
//! autotune-core (no tensors): knobs ─▶ trial ─▶ spec ─▶ trial_protocol ─▶ estimate ─▶ fit ─▶ search
//!                             ─▶ plan ─▶ profile ─▶ report
//! runtime (this crate):       backend ─▶ ops ─▶ model ─▶ collective ─▶ train ─▶ hf ─▶ probe ─▶ dist
//!                             ─▶ settings (argv → validated settings) ─▶ session (the commands' runs)
//! binary (src/cli):           parse ─▶ resolve settings ─▶ call a session ─▶ print
//! ```
//!
//! The core's modules are re-exported here under their own names, so `autotune::knobs` is
//! `autotune_core::knobs`. `model` is the Transformer and `train` the step that honours every
//! knob; both run on candle's CPU device and, with the `cuda` feature, on the GPU. `probe`
//! runs trials ([`probe::Prober`]), and `dist` spreads training and trials over several GPUs
//! of one host (data parallelism, one process per GPU) on top of `collective`'s process groups.
//! `settings` resolves each command's flags into validated settings in one step, and `session`
//! runs a command's session (tuning) on them, printing nothing: the binary renders it.

pub use autotune_core::{
    atomic_file, estimate, fit, input_file, knobs, outputs, plan, profile, report, search, spec,
    trial, trial_protocol,
};

pub mod backend;
pub mod collective;
pub mod data;
pub mod dist;
pub mod error;
pub mod hash;
pub mod hf;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod probe;
pub mod session;
pub mod settings;
pub mod train;

pub use error::{Error, Result};
pub use knobs::{Checkpointing, Knobs, Offload, Precision, Regime};
pub use spec::model::ModelSpec;
