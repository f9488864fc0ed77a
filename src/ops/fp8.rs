//! The two 8-bit float formats of fp8 training, and the per-tensor scaling that fits a tensor
//! into them: the numerics an fp8 matrix product runs on, written out on the host so that an
//! emulated fp8 step on the CPU and the GPU's conversions can be checked against them.
//!
//! Both formats are the OCP ones that NVIDIA's Ada and Hopper tensor cores take:
//! - [`Fp8Format::E4m3`]: 4 exponent bits (bias 7) and 3 mantissa bits, largest finite 448, no
//!   infinities (only `S.1111.111` is NaN), for weights and activations, which need precision;
//! - [`Fp8Format::E5m2`]: 5 exponent bits (bias 15) and 2 mantissa bits, largest finite 57344,
//!   IEEE-like infinities and NaNs, for gradients, which need range.
//!
//! Conversion rounds to nearest, ties to even, and saturates: a value beyond the largest
//! finite one (an infinity included) becomes that largest value with its sign, as the GPU's
//! `cvt.rn.satfinite` does. A scaled tensor should never reach it; where one does (a spike after
//! the scale was chosen), clipping it is what training tolerates, an infinity is not. NaN stays
//! NaN.
//!
//! A tensor is multiplied by its scale before conversion and divided by it after
//! ([`Quantized::dequantize`]), so that its largest magnitude lands near the format's largest
//! finite value and its small values keep their precision. [`TensorScaler`] chooses the scale
//! from the tensor itself (current scaling) or from the largest magnitudes of the last steps
//! (delayed scaling, which needs no pass over the tensor before its conversion).
//!
//! [`quantize_operand`] and [`fp8_product`] (`operand.rs`) convert and multiply on the tensors'
//! own device: cuBLASLt's fp8 product on a GPU with fp8 tensor cores, and on the CPU the
//! emulation, the codes decoded and multiplied with f32 accumulation, the scales divided out;
//! what an fp8 step runs there, and the reference a GPU product is checked against.
//! [`emulated_product`] is the two in one call.

use std::collections::VecDeque;

use candle_core::{Result, Tensor};

#[cfg(feature = "cuda")]
mod gpu;
mod operand;

pub use operand::{
    fp8_product, fp8_product_plus, has_fp8_tensor_cores, quantize_operand, quantize_operand_pair,
    Fp8Operand, LayerScales, LayerScalesState, OperandLayout, ScaleHistory, HISTORY_SLOTS,
};

/// An 8-bit float format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits: weights and activations.
    E4m3,
    /// 5 exponent bits, 2 mantissa bits: gradients.
    E5m2,
}

impl Fp8Format {
    /// Mantissa (fraction) bits.
    const fn mantissa_bits(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 3,
            Fp8Format::E5m2 => 2,
        }
    }

    /// The exponent's bias.
    const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 7,
            Fp8Format::E5m2 => 15,
        }
    }

    /// The code of the largest finite magnitude (sign bit clear).
    const fn max_code(self) -> u8 {
        match self {
            // S.1111.110: S.1111.111 is NaN.
            Fp8Format::E4m3 => 0x7e,
            // S.11110.11: exponent 11111 holds infinities and NaNs.
            Fp8Format::E5m2 => 0x7b,
        }
    }

    /// The largest finite magnitude: 448 or 57344.
    pub fn max_finite(self) -> f32 {
        self.decode(self.max_code())
    }

    /// The code of `x`, rounded to nearest (ties to even) and saturated to the largest finite
    /// magnitude.
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return sign | 0x7f;
        }
        let magnitude = f64::from(x.abs());
        if magnitude == 0.0 {
            return sign;
        }
        let mantissa = self.mantissa_bits();
        // The f32's own binade (its exponent bits; an f32 subnormal lies far below either
        // format's smallest value), no lower than the formats' smallest normal one, whose
        // spacing the subnormals below it share.
        let binade = ((x.abs().to_bits() >> 23) as i32 - 127).max(1 - self.bias());
        // Exact: a division by a power of two in f64 (built from its exponent bits: the
        // quantum lies within f64's normal range for both formats).
        let quantum = f64::from_bits(((binade - mantissa + 1023) as u64) << 52);
        let steps = (magnitude / quantum).round_ties_even();
        // `steps` counts from 2^mantissa in a normal binade, so the code is the binade's
        // first code plus the steps past it; in the smallest binade the same sum gives the
        // subnormals (exponent field 0), and a carry to 2^(mantissa+1) steps is the next
        // binade's first code.
        let field = f64::from((binade + self.bias() - 1) << mantissa) + steps;
        let code = field.min(f64::from(self.max_code())) as u8;
        sign | code
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let mantissa_bits = self.mantissa_bits();
        let field = i32::from(code & 0x7f);
        let exponent_field = field >> mantissa_bits;
        let mantissa = field & ((1 << mantissa_bits) - 1);
        let top_exponent = (1 << (7 - mantissa_bits)) - 1;
        match self {
            Fp8Format::E4m3 if field == 0x7f => return f32::NAN,
            Fp8Format::E5m2 if exponent_field == top_exponent => {
                return if mantissa == 0 {
                    sign * f32::INFINITY
                } else {
                    f32::NAN
                };
            }
            _ => {}
        }
        let scale = 2f32.powi(1 - self.bias() - mantissa_bits);
        let value = if exponent_field == 0 {
            mantissa as f32 * scale
        } else {
            ((1 << mantissa_bits) + mantissa) as f32 * scale * 2f32.powi(exponent_field - 1)
        };
        sign * value
    }
}

