//! Softmax over the last dimension as one differentiable op.
//!
//! Memory: backward needs only the output `y` (`dx = y ⊙ (dy − Σ dy ⊙ y)`), which the next op
//! (dropout, the value matmul) keeps anyway; candle's graph also keeps the input alive as the
//! op's argument. The composite reference additionally keeps `x − max` and `exp(x − max)`, two
//! more full-size tensors per attention layer.

#![allow(unsafe_code)]

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

use super::{check_input, contiguous, float_storage, from_f32, rows_cols, to_f32};

const NAME: &str = "fused-softmax";

/// Softmax of `x` (any shape, f32/bf16/f16, any layout) over its last dimension, in `x`'s
/// dtype, computed in f32. Rows that are entirely −∞ give NaN, as the composite does.
///
/// Memory saved for backward: the output (and the input, which candle's graph holds as the
/// op's argument).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_input(x, NAME)?;
    x.contiguous()?.apply_op1(Softmax)
}

/// Forward: `x → y`.
struct Softmax;

/// Backward: `(y, dy) → dx`.
struct SoftmaxGrad;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l);
        let out = float_storage!(NAME, s, v => fwd_cpu(contiguous(v, l, NAME)?, cols));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s, v => gpu::fwd(v, l, &s.device)?);
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.to_dtype(y.dtype())?.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(&dy, &SoftmaxGrad)?))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let out = float_storage!(NAME, s1, v => {
            let dy = contiguous(WithDType::cpu_storage_as_slice(s2)?, l2, NAME)?;
            bwd_cpu(contiguous(v, l1, NAME)?, dy, cols)
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s1, v => gpu::bwd(v, l1, s2, l2, &s1.device)?);
        Ok((out, l1.shape().clone()))
    }
}

fn fwd_cpu<T: WithDType>(x: &[T], cols: usize) -> CpuStorage {
    let mut out = Vec::with_capacity(x.len());
    let mut exps = vec![0f32; cols];
    for row in x.chunks_exact(cols) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(to_f32(v)));
        let mut sum = 0f64;
        for (e, &v) in exps.iter_mut().zip(row) {
            *e = (to_f32(v) - max).exp();
            sum += f64::from(*e);
        }
        let inv = 1.0 / sum as f32;
        out.extend(exps.iter().map(|&e| from_f32::<T>(e * inv)));
    }
    T::to_cpu_storage_owned(out)
}

fn bwd_cpu<T: WithDType>(y: &[T], dy: &[T], cols: usize) -> CpuStorage {
    let mut out = Vec::with_capacity(y.len());
    for (yr, dyr) in y.chunks_exact(cols).zip(dy.chunks_exact(cols)) {
        let dot = yr
            .iter()
            .zip(dyr)
            .map(|(&a, &b)| f64::from(to_f32(a) * to_f32(b)))
            .sum::<f64>() as f32;
        out.extend(
            yr.iter()
                .zip(dyr)
                .map(|(&a, &b)| from_f32::<T>(to_f32(a) * (to_f32(b) - dot))),
        );
    }
    T::to_cpu_storage_owned(out)
}

#[cfg(feature = "cuda")]
mod gpu {
    //! Launch configs: one block per row, `row_config` threads (64..=1024, ~4 columns each).

    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaDevice, CudaStorage, Layout, Result};

    use super::NAME;
    use crate::ops::cuda::{self, Elem};
    use crate::ops::rows_cols;

    pub(super) fn fwd<T: Elem>(
        x: &CudaSlice<T>,
        l: &Layout,
        dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        let (rows, cols) = rows_cols(l);
        let x = cuda::slice_view(x, l, NAME)?;
        let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_fwd", T::DTYPE)?;
        let mut y = cuda::output::<T>(dev, rows * cols)?;
        let n_cols = cuda::dim(cols, "columns")?;
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(&func);
        args.arg(&x).arg(&mut y).arg(&n_cols);
        // SAFETY: the arguments match `softmax_fwd_<T>(const T*, T*, int)`; `x` and `y` hold
        // rows·cols elements and the grid has one block per row.
        unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }

    pub(super) fn bwd<T: Elem>(
        y: &CudaSlice<T>,
        l1: &Layout,
        dy: &CudaStorage,
        l2: &Layout,
        dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        let (rows, cols) = rows_cols(l1);
        let y = cuda::slice_view(y, l1, NAME)?;
        let dy = cuda::view::<T>(dy, l2, NAME)?;
        let func = cuda::kernel(dev, &cuda::SOFTMAX, "softmax_bwd", T::DTYPE)?;
        let mut dx = cuda::output::<T>(dev, rows * cols)?;
        let n_cols = cuda::dim(cols, "columns")?;
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(&func);
        args.arg(&y).arg(&dy).arg(&mut dx).arg(&n_cols);
        // SAFETY: the arguments match `softmax_bwd_<T>(const T*, const T*, T*, int)`; all three
        // buffers hold rows·cols elements and the grid has one block per row.
        unsafe { args.launch(cuda::row_config(rows, cols)?) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
    }
}
