//! How a step turns its micro-batches' gradients into new weights: one [`Updater`] per
//! [`UpdateStrategy`], each in its own file.
//!
//! - [`after_backward`]: exact AdamW on the device after the backward pass, the gradients summed
//!   over micro-batches and ranks (optionally with the moments sharded between the ranks);
//! - [`in_backward`]: exact AdamW on the device, each layer as the backward pass settles it;
//! - [`offloaded`]: masters and moments in host memory, the gradients summed there;
//! - [`streamed`]: offloaded, each part updated on the host while the backward pass goes on;
//! - [`compact`]: a compact or host-placed state layout, in or after the backward pass.
//!
//! [`UpdateStrategy::of`] decides which one knobs ask for (and refuses what cannot run), and
//! [`build`] constructs it: the trainer's step is then the same few lines for every strategy.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::collective::Collective;
use crate::knobs::UpdateStrategy;
use crate::model::batch::Batch;
use crate::model::{HeadGradient, Masters, Transformer};
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::offload::OffloadAdam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::passes::Passes;
use crate::train::scaler::{LossScaler, ScaleDecision};
use crate::Result;

mod after_backward;
mod compact;
mod gradients;
mod in_backward;
mod offloaded;
mod streamed;

pub(crate) use gradients::tensor_bytes;

/// What a step's update reads and changes beside its own optimizer.
pub(crate) struct StepEnv<'a> {
    /// The passes to run (the model, its knobs, the device).
    pub(crate) passes: &'a Passes,
    /// The step's index: the steps taken before it (dropout keys and data follow it).
    pub(crate) index: u64,
    /// The loss scale (identity unless fp16), which decides whether the update applies.
    pub(crate) scaler: &'a mut LossScaler,
    /// The data-parallel group whose gradients are summed.
    pub(crate) group: &'a mut Collective,
}

/// What a step's update did.
pub(crate) struct Stepped {
    /// The mean loss over this rank's micro-batches (unscaled).
    pub(crate) loss: f64,
    /// Whether the update was applied or skipped (an fp16 overflow).
    pub(crate) decision: ScaleDecision,
    /// The most gradient bytes the step held on the device at once.
    pub(crate) gradient_bytes: u64,
}

/// One way of updating the weights, with the optimizer state it updates.
pub(crate) trait Updater {
    /// One optimizer step over this rank's `batches`: their passes, then the update.
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped>;

    /// The optimizer's state, for checkpoints and measurements.
    fn optimizer(&self) -> OptimizerState<'_>;

    /// The optimizer's state, to set the next learning rate or restore a checkpoint.
    fn optimizer_mut(&mut self) -> OptimizerStateMut<'_>;

    /// How the head's weight gradient is best computed under this strategy: by rows where each
    /// slice is updated as soon as it settles; elsewhere the whole gradient is held anyway, and
    /// the rows' extra product is waste.
    fn head_gradient(&self) -> HeadGradient {
        HeadGradient::Whole
    }

    /// With the moments sharded between ranks, every parameter's moments gathered from its
    /// owner (on the root rank, as host tensors named `m.<name>`, `v.<name>`; empty elsewhere);
    /// every rank calls it together. `None` when this rank's optimizer holds all of them.
    fn gathered_moments(
        &self,
        group: &mut Collective,
        model: &Transformer,
    ) -> Result<Option<HashMap<String, Tensor>>> {
        let _ = (group, model);
        Ok(None)
    }
}

/// Where the master weights live under `strategy`, for a model whose passes compute in
/// `compute`: host memory with offload, the bf16 working copies with half-precision masters,
/// else the model's own f32 parameters.
pub(crate) fn masters(strategy: UpdateStrategy, compute: DType) -> Masters {
    match strategy {
        UpdateStrategy::Offloaded | UpdateStrategy::OffloadedStreamed => Masters::Host { compute },
        UpdateStrategy::Compact { layout, .. } if layout.masters.is_half() => {
            Masters::Working { compute }
        }
        _ => Masters::Device,
    }
}

/// The updater of `strategy` for `model` (built with [`masters`]'s placement), as a rank of
/// `group`; `seed` fixes stochastic rounding.
pub(crate) fn build(
    strategy: UpdateStrategy,
    model: &mut Transformer,
    spec: OptimizerSpec,
    group: &Collective,
    seed: u64,
) -> Result<Box<dyn Updater>> {
    Ok(match strategy {
        UpdateStrategy::AfterBackward { shard_optimizer } => Box::new(
            after_backward::AfterBackward::new(model, spec, shard_optimizer, group)?,
        ),
        UpdateStrategy::InBackward => Box::new(in_backward::InBackward::new(model, spec)?),
        UpdateStrategy::Offloaded => Box::new(offloaded::Offloaded::new(model, spec)?),
        UpdateStrategy::OffloadedStreamed => {
            Box::new(streamed::OffloadedStreamed::new(model, spec)?)
        }
        UpdateStrategy::Compact {
            layout,
            in_backward,
        } => Box::new(compact::Compact::new(
            model,
            spec,
            layout,
            in_backward,
            seed,
        )?),
    })
}

/// The host optimizer of an offloaded strategy, over the masters the model was built with in
/// host memory.
fn offloaded_adam(model: &mut Transformer, spec: OptimizerSpec) -> Result<OffloadAdam> {
    let master = model.params_mut().take_host_masters().ok_or_else(|| {
        crate::Error::internal("an offloaded optimizer needs a model built with host masters")
    })?;
    OffloadAdam::new(model.params().vars(), master, spec)
}
