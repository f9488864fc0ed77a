//! The explicit engine: hand-written forward and backward passes of the Transformer.
//!
//! candle's autograd keeps every input of every op until the backward pass and, for every op,
//! adds its gradient into a fresh zero tensor: a full-size add per graph node. Measured on an
//! H200 (seed model, bf16, micro-batch 512), those adds alone took 45% of a training step, and
//! dropout built from candle primitives (uniform draw, compare, cast, scale, multiply) another
//! 20%. Here nothing is recorded in a graph:
//!
//! - each block's forward returns exactly what its backward reads (`block::Saved`): the
//!   inputs of the matrix products, the norms' inputs and what attention needs (with flash
//!   attention, one log-sum-exp per row and head instead of the probabilities; see
//!   `attention`);
//! - bias, activation, dropout and residual run as one elementwise pass
//!   ([`crate::ops::epilogue`]), and dropout masks are regenerated from their keys in the
//!   backward pass instead of stored;
//! - activation checkpointing is a choice per block of whether to keep `block::Saved` or only
//!   the block's input and run the forward again during backward.
//!
//! The maths are the composite engine's; `tests/it/explicit.rs` checks losses and every
//! parameter's gradient against it.

mod attention;
mod block;
mod linear;

use std::collections::HashMap;

use candle_core::{DType, Tensor, TensorId};

use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::model::recompute::RecomputedBlocks;
use crate::model::Transformer;
use crate::ops::{self, DropoutMask};
use crate::spec::model::NormPlacement;
use crate::{Error, Result};

pub use self::attention::Attention;
use self::block::{BlockWeights, Saved};
use self::linear::{column_sum, Lin, Norm};

/// Dropout site of the embeddings (blocks use their own parts, see [`Dropout::mask`]).
const EMBED_PART: u64 = u64::MAX;

/// Forward and backward pass of one micro-batch: hands `(parameter index, gradient in the
/// parameter's dtype)` of `loss_factor × loss` to `sink`, once per parameter, and returns the
/// unscaled loss.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Transformer,
    plan: &RecomputedBlocks,
    batch: &Batch,
    dtype: DType,
    attention: Attention,
    dropout: &Dropout,
    loss_factor: f64,
    sink: &mut dyn FnMut(usize, Tensor) -> Result<()>,
) -> Result<f64> {
    let started = std::time::Instant::now();
    let mut grads = Grads::new(model, sink);
    let (b, s) = batch.inputs.dims2()?;
    let weights = block_weights(model, dtype, attention, batch.inputs.device())?;

    // Forward: keep each block's saved activations, or only its input where it is recomputed.
    let embed_mask = embed_mask(model, dropout);
    let mut x = embed(model, &batch.inputs, dtype, embed_mask)?;
    let mut saved: Vec<LeftForBackward> = Vec::with_capacity(weights.len());
    for (i, w) in weights.iter().enumerate() {
        let keep = !plan.recomputes(i);
        let (out, kept) = w.forward(&x, b, s, dropout, i as u64, keep)?;
        saved.push(match kept {
            Some(kept) => LeftForBackward::Kept(kept),
            None => LeftForBackward::Input(x),
        });
        x = out;
    }

    // Head and loss; the logits die as soon as their gradient has been taken.
    let (loss, mut dx) = {
        let head = Head::new(model, dtype, head_row_multiple(x.device()))?;
        let (hidden, logits) = head.forward(&x)?;
        let classes = head.classes();
        let losses = ops::cross_entropy_rows_padded(&logits, &batch.targets, classes)?;
        let rows = losses.elem_count();
        // Read at the very end: a read now would stall the device until the forward pass is
        // done, leaving it idle while the backward pass is being queued.
        let loss = losses.to_dtype(DType::F64)?.mean_all()?;
        let row_grad = Tensor::full((loss_factor / rows as f64) as f32, rows, x.device())?;
        let dlogits =
            ops::cross_entropy_backward(&logits, &batch.targets, classes, &losses, &row_grad)?;
        drop(logits);
        (loss, head.backward(&x, &hidden, dlogits, &mut grads)?)
    };
    drop(x);

    // Backward through the blocks, last first, recomputing where only the input was kept.
    while let Some(stash) = saved.pop() {
        let i = saved.len();
        let w = &weights[i];
        let kept = match stash {
            LeftForBackward::Kept(kept) => kept,
            LeftForBackward::Input(input) => w
                .forward(&input, b, s, dropout, i as u64, true)?
                .1
                .ok_or_else(|| Error::internal(format!("block {i} kept nothing when asked to")))?,
        };
        dx = w.backward(&dx, kept, b, s, dropout, i as u64, &mut grads)?;
    }
    embed_backward(model, &batch.inputs, &dx, embed_mask, &mut grads)?;
    grads.finish(model)?;
    // The first read of the step: it waits for the device. A long enqueue and a short wait
    // mean the device starved while the host queued work.
    let enqueued = started.elapsed();
    let loss = loss.to_scalar::<f64>()?;
    tracing::trace!(
        target: "autotune::timing",
        enqueue_ms = enqueued.as_secs_f64() * 1e3,
        wait_ms = (started.elapsed() - enqueued).as_secs_f64() * 1e3,
        "forward and backward queued, then waited for"
    );
    Ok(loss)
}

