//! Validated inputs: what to train ([`model::ModelSpec`]).

pub mod budget;
pub mod device;
pub mod limits;
pub mod model;
