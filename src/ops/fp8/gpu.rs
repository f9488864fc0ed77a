//! The fp8 conversion kernels (`kernels/fp8.cu`) and cuBLASLt's fp8 matrix product, on
//! candle's stream.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::cublaslt::sys;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::operand::{EncodeTarget, Fp8Operand, OperandLayout};
use super::Fp8Format;
use crate::ops::cublaslt::{self, Operand, Product, Queued};
use crate::ops::cuda::{self, Elem};
use crate::ops::FusedLinear;

const NAME: &str = "fp8";

fn format_code(format: Fp8Format) -> i32 {
    match format {
        Fp8Format::E4m3 => 0,
        Fp8Format::E5m2 => 1,
    }
}

/// `[1/scale, scale, 0]` for `x` at current scaling: its largest magnitude, then the scale.
/// The reciprocal comes first so that the product reads it at the allocation's own alignment;
/// the zero is where a recording conversion folds its input's largest magnitude.
pub(super) fn scales<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    dev: &CudaDevice,
    format: Fp8Format,
) -> Result<CudaStorage> {
    let n = l.shape().elem_count();
    let x = cuda::slice_view(x, l, NAME)?;
    let stream = dev.cuda_stream();
    // SAFETY: `fp8_scale` writes all three elements.
    let mut out = unsafe { cuda::output::<f32>(dev, 3) }?;
    let func = cuda::kernel_untyped(dev, &cuda::FP8, "fp8_scale")?;
    let (code, margin) = (format_code(format), 0i32);
    let mut args = stream.launch_builder(&func);
    // A few f32 (a delayed-scaling history) are their own partial maxima: the scale kernel
    // takes their magnitudes itself, one launch instead of two.
    let partials = match T::DTYPE == DType::F32 && n <= SCALE_ALONE {
        true => None,
        false => Some(partial_maxima(&x, l, dev)?),
    };
    match &partials {
        Some(partials) => args.arg(partials),
        None => args.arg(&x),
    };
    let count = cuda::dim(partials.as_ref().map_or(n, |p| p.len()), "partial maxima")?;
    args.arg(&count).arg(&code).arg(&margin).arg(&mut out);
    // SAFETY: `fp8_scale(const float*, int, int, int, float*)`, one block of whole warps; its
    // input holds `count` floats (the partials, or `x` itself where it is f32), `out` three.
    unsafe { args.launch(one_block()) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// The most f32 values the scale kernel reduces alone, without a largest-magnitude pass first.
const SCALE_ALONE: usize = 4096;

/// One largest magnitude per block of a pass over `x`: up to AMAX_BLOCKS blocks, each thread
/// looping over its share (eight elements at a time where it can).
fn partial_maxima<T: Elem>(
    x: &CudaView<'_, T>,
    l: &Layout,
    dev: &CudaDevice,
) -> Result<CudaSlice<f32>> {
    let n = l.shape().elem_count();
    let vec = cuda::eight_wide(&[n], &[cuda::byte_offset::<T>(l)]);
    let config = cuda::elementwise_config(if vec == 1 { n / 8 } else { n });
    let blocks = config.grid_dim.0.min(AMAX_BLOCKS);
    // SAFETY: `fp8_amax_<T>` writes one partial per block.
    let mut partials = unsafe { cuda::output::<f32>(dev, blocks as usize) }?;
    let func = cuda::kernel(dev, &cuda::FP8, "fp8_amax", T::DTYPE)?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(x).arg(&n).arg(&vec).arg(&mut partials);
    let config = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        ..config
    };
    // SAFETY: `fp8_amax_<T>(const T*, size_t, int, float*)`; `x` holds n elements of T (16-byte
    // aligned and a multiple of 8 where `vec`) and `partials` one float per block. Blocks are
    // whole warps (256 threads), as its reduction needs.
    unsafe { args.launch(config) }.w()?;
    Ok(partials)
}

/// The most blocks the largest-magnitude pass runs: enough to keep every SM of a large GPU
/// busy, few enough for one block to reduce their partials.
const AMAX_BLOCKS: u32 = 1024;

/// One block of 1024 threads (whole warps).
fn one_block() -> candle_core::cuda_backend::cudarc::driver::LaunchConfig {
    candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `x`'s codes at `scales[1]`, as `target` says: in one layout, or both from one read (the
/// rows' codes, then the transposed ones). With `record`, the kernel folds the largest
/// magnitude of `x` into `scales[2]` (zero until then, as the scale kernel left it).
pub(super) fn encode<T: Elem>(
    x: &CudaSlice<T>,
    l: &Layout,
    dev: &CudaDevice,
    scales: &CudaView<'_, f32>,
    format: Fp8Format,
    (target, record): (EncodeTarget, bool),
) -> Result<CudaStorage> {
    let n = l.shape().elem_count();
    if scales.len() < 3 {
        bail!("{NAME}: a conversion's scales are [1/scale, scale, magnitude]");
    }
    let x = cuda::slice_view(x, l, NAME)?;
    let code = format_code(format);
    // SAFETY: the kernel writes every code.
    let mut out = unsafe { cuda::output::<u8>(dev, target.count(n)) }?;
    let mut codes = out.slice_mut(..);
    let scale = scales.slice(1..2);
    // Written through: the scales are this conversion's own, made by the scale kernel just
    // before on this stream, and nothing reads their last element until the record after.
    let magnitude = scales.slice(2..3);
    let amax = record.then_some(&magnitude);
    match target {
        EncodeTarget::One(OperandLayout::Rows) => {
            rows(dev, (&x, l), &scale, code, &mut codes, amax)?;
        }
        EncodeTarget::One(OperandLayout::Transposed) => {
            transposed(dev, (&x, l), &scale, code, (None, &mut codes), amax)?;
        }
        EncodeTarget::Both => {
            let (mut rows, mut columns) = codes.split_at_mut(n);
            transposed(
                dev,
                (&x, l),
                &scale,
                code,
                (Some(&mut rows), &mut columns),
                amax,
            )?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// A null device pointer, for a kernel's optional buffer left out.
const NULL: u64 = 0;

/// The conversion of `x` (shape from `l`) into `codes` as it is, recording its largest magnitude
/// into `amax` where given.
fn rows<T: Elem>(
    dev: &CudaDevice,
    (x, l): (&CudaView<'_, T>, &Layout),
    scale: &CudaView<'_, f32>,
    code: i32,
    codes: &mut CudaViewMut<'_, u8>,
    amax: Option<&CudaView<'_, f32>>,
) -> Result<()> {
    let n = l.shape().elem_count();
    let vec = cuda::eight_wide(&[n], &[cuda::byte_offset::<T>(l)]);
    let func = cuda::kernel(dev, &cuda::FP8, "fp8_quantize", T::DTYPE)?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(x)
        .arg(&n)
        .arg(scale)
        .arg(&code)
        .arg(&vec)
        .arg(codes);
    match amax {
        Some(amax) => args.arg(amax),
        None => args.arg(&NULL),
    };
    let threads = if vec == 1 { n / 8 } else { n };
    // SAFETY: `fp8_quantize_<T>(const T*, size_t, const float*, int, int, uchar*, float*)`;
    // `x` and `codes` hold n elements (x 16-byte aligned and n a multiple of 8 where `vec`;
    // `codes` starts a fresh allocation), `scale` at least one, `amax` (or null) one f32.
    // Blocks are whole warps (256 threads), as its reduction needs.
    unsafe { args.launch(cuda::elementwise_config(threads)) }.w()?;
    Ok(())
}

/// The transposing conversion of the matrix `x` (shape from `l`) into `codes_t`, and into
/// `codes` as it is, if given; recording its largest magnitude into `amax` where given. Matrices
/// whose rows are a multiple of 16 and columns a multiple of 8, starting on a 16-byte boundary
/// (every product operand of a model whose widths are multiples of 64, at any token count that
/// is a multiple of 16), take the wide kernel.
fn transposed<T: Elem>(
    dev: &CudaDevice,
    (x, l): (&CudaView<'_, T>, &Layout),
    scale: &CudaView<'_, f32>,
    code: i32,
    (codes, codes_t): (Option<&mut CudaViewMut<'_, u8>>, &mut CudaViewMut<'_, u8>),
    amax: Option<&CudaView<'_, f32>>,
) -> Result<()> {
    let (rows, cols) = l.shape().dims2()?;
    let wide = rows % 16 == 0 && cuda::eight_wide(&[cols], &[cuda::byte_offset::<T>(l)]) == 1;
    let (tile, base, block) = match wide {
        true => (64, "fp8_quantize_transposed_wide", (256, 1, 1)),
        false => (32, "fp8_quantize_transposed", (32, 8, 1)),
    };
    let tiles_y = rows.div_ceil(tile);
    if tiles_y > 65_535 {
        bail!("{NAME}: {rows} rows are more than the transposing conversion's grid holds");
    }
    let (r, c) = (cuda::dim(rows, "rows")?, cuda::dim(cols, "columns")?);
    let func = cuda::kernel(dev, &cuda::FP8, base, T::DTYPE)?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(x).arg(&r).arg(&c).arg(scale).arg(&code);
    match codes {
        Some(codes) => args.arg(codes),
        // The kernel writes the transposed codes alone.
        None => args.arg(&NULL),
    };
    args.arg(codes_t);
    match amax {
        Some(amax) => args.arg(amax),
        None => args.arg(&NULL),
    };
    let config = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (cols.div_ceil(tile) as u32, tiles_y as u32, 1),
        block_dim: block,
        shared_mem_bytes: 0,
    };
    // SAFETY: `fp8_quantize_transposed[_wide]_<T>(const T*, int, int, const float*, int, uchar*,
    // uchar*, float*)` over `tile` × `tile` tiles with the block shape each assumes; `x`,
    // `codes_t` and `codes` (or null) hold rows·cols elements, `amax` (or null) one f32. The
    // wide kernel's conditions are checked above, and `codes` and `codes_t` start at offsets 0
    // and rows·cols (a multiple of 128) of a fresh allocation, so its 8- and 16-byte stores are
    // aligned.
    unsafe { args.launch(config) }.w()?;
    Ok(())
}

/// `history[slot]` = the largest magnitude a recording conversion folded into `scales[2]`: one
/// thread, on candle's stream.
pub(super) fn record_amax(
    dev: &CudaDevice,
    history: &mut CudaViewMut<'_, f32>,
    scales: &CudaView<'_, f32>,
    slot: usize,
) -> Result<()> {
    if slot >= history.len() || scales.len() < 3 {
        bail!(
            "{NAME}: no slot {slot} of {}, or no magnitude in {} scales",
            history.len(),
            scales.len()
        );
    }
    let from = scales.slice(2..3);
    let slot = cuda::dim(slot, "history slots")?;
    let func = cuda::kernel_untyped(dev, &cuda::FP8, "fp8_record_amax")?;
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(&from).arg(history).arg(&slot);
    let config = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `fp8_record_amax(const float*, float*, int)`, one thread; `from` is one f32,
    // `history` holds more than `slot` floats.
    unsafe { args.launch(config) }.w()?;
    Ok(())
}

/// Compute capability 8.9 (Ada) or newer: fp8 tensor cores.
pub(super) fn has_fp8_tensor_cores(dev: &CudaDevice) -> Result<bool> {
    let context = dev.cuda_stream().context().clone();
    let major = context
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = context
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok(crate::spec::device::has_fp8_tensor_cores_at(major, minor))
}

fn lt_type(format: Fp8Format) -> sys::cudaDataType_t {
    match format {
        Fp8Format::E4m3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Fp8Format::E5m2 => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

/// `a · bᵀ` as one cuBLASLt fp8 product.
///
/// cuBLASLt is column-major, and row-major `D (m × n)` is column-major `Dᵀ (n × m)` =
/// `b · aᵀ` with `b` read as the column-major `k × n` matrix it already is, transposed, and `a`
/// as the column-major `k × m` one, not transposed: "TN", the one layout fp8 products take.
pub(super) fn product(a: &Fp8Operand, b: &Fp8Operand, dtype: DType) -> Result<Tensor> {
    match queue(a, b, dtype, None, None)? {
        (out, Queued::Yes) => Ok(out),
        (_, Queued::NoKernel(why)) => bail!(
            "{NAME}: cuBLASLt has no fp8 product for this GPU and shape ({why}); fp8 needs \
             compute capability 8.9 or newer"
        ),
    }
}

/// `a · bᵀ + bias + residual` as one cuBLASLt fp8 product whose epilogue adds the bias and sums
/// the residual (both of `dtype`, checked by the caller), or cuBLASLt's refusal where it has no
/// such kernel on this GPU.
pub(super) fn product_plus(
    a: &Fp8Operand,
    b: &Fp8Operand,
    dtype: DType,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<FusedLinear> {
    let bias = bias.map(|t| t.contiguous()).transpose()?;
    let residual = residual.map(|t| t.contiguous()).transpose()?;
    match queue(a, b, dtype, bias.as_ref(), residual.as_ref())? {
        (out, Queued::Yes) => Ok(FusedLinear::Computed(out)),
        (_, Queued::NoKernel(why)) => {
            tracing::debug!(
                target: "autotune::ops",
                why,
                "cuBLASLt has no fp8 product with this epilogue; the bias and residual run apart"
            );
            Ok(FusedLinear::NoKernel(why))
        }
    }
}

/// Queues `a · bᵀ [+ bias] [+ residual]` into a new `m × n` tensor of `dtype`; the bias and the
/// residual, where given, are contiguous and of `dtype`.
fn queue(
    a: &Fp8Operand,
    b: &Fp8Operand,
    dtype: DType,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<(Tensor, Queued)> {
    let ((m, k), (n, _)) = (a.codes.dims2()?, b.codes.dims2()?);
    let candle_core::Device::Cuda(dev) = a.codes.device() else {
        bail!("{NAME}: the product's operands are not on a GPU");
    };
    if a.format == Fp8Format::E5m2 && b.format == Fp8Format::E5m2 {
        bail!("{NAME}: cuBLASLt has no E5M2 × E5M2 product");
    }
    if k % 16 != 0 {
        bail!("{NAME}: fp8 products need an inner dimension that is a multiple of 16, got {k}");
    }
    let out_type = match dtype {
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        other => bail!("{NAME}: fp8 products write bf16 or f32, not {other:?}"),
    };
    if m == 0 || n == 0 {
        return Ok((Tensor::zeros((m, n), dtype, a.codes.device())?, Queued::Yes));
    }
    let out = cublaslt::unwritten(dev, (m, n), dtype)?;
    let address = |t: &Tensor| cuda::address(t, NAME);
    let operand = |codes: &Tensor, format: Fp8Format, scale_inv: &Tensor| -> Result<Operand> {
        Ok(Operand {
            address: address(codes)?,
            data_type: lt_type(format),
            scale: Some(address(scale_inv)?),
        })
    };
    let call = Product {
        op: NAME,
        rows: n as u64,
        cols: m as u64,
        inner: k as u64,
        a: operand(&b.codes, b.format, &b.scale_inv)?,
        b: operand(&a.codes, a.format, &a.scale_inv)?,
        d: (address(&out)?, out_type),
        bias: bias
            .map(|t| Ok::<_, candle_core::Error>((address(t)?, out_type)))
            .transpose()?,
        summed: residual.map(address).transpose()?,
    };
    // SAFETY: the addresses come from live, contiguous tensors of the checked shapes: `b`'s
    // codes hold n·k bytes, `a`'s m·k, `out` (and the residual) m·n elements of `out_type`, the
    // bias n of them, each scale one f32; all stay alive past the queued product, since
    // candle's pool reuses memory in the order of this same stream.
    let queued = unsafe { call.run(dev) }?;
    Ok((out, queued))
}
