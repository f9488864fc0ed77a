//! CUDA launches for flash attention (`kernels/attention.cu`).
//!
//! Every kernel runs 128 threads (four warps of 16 rows) per block on a
//! `(batch·heads, ceil(seq / 64))` grid (the dk/dv kernel: `batch·kv_heads`, each block summing
//! the query heads of its group), for every head width (the kernels of wide heads stream
//! narrower tiles, but still take 64 rows per block), with static shared memory only. The
//! backward pass launches the dq kernel first: it also writes `D = rowsum(dO ⊙ O)`, which the
//! dk/dv kernel reads.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Storage};

use super::{Args, NAME};
use crate::ops::cuda::{self, Elem};

/// The kernels' `flash::Dims`, passed by value.
///
/// Twin of `struct flash::Dims` in `src/ops/kernels/attention.cu`: the asserts below and the
/// `static_assert`s there check the same layout; change both together.
#[repr(C)]
#[derive(Clone, Copy)]
struct Dims {
    batch: i32,
    heads: i32,
    seq: i32,
    scale: f32,
    causal: i32,
    kv_heads: i32,
    key: u64,
    threshold: u32,
    keep_scale: f32,
}

const _: () = assert!(std::mem::size_of::<Dims>() == 40);
const _: () = assert!(std::mem::offset_of!(Dims, batch) == 0);
const _: () = assert!(std::mem::offset_of!(Dims, heads) == 4);
const _: () = assert!(std::mem::offset_of!(Dims, seq) == 8);
const _: () = assert!(std::mem::offset_of!(Dims, scale) == 12);
const _: () = assert!(std::mem::offset_of!(Dims, causal) == 16);
const _: () = assert!(std::mem::offset_of!(Dims, kv_heads) == 20);
const _: () = assert!(std::mem::offset_of!(Dims, key) == 24);
const _: () = assert!(std::mem::offset_of!(Dims, threshold) == 32);
const _: () = assert!(std::mem::offset_of!(Dims, keep_scale) == 36);

// SAFETY: a plain `repr(C)` struct with the field order, types and therefore padding of the
// kernels' `struct Dims { int, int, int; float; int, int; uint64_t; uint32_t; float; }`
// (layout asserted on both sides).
unsafe impl DeviceRepr for Dims {}

const THREADS: u32 = 128;
const TILE: usize = 64;

impl Dims {
    fn new(a: &Args) -> Result<Self> {
        let (key, threshold, keep_scale) = match a.dropout {
            Some(m) => (m.key, m.threshold(), m.scale()),
            None => (0, 0, 1.0),
        };
        Ok(Self {
            batch: cuda::dim(a.batch, "batch")?,
            heads: cuda::dim(a.heads, "heads")?,
            seq: cuda::dim(a.seq, "sequence length")?,
            scale: a.scale,
            causal: i32::from(a.causal),
            kv_heads: cuda::dim(a.kv_heads, "key/value heads")?,
            key,
            threshold,
            keep_scale,
        })
    }
}

/// One block per 64 rows of each (sequence, head) of `heads` heads.
fn config(a: &Args, heads: usize) -> Result<LaunchConfig> {
    let tiles = a.seq.div_ceil(TILE);
    if tiles > 65_535 {
        bail!("{NAME}: sequence length {} exceeds the grid", a.seq);
    }
    Ok(LaunchConfig {
        grid_dim: (
            cuda::dim(a.batch * heads, "batch × heads")? as u32,
            tiles as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A call's key mask as the kernels read it: a key-padding mask's lengths (one per sequence)
/// and packed sequences' position ids (one per token), each a device pointer or null.
#[derive(Clone, Copy)]
pub(super) struct Masks<'a> {
    pub lengths: Option<(&'a Storage, &'a Layout)>,
    pub positions: Option<(&'a Storage, &'a Layout)>,
}

enum PointerArg<'a> {
    View(CudaView<'a, u32>),
    Null(u64),
}

impl<'a> PointerArg<'a> {
    fn new(values: Option<(&'a Storage, &'a Layout)>) -> Result<Self> {
        match values {
            None => Ok(Self::Null(0)),
            Some((Storage::Cuda(s), l)) => Ok(Self::View(cuda::view::<u32>(s, l, NAME)?)),
            Some(_) => bail!("{NAME}: key masks must be on the GPU with q/k/v"),
        }
    }

    fn push<'b>(&'b self, args: &mut LaunchArgs<'b>) {
        match self {
            Self::View(v) => args.arg(v),
            // A null `const uint32_t*`: the kernels then apply no such mask.
            Self::Null(zero) => args.arg(zero),
        };
    }
}

/// Both pointers of a [`Masks`], pushed in the kernels' order: lengths, then positions.
struct MaskArgs<'a>(PointerArg<'a>, PointerArg<'a>);

impl<'a> MaskArgs<'a> {
    fn new(masks: Masks<'a>) -> Result<Self> {
        Ok(Self(
            PointerArg::new(masks.lengths)?,
            PointerArg::new(masks.positions)?,
        ))
    }

    fn push<'b>(&'b self, args: &mut LaunchArgs<'b>) {
        self.0.push(args);
        self.1.push(args);
    }
}

/// The kernel's name without its dtype suffix, e.g. `flash_fwd_h64`.
fn name(base: &str, a: &Args, dtype: candle_core::DType) -> Result<String> {
    if !matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16) {
        bail!("{NAME}: the CUDA kernels take bf16 or f16, not {dtype:?}");
    }
    if !super::FLASH_HEAD_DIMS.contains(&a.head_dim) {
        bail!(
            "{NAME}: no CUDA kernel for head width {} (built for {:?})",
            a.head_dim,
            super::FLASH_HEAD_DIMS
        );
    }
    Ok(format!("{base}_h{}", a.head_dim))
}

