//! Plans: the fastest feasible setting found, with its evidence, as versioned JSON.
//!
//! [`schema::Plan`] is the document (its module docs describe the wire format);
//! [`Plan::from_search`](schema::Plan::from_search) builds one from a finished search; and
//! [`exports`] translates its knobs into DeepSpeed and Accelerate/Lightning settings.

pub mod exports;
pub mod schema;
pub mod select;

pub use exports::{deepspeed_config, trainer_args, DeepSpeedConfig, TrainerArgs};
pub use schema::{
    Alternative, DataParallelReport, Headroom, ModelError, Plan, Predicted, Tool, SCHEMA_VERSION,
    SINGLE_GPU_SCHEMA_VERSION,
};
