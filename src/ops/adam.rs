//! Adam / AdamW updates in place. [`adam_update`] runs three kernels per parameter tensor (first
//! moment, second moment, weight) instead of a dozen tensor ops that each allocate a result: on
//! an H200 the composite update cost ~13 launches per parameter, 1,000 per step for the
//! 29M-parameter seed, most of them too small to hide the launch overhead. [`adam_update_all`]
//! updates every tensor of a model in one CUDA launch, reading and writing each element once
//! (28 bytes per parameter instead of the three passes' 48).

#![allow(unsafe_code)]

use candle_core::{bail, CpuStorage, DType, InplaceOp3, Layout, Result, Tensor};

use super::contiguous;
use crate::ops::host_optim::AdamConsts;

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
    check(theta, m, v, g)?;
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

/// [`adam_update`] for every `(theta[i], m[i], v[i], g[i])` at once, with the same arithmetic:
/// on CUDA one launch for all tensors, elsewhere one update per tensor.
pub fn adam_update_all(
    theta: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    g: &[Tensor],
    consts: &AdamConsts,
) -> Result<()> {
    if m.len() != theta.len() || v.len() != theta.len() || g.len() != theta.len() {
        bail!(
            "adam: {} weights, {} first moments, {} second moments and {} gradients",
            theta.len(),
            m.len(),
            v.len(),
            g.len()
        );
    }
    #[cfg(feature = "cuda")]
    if let Some(candle_core::Device::Cuda(dev)) = theta.first().map(|t| t.device().clone()) {
        for (i, t) in theta.iter().enumerate() {
            check(t, &m[i], &v[i], &g[i])?;
        }
        return multi::launch(&dev, theta, m, v, g, consts);
    }
    for (i, t) in theta.iter().enumerate() {
        adam_update(t, &m[i], &v[i], &g[i], consts)?;
    }
    Ok(())
}

/// All four tensors contiguous f32 of the weight's shape.
fn check(theta: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor) -> Result<()> {
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
    Ok(())
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

#[cfg(feature = "cuda")]
mod multi {
    //! The one-launch update: a device table of `(θ, m, v, g, n, first block)` segments, one
    //! per tensor, and a grid of blocks of `PER_BLOCK` elements over all of them.

    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{bail, CudaDevice, Result, Storage, Tensor};

    use super::AdamArgs;
    use crate::ops::cuda;
    use crate::ops::host_optim::AdamConsts;

    /// Elements per block: 256 threads, eight elements each.
    const PER_BLOCK: i64 = 2048;
    const THREADS: u32 = 256;

    /// The kernel's `AdamSegment`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Segment {
        theta: u64,
        m: u64,
        v: u64,
        g: u64,
        n: i64,
        first_block: i64,
    }

    // SAFETY: plain `repr(C)` integers, laid out as the kernel's struct of four pointers and
    // two long longs.
    unsafe impl DeviceRepr for Segment {}

    /// The device address of a contiguous f32 CUDA tensor's first element.
    fn address(t: &Tensor, dev: &CudaDevice) -> Result<u64> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!("adam: every tensor must be on the GPU");
        };
        let slice = s.as_cuda_slice::<f32>()?;
        let stream = dev.cuda_stream();
        let (ptr, _sync) = slice.device_ptr(&stream);
        Ok(ptr + (layout.start_offset() * std::mem::size_of::<f32>()) as u64)
    }

    pub(super) fn launch(
        dev: &CudaDevice,
        theta: &[Tensor],
        m: &[Tensor],
        v: &[Tensor],
        g: &[Tensor],
        consts: &AdamConsts,
    ) -> Result<()> {
        let mut segments = Vec::with_capacity(theta.len());
        let mut blocks = 0i64;
        for (i, t) in theta.iter().enumerate() {
            let n = t.elem_count() as i64;
            if n == 0 {
                continue;
            }
            segments.push(Segment {
                theta: address(t, dev)?,
                m: address(&m[i], dev)?,
                v: address(&v[i], dev)?,
                g: address(&g[i], dev)?,
                n,
                first_block: blocks,
            });
            blocks += (n + PER_BLOCK - 1) / PER_BLOCK;
        }
        if segments.is_empty() {
            return Ok(());
        }
        let stream = dev.cuda_stream();
        let table = stream.clone_htod(&segments).w()?;
        let func = cuda::kernel_untyped(dev, &cuda::ADAM, "adam_multi")?;
        let n_segs = cuda::dim(segments.len(), "parameter tensors")?;
        let k = AdamArgs(consts.packed());
        let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
            grid_dim: (
                u32::try_from(blocks).map_err(|_| {
                    candle_core::Error::Msg(format!("adam: {blocks} blocks exceed the grid"))
                })?,
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = stream.launch_builder(&func);
        args.arg(&table).arg(&n_segs).arg(&k).arg(&PER_BLOCK);
        // SAFETY: the arguments match `adam_multi(const AdamSegment*, int, AdamK, long long)`.
        // Every segment addresses four live, contiguous f32 buffers of `n` elements (checked by
        // the caller; the tensors outlive the launch on candle's one stream, which orders it
        // after the gradients' producers and before any later reader). The kernel writes θ, m
        // and v in place, as `adam_update`'s in-place ops do; nothing else touches them while
        // the optimizer steps.
        unsafe { args.launch(cfg) }.w()?;
        Ok(())
    }
}
