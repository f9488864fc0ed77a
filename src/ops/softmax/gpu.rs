//! CUDA launches for the softmax ops (`kernels/softmax.cu`).
//!
//! Launch configs: one block per row, `row_config` threads (64..=1024, ~4 columns each).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::NAME;
use crate::ops::cuda::{self, Elem};
use crate::ops::rows_cols;

/// Rows up to this long run one warp per row (attention scores: seq ≤ 1024); longer rows
/// one block per row.
const WARP_COLS: usize = 1024;

/// Eight warps (rows) per block.
fn warp_config(rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (cuda::dim(rows.div_ceil(8), "rows")? as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn fwd<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    scale: f32,
    causal_seq: usize,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l);
    let x = cuda::slice_view(x, l, NAME)?;
    // SAFETY: the kernel launched below writes every element.
    let mut y = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let (n_rows, n_cols) = (cuda::dim(rows, "rows")?, cuda::dim(cols, "columns")?);
    let causal = cuda::dim(causal_seq, "causal sequence")?;
    let stream = dev.cuda_stream();
    if cols <= WARP_COLS {
        let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_fwd_warp", T::DTYPE)?;
        let mut args = stream.launch_builder(&func);
        args.arg(&x)
            .arg(&mut y)
            .arg(&n_rows)
            .arg(&n_cols)
            .arg(&scale)
            .arg(&causal);
        // SAFETY: the arguments match `softmax_fwd_warp_<T>(const T*, T*, int, int, float,
        // int)`; one warp per row, rows past the end return at once.
        unsafe { args.launch(warp_config(rows)?) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()));
    }
    let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_fwd", T::DTYPE)?;
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&mut y)
        .arg(&n_cols)
        .arg(&scale)
        .arg(&causal);
    // SAFETY: the arguments match `softmax_fwd_<T>(const T*, T*, int, float, int)`; `x` and `y` hold
    // rows·cols elements and the grid has one block per row.
    unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

pub(super) fn bwd<T: Elem>(
    y: &CudaSlice<T>,
    l1: &Layout,
    dy: &CudaStorage,
    l2: &Layout,
    scale: f32,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l1);
    let y = cuda::slice_view(y, l1, NAME)?;
    let dy = cuda::view::<T>(dy, l2, NAME)?;
    // SAFETY: the kernel launched below writes every element.
    let mut dx = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let (n_rows, n_cols) = (cuda::dim(rows, "rows")?, cuda::dim(cols, "columns")?);
    let stream = dev.cuda_stream();
    if cols <= WARP_COLS {
        let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_bwd_warp", T::DTYPE)?;
        let mut args = stream.launch_builder(&func);
        args.arg(&y)
            .arg(&dy)
            .arg(&mut dx)
            .arg(&n_rows)
            .arg(&n_cols)
            .arg(&scale);
        // SAFETY: the arguments match `softmax_bwd_warp_<T>(const T*, const T*, T*, int,
        // int, float)`; one warp per row, rows past the end return at once.
        unsafe { args.launch(warp_config(rows)?) }.w()?;
        return Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()));
    }
    let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_bwd", T::DTYPE)?;
    let mut args = stream.launch_builder(&func);
    args.arg(&y).arg(&dy).arg(&mut dx).arg(&n_cols).arg(&scale);
    // SAFETY: the arguments match `softmax_bwd_<T>(const T*, const T*, T*, int, float)`; all three
    // buffers hold rows·cols elements and the grid has one block per row.
    unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}