/// A tensor in fp8: its codes and the scale they were taken at.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// One code per value, in order.
    pub codes: Vec<u8>,
    /// What the values were multiplied by before conversion.
    pub scale: f32,
    /// The codes' format.
    pub format: Fp8Format,
}

impl Quantized {
    /// `values` times `scale`, each converted to `format`.
    pub fn new(values: &[f32], format: Fp8Format, scale: f32) -> Self {
        let codes = values.iter().map(|&v| format.encode(v * scale)).collect();
        Self {
            codes,
            scale,
            format,
        }
    }

    /// The values the codes stand for, the scale divided out.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .map(|&c| self.format.decode(c) / self.scale)
            .collect()
    }
}

/// `values` as an fp8 product would see them: converted at `scale` and back, in place.
pub fn round_trip(values: &mut [f32], format: Fp8Format, scale: f32) {
    for v in values.iter_mut() {
        *v = format.decode(format.encode(*v * scale)) / scale;
    }
}

/// The largest magnitude of `values` (NaNs ignored).
pub fn amax(values: &[f32]) -> f32 {
    values
        .iter()
        .filter(|v| !v.is_nan())
        .fold(0.0f32, |m, v| m.max(v.abs()))
}

/// `a · bᵀ` in fp8: `a` converted to `a_format` and `b` to `b_format`, each at its own current
/// scale ([`quantize_operand`]), then [`fp8_product`] in `a`'s dtype. E4M3 × E4M3 is the
/// forward product (activations and weights), E5M2 × E4M3 the backward ones (a gradient and a
/// weight or an activation). On the CPU this is the emulation: the codes decoded, multiplied
/// with f32 accumulation, the scales divided out.
pub fn emulated_product(
    a: &Tensor,
    b: &Tensor,
    a_format: Fp8Format,
    b_format: Fp8Format,
) -> Result<Tensor> {
    let qa = quantize_operand(a, a_format, OperandLayout::Rows)?;
    let qb = quantize_operand(b, b_format, OperandLayout::Rows)?;
    fp8_product(&qa, &qb, a.dtype())
}

/// How a tensor's scale is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// From the tensor's own largest magnitude: a pass over it before it is converted.
    Current,
    /// From the largest magnitude over the last `history` tensors this scaler converted (at
    /// least one), not counting the one being converted.
    Delayed {
        /// How many earlier tensors' magnitudes count.
        history: usize,
    },
}

/// Chooses one tensor's scale, step after step.
#[derive(Debug, Clone)]
pub struct TensorScaler {
    format: Fp8Format,
    scaling: Scaling,
    /// Headroom below the largest finite value, as a power of two: the scale puts the largest
    /// magnitude at `max_finite / 2^margin`.
    margin: i32,
    /// The largest magnitudes of the last tensors, newest last.
    seen: VecDeque<f32>,
}

