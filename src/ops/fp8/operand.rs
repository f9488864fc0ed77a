//! fp8 product operands converted on their own device, and the product of two of them: on the
//! GPU one cuBLASLt fp8 matrix product, on the CPU the same codes decoded and multiplied in f32.
//!
//! An operand is the codes of a matrix laid out along the product's inner dimension `k` (each
//! row holds `k` codes), and the reciprocal of the scale they were taken at, kept on the device
//! as a one-element tensor: choosing the scale, converting and multiplying never wait for the
//! host. `a · bᵀ` takes `a` as `m × k` and `b` as `n × k` codes, which is the only layout an fp8
//! product accepts on Ada and Hopper (both operands read along `k`); a matrix whose `k` runs
//! down its columns (a gradient's rows in a weight gradient) is converted transposed.
//!
//! The conversion is [`Fp8Format::encode`] at [`TensorScaler`]'s current scale, to the bit: the
//! CUDA kernels (`kernels/fp8.cu`) restate both in the same f32 operations, and the op tests
//! hold them to the host's codes.

use std::sync::Mutex;

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, InplaceOp3, Layout, Result, Shape, Tensor,
};

use super::{Fp8Format, Scaling, TensorScaler};
use crate::ops::FusedLinear;

const NAME: &str = "fp8";

/// How a matrix is laid out as an operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperandLayout {
    /// As it is: its rows are the product's rows, its columns the inner dimension.
    Rows,
    /// Transposed: its columns become the product's rows, its rows the inner dimension.
    Transposed,
}

/// A matrix in fp8 on its device, as a product reads it.
#[derive(Debug, Clone)]
pub struct Fp8Operand {
    /// The codes (u8), `rows × k`, row-major.
    pub codes: Tensor,
    /// The reciprocal of the scale the codes were taken at (one f32, on the codes' device):
    /// what the product multiplies them by.
    pub scale_inv: Tensor,
    /// The codes' format.
    pub format: Fp8Format,
}

/// `t` (a matrix of f32, bf16 or f16) converted to `format` at its own current scale, on its
/// device, laid out as `layout` says.
pub fn quantize_operand(
    t: &Tensor,
    format: Fp8Format,
    layout: OperandLayout,
) -> Result<Fp8Operand> {
    let t = matrix(t)?;
    let scales = current_scales(&t, format)?;
    let codes = encoded(&t, &scales, format, EncodeTarget::One(layout))?;
    one_layout(&t, codes, &scales, format, layout)
}

/// `t` (a matrix) converted to `format` at its own current scale in both layouts, rows then
/// transposed: one largest-magnitude pass and one read of `t` where two conversions would take
/// two of each (a gradient's products read it both ways).
pub fn quantize_operand_pair(t: &Tensor, format: Fp8Format) -> Result<(Fp8Operand, Fp8Operand)> {
    let t = matrix(t)?;
    let scales = current_scales(&t, format)?;
    let both = encoded(&t, &scales, format, EncodeTarget::Both)?;
    both_layouts(&t, both, &scales, format)
}

/// How many conversions of one operand delayed scaling looks back over: long enough that a
/// scale does not follow every step's wobble, short enough that the large magnitudes of the
/// first steps leave it soon.
pub const HISTORY_SLOTS: usize = 16;

/// Delayed scaling for one operand of a layer (its input, its weight, or its output gradient):
/// the largest magnitudes of its last conversions, on their device, and the format it is
/// converted to.
///
/// A conversion takes its scale from the largest of those magnitudes (as
/// [`TensorScaler`] with [`Scaling::Delayed`] does), so it needs no pass over the tensor
/// before converting it; the conversion records the tensor's own largest magnitude as it
/// reads it, for the conversions after it. The first conversion, with no history yet, scales
/// itself. Nothing waits for the host: the history, the scale and the record stay on the
/// device.
#[derive(Debug)]
pub struct ScaleHistory {
    format: Fp8Format,
    slots: usize,
    state: Mutex<Option<History>>,
}

