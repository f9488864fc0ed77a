//! CUDA launches for widening, narrowing and in-place sums (`kernels/widen.cu`): grid-stride,
//! eight elements per thread where the buffers allow.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

use super::NAME;
use crate::ops::cuda::{self, Elem};

/// `x` (`T`) widened to f32, exactly.
pub(super) fn widen<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    convert::<T, f32>(x, l, dev, "widen", T::DTYPE)
}

/// `x` (f32) as `T` (bf16 or f16), rounded to nearest even.
pub(super) fn narrow<T: Elem>(
    x: &CudaSlice<f32>,
    l: &Layout,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    convert::<f32, T>(x, l, dev, "narrow", T::DTYPE)
}

/// `x` converted by kernel `<base>_<dtype>(const In*, Out*, size_t n, int vec)`, which writes
/// every element of its output.
fn convert<In: Elem, Out: Elem>(
    x: &CudaSlice<In>,
    l: &Layout,
    dev: &CudaDevice,
    base: &str,
    dtype: DType,
) -> Result<CudaStorage> {
    let n = l.shape().elem_count();
    let x = cuda::slice_view(x, l, NAME)?;
    let func = cuda::kernel(dev, &cuda::WIDEN, base, dtype)?;
    // SAFETY: the kernel launched below writes every element.
    let mut y = unsafe { cuda::output::<Out>(dev, n) }?;
    let vec = cuda::eight_wide(&[n], &[cuda::byte_offset::<In>(l)]);
    let threads = if vec == 1 { n / 8 } else { n };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&x).arg(&mut y).arg(&n).arg(&vec);
    // SAFETY: the arguments match `widen_<T>(const T*, float*, size_t, int)` and
    // `narrow_<T>(const float*, T*, size_t, int)`, the only kernels passed here; `x` and `y`
    // hold n elements of the types those kernels take.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

pub(super) fn accumulate(
    acc: &mut CudaStorage,
    l1: &Layout,
    (x, l2): (&CudaStorage, &Layout),
) -> Result<()> {
    let dev = acc.device.clone();
    let Some((start, end)) = l1.contiguous_offsets() else {
        bail!("{NAME}: the sum must be contiguous");
    };
    let n = end - start;
    let CudaStorageSlice::F32(acc) = &mut acc.slice else {
        bail!("{NAME}: the sum must be f32");
    };
    let mut sum = acc.slice_mut(start..end);
    cuda::float_slice!(NAME, x, v => {
        let xv = cuda::slice_view(v, l2, NAME)?;
        let vec = cuda::eight_wide(&[n], &[start * 4, l2.start_offset() * x.dtype().size_in_bytes()]);
        let threads = if vec == 1 { n / 8 } else { n };
        let func = cuda::kernel(&dev, &cuda::WIDEN, "accumulate", x.dtype())?;
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(&func);
        args.arg(&mut sum).arg(&xv).arg(&n).arg(&vec);
        // SAFETY: the arguments match `accumulate_<T>(float*, const T*, size_t, int)`; the sum
        // and `x` hold n elements, and each thread reads and writes its own.
        unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    });
    Ok(())
}
