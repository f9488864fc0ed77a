//! Adam / AdamW updates in place. [`adam_update`] runs three kernels per parameter tensor (first
//! moment, second moment, weight) instead of a dozen tensor ops that each allocate a result: on
//! an H200 the composite update cost ~13 launches per parameter, 1,000 per step for the
//! 29M-parameter seed, most of them too small to hide the launch overhead. [`adam_update_all`]
//! updates every tensor of a model in one CUDA launch, reading and writing each element once
//! (28 bytes per parameter instead of the three passes' 48).

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
    if let Some(device) = theta.first().map(|t| t.device().clone()) {
        if let candle_core::Device::Cuda(dev) = &device {
            for (i, t) in theta.iter().enumerate() {
                check(t, &m[i], &v[i], &g[i])?;
                on_device(&device, i, [t, &m[i], &v[i], &g[i]])?;
            }
            return gpu::multi(dev, theta, m, v, g, consts);
        }
    }
    for (i, t) in theta.iter().enumerate() {
        adam_update(t, &m[i], &v[i], &g[i], consts)?;
    }
    Ok(())
}

/// The four tensors of parameter `index` on `device`: the one launch takes raw addresses, and
/// an address on another GPU would be read and written as if it were on this one.
#[cfg(feature = "cuda")]
fn on_device(device: &candle_core::Device, index: usize, tensors: [&Tensor; 4]) -> Result<()> {
    for (name, t) in ["weight", "m", "v", "gradient"].into_iter().zip(tensors) {
        if !t.device().same_device(device) {
            bail!(
                "adam: the {name} of parameter {index} is on {:?}, not on the first weight's {:?}; every tensor of one update must be on one device",
                t.device().location(),
                device.location()
            );
        }
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
        gpu::pass(self.pass, &self.consts, (s1, l1), (s2, l2), (s3, l3))
    }
}

#[cfg(feature = "cuda")]
mod gpu;
