//! Shared CUDA plumbing for the fused ops: embedded PTX, kernel lookup, launch shapes.
//!
//! Kernels are PTX compiled by `build.rs` (see the module doc of [`crate::ops`]). Each `.cu` file
//! is one CUDA module, loaded once per device by candle's custom-module cache and looked up by
//! `<kernel>_<dtype>` name.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, WithDType};

/// One PTX module: its cache key in candle's custom-module table and its text.
pub(crate) struct Module {
    name: &'static str,
    ptx: &'static str,
}

pub(crate) const CROSS_ENTROPY: Module = Module {
    name: "autotune_cross_entropy",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/cross_entropy.ptx")),
};

pub(crate) const ATTENTION: Module = Module {
    name: "autotune_attention",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")),
};

pub(crate) const SOFTMAX: Module = Module {
    name: "autotune_softmax",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/softmax.ptx")),
};

pub(crate) const ADAM: Module = Module {
    name: "autotune_adam",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/adam.ptx")),
};

pub(crate) const EPILOGUE: Module = Module {
    name: "autotune_epilogue",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/epilogue.ptx")),
};

pub(crate) const PERMUTE: Module = Module {
    name: "autotune_permute",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/permute.ptx")),
};

pub(crate) const LLAMA: Module = Module {
    name: "autotune_llama",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/llama.ptx")),
};

pub(crate) const COMPACT_ADAM: Module = Module {
    name: "autotune_compact_adam",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/compact_adam.ptx")),
};

pub(crate) const WIDEN: Module = Module {
    name: "autotune_widen",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/widen.ptx")),
};

pub(crate) const FP8: Module = Module {
    name: "autotune_fp8",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/fp8.ptx")),
};

pub(crate) const LAYER_NORM: Module = Module {
    name: "autotune_layer_norm",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/layer_norm.ptx")),
};

/// Element types a kernel argument can have (the float dtypes, and u32 for targets).
pub(crate) trait Elem: WithDType + CudaDType + DeviceRepr {}
impl<T: WithDType + CudaDType + DeviceRepr> Elem for T {}

/// Matches a float `CudaStorage`, binding its `&CudaSlice<T>` to `$v` in `$body`; the body is
/// monomorphised per dtype, so it can call generic launch functions.
macro_rules! float_slice {
    ($op:expr, $storage:expr, $v:ident => $body:expr) => {{
        use candle_core::cuda_backend::CudaStorageSlice as Slice;
        match &$storage.slice {
            Slice::F32($v) => $body,
            Slice::BF16($v) => $body,
            Slice::F16($v) => $body,
            _ => candle_core::bail!(
                "{}: expected f32, bf16 or f16 input, got {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype($storage)
            ),
        }
    }};
}
pub(crate) use float_slice;

/// Loads (once) and returns kernel `<base>_<dtype>` of `module`; launch it on
/// `dev.cuda_stream()`, the stream candle runs everything else on.
pub(crate) fn kernel(
    dev: &CudaDevice,
    module: &Module,
    base: &str,
    dtype: DType,
) -> Result<CudaFunction> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{base}: no CUDA kernel for {other:?}"),
    };
    let func = dev.get_or_load_custom_func(&format!("{base}_{suffix}"), module.name, module.ptx)?;
    Ok(func.into_cuda_function())
}

/// Loads a kernel that has no dtype variants.
pub(crate) fn kernel_untyped(
    dev: &CudaDevice,
    module: &Module,
    name: &str,
) -> Result<CudaFunction> {
    let func = dev.get_or_load_custom_func(name, module.name, module.ptx)?;
    Ok(func.into_cuda_function())
}

/// One block per row. Each thread handles about four elements of the row (enough work to hide
/// latency, few enough threads to keep several blocks per SM for short rows); the block size is
/// a power of two in 64..=1024 because the block reductions assume whole warps.
pub(crate) fn row_config(rows: usize, cols: usize) -> Result<LaunchConfig> {
    let threads = cols.div_ceil(4).next_power_of_two().clamp(64, 1024);
    Ok(LaunchConfig {
        grid_dim: (dim(rows, "rows")? as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Grid-stride elementwise kernels: 256 threads per block and enough blocks for `n` threads,
/// capped where every SM is busy many times over (each thread then loops).
pub(crate) fn elementwise_config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535 * 4) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether an elementwise kernel may move eight elements per thread step (`Pack8` in
/// `kernels/common.cuh`): every count in `multiples_of_8` (the element count, a row width) is a
/// multiple of 8 and every buffer starts `byte_offsets` into a 16-byte-aligned allocation on a
/// 16-byte boundary. As the kernels' `vec` flag.
pub(crate) fn eight_wide(multiples_of_8: &[usize], byte_offsets: &[usize]) -> i32 {
    i32::from(multiples_of_8.iter().all(|n| n % 8 == 0) && byte_offsets.iter().all(|o| o % 16 == 0))
}

/// The byte offset of `layout`'s first element of type `T` in its buffer.
pub(crate) fn byte_offset<T>(layout: &Layout) -> usize {
    layout.start_offset() * std::mem::size_of::<T>()
}

/// A size as the kernels' `int` parameter.
pub(crate) fn dim(n: usize, what: &str) -> Result<i32> {
    match i32::try_from(n) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what} = {n} exceeds the kernels' 32-bit index range"),
    }
}

/// The contiguous view of a storage that `layout` addresses, as element type `T` (an error if
/// the storage holds another dtype).
pub(crate) fn view<'a, T: Elem>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    slice_view(T::as_cuda_slice(storage)?, layout, op)
}

/// The contiguous part of `slice` that `layout` addresses.
pub(crate) fn slice_view<'a, T>(
    slice: &'a CudaSlice<T>,
    layout: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => bail!("{op}: input must be contiguous"),
    }
}

/// An uninitialised output buffer of `len` elements.
///
/// # Safety
///
/// The caller must launch a kernel that writes all `len` elements (on candle's stream, so it
/// runs before any later read) before the buffer is read or handed to candle.
pub(crate) unsafe fn output<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: forwarded to the caller (see above).
    unsafe { dev.alloc::<T>(len) }
}

/// The device address of a contiguous GPU tensor's first element (f32, bf16, f16 or u8), for
/// launches that take raw pointers (cuBLAS, kernels with many buffers); `op` names the caller
/// in errors.
pub(crate) fn address(t: &candle_core::Tensor, op: &str) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaStorageSlice;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        bail!("{op}: every tensor must be on the GPU");
    };
    if !layout.is_contiguous() {
        bail!("{op}: every tensor must be contiguous");
    }
    let stream = s.device.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::U8(x) => (x.device_ptr(&stream).0, 1),
        _ => bail!("{op}: a {:?} tensor", t.dtype()),
    };
    Ok(base + (layout.start_offset() * size) as u64)
}
