//! A compact or host-placed state layout ([`CompactAdam`]) on one device: after the backward
//! pass with every gradient held (checked and clipped as the exact update is), or in backward,
//! each part updated whole as it settles (host-placed moments move a part at a time).

use super::gradients::{finish_whole_step, tensor_bytes, Pending, UpdateInBackward};
use super::{StepEnv, Stepped, Updater};
use crate::knobs::StateLayout;
use crate::model::batch::Batch;
use crate::model::Transformer;
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::compact::CompactAdam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// The update of a compact state layout.
pub(super) struct Compact {
    compact: Box<CompactAdam>,
    in_backward: bool,
}

impl Compact {
    /// Zero state in `layout` for `model`'s parameters; `seed` fixes stochastic rounding.
    pub(super) fn new(
        model: &Transformer,
        spec: OptimizerSpec,
        layout: StateLayout,
        in_backward: bool,
        seed: u64,
    ) -> Result<Self> {
        Ok(Self {
            compact: Box::new(CompactAdam::new(model.params().vars(), spec, layout, seed)?),
            in_backward,
        })
    }

    fn step_after_backward(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let (grads, loss) = env
            .passes
            .device_gradients(env.index, env.scaler.scale, batches)?;
        let gradient_bytes = tensor_bytes(&grads);
        let compact = &mut self.compact;
        let decision = finish_whole_step(env, grads, |grads| compact.step(grads))?;
        Ok(Stepped {
            loss,
            decision,
            gradient_bytes,
        })
    }

    fn step_in_backward(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let consts = self.compact.begin_step();
        let compact = &mut self.compact;
        // Whole parts: host-placed moments move a part at a time.
        let mut sink = UpdateInBackward::new(|part: &[Pending]| {
            let whole = part
                .iter()
                .map(|p| match p.first_row {
                    None => Ok((p.index, p.grad.clone())),
                    Some(_) => Err(crate::Error::internal(
                        "the compact optimizer takes whole gradients",
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            compact.update(&consts, &whole)
        });
        let loss = env
            .passes
            .for_each_gradient(env.index, env.scaler.scale, batches, &mut sink)?;
        let gradient_bytes = sink.peak_bytes;
        drop(sink);
        self.compact.finish_step()?;
        Ok(Stepped {
            loss,
            decision: ScaleDecision::Apply,
            gradient_bytes,
        })
    }
}

impl Updater for Compact {
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        if self.in_backward {
            self.step_in_backward(env, batches)
        } else {
            self.step_after_backward(env, batches)
        }
    }

    fn optimizer(&self) -> OptimizerState<'_> {
        OptimizerState::Compact(&self.compact)
    }

    fn optimizer_mut(&mut self) -> OptimizerStateMut<'_> {
        OptimizerStateMut::Compact(&mut self.compact)
    }
}
