//! Validated inputs: what to train ([`model::ModelSpec`]), where ([`device::DeviceSpec`]), within
//! which limits ([`budget::Budget`]), and the state a setting keeps ([`state::StateBytes`]).

pub mod activations;
pub mod budget;
pub mod device;
pub mod limits;
pub mod model;
pub mod state;
