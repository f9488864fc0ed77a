//! Host arithmetic of the offloaded optimizer: multi-threaded passes over flat f32 buffers.
//!
//! Every pass is elementwise, so the buffers are cut into one chunk per core
//! ([`crate::parallel`]) and each chunk runs on its own scoped thread; no buffer is allocated.
//! The Adam pass, which an offloaded step spends its host time on, runs on the widest vector
//! unit the CPU has ([`Lanes`]), each bit-identical to the portable loop.

mod lanes;

pub use lanes::{HostFloat, Lanes};

use crate::parallel::{chunk_len, run_parallel};
use crate::spec::model::{OptimizerKind, OptimizerSpec};

/// `dst = src` (`assign`, the first micro-batch) or `dst += src`, converting `src` to f32.
///
/// Assigning rather than adding to zero keeps the sum bit-identical to the on-device path,
/// whose first gradient is taken as is.
pub fn accumulate<T: HostFloat>(dst: &mut [f32], src: &[T], assign: bool, threads: usize) {
    assert_eq!(dst.len(), src.len(), "gradient length");
    let c = chunk_len(dst.len(), threads);
    run_parallel(dst.chunks_mut(c).zip(src.chunks(c)), |(d, s)| {
        // bf16, f16 and f32 all widen to f32 exactly.
        if assign {
            d.iter_mut().zip(s).for_each(|(d, s)| *d = s.to_f32());
        } else {
            d.iter_mut().zip(s).for_each(|(d, s)| *d += s.to_f32());
        }
    });
}

/// Scales `grads` so that their L2 norm is at most `max`, as PyTorch's `clip_grad_norm_` does
/// (by `max / (norm + 1e-6)` when that is below 1); returns the norm before clipping. The sum
/// of squares runs in f64 per chunk, and the chunks' sums are added in order, so the norm does
/// not depend on which thread finishes first.
pub fn clip_global_norm(grads: &mut [f32], max: f64, threads: usize) -> f64 {
    let c = chunk_len(grads.len(), threads);
    let mut partials = vec![0f64; grads.len().div_ceil(c.max(1))];
    run_parallel(grads.chunks(c).zip(partials.iter_mut()), |(chunk, sum)| {
        *sum = chunk.iter().map(|&g| f64::from(g) * f64::from(g)).sum();
    });
    let norm = partials.iter().sum::<f64>().sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        let coef = coef as f32;
        run_parallel(grads.chunks_mut(c), |chunk| {
            chunk.iter_mut().for_each(|g| *g *= coef);
        });
    }
    norm
}

/// Multiplies `grads` by `inv_scale` (when given, as the on-device `g · (1/scale)` does) and
/// reports whether every element is finite.
pub fn unscale_and_check(grads: &mut [f32], inv_scale: Option<f32>, threads: usize) -> bool {
    let c = chunk_len(grads.len(), threads);
    let finite = std::sync::atomic::AtomicBool::new(true);
    run_parallel(grads.chunks_mut(c), |chunk| {
        if let Some(inv) = inv_scale {
            chunk.iter_mut().for_each(|g| *g = *g * inv + 0.0);
        }
        if !chunk.iter().all(|g| g.is_finite()) {
            finite.store(false, std::sync::atomic::Ordering::Relaxed);
        }
    });
    finite.into_inner()
}

/// The constants of one Adam step, rounded to f32 exactly as candle rounds scalar operands.
#[derive(Debug, Clone, Copy)]
pub struct AdamConsts {
    b1: f32,
    c1: f32,
    b2: f32,
    c2: f32,
    inv_sqrt_bias2: f32,
    eps: f32,
    step_size: f32,
    /// Decoupled decay factor `1 − lr·wd` (AdamW).
    decay: Option<f32>,
    /// L2 coefficient folded into the gradient (Adam).
    l2: Option<f32>,
}

