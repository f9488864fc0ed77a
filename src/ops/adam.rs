//! Adam / AdamW updates in place: three kernels per parameter tensor (first moment, second
//! moment, weight) instead of a dozen tensor ops that each allocate a result. On an H200 the
//! composite update cost ~13 launches per parameter, 1,000 per step for the 29M-parameter seed,
//! most of them too small to hide the launch overhead.

#![allow(unsafe_code)]

use candle_core::{bail, CpuStorage, DType, InplaceOp3, Layout, Result, Tensor};

use super::contiguous;
use crate::train::host_math::AdamConsts;

/// Which pass of the update.
#[derive(Debug, Clone, Copy)]
enum Pass {
    First,
    Second,
    Apply,
}

struct AdamPass {
    pass: Pass,
    consts: AdamConsts,
}

/// One Adam step in place: `m` and `v` (the moments) and then `theta` (the weights) are
/// overwritten. All four tensors are f32 with one shape; `g` is the unscaled gradient.
pub fn adam_update(
    theta: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    consts: &AdamConsts,
) -> Result<()> {
    for (name, t) in [("weight", theta), ("m", m), ("v", v), ("gradient", g)] {
        if t.dtype() != DType::F32 || t.dims() != theta.dims() || !t.is_contiguous() {
            bail!(
                "adam: {name} must be a contiguous f32 tensor of shape {:?}, got {:?} {:?}",
                theta.shape(),
                t.dtype(),
                t.shape()
            );
        }
    }
    let c = *consts;
    m.inplace_op3(
        g,
        theta,
        &AdamPass {
            pass: Pass::First,
            consts: c,
        },
    )?;
    v.inplace_op3(
        g,
        theta,
        &AdamPass {
            pass: Pass::Second,
            consts: c,
        },
    )?;
    theta.inplace_op3(
        m,
        v,
        &AdamPass {
            pass: Pass::Apply,
            consts: c,
        },
    )
}

impl InplaceOp3 for AdamPass {
    fn name(&self) -> &'static str {
        "adam"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let (CpuStorage::F32(out), CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2, s3) else {
            bail!("adam: expected f32 storages");
        };
        let (a, b) = (contiguous(a, l2, "adam")?, contiguous(b, l3, "adam")?);
        let Some((start, end)) = l1.contiguous_offsets() else {
            bail!("adam: the updated tensor must be contiguous");
        };
        let c = &self.consts;
        for (j, x) in out[start..end].iter_mut().enumerate() {
            *x = match self.pass {
                // (x, a, b) = (m, g, θ), (v, g, θ), (θ, m, v)
                Pass::First => c.first_moment(b[j], *x, a[j]),
                Pass::Second => c.second_moment(b[j], *x, a[j]),
                Pass::Apply => c.apply(*x, a[j], b[j]),
            };
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};

        use super::cuda;

        let dev = s1.device.clone();
        let n = l1.shape().elem_count();
        let name = match self.pass {
            Pass::First => "adam_first",
            Pass::Second => "adam_second",
            Pass::Apply => "adam_apply",
        };
        let func = cuda::kernel_untyped(&dev, &cuda::ADAM, name)?;
        let a = cuda::view::<f32>(s2, l2, "adam")?;
        let b = cuda::view::<f32>(s3, l3, "adam")?;
        let CudaStorageSlice::F32(out) = &mut s1.slice else {
            bail!("adam: expected an f32 storage");
        };
        let Some((start, end)) = l1.contiguous_offsets() else {
            bail!("adam: the updated tensor must be contiguous");
        };
        let mut out = out.slice_mut(start..end);
        let k = AdamArgs(self.consts.packed());
        let cfg = cuda::elementwise_config(n);
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(&func);
        args.arg(&mut out).arg(&a).arg(&b).arg(&k).arg(&n);
        // SAFETY: the arguments match `adam_<pass>(float*, const float*, const float*, AdamK,
        // size_t)`; all three buffers hold n floats and `AdamArgs` has AdamK's layout.
        unsafe { args.launch(cfg) }.w()?;
        Ok(())
    }
}

/// The kernels' `AdamK` struct: nine f32s passed by value.
#[cfg(feature = "cuda")]
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs([f32; 9]);

// SAFETY: `AdamArgs` is a plain `repr(C)` array of f32, as the kernel's struct of nine floats.
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for AdamArgs {}