/// The magnitudes (f32, one per slot, zero where none yet) and the slot the next conversion
/// records into: the oldest.
#[derive(Debug)]
struct History {
    amaxes: Tensor,
    next: usize,
}

impl ScaleHistory {
    /// An empty history of `slots` conversions (at least one) into `format`.
    pub fn new(format: Fp8Format, slots: usize) -> Self {
        Self {
            format,
            slots: slots.max(1),
            state: Mutex::new(None),
        }
    }

    /// `t` (a matrix) converted at the history's scale, laid out as `layout` says; its
    /// largest magnitude joins the history.
    pub fn quantize(&self, t: &Tensor, layout: OperandLayout) -> Result<Fp8Operand> {
        let t = matrix(t)?;
        let (codes, scales) = self.converted(&t, EncodeTarget::One(layout))?;
        one_layout(&t, codes, &scales, self.format, layout)
    }

    /// `t` (a matrix) converted at the history's scale in both layouts, rows then transposed
    /// (as [`quantize_operand_pair`]); its largest magnitude joins the history.
    pub fn quantize_pair(&self, t: &Tensor) -> Result<(Fp8Operand, Fp8Operand)> {
        let t = matrix(t)?;
        let (both, scales) = self.converted(&t, EncodeTarget::Both)?;
        both_layouts(&t, both, &scales, self.format)
    }

    /// The codes as `target` says (flat) and the scales they were taken at, recording `t`'s
    /// largest magnitude in the oldest slot.
    fn converted(&self, t: &Tensor, target: EncodeTarget) -> Result<(Tensor, Tensor)> {
        let mut state = self.lock()?;
        // The history's largest magnitude is what current scaling would pick for a tensor
        // holding those magnitudes: the same op gives it.
        let scales = match &*state {
            Some(history) => current_scales(&history.amaxes, self.format)?,
            None => current_scales(t, self.format)?,
        };
        let record = Encode {
            format: self.format,
            target,
            record: true,
        };
        let codes = t.apply_op2_no_bwd(&scales, &record)?;
        let history = match &mut *state {
            Some(history) => history,
            empty => empty.insert(History {
                amaxes: Tensor::zeros(self.slots, DType::F32, t.device())?,
                next: 0,
            }),
        };
        let slot = RecordAmax { slot: history.next };
        history.amaxes.inplace_op3(t, &scales, &slot)?;
        history.next = (history.next + 1) % self.slots;
        Ok((codes, scales))
    }

    /// The largest magnitudes recorded, oldest first (zeros where fewer conversions than slots
    /// have run); empty before the first conversion. What a checkpoint keeps.
    pub fn magnitudes(&self) -> Result<Vec<f32>> {
        let state = self.lock()?;
        let Some(history) = &*state else {
            return Ok(Vec::new());
        };
        let slots = history.amaxes.to_vec1::<f32>()?;
        Ok([&slots[history.next..], &slots[..history.next]].concat())
    }

    /// Goes on from `magnitudes` ([`ScaleHistory::magnitudes`] of a history of as many slots),
    /// on `device`: the next conversion scales and records as it would have after them. Empty
    /// starts over, as a new history does.
    pub fn restore(&self, magnitudes: &[f32], device: &candle_core::Device) -> Result<()> {
        let mut state = self.lock()?;
        if magnitudes.is_empty() {
            *state = None;
            return Ok(());
        }
        if magnitudes.len() != self.slots {
            bail!(
                "{NAME}: a history of {} magnitudes for one of {} slots",
                magnitudes.len(),
                self.slots
            );
        }
        *state = Some(History {
            amaxes: Tensor::from_slice(magnitudes, self.slots, device)?,
            next: 0,
        });
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<History>>> {
        self.state
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{NAME}: a conversion panicked")))
    }
}

/// Delayed scaling for a linear layer whose products run in fp8: its input and its weight in
/// E4M3 (precision), its output gradient in E5M2 (range). A layer's input is converted as
/// rows for the forward product and transposed for the weight's gradient, and its weight as
/// rows forward and transposed backward: each pair shares a history, since both conversions
/// read the same values.
#[derive(Debug)]
pub struct LayerScales {
    /// The layer's input.
    pub input: ScaleHistory,
    /// The layer's weight.
    pub weight: ScaleHistory,
    /// The gradient of the layer's output.
    pub gradient: ScaleHistory,
}

/// A layer's histories as a checkpoint keeps them: each operand's magnitudes, oldest first,
/// as the bits of their f32 (exact, and an infinity stays one in JSON).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerScalesState {
    /// The input's.
    pub input: Vec<u32>,
    /// The weight's.
    pub weight: Vec<u32>,
    /// The output gradient's.
    pub gradient: Vec<u32>,
}

