//! Exact AdamW on the device, each layer updated as soon as the backward pass settles it and
//! its gradients dropped, so the whole model's gradients never exist at once. The vocabulary
//! head's weight comes by slices of rows, each updated alone ([`HeadGradient::ByRows`]).
//!
//! [`crate::knobs::UpdateStrategy::of`] admits it only where it is exactly the normal step: one
//! micro-batch, no loss scale to check, one rank, no clipping.

use super::gradients::{Pending, UpdateInBackward};
use super::{StepEnv, Stepped, Updater};
use crate::model::batch::Batch;
use crate::model::{HeadGradient, Transformer};
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::adam::Adam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// The update in backward, on the device.
pub(super) struct InBackward {
    adam: Adam,
}

impl InBackward {
    /// Zero moments for `model`'s parameters.
    pub(super) fn new(model: &Transformer, spec: OptimizerSpec) -> Result<Self> {
        Ok(Self {
            adam: Adam::new(model.params().vars(), spec)?,
        })
    }
}

impl Updater for InBackward {
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let step = self.adam.begin_step();
        let adam = &self.adam;
        let mut sink = UpdateInBackward::new(|part: &[Pending]| {
            let mut whole = Vec::with_capacity(part.len());
            for p in part {
                match p.first_row {
                    Some(first) => adam.update_rows(&step, p.index, first, &p.grad)?,
                    None => whole.push((p.index, p.grad.clone())),
                }
            }
            adam.update(&step, &whole)
        });
        // Each layer's gradients are dropped as soon as it settles.
        sink.by_layer = true;
        let loss = env
            .passes
            .for_each_gradient(env.index, env.scaler.scale, batches, &mut sink)?;
        Ok(Stepped {
            loss,
            decision: ScaleDecision::Apply,
            gradient_bytes: sink.peak_bytes,
        })
    }

    fn optimizer(&self) -> OptimizerState<'_> {
        OptimizerState::Device(&self.adam)
    }

    fn optimizer_mut(&mut self) -> OptimizerStateMut<'_> {
        OptimizerStateMut::Device(&mut self.adam)
    }

    fn head_gradient(&self) -> HeadGradient {
        HeadGradient::ByRows
    }
}
