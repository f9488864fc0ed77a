//! argv → settings: each command's flags (the clap types) and the validated settings they
//! resolve to, in one step. Everything a flag can get wrong is refused here, naming the flag
//! as typed, before anything runs; what a command then runs ([`crate::session`]) takes these
//! settings, never the raw flags. [`flags`] maps the core's field names back to the flags that
//! set them.

pub mod allocator;
pub mod check;
pub mod data;
pub mod dataset;
pub mod estimate;
pub mod export;
pub mod export_weights;
pub mod flags;
pub mod knobs;
pub mod model;
pub mod optimizer;
pub mod probe;
pub mod show;
pub mod target;
pub mod train;
pub mod training;
pub mod tune;
