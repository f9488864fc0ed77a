//! The CUDA launch of the compact update (`kernels/compact_adam.cu`).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::BLOCK;
use crate::knobs::{MasterFormat, MomentFormat, StateLayout};
use crate::ops::cuda;
use crate::ops::host_optim::AdamConsts;

/// The kernel's `AdamK` (nine f32s, [`AdamConsts::packed`]'s order).
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs([f32; 9]);

// SAFETY: a plain `repr(C)` array of f32, as the kernel's struct of nine floats.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for AdamArgs {}

/// One tensor's state on the device, in its format: `m`, `v` (f32, bf16 or u8 codes),
/// per-block scales with 8-bit codes, and the Kahan compensation with Kahan masters.
pub struct DeviceState<'a> {
    /// First moment.
    pub m: &'a Tensor,
    /// Second moment.
    pub v: &'a Tensor,
    /// First- and second-moment block scales (f32), with 8-bit codes.
    pub scales: Option<(&'a Tensor, &'a Tensor)>,
    /// bf16 compensation, with Kahan masters.
    pub comp: Option<&'a Tensor>,
}

/// The device address of a contiguous tensor's first element.
fn address(t: &Tensor) -> Result<u64> {
    cuda::address(t, "compact adam")
}

/// One update of `w` with gradient `g` (the weights' dtype, or f32) over `state`,
/// with `maps` the signed and unsigned quantile maps (f32, 256 each, on the device).
pub fn update_cuda(
    w: &Tensor,
    g: &Tensor,
    state: DeviceState<'_>,
    maps: (&Tensor, &Tensor),
    layout: StateLayout,
    consts: &AdamConsts,
    seed: u64,
) -> Result<()> {
    let candle_core::Device::Cuda(dev) = w.device() else {
        bail!("compact adam: the weights are not on a GPU");
    };
    let n = w.elem_count();
    if n == 0 {
        return Ok(());
    }
    let (wn, master) = weight_variant(w, g, layout.masters)?;
    let mn = moment_variant(&state, layout.moments, n)?;
    let (sm, sv, comp) = optional_addresses(&state, layout, n)?;
    let func = cuda::kernel_untyped(
        dev,
        &cuda::COMPACT_ADAM,
        &format!("compact_adam_{wn}_{mn}_{master}"),
    )?;
    let blocks = n.div_ceil(BLOCK);
    let args_k = AdamArgs(consts.packed());
    let (wp, gp, mp, vp) = (
        address(w)?,
        address(g)?,
        address(state.m)?,
        address(state.v)?,
    );
    let (q1, q2) = (address(maps.0)?, address(maps.1)?);
    let n_ll = n as i64;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(blocks)
                .map_err(|_| candle_core::Error::Msg(format!("compact adam: {blocks} blocks")))?,
            1,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&wp)
        .arg(&gp)
        .arg(&mp)
        .arg(&vp)
        .arg(&sm)
        .arg(&sv)
        .arg(&comp)
        .arg(&q1)
        .arg(&q2)
        .arg(&args_k)
        .arg(&n_ll)
        .arg(&seed);
    // SAFETY: the arguments match `compact_adam_<w>_<m>_<master>(W*, const G*, void*, void*,
    // float*, float*, bf16*, const float*, const float*, AdamK, long long, unsigned long long)`:
    // every address is a live, contiguous device buffer of the checked dtype and length (the
    // null ones are unused by the variant launched). The tensors outlive the launch on
    // candle's one stream, which orders it after the gradient's producers and before later
    // readers; nothing else writes the weights or the state while the optimizer steps.
    unsafe { args.launch(cfg) }.w()?;
    Ok(())
}

/// The kernel's weight and master parts of its name for weights `w`, gradient `g` (checked to
/// be the weights' dtype or f32, and as long) and `masters`.
fn weight_variant(
    w: &Tensor,
    g: &Tensor,
    masters: MasterFormat,
) -> Result<(&'static str, &'static str)> {
    let same = g.dtype() == w.dtype();
    if !(same || g.dtype() == DType::F32) || g.elem_count() != w.elem_count() {
        bail!(
            "compact adam: a {:?} gradient of {} elements for {:?} weights of {}",
            g.dtype(),
            g.elem_count(),
            w.dtype(),
            w.elem_count()
        );
    }
    Ok(match (w.dtype(), masters, same) {
        (DType::F32, MasterFormat::F32, _) => ("f32", "f32"),
        (DType::BF16, MasterFormat::Bf16Kahan, true) => ("bf16", "kahan"),
        (DType::BF16, MasterFormat::Bf16Stochastic, true) => ("bf16", "sr"),
        (DType::BF16, MasterFormat::Bf16Kahan, false) => ("bf16_g32", "kahan"),
        (DType::BF16, MasterFormat::Bf16Stochastic, false) => ("bf16_g32", "sr"),
        (dtype, masters, _) => bail!("compact adam: {dtype:?} weights with {masters:?} masters"),
    })
}

