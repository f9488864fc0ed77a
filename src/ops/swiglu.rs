//! SwiGLU, the feed-forward activation of Llama, Qwen and Mistral, between the gate/up product
//! and the down projection, forward and backward, for the explicit engine.
//!
//! The gate and up projections run as one product of width `2·f` (`[gate | up]` per row), so
//! the activation reads one tensor and writes `f` columns: `dropout(silu(g + bg) · (u + bu))`.
//! Its backward pass recomputes `silu` from the saved product instead of keeping the
//! activation, and writes the product's gradient in the same `[gate | up]` layout. Dropout
//! masks are drawn over the output's element indices, as every epilogue's.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::epilogue::KernelDropout;
use super::{check_input, input_f32, output, rows_cols, DropoutMask};

const NAME: &str = "swiglu";

/// What the kernels need besides the tensors.
#[derive(Debug, Clone, Copy)]
struct SwigluOps {
    has_bias: bool,
    dropout: KernelDropout,
}

impl SwigluOps {
    fn new(has_bias: bool, dropout: Option<DropoutMask>) -> Self {
        Self {
            has_bias,
            dropout: KernelDropout::new(dropout),
        }
    }
}

fn silu_parts(g: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + (-g).exp());
    (g * s, s)
}

/// `dropout(silu(g + bg) · (u + bu))` for the `[g | u]` rows of `h` (`rows × 2f`, any float
/// dtype), `(rows, f)` in `h`'s dtype; `bias` is an f32 vector of `2f`. No graph is recorded.
pub fn swiglu(h: &Tensor, bias: Option<&Tensor>, dropout: Option<DropoutMask>) -> Result<Tensor> {
    check_input(h, NAME)?;
    let h = h.contiguous()?;
    let ops = SwigluOps::new(bias.is_some(), dropout);
    let bias = bias_or_dummy(&h, bias)?;
    h.apply_op2_no_bwd(&bias, &Swiglu { ops })
}

/// The gradient of [`swiglu`]'s input `h` (`rows × 2f`) from the gradient of its output.
pub fn swiglu_backward(
    dout: &Tensor,
    h: &Tensor,
    bias: Option<&Tensor>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let h = h.contiguous()?;
    let (rows, cols) = h.dims2()?;
    if dout.dims() != [rows, cols / 2] {
        bail!(
            "{NAME}: output gradient {:?} does not match [{rows}, {}]",
            dout.shape(),
            cols / 2
        );
    }
    let ops = SwigluOps::new(bias.is_some(), dropout);
    let bias = bias_or_dummy(&h, bias)?;
    let dout = dout.to_dtype(h.dtype())?.contiguous()?;
    dout.apply_op3_no_bwd(&h, &bias, &SwigluGrad { ops })
}

/// The gate/up product's bias (as the epilogue's `bias_or_dummy`), after checking that
/// the product splits into a gate and an up half.
fn bias_or_dummy(h: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let cols = h.dim(candle_core::D::Minus1)?;
    if cols % 2 != 0 {
        bail!("{NAME}: the gate/up product needs an even width, got {cols}");
    }
    super::epilogue::bias_or_dummy(NAME, h, bias)
}

struct Swiglu {
    ops: SwigluOps,
}

struct SwigluGrad {
    ops: SwigluOps,
}

/// The biased gate and up values of element `j` of row `r`.
fn gate_up(h: &[f32], bias: &[f32], has_bias: bool, f: usize, r: usize, j: usize) -> (f32, f32) {
    let (mut g, mut u) = (h[r * 2 * f + j], h[r * 2 * f + f + j]);
    if has_bias {
        g += bias[j];
        u += bias[f + j];
    }
    (g, u)
}

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = rows_cols(l1);
        let f = cols / 2;
        let (h, bias) = (input_f32(s1, l1, NAME)?, input_f32(s2, l2, NAME)?);
        let p = self.ops;
        let out = (0..rows * f)
            .map(|i| {
                let (g, u) = gate_up(&h, &bias, p.has_bias, f, i / f, i % f);
                p.dropout.apply(i, silu_parts(g).0 * u)
            })
            .collect();
        Ok((output(out, s1.dtype())?, Shape::from((rows, f))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(l1);
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::forward(v, l1, (s2, l2), &self.ops, &s1.device)?
        });
        Ok((out, Shape::from((rows, cols / 2))))
    }
}

impl CustomOp3 for SwigluGrad {
    fn name(&self) -> &'static str {
        "swiglu-grad"
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
        let (rows, cols) = rows_cols(l2);
        let f = cols / 2;
        let dout = input_f32(s1, l1, NAME)?;
        let (h, bias) = (input_f32(s2, l2, NAME)?, input_f32(s3, l3, NAME)?);
        let p = self.ops;
        let mut dh = vec![0f32; rows * cols];
        for i in 0..rows * f {
            let (r, j) = (i / f, i % f);
            let (g, u) = gate_up(&h, &bias, p.has_bias, f, r, j);
            let d = p.dropout.apply(i, dout[i]);
            let (silu, s) = silu_parts(g);
            dh[r * cols + j] = d * u * s * (1.0 + g * (1.0 - s));
            dh[r * cols + f + j] = d * silu;
        }
        Ok((output(dh, s1.dtype())?, Shape::from((rows, cols))))
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
        let (rows, cols) = rows_cols(l2);
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::backward(v, l1, (s2, l2), (s3, l3), &self.ops, &s1.device)?
        });
        Ok((out, Shape::from((rows, cols))))
    }
}

#[cfg(feature = "cuda")]
mod gpu;
