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
//! compute the same function. Packed sequences (position ids given) keep each query inside its
//! own example: the flash kernels skip what lies outside it, the materialised path masks the
//! scores.

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
        /// q `(batch, heads, seq, head_dim)`.
        q: Tensor,
        /// k and v `(batch, kv_heads, seq, head_dim)`: shared heads are repeated only while
        /// a product needs them.
        k: Tensor,
        v: Tensor,
        /// Probabilities before dropout `(batch, heads, seq, seq)`.
        probs: Tensor,
    },
}

/// `(what backward reads, merged output rows (rows, d))` from the q/k/v product
/// `(rows, (heads + 2·kv_heads)·hd)`; `positions` are packed sequences' position ids.
pub(crate) fn forward(
    how: Attention,
    qkv: Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
    positions: Option<&Tensor>,
) -> Result<(Saved, Tensor)> {
    match how {
        Attention::Flash => {
            let (merged, lse) = match positions {
                None => ops::flash_attention(&qkv, shape, mask)?,
                Some(ids) => ops::flash_attention_packed(&qkv, shape, mask, ids)?,
            };
            Ok((Saved::Flash { qkv, lse }, merged))
        }
        Attention::Materialized => materialized_forward(qkv, shape, mask, positions),
    }
}

/// The gradient of the q/k/v product from that of the merged output.
pub(crate) fn backward(
    saved: Saved,
    merged: &Tensor,
    dmerged: &Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
    positions: Option<&Tensor>,
) -> Result<Tensor> {
    match saved {
        Saved::Flash { qkv, lse } => Ok(match positions {
            None => ops::flash_attention_backward(&qkv, merged, &lse, dmerged, shape, mask)?,
            Some(ids) => {
                ops::flash_attention_packed_backward(&qkv, merged, &lse, dmerged, shape, mask, ids)?
            }
        }),
        Saved::Materialized { q, k, v, probs } => {
            materialized_backward(&q, &k, &v, &probs, dmerged, shape, mask)
        }
    }
}

fn materialized_forward(
    qkv: Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
    positions: Option<&Tensor>,
) -> Result<(Saved, Tensor)> {
    let &AttentionShape {
        batch: b,
        seq: s,
        heads: h,
        kv_heads: kv,
        causal,
    } = shape;
    let hd = qkv.dim(1)? / (h + 2 * kv);
    let d = h * hd;
    let (q, k, v) = split_heads(&qkv, shape, hd)?;
    drop(qkv);
    let mut scores = q.matmul(&repeat_kv(&k, h)?.t()?)?;
    if let Some(ids) = positions {
        scores = scores.broadcast_add(&other_examples(ids, b, s)?.to_dtype(scores.dtype())?)?;
    }
    let probs = ops::attention_softmax(&scores, scale(hd), if causal { s } else { 0 })?;
    drop(scores);
    let dropped = match mask {
        Some(m) => ops::dropout(&probs, m)?,
        None => probs.clone(),
    };
    let o = dropped.matmul(&repeat_kv(&v, h)?)?;
    drop(dropped);
    let merged = ops::permute_contiguous(&o, &[0, 2, 1, 3])?.reshape((b * s, d))?;
    Ok((Saved::Materialized { q, k, v, probs }, merged))
}

/// `(b, 1, s, s)`: −∞ where query `i` may not see key `j` because `j` lies before the start of
/// `i`'s example (`i − positions[i]`), 0 elsewhere; the causal mask does the rest.
fn other_examples(positions: &Tensor, b: usize, s: usize) -> Result<Tensor> {
    let device = positions.device();
    let index = Tensor::arange(0u32, s as u32, device)?.to_dtype(DType::F32)?;
    let starts = index
        .reshape((1, 1, s, 1))?
        .broadcast_sub(&positions.to_dtype(DType::F32)?.reshape((b, 1, s, 1))?)?;
    let before = index.reshape((1, 1, 1, s))?.broadcast_lt(&starts)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (b, 1, s, s), device)?;
    let open = Tensor::zeros((b, 1, s, s), DType::F32, device)?;
    Ok(before
        .broadcast_as((b, 1, s, s))?
        .where_cond(&blocked, &open)?)
}

/// q `(b, heads, s, hd)`, k and v `(b, kv_heads, s, hd)` from the q/k/v product's columns.
fn split_heads(
    qkv: &Tensor,
    shape: &AttentionShape,
    hd: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, s, h, kv) = (shape.batch, shape.seq, shape.heads, shape.kv_heads);
    let part = |start: usize, n: usize| -> Result<Tensor> {
        let cols = qkv.narrow(1, start * hd, n * hd)?.contiguous()?;
        Ok(ops::permute_contiguous(
            &cols.reshape((b, s, n, hd))?,
            &[0, 2, 1, 3],
        )?)
    };
    Ok((part(0, h)?, part(h, kv)?, part(h + kv, kv)?))
}

/// `(b, kv, s, hd)` key/value heads repeated for `heads` query heads (each shared by a group of
/// `heads / kv` consecutive ones); the heads themselves when there is one per query head.
fn repeat_kv(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kv, s, hd) = x.dims4()?;
    if kv == heads {
        return Ok(x.clone());
    }
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, kv, heads / kv, s, hd))?
        .contiguous()?
        .reshape((b, heads, s, hd))?)
}

/// The sum over each group of `heads / kv` query heads of a `(b, heads, s, hd)` gradient: the
/// gradient of the shared key/value heads.
fn sum_groups(x: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, h, s, hd) = x.dims4()?;
    if kv == h {
        return Ok(x.clone());
    }
    Ok(x.reshape((b, kv, h / kv, s, hd))?.sum(2)?)
}

fn materialized_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: &Tensor,
    dmerged: &Tensor,
    shape: &AttentionShape,
    mask: Option<DropoutMask>,
) -> Result<Tensor> {
    let (b, s, h, kv) = (shape.batch, shape.seq, shape.heads, shape.kv_heads);
    let d = dmerged.dim(1)?;
    let hd = d / h;
    // (rows, d) → (b, h, s, hd)
    let d_o = ops::permute_contiguous(&dmerged.reshape((b, s, h, hd))?, &[0, 2, 1, 3])?;
    let dropped = match mask {
        Some(m) => ops::dropout(probs, m)?,
        None => probs.clone(),
    };
    let dv = sum_groups(&dropped.t()?.matmul(&d_o)?, kv)?;
    drop(dropped);
    let d_dropped = d_o.matmul(&repeat_kv(v, h)?.t()?)?;
    let dprobs = match mask {
        Some(m) => ops::dropout(&d_dropped, m)?,
        None => d_dropped,
    };
    let dscores = ops::attention_softmax_backward(probs, &dprobs, scale(hd))?;
    drop(dprobs);
    let dq = dscores.matmul(&repeat_kv(k, h)?)?;
    let dk = sum_groups(&dscores.t()?.matmul(q)?, kv)?;
    drop(dscores);
    // Each part (b, n, s, hd) → (b, s, n·hd), side by side as the product's columns.
    let rows = |t: &Tensor, n: usize| -> Result<Tensor> {
        Ok(ops::permute_contiguous(t, &[0, 2, 1, 3])?.reshape((b * s, n * hd))?)
    };
    Ok(Tensor::cat(
        &[&rows(&dq, h)?, &rows(&dk, kv)?, &rows(&dv, kv)?],
        1,
    )?)
}

/// Attention's score scale, 1/√head_dim.
fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}