impl AdamConsts {
    /// Constants for update number `t` (1-based).
    pub fn new(o: &OptimizerSpec, t: u64) -> Self {
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bias1 = 1.0 - o.beta1.powi(t);
        let bias2 = 1.0 - o.beta2.powi(t);
        Self {
            b1: o.beta1 as f32,
            c1: (1.0 - o.beta1) as f32,
            b2: o.beta2 as f32,
            c2: (1.0 - o.beta2) as f32,
            inv_sqrt_bias2: (1.0 / bias2.sqrt()) as f32,
            eps: o.eps as f32,
            step_size: (o.lr / bias1) as f32,
            decay: (o.kind == OptimizerKind::AdamW && o.weight_decay > 0.0)
                .then_some((1.0 - o.lr * o.weight_decay) as f32),
            l2: (o.kind == OptimizerKind::Adam && o.weight_decay > 0.0)
                .then_some(o.weight_decay as f32),
        }
    }
}

impl AdamConsts {
    /// The gradient Adam sees: with L2 decay (Adam) `g + wd·θ`.
    #[inline(always)]
    fn decayed_grad(&self, theta: f32, g: f32) -> f32 {
        match self.l2 {
            Some(wd) => g + (theta * wd + 0.0),
            None => g,
        }
    }

    /// The next first moment.
    #[inline(always)]
    pub fn first_moment(&self, theta: f32, m: f32, g: f32) -> f32 {
        let g = self.decayed_grad(theta, g);
        (m * self.b1 + 0.0) + (g * self.c1 + 0.0)
    }

    /// The next second moment.
    #[inline(always)]
    pub fn second_moment(&self, theta: f32, v: f32, g: f32) -> f32 {
        let g = self.decayed_grad(theta, g);
        (v * self.b2 + 0.0) + ((g * g) * self.c2 + 0.0)
    }

    /// The next weight from the next moments.
    #[inline(always)]
    pub fn apply(&self, theta: f32, m: f32, v: f32) -> f32 {
        let denom = (v.sqrt() * self.inv_sqrt_bias2 + 0.0) + self.eps;
        let update = (m / denom) * self.step_size + 0.0;
        let decayed = match self.decay {
            Some(d) => theta * d + 0.0,
            None => theta,
        };
        decayed - update
    }

    /// The constants as the CUDA kernels take them: `[b1, c1, b2, c2, inv_sqrt_bias2, eps,
    /// step_size, decay (1 if none), l2 (0 if none)]`.
    pub fn packed(&self) -> [f32; 9] {
        [
            self.b1,
            self.c1,
            self.b2,
            self.c2,
            self.inv_sqrt_bias2,
            self.eps,
            self.step_size,
            self.decay.unwrap_or(1.0),
            self.l2.unwrap_or(0.0),
        ]
    }
}

/// The flat optimizer state a step updates in place, and the gradients it reads: f32 sums, or
/// one micro-batch's gradients in their own dtype (bf16, f16 and f32 all convert to f32
/// exactly, as the sums' first micro-batch does).
pub struct HostState<'a, G = f32> {
    /// f32 master weights.
    pub master: &'a mut [f32],
    /// First moments.
    pub first: &'a mut [f32],
    /// Second moments.
    pub second: &'a mut [f32],
    /// Unscaled gradients.
    pub grads: &'a [G],
}

/// Applies one fused Adam step to every element and, when `working` is given, writes the new
/// weights' half-precision working copy in the same pass, on the widest lanes the CPU has.
pub fn adam_step<T: HostFloat, G: HostFloat>(
    c: &AdamConsts,
    state: HostState<'_, G>,
    working: Option<&mut [T]>,
    threads: usize,
) {
    adam_step_on(Lanes::detect(), c, state, working, threads)
}

/// [`adam_step`] on `lanes`, or on the portable loop where the CPU lacks them: for comparing
/// the variants, which are bit-identical.
pub fn adam_step_on<T: HostFloat, G: HostFloat>(
    lanes: Lanes,
    c: &AdamConsts,
    state: HostState<'_, G>,
    working: Option<&mut [T]>,
    threads: usize,
) {
    let lanes = lanes.or_portable();
    let n = state.master.len();
    assert!(
        state.first.len() == n && state.second.len() == n && state.grads.len() == n,
        "optimizer buffers differ in length"
    );
    let len = chunk_len(n, threads);
    let working: Vec<Option<&mut [T]>> = match working {
        Some(w) => {
            assert_eq!(w.len(), n, "working copies differ in length");
            w.chunks_mut(len).map(Some).collect()
        }
        None => (0..n.div_ceil(len)).map(|_| None).collect(),
    };
    let chunks = state
        .master
        .chunks_mut(len)
        .zip(state.first.chunks_mut(len))
        .zip(state.second.chunks_mut(len))
        .zip(state.grads.chunks(len))
        .zip(working);
    run_parallel(chunks, |((((theta, m), v), g), w)| match w {
        Some(w) => lanes::adam_chunk::<G, T, _>(lanes, c, theta, m, v, g, w),
        None => lanes::adam_chunk::<G, T, _>(lanes, c, theta, m, v, g, lanes::Nowhere),
    });
}

