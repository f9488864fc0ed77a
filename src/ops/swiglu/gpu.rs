//! CUDA launches for SwiGLU (`kernels/llama.cu`): grid-stride over the output's elements.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::{SwigluOps, NAME};
use crate::ops::cuda::{self, Elem};
use crate::ops::rows_cols;

pub(super) fn forward<T: Elem>(
    h: &CudaSlice<T>,
    l1: &Layout,
    (bias, l2): (&CudaStorage, &Layout),
    p: &SwigluOps,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l1);
    let f = cols / 2;
    let n = rows * f;
    let h = cuda::slice_view(h, l1, NAME)?;
    let bias = cuda::view::<f32>(bias, l2, NAME)?;
    let func = cuda::kernel(dev, &cuda::LLAMA, "swiglu_fwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut out = unsafe { cuda::output::<T>(dev, n) }?;
    let width = cuda::dim(f, "feed-forward width")?;
    let has_bias = i32::from(p.has_bias);
    let vec = cuda::eight_wide(&[f], &[cuda::byte_offset::<T>(l1)]);
    let threads = if vec == 1 { n / 8 } else { n };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&h)
        .arg(&bias)
        .arg(&mut out)
        .arg(&n)
        .arg(&width)
        .arg(&has_bias)
        .arg(&p.dropout.threshold)
        .arg(&p.dropout.scale)
        .arg(&p.dropout.key)
        .arg(&vec);
    // SAFETY: the arguments match `swiglu_fwd_<T>(const T*, const float*, T*, size_t, int, int,
    // uint32_t, float, uint64_t, int)`; `h` holds rows·2f elements, `out` rows·f, `bias` (when
    // read) 2f floats.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

pub(super) fn backward<T: Elem>(
    dout: &CudaSlice<T>,
    l1: &Layout,
    (h, l2): (&CudaStorage, &Layout),
    (bias, l3): (&CudaStorage, &Layout),
    p: &SwigluOps,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l2);
    let f = cols / 2;
    let n = rows * f;
    let dout = cuda::slice_view(dout, l1, NAME)?;
    let h = cuda::view::<T>(h, l2, NAME)?;
    let bias = cuda::view::<f32>(bias, l3, NAME)?;
    let func = cuda::kernel(dev, &cuda::LLAMA, "swiglu_bwd", T::DTYPE)?;
    // SAFETY: each of the n threads' elements writes its gate and its up column: all rows·2f.
    let mut dh = unsafe { cuda::output::<T>(dev, rows * cols) }?;
    let width = cuda::dim(f, "feed-forward width")?;
    let has_bias = i32::from(p.has_bias);
    let vec = cuda::eight_wide(
        &[f],
        &[cuda::byte_offset::<T>(l1), cuda::byte_offset::<T>(l2)],
    );
    let threads = if vec == 1 { n / 8 } else { n };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&dout)
        .arg(&h)
        .arg(&bias)
        .arg(&mut dh)
        .arg(&n)
        .arg(&width)
        .arg(&has_bias)
        .arg(&p.dropout.threshold)
        .arg(&p.dropout.scale)
        .arg(&p.dropout.key)
        .arg(&vec);
    // SAFETY: the arguments match `swiglu_bwd_<T>(const T*, const T*, const float*, T*, size_t,
    // int, int, uint32_t, float, uint64_t, int)`; `dout` holds rows·f elements, `h` and `dh`
    // rows·2f.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dh, dev.clone()))
}
