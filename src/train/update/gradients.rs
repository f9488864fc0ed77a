//! What the update strategies share: the sink that updates each part as the backward pass
//! settles it, and the end of a step that holds every gradient (the overflow check, the loss
//! scale's decision, clipping).

use candle_core::Tensor;

use super::StepEnv;
use crate::train::passes::StepSink;
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// The end of a step that holds every gradient (`grads`, unscaled): fp16's overflow check, the
/// loss scale's decision, clipping to the model's global norm, then `update`. The gradients are
/// dropped before this returns.
pub(super) fn finish_whole_step(
    env: &mut StepEnv<'_>,
    mut grads: Vec<Tensor>,
    update: impl FnOnce(&[Tensor]) -> Result<()>,
) -> Result<ScaleDecision> {
    let check = env.passes.knobs.precision.needs_loss_scaling();
    let finite = !check || all_finite(&grads)?;
    let decision = env.scaler.update(finite);
    if decision == ScaleDecision::Apply {
        if let Some(max) = env.passes.model.spec().optimizer.grad_clip {
            clip_global_norm(&mut grads, max)?;
        }
        update(&grads)?;
    }
    Ok(decision)
}

/// A gradient waiting for its part to settle: a parameter's whole gradient, or its rows from
/// `first_row` on.
pub(super) struct Pending {
    pub(super) index: usize,
    pub(super) first_row: Option<usize>,
    pub(super) grad: Tensor,
}

/// The update in backward: each settled part of the model is updated at once by `update` (in
/// the step begun before the pass), and its gradients dropped.
pub(super) struct UpdateInBackward<F> {
    update: F,
    pending: Vec<Pending>,
    /// Whether a settled layer (not only a whole part) is updated at once.
    pub(super) by_layer: bool,
    /// The most gradient bytes pending at once.
    pub(super) peak_bytes: u64,
}

impl<F: FnMut(&[Pending]) -> Result<()>> UpdateInBackward<F> {
    pub(super) fn new(update: F) -> Self {
        Self {
            update,
            pending: Vec::new(),
            by_layer: false,
            peak_bytes: 0,
        }
    }

    fn push(&mut self, pending: Pending) {
        self.pending.push(pending);
        let bytes = tensor_bytes(self.pending.iter().map(|p| &p.grad));
        self.peak_bytes = self.peak_bytes.max(bytes);
    }
}

impl<F: FnMut(&[Pending]) -> Result<()>> StepSink for UpdateInBackward<F> {
    fn gradient(&mut self, _micro: usize, index: usize, grad: Tensor) -> Result<()> {
        self.push(Pending {
            index,
            first_row: None,
            grad,
        });
        Ok(())
    }

    fn gradient_rows(
        &mut self,
        _micro: usize,
        index: usize,
        first: usize,
        grad: Tensor,
    ) -> Result<()> {
        self.push(Pending {
            index,
            first_row: Some(first),
            grad,
        });
        Ok(())
    }

    fn settled(&mut self) -> Result<()> {
        // Layers settle where nothing is pending (a block's last layer, then the block).
        if self.by_layer && self.pending.is_empty() {
            return Ok(());
        }
        (self.update)(&self.pending)?;
        self.pending.clear();
        Ok(())
    }

    fn settled_layer(&mut self) -> Result<()> {
        if self.by_layer {
            self.settled()?;
        }
        Ok(())
    }
}

/// The bytes of `tensors` together.
pub(crate) fn tensor_bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors
        .into_iter()
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum()
}

/// Scales `grads` so that their global L2 norm is at most `max`, as PyTorch's
/// `clip_grad_norm_` does (by `max / (norm + 1e-6)` when that is below 1); returns the norm
/// before clipping. One device reduction per tensor and one host read in all.
fn clip_global_norm(grads: &mut [Tensor], max: f64) -> Result<f64> {
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let norm = f64::from(Tensor::stack(&squares, 0)?.sum_all()?.to_scalar::<f32>()?).sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

/// One device reduction and one host read for all gradients: inf or NaN anywhere makes the sum
/// non-finite.
fn all_finite(grads: &[Tensor]) -> Result<bool> {
    let sums = grads
        .iter()
        .map(|g| g.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()?;
    Ok(total.is_finite())
}
