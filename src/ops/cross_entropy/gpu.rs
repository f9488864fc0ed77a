//! CUDA launches for the cross-entropy ops (`kernels/cross_entropy.cu`).
//!
//! Launch configs: one block per row, `row_config` threads (64..=1024, ~4 classes each).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::{Lse, NAME};
use crate::ops::cuda::{self, Elem};
use crate::ops::rows_cols;

pub(super) fn fwd<T: Elem>(
    logits: &CudaSlice<T>,
    l1: &Layout,
    targets: &CudaStorage,
    l2: &Layout,
    classes: usize,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l1);
    let x = cuda::slice_view(logits, l1, NAME)?;
    let t = cuda::view::<u32>(targets, l2, NAME)?;
    let func = cuda::kernel(dev, &cuda::CROSS_ENTROPY, "ce_fwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut loss = unsafe { cuda::output::<f32>(dev, rows) }?;
    let (n_classes, n_cols) = (cuda::dim(classes, "classes")?, cuda::dim(cols, "columns")?);
    let vec = cuda::eight_wide(&[cols], &[cuda::byte_offset::<T>(l1)]);
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&t)
        .arg(&mut loss)
        .arg(&n_classes)
        .arg(&n_cols)
        .arg(&vec);
    // SAFETY: the arguments match `ce_fwd_<T>(const T*, const uint32_t*, float*, int, int,
    // int)`; `x` holds rows·cols elements, `t` and `loss` rows, and the grid has one block per
    // row; `vec` only where every row starts on a 16-byte boundary.
    unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(loss, dev.clone()))
}

/// The backward over the logits' columns (`first..`, from [`Lse`]), with each row's
/// log-sum-exp rebuilt from its loss or given (`ce_bwd`).
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd<T: Elem>(
    logits: &CudaSlice<T>,
    l1: &Layout,
    targets: &CudaStorage,
    l2: &Layout,
    loss_grad: &CudaStorage,
    l3: &Layout,
    classes: usize,
    lse: Lse,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l1);
    let x = cuda::slice_view(logits, l1, NAME)?;
    let t = cuda::view::<u32>(targets, l2, NAME)?;
    let lg = cuda::view::<f32>(loss_grad, l3, NAME)?;
    let func = cuda::kernel(dev, &cuda::CROSS_ENTROPY, "ce_bwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut dx = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let (n_rows, n_first, n_classes, n_cols) = (
        cuda::dim(rows, "rows")?,
        cuda::dim(lse.first(), "first column")?,
        cuda::dim(classes, "classes")?,
        cuda::dim(cols, "columns")?,
    );
    let given = i32::from(matches!(lse, Lse::Given { .. }));
    // `dx` is a fresh allocation: only the logits' offset can break the alignment.
    let vec = cuda::eight_wide(&[cols], &[cuda::byte_offset::<T>(l1)]);
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&x)
        .arg(&t)
        .arg(&lg)
        .arg(&mut dx)
        .arg(&n_rows)
        .arg(&n_first)
        .arg(&n_classes)
        .arg(&n_cols)
        .arg(&given)
        .arg(&vec);
    // SAFETY: the arguments match `ce_bwd_<T>(const T*, const uint32_t*, const float*, T*,
    // int, int, int, int, int, int)`; `lg` holds 2·rows floats, `x` and `dx` rows·cols
    // elements; `vec` only where every row of both starts on a 16-byte boundary.
    unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}
