//! CUDA launch of the permuted copy (`kernels/permute.cu`): one grid-stride pass over the
//! output (`cuda::elementwise_config`).

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, Result};

use crate::ops::cuda;

/// The kernels' `Dims4`: output outer dims and their source strides, in units.
///
/// Twin of `struct Dims4` in `src/ops/kernels/permute.cu`: the asserts below and the
/// `static_assert`s there check the same layout; change both together.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Dims4 {
    pub n: [i64; 4],
    pub stride: [i64; 4],
}

const _: () = assert!(std::mem::size_of::<Dims4>() == 64);
const _: () = assert!(std::mem::offset_of!(Dims4, n) == 0);
const _: () = assert!(std::mem::offset_of!(Dims4, stride) == 32);

// SAFETY: plain `repr(C)` integers, laid out as the kernel's struct of two long long[4]
// (layout asserted on both sides).
unsafe impl DeviceRepr for Dims4 {}

pub(super) struct Geometry {
    pub dims: Dims4,
    pub inner_units: i64,
    pub total_units: usize,
    /// Bytes per unit: 16, 4 or 2.
    pub unit: usize,
}

pub(super) fn launch<T: DeviceRepr>(
    dev: &CudaDevice,
    src: &CudaView<'_, T>,
    g: &Geometry,
) -> Result<CudaSlice<T>> {
    let kernel = match g.unit {
        16 => "permute_b16",
        4 => "permute_b4",
        2 => "permute_b2",
        other => bail!("permute: no kernel for {other}-byte units"),
    };
    let func = cuda::kernel_untyped(dev, &cuda::PERMUTE, kernel)?;
    let elems = g.total_units * g.unit / std::mem::size_of::<T>();
    // SAFETY: the kernel below writes every unit, i.e. every element.
    let mut out = unsafe { cuda::output::<T>(dev, elems) }?;
    let total = g.total_units as i64;
    let cfg = cuda::elementwise_config(g.total_units);
    let stream = dev.cuda_stream();
    let mut args = stream.launch_builder(&func);
    args.arg(src)
        .arg(&mut out)
        .arg(&g.dims)
        .arg(&g.inner_units)
        .arg(&total);
    // SAFETY: the arguments match `permute_<w>(const U*, U*, Dims4, long long, long long)`;
    // source offsets stay inside the contiguous input, which holds total units.
    unsafe { args.launch(cfg) }.w()?;
    Ok(out)
}