impl LayerScalesState {
    /// Whether no conversion has run (a layer whose products are not in fp8).
    pub fn is_empty(&self) -> bool {
        self.input.is_empty() && self.weight.is_empty() && self.gradient.is_empty()
    }
}

impl LayerScales {
    /// The histories as a checkpoint keeps them.
    pub fn state(&self) -> Result<LayerScalesState> {
        let bits = |h: &ScaleHistory| -> Result<Vec<u32>> {
            Ok(h.magnitudes()?.into_iter().map(f32::to_bits).collect())
        };
        Ok(LayerScalesState {
            input: bits(&self.input)?,
            weight: bits(&self.weight)?,
            gradient: bits(&self.gradient)?,
        })
    }

    /// Goes on from `state` ([`LayerScales::state`]), the histories on `device`.
    pub fn restore(&self, state: &LayerScalesState, device: &candle_core::Device) -> Result<()> {
        let values = |bits: &[u32]| bits.iter().copied().map(f32::from_bits).collect::<Vec<_>>();
        self.input.restore(&values(&state.input), device)?;
        self.weight.restore(&values(&state.weight), device)?;
        self.gradient.restore(&values(&state.gradient), device)
    }
}

impl Default for LayerScales {
    fn default() -> Self {
        Self {
            input: ScaleHistory::new(Fp8Format::E4m3, HISTORY_SLOTS),
            weight: ScaleHistory::new(Fp8Format::E4m3, HISTORY_SLOTS),
            gradient: ScaleHistory::new(Fp8Format::E5m2, HISTORY_SLOTS),
        }
    }
}

/// `t` as a contiguous matrix, or an error naming its shape.
fn matrix(t: &Tensor) -> Result<Tensor> {
    if t.rank() != 2 {
        bail!(
            "{NAME}: an operand must be a matrix, got shape {:?}",
            t.dims()
        );
    }
    t.contiguous()
}

/// `[1/scale, scale]` at current scaling for `t`. The reciprocal comes first so that the
/// product reads it at the allocation's own alignment.
fn current_scales(t: &Tensor, format: Fp8Format) -> Result<Tensor> {
    t.apply_op1_no_bwd(&ChooseScale { format })
}

/// `t`'s codes at `scales[1]` as `target` says, flat.
fn encoded(t: &Tensor, scales: &Tensor, format: Fp8Format, target: EncodeTarget) -> Result<Tensor> {
    let plain = Encode {
        format,
        target,
        record: false,
    };
    t.apply_op2_no_bwd(scales, &plain)
}

/// The operand from the flat `codes` of the matrix `t` in `layout`.
fn one_layout(
    t: &Tensor,
    codes: Tensor,
    scales: &Tensor,
    format: Fp8Format,
    layout: OperandLayout,
) -> Result<Fp8Operand> {
    let (rows, cols) = t.dims2()?;
    let shape = match layout {
        OperandLayout::Rows => (rows, cols),
        OperandLayout::Transposed => (cols, rows),
    };
    Ok(Fp8Operand {
        codes: codes.reshape(shape)?,
        scale_inv: scales.narrow(0, 0, 1)?,
        format,
    })
}

