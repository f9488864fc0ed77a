//! Forward and backward passes of the autograd engines (fused and composite), with activation
//! checkpointing: chosen Transformer blocks keep only their input during the forward pass and
//! are recomputed in the backward pass.
//!
//! candle has no checkpoint API and no way to seed a backward pass with a gradient, so a
//! micro-batch's forward and backward passes run in segments:
//!
//! - **Forward.** A recomputed block runs on its *detached* input; its output is copied into a
//!   fresh `Var` and the block's graph is dropped on the spot, so none of its intermediates
//!   outlive its forward pass. What survives is a `Boundary`: the block's input (still attached
//!   to the graph of the segment before it) and the output `Var` the next segment starts from.
//!   Blocks that are not recomputed run as usual and keep their graph.
//! - **Backward.** The loss's backward pass covers the last segment and yields `dL/dy` for the
//!   last boundary's output. Then, in reverse order, each recomputed block runs again on its
//!   attached input and a `SeedGradient` root backpropagates `dL/dy` through the block *and*
//!   the segment before it, down to the previous boundary's output (or the embeddings).
//!
//! Every parameter is used in exactly one segment, so each backward pass hands over the
//! gradients of a disjoint set of parameters. Dropout masks are reproduced exactly because every
//! block draws from its own sub-stream ([`crate::model::Ctx::block`]).

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, Var};

use crate::model::batch::Batch;
use crate::model::block::RopeTables;
use crate::model::gradients::GradientSink;
use crate::model::layers::cross_entropy;
use crate::model::recompute::RecomputedBlocks;
use crate::model::{Ctx, Transformer};
use crate::{Error, Result};

/// What survives a recomputed block's forward pass.
struct Boundary {
    block: usize,
    /// The block's input, attached to the graph of the segment before it.
    input: Tensor,
    /// A copy of the block's output: the leaf the next segment starts from.
    output: Var,
}

/// Forward and backward pass of one micro-batch, segmented by `plan`.
///
/// Hands each parameter's gradient of `loss_factor × loss` to `sink` as `(index into
/// model.params().vars(), gradient in the parameter's dtype)`, exactly once per parameter, and
/// returns the (unscaled) loss.
pub fn forward_backward(
    model: &Transformer,
    plan: &RecomputedBlocks,
    batch: &Batch,
    dtype: DType,
    ctx: &Ctx,
    loss_factor: f64,
    sink: &mut dyn GradientSink,
) -> Result<f64> {
    if batch.positions.is_some() {
        return Err(Error::Usage(
            "packed sequences run on the explicit engines only; pass --no-pack to pad each \
             example instead"
                .into(),
        ));
    }
    let vars = model.params().vars();
    let mut received = vec![false; vars.len()];
    let inputs = BlockInputs::new(model, &batch.inputs, dtype)?;
    // A tied head's weight is the embedding table: its gradient has a part from each end of
    // the model, summed before the sink hears of it.
    let mut tied = model.is_tied().then(|| TiedGradient {
        index: vars
            .iter()
            .position(|v| v.as_tensor().id() == model.token_embedding().as_tensor().id())
            .unwrap_or(usize::MAX),
        sum: None,
    });
    let (loss, mut grads, mut boundaries) =
        forward_segments(model, plan, batch, dtype, ctx, &inputs, loss_factor)?;
    harvest(&mut grads, vars, &mut received, tied.as_mut(), sink)?;
    while let Some(boundary) = boundaries.pop() {
        let dy = grads.remove(boundary.output.as_tensor()).ok_or_else(|| {
            Error::internal(format!(
                "block {} output received no gradient",
                boundary.block
            ))
        })?;
        // Free the previous segment's gradients before the recomputation allocates.
        drop(grads);
        grads = backward_segment(model, &boundary, dy, ctx, &inputs)?;
        harvest(&mut grads, vars, &mut received, tied.as_mut(), sink)?;
    }
    if let Some(TiedGradient {
        index,
        sum: Some(sum),
    }) = tied
    {
        sink.gradient(index, sum)?;
    }
    if let Some(i) = received.iter().position(|&r| !r) {
        return Err(Error::MissingGradient {
            parameter: model.params().names()[i].clone(),
        });
    }
    // Segments share no parameter, but a graph keeps every weight it read until it is
    // dropped: only now is every weight done with.
    drop(grads);
    sink.settled()?;
    Ok(loss)
}

/// What the blocks read beside their input: the attention mask and the rotary tables.
struct BlockInputs {
    mask: Option<Tensor>,
    rope: Option<RopeTables>,
}

impl BlockInputs {
    /// Those of a batch of `tokens` computed in `dtype`.
    fn new(model: &Transformer, tokens: &Tensor, dtype: DType) -> Result<Self> {
        Ok(Self {
            mask: model.attention_mask(tokens.dim(1)?, dtype, tokens.device())?,
            rope: model.rope_tables(tokens.dim(1)?, dtype, tokens.device())?,
        })
    }
}

