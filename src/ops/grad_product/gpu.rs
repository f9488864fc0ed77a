//! The f32-accumulating products on cuBLAS, on candle's stream and handle.

#![allow(unsafe_code)]

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::cublas::{result, sys};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use crate::ops::cuda;

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!("gradient product: {what} {v} is over cuBLAS's int"))
    })
}

/// `acc += dyᵀ · x` (checked shapes, contiguous operands) as one `GemmEx`.
///
/// Row-major `acc (out × in)` is column-major `accᵀ (in × out)` = `xᵀ · dy`, with `x` read as
/// the column-major `in × rows` matrix it already is and `dy` transposed.
pub(super) fn accumulate_product_tn(acc: &Tensor, dy: &Tensor, x: &Tensor) -> Result<()> {
    let (out, inputs) = acc.dims2()?;
    let rows = dy.dim(0)?;
    if rows == 0 || out == 0 || inputs == 0 {
        return Ok(());
    }
    let address = |t: &Tensor| cuda::address(t, "weight gradient");
    // `x` holds rows·in and `dy` rows·out elements, `acc` out·in f32; the leading dimensions
    // are their row lengths.
    let product = Product {
        transpose_b: true,
        m: int(inputs, "width")?,
        n: int(out, "outputs")?,
        k: int(rows, "rows")?,
        a: (address(x)?, int(inputs, "width")?),
        b: (address(dy)?, int(out, "outputs")?),
        c: address(acc)?,
    };
    product.accumulate(acc, dy.dtype())
}

/// `acc += dy[:, first..first + k] · w` (checked shapes, contiguous operands) as one `GemmEx`.
///
/// Row-major `acc (rows × in)` is column-major `accᵀ (in × rows)` = `wᵀ · dy[:, cols]ᵀ`: `w`
/// is the column-major `in × k` matrix it already is, and the column block of `dy` the
/// column-major `k × rows` matrix that starts `first` elements in, with `dy`'s row length as
/// its leading dimension.
pub(super) fn accumulate_product_nn(
    acc: &Tensor,
    dy: &Tensor,
    first: usize,
    w: &Tensor,
) -> Result<()> {
    let (rows, inputs) = acc.dims2()?;
    let (k, cols) = (w.dim(0)?, dy.dim(1)?);
    if rows == 0 || inputs == 0 || k == 0 {
        return Ok(());
    }
    let address = |t: &Tensor| cuda::address(t, "input gradient");
    let offset = (first * dy.dtype().size_in_bytes()) as u64;
    // `w` holds k·in elements, `acc` rows·in f32, and `dy` rows·cols elements of which the
    // product reads columns first..first + k of every row (checked: first + k ≤ cols).
    let product = Product {
        transpose_b: false,
        m: int(inputs, "width")?,
        n: int(rows, "rows")?,
        k: int(k, "weight rows")?,
        a: (address(w)?, int(inputs, "width")?),
        b: (address(dy)? + offset, int(cols, "columns")?),
        c: address(acc)?,
    };
    product.accumulate(acc, dy.dtype())
}

/// One column-major `C (m × n) += A (m × k) · op(B)` with f32 `C` and accumulation; `a` and `b`
/// are device addresses with their leading dimensions, `op(B)` is `Bᵀ` (B stored `n × k`)
/// when `transpose_b`, else `B` (stored `k × n`); `C`'s leading dimension is `m`.
struct Product {
    transpose_b: bool,
    m: i32,
    n: i32,
    k: i32,
    a: (u64, i32),
    b: (u64, i32),
    c: u64,
}

impl Product {
    /// Runs the product on `acc`'s GPU with operands of `dtype` (the callers skip empty ones).
    fn accumulate(&self, acc: &Tensor, dtype: DType) -> Result<()> {
        let candle_core::Device::Cuda(dev) = acc.device() else {
            bail!("gradient product: the sum is not on a GPU");
        };
        let data_type = data_type(dtype)?;
        let transpose_b = if self.transpose_b {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        };
        let (alpha, beta) = (1f32, 1f32);
        let blas = dev.cublas_handle();
        // SAFETY: the handle runs on candle's stream, which orders this product after the
        // kernels that wrote the operands and the sum. The callers build `Product` from live
        // tensors of checked shapes: `a` addresses an `m × k` and `b` an `op(B)`-shaped matrix
        // of `data_type` at their leading dimensions, `c` an `m × n` f32 matrix no other tensor
        // shares.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                transpose_b,
                self.m,
                self.n,
                self.k,
                (&alpha as *const f32).cast::<c_void>(),
                self.a.0 as *const c_void,
                data_type,
                self.a.1,
                self.b.0 as *const c_void,
                data_type,
                self.b.1,
                (&beta as *const f32).cast::<c_void>(),
                self.c as *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                self.m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()?;
        Ok(())
    }
}

/// The cuBLAS type of a product's operands.
fn data_type(dtype: DType) -> Result<sys::cudaDataType_t> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        other => bail!("gradient product: products of {other:?} are not supported"),
    })
}
