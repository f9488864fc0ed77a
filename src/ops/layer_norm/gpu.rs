//! CUDA launches for the layer-norm and RMS-norm ops (`rms` selects the latter).
//!
//! Launch configs: forward, `dx` and the statistics kernel run one warp per row, eight rows a
//! block, where every row has a multiple of 8 values on 16-byte boundaries and at most
//! [`WARP_MAX_COLS`] ([`launch`]); else one block per row with `row_config` threads
//! (64..=1024, ~4 columns each). The parameter gradients use 32 × 8 thread
//! blocks on a `(ceil(d / 32), chunks)` grid, each block summing one 32-column tile over one
//! chunk of rows, then one thread per column sums the chunks in order.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::NAME;
use crate::ops::cuda::{self, Elem};
use crate::ops::rows_cols;

/// Rows per chunk of the parameter-gradient reduction: at least 64 (so each of a block's 8 row
/// threads sums ≥ 8 rows) and at most 512 chunks (bounding the partial-sum buffer at
/// 2·512·d floats). It depends only on the shape, which keeps results reproducible.
fn rows_per_chunk(rows: usize) -> usize {
    rows.div_ceil(512).max(64)
}

/// Rows a block of the one-warp-per-row kernels takes: eight warps.
const WARP_ROWS_PER_BLOCK: usize = 8;

/// The widest row a warp takes; wider rows keep a block each.
const WARP_MAX_COLS: usize = 8192;

