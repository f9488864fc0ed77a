//! CUDA launch for the rotary embedding (`kernels/llama.cu`): one thread per rotated pair.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

use super::{Rotary, NAME};
use crate::ops::cuda::{self, Elem};

pub(super) fn rotate(
    x: &mut CudaStorage,
    l1: &Layout,
    (freqs, l2): (&CudaStorage, &Layout),
    positions: Option<(&CudaStorage, &Layout)>,
    op: &Rotary,
) -> Result<()> {
    let dev = x.device.clone();
    let positions = match positions {
        Some((p, l)) => Some(cuda::view::<u32>(p, l, NAME)?),
        None => None,
    };
    let with = ((freqs, l2), positions.as_ref());
    match &mut x.slice {
        CudaStorageSlice::F32(v) => launch(v, l1, with, op, &dev),
        CudaStorageSlice::BF16(v) => launch(v, l1, with, op, &dev),
        CudaStorageSlice::F16(v) => launch(v, l1, with, op, &dev),
        _ => bail!("{NAME}: expected f32, bf16 or f16 rows"),
    }
}

fn launch<T: Elem>(
    x: &mut CudaSlice<T>,
    l1: &Layout,
    ((freqs, l2), positions): ((&CudaStorage, &Layout), Option<&CudaView<u32>>),
    op: &Rotary,
    dev: &CudaDevice,
) -> Result<()> {
    let Some((start, end)) = l1.contiguous_offsets() else {
        bail!("{NAME}: the q/k/v rows must be contiguous");
    };
    let width = l1.dims().last().copied().unwrap_or(1);
    let rows = (end - start) / width.max(1);
    let freqs = cuda::view::<f32>(freqs, l2, NAME)?;
    let mut rows_view = x.slice_mut(start..end);
    let func = cuda::kernel(dev, &cuda::LLAMA, "rotary", T::DTYPE)?;
    let (n_width, heads, hd, seq) = (
        cuda::dim(width, "q/k/v width")?,
        cuda::dim(op.heads, "heads")?,
        cuda::dim(op.hd, "head width")?,
        cuda::dim(op.seq, "sequence length")?,
    );
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    // A null `const uint32_t*` turns each row by its index in its sequence.
    let null = 0u64;
    args.arg(&mut rows_view).arg(&freqs);
    match positions {
        Some(p) => args.arg(p),
        None => args.arg(&null),
    };
    args.arg(&rows)
        .arg(&n_width)
        .arg(&heads)
        .arg(&hd)
        .arg(&seq)
        .arg(&op.sign);
    // SAFETY: the arguments match `rotary_<T>(T*, const float*, const uint32_t*, size_t, int,
    // int, int, int, float)`; the view holds rows·width elements, `freqs` hd/2 floats, the
    // positions (or null) one u32 per row, and each thread reads and writes its own pair of
    // one row.
    unsafe { args.launch(cuda::elementwise_config(rows * op.heads * op.hd / 2)) }.w()?;
    Ok(())
}
