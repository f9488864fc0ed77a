//! Casts between the f32 master weights and the half precision their products run in:
//! [`to_f32`] widens a half-precision gradient, [`accumulate_into`] adds one to an f32 sum in
//! place, and [`to_half`] narrows a master to bf16 or f16 for its product.
//!
//! Every weight of a mixed-precision step is narrowed once and its gradient widened once; on
//! the GPU candle's cast moved one element per thread and ran at a quarter of the memory
//! bandwidth, 11% of a llama-3.2-1b step one way and 8% of a gpt-1.3b step the other. These
//! kernels move eight elements per thread, and the in-place sum saves the vocabulary head's
//! chunks a cast and a copy each. Widening is exact and narrowing rounds to nearest even, as
//! the cast does, so the values are the cast's.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Result, Shape, Tensor};

use super::input_f32;

const NAME: &str = "widen";

/// `x` as f32: itself when it is f32, else widened (exactly).
pub fn to_f32(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 => Ok(x.clone()),
        DType::BF16 | DType::F16 if x.device().is_cuda() => {
            x.contiguous()?.apply_op1_no_bwd(&Widen)
        }
        _ => x.to_dtype(DType::F32),
    }
}

/// `x` (f32) as `dtype` (bf16 or f16, rounded to nearest even), or cast as candle casts where
/// it is another pair of dtypes. Records no gradient: for detached masters only.
pub fn to_half(x: &Tensor, dtype: DType) -> Result<Tensor> {
    match (x.dtype(), dtype) {
        (DType::F32, DType::BF16 | DType::F16) if x.device().is_cuda() => {
            x.contiguous()?.apply_op1_no_bwd(&Narrow(dtype))
        }
        _ => x.to_dtype(dtype),
    }
}

/// `acc += x` in place, elementwise: `acc` an f32 tensor no other tensor shares (it is written
/// through), `x` of `acc`'s shape in any float dtype.
pub fn accumulate_into(acc: &Tensor, x: &Tensor) -> Result<()> {
    if acc.dtype() != DType::F32 || !acc.is_contiguous() {
        bail!("{NAME}: the sum must be a contiguous f32 tensor");
    }
    if acc.dims() != x.dims() {
        bail!("{NAME}: cannot add {:?} into {:?}", x.shape(), acc.shape());
    }
    acc.inplace_op2(&x.contiguous()?, &Accumulate)
}

struct Widen;

/// f32 into the half-precision dtype it holds.
struct Narrow(DType);

struct Accumulate;

impl CustomOp1 for Narrow {
    fn name(&self) -> &'static str {
        "narrow"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = input_f32(s, l, NAME)?;
        let out = match self.0 {
            DType::BF16 => {
                CpuStorage::BF16(values.iter().map(|&v| half::bf16::from_f32(v)).collect())
            }
            DType::F16 => CpuStorage::F16(values.iter().map(|&v| half::f16::from_f32(v)).collect()),
            other => bail!("{NAME}: cannot narrow f32 to {other:?}"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let candle_core::cuda_backend::CudaStorageSlice::F32(x) = &s.slice else {
            bail!("{NAME}: narrowing needs an f32 input");
        };
        let out = match self.0 {
            DType::BF16 => gpu::narrow::<half::bf16>(x, l, &s.device)?,
            DType::F16 => gpu::narrow::<half::f16>(x, l, &s.device)?,
            other => bail!("{NAME}: cannot narrow f32 to {other:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

impl CustomOp1 for Widen {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = input_f32(s, l, NAME)?.into_owned();
        Ok((CpuStorage::F32(values), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s, v => gpu::widen(v, l, &s.device)?);
        Ok((out, l.shape().clone()))
    }
}

impl InplaceOp2 for Accumulate {
    fn name(&self) -> &'static str {
        "accumulate"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let x = input_f32(s2, l2, NAME)?;
        let Some((start, end)) = l1.contiguous_offsets() else {
            bail!("{NAME}: the sum must be contiguous");
        };
        match s1 {
            CpuStorage::F32(acc) => {
                for (a, v) in acc[start..end].iter_mut().zip(x.iter()) {
                    *a += v;
                }
                Ok(())
            }
            other => bail!("{NAME}: the sum must be f32, got {:?}", other.dtype()),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        gpu::accumulate(s1, l1, (s2, l2))
    }
}

#[cfg(feature = "cuda")]
mod gpu;