/// The two operands from the flat codes of the matrix `t` in both layouts, rows first.
fn both_layouts(
    t: &Tensor,
    both: Tensor,
    scales: &Tensor,
    format: Fp8Format,
) -> Result<(Fp8Operand, Fp8Operand)> {
    let (rows, cols) = t.dims2()?;
    let n = rows * cols;
    let scale_inv = scales.narrow(0, 0, 1)?;
    let operand = |start: usize, shape: (usize, usize)| -> Result<Fp8Operand> {
        Ok(Fp8Operand {
            codes: both.narrow(0, start, n)?.reshape(shape)?,
            scale_inv: scale_inv.clone(),
            format,
        })
    };
    Ok((operand(0, (rows, cols))?, operand(n, (cols, rows))?))
}

/// Which codes [`Encode`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EncodeTarget {
    /// One layout.
    One(OperandLayout),
    /// Both, rows then transposed, in one flat tensor.
    Both,
}

impl EncodeTarget {
    /// The codes written for a matrix of `n` values.
    pub(super) fn count(self, n: usize) -> usize {
        match self {
            EncodeTarget::One(_) => n,
            EncodeTarget::Both => 2 * n,
        }
    }
}

/// `a · bᵀ` (`a`: `m × k` codes, `b`: `n × k`) with f32 accumulation and both scales divided
/// out, written in `dtype` (bf16 or f32 on the GPU). On the GPU one cuBLASLt fp8 product, which
/// needs fp8 tensor cores (compute capability 8.9 or newer), `k` a multiple of 16, and not both
/// operands in E5M2; on the CPU the codes decoded and multiplied in f32.
pub fn fp8_product(a: &Fp8Operand, b: &Fp8Operand, dtype: DType) -> Result<Tensor> {
    let ((m, k), (n, kb)) = (a.codes.dims2()?, b.codes.dims2()?);
    if k != kb {
        bail!("{NAME}: product of {m}×{k} and ({n}×{kb})ᵀ codes: inner dimensions differ");
    }
    #[cfg(feature = "cuda")]
    if a.codes.device().is_cuda() {
        return super::gpu::product(a, b, dtype);
    }
    let decoded = |o: &Fp8Operand| -> Result<Tensor> {
        let table: Vec<f32> = (0..=255u8).map(|c| o.format.decode(c)).collect();
        let codes = o.codes.flatten_all()?.to_vec1::<u8>()?;
        let values: Vec<f32> = codes.iter().map(|&c| table[usize::from(c)]).collect();
        Tensor::from_vec(values, o.codes.shape(), o.codes.device())
    };
    let product = decoded(a)?.matmul(&decoded(b)?.t()?)?;
    let scale = a.scale_inv.mul(&b.scale_inv)?;
    product.broadcast_mul(&scale)?.to_dtype(dtype)
}

/// `a · bᵀ + bias + residual`, summed before it is rounded to `dtype` once: the fp8 product
/// with the separate epilogue pass's bias and residual folded in. On the GPU one cuBLASLt fp8
/// product, whose epilogue adds the bias (`n` values) and sums the residual (`m × n`), both of
/// the output's dtype, where cuBLASLt has a kernel for it; on the CPU the f32 product plus both,
/// widened to f32. Anything else (another dtype or shape, nothing to add) is
/// [`FusedLinear::NotFusable`], and the caller runs [`fp8_product`] and the separate pass on the
/// same operands.
pub fn fp8_product_plus(
    a: &Fp8Operand,
    b: &Fp8Operand,
    dtype: DType,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
) -> Result<FusedLinear> {
    let ((m, _), (n, _)) = (a.codes.dims2()?, b.codes.dims2()?);
    let same_device = |t: &Tensor| t.device().same_device(a.codes.device());
    let bias_fits = bias.is_none_or(|t| t.dims() == [n] && same_device(t));
    let residual_fits = residual.is_none_or(|t| t.dims() == [m, n] && same_device(t));
    if !(bias_fits && residual_fits) || (bias.is_none() && residual.is_none()) {
        return Ok(FusedLinear::NotFusable);
    }
    #[cfg(feature = "cuda")]
    if a.codes.device().is_cuda() {
        let of_dtype = |t: Option<&Tensor>| t.is_none_or(|t| t.dtype() == dtype);
        if dtype != DType::BF16 || !of_dtype(bias) || !of_dtype(residual) {
            return Ok(FusedLinear::NotFusable);
        }
        return super::gpu::product_plus(a, b, dtype, bias, residual);
    }
    let mut sum = fp8_product(a, b, DType::F32)?;
    if let Some(bias) = bias {
        sum = sum.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    if let Some(residual) = residual {
        sum = (sum + residual.to_dtype(DType::F32)?)?;
    }
    Ok(FusedLinear::Computed(sum.to_dtype(dtype)?))
}

/// Whether `device` multiplies fp8 on its tensor cores: a GPU of compute capability 8.9 (Ada)
/// or newer. The CPU emulates the product instead.
pub fn has_fp8_tensor_cores(device: &candle_core::Device) -> Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => super::gpu::has_fp8_tensor_cores(dev),
        _ => Ok(false),
    }
}

