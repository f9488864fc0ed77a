//! One Transformer block, forward and backward, pre- or post-norm.
//!
//! Rows are `batch·seq` tokens of width `d`. Attention runs per head on `(batch, heads, seq,
//! head_dim)` tensors with batched matrix products; the scores' scale and the causal mask are
//! applied inside the softmax kernel, so no mask tensor or scaled copy exists.

use candle_core::{DType, Tensor};

use super::linear::{Lin, Norm};
use super::Grads;
use crate::model::block::BlockLayers;
use crate::model::dropout::Dropout;
use crate::ops::{self, DropoutMask};
use crate::spec::model::{Activation, NormPlacement};
use crate::Result;

/// Dropout sites inside a block.
const ATTN_PROBS: u64 = 0;
const ATTN_OUT: u64 = 1;
const FF_HIDDEN: u64 = 2;
const FF_OUT: u64 = 3;

/// A block's weights for one pass.
pub(crate) struct BlockWeights<'a> {
    qkv: Lin<'a>,
    out: Lin<'a>,
    ff_in: Lin<'a>,
    ff_out: Lin<'a>,
    norm1: Norm<'a>,
    norm2: Norm<'a>,
    heads: usize,
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
    /// q, k, v as `(3, batch, heads, seq, head_dim)`.
    heads: Tensor,
    /// Attention probabilities before dropout, `(batch, heads, seq, seq)`.
    probs: Tensor,
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
    pub(crate) fn new(layers: &BlockLayers<'a>, dtype: DType) -> Result<Self> {
        Ok(Self {
            qkv: Lin::new(layers.qkv, dtype)?,
            out: Lin::new(layers.out, dtype)?,
            ff_in: Lin::new(layers.ff_in, dtype)?,
            ff_out: Lin::new(layers.ff_out, dtype)?,
            norm1: Norm::new(layers.norm1),
            norm2: Norm::new(layers.norm2),
            heads: layers.n_heads,
            placement: layers.placement,
            activation: layers.activation,
        })
    }

    /// The block's output rows and, if `keep`, what its backward pass needs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        b: usize,
        s: usize,
        causal: bool,
        dropout: &Dropout,
        part: u64,
        keep: bool,
    ) -> Result<(Tensor, Option<Saved>)> {
        let m = |site| dropout.mask(part, site);
        let attn_in = match self.placement {
            NormPlacement::Pre => self.norm1.forward(x)?,
            NormPlacement::Post => x.clone(),
        };
        let (heads, probs, merged) = self.attention(&attn_in, b, s, causal, m(ATTN_PROBS))?;
        // x + dropout(merged · Woutᵀ + b)
        let mid = self.out.forward(&merged, None, m(ATTN_OUT), Some(x))?;
        let ff_x = match self.placement {
            NormPlacement::Pre => self.norm2.forward(&mid)?,
            NormPlacement::Post => self.norm1.forward(&mid)?,
        };
        let hidden = self.ff_in.product(&ff_x)?;
        let act = self
            .ff_in
            .epilogue(&hidden, Some(self.activation), m(FF_HIDDEN))?;
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
            heads,
            probs,
            merged,
            mid,
            ff_x,
            hidden,
            last,
        });
        Ok((out, saved))
    }

    /// Multi-head self-attention up to the merged heads (before the output projection):
    /// returns `(q/k/v heads, probabilities, merged output rows)`.
    fn attention(
        &self,
        x: &Tensor,
        b: usize,
        s: usize,
        causal: bool,
        mask: Option<DropoutMask>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let d = x.dim(1)?;
        let (h, hd) = (self.heads, d / self.heads);
        let qkv = self.qkv.forward(x, None, None, None)?;
        // (b, s, 3, h, hd) → (3, b, h, s, hd)
        let heads = ops::permute_contiguous(&qkv.reshape((b, s, 3, h, hd))?, &[2, 0, 3, 1, 4])?;
        drop(qkv);
        let (q, k, v) = (heads.get(0)?, heads.get(1)?, heads.get(2)?);
        let scores = q.matmul(&k.t()?)?;
        let probs = ops::attention_softmax(&scores, scale(hd), if causal { s } else { 0 })?;
        drop(scores);
        let dropped = match mask {
            Some(m) => ops::dropout(&probs, m)?,
            None => probs.clone(),
        };
        let o = dropped.matmul(&v)?;
        drop(dropped);
        let merged = ops::permute_contiguous(&o, &[0, 2, 1, 3])?.reshape((b * s, d))?;
        Ok((heads, probs, merged))
    }

    /// Gradient of the block input from the gradient of its output; hands over the block's
    /// parameter gradients.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        dout: &Tensor,
        saved: Saved,
        b: usize,
        s: usize,
        dropout: &Dropout,
        part: u64,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let m = |site| dropout.mask(part, site);
        let Saved {
            attn_in,
            x,
            heads,
            probs,
            merged,
            mid,
            ff_x,
            hidden,
            last,
        } = saved;
        // Gradient of the feed-forward's residual sum.
        let dsum = match (&last, self.placement) {
            (Some(last), NormPlacement::Post) => self.norm2.backward(last, dout, grads)?,
            _ => dout.clone(),
        };
        drop(last);
        // Feed-forward: recompute its dropped activation (cheaper than keeping it).
        let act = self
            .ff_in
            .epilogue(&hidden, Some(self.activation), m(FF_HIDDEN))?;
        let dact = self
            .ff_out
            .backward_through(&dsum, &dsum, &act, None, m(FF_OUT), grads)?;
        drop(act);
        let dff_x = self.ff_in.backward_through(
            &dact,
            &hidden,
            &ff_x,
            Some(self.activation),
            m(FF_HIDDEN),
            grads,
        )?;
        drop((dact, hidden));
        // Gradient of `mid` (the attention residual sum).
        let dmid = match self.placement {
            NormPlacement::Pre => (&dsum + self.norm2.backward(&mid, &dff_x, grads)?)?,
            NormPlacement::Post => {
                let dff_in = (&dsum + &dff_x)?;
                self.norm1.backward(&mid, &dff_in, grads)?
            }
        };
        drop((dsum, dff_x, ff_x, mid));
        // Attention output projection, then the heads.
        let dmerged = self
            .out
            .backward_through(&dmid, &dmid, &merged, None, m(ATTN_OUT), grads)?;
        drop(merged);
        let dqkv = self.attention_backward(&dmerged, &heads, &probs, b, s, m(ATTN_PROBS))?;
        drop((dmerged, heads, probs));
        let dattn_in = self.qkv.backward(&dqkv, &attn_in, grads)?;
        drop(dqkv);
        let dx = match self.placement {
            NormPlacement::Pre => self.norm1.backward(&x, &dattn_in, grads)?,
            NormPlacement::Post => dattn_in,
        };
        Ok((dmid + dx)?)
    }

    /// Gradient of the q/k/v product's output `(rows, 3d)` from that of the merged heads.
    fn attention_backward(
        &self,
        dmerged: &Tensor,
        heads: &Tensor,
        probs: &Tensor,
        b: usize,
        s: usize,
        mask: Option<DropoutMask>,
    ) -> Result<Tensor> {
        let d = dmerged.dim(1)?;
        let (h, hd) = (self.heads, d / self.heads);
        let (q, k, v) = (heads.get(0)?, heads.get(1)?, heads.get(2)?);
        // (rows, d) → (b, h, s, hd)
        let d_o = ops::permute_contiguous(&dmerged.reshape((b, s, h, hd))?, &[0, 2, 1, 3])?;
        let dropped = match mask {
            Some(m) => ops::dropout(probs, m)?,
            None => probs.clone(),
        };
        let dv = dropped.t()?.matmul(&d_o)?;
        drop(dropped);
        let d_dropped = d_o.matmul(&v.t()?)?;
        let dprobs = match mask {
            Some(m) => ops::dropout(&d_dropped, m)?,
            None => d_dropped,
        };
        let dscores = ops::attention_softmax_backward(probs, &dprobs, scale(hd))?;
        drop(dprobs);
        let dq = dscores.matmul(&k)?;
        let dk = dscores.t()?.matmul(&q)?;
        drop(dscores);
        // (3, b, h, s, hd) → (b, s, 3, h, hd) → (rows, 3d)
        let stacked = Tensor::stack(&[dq, dk, dv], 0)?;
        Ok(ops::permute_contiguous(&stacked, &[1, 3, 0, 2, 4])?.reshape((b * s, 3 * d))?)
    }
}

/// Attention's score scale, 1/√head_dim.
fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}
