//! CUDA launches for the epilogue and embedding ops (`kernels/epilogue.cu`): grid-stride
//! elementwise launches (`cuda::elementwise_config`).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result};

use super::{cols_of, Embed, EpilogueOps, NAME};
use crate::ops::cuda::{self, Elem};

pub(super) fn epilogue<T: Elem>(
    y: &CudaSlice<T>,
    l1: &Layout,
    (bias, l2): (&CudaStorage, &Layout),
    (residual, l3): (&CudaStorage, &Layout),
    p: &EpilogueOps,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let n = l1.shape().elem_count();
    let y = cuda::slice_view(y, l1, NAME)?;
    let bias = cuda::view::<f32>(bias, l2, NAME)?;
    let residual = cuda::view::<T>(residual, l3, NAME)?;
    let func = cuda::kernel(dev, &cuda::EPILOGUE, "epilogue_fwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut out = unsafe { cuda::output::<T>(dev, n) }?;
    let cols = cuda::dim(cols_of(l1), "columns")?;
    let (has_bias, has_residual) = (i32::from(p.has_bias), i32::from(p.has_residual));
    let vec = cuda::eight_wide(
        &[n, cols_of(l1)],
        &[cuda::byte_offset::<T>(l1), cuda::byte_offset::<T>(l3)],
    );
    let threads = if vec == 1 { n / 8 } else { n };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&y)
        .arg(&bias)
        .arg(&residual)
        .arg(&mut out)
        .arg(&n)
        .arg(&cols)
        .arg(&has_bias)
        .arg(&has_residual)
        .arg(&p.act)
        .arg(&p.dropout.threshold)
        .arg(&p.dropout.scale)
        .arg(&p.dropout.key)
        .arg(&vec);
    // SAFETY: the arguments match `epilogue_fwd_<T>`; `y`, `residual` (when read) and `out`
    // hold n elements, `bias` (when read) `cols` floats.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

pub(super) fn epilogue_grad<T: Elem>(
    dout: &CudaSlice<T>,
    l1: &Layout,
    (y, l2): (&CudaStorage, &Layout),
    (bias, l3): (&CudaStorage, &Layout),
    p: &EpilogueOps,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let n = l1.shape().elem_count();
    let dout = cuda::slice_view(dout, l1, NAME)?;
    let y = cuda::view::<T>(y, l2, NAME)?;
    let bias = cuda::view::<f32>(bias, l3, NAME)?;
    let func = cuda::kernel(dev, &cuda::EPILOGUE, "epilogue_bwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut dy = unsafe { cuda::output::<T>(dev, n) }?;
    let cols = cuda::dim(cols_of(l1), "columns")?;
    let has_bias = i32::from(p.has_bias);
    let vec = cuda::eight_wide(
        &[n, cols_of(l1)],
        &[cuda::byte_offset::<T>(l1), cuda::byte_offset::<T>(l2)],
    );
    let threads = if vec == 1 { n / 8 } else { n };
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&dout)
        .arg(&y)
        .arg(&bias)
        .arg(&mut dy)
        .arg(&n)
        .arg(&cols)
        .arg(&has_bias)
        .arg(&p.act)
        .arg(&p.dropout.threshold)
        .arg(&p.dropout.scale)
        .arg(&p.dropout.key)
        .arg(&vec);
    // SAFETY: the arguments match `epilogue_bwd_<T>`; `dout`, `y` and `dy` hold n elements,
    // `bias` (when read) `cols` floats.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dy, dev.clone()))
}

/// An embedding table's row count as the kernels take it.
fn vocab_rows(rows: usize) -> Result<u32> {
    u32::try_from(rows).map_err(|_| {
        candle_core::Error::Msg(format!(
            "embed: a table of {rows} rows is over the kernels' u32 ids"
        ))
    })
}

pub(super) fn embed<T: Elem>(
    table: &CudaSlice<T>,
    l2: &Layout,
    (ids, l1): (&CudaStorage, &Layout),
    (positions, l3): (&CudaStorage, &Layout),
    op: &Embed,
    dev: &CudaDevice,
) -> Result<CudaStorage> {
    let (p, seq) = (&op.ops, op.seq);
    let rows = l1.shape().elem_count();
    let d = cols_of(l2);
    let n = rows * d;
    let table = cuda::slice_view(table, l2, "embed")?;
    let ids = cuda::view::<u32>(ids, l1, "embed")?;
    let positions = cuda::view::<T>(positions, l3, "embed")?;
    let func = cuda::kernel(dev, &cuda::EPILOGUE, "embed_fwd", T::DTYPE)?;
    // SAFETY: the kernel launched below writes every element.
    let mut out = unsafe { cuda::output::<T>(dev, n) }?;
    let (d32, seq32) = (cuda::dim(d, "width")?, cuda::dim(seq.max(1), "sequence")?);
    let vocab = vocab_rows(l2.shape().elem_count() / d.max(1))?;
    let has_positions = i32::from(op.has_positions);
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&ids)
        .arg(&table)
        .arg(&positions)
        .arg(&mut out)
        .arg(&n)
        .arg(&d32)
        .arg(&vocab)
        .arg(&seq32)
        .arg(&has_positions)
        .arg(&p.dropout.threshold)
        .arg(&p.dropout.scale)
        .arg(&p.dropout.key);
    // SAFETY: the arguments match `embed_fwd_<T>`; `ids` holds rows entries, the kernel reads
    // the table only for those below its `vocab` rows, and `out` holds rows·d elements.
    unsafe { args.launch(cuda::elementwise_config(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

pub(super) fn embed_grad<T: Elem>(
    d_out: &CudaSlice<T>,
    l3: &Layout,
    (ids, l2): (&CudaStorage, &Layout),
    (table, l1): (&mut CudaStorage, &Layout),
    first: u32,
    dev: &CudaDevice,
) -> Result<()> {
    let d = cols_of(l3);
    let n = l3.shape().elem_count();
    let d_out = cuda::slice_view(d_out, l3, "embed")?;
    let ids = cuda::view::<u32>(ids, l2, "embed")?;
    let Some((start, end)) = l1.contiguous_offsets() else {
        candle_core::bail!("embed: the gradient table must be contiguous");
    };
    let CudaStorageSlice::F32(table) = &mut table.slice else {
        candle_core::bail!("embed: the gradient table must be f32");
    };
    let mut table = table.slice_mut(start..end);
    let vocab = (end - start) / d.max(1);
    let func = cuda::kernel(dev, &cuda::EPILOGUE, "embed_grad", T::DTYPE)?;
    let d32 = cuda::dim(d, "width")?;
    let vocab32 = vocab_rows(vocab)?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&ids)
        .arg(&d_out)
        .arg(&mut table)
        .arg(&n)
        .arg(&d32)
        .arg(&vocab32)
        .arg(&first);
    // SAFETY: the arguments match `embed_grad_<T>`; `d_out` holds n = rows·d elements and
    // `table` vocab·d floats, which the kernel indexes only by `id − first` below vocab.
    unsafe { args.launch(cuda::elementwise_config(n)) }.w()?;
    Ok(())
}