/// Op: the scale that current scaling picks for a tensor, as three f32: its reciprocal (what the
/// product divides out), the scale, and a zero, where a recording [`Encode`] on the GPU folds
/// its input's largest magnitude.
struct ChooseScale {
    format: Fp8Format,
}

/// The length of [`ChooseScale`]'s output.
const SCALES: usize = 3;

impl CustomOp1 for ChooseScale {
    fn name(&self) -> &'static str {
        "fp8-scale"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = crate::ops::input_f32(s, l, NAME)?;
        let scale = TensorScaler::new(self.format, Scaling::Current).current_scale(&values);
        Ok((
            CpuStorage::F32(vec![1.0 / scale, scale, 0.0]),
            Shape::from(SCALES),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::ops::cuda::float_slice!(NAME, s, v => super::gpu::scales(v, l, &s.device, self.format)?);
        Ok((out, Shape::from(SCALES)))
    }
}

/// Op: a matrix's codes at the scale of the second input ([`ChooseScale`]'s), laid out as
/// `target` says, flat. With `record`, the GPU kernel also folds the matrix's largest magnitude
/// into the scales' last element as it reads the matrix ([`RecordAmax`] takes it from there;
/// the CPU computes it there instead).
struct Encode {
    format: Fp8Format,
    target: EncodeTarget,
    // The CPU records in `RecordAmax` instead, so only the GPU build reads it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    record: bool,
}

impl CustomOp2 for Encode {
    fn name(&self) -> &'static str {
        "fp8-encode"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        scales: &CpuStorage,
        scales_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let values = crate::ops::input_f32(s, l, NAME)?;
        let scale = crate::ops::input_f32(scales, scales_layout, NAME)?[1];
        let (rows, cols) = l.shape().dims2()?;
        let code = |i: usize| self.format.encode(values[i] * scale);
        let as_rows = || (0..rows * cols).map(code);
        let transposed = || {
            (0..cols)
                .flat_map(|c| (0..rows).map(move |r| r * cols + c))
                .map(code)
        };
        let codes: Vec<u8> = match self.target {
            EncodeTarget::One(OperandLayout::Rows) => as_rows().collect(),
            EncodeTarget::One(OperandLayout::Transposed) => transposed().collect(),
            EncodeTarget::Both => as_rows().chain(transposed()).collect(),
        };
        debug_assert_eq!(codes.len(), self.target.count(rows * cols));
        let len = codes.len();
        Ok((CpuStorage::U8(codes), Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        scales: &candle_core::CudaStorage,
        scales_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let scales = crate::ops::cuda::view::<f32>(scales, scales_layout, NAME)?;
        let out = crate::ops::cuda::float_slice!(NAME, s, v => super::gpu::encode(
            v, l, &s.device, &scales, self.format, (self.target, self.record)
        )?);
        Ok((out, Shape::from(self.target.count(l.shape().elem_count()))))
    }
}

/// Op, in place on a history of largest magnitudes (f32): `history[slot]` = the largest
/// magnitude of the matrix (the second input) a recording [`Encode`] converted at the scales
/// given (the third). The GPU copies what the conversion folded into the scales; the CPU
/// computes it from the matrix.
struct RecordAmax {
    slot: usize,
}

impl InplaceOp3 for RecordAmax {
    fn name(&self) -> &'static str {
        "fp8-record-amax"
    }

