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
mod head;
mod head_rows;
mod linear;

use std::collections::HashMap;

use candle_core::{DType, Tensor, TensorId};

use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::model::gradients::GradientSink;
use crate::model::recompute::RecomputedBlocks;
use crate::model::{HeadGradient, Transformer};
use crate::ops::{self, DropoutMask};
use crate::spec::model::{NormPlacement, Positions};
use crate::{Error, Result};

pub use self::attention::Attention;
use self::block::{BlockWeights, Rows, Saved};
use self::head::{head_row_multiple, Head};
use self::head_rows::{slice_rows, Deferred, SlicedHead};
use self::linear::column_sum;
pub use self::linear::Products;

/// Dropout site of the embeddings (blocks use their own parts, see [`Dropout::mask`]).
const EMBED_PART: u64 = u64::MAX;

/// Forward and backward pass of one micro-batch: hands `(parameter index, gradient in the
/// parameter's dtype)` of `loss_factor × loss` to `sink`, once per parameter, and returns the
/// unscaled loss. The sink hears that a part's parameters are settled after the head's
/// backward, after each block's and after the embeddings'.
///
/// A block's weights are cast to the compute dtype when the block runs and dropped after it,
/// in the forward pass and again in the backward pass: the half-precision copies of the whole
/// model never exist at once (2 bytes per parameter), for one more cast per block and step.
/// Within a block's backward pass the sink hears that each layer is settled
/// ([`GradientSink::settled_layer`]); `head` says how the head's weight gradient is computed.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Transformer,
    plan: &RecomputedBlocks,
    batch: &Batch,
    (dtype, products): (DType, Products),
    attention: Attention,
    head: HeadGradient,
    dropout: &Dropout,
    loss_factor: f64,
    sink: &mut dyn GradientSink,
) -> Result<f64> {
    let started = std::time::Instant::now();
    let mut grads = Grads::new(model, sink);
    let rows = Rows::of(model, batch)?;
    let weights = BlockCaster::new(model, (dtype, products), attention, batch.inputs.device())?;
    let embed_mask = embed_mask(model, dropout);
    let x = embed(model, &batch.inputs, dtype, embed_mask)?;
    let (x, saved) = forward_blocks(&weights, plan, x, rows, dropout)?;
    let (loss, dx, rest) =
        head_loss_and_backward(model, x, batch, dtype, head, loss_factor, &mut grads)?;
    grads.settled()?;
    let dx = backward_blocks(&weights, saved, dx, rows, dropout, &mut grads)?;
    match rest {
        HeadRest::Rows(head, deferred) => {
            let dropped = embed_backward(
                model,
                &batch.inputs,
                &dx,
                embed_mask,
                TiedPart::Deferred,
                &mut grads,
            )?
            .ok_or_else(|| Error::internal("the embeddings kept no gradient for the head"))?;
            drop(dx);
            // The positions' gradient, then an untied table's by the head's slices of rows.
            grads.layer_settled()?;
            if model.is_tied() {
                head.weight_grad(deferred, Some((&batch.inputs, &dropped)), &mut grads)?;
            } else {
                let table = model.token_embedding();
                head.table_grad(table, &batch.inputs, &dropped, &mut grads)?;
                drop(dropped);
                head.weight_grad(deferred, None, &mut grads)?;
            }
        }
        HeadRest::Tied(tied) => {
            let tied = match tied {
                Some(t) => TiedPart::Whole(t),
                None => TiedPart::Untied,
            };
            embed_backward(model, &batch.inputs, &dx, embed_mask, tied, &mut grads)?;
        }
    }
    grads.finish(model)?;
    grads.settled()?;
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

/// The forward pass through the blocks from the embeddings `x`: the last block's output, and
/// for each block its saved activations, or only its input where `plan` recomputes it.
fn forward_blocks(
    weights: &BlockCaster,
    plan: &RecomputedBlocks,
    mut x: Tensor,
    rows: Rows,
    dropout: &Dropout,
) -> Result<(Tensor, Vec<LeftForBackward>)> {
    let blocks = weights.model.blocks().len();
    let mut saved: Vec<LeftForBackward> = Vec::with_capacity(blocks);
    for i in 0..blocks {
        let keep = !plan.recomputes(i);
        let (out, kept) = weights
            .block(i)?
            .forward(&x, rows, dropout, i as u64, keep)?;
        saved.push(match kept {
            Some(kept) => LeftForBackward::Kept(kept),
            None => LeftForBackward::Input(x),
        });
        x = out;
    }
    Ok((x, saved))
}

/// Head and loss of the last block's output `x`, in chunks of rows, and the head's backward:
/// the loss (still on the device), the gradient of `x`, and what the head leaves for the end
/// of the backward pass.
///
/// The loss is read at the very end: a read now would stall the device until the forward pass
/// is done, leaving it idle while the backward pass is being queued. A tied head's weight
/// gradient waits for the embeddings' part; by rows, the whole weight gradient waits.
fn head_loss_and_backward<'a>(
    model: &'a Transformer,
    x: Tensor,
    batch: &Batch,
    dtype: DType,
    head: HeadGradient,
    loss_factor: f64,
    grads: &mut Grads,
) -> Result<(Tensor, Tensor, HeadRest<'a>)> {
    let row_multiple = head_row_multiple(x.device());
    let reduction = batch.reduction();
    match head {
        HeadGradient::ByRows => {
            let slice = slice_rows(model.spec().d_model, dtype, row_multiple);
            let head = SlicedHead::new(model, dtype, row_multiple, slice)?;
            let chunk = head.chunk_rows(&x);
            let (loss, dx, deferred) =
                head.loss_and_backward(&x, &batch.targets, reduction, loss_factor, chunk, grads)?;
            Ok((loss, dx, HeadRest::Rows(head, deferred)))
        }
        HeadGradient::Whole => {
            let head = Head::new(model, dtype, row_multiple)?;
            let chunk = head.chunk_rows(&x)?;
            let (loss, dx, tied) =
                head.loss_and_backward(&x, &batch.targets, reduction, loss_factor, chunk, grads)?;
            Ok((loss, dx, HeadRest::Tied(tied)))
        }
    }
}

