//! Layer norm over the last dimension with affine f32 parameters, as one differentiable op.
//!
//! Memory: the graph keeps the input `x` (the op's argument) and the output; the per-row mean
//! and 1/std are *recomputed* from `x` in the backward kernels rather than saved. Saving them
//! would cost only 8 bytes per row, but a candle custom op has a single output, and the
//! recomputation re-reads a row that is being read anyway. The composite reference keeps an
//! f32 copy of `x` (for bf16/f16), the centred input, its square, the normalised input and
//! the scaled output: five full-size f32 tensors per norm.
//!
//! Backward runs two ops: one for `dx` (one block per row) and one for `dgamma`/`dbeta`, a
//! deterministic two-pass column reduction (per-chunk partial sums, then a fixed-order sum over
//! chunks; no float atomics), so gradients are bitwise reproducible.
//!
//! RMS norm ([`rms_norm`], Llama's) is the same op without the mean and the shift: the kernels
//! take a flag, so both share their memory behaviour and their reductions.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::{check_input, input_f32, output, row_stats, rows_cols};

const NAME: &str = "fused-layer-norm";

/// `(x − mean) / sqrt(var + eps) · gamma + beta` over the last dimension of `x` (f32, bf16 or
/// f16; any layout), returned in `x`'s dtype. `gamma` and `beta` are f32 vectors of the last
/// dimension's size (other dtypes are cast, differentiably). Statistics are computed in f32.
///
/// Gradients flow to `x`, `gamma` and `beta`. Memory saved for backward: `x` and the output;
/// mean and 1/std are recomputed.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    check_input(x, NAME)?;
    let d = x.dim(candle_core::D::Minus1)?;
    for (name, p) in [("gamma", gamma), ("beta", beta)] {
        if p.dims() != [d] {
            bail!("{NAME}: {name} must have shape [{d}], got {:?}", p.shape());
        }
    }
    let gamma = gamma.to_dtype(DType::F32)?.contiguous()?;
    let beta = beta.to_dtype(DType::F32)?.contiguous()?;
    x.contiguous()?
        .apply_op3(&gamma, &beta, LayerNorm { eps, rms: false })
}

/// `x / sqrt(mean(x²) + eps) · gamma` over the last dimension of `x` (f32, bf16 or f16),
/// returned in `x`'s dtype, statistics in f32: Llama's RMS norm. Gradients flow to `x` and
/// `gamma`, as for [`layer_norm`].
pub fn rms_norm(x: &Tensor, gamma: &Tensor, eps: f64) -> Result<Tensor> {
    check_input(x, NAME)?;
    let d = x.dim(candle_core::D::Minus1)?;
    if gamma.dims() != [d] {
        bail!(
            "{NAME}: gamma must have shape [{d}], got {:?}",
            gamma.shape()
        );
    }
    let gamma = gamma.to_dtype(DType::F32)?.contiguous()?;
    // The third input stands in for the shift, which RMS norm does not read.
    x.contiguous()?
        .apply_op3(&gamma, &gamma.detach(), LayerNorm { eps, rms: true })
}

/// The gradients `(dx, dgamma, dbeta)` of [`layer_norm`] from its input `x`, scale `gamma`
/// and output gradient `dy`, outside any graph (`dx` in `x`'s dtype, the others f32).
pub fn layer_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    layer_norm_backward_plus(x, gamma, dy, None, eps)
}

/// [`layer_norm_backward`] with `plus` (of `x`'s shape) added to `dx` in the same pass, before
/// `dx` is rounded to `x`'s dtype: a residual stream's gradient meeting the norm's, without a
/// pass of its own.
pub fn layer_norm_backward_plus(
    x: &Tensor,
    gamma: &Tensor,
    dy: &Tensor,
    plus: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dx, params) = norm_backward(x, gamma, dy, plus, eps, false)?;
    Ok((dx, params.get(0)?, params.get(1)?))
}

/// The gradients `(dx, dgamma)` of [`rms_norm`], outside any graph.
pub fn rms_norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    rms_norm_backward_plus(x, gamma, dy, None, eps)
}

/// [`rms_norm_backward`] with `plus` added to `dx` in the same pass, as
/// [`layer_norm_backward_plus`].
pub fn rms_norm_backward_plus(
    x: &Tensor,
    gamma: &Tensor,
    dy: &Tensor,
    plus: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (dx, params) = norm_backward(x, gamma, dy, plus, eps, true)?;
    Ok((dx, params.get(0)?))
}

/// `dx` (plus `plus`) and the `2 × d` parameter gradients `[dgamma; dbeta]`.
fn norm_backward(
    x: &Tensor,
    gamma: &Tensor,
    dy: &Tensor,
    plus: Option<&Tensor>,
    eps: f64,
    rms: bool,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let dy = dy.to_dtype(x.dtype())?.contiguous()?;
    let gamma = gamma.to_dtype(DType::F32)?.contiguous()?;
    let plus = match plus {
        Some(p) if p.dims() != x.dims() => bail!(
            "{NAME}: the gradient added to dx has shape {:?}, not x's {:?}",
            p.shape(),
            x.shape()
        ),
        Some(p) => Some(p.to_dtype(x.dtype())?.contiguous()?),
        None => None,
    };
    let dx = x.apply_op3_no_bwd(&dy, &gamma, &LayerNormGradInput { eps, rms, plus })?;
    let params = x.apply_op2_no_bwd(&dy, &LayerNormGradParams { eps, rms })?;
    Ok((dx, params))
}

/// Forward: `(x, gamma, beta) → y`.
struct LayerNorm {
    eps: f64,
    rms: bool,
}

