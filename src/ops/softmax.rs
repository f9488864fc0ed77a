//! Softmax over the last dimension as one differentiable op.
//!
//! Memory: backward needs only the output `y` (`dx = y ⊙ (dy − Σ dy ⊙ y)`), which the next op
//! (dropout, the value matmul) keeps anyway; candle's graph also keeps the input alive as the
//! op's argument. The composite reference additionally keeps `x − max` and `exp(x − max)`, two
//! more full-size tensors per attention layer.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{check_input, input_f32, output, rows_cols};

const NAME: &str = "fused-softmax";

/// Softmax of `x` (any shape, f32/bf16/f16, any layout) over its last dimension, in `x`'s
/// dtype, computed in f32. Rows that are entirely −∞ give NaN, as the composite does.
///
/// Memory saved for backward: the output (and the input, which candle's graph holds as the
/// op's argument).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_input(x, NAME)?;
    x.contiguous()?.apply_op1(Softmax::PLAIN)
}

/// Attention probabilities `softmax(scale · x)` over the last dimension, outside any graph.
/// With `causal_seq > 0`, row `r` sees only columns `0..=r % causal_seq` (the others get 0):
/// a causal mask for `(…, seq, seq)` scores without a mask tensor.
pub fn attention_softmax(x: &Tensor, scale: f32, causal_seq: usize) -> Result<Tensor> {
    check_input(x, NAME)?;
    x.contiguous()?
        .apply_op1_no_bwd(&Softmax { scale, causal_seq })
}

/// The gradient of [`attention_softmax`]'s input from its output `y` and output gradient `dy`.
pub fn attention_softmax_backward(y: &Tensor, dy: &Tensor, scale: f32) -> Result<Tensor> {
    let dy = dy.to_dtype(y.dtype())?.contiguous()?;
    y.contiguous()?
        .apply_op2_no_bwd(&dy, &SoftmaxGrad { scale })
}

/// Forward: `x → y = softmax(scale · x)`, causally masked when `causal_seq > 0`.
struct Softmax {
    scale: f32,
    causal_seq: usize,
}

impl Softmax {
    const PLAIN: Softmax = Softmax {
        scale: 1.0,
        causal_seq: 0,
    };
}

/// Backward: `(y, dy) → dx`.
struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l);
        let y = fwd_cpu(&input_f32(s, l, NAME)?, cols, self.scale, self.causal_seq);
        Ok((output(y, s.dtype())?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s, v => {
            gpu::fwd(v, l, self.scale, self.causal_seq, &s.device)?
        });
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.to_dtype(y.dtype())?.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(&dy, &SoftmaxGrad { scale: 1.0 })?))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let dx = bwd_cpu(
            &input_f32(s1, l1, NAME)?,
            &input_f32(s2, l2, NAME)?,
            cols,
            self.scale,
        );
        Ok((output(dx, s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::bwd(v, l1, s2, l2, self.scale, &s1.device)?
        });
        Ok((out, l1.shape().clone()))
    }
}

fn fwd_cpu(x: &[f32], cols: usize, scale: f32, causal_seq: usize) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    for (r, (row, out)) in x
        .chunks_exact(cols)
        .zip(y.chunks_exact_mut(cols))
        .enumerate()
    {
        let seen = if causal_seq > 0 {
            r % causal_seq + 1
        } else {
            cols
        };
        let mut max = f32::NEG_INFINITY;
        for &v in &row[..seen] {
            max = max.max(scale * v);
        }
        let mut sum = 0f64;
        for j in 0..seen {
            out[j] = (scale * row[j] - max).exp();
            sum += f64::from(out[j]);
        }
        let inv = 1.0 / sum as f32;
        for v in out.iter_mut() {
            *v *= inv;
        }
    }
    y
}

fn bwd_cpu(y: &[f32], dy: &[f32], cols: usize, scale: f32) -> Vec<f32> {
    let mut dx = vec![0f32; y.len()];
    for (r, out) in dx.chunks_exact_mut(cols).enumerate() {
        let (yr, dyr) = (&y[r * cols..(r + 1) * cols], &dy[r * cols..(r + 1) * cols]);
        let mut dot = 0f64;
        for j in 0..cols {
            dot += f64::from(yr[j] * dyr[j]);
        }
        let dot = dot as f32;
        for j in 0..cols {
            out[j] = scale * yr[j] * (dyr[j] - dot);
        }
    }
    dx
}

#[cfg(feature = "cuda")]
mod gpu;