/// The mean loss of `batch` without dropout, keeping nothing.
pub fn eval_loss(
    model: &Transformer,
    batch: &Batch,
    dtype: DType,
    attention: Attention,
) -> Result<f64> {
    let (b, s) = batch.inputs.dims2()?;
    let off = Dropout::disabled();
    let mut x = embed(model, &batch.inputs, dtype, None)?;
    // One block's weights at a time: evaluation never holds more than a training step.
    let spec = model.spec();
    let attention = attention.resolve(batch.inputs.device(), dtype, spec.head_dim());
    for (i, block) in model.blocks().iter().enumerate() {
        let w = BlockWeights::new(&block.layers(), dtype, attention, spec.causal)?;
        x = w.forward(&x, b, s, &off, i as u64, false)?.0;
    }
    let head = Head::new(model, dtype, head_row_multiple(x.device()))?;
    let (_, logits) = head.forward(&x)?;
    let losses = ops::cross_entropy_rows_padded(&logits, &batch.targets, head.classes())?;
    Ok(losses
        .to_dtype(DType::F64)?
        .mean_all()?
        .to_scalar::<f64>()?)
}

/// Every block's weights for one pass, with attention resolved for the device.
fn block_weights<'a>(
    model: &'a Transformer,
    dtype: DType,
    attention: Attention,
    device: &candle_core::Device,
) -> Result<Vec<BlockWeights<'a>>> {
    let spec = model.spec();
    let attention = attention.resolve(device, dtype, spec.head_dim());
    model
        .blocks()
        .iter()
        .map(|block| BlockWeights::new(&block.layers(), dtype, attention, spec.causal))
        .collect()
}

/// The multiple the vocabulary head's rows are padded to on `device`.
///
/// cuBLAS runs its aligned tensor-core kernels only when every matrix dimension is a multiple
/// of 8 half-precision elements; GPT-2's 50257 classes are not, and the head's three products
/// (the largest of the step) then ran on a far slower kernel, in PyTorch too. 64 as in
/// nanoGPT's 50304. The CPU gains nothing and computes no padding.
fn head_row_multiple(device: &candle_core::Device) -> usize {
    if device.is_cuda() {
        64
    } else {
        1
    }
}

/// The final norm (pre-norm models) and the vocabulary head, whose rows may be padded with
/// zeros (the logits then have padding columns after the classes).
struct Head<'a> {
    norm: Option<Norm<'a>>,
    lin: Lin<'a>,
}

