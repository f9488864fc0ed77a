//! One Transformer block, forward and backward, pre- or post-norm.
//!
//! Rows are `batch·seq` tokens of width `d`; attention between the q/k/v product and the output
//! projection is [`super::attention`]'s. With rotary positions the q and k heads of the q/k/v
//! product are rotated in place right after the product (and its gradient rotated back before
//! the product's backward pass), so attention and what it saves see rotated heads; SwiGLU runs
//! as its own op between the gate/up product and the down projection.

use candle_core::{DType, Tensor};

use super::attention::{self, Attention};
use super::linear::{Lin, Norm, Products};
use super::Grads;
use crate::model::batch::Batch;
use crate::model::block::BlockLayers;
use crate::model::dropout::Dropout;
use crate::ops::{self, AttentionShape, DropoutMask, Rotation};
use crate::spec::model::{Activation, NormPlacement};
use crate::Result;

/// Dropout sites inside a block.
const ATTN_PROBS: u64 = 0;
const ATTN_OUT: u64 = 1;
const FF_HIDDEN: u64 = 2;
const FF_OUT: u64 = 3;

/// The token rows of a pass: `batch` sequences of `seq` tokens, and for packed sequences each
/// token's position within its own example.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub batch: usize,
    pub seq: usize,
    pub positions: Option<&'a Tensor>,
}

impl<'a> Rows<'a> {
    /// The rows of `batch`; packed sequences need a model without learned positions (their
    /// table is looked up by index, not by position id).
    pub(crate) fn of(model: &crate::model::Transformer, batch: &'a Batch) -> Result<Self> {
        let (batch_size, seq) = batch.inputs.dims2()?;
        if batch.positions.is_some() && model.position_embedding().is_some() {
            return Err(crate::Error::Usage(
                "packed sequences need a model with rotary positions or none; pass --no-pack \
                 to pad each example instead"
                    .into(),
            ));
        }
        Ok(Self {
            batch: batch_size,
            seq,
            positions: batch.positions.as_ref(),
        })
    }
}

/// A block's weights for one pass.
pub(crate) struct BlockWeights<'a> {
    qkv: Lin<'a>,
    out: Lin<'a>,
    ff_in: Lin<'a>,
    ff_out: Lin<'a>,
    norm1: Norm<'a>,
    norm2: Norm<'a>,
    heads: usize,
    kv_heads: usize,
    /// The rotary frequencies on the device, for models with rotary positions.
    rope: Option<Tensor>,
    causal: bool,
    attention: Attention,
    placement: NormPlacement,
    activation: Activation,
}

/// What a block's backward pass reads.
pub(crate) struct Saved {
    /// Input of the q/k/v product (the first norm's output in pre-norm blocks, the block input
    /// in post-norm ones).
    attn_in: Tensor,
    /// The block input (pre-norm: the first norm's input and the first residual).
    x: Tensor,
    /// What attention's backward pass reads.
    attn: attention::Saved,
    /// Merged attention output `(rows, d)`: the input of the output projection.
    merged: Tensor,
    /// Pre-norm: `x + attention` (the second norm's input). Post-norm: the first norm's input.
    mid: Tensor,
    /// Input of the feed-forward (the second norm's output in pre-norm blocks, the first norm's
    /// output in post-norm ones).
    ff_x: Tensor,
    /// Feed-forward hidden product before bias and activation `(rows, d_ff)`.
    hidden: Tensor,
    /// Post-norm only: the second norm's input.
    last: Option<Tensor>,
}

impl<'a> BlockWeights<'a> {
    /// `attention` is the implementation that runs (already resolved for the device); `causal`
    /// whether token `i` attends to tokens `0..=i` only; `rope` the rotary frequencies
    /// ([`ops::rotary::frequencies`]) when the model has rotary positions.
    pub(crate) fn new(
        layers: &BlockLayers<'a>,
        (dtype, products): (DType, Products),
        attention: Attention,
        causal: bool,
        rope: Option<Tensor>,
    ) -> Result<Self> {
        let lin = |layer| Lin::with_products(layer, dtype, products);
        Ok(Self {
            qkv: lin(layers.qkv)?,
            out: lin(layers.out)?,
            ff_in: lin(layers.ff_in)?,
            ff_out: lin(layers.ff_out)?,
            norm1: Norm::new(layers.norm1),
            norm2: Norm::new(layers.norm2),
            heads: layers.n_heads,
            kv_heads: layers.kv_heads,
            rope,
            causal,
            attention,
            placement: layers.placement,
            activation: layers.activation,
        })
    }

