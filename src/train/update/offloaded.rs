//! Offloaded and summed: each micro-batch's gradients are copied to the host and summed there
//! in f32, summed over the ranks, checked and clipped on the host, and the Adam update runs
//! there after the backward pass ([`OffloadAdam::step`]), uploading the new working copies.

use super::{offloaded_adam, StepEnv, Stepped, Updater};
use crate::model::batch::Batch;
use crate::model::Transformer;
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::offload::OffloadAdam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// The offloaded update after the backward pass.
pub(super) struct Offloaded {
    host: OffloadAdam,
}

impl Offloaded {
    /// Zero moments beside the host masters `model` was built with.
    pub(super) fn new(model: &mut Transformer, spec: OptimizerSpec) -> Result<Self> {
        Ok(Self {
            host: offloaded_adam(model, spec)?,
        })
    }
}

impl Updater for Offloaded {
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let scale = env.scaler.scale;
        let host = &mut self.host;
        let loss = env.passes.for_each_gradient(
            env.index,
            scale,
            batches,
            &mut |micro: usize, i: usize, g| host.accumulate(i, &g, micro == 0),
        )?;
        env.group
            .all_reduce_sum_host(self.host.gradient_sums_mut(), &env.passes.device)?;
        // Without loss scaling the scale is 1 and there is nothing to unscale or check.
        let check = env.passes.knobs.precision.needs_loss_scaling();
        let finite = !check || self.host.unscale_and_check(scale);
        let decision = env.scaler.update(finite);
        if decision == ScaleDecision::Apply {
            if let Some(max) = env.passes.model.spec().optimizer.grad_clip {
                self.host.clip_global_norm(max);
            }
            self.host.step()?;
        }
        Ok(Stepped {
            loss,
            decision,
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
