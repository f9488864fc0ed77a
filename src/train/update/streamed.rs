//! Offloaded and streamed: each part of the model goes to the host as soon as the backward
//! pass settles it, and is updated and uploaded there while the device runs the parts before
//! it ([`OffloadAdam::streamed_step`]). The arithmetic is the summed step's for one micro-batch,
//! so the weights come out bit-identical.
//!
//! [`crate::knobs::UpdateStrategy::of`] chooses it for offload wherever nothing needs every
//! gradient first: one micro-batch, no loss scale to check, one rank, no clipping.

use super::{offloaded_adam, StepEnv, Stepped, Updater};
use crate::model::batch::Batch;
use crate::model::Transformer;
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::offload::OffloadAdam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::passes::PassSink;
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// The offloaded update, streamed through the backward pass.
pub(super) struct OffloadedStreamed {
    host: OffloadAdam,
}

impl OffloadedStreamed {
    /// Zero moments beside the host masters `model` was built with.
    pub(super) fn new(model: &mut Transformer, spec: OptimizerSpec) -> Result<Self> {
        Ok(Self {
            host: offloaded_adam(model, spec)?,
        })
    }
}

impl Updater for OffloadedStreamed {
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let (passes, index, scale) = (env.passes, env.index, env.scaler.scale);
        let loss = self.host.streamed_step(&mut |sink| {
            passes.for_each_gradient(index, scale, batches, &mut PassSink(sink))
        })?;
        Ok(Stepped {
            loss,
            decision: ScaleDecision::Apply,
            gradient_bytes: 0,
        })
    }

    fn optimizer(&self) -> OptimizerState<'_> {
        OptimizerState::Host(&self.host)
    }

    fn optimizer_mut(&mut self) -> OptimizerStateMut<'_> {
        OptimizerStateMut::Host(&mut self.host)
    }
}