impl<'a> Head<'a> {
    fn new(model: &'a Transformer, dtype: DType, row_multiple: usize) -> Result<Self> {
        Ok(Self {
            norm: model.final_norm().map(Norm::new),
            lin: Lin::new(model.head_layer(), dtype)?.pad_outputs(row_multiple)?,
        })
    }

    /// The vocabulary size: the logits' leading columns that are classes.
    fn classes(&self) -> usize {
        self.lin.outputs()
    }

    /// `(the head's input after the final norm, logits)` for the last block's output `x`.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let hidden = match &self.norm {
            Some(n) => n.forward(x)?,
            None => x.clone(),
        };
        let logits = self.lin.forward(&hidden, None, None, None)?;
        Ok((hidden, logits))
    }

    /// Gradient of `x` from the logits' gradient (consumed, zero in padding columns); hands
    /// over the head's and the norm's parameter gradients.
    fn backward(
        &self,
        x: &Tensor,
        hidden: &Tensor,
        dlogits: Tensor,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let dhidden = self.lin.backward(&dlogits, hidden, grads)?;
        // The logits' gradient is the largest tensor of the step: gone before the norm's.
        drop(dlogits);
        match &self.norm {
            Some(n) => n.backward(x, &dhidden, grads),
            None => Ok(dhidden),
        }
    }
}

/// What the forward pass left for a block's backward.
enum LeftForBackward {
    Kept(Saved),
    Input(Tensor),
}

fn embed_mask(model: &Transformer, dropout: &Dropout) -> Option<DropoutMask> {
    // GPT-2 drops embeddings; PyTorch's encoder stack (the seed) does not.
    match model.spec().norm {
        NormPlacement::Pre => dropout.mask(EMBED_PART, 0),
        NormPlacement::Post => None,
    }
}

/// Token (and position) embeddings as `(batch·seq, d)` rows in `dtype`.
fn embed(
    model: &Transformer,
    tokens: &Tensor,
    dtype: DType,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    let s = tokens.dim(1)?;
    let table = model
        .token_embedding()
        .as_tensor()
        .detach()
        .to_dtype(dtype)?;
    let positions = match model.position_embedding() {
        Some(p) => Some(p.as_tensor().detach().to_dtype(dtype)?),
        None => None,
    };
    Ok(ops::embed(tokens, &table, positions.as_ref(), s, mask)?)
}

fn embed_backward(
    model: &Transformer,
    tokens: &Tensor,
    dx: &Tensor,
    mask: Option<DropoutMask>,
    grads: &mut Grads,
) -> Result<()> {
    let (b, s) = tokens.dims2()?;
    let dx = match mask {
        Some(m) => ops::dropout(dx, m)?,
        None => dx.clone(),
    };
    let table = model.token_embedding();
    let vocab = table.dim(0)?;
    grads.put(table, ops::embed_backward(tokens, &dx, vocab)?)?;
    if let Some(positions) = model.position_embedding() {
        let d = dx.dim(1)?;
        // Σ over the batch of each position's gradient, as one product with a ones row.
        let used = column_sum(&dx.reshape((b, s * d))?)?.reshape((s, d))?;
        let rows = positions.dim(0)?;
        let full = if rows > s {
            Tensor::cat(
                &[
                    &used,
                    &Tensor::zeros((rows - s, d), DType::F32, dx.device())?,
                ],
                0,
            )?
        } else {
            used
        };
        grads.put(positions, full)?;
    }
    Ok(())
}

/// Routes parameter gradients to the sink, in the parameter's dtype, and checks that every
/// parameter got exactly one.
pub(crate) struct Grads<'a> {
    index: HashMap<TensorId, usize>,
    received: Vec<bool>,
    sink: &'a mut dyn FnMut(usize, Tensor) -> Result<()>,
}

impl<'a> Grads<'a> {
    fn new(model: &Transformer, sink: &'a mut dyn FnMut(usize, Tensor) -> Result<()>) -> Self {
        let vars = model.params().vars();
        Self {
            index: vars
                .iter()
                .enumerate()
                .map(|(i, v)| (v.as_tensor().id(), i))
                .collect(),
            received: vec![false; vars.len()],
            sink,
        }
    }

