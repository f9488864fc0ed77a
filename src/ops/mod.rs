//! Fused, differentiable operations: softmax cross-entropy, softmax and layer norm.
//!
//! candle's autograd keeps every input of every op alive until the backward pass, so a norm or
//! a loss composed from primitives keeps several full-size intermediates per call (centred
//! input, squares, exponentials, f32 copies of bf16 logits, ...). Each op here is one candle
//! custom op whose forward runs one kernel and whose backward recomputes what it needs from the
//! saved tensors, so the graph holds only the op's inputs and output. Every op has a CPU
//! implementation (tests, CI, CPU training) and a CUDA kernel; both accumulate in f32 whatever
//! the activation dtype.
//!
//! The CUDA kernels (`src/ops/kernels/*.cu`) are compiled to PTX by `build.rs` with nvcc at
//! build time, as candle-kernels does, and embedded in the binary. That keeps NVRTC out of the
//! run-time dependencies, uses the same toolchain (and the same `$NVCC`) as candle's own
//! kernels, and turns a kernel syntax error into a build error rather than a failure on the GPU
//! machine. The PTX targets `compute_80`, which the driver JIT-compiles for Ampere and newer.

mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda;
mod layer_norm;
mod softmax;

pub use cross_entropy::{cross_entropy, cross_entropy_rows};
pub use layer_norm::layer_norm;
pub use softmax::softmax_last_dim;

use candle_core::{bail, DType, Layout, Result, Tensor, WithDType};

/// Matches a float `CpuStorage`, binding its `Vec<T>` to `$v` in `$body`; the body is
/// monomorphised once per dtype (f32, bf16, f16), so it can call generic functions.
macro_rules! float_storage {
    ($op:expr, $storage:expr, $v:ident => $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32($v) => $body,
            candle_core::CpuStorage::BF16($v) => $body,
            candle_core::CpuStorage::F16($v) => $body,
            other => candle_core::bail!(
                "{}: expected f32, bf16 or f16 input, got {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(crate) use float_storage;

/// The contiguous part of a CPU buffer that `layout` addresses.
fn contiguous<'a, T>(data: &'a [T], layout: &Layout, op: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("{op}: input must be contiguous"),
    }
}

/// `(rows, cols)` of a tensor seen as a matrix over its last dimension.
fn rows_cols(layout: &Layout) -> (usize, usize) {
    let cols = layout.dims().last().copied().unwrap_or(1);
    (layout.shape().elem_count() / cols.max(1), cols)
}

/// Rejects what the kernels do not handle: empty tensors (a zero-sized launch is an error on
/// the GPU) and non-float dtypes.
fn check_input(x: &Tensor, op: &str) -> Result<()> {
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!("{op}: expected f32, bf16 or f16 input, got {:?}", x.dtype());
    }
    if x.rank() == 0 || x.elem_count() == 0 {
        bail!(
            "{op}: expected a non-empty input with at least one dimension, got {:?}",
            x.shape()
        );
    }
    Ok(())
}

#[inline]
fn to_f32<T: WithDType>(x: T) -> f32 {
    x.to_f64() as f32
}

/// f32 → T with round-to-nearest-even; exact via f64 because every f32 is an f64.
#[inline]
fn from_f32<T: WithDType>(x: f32) -> T {
    T::from_f64(f64::from(x))
}

/// Mean and 1/sqrt(var + eps) of a row: two passes (so a large mean does not cancel the
/// variance), f64 accumulators, f32 results as the kernels produce.
fn row_stats<T: WithDType>(row: &[T], eps: f64) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(to_f32(v))).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(to_f32(v)) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
}
