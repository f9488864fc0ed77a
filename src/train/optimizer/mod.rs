//! The optimizer's state: exact Adam/AdamW on the device ([`adam`]), in host memory
//! ([`offload`]), or in a compact layout ([`compact`]); and what every one of them shares, its
//! settings and count of updates ([`AdamProgress`]), read and restored through
//! [`OptimizerState`] and [`OptimizerStateMut`] whatever the layout.
//!
//! How a step drives a state (after the backward pass, during it, streamed through the host)
//! is `train::update`'s; this module only keeps and updates the numbers.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::ops::host_optim::AdamConsts;
use crate::spec::model::OptimizerSpec;
use crate::spec::state::{Components, StateBytes};

pub mod adam;
pub mod compact;
pub mod offload;

use adam::Adam;
use compact::CompactAdam;
use offload::OffloadAdam;

/// An optimizer's settings and the updates it has applied: the bias corrections of the next
/// update follow from them, and checkpoints save and restore them.
#[derive(Debug, Clone, Copy)]
pub struct AdamProgress {
    spec: OptimizerSpec,
    steps: u64,
}

impl AdamProgress {
    /// No update applied yet, with `spec`'s settings.
    pub fn new(spec: OptimizerSpec) -> Self {
        Self { spec, steps: 0 }
    }

    /// Optimizer updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The learning rate of the next updates.
    pub fn learning_rate(&self) -> f64 {
        self.spec.lr
    }

    /// Sets the learning rate of the next updates.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.spec.lr = lr;
    }

    /// Counts one more update and returns its constants (its step's bias corrections).
    pub fn begin_step(&mut self) -> AdamConsts {
        self.steps += 1;
        AdamConsts::new(&self.spec, self.steps)
    }

    /// Sets the count of updates applied (a checkpoint's).
    pub fn restore(&mut self, steps: u64) {
        self.steps = steps;
    }
}

/// An optimizer's state, whichever strategy steps it: what checkpoints save and measurements
/// read.
pub enum OptimizerState<'a> {
    /// Exact f32 masters (the model's parameters) and moments on the training device, or a
    /// share of the moments when sharded.
    Device(&'a Adam),
    /// f32 masters and moments in host memory; the device holds working copies.
    Host(&'a OffloadAdam),
    /// A compact state layout (or moments placed in host memory), updated on the device.
    Compact(&'a CompactAdam),
}

impl<'a> OptimizerState<'a> {
    /// Its settings and count of updates.
    pub fn progress(&self) -> &'a AdamProgress {
        match *self {
            OptimizerState::Device(adam) => &adam.progress,
            OptimizerState::Host(offload) => &offload.progress,
            OptimizerState::Compact(compact) => &compact.progress,
        }
    }

    /// Optimizer updates applied so far.
    pub fn steps(&self) -> u64 {
        self.progress().steps()
    }

    /// Whether the masters and moments live in host memory.
    pub fn is_offloaded(&self) -> bool {
        matches!(self, OptimizerState::Host(_))
    }

    /// The training state these hold, measured from their tensors, beside the model's
    /// `weights` (its parameters' bytes on the device) and the most `gradient_bytes` a step held
    /// at once on the device.
    pub fn state_bytes(&self, weights: u64, gradient_bytes: u64) -> StateBytes {
        match self {
            OptimizerState::Device(adam) => StateBytes {
                device: Components {
                    weights,
                    moments: adam.moment_bytes(),
                    gradients: gradient_bytes,
                },
                host: Components::default(),
            },
            OptimizerState::Host(offload) => StateBytes {
                device: Components {
                    weights,
                    moments: 0,
                    gradients: 0,
                },
                host: offload.host_bytes(),
            },
            OptimizerState::Compact(compact) => {
                let (device, host) = compact.bytes();
                StateBytes {
                    device: Components {
                        gradients: gradient_bytes,
                        ..device
                    },
                    host,
                }
            }
        }
    }

    /// Bytes a step copies over the host link, `None` when the state stays on the device: an
    /// offloaded step's gradients come down in their working dtype each micro-batch, and the
    /// new working copies (`working_bytes`) go up once; host-placed moments move as the
    /// compact layout says.
    pub fn host_link_bytes_per_step(&self, working_bytes: u64, grad_accum: u64) -> Option<u64> {
        match self {
            OptimizerState::Device(_) => None,
            OptimizerState::Host(_) => Some(working_bytes * (grad_accum + 1)),
            OptimizerState::Compact(compact) => compact.link_bytes_per_step(),
        }
    }
}

/// An optimizer's state, to change: the next learning rate, a checkpoint's restore.
pub enum OptimizerStateMut<'a> {
    /// See [`OptimizerState::Device`].
    Device(&'a mut Adam),
    /// See [`OptimizerState::Host`].
    Host(&'a mut OffloadAdam),
    /// See [`OptimizerState::Compact`].
    Compact(&'a mut CompactAdam),
}

impl OptimizerStateMut<'_> {
    /// Its settings and count of updates.
    pub fn progress_mut(&mut self) -> &mut AdamProgress {
        match self {
            OptimizerStateMut::Device(adam) => &mut adam.progress,
            OptimizerStateMut::Host(offload) => &mut offload.progress,
            OptimizerStateMut::Compact(compact) => &mut compact.progress,
        }
    }

    /// Restores the moments from a checkpoint's `tensors` (named after the model's parameters,
    /// `names`) and the count of updates, `steps`.
    pub fn load_state(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
        steps: u64,
    ) -> std::result::Result<(), String> {
        match self {
            OptimizerStateMut::Device(adam) => adam.load_moments(names, tensors)?,
            OptimizerStateMut::Host(offload) => offload.load_moments(names, tensors)?,
            OptimizerStateMut::Compact(compact) => compact.load_moments(names, tensors)?,
        }
        self.progress_mut().restore(steps);
        Ok(())
    }
}