/// The forward pass, segmented by `plan`, and the loss's backward pass through the last
/// segment: the (unscaled) loss, the last segment's gradients, and the boundaries of the
/// recomputed blocks, first block first. The last segment's graph (logits and all) ends with
/// this function, as soon as its backward pass is done.
fn forward_segments(
    model: &Transformer,
    plan: &RecomputedBlocks,
    batch: &Batch,
    dtype: DType,
    ctx: &Ctx,
    inputs: &BlockInputs,
    loss_factor: f64,
) -> Result<(f64, GradStore, Vec<Boundary>)> {
    let (mask, rope) = (inputs.mask.as_ref(), inputs.rope.as_ref());
    let mut boundaries = Vec::with_capacity(plan.count());
    let mut x = model.embed(&batch.inputs, dtype, ctx)?;
    for (i, block) in model.blocks().iter().enumerate() {
        let block_ctx = ctx.block(i)?;
        if plan.recomputes(i) {
            // `y` and the block's whole graph die at the end of this statement; only the
            // copy in `output` remains.
            let output = Var::from_tensor(&block.forward(&x.detach(), mask, rope, &block_ctx)?)?;
            let next = output.as_tensor().clone();
            boundaries.push(Boundary {
                block: i,
                input: x,
                output,
            });
            x = next;
        } else {
            x = block.forward(&x, mask, rope, &block_ctx)?;
        }
    }
    let logits = model.head(&x, ctx)?;
    let loss = cross_entropy(&logits, &batch.targets, batch.mask.as_ref(), ctx.engine)?;
    let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((value, (loss * loss_factor)?.backward()?, boundaries))
}

/// The backward pass of a recomputed block and the segment before it: the block runs again on
/// its attached input and its output's gradient `dy` seeds the pass.
fn backward_segment(
    model: &Transformer,
    boundary: &Boundary,
    dy: Tensor,
    ctx: &Ctx,
    inputs: &BlockInputs,
) -> Result<GradStore> {
    let block_ctx = ctx.block(boundary.block)?;
    let y = model.blocks()[boundary.block].forward(
        &boundary.input,
        inputs.mask.as_ref(),
        inputs.rope.as_ref(),
        &block_ctx,
    )?;
    Ok(y.apply_op1(SeedGradient { dy })?.backward()?)
}

/// The gradient of a tied embedding table, summed over the segments that read it.
struct TiedGradient {
    index: usize,
    sum: Option<Tensor>,
}

/// Moves the parameter gradients out of `grads` into `sink` (a tied table's into its sum).
fn harvest(
    grads: &mut GradStore,
    vars: &[Var],
    received: &mut [bool],
    tied: Option<&mut TiedGradient>,
    sink: &mut dyn GradientSink,
) -> Result<()> {
    let mut tied = tied;
    for (i, var) in vars.iter().enumerate() {
        if let Some(g) = grads.remove(var) {
            received[i] = true;
            match tied.as_deref_mut() {
                Some(t) if t.index == i => {
                    t.sum = Some(match t.sum.take() {
                        Some(s) => (s + g)?,
                        None => g,
                    });
                }
                _ => sink.gradient(i, g)?,
            }
        }
    }
    Ok(())
}

/// The root of a recomputed block's backward pass: a scalar whose gradient with respect to the
/// block output `y` is `dy`, the gradient the following segment computed for it.
///
/// `(y · dy).sum()` would do the same, but candle's product backward also computes and stores a
/// gradient for `dy`, an activation-sized tensor that is never used.
struct SeedGradient {
    dy: Tensor,
}

impl CustomOp1 for SeedGradient {
    fn name(&self) -> &'static str {
        "seed-gradient"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        scalar_zero(s)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        scalar_zero(s)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // The seed is only ever the root of its backward pass, whose incoming gradient is
        // exactly one, so `dy` is the gradient as is.
        Ok(Some(self.dy.clone()))
    }
}

/// A scalar zero in `s`'s dtype and backend: the seed's value is never read.
fn scalar_zero<S: BackendStorage>(s: &S) -> candle_core::Result<(S, Shape)> {
    Ok((
        s.affine(&Layout::contiguous(()), 0.0, 0.0)?,
        Shape::from(()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_gradient_backpropagates_dy() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let x = Var::from_vec(vec![1f32, 2.0, 3.0], 3, &dev)?;
        let y = (x.as_tensor() * 2.0)?;
        let dy = Tensor::new(&[0.5f32, -1.0, 4.0], &dev)?;
        let grads = y.apply_op1(SeedGradient { dy })?.backward()?;
        let g: Vec<f32> = grads.get(&x).expect("x gets a gradient").to_vec1()?;
        assert_eq!(g, vec![1.0, -2.0, 8.0]);
        Ok(())
    }
}