    fn cpu_fwd(
        &self,
        history: &mut CpuStorage,
        history_layout: &Layout,
        matrix: &CpuStorage,
        matrix_layout: &Layout,
        _scales: &CpuStorage,
        _scales_layout: &Layout,
    ) -> Result<()> {
        let CpuStorage::F32(history) = history else {
            bail!("{NAME}: a history is f32");
        };
        let Some((start, end)) = history_layout.contiguous_offsets() else {
            bail!("{NAME}: the history must be contiguous");
        };
        let Some(slot) = history[start..end].get_mut(self.slot) else {
            bail!("{NAME}: no slot {} in the history", self.slot);
        };
        *slot = super::amax(&crate::ops::input_f32(matrix, matrix_layout, NAME)?);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        history: &mut candle_core::CudaStorage,
        history_layout: &Layout,
        _matrix: &candle_core::CudaStorage,
        _matrix_layout: &Layout,
        scales: &candle_core::CudaStorage,
        scales_layout: &Layout,
    ) -> Result<()> {
        let dev = history.device.clone();
        let scales = crate::ops::cuda::view::<f32>(scales, scales_layout, NAME)?;
        let Some((start, end)) = history_layout.contiguous_offsets() else {
            bail!("{NAME}: the history must be contiguous");
        };
        let mut slots = history.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
        super::gpu::record_amax(&dev, &mut slots, &scales, self.slot)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn matrix(rows: usize, cols: usize, seed: u64) -> Tensor {
        // Values over several binades, both signs, and a few exact zeros.
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let h = crate::hash::splitmix64(seed ^ i as u64);
                let unit = (h >> 11) as f32 / (1u64 << 53) as f32;
                let exponent = ((h >> 3) % 12) as i32 - 6;
                let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
                if h % 29 == 0 {
                    0.0
                } else {
                    sign * (0.5 + unit) * 2f32.powi(exponent)
                }
            })
            .collect();
        Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap()
    }