impl TensorScaler {
    /// A scaler into `format`, choosing as `scaling` says, with no margin.
    pub fn new(format: Fp8Format, scaling: Scaling) -> Self {
        Self {
            format,
            scaling,
            margin: 0,
            seen: VecDeque::new(),
        }
    }

    /// The same scaler keeping the largest magnitude `margin` binades below the largest
    /// finite value.
    pub fn with_margin(mut self, margin: i32) -> Self {
        self.margin = margin;
        self
    }

    /// `values` converted at the scale this scaler chooses for them; their largest magnitude
    /// then joins the history delayed scaling reads.
    pub fn quantize(&mut self, values: &[f32]) -> Quantized {
        let current = amax(values);
        let reference = match self.scaling {
            Scaling::Current => current,
            // Before any history there is nothing to delay: the first tensor scales itself.
            Scaling::Delayed { .. } if self.seen.is_empty() => current,
            Scaling::Delayed { .. } => self.seen.iter().copied().fold(0.0, f32::max),
        };
        let quantized = Quantized::new(values, self.format, self.scale_for(reference));
        if let Scaling::Delayed { history } = self.scaling {
            self.seen.push_back(current);
            while self.seen.len() > history.max(1) {
                self.seen.pop_front();
            }
        }
        quantized
    }

    /// The scale current scaling picks for `values`, without converting them.
    pub(crate) fn current_scale(&self, values: &[f32]) -> f32 {
        self.scale_for(amax(values))
    }

    /// The scale that puts `reference` (a largest magnitude) at the format's largest finite
    /// value less the margin; 1 where there is no finite, nonzero magnitude to scale.
    fn scale_for(&self, reference: f32) -> f32 {
        if !reference.is_finite() || reference <= 0.0 {
            return 1.0;
        }
        let scale = self.format.max_finite() / reference / 2f32.powi(self.margin);
        if scale.is_finite() {
            scale
        } else {
            f32::MAX
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4m3, Fp8Format::E5m2];

    /// The value of `code` from the format's definition, in f64, written independently of
    /// `decode`: (−1)^s · 2^(e − bias) · (1 + m / 2^M), or 2^(1 − bias) · m / 2^M when e = 0.
    fn reference_value(format: Fp8Format, code: u8) -> Option<f64> {
        let (e_bits, m_bits, bias) = match format {
            Fp8Format::E4m3 => (4, 3, 7),
            Fp8Format::E5m2 => (5, 2, 15),
        };
        let sign = if code >> 7 == 1 { -1.0 } else { 1.0 };
        let e = i32::from((code >> m_bits) & ((1 << e_bits) - 1));
        let m = f64::from(code & ((1 << m_bits) - 1));
        let all_ones = (1 << e_bits) - 1;
        let special = match format {
            Fp8Format::E4m3 => e == all_ones && m == f64::from((1 << m_bits) - 1),
            Fp8Format::E5m2 => e == all_ones,
        };
        if special {
            return None;
        }
        let fraction = m / f64::from(1 << m_bits);
        Some(if e == 0 {
            sign * 2f64.powi(1 - bias) * fraction
        } else {
            sign * 2f64.powi(e - bias) * (1.0 + fraction)
        })
    }

    /// Every finite code with its value, in f64.
    fn finite_codes(format: Fp8Format) -> Vec<(u8, f64)> {
        (0..=255u8)
            .filter_map(|c| reference_value(format, c).map(|v| (c, v)))
            .collect()
    }

    /// The code `x` rounds to by the definition: the nearest finite value, ties to the even
    /// code, magnitudes past the largest finite one saturated, zero keeping its sign.
    fn reference_encode(format: Fp8Format, x: f64) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let codes: Vec<(u8, f64)> = finite_codes(format)
            .into_iter()
            .filter(|(c, _)| c & 0x80 == 0)
            .collect();
        let magnitude = x.abs();
        let (max_code, max) = codes
            .iter()
            .copied()
            .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
        if magnitude >= max {
            return sign | max_code;
        }
        let (mut best, mut best_distance) = (0u8, f64::INFINITY);
        for (code, value) in codes {
            let distance = (value - magnitude).abs();
            let closer = distance < best_distance;
            let tie_to_even = distance == best_distance && code % 2 == 0;
            if closer || tie_to_even {
                (best, best_distance) = (code, distance);
            }
        }
        sign | best
    }

