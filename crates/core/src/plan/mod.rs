//! Plans: the fastest feasible setting found, with its evidence, as versioned JSON.
//!
//! [`schema::Plan`] is the document (its module docs describe the wire format);
//! [`Plan::from_search`](schema::Plan::from_search) builds one from a finished search; and
//! [`exports`] translates it into DeepSpeed, Hugging Face and Lightning settings.

pub mod data;
pub mod exports;
pub mod longest;
pub mod schema;
pub mod select;

pub use data::{length_histogram, Batching, DataMismatch, DataProfile, LengthBucket, Truncation};
pub use exports::{ExportFormat, Notes};
pub use longest::{EdgeSearch, EdgeTrial, LongestSequence};
pub use schema::{
    Alternative, DataParallelReport, Headroom, ModelError, Plan, Predicted, Provenance, Tool,
    SCHEMA_VERSION, SINGLE_GPU_SCHEMA_VERSION,
};