    #[test]
    fn operands_hold_the_codes_the_scaler_picks_in_either_layout() {
        let t = matrix(7, 12, 3);
        for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
            let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let expected = TensorScaler::new(format, Scaling::Current).quantize(&values);
            let rows = quantize_operand(&t, format, OperandLayout::Rows).unwrap();
            assert_eq!(rows.codes.dims(), &[7, 12]);
            assert_eq!(
                rows.codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
                expected.codes
            );
            let inverse = rows.scale_inv.to_vec1::<f32>().unwrap();
            assert_eq!(inverse, vec![1.0 / expected.scale]);

            let transposed = quantize_operand(&t, format, OperandLayout::Transposed).unwrap();
            assert_eq!(transposed.codes.dims(), &[12, 7]);
            let codes = transposed.codes.to_vec2::<u8>().unwrap();
            for (c, column) in codes.iter().enumerate() {
                for (r, &code) in column.iter().enumerate() {
                    assert_eq!(code, expected.codes[r * 12 + c], "{format:?} ({r}, {c})");
                }
            }
        }
    }

    #[test]
    fn a_pair_holds_both_layouts_at_one_scale_as_two_conversions_would() {
        let t = matrix(9, 20, 6);
        for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
            let (rows, transposed) = quantize_operand_pair(&t, format).unwrap();
            for (got, layout) in [
                (&rows, OperandLayout::Rows),
                (&transposed, OperandLayout::Transposed),
            ] {
                let want = quantize_operand(&t, format, layout).unwrap();
                assert_eq!(got.codes.dims(), want.codes.dims(), "{format:?} {layout:?}");
                let codes = |o: &Fp8Operand| o.codes.flatten_all().unwrap().to_vec1::<u8>();
                assert_eq!(
                    codes(got).unwrap(),
                    codes(&want).unwrap(),
                    "{format:?} {layout:?}"
                );
                let inverse = |o: &Fp8Operand| o.scale_inv.to_vec1::<f32>().unwrap();
                assert_eq!(inverse(got), inverse(&want));
                assert_eq!(got.format, format);
            }
        }
        assert!(quantize_operand_pair(
            &Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
            Fp8Format::E4m3
        )
        .is_err());
    }

    #[test]
    fn a_history_converts_as_delayed_scaling_defines_in_every_layout() {
        // Two slots, so the sequence shows the first conversion scaling itself, a spike
        // clipped at the scale before it, the scale after it, and the spike leaving.
        for format in [Fp8Format::E4m3, Fp8Format::E5m2] {
            let history = ScaleHistory::new(format, 2);
            let mut scaler = TensorScaler::new(format, Scaling::Delayed { history: 2 });
            assert!(history.magnitudes().unwrap().is_empty());
            for (step, size) in [1.0f32, 8.0, 1.0, 1.0, 0.5, 1.0].into_iter().enumerate() {
                let t = (matrix(5, 12, step as u64) * f64::from(size)).unwrap();
                let values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let want = scaler.quantize(&values);
                let codes = |o: &Fp8Operand| o.codes.flatten_all().unwrap().to_vec1::<u8>();
                let inverse = |o: &Fp8Operand| o.scale_inv.to_vec1::<f32>().unwrap();
                // Alternating the ways in: each records into the same history.
                let operand = match step % 3 {
                    0 => history.quantize(&t, OperandLayout::Rows).unwrap(),
                    1 => {
                        let (rows, transposed) = history.quantize_pair(&t).unwrap();
                        assert_eq!(transposed.codes.dims(), &[12, 5]);
                        // The transposed codes: the same values at the same scale.
                        let by_hand: Vec<u8> = (0..12)
                            .flat_map(|c| (0..5).map(move |r| r * 12 + c))
                            .map(|i| format.encode(values[i] * want.scale))
                            .collect();
                        assert_eq!(codes(&transposed).unwrap(), by_hand, "{format:?} {step}");
                        assert_eq!(inverse(&transposed), inverse(&rows));
                        rows
                    }
                    _ => {
                        let transposed = history.quantize(&t, OperandLayout::Transposed).unwrap();
                        let as_rows = transposed.codes.t().unwrap().contiguous().unwrap();
                        Fp8Operand {
                            codes: as_rows,
                            ..transposed
                        }
                    }
                };
                assert_eq!(
                    codes(&operand).unwrap(),
                    want.codes,
                    "{format:?} step {step}"
                );
                assert_eq!(
                    inverse(&operand),
                    vec![1.0 / want.scale],
                    "{format:?} {step}"
                );
                assert_eq!(operand.format, format);
            }
            // The last two conversions' magnitudes, in their slots.
            let recorded = history.magnitudes().unwrap();
            let magnitude = |step: u64, size: f32| {
                let t = (matrix(5, 12, step) * f64::from(size)).unwrap();
                crate::ops::fp8::amax(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            };
            assert_eq!(recorded, vec![magnitude(4, 0.5), magnitude(5, 1.0)]);
        }
    }

    #[test]
    fn a_transposed_operand_multiplies_as_its_matrix_transposed() {
        // aᵀ · b as (a transposed) · (b transposed)ᵀ: k runs down both matrices' rows.
        let (a, b) = (matrix(16, 6, 4), matrix(16, 3, 5));
        let product = fp8_product(
            &quantize_operand(&a, Fp8Format::E4m3, OperandLayout::Transposed).unwrap(),
            &quantize_operand(&b, Fp8Format::E4m3, OperandLayout::Transposed).unwrap(),
            DType::F32,
        )
        .unwrap();
        let exact = a.t().unwrap().matmul(&b).unwrap();
        let (got, want) = (
            product.to_vec2::<f32>().unwrap(),
            exact.to_vec2::<f32>().unwrap(),
        );
        let largest = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            // E4M3 keeps 3 mantissa bits: each product within about 2^-3 of its own size.
            assert!((g - w).abs() <= 0.15 * largest, "{g} vs {w}");
        }
        assert_eq!(product.dims(), &[6, 3]);
    }

    #[test]
    fn an_fp8_product_adds_its_bias_and_residual_before_rounding_once() {
        let (m, n, k) = (5, 8, 32);
        let a = quantize_operand(&matrix(m, k, 11), Fp8Format::E4m3, OperandLayout::Rows).unwrap();
        let b = quantize_operand(&matrix(n, k, 12), Fp8Format::E4m3, OperandLayout::Rows).unwrap();
        let bias = matrix(1, n, 13).reshape(n).unwrap();
        let residual = matrix(m, n, 14);
        // The reference in f64 from the codes themselves: Σ decode(a)·decode(b) / (sa·sb).
        let decoded = |o: &Fp8Operand| -> Vec<f64> {
            let codes = o.codes.flatten_all().unwrap().to_vec1::<u8>().unwrap();
            let inv = f64::from(o.scale_inv.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]);
            codes
                .iter()
                .map(|&c| f64::from(o.format.decode(c)) * inv)
                .collect()
        };
        let (av, bv) = (decoded(&a), decoded(&b));
        let biases = bias.to_vec1::<f32>().unwrap();
        let residuals = residual.to_vec2::<f32>().unwrap();
        let want = |i: usize, j: usize, with_bias: bool, with_residual: bool| -> f64 {
            let dot: f64 = (0..k).map(|t| av[i * k + t] * bv[j * k + t]).sum();
            let bias = if with_bias { f64::from(biases[j]) } else { 0.0 };
            let residual = if with_residual {
                f64::from(residuals[i][j])
            } else {
                0.0
            };
            dot + bias + residual
        };
        for (with_bias, with_residual) in [(true, false), (false, true), (true, true)] {
            let plus = |dtype| {
                let (bias, residual) = (
                    with_bias.then_some(&bias),
                    with_residual.then_some(&residual),
                );
                fp8_product_plus(&a, &b, dtype, bias, residual)
                    .unwrap()
                    .computed()
                    .expect("the CPU adds both")
            };
            let got = plus(DType::F32).to_vec2::<f32>().unwrap();
            for (i, row) in got.iter().enumerate() {
                for (j, &g) in row.iter().enumerate() {
                    let w = want(i, j, with_bias, with_residual);
                    assert!(
                        (f64::from(g) - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{g} vs {w}"
                    );
                }
            }
            // bf16 rounds the f32 sum once: the f32 result cast, not the rounded product plus.
            let half = plus(DType::BF16);
            let once = Tensor::new(got, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            assert_eq!(
                half.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
                once.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
            );
        }
        // Nothing to add, or a bias of the wrong width, is left to the caller.
        let nothing = fp8_product_plus(&a, &b, DType::F32, None, None).unwrap();
        assert!(matches!(nothing, FusedLinear::NotFusable));
        let narrow = bias.narrow(0, 0, n - 1).unwrap();
        let wrong = fp8_product_plus(&a, &b, DType::F32, Some(&narrow), None).unwrap();
        assert!(matches!(wrong, FusedLinear::NotFusable));
    }

    #[test]
    fn the_cpu_has_no_fp8_tensor_cores_and_shapes_must_agree() {
        assert!(!has_fp8_tensor_cores(&Device::Cpu).unwrap());
        let a = quantize_operand(&matrix(2, 16, 1), Fp8Format::E4m3, OperandLayout::Rows).unwrap();
        let b = quantize_operand(&matrix(2, 8, 1), Fp8Format::E4m3, OperandLayout::Rows).unwrap();
        let err = fp8_product(&a, &b, DType::F32).unwrap_err().to_string();
        assert!(err.contains("inner dimensions differ"), "{err}");
        let vector = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        assert!(quantize_operand(&vector, Fp8Format::E4m3, OperandLayout::Rows).is_err());
    }
}