    /// A deterministic spread of magnitudes over the formats' whole range and past it.
    fn samples() -> Vec<f32> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut out = Vec::new();
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            let exponent = -22.0 + 42.0 * unit;
            let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
            out.push((sign * 2f64.powf(exponent)) as f32);
        }
        out
    }

    #[test]
    fn every_code_decodes_to_its_defined_value() {
        for format in FORMATS {
            for code in 0..=255u8 {
                let got = format.decode(code);
                match reference_value(format, code) {
                    Some(want) => assert_eq!(f64::from(got), want, "{format:?} {code:#04x}"),
                    None => assert!(
                        got.is_nan() || (format == Fp8Format::E5m2 && got.is_infinite()),
                        "{format:?} {code:#04x}: {got}"
                    ),
                }
            }
        }
        assert_eq!(Fp8Format::E4m3.max_finite(), 448.0);
        assert_eq!(Fp8Format::E5m2.max_finite(), 57344.0);
        assert_eq!(
            Fp8Format::E4m3.decode(1),
            2f32.powi(-9),
            "smallest subnormal"
        );
        assert_eq!(
            Fp8Format::E5m2.decode(1),
            2f32.powi(-16),
            "smallest subnormal"
        );
    }

    #[test]
    fn every_finite_code_encodes_back_to_itself() {
        for format in FORMATS {
            for (code, value) in finite_codes(format) {
                let back = format.encode(value as f32);
                // Negative zero is a code of its own; both zeros decode to zero.
                assert_eq!(back, code, "{format:?} {value}");
            }
        }
    }

    #[test]
    fn values_round_to_the_nearest_code_ties_to_even_and_saturate() {
        for format in FORMATS {
            let mut inputs = samples();
            // Every midpoint between neighbouring codes is a tie; just off it is not.
            let mut values: Vec<f64> = finite_codes(format)
                .into_iter()
                .filter(|(c, _)| c & 0x80 == 0)
                .map(|(_, v)| v)
                .collect();
            values.sort_by(f64::total_cmp);
            for pair in values.windows(2) {
                let mid = (pair[0] + pair[1]) / 2.0;
                inputs.extend([
                    mid as f32,
                    (mid * 1.000_001) as f32,
                    (mid * 0.999_999) as f32,
                ]);
            }
            let max = f64::from(format.max_finite());
            inputs.extend([max as f32, (max * 1.2) as f32, f32::MAX, f32::INFINITY]);
            inputs.extend([-f32::INFINITY, 0.0, -0.0, f32::MIN_POSITIVE, 1e-30]);
            for x in inputs {
                let got = format.encode(x);
                let want = reference_encode(format, f64::from(x));
                assert_eq!(got, want, "{format:?} {x:e}: {got:#04x} vs {want:#04x}");
            }
            assert!(format.decode(format.encode(f32::NAN)).is_nan());
        }
    }

    #[test]
    fn a_scaled_round_trip_keeps_each_value_within_half_a_step() {
        for format in FORMATS {
            let values = samples();
            let mut scaler = TensorScaler::new(format, Scaling::Current);
            let quantized = scaler.quantize(&values);
            let back = quantized.dequantize();
            // Half a step of the mantissa, relative, wherever the scaled value is normal.
            let bound = 2f64.powi(-(format.mantissa_bits() + 1));
            let smallest_normal = 2f64.powi(1 - format.bias());
            let mut checked = 0;
            for (x, y) in values.iter().zip(&back) {
                let scaled = f64::from(*x) * f64::from(quantized.scale);
                if scaled.abs() < smallest_normal {
                    continue;
                }
                let relative = ((f64::from(*y) - f64::from(*x)) / f64::from(*x)).abs();
                assert!(
                    relative <= bound * (1.0 + 1e-6),
                    "{format:?} {x:e} -> {y:e}"
                );
                checked += 1;
            }
            assert!(
                checked > values.len() / 4,
                "{format:?}: only {checked} checked"
            );
            // The largest magnitude lands on the largest finite value.
            let top = amax(&values) * quantized.scale;
            assert!((f64::from(top) / f64::from(format.max_finite()) - 1.0).abs() < 1e-6);
            let mut copy = values.clone();
            round_trip(&mut copy, format, quantized.scale);
            assert_eq!(copy, back, "round_trip is quantize then dequantize");
        }
    }

    #[test]
    fn an_emulated_product_is_the_product_of_the_codes_with_the_scales_divided_out() {
        use candle_core::Device;
        let (m, n, k) = (7, 5, 33);
        let draw = |count: usize, seed: u64, spread: f64| {
            let mut state = seed;
            (0..count)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
                    ((unit - 0.5) * spread) as f32
                })
                .collect::<Vec<f32>>()
        };
        let (a, b) = (draw(m * k, 3, 2.0), draw(n * k, 5, 0.02));
        let at = Tensor::from_vec(a.clone(), (m, k), &Device::Cpu).unwrap();
        let bt = Tensor::from_vec(b.clone(), (n, k), &Device::Cpu).unwrap();
        for (fa, fb) in [
            (Fp8Format::E4m3, Fp8Format::E4m3),
            (Fp8Format::E5m2, Fp8Format::E4m3),
        ] {
            let got = emulated_product(&at, &bt, fa, fb)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            // The reference: the codes decoded in f64, multiplied and summed in f64.
            let qa = Quantized::new(&a, fa, fa.max_finite() / amax(&a));
            let qb = Quantized::new(&b, fb, fb.max_finite() / amax(&b));
            let mut exact_error = 0.0f64;
            let mut exact_norm = 0.0f64;
            for i in 0..m {
                for j in 0..n {
                    let mut sum = 0.0f64;
                    let mut exact = 0.0f64;
                    for p in 0..k {
                        let x = f64::from(fa.decode(qa.codes[i * k + p]));
                        let y = f64::from(fb.decode(qb.codes[j * k + p]));
                        sum += x * y;
                        exact += f64::from(a[i * k + p]) * f64::from(b[j * k + p]);
                    }
                    let want = sum / (f64::from(qa.scale) * f64::from(qb.scale));
                    let g = f64::from(got[i][j]);
                    assert!(
                        (g - want).abs() <= 1e-5 * want.abs().max(1e-6),
                        "{fa:?}: {g} vs {want}"
                    );
                    exact_error += (g - exact).powi(2);
                    exact_norm += exact.powi(2);
                }
            }
            // Against the unquantized product: fp8's rounding, a few per cent (3.4 % and 6.8 %
            // here), about twice as much with E5M2's one mantissa bit fewer.
            let relative = (exact_error / exact_norm).sqrt();
            let bound = if fa == Fp8Format::E4m3 { 0.06 } else { 0.12 };
            assert!(
                relative < bound && relative > 0.0,
                "{fa:?} x {fb:?}: {relative}"
            );
        }
    }

    #[test]
    fn delayed_scaling_reads_the_last_steps_and_clips_a_spike_until_it_is_seen() {
        let mut scaler = TensorScaler::new(Fp8Format::E4m3, Scaling::Delayed { history: 2 });
        let step = |scale: f32| vec![scale, -scale / 3.0, scale / 100.0];
        // The first tensor has no history: it scales itself.
        let first = scaler.quantize(&step(1.0));
        assert_eq!(first.scale, 448.0);
        // A spike 8x past the history saturates at the largest finite value...
        let spike = scaler.quantize(&step(8.0));
        assert_eq!(spike.scale, 448.0, "the scale comes from the step before");
        assert_eq!(spike.dequantize()[0], 1.0, "clipped to 448 / 448");
        // ...and the next step's scale has seen it.
        let after = scaler.quantize(&step(1.0));
        assert_eq!(after.scale, 56.0);
        // Two steps later the spike has left the history.
        scaler.quantize(&step(1.0));
        assert_eq!(scaler.quantize(&step(1.0)).scale, 448.0);
        // A margin keeps the largest magnitude that many binades lower.
        let mut margined = TensorScaler::new(Fp8Format::E5m2, Scaling::Current).with_margin(2);
        assert_eq!(margined.quantize(&[2.0, -1.0]).scale, 57344.0 / 2.0 / 4.0);
        // Nothing finite to scale by: scale 1.
        let mut zeros = TensorScaler::new(Fp8Format::E5m2, Scaling::Current);
        assert_eq!(zeros.quantize(&[0.0, 0.0]).scale, 1.0);
    }
}