    /// The block's output rows and, if `keep`, what its backward pass needs.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        rows: Rows,
        dropout: &Dropout,
        part: u64,
        keep: bool,
    ) -> Result<(Tensor, Option<Saved>)> {
        let m = |site| dropout.mask(part, site);
        let attn_in = match self.placement {
            NormPlacement::Pre => self.norm1.forward(x)?,
            NormPlacement::Post => x.clone(),
        };
        let qkv = self.qkv.forward(&attn_in, None, None, None)?;
        self.rotate(&qkv, rows, Rotation::Forward)?;
        let shape = self.shape(rows);
        let (attn, merged) =
            attention::forward(self.attention, qkv, &shape, m(ATTN_PROBS), rows.positions)?;
        // x + dropout(merged · Woutᵀ + b)
        let mid = self.out.forward(&merged, None, m(ATTN_OUT), Some(x))?;
        let ff_x = match self.placement {
            NormPlacement::Pre => self.norm2.forward(&mid)?,
            NormPlacement::Post => self.norm1.forward(&mid)?,
        };
        let hidden = self.ff_in.product(&ff_x)?;
        let act = self.activate(&hidden, m(FF_HIDDEN))?;
        let residual = match self.placement {
            NormPlacement::Pre => &mid,
            NormPlacement::Post => &ff_x,
        };
        let summed = self.ff_out.forward(&act, None, m(FF_OUT), Some(residual))?;
        drop(act);
        let (out, last) = match self.placement {
            NormPlacement::Pre => (summed, None),
            NormPlacement::Post => (self.norm2.forward(&summed)?, Some(summed)),
        };
        let saved = keep.then(|| Saved {
            attn_in,
            x: x.clone(),
            attn,
            merged,
            mid,
            ff_x,
            hidden,
            last,
        });
        Ok((out, saved))
    }

    fn shape(&self, rows: Rows) -> AttentionShape {
        AttentionShape {
            batch: rows.batch,
            seq: rows.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            causal: self.causal,
        }
    }

    /// Rotates the q and k heads of the fresh q/k/v product (or its gradient) `qkv` in place;
    /// nothing without rotary positions.
    fn rotate(&self, qkv: &Tensor, rows: Rows, rotation: Rotation) -> Result<()> {
        if let Some(freqs) = &self.rope {
            let hd = qkv.dim(1)? / (self.heads + 2 * self.kv_heads);
            let heads = self.heads + self.kv_heads;
            match rows.positions {
                None => ops::rotate_in_place(qkv, freqs, heads, hd, rows.seq, rotation)?,
                Some(ids) => {
                    ops::rotate_packed_in_place(qkv, freqs, heads, hd, rows.seq, rotation, ids)?
                }
            }
        }
        Ok(())
    }

    /// The feed-forward's activation of the saved product `hidden` (its bias included).
    fn activate(&self, hidden: &Tensor, mask: Option<DropoutMask>) -> Result<Tensor> {
        match self.activation {
            Activation::Swiglu => Ok(ops::swiglu(hidden, self.ff_in.bias(), mask)?),
            act => self.ff_in.epilogue(hidden, Some(act), mask),
        }
    }

    /// Gradient of the block input from the gradient of its output; hands over the block's
    /// parameter gradients, and says when each layer's are settled: its weights are not read
    /// again in this pass (the half-precision copies were cast before, and a bias or norm is
    /// read only by its own layer's backward, which is done).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        dout: &Tensor,
        saved: Saved,
        rows: Rows,
        dropout: &Dropout,
        part: u64,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let m = |site| dropout.mask(part, site);
        let Saved {
            attn_in,
            x,
            attn,
            merged,
            mid,
            ff_x,
            hidden,
            last,
        } = saved;
        // Gradient of the feed-forward's residual sum.
        let dsum = match (&last, self.placement) {
            (Some(last), NormPlacement::Post) => {
                let d = self.norm2.backward(last, dout, grads)?;
                grads.layer_settled()?;
                d
            }
            _ => dout.clone(),
        };
        drop(last);
        let dff_x = self.feed_forward_backward(&dsum, hidden, &ff_x, dropout, part, grads)?;
        // Gradient of `mid` (the attention residual sum): the residual's and the norm's meet in
        // the norm's backward pass.
        let dmid = match self.placement {
            NormPlacement::Pre => self.norm2.backward_plus(&mid, &dff_x, Some(&dsum), grads)?,
            NormPlacement::Post => {
                let dff_in = (&dsum + &dff_x)?;
                self.norm1.backward(&mid, &dff_in, grads)?
            }
        };
        drop((dsum, dff_x, ff_x, mid));
        grads.layer_settled()?;
        // Attention output projection, then the heads.
        let dmerged = self
            .out
            .backward_through(&dmid, &dmid, &merged, None, m(ATTN_OUT), grads)?;
        grads.layer_settled()?;
        let shape = self.shape(rows);
        let dqkv = attention::backward(
            attn,
            &merged,
            &dmerged,
            &shape,
            m(ATTN_PROBS),
            rows.positions,
        )?;
        drop((dmerged, merged));
        self.rotate(&dqkv, rows, Rotation::Backward)?;
        let dattn_in = self.qkv.backward(&dqkv, &attn_in, grads)?;
        drop(dqkv);
        grads.layer_settled()?;
        // The block input's gradient: the residual's (`dmid`) and the attention branch's.
        match self.placement {
            NormPlacement::Pre => self.norm1.backward_plus(&x, &dattn_in, Some(&dmid), grads),
            NormPlacement::Post => Ok((dmid + dattn_in)?),
        }
    }

    /// Gradient of the feed-forward's input `ff_x` from the gradient `dsum` of its residual
    /// sum; hands over its layers' gradients. `hidden` is its saved product.
    fn feed_forward_backward(
        &self,
        dsum: &Tensor,
        hidden: Tensor,
        ff_x: &Tensor,
        dropout: &Dropout,
        part: u64,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let m = |site| dropout.mask(part, site);
        // The dropped activation is recomputed (cheaper than keeping it).
        let act = self.activate(&hidden, m(FF_HIDDEN))?;
        let dact = self
            .ff_out
            .backward_through(dsum, dsum, &act, None, m(FF_OUT), grads)?;
        drop(act);
        grads.layer_settled()?;
        let dff_x = match self.activation {
            Activation::Swiglu => {
                let dhidden =
                    ops::swiglu_backward(&dact, &hidden, self.ff_in.bias(), m(FF_HIDDEN))?;
                self.ff_in.backward(&dhidden, ff_x, grads)?
            }
            act => {
                self.ff_in
                    .backward_through(&dact, &hidden, ff_x, Some(act), m(FF_HIDDEN), grads)?
            }
        };
        drop((dact, hidden));
        grads.layer_settled()?;
        Ok(dff_x)
    }
}
