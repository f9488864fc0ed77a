//! autotune's core: what to train and where, the settings a plan chooses, the trials that
//! measure them, and the pure search, fit and plan built on their results.
//!
//! Nothing here runs a tensor: the runtime crate (`autotune`) trains and measures, and hands
//! this crate [`trial::TrialResult`]s. So the search, the models and the formats build and
//! test in seconds, and cannot reach into an engine. The layers, lowest first:
//!
//! ```text
//! knobs (one setting) ─▶ trial (what a trial asks and finds) ─▶ spec (model, device, budget)
//!   ─▶ trial_protocol (trials asked of other programs) ─▶ estimate (analytic peak memory)
//!   ─▶ fit (memory and step-time models) ─▶ search (pure driver and its one loop)
//!   ─▶ plan (the versioned plan and its exports) ─▶ profile (recorded trials, replay, check)
//!   ─▶ report (a search as an HTML page)
//! ```

pub mod atomic_file;
pub mod error;
pub mod estimate;
pub mod fit;
pub mod input_file;
pub mod json;
pub mod knobs;
pub mod outputs;
pub mod plan;
pub mod profile;
pub mod report;
pub mod search;
pub mod spec;
pub mod text;
pub mod trial;
pub mod trial_protocol;

pub use error::{Error, Result};
pub use knobs::{Checkpointing, Knobs, Offload, Precision, Regime};
pub use spec::model::ModelSpec;