/// Backward for the input: `(x, dy, gamma) → dx`, plus `plus` where given (contiguous, of
/// `x`'s dtype and shape).
struct LayerNormGradInput {
    eps: f64,
    rms: bool,
    plus: Option<Tensor>,
}

/// Backward for the parameters: `(x, dy) → [dgamma; dbeta]` as a `2 × d` f32 tensor.
struct LayerNormGradParams {
    eps: f64,
    rms: bool,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let (gamma, beta) = (input_f32(s2, l2, NAME)?, input_f32(s3, l3, NAME)?);
        let y = fwd_cpu(
            &input_f32(s1, l1, NAME)?,
            &gamma,
            &beta,
            cols,
            self.eps,
            self.rms,
        );
        Ok((output(y, s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::fwd(v, l1, (s2, l2), (s3, l3), self.eps, self.rms, &s1.device)?
        });
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.to_dtype(y.dtype())?.contiguous()?;
        let (eps, rms) = (self.eps, self.rms);
        let plus = None;
        let dx = x.apply_op3_no_bwd(&dy, gamma, &LayerNormGradInput { eps, rms, plus })?;
        let params = x.apply_op2_no_bwd(&dy, &LayerNormGradParams { eps, rms })?;
        // RMS norm's third input is a placeholder with no gradient.
        let dbeta = if rms { None } else { Some(params.get(1)?) };
        Ok((Some(dx), Some(params.get(0)?), dbeta))
    }
}

impl CustomOp3 for LayerNormGradInput {
    fn name(&self) -> &'static str {
        "fused-layer-norm-grad-input"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let (x, dy) = (input_f32(s1, l1, NAME)?, input_f32(s2, l2, NAME)?);
        let mut dx = bwd_input_cpu(&x, &dy, &input_f32(s3, l3, NAME)?, cols, self.eps, self.rms);
        if let Some(plus) = &self.plus {
            let plus = plus.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for (d, p) in dx.iter_mut().zip(plus) {
                *d += p;
            }
        }
        Ok((output(dx, s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let plus = self.plus.as_ref().map(|t| t.storage_and_layout());
        let plus = match &plus {
            Some((storage, layout)) => match &**storage {
                candle_core::Storage::Cuda(s) => Some((s, *layout)),
                _ => bail!("{NAME}: the gradient added to dx is not on the GPU"),
            },
            None => None,
        };
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::bwd_input(v, l1, (s2, l2), (s3, l3), plus, self.eps, self.rms, &s1.device)?
        });
        Ok((out, l1.shape().clone()))
    }
}

impl CustomOp2 for LayerNormGradParams {
    fn name(&self) -> &'static str {
        "fused-layer-norm-grad-params"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let (x, dy) = (input_f32(s1, l1, NAME)?, input_f32(s2, l2, NAME)?);
        let out = bwd_params_cpu(&x, &dy, cols, self.eps, self.rms);
        Ok((CpuStorage::F32(out), Shape::from((2, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::bwd_params(v, l1, (s2, l2), self.eps, self.rms, &s1.device)?
        });
        Ok((out, Shape::from((2, cols))))
    }
}

fn fwd_cpu(x: &[f32], gamma: &[f32], beta: &[f32], cols: usize, eps: f64, rms: bool) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for (row, out) in x.chunks_exact(cols).zip(y.chunks_exact_mut(cols)) {
        let (mean, rstd) = row_stats(row, eps, rms);
        for j in 0..cols {
            let shift = if rms { 0.0 } else { beta[j] };
            out[j] = (row[j] - mean) * rstd * gamma[j] + shift;
        }
    }
    y
}

fn bwd_input_cpu(
    x: &[f32],
    dy: &[f32],
    gamma: &[f32],
    cols: usize,
    eps: f64,
    rms: bool,
) -> Vec<f32> {
    let mut dx = vec![0f32; x.len()];
    for (r, out) in dx.chunks_exact_mut(cols).enumerate() {
        let (row, drow) = (&x[r * cols..(r + 1) * cols], &dy[r * cols..(r + 1) * cols]);
        let (mean, rstd) = row_stats(row, eps, rms);
        let (mut sum_g, mut sum_gx) = (0f64, 0f64);
        for j in 0..cols {
            let g = drow[j] * gamma[j];
            sum_g += f64::from(g);
            sum_gx += f64::from(g * (row[j] - mean) * rstd);
        }
        let mean_g = if rms {
            0.0
        } else {
            (sum_g / cols as f64) as f32
        };
        let mean_gx = (sum_gx / cols as f64) as f32;
        for j in 0..cols {
            let xhat = (row[j] - mean) * rstd;
            out[j] = rstd * (drow[j] * gamma[j] - mean_g - xhat * mean_gx);
        }
    }
    dx
}

/// `[dgamma; dbeta]` (2·cols f32), summed over rows in f64.
fn bwd_params_cpu(x: &[f32], dy: &[f32], cols: usize, eps: f64, rms: bool) -> Vec<f32> {
    let mut dgamma = vec![0f64; cols];
    let mut dbeta = vec![0f64; cols];
    for (row, drow) in x.chunks_exact(cols).zip(dy.chunks_exact(cols)) {
        let (mean, rstd) = row_stats(row, eps, rms);
        for j in 0..cols {
            dgamma[j] += f64::from(drow[j] * (row[j] - mean) * rstd);
            dbeta[j] += f64::from(drow[j]);
        }
    }
    dgamma.iter().chain(&dbeta).map(|&v| v as f32).collect()
}

#[cfg(feature = "cuda")]
mod gpu;
