//! Fused, differentiable operations: softmax cross-entropy, softmax and layer norm; and the
//! explicit engine's kernels (epilogues, embeddings, flash attention, Adam).
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

mod adam;
mod attention;
pub mod compact_adam;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(feature = "cuda")]
mod cuda;
mod epilogue;
pub mod fp8;
mod fused_linear;
mod grad_product;
pub mod host_optim;
mod layer_norm;
mod permute;
pub mod rotary;
mod softmax;
mod swiglu;
pub mod transfer;
mod widen;

pub use adam::{adam_update, adam_update_all};
pub use attention::{
    flash_attention, flash_attention_backward, flash_attention_packed,
    flash_attention_packed_backward, flash_attention_padded, flash_attention_padded_backward,
    flash_attention_supported, AttentionShape, FLASH_HEAD_DIMS,
};
pub use cross_entropy::{
    cross_entropy, cross_entropy_backward, cross_entropy_backward_columns, cross_entropy_lse,
    cross_entropy_rows, cross_entropy_rows_padded,
};
pub use epilogue::{
    dropout, embed, embed_backward, embed_backward_into, embed_backward_rows_into, epilogue,
    epilogue_backward, DropoutMask,
};
pub use fused_linear::{fused_linear, FusedLinear};
pub use grad_product::{accumulate_product_nn, accumulate_product_tn};
pub use layer_norm::{
    layer_norm, layer_norm_backward, layer_norm_backward_plus, rms_norm, rms_norm_backward,
    rms_norm_backward_plus,
};
pub use permute::permute_contiguous;
pub use rotary::{rotate_in_place, rotate_packed_in_place, Rotation};
pub use softmax::{attention_softmax, attention_softmax_backward, softmax_last_dim};
pub use swiglu::{swiglu, swiglu_backward};
pub use widen::{accumulate_into, to_f32, to_half};

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor};

/// The contiguous values of a float CPU storage as f32. CPU kernels compute on f32 slices only;
/// bf16/f16 are converted (exactly) by candle's cast, which is optimised code even in debug
/// builds of this crate, so the hand-written loops stay monomorphic and few.
fn input_f32<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<Cow<'a, [f32]>> {
    match storage {
        CpuStorage::F32(v) => Ok(Cow::Borrowed(contiguous(v, layout, op)?)),
        CpuStorage::BF16(_) | CpuStorage::F16(_) => {
            if layout.contiguous_offsets().is_none() {
                bail!("{op}: input must be contiguous");
            }
            match storage.to_dtype(layout, DType::F32)? {
                CpuStorage::F32(v) => Ok(Cow::Owned(v)),
                _ => bail!("{op}: cast to f32 returned another dtype"),
            }
        }
        other => bail!(
            "{op}: expected f32, bf16 or f16 input, got {:?}",
            other.dtype()
        ),
    }
}

/// f32 results as a storage of `dtype` (round to nearest even, as the GPU kernels do).
fn output(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    let n = values.len();
    let storage = CpuStorage::F32(values);
    if dtype == DType::F32 {
        Ok(storage)
    } else {
        storage.to_dtype(&Layout::contiguous(n), dtype)
    }
}

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

/// Mean and 1/sqrt(var + eps) of a row: two passes (so a large mean does not cancel the
/// variance), f64 accumulators, f32 results as the kernels produce. With `rms` the mean is taken
/// as 0 (RMS norm: 1/sqrt(mean(x²) + eps)).
fn row_stats(row: &[f32], eps: f64, rms: bool) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = if rms {
        0.0
    } else {
        row.iter().map(|&v| f64::from(v)).sum::<f64>() / n
    };
    let mut sq = 0f64;
    for &v in row {
        let d = f64::from(v) - mean;
        sq += d * d;
    }
    (mean as f32, (1.0 / (sq / n + eps).sqrt()) as f32)
}
