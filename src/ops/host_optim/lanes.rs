//! The host Adam pass's inner loop, written so that it vectorises, and compiled once per
//! instruction set the host may have.
//!
//! The portable build targets baseline x86-64 (SSE2: four lanes), so the same loop is also
//! compiled for AVX2 (eight) and AVX-512 (sixteen) and the widest the CPU has is picked at run
//! time. On a 16-core server the scalar loop, with `half`'s branchy conversions, was bound by
//! arithmetic, not memory: 1.7 s per gpt-1.3b step. Every lane computes exactly the scalar
//! operations in the same order (IEEE add, multiply, divide and square root round the same in
//! any lane, and Rust never fuses a multiply and an add), so all variants are bit-identical.

#![allow(unsafe_code)]

use half::{bf16, f16};

use super::AdamConsts;

/// A gradient or working-copy element, converted to and from f32 by its bits so that the
/// conversions vectorise.
pub trait HostFloat: Copy + Send + Sync {
    /// Exact widening.
    fn to_f32(self) -> f32;
    /// Rounded to nearest-even, exactly as candle's casts round.
    fn from_f32(x: f32) -> Self;
}

impl HostFloat for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl HostFloat for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        let bits = x.to_bits();
        // `half`'s rule, which candle's casts use: NaNs stay NaN (quieted), everything else
        // rounds to nearest-even, overflowing to infinity.
        let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
        let quiet = (bits >> 16) | 0x0040;
        bf16::from_bits((if nan { quiet } else { rounded }) as u16)
    }
}

impl HostFloat for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// Where a pass writes the new weights' working copies: a slice of them, or nowhere.
pub trait Working<T> {
    /// Stores element `j`.
    fn put(&mut self, j: usize, x: f32);
}

impl<T: HostFloat> Working<T> for &mut [T] {
    #[inline(always)]
    fn put(&mut self, j: usize, x: f32) {
        self[j] = T::from_f32(x);
    }
}

/// No working copy (an f32 working copy is the master itself).
pub struct Nowhere;

impl<T> Working<T> for Nowhere {
    #[inline(always)]
    fn put(&mut self, _: usize, _: f32) {}
}

/// One Adam step over a chunk, with the optional decay terms fixed at compile time so that
/// the loop has no branch. Each line mirrors one tensor op of the on-device optimizer: candle
/// computes a tensor–scalar op as `x·mul + add` in f32 (so `x · s` is `x·s + 0`, which turns −0
/// into +0), and mirroring that keeps the two optimizers bit-identical.
#[inline(always)]
fn chunk<G: HostFloat, T, W: Working<T>, const DECAY: bool, const L2: bool>(
    c: &AdamConsts,
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    mut w: W,
) {
    let n = theta.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
    let decay = c.decay.unwrap_or(1.0);
    let l2 = c.l2.unwrap_or(0.0);
    for j in 0..n {
        let t = theta[j];
        let gj = g[j].to_f32();
        let gd = if L2 { gj + (t * l2 + 0.0) } else { gj };
        let m_next = (m[j] * c.b1 + 0.0) + (gd * c.c1 + 0.0);
        let v_next = (v[j] * c.b2 + 0.0) + ((gd * gd) * c.c2 + 0.0);
        let denom = (v_next.sqrt() * c.inv_sqrt_bias2 + 0.0) + c.eps;
        let update = (m_next / denom) * c.step_size + 0.0;
        let decayed = if DECAY { t * decay + 0.0 } else { t };
        let next = decayed - update;
        theta[j] = next;
        m[j] = m_next;
        v[j] = v_next;
        w.put(j, next);
    }
}

/// [`chunk`] for this step's decay terms.
#[inline(always)]
fn any_decay<G: HostFloat, T, W: Working<T>>(
    c: &AdamConsts,
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    w: W,
) {
    match (c.decay.is_some(), c.l2.is_some()) {
        (false, false) => chunk::<G, T, W, false, false>(c, theta, m, v, g, w),
        (true, false) => chunk::<G, T, W, true, false>(c, theta, m, v, g, w),
        (false, true) => chunk::<G, T, W, false, true>(c, theta, m, v, g, w),
        (true, true) => chunk::<G, T, W, true, true>(c, theta, m, v, g, w),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn avx512<G: HostFloat, T, W: Working<T>>(
    c: &AdamConsts,
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    w: W,
) {
    any_decay::<G, T, W>(c, theta, m, v, g, w)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2<G: HostFloat, T, W: Working<T>>(
    c: &AdamConsts,
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    w: W,
) {
    any_decay::<G, T, W>(c, theta, m, v, g, w)
}

/// The widest vector unit this CPU has; ordered narrowest first, and a CPU with one has
/// every narrower one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lanes {
    /// The build's baseline.
    Portable,
    /// AVX2.
    Avx2,
    /// AVX-512F.
    Avx512,
}

impl Lanes {
    /// What this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// `lanes`, or the portable loop where this CPU lacks them.
    pub fn or_portable(self) -> Self {
        if self <= Self::detect() {
            self
        } else {
            Self::Portable
        }
    }
}

/// One Adam step over a chunk on `lanes` (which [`Lanes::or_portable`] checked).
#[inline(always)]
pub fn adam_chunk<G: HostFloat, T, W: Working<T>>(
    lanes: Lanes,
    c: &AdamConsts,
    theta: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    w: W,
) {
    match lanes {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `lanes` is AVX-512 only where the CPU has AVX-512F (`Lanes::or_portable`).
        Lanes::Avx512 => unsafe { avx512::<G, T, W>(c, theta, m, v, g, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2.
        Lanes::Avx2 => unsafe { avx2::<G, T, W>(c, theta, m, v, g, w) },
        _ => any_decay::<G, T, W>(c, theta, m, v, g, w),
    }
}