/// The kernel's moment part of its name for `moments`, with `state`'s m and v checked to be
/// `n` elements of their dtype.
fn moment_variant(
    state: &DeviceState<'_>,
    moments: MomentFormat,
    n: usize,
) -> Result<&'static str> {
    let (mn, moment_dtype) = match moments {
        MomentFormat::F32 => ("mf32", DType::F32),
        MomentFormat::Bf16 => ("mbf16", DType::BF16),
        MomentFormat::Int8Blockwise => ("mi8", DType::U8),
    };
    for (name, t) in [("m", state.m), ("v", state.v)] {
        if t.dtype() != moment_dtype || t.elem_count() != n {
            bail!(
                "compact adam: {name} is {:?} of {}, expected {moment_dtype:?} of {n}",
                t.dtype(),
                t.elem_count()
            );
        }
    }
    Ok(mn)
}

/// The addresses of `state`'s block scales and compensation, checked against `layout` for
/// `n` elements; null where the layout has none.
fn optional_addresses(
    state: &DeviceState<'_>,
    layout: StateLayout,
    n: usize,
) -> Result<(u64, u64, u64)> {
    let null = 0u64;
    let blocks = n.div_ceil(BLOCK);
    let (sm, sv) = match (layout.moments, state.scales) {
        (MomentFormat::Int8Blockwise, Some((a, b))) => {
            for t in [a, b] {
                if t.dtype() != DType::F32 || t.elem_count() != blocks {
                    bail!("compact adam: block scales must be f32 of {blocks}");
                }
            }
            (address(a)?, address(b)?)
        }
        (MomentFormat::Int8Blockwise, None) => bail!("compact adam: 8-bit moments need scales"),
        _ => (null, null),
    };
    let comp = match (layout.masters, state.comp) {
        (MasterFormat::Bf16Kahan, Some(c)) if c.dtype() == DType::BF16 && c.elem_count() == n => {
            address(c)?
        }
        (MasterFormat::Bf16Kahan, _) => {
            bail!("compact adam: Kahan masters need a bf16 compensation")
        }
        _ => null,
    };
    Ok((sm, sv, comp))
}

/// A copy stream beside candle's, for moments that live in host memory: their uploads and
/// downloads run while the device computes, ordered against it by events only where a copy
/// and a kernel touch the same memory.
pub struct Stager {
    compute: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    copies: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
}

/// A point on one of the [`Stager`]'s streams that the other can wait for.
pub struct Mark(candle_core::cuda_backend::cudarc::driver::CudaEvent);

impl Stager {
    /// A copy stream for `device`'s compute stream.
    pub fn new(device: &candle_core::Device) -> Result<Self> {
        let candle_core::Device::Cuda(dev) = device else {
            bail!("a copy stream needs a CUDA device");
        };
        let compute = dev.cuda_stream();
        let copies = compute.fork().w()?;
        Ok(Self { compute, copies })
    }

    /// Work queued on the compute stream so far.
    pub fn compute_mark(&self) -> Result<Mark> {
        Ok(Mark(self.compute.record_event(None).w()?))
    }

    /// Work queued on the copy stream so far.
    pub fn copies_mark(&self) -> Result<Mark> {
        Ok(Mark(self.copies.record_event(None).w()?))
    }

    /// Later copies wait for `mark` (of the compute stream).
    pub fn copies_wait(&self, mark: &Mark) -> Result<()> {
        self.copies.wait(&mark.0).w()
    }

    /// Later kernels wait for `mark` (of the copy stream).
    pub fn compute_wait(&self, mark: &Mark) -> Result<()> {
        self.compute.wait(&mark.0).w()
    }

    /// Blocks the host until every queued copy has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.copies.synchronize().w()
    }

    /// Queues a copy of `src` into the contiguous device tensor `dst` (as many bytes) on the
    /// copy stream.
    ///
    /// # Safety
    ///
    /// `src` must be page-locked memory that nobody writes until the copy has finished (see
    /// [`Self::synchronize`]), and `dst` must stay allocated, unread and unwritten by the
    /// compute stream until then (make it wait for a mark after the copy).
    pub unsafe fn upload(&self, dst: &Tensor, src: &[u8]) -> Result<()> {
        let n = dst.elem_count() * dst.dtype().size_in_bytes();
        if n != src.len() {
            bail!("upload: {} bytes for a {n}-byte tensor", src.len());
        }
        let to = address(dst)?;
        // SAFETY: `to` addresses `n` bytes of a live contiguous device tensor; the caller
        // keeps both sides untouched until the copy is done.
        unsafe {
            candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(
                to,
                src,
                self.copies.cu_stream(),
            )
        }
        .w()
    }

    /// Queues a copy of the contiguous device tensor `src` into `dst` on the copy stream.
    ///
    /// # Safety
    ///
    /// `dst` must be page-locked memory that nobody reads or writes until the copy has
    /// finished, and `src` must stay allocated and unwritten until then; the copy stream must
    /// already wait for the kernels that write `src`.
    pub unsafe fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let n = src.elem_count() * src.dtype().size_in_bytes();
        if n != dst.len() {
            bail!("download: a {n}-byte tensor into {} bytes", dst.len());
        }
        let from = address(src)?;
        // SAFETY: `from` addresses `n` bytes of a live contiguous device tensor; the caller
        // keeps both sides untouched until the copy is done.
        unsafe {
            candle_core::cuda_backend::cudarc::driver::result::memcpy_dtoh_async(
                dst,
                from,
                self.copies.cu_stream(),
            )
        }
        .w()
    }
}
