//! Multi-head self-attention between the q/k/v product and the output projection, forward and
//! backward, in one of two implementations:
//!
//! - [`Attention::Flash`] ([`ops::flash_attention`]): reads q, k and v straight from the
//!   product's rows and keeps one log-sum-exp per row and head; the probabilities are recomputed
//!   in the backward pass. Where the device has no kernel for the dtype or head width, the
//!   materialised path runs instead ([`Attention::resolve`]).
//! - [`Attention::Materialized`]: heads split into `(3, batch, heads, seq, hd)`, batched
//!   products around [`ops::attention_softmax`], probabilities kept for the backward pass: the
//!   reference the flash path is tested against, and the fallback.
//!
//! Both draw dropout masks over the `(batch, heads, seq, seq)` probability indices, so they
//! compute the same function.

use candle_core::{DType, Device, Tensor};

use crate::ops::{self, AttentionShape, DropoutMask};
use crate::Result;

/// How attention runs in the explicit engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Flash attention where the device supports it, materialised elsewhere.
    Flash,
    /// Probabilities materialised and kept for the backward pass.
    Materialized,
}

impl Attention {
    /// The implementation that runs for `dtype` activations with heads of `head_dim` on
    /// `device`.
    pub fn resolve(self, device: &Device, dtype: DType, head_dim: usize) -> Attention {
        match self {
            Attention::Flash if ops::flash_attention_supported(device, dtype, head_dim) => {
                Attention::Flash
            }
            _ => Attention::Materialized,
        }
    }
}

/// What attention's backward pass reads, besides the merged output.
pub(crate) enum Saved {
    Flash {
        /// The q/k/v product `(rows, 3d)`.
        qkv: Tensor,
        /// Log-sum-exp of each row's scores `(batch, heads, seq)`, f32.
        lse: Tensor,
    },
    Materialized {
        /// q, k, v as `(3, batch, heads, seq, head_dim)`.
        heads: Tensor,
        /// Probabilities before dropout `(batch, heads, seq, seq)`.
        probs: Tensor,
    },
}

/// `(what backward reads, merged output rows (rows, d))` from the q/k/v product `(rows, 3d)`.
pub(crate) fn forward(
    how: Attention,
    qkv: Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
) -> Result<(Saved, Tensor)> {
    match how {
        Attention::Flash => {
            let (merged, lse) = ops::flash_attention(&qkv, shape, mask)?;
            Ok((Saved::Flash { qkv, lse }, merged))
        }
        Attention::Materialized => materialized_forward(qkv, shape, mask),
    }
}

/// The gradient of the q/k/v product `(rows, 3d)` from that of the merged output.
pub(crate) fn backward(
    saved: Saved,
    merged: &Tensor,
    dmerged: &Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    match saved {
        Saved::Flash { qkv, lse } => Ok(ops::flash_attention_backward(
            &qkv, merged, &lse, dmerged, shape, mask,
        )?),
        Saved::Materialized { heads, probs } => {
            materialized_backward(&heads, &probs, dmerged, shape, mask)
        }
    }
}

fn materialized_forward(
    qkv: Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
) -> Result<(Saved, Tensor)> {
    let &AttentionShape {
        batch: b,
        seq: s,
        heads: h,
        causal,
    } = shape;
    let d = qkv.dim(1)? / 3;
    let hd = d / h;
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
    Ok((Saved::Materialized { heads, probs }, merged))
}

fn materialized_backward(
    heads: &Tensor,
    probs: &Tensor,
    dmerged: &Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    let (b, s, h) = (shape.batch, shape.seq, shape.heads);
    let d = dmerged.dim(1)?;
    let hd = d / h;
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

/// Attention's score scale, 1/√head_dim.
fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}
