//! CUDA launches for the Adam updates (`kernels/adam.cu`).
//!
//! [`pass`] runs one of the three per-tensor kernels as a grid-stride elementwise launch.
//! [`multi`] is the one-launch update: a device table of `(θ, m, v, g, n, first block)`
//! segments, one per tensor, and a grid of blocks of `PER_BLOCK` elements over all of them.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Storage, Tensor};

use super::Pass;
use crate::ops::cuda;
use crate::ops::host_optim::AdamConsts;

/// The kernels' `AdamK` struct: nine f32s passed by value, in the order of
/// [`AdamConsts::packed`].
///
/// Twin of `struct AdamK` in `src/ops/kernels/adam.cu`: the asserts below and the
/// `static_assert`s there check the same layout; change both together.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs([f32; 9]);

const _: () = assert!(std::mem::size_of::<AdamArgs>() == 36);
const _: () = assert!(std::mem::offset_of!(AdamArgs, 0) == 0);

// SAFETY: `AdamArgs` is a plain `repr(C)` array of f32, as the kernel's struct of nine floats
// (layout asserted on both sides).
unsafe impl DeviceRepr for AdamArgs {}

/// The kernel's `AdamSegment`: one tensor's device addresses, its length and the number of its
/// first block.
///
/// Twin of `struct AdamSegment` in `src/ops/kernels/adam.cu`: the asserts below and the
/// `static_assert`s there check the same layout; change both together.
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

const _: () = assert!(std::mem::size_of::<Segment>() == 48);
const _: () = assert!(std::mem::offset_of!(Segment, theta) == 0);
const _: () = assert!(std::mem::offset_of!(Segment, m) == 8);
const _: () = assert!(std::mem::offset_of!(Segment, v) == 16);
const _: () = assert!(std::mem::offset_of!(Segment, g) == 24);
const _: () = assert!(std::mem::offset_of!(Segment, n) == 32);
const _: () = assert!(std::mem::offset_of!(Segment, first_block) == 40);

// SAFETY: plain `repr(C)` integers, laid out as the kernel's struct of four pointers and two
// long longs (layout asserted on both sides).
unsafe impl DeviceRepr for Segment {}

/// Elements per block of the one-launch update: 256 threads, eight elements each.
const PER_BLOCK: i64 = 2048;
const THREADS: u32 = 256;

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// One pass of [`super::adam_update`] in place: `out` is `m`, `v` or `θ`, and `a`, `b` are
/// `(g, θ)`, `(g, θ)` or `(m, v)`.
pub(super) fn pass(
    pass: Pass,
    consts: &AdamConsts,
    (s1, l1): (&mut CudaStorage, &Layout),
    (s2, l2): Input,
    (s3, l3): Input,
) -> Result<()> {
    let dev = s1.device.clone();
    let n = l1.shape().elem_count();
    let name = match pass {
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
    let k = AdamArgs(consts.packed());
    let cfg = cuda::elementwise_config(n);
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&mut out).arg(&a).arg(&b).arg(&k).arg(&n);
    // SAFETY: the arguments match `adam_<pass>(float*, const float*, const float*, AdamK,
    // size_t)`; all three buffers hold n floats and `AdamArgs` has AdamK's layout.
    unsafe { args.launch(cfg) }.w()?;
    Ok(())
}

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

/// [`super::adam_update_all`] on CUDA: every tensor in one launch.
pub(super) fn multi(
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
    let cfg = LaunchConfig {
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