/// The backward pass through the blocks, last first, from the gradient `dx` of the last
/// block's output, recomputing where only the input was kept; returns the gradient of the
/// embeddings' output.
fn backward_blocks(
    weights: &BlockCaster,
    mut saved: Vec<LeftForBackward>,
    mut dx: Tensor,
    rows: Rows,
    dropout: &Dropout,
    grads: &mut Grads,
) -> Result<Tensor> {
    while let Some(stash) = saved.pop() {
        let i = saved.len();
        let w = weights.block(i)?;
        let kept = match stash {
            LeftForBackward::Kept(kept) => kept,
            LeftForBackward::Input(input) => w
                .forward(&input, rows, dropout, i as u64, true)?
                .1
                .ok_or_else(|| Error::internal(format!("block {i} kept nothing when asked to")))?,
        };
        dx = w.backward(&dx, kept, rows, dropout, i as u64, grads)?;
        // The block's weights (and their half-precision copies) are done with.
        drop(w);
        grads.settled()?;
    }
    Ok(dx)
}

/// The mean loss of `batch` without dropout, keeping nothing.
pub fn eval_loss(
    model: &Transformer,
    batch: &Batch,
    (dtype, products): (DType, Products),
    attention: Attention,
) -> Result<f64> {
    let rows = Rows::of(model, batch)?;
    let off = Dropout::disabled();
    let mut x = embed(model, &batch.inputs, dtype, None)?;
    // One block's weights at a time: evaluation never holds more than a training step.
    let weights = BlockCaster::new(model, (dtype, products), attention, batch.inputs.device())?;
    for i in 0..model.blocks().len() {
        x = weights
            .block(i)?
            .forward(&x, rows, &off, i as u64, false)?
            .0;
    }
    let head = Head::new(model, dtype, head_row_multiple(x.device()))?;
    let chunk = head.chunk_rows(&x)?;
    Ok(head
        .loss(&x, &batch.targets, batch.reduction(), chunk)?
        .to_scalar::<f64>()?)
}

/// Casts one block's weights for the pass at a time, with attention resolved for the device
/// and the rotary frequencies (if any) on it.
struct BlockCaster<'a> {
    model: &'a Transformer,
    dtype: DType,
    products: Products,
    attention: Attention,
    rope: Option<Tensor>,
}

impl<'a> BlockCaster<'a> {
    fn new(
        model: &'a Transformer,
        (dtype, products): (DType, Products),
        attention: Attention,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let spec = model.spec();
        let attention = attention.resolve(device, dtype, spec.head_dim());
        let rope = match spec.positions {
            Positions::Rotary(rope) => Some(ops::rotary::frequencies(
                &rope.inverse_frequencies(spec.head_dim()),
                device,
            )?),
            Positions::None | Positions::Learned => None,
        };
        Ok(Self {
            model,
            dtype,
            products,
            attention,
            rope,
        })
    }

    /// Block `i`'s weights in the compute dtype.
    fn block(&self, i: usize) -> Result<BlockWeights<'a>> {
        let block = &self.model.blocks()[i];
        BlockWeights::new(
            &block.layers(),
            (self.dtype, self.products),
            self.attention,
            self.model.spec().causal,
            self.rope.clone(),
        )
    }
}

/// What the head leaves for the end of the backward pass.
enum HeadRest<'a> {
    /// A tied head's f32 weight gradient, for the embeddings to add their part to.
    Tied(Option<Tensor>),
    /// The head whose weight gradient by rows is still to compute, and what it reads.
    Rows(SlicedHead<'a>, Deferred),
}

