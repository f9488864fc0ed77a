//! A weight gradient summed in f32 straight out of its product: `acc += dyᵀ · x`.
//!
//! The vocabulary head runs in chunks of rows (`model::explicit::head`), and its weight's
//! gradient is the sum of the chunks' products. Done as a half-precision product, widened and
//! then added, each chunk holds a second table-sized gradient (gpt-1.3b: 0.2 GB, at the step's
//! peak) and rounds its part to bf16 before the sum. On the GPU the product here writes into
//! the f32 sum itself (cuBLAS `GemmEx` with an f32 output and β = 1): no second buffer, no
//! rounding of the parts, no widening pass.
//!
//! [`accumulate_product_nn`] is the input gradient's twin for a weight seen in slices of rows:
//! `acc += dy[:, cols] · w`, each slice's product written into one f32 sum.

use candle_core::{bail, DType, Result, Tensor};

use super::accumulate_into;

/// `acc += dyᵀ · x`: `acc` a contiguous f32 `(out, in)` tensor no other tensor shares (it is
/// written through), `dy` of `(rows, out)` and `x` of `(rows, in)` in one float dtype.
pub fn accumulate_product_tn(acc: &Tensor, dy: &Tensor, x: &Tensor) -> Result<()> {
    let (out, inputs) = acc.dims2()?;
    let (rows, dy_cols) = dy.dims2()?;
    let (x_rows, x_cols) = x.dims2()?;
    if acc.dtype() != DType::F32 || !acc.is_contiguous() {
        bail!("weight gradient: the sum must be a contiguous f32 matrix");
    }
    if dy_cols != out || x_cols != inputs || x_rows != rows || dy.dtype() != x.dtype() {
        bail!(
            "weight gradient: cannot add {:?}ᵀ·{:?} ({:?}, {:?}) into {:?}",
            dy.shape(),
            x.shape(),
            dy.dtype(),
            x.dtype(),
            acc.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if acc.device().is_cuda() {
        return gpu::accumulate_product_tn(acc, &dy.contiguous()?, &x.contiguous()?);
    }
    let part = dy.t()?.matmul(x)?;
    accumulate_into(acc, &part)
}

/// `acc += dy[:, first..first + k] · w`: `acc` a contiguous f32 `(rows, in)` tensor no other
/// tensor shares, `dy` a contiguous `(rows, cols)` matrix of which the `k` columns from `first`
/// are read, and `w` of `(k, in)` in `dy`'s dtype. The gradient of a layer's input summed over
/// slices of its weight's rows, in f32, without a copy of the columns on the GPU.
pub fn accumulate_product_nn(acc: &Tensor, dy: &Tensor, first: usize, w: &Tensor) -> Result<()> {
    let (rows, inputs) = acc.dims2()?;
    let (dy_rows, cols) = dy.dims2()?;
    let (k, w_cols) = w.dims2()?;
    if acc.dtype() != DType::F32 || !acc.is_contiguous() {
        bail!("input gradient: the sum must be a contiguous f32 matrix");
    }
    if dy_rows != rows || w_cols != inputs || first + k > cols || dy.dtype() != w.dtype() {
        bail!(
            "input gradient: cannot add {:?}[:, {first}..{}]·{:?} ({:?}, {:?}) into {:?}",
            dy.shape(),
            first + k,
            w.shape(),
            dy.dtype(),
            w.dtype(),
            acc.shape()
        );
    }
    #[cfg(feature = "cuda")]
    if acc.device().is_cuda() {
        return gpu::accumulate_product_nn(acc, &dy.contiguous()?, first, &w.contiguous()?);
    }
    let part = dy.narrow(1, first, k)?.contiguous()?.matmul(w)?;
    accumulate_into(acc, &part)
}

#[cfg(feature = "cuda")]
mod gpu;