/// The row kernels' `warp` flag and launch shape for `rows` rows of `cols` values whose buffers
/// start `byte_offsets` into their allocations (outputs are fresh, at 0).
fn launch(rows: usize, cols: usize, byte_offsets: &[usize]) -> Result<(i32, LaunchConfig)> {
    if cols <= WARP_MAX_COLS && cuda::eight_wide(&[cols], byte_offsets) == 1 {
        let blocks = cuda::dim(rows.div_ceil(WARP_ROWS_PER_BLOCK), "blocks")? as u32;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: ((32 * WARP_ROWS_PER_BLOCK) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        return Ok((1, config));
    }
    Ok((0, cuda::row_config(rows, cols)?))
}

pub(super) fn fwd<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    (gamma, lg): (&CudaStorage, &Layout),
    (beta, lb): (&CudaStorage, &Layout),
    eps: f64,
    rms: bool,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l);
    let x = cuda::slice_view(x, l, NAME)?;
    let gamma = cuda::view::<f32>(gamma, lg, NAME)?;
    let beta = cuda::view::<f32>(beta, lb, NAME)?;
    let func = cuda::kernel(dev, &cuda::LAYER_NORM, "ln_fwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut y = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let mut offsets = vec![cuda::byte_offset::<T>(l), cuda::byte_offset::<f32>(lg)];
    if !rms {
        offsets.push(cuda::byte_offset::<f32>(lb));
    }
    let (warp, config) = launch(rows, cols, &offsets)?;
    let (n_rows, n_cols) = (cuda::dim(rows, "rows")?, cuda::dim(cols, "columns")?);
    let (eps, rms) = (eps as f32, i32::from(rms));
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&gamma)
        .arg(&beta)
        .arg(&mut y)
        .arg(&n_rows)
        .arg(&n_cols)
        .arg(&eps)
        .arg(&rms)
        .arg(&warp);
    // SAFETY: the arguments match `ln_fwd_<T>(const T*, const float*, const float*, T*, int,
    // int, float, int, int)`; `x`/`y` hold rows·cols elements, `gamma`/`beta` cols; a block or
    // a warp per row as `launch` set `warp`, on the alignment it checked.
    unsafe { args.launch(config) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// `dx`, plus `plus` (of `x`'s dtype and shape) where given.
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd_input<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    (dy, ldy): (&CudaStorage, &Layout),
    (gamma, lg): (&CudaStorage, &Layout),
    plus: Option<(&CudaStorage, &Layout)>,
    eps: f64,
    rms: bool,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l);
    let x = cuda::slice_view(x, l, NAME)?;
    let dy = cuda::view::<T>(dy, ldy, NAME)?;
    let gamma = cuda::view::<f32>(gamma, lg, NAME)?;
    let plus_view = match plus {
        Some((p, lp)) => Some((cuda::view::<T>(p, lp, NAME)?, cuda::byte_offset::<T>(lp))),
        None => None,
    };
    let func = cuda::kernel(dev, &cuda::LAYER_NORM, "ln_bwd_input", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut dx = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let mut offsets = vec![
        cuda::byte_offset::<T>(l),
        cuda::byte_offset::<T>(ldy),
        cuda::byte_offset::<f32>(lg),
    ];
    offsets.extend(plus_view.as_ref().map(|(_, offset)| *offset));
    let (warp, config) = launch(rows, cols, &offsets)?;
    let (n_rows, n_cols) = (cuda::dim(rows, "rows")?, cuda::dim(cols, "columns")?);
    let (eps, rms) = (eps as f32, i32::from(rms));
    // A null pointer tells the kernel there is nothing to add.
    let no_plus = 0u64;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&x).arg(&dy).arg(&gamma);
    match &plus_view {
        Some((view, _)) => args.arg(view),
        None => args.arg(&no_plus),
    };
    args.arg(&mut dx)
        .arg(&n_rows)
        .arg(&n_cols)
        .arg(&eps)
        .arg(&rms)
        .arg(&warp);
    // SAFETY: the arguments match `ln_bwd_input_<T>(const T*, const T*, const float*, const T*,
    // T*, int, int, float, int, int)`; `x`/`dy`/`dx` and a given `plus` hold rows·cols
    // elements, `gamma` cols; a block or a warp per row as `launch` set `warp`, on the
    // alignment it checked.
    unsafe { args.launch(config) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// `[dgamma; dbeta]` (2·cols f32) in three launches: row statistics, per-chunk column
/// partial sums, fixed-order sum over chunks. The temporaries (8 bytes per row plus the
/// partials) are freed on return.
pub(super) fn bwd_params<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    (dy, ldy): (&CudaStorage, &Layout),
    eps: f64,
    rms: bool,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l);
    let x = cuda::slice_view(x, l, NAME)?;
    let dy = cuda::view::<T>(dy, ldy, NAME)?;
    let (n_rows, n_cols, eps, rms) = (
        cuda::dim(rows, "rows")?,
        cuda::dim(cols, "columns")?,
        eps as f32,
        i32::from(rms),
    );
    let stream = dev.cuda_stream();

    // SAFETY: the kernel launched below writes every element.
    let mut stats = unsafe { cuda::output::<f32>(dev, 2 * rows) }?;
    let func = cuda::kernel(dev, &cuda::LAYER_NORM, "ln_stats", T::DTYPE)?;
    let (warp, config) = launch(rows, cols, &[cuda::byte_offset::<T>(l)])?;
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&mut stats)
        .arg(&n_rows)
        .arg(&n_cols)
        .arg(&eps)
        .arg(&rms)
        .arg(&warp);
    // SAFETY: the arguments match `ln_stats_<T>(const T*, float*, int, int, float, int, int)`;
    // `x` holds rows·cols elements, `stats` 2·rows; a block or a warp per row (as `launch` set
    // `warp`) writes its two entries.
    unsafe { args.launch(config) }.w()?;

    let per_chunk = rows_per_chunk(rows);
    let chunks = rows.div_ceil(per_chunk);
    // SAFETY: the kernel launched below writes every element.
    let mut partial = unsafe { cuda::output::<f32>(dev, 2 * chunks * cols) }?;
    let func = cuda::kernel(dev, &cuda::LAYER_NORM, "ln_params_partial", T::DTYPE)?;
    let n_per_chunk = cuda::dim(per_chunk, "rows per chunk")?;
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&dy)
        .arg(&stats)
        .arg(&mut partial)
        .arg(&n_rows)
        .arg(&n_cols)
        .arg(&n_per_chunk);
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `ln_params_partial_<T>(const T*, const T*, const float*,
    // float*, int, int, int)`; the grid covers every (32-column tile, chunk) pair and each
    // in-range column of each chunk writes its two entries of `partial` (2·chunks·cols).
    unsafe { args.launch(cfg) }.w()?;

    // SAFETY: the kernel launched below writes every element.
    let mut out = unsafe { cuda::output::<f32>(dev, 2 * cols) }?;
    let func = cuda::kernel_untyped(dev, &cuda::LAYER_NORM, "ln_params_final")?;
    let n_chunks = cuda::dim(chunks, "chunks")?;
    let mut args = stream.launch_builder(&func);
    args.arg(&partial).arg(&mut out).arg(&n_chunks).arg(&n_cols);
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `ln_params_final(const float*, float*, int, int)`; one thread
    // per column (out-of-range threads return) writes `out[col]` and `out[cols + col]`.
    unsafe { args.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