pub(super) fn forward(
    qkv: &CudaStorage,
    l: &Layout,
    lens: Masks,
    a: &Args,
) -> Result<(CudaStorage, CudaStorage)> {
    let out = cuda::float_slice!(NAME, qkv, v => forward_typed(v, l, lens, a, &qkv.device)?);
    Ok(out)
}

fn forward_typed<T: Elem>(
    qkv: &candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    l: &Layout,
    lens: Masks,
    a: &Args,
    dev: &CudaDevice,
) -> Result<(CudaStorage, CudaStorage)> {
    let qkv = cuda::slice_view(qkv, l, NAME)?;
    let lens = MaskArgs::new(lens)?;
    let func = cuda::kernel(
        dev,
        &cuda::ATTENTION,
        &name("flash_fwd", a, T::DTYPE)?,
        T::DTYPE,
    )?;
    let rows = a.batch * a.seq;
    // SAFETY: the kernel writes every output row and every log-sum-exp (one per row and head).
    let mut out = unsafe { cuda::output::<T>(dev, rows * a.width()) }?;
    // SAFETY: as above.
    let mut lse = unsafe { cuda::output::<f32>(dev, a.batch * a.heads * a.seq) }?;
    let dims = Dims::new(a)?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&qkv);
    lens.push(&mut args);
    args.arg(&mut out).arg(&mut lse).arg(&dims);
    // SAFETY: the arguments match `flash_fwd_h<hd>_<T>(const T*, const uint32_t*, const
    // uint32_t*, T*, float*, Dims)`; `qkv` holds rows·(heads + 2·kv_heads)·hd elements starting
    // 16-byte aligned (`super::aligned`), the lengths (or null) batch u32, the positions (or
    // null) rows u32, `out` rows·d and `lse` batch·heads·seq.
    unsafe { args.launch(config(a, a.heads)?) }.w()?;
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev.clone()),
    ))
}

type Input<'a> = (&'a CudaStorage, &'a Layout);

pub(super) fn backward(
    qkv: Input,
    out: Input,
    lse: Input,
    dout: Input,
    lens: Masks,
    a: &Args,
) -> Result<CudaStorage> {
    let dqkv = cuda::float_slice!(NAME, qkv.0, v => backward_typed(v, qkv.1, out, lse, dout, lens, a, &qkv.0.device)?);
    Ok(dqkv)
}

#[allow(clippy::too_many_arguments)]
fn backward_typed<T: Elem>(
    qkv: &candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    lq: &Layout,
    (out, lo): Input,
    (lse, ll): Input,
    (dout, ld): Input,
    lens: Masks,
    a: &Args,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let qkv = cuda::slice_view(qkv, lq, NAME)?;
    let lens = MaskArgs::new(lens)?;
    let out = cuda::view::<T>(out, lo, NAME)?;
    let dout = cuda::view::<T>(dout, ld, NAME)?;
    let lse = cuda::view::<f32>(lse, ll, NAME)?;
    let rows = a.batch * a.seq;
    // SAFETY: the dq kernel writes every row's q columns and every D, the dk/dv kernel every
    // row's k and v columns.
    let mut dqkv = unsafe { cuda::output::<T>(dev, rows * a.qkv_width()) }?;
    // SAFETY: as above.
    let mut dsum = unsafe { cuda::output::<f32>(dev, a.batch * a.heads * a.seq) }?;
    let dims = Dims::new(a)?;
    let stream = dev.cuda_stream();

    let dq = cuda::kernel(
        dev,
        &cuda::ATTENTION,
        &name("flash_bwd_dq", a, T::DTYPE)?,
        T::DTYPE,
    )?;
    let mut args = stream.launch_builder(&dq);
    args.arg(&qkv);
    lens.push(&mut args);
    args.arg(&out)
        .arg(&dout)
        .arg(&lse)
        .arg(&mut dsum)
        .arg(&mut dqkv)
        .arg(&dims);
    // SAFETY: the arguments match `flash_bwd_dq_h<hd>_<T>(const T* qkv, const uint32_t* lens,
    // const uint32_t* pos, const T* out, const T* dout, const float* lse, float* dsum, T* dqkv,
    // Dims)` with the sizes above.
    unsafe { args.launch(config(a, a.heads)?) }.w()?;

    let dkdv = cuda::kernel(
        dev,
        &cuda::ATTENTION,
        &name("flash_bwd_dkdv", a, T::DTYPE)?,
        T::DTYPE,
    )?;
    let mut args = stream.launch_builder(&dkdv);
    args.arg(&qkv);
    lens.push(&mut args);
    args.arg(&dout)
        .arg(&lse)
        .arg(&dsum)
        .arg(&mut dqkv)
        .arg(&dims);
    // SAFETY: the arguments match `flash_bwd_dkdv_h<hd>_<T>(const T* qkv, const uint32_t* lens,
    // const uint32_t* pos, const T* dout, const float* lse, const float* dsum, T* dqkv, Dims)`;
    // it runs after the dq kernel on the same stream, so `dsum` is complete; one block per 64
    // keys of each key/value head, which sums its group's query heads.
    unsafe { args.launch(config(a, a.kv_heads)?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dqkv, dev.clone()))
}