/// Writes the half-precision working copy of `master` into `working`.
pub fn fill_working<T: HostFloat>(master: &[f32], working: &mut [T], threads: usize) {
    let c = chunk_len(master.len(), threads);
    run_parallel(working.chunks_mut(c).zip(master.chunks(c)), |(w, m)| {
        w.iter_mut().zip(m).for_each(|(w, &x)| *w = T::from_f32(x));
    });
}

#[cfg(test)]
mod tests {
    use candle_core::backend::BackendDevice;
    use candle_core::cpu_backend::CpuDevice;
    use candle_core::{CpuStorage, DType, Device, Shape, Tensor};
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Bits of `values` cast by candle to `dtype` and back to f32 (NaNs collapse to one).
    fn candle_cast(values: &[f32], dtype: DType) -> Vec<u32> {
        let t = Tensor::from_slice(values, values.len(), &Device::Cpu).unwrap();
        let back: Vec<f32> = t
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        back.iter()
            .map(|x| if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() })
            .collect()
    }

    fn ours(values: &[f32], dtype: DType) -> Vec<u32> {
        let mut staging = CpuDevice
            .zeros_impl(&Shape::from(values.len()), dtype)
            .unwrap();
        let t = match &mut staging {
            CpuStorage::BF16(w) => {
                fill_working(values, w, 4);
                Tensor::from_slice(w, values.len(), &Device::Cpu)
            }
            CpuStorage::F16(w) => {
                fill_working(values, w, 4);
                Tensor::from_slice(w, values.len(), &Device::Cpu)
            }
            _ => unreachable!("half dtypes only"),
        };
        let back: Vec<f32> = t.unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        back.iter()
            .map(|x| if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() })
            .collect()
    }

    #[test]
    fn half_conversion_matches_candle_casts_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // Random bit patterns cover every exponent, subnormals, infinities and NaNs; the
        // explicit values are ties and near-ties at both precisions.
        let mut values: Vec<f32> = (0..400_000).map(|_| f32::from_bits(rng.random())).collect();
        for base in [1.0f32, 3.0, 65504.0, 6.1e-5, 1e-7] {
            let b = base.to_bits();
            for delta in [
                0x7FFF, 0x8000, 0x8001, 0x8004, 0x1000, 0x1001, 0x1004, 0x3000, 0x3001,
            ] {
                values.push(f32::from_bits((b & !0xFFFF) | delta));
                values.push(-f32::from_bits((b & !0x1FFF) | (delta & 0x1FFF)));
            }
        }
        values.extend([
            0.0,
            -0.0,
            65520.0,
            65519.99,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
        ]);
        for dtype in [DType::BF16, DType::F16] {
            assert!(
                ours(&values, dtype) == candle_cast(&values, dtype),
                "{dtype:?} differs"
            );
        }
    }

    /// One Adam step for one element, the scalar reference the vectorised passes must equal.
    ///
    /// Each line mirrors one tensor op of the on-device optimizer (`train::optimizer::adam::Adam::step`,
    /// which runs above this layer): candle computes a
    /// tensor–scalar op as `x·mul + add` in f32 (so `x · s` is `x·s + 0`, which turns −0 into +0),
    /// and mirroring that keeps the two optimizers bit-identical on the CPU.
    fn adam_element(c: &AdamConsts, theta: &mut f32, m: &mut f32, v: &mut f32, g: f32) {
        let m_next = c.first_moment(*theta, *m, g);
        let v_next = c.second_moment(*theta, *v, g);
        *theta = c.apply(*theta, m_next, v_next);
        *m = m_next;
        *v = v_next;
    }

    /// Every vector width gives the scalar reference's bits, for every decay variant and
    /// element type, on values that include zeros of both signs, subnormals and large ones.
    #[test]
    fn every_lane_width_equals_the_scalar_step() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let n = 300_001;
        let mut special = vec![0.0f32, -0.0, 1e-40, -1e-40, 3e38, -1.0, 65504.0];
        let pick = |rng: &mut rand_chacha::ChaCha8Rng, special: &mut Vec<f32>, scale: f32| {
            if rng.random::<u8>() < 8 {
                special[rng.random_range(0..special.len())]
            } else {
                (rng.random::<f32>() - 0.5) * scale
            }
        };
        let theta0: Vec<f32> = (0..n).map(|_| pick(&mut rng, &mut special, 2.0)).collect();
        let m0: Vec<f32> = (0..n).map(|_| pick(&mut rng, &mut special, 0.1)).collect();
        let v0: Vec<f32> = (0..n)
            .map(|_| pick(&mut rng, &mut special, 0.01).abs())
            .collect();
        let g32: Vec<f32> = (0..n).map(|_| pick(&mut rng, &mut special, 0.2)).collect();
        let g16: Vec<half::bf16> = g32.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let mut specs = vec![OptimizerSpec::adamw(1e-3), OptimizerSpec::adamw(1e-3)];
        specs[1].weight_decay = 0.0;
        let mut adam = OptimizerSpec::adamw(1e-3);
        adam.kind = OptimizerKind::Adam;
        adam.weight_decay = 0.01;
        specs.push(adam);
        for spec in &specs {
            let c = AdamConsts::new(spec, 7);
            let reference = |grads: &dyn Fn(usize) -> f32| {
                let (mut t, mut m, mut v) = (theta0.clone(), m0.clone(), v0.clone());
                for j in 0..n {
                    adam_element(&c, &mut t[j], &mut m[j], &mut v[j], grads(j));
                }
                (t, m, v)
            };
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let want_16 = reference(&|j| g16[j].to_f32());
            let want_32 = reference(&|j| g32[j]);
            for lanes in [Lanes::Portable, Lanes::Avx2, Lanes::Avx512] {
                let (mut t, mut m, mut v) = (theta0.clone(), m0.clone(), v0.clone());
                let mut w = vec![half::bf16::ZERO; n];
                let state = HostState {
                    master: &mut t,
                    first: &mut m,
                    second: &mut v,
                    grads: &g16,
                };
                adam_step_on(lanes, &c, state, Some(&mut w), 3);
                assert!(bits(&t) == bits(&want_16.0), "{lanes:?} {spec:?}: weights");
                assert!(bits(&m) == bits(&want_16.1), "{lanes:?}: first moments");
                assert!(bits(&v) == bits(&want_16.2), "{lanes:?}: second moments");
                let cast: Vec<u16> = t
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                assert!(cast == w.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                let (mut t, mut m, mut v) = (theta0.clone(), m0.clone(), v0.clone());
                let state = HostState {
                    master: &mut t,
                    first: &mut m,
                    second: &mut v,
                    grads: &g32,
                };
                adam_step_on::<f32, f32>(lanes, &c, state, None, 2);
                assert!(
                    bits(&t) == bits(&want_32.0),
                    "{lanes:?} {spec:?}: f32 weights"
                );
                assert!(
                    bits(&v) == bits(&want_32.2),
                    "{lanes:?}: f32 second moments"
                );
            }
        }
    }

    #[test]
    fn accumulate_assigns_then_adds_and_unscale_finds_overflow() {
        let mut dst = vec![7.0f32; 200_000];
        let src = vec![1.5f32; 200_000];
        accumulate(&mut dst, &src, true, 4);
        accumulate(&mut dst, &src, false, 4);
        assert!(dst.iter().all(|&x| x == 3.0));
        assert!(unscale_and_check(&mut dst, Some(0.5), 4));
        assert!(dst.iter().all(|&x| x == 1.5));
        dst[123_456] = f32::INFINITY;
        assert!(!unscale_and_check(&mut dst, None, 4));
    }
}
