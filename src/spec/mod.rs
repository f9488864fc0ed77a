//! Validated inputs: what to train ([`model::ModelSpec`]).

pub mod model;
