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

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{Fp8Format, Scaling, TensorScaler};

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
    let (codes, scale_inv) = converted(t, format, EncodeTarget::One(layout))?;
    Ok(Fp8Operand {
        codes,
        scale_inv,
        format,
    })
}

/// `t` (a matrix) converted to `format` at its own current scale in both layouts, rows then
/// transposed: one largest-magnitude pass and one read of `t` where two conversions would take
/// two of each (a gradient's products read it both ways).
pub fn quantize_operand_pair(t: &Tensor, format: Fp8Format) -> Result<(Fp8Operand, Fp8Operand)> {
    let (both, scale_inv) = converted(t, format, EncodeTarget::Both)?;
    let (rows, cols) = t.dims2()?;
    let n = rows * cols;
    let operand = |start: usize, shape: (usize, usize)| -> Result<Fp8Operand> {
        Ok(Fp8Operand {
            codes: both.narrow(0, start, n)?.reshape(shape)?,
            scale_inv: scale_inv.clone(),
            format,
        })
    };
    Ok((operand(0, (rows, cols))?, operand(n, (cols, rows))?))
}

/// The matrix `t`'s codes at its current scale as `target` says, and the reciprocal of that
/// scale (what a product divides out).
fn converted(t: &Tensor, format: Fp8Format, target: EncodeTarget) -> Result<(Tensor, Tensor)> {
    if t.rank() != 2 {
        bail!(
            "{NAME}: an operand must be a matrix, got shape {:?}",
            t.dims()
        );
    }
    let t = t.contiguous()?;
    // [1/scale, scale]
    let scales = t.apply_op1_no_bwd(&ChooseScale { format })?;
    let codes = t.apply_op2_no_bwd(&scales, &Encode { format, target })?;
    Ok((codes, scales.narrow(0, 0, 1)?))
}

/// Which codes [`Encode`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EncodeTarget {
    /// One layout.
    One(OperandLayout),
    /// Both, rows then transposed, in one flat tensor.
    Both,
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

/// Whether `device` multiplies fp8 on its tensor cores: a GPU of compute capability 8.9 (Ada)
/// or newer. The CPU emulates the product instead.
pub fn has_fp8_tensor_cores(device: &candle_core::Device) -> Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => super::gpu::has_fp8_tensor_cores(dev),
        _ => Ok(false),
    }
}

/// Op: the scale that current scaling picks for a tensor, as two f32: its reciprocal (what the
/// product divides out), then the scale.
struct ChooseScale {
    format: Fp8Format,
}

impl CustomOp1 for ChooseScale {
    fn name(&self) -> &'static str {
        "fp8-scale"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = crate::ops::input_f32(s, l, NAME)?;
        let scale = TensorScaler::new(self.format, Scaling::Current).current_scale(&values);
        Ok((CpuStorage::F32(vec![1.0 / scale, scale]), Shape::from(2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::ops::cuda::float_slice!(NAME, s, v => super::gpu::scales(v, l, &s.device, self.format)?);
        Ok((out, Shape::from(2)))
    }
}

/// Op: a matrix's codes at the scale of the second input (`[1/scale, scale]`), laid out as
/// `target` says.
struct Encode {
    format: Fp8Format,
    target: EncodeTarget,
}

impl Encode {
    fn shape(&self, l: &Layout) -> Result<Shape> {
        let (rows, cols) = l.shape().dims2()?;
        Ok(match self.target {
            EncodeTarget::One(OperandLayout::Rows) => Shape::from((rows, cols)),
            EncodeTarget::One(OperandLayout::Transposed) => Shape::from((cols, rows)),
            EncodeTarget::Both => Shape::from(2 * rows * cols),
        })
    }
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
        Ok((CpuStorage::U8(codes), self.shape(l)?))
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
        let scale = scales.slice(1..);
        let out = crate::ops::cuda::float_slice!(NAME, s, v => super::gpu::encode(
            v, l, &s.device, &scale, self.format, self.target
        )?);
        Ok((out, self.shape(l)?))
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