    /// Hands over the gradient of `var` (any float dtype; cast to the parameter's).
    pub(crate) fn put(&mut self, var: &candle_core::Var, grad: Tensor) -> Result<()> {
        let i = self
            .index
            .get(&var.as_tensor().id())
            .copied()
            .ok_or_else(|| Error::internal("a layer's parameter is not in the model's store"))?;
        if self.received[i] {
            return Err(Error::internal(format!(
                "parameter {i} received two gradients"
            )));
        }
        self.received[i] = true;
        (self.sink)(i, grad.to_dtype(var.dtype())?)
    }

    fn finish(&self, model: &Transformer) -> Result<()> {
        match self.received.iter().position(|&r| !r) {
            Some(i) => Err(Error::MissingGradient {
                parameter: model.params().names()[i].clone(),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::spec::model::ModelSpec;

    /// Loss, input gradient and parameter gradients of the head for `row_multiple`.
    fn head_pass(
        model: &Transformer,
        x: &Tensor,
        targets: &Tensor,
        row_multiple: usize,
    ) -> (Vec<f32>, Vec<f32>, HashMap<usize, Vec<f32>>, usize) {
        let mut got = HashMap::new();
        let mut sink = |i: usize, g: Tensor| -> Result<()> {
            got.insert(i, g.flatten_all()?.to_vec1::<f32>()?);
            Ok(())
        };
        let mut grads = Grads::new(model, &mut sink);
        let head = Head::new(model, DType::F32, row_multiple).unwrap();
        let (hidden, logits) = head.forward(x).unwrap();
        let columns = logits.dim(1).unwrap();
        let losses = ops::cross_entropy_rows_padded(&logits, targets, head.classes()).unwrap();
        let row_grad = Tensor::ones(losses.elem_count(), DType::F32, x.device()).unwrap();
        let dlogits =
            ops::cross_entropy_backward(&logits, targets, head.classes(), &losses, &row_grad)
                .unwrap();
        let dx = head.backward(x, &hidden, dlogits, &mut grads).unwrap();
        drop(grads);
        let losses = losses.to_vec1::<f32>().unwrap();
        let dx = dx.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (losses, dx, got, columns)
    }

    #[test]
    fn a_padded_head_computes_what_the_unpadded_one_does() {
        let spec = ModelSpec {
            vocab_size: 37,
            ..ModelSpec::tiny()
        };
        let device = Device::Cpu;
        let model = Transformer::new(&spec, &device, 3).unwrap();
        let rows = 10;
        let x = Tensor::randn(0f32, 1.0, (rows, spec.d_model), &device).unwrap();
        let targets = Tensor::arange(0u32, rows as u32, &device)
            .unwrap()
            .affine(3.0, 1.0)
            .unwrap();

        let (loss, dx, grads, columns) = head_pass(&model, &x, &targets, 1);
        assert_eq!(columns, 37);
        let (padded_loss, padded_dx, padded_grads, padded_columns) =
            head_pass(&model, &x, &targets, 16);
        assert_eq!(padded_columns, 48, "padded to a multiple of 16");
        // Same values up to the products' summation order (on this CPU they are identical).
        let close = |what: &str, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}: lengths");
            let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= 1e-6 * scale, "{what}: {g} vs {w}");
            }
        };
        close("loss", &padded_loss, &loss);
        close("dx", &padded_dx, &dx);
        // The head's weight (and the final norm's parameters) got gradients of the same shape
        // and values: the padding rows were cut off.
        assert!(!grads.is_empty());
        assert_eq!(padded_grads.len(), grads.len());
        for (i, want) in &grads {
            close(&format!("parameter {i}"), &padded_grads[i], want);
        }
        let head_weight = model.head_layer().weight().elem_count();
        assert!(grads.values().any(|g| g.len() == head_weight));
    }
}