/// A tied head's part in the embedding table's gradient.
enum TiedPart {
    /// The head is not tied.
    Untied,
    /// The head's whole f32 gradient: the embeddings' part is added into it.
    Whole(Tensor),
    /// The table's gradient goes by rows later (a tied one's with the head's): the lookup's
    /// output gradient is returned for it.
    Deferred,
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
    let table = ops::to_half(&model.token_embedding().as_tensor().detach(), dtype)?;
    let positions = match model.position_embedding() {
        Some(p) => Some(ops::to_half(&p.as_tensor().detach(), dtype)?),
        None => None,
    };
    Ok(ops::embed(tokens, &table, positions.as_ref(), s, mask)?)
}

/// Hands over the embedding table's gradient (with a tied head's part added) and the position
/// table's; where the table's gradient goes by rows ([`TiedPart::Deferred`]), returns the
/// lookup's output gradient (dropout applied) for it instead.
fn embed_backward(
    model: &Transformer,
    tokens: &Tensor,
    dx: &Tensor,
    mask: Option<DropoutMask>,
    tied: TiedPart,
    grads: &mut Grads,
) -> Result<Option<Tensor>> {
    let (b, s) = tokens.dims2()?;
    let dx = match mask {
        Some(m) => ops::dropout(dx, m)?,
        None => dx.clone(),
    };
    let table = model.token_embedding();
    let vocab = table.dim(0)?;
    // A tied head's gradient takes the embeddings' part in place: one table-sized buffer.
    let for_head = match tied {
        TiedPart::Whole(head) => {
            ops::embed_backward_into(tokens, &dx, &head)?;
            grads.put(table, head)?;
            None
        }
        TiedPart::Untied => {
            grads.put(table, ops::embed_backward(tokens, &dx, vocab)?)?;
            None
        }
        TiedPart::Deferred => Some(dx.clone()),
    };
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
    Ok(for_head)
}

/// Routes parameter gradients to the sink, in the parameter's dtype, and checks that every
/// parameter got exactly one.
pub(crate) struct Grads<'a> {
    index: HashMap<TensorId, usize>,
    received: Vec<bool>,
    /// Rows received so far of gradients handed over in parts.
    rows_received: HashMap<usize, usize>,
    sink: &'a mut dyn GradientSink,
}

impl<'a> Grads<'a> {
    fn new(model: &Transformer, sink: &'a mut dyn GradientSink) -> Self {
        let vars = model.params().vars();
        Self {
            index: vars
                .iter()
                .enumerate()
                .map(|(i, v)| (v.as_tensor().id(), i))
                .collect(),
            received: vec![false; vars.len()],
            rows_received: HashMap::new(),
            sink,
        }
    }

    /// Hands over the gradient of `var` (any float dtype; cast to the parameter's).
    pub(crate) fn put(&mut self, var: &candle_core::Var, grad: Tensor) -> Result<()> {
        let i = self.unreceived(var)?;
        self.received[i] = true;
        let grad = cast_like(var, &grad)?;
        self.sink.gradient(i, grad)
    }

    /// Hands over rows `first..first + grad.dim(0)` of `var`'s gradient; the gradient counts
    /// as received once every row has come (each exactly once, in any order).
    pub(crate) fn put_rows(
        &mut self,
        var: &candle_core::Var,
        first: usize,
        grad: Tensor,
    ) -> Result<()> {
        let i = self.unreceived(var)?;
        let (rows, total) = (grad.dim(0)?, var.dim(0)?);
        let got = self.rows_received.entry(i).or_insert(0);
        if first + rows > total || *got + rows > total {
            return Err(Error::internal(format!(
                "parameter {i} received more than its {total} rows"
            )));
        }
        *got += rows;
        if *got == total {
            self.received[i] = true;
        }
        let grad = cast_like(var, &grad)?;
        self.sink.gradient_rows(i, first, grad)
    }

    /// The index of `var`, whose gradient has not been received yet.
    fn unreceived(&self, var: &candle_core::Var) -> Result<usize> {
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
        Ok(i)
    }

    /// Tells the sink that the gradients handed over so far are complete.
    fn settled(&mut self) -> Result<()> {
        self.sink.settled()
    }

    /// Tells the sink that the gradients handed over so far are complete, at a layer's grain.
    pub(crate) fn layer_settled(&mut self) -> Result<()> {
        self.sink.settled_layer()
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

/// `grad` in `var`'s dtype.
fn cast_like(var: &candle_core::Var, grad: &Tensor) -> Result<Tensor> {
    Ok(match var.dtype() {
        DType::F32 => ops::to_f32(grad)?,
        dtype => grad.to_dtype(dtype)?,
    })
}
