//! The f32-accumulating product on cuBLAS, on candle's stream and handle.

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
    let candle_core::Device::Cuda(dev) = acc.device() else {
        bail!("weight gradient: the sum is not on a GPU");
    };
    let (out, inputs) = acc.dims2()?;
    let rows = dy.dim(0)?;
    if rows == 0 || out == 0 || inputs == 0 {
        return Ok(());
    }
    let data_type = data_type(dy.dtype())?;
    let (m, n, k) = (
        int(inputs, "width")?,
        int(out, "outputs")?,
        int(rows, "rows")?,
    );
    let address = |t: &Tensor| cuda::address(t, "weight gradient");
    let (a, b, c) = (address(x)?, address(dy)?, address(acc)?);
    let (alpha, beta) = (1f32, 1f32);
    let blas = dev.cublas_handle();
    // SAFETY: the handle runs on candle's stream, which orders this product after the kernels
    // that wrote `x`, `dy` and `acc`. The addresses hold contiguous matrices of the checked
    // shapes: `x` rows·in and `dy` rows·out elements of `data_type`, `acc` out·in f32; the
    // leading dimensions are their row lengths.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_T,
            m,
            n,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            a as *const c_void,
            data_type,
            m,
            b as *const c_void,
            data_type,
            n,
            (&beta as *const f32).cast::<c_void>(),
            c as *mut c_void,
            sys::cudaDataType_t::CUDA_R_32F,
            m,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .w()?;
    Ok(())
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
    let candle_core::Device::Cuda(dev) = acc.device() else {
        bail!("input gradient: the sum is not on a GPU");
    };
    let (rows, inputs) = acc.dims2()?;
    let (k, cols) = (w.dim(0)?, dy.dim(1)?);
    if rows == 0 || inputs == 0 || k == 0 {
        return Ok(());
    }
    let data_type = data_type(dy.dtype())?;
    let (m, n, kk, ld_dy) = (
        int(inputs, "width")?,
        int(rows, "rows")?,
        int(k, "weight rows")?,
        int(cols, "columns")?,
    );
    let address = |t: &Tensor| cuda::address(t, "input gradient");
    let offset = (first * dy.dtype().size_in_bytes()) as u64;
    let (a, b, c) = (address(w)?, address(dy)? + offset, address(acc)?);
    let (alpha, beta) = (1f32, 1f32);
    let blas = dev.cublas_handle();
    // SAFETY: the handle runs on candle's stream, which orders this product after the kernels
    // that wrote `w`, `dy` and `acc`. `w` holds k·in elements of `data_type`, `acc` rows·in
    // f32, and `dy` rows·cols elements of which the product reads columns first..first + k of
    // every row (checked: first + k ≤ cols), with the row length as leading dimension.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_N,
            m,
            n,
            kk,
            (&alpha as *const f32).cast::<c_void>(),
            a as *const c_void,
            data_type,
            m,
            b as *const c_void,
            data_type,
            ld_dy,
            (&beta as *const f32).cast::<c_void>(),
            c as *mut c_void,
            sys::cudaDataType_t::CUDA_R_32F,
            m,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .w()?;
    Ok(())
}
