//! The compact update on host slices: the reference the CUDA kernel (`kernels/compact_adam.cu`)
//! matches element for element, and what a CPU device trains with.

use half::bf16;

use super::quantile::{quantize, CODES};
use super::{random_bits, round_stochastic, BLOCK};
use crate::knobs::MasterFormat;
use crate::ops::host_optim::AdamConsts;

/// A weight element type: f32 masters, or bf16 ones.
pub trait Weight: Copy {
    /// The value in f32.
    fn to_f32(self) -> f32;
    /// `x` rounded to nearest even.
    fn from_f32(x: f32) -> Self;
}

impl Weight for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Weight for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// One tensor's moments, borrowed mutably in their storage format.
pub enum MomentsMut<'a> {
    /// Exact moments.
    F32(&'a mut [f32], &'a mut [f32]),
    /// bf16 moments.
    Bf16(&'a mut [bf16], &'a mut [bf16]),
    /// 8-bit codes and one scale per [`BLOCK`] elements, for each moment.
    Int8 {
        /// First-moment codes (signed map).
        m: &'a mut [u8],
        /// Second-moment codes (unsigned map).
        v: &'a mut [u8],
        /// First-moment block scales.
        m_scale: &'a mut [f32],
        /// Second-moment block scales.
        v_scale: &'a mut [f32],
    },
}

/// The two quantile maps.
pub struct Maps {
    /// For the first moment, over [−1, 1].
    pub signed: [f32; CODES],
    /// For the second moment, over [0, 1].
    pub unsigned: [f32; CODES],
}

/// One Adam update of the weights `w` with gradient `g` (unscaled, averaged; f32, which holds
/// a bf16 gradient exactly) over compact
/// state, in blocks of [`BLOCK`] elements: each block's moments are read from their format,
/// updated in f32, applied to the weights, and stored back (8-bit codes scaled by the block's
/// new largest magnitude). `comp` is the Kahan compensation with [`MasterFormat::Bf16Kahan`];
/// `seed` draws the stochastic rounding with [`MasterFormat::Bf16Stochastic`].
#[allow(clippy::too_many_arguments)]
pub fn update<W: Weight>(
    w: &mut [W],
    g: &[f32],
    moments: MomentsMut<'_>,
    comp: Option<&mut [bf16]>,
    masters: MasterFormat,
    k: &AdamConsts,
    maps: &Maps,
    seed: u64,
) {
    update_in_blocks(BLOCK, w, g, moments, comp, masters, k, maps, seed);
}

/// [`update`] with quantisation blocks of `block` elements (at most [`BLOCK`]): bitsandbytes'
/// optimizers use 256, which the tests compare against.
#[allow(clippy::too_many_arguments)]
pub fn update_in_blocks<W: Weight>(
    block: usize,
    w: &mut [W],
    g: &[f32],
    mut moments: MomentsMut<'_>,
    mut comp: Option<&mut [bf16]>,
    masters: MasterFormat,
    k: &AdamConsts,
    maps: &Maps,
    seed: u64,
) {
    assert!((1..=BLOCK).contains(&block), "a block of {block} elements");
    let n = w.len();
    let mut m_new = [0f32; BLOCK];
    let mut v_new = [0f32; BLOCK];
    for (b, start) in (0..n).step_by(block).enumerate() {
        let end = (start + block).min(n);
        for i in start..end {
            let (m0, v0) = moments.read(i, b, maps);
            let theta = w[i].to_f32();
            let gi = g[i];
            let m1 = k.first_moment(theta, m0, gi);
            let v1 = k.second_moment(theta, v0, gi);
            let next = k.apply(theta, m1, v1);
            w[i] = match masters {
                MasterFormat::F32 => W::from_f32(next),
                MasterFormat::Bf16Stochastic => {
                    W::from_f32(round_stochastic(next, random_bits(seed, i as u64)))
                }
                MasterFormat::Bf16Kahan => {
                    let c = comp
                        .as_deref_mut()
                        .expect("Kahan masters carry a compensation");
                    let (stored, lost) = kahan(theta, next, c[i].to_f32());
                    c[i] = bf16::from_f32(lost);
                    W::from_f32(stored)
                }
            };
            m_new[i - start] = m1;
            v_new[i - start] = v1;
        }
        let len = end - start;
        moments.store(b, start, &m_new[..len], &v_new[..len], maps);
    }
}

impl MomentsMut<'_> {
    /// Element `i`'s moments (of block `b`) in f32.
    #[inline]
    fn read(&self, i: usize, b: usize, maps: &Maps) -> (f32, f32) {
        match self {
            MomentsMut::F32(m, v) => (m[i], v[i]),
            MomentsMut::Bf16(m, v) => (m[i].to_f32(), v[i].to_f32()),
            MomentsMut::Int8 {
                m,
                v,
                m_scale,
                v_scale,
            } => (
                maps.signed[m[i] as usize] * m_scale[b],
                maps.unsigned[v[i] as usize] * v_scale[b],
            ),
        }
    }

    /// Stores block `b`'s new moments `m_new`, `v_new` (its elements from `start` on) in
    /// their format: 8-bit codes scaled by the block's largest magnitude.
    fn store(&mut self, b: usize, start: usize, m_new: &[f32], v_new: &[f32], maps: &Maps) {
        let len = m_new.len();
        let end = start + len;
        match self {
            MomentsMut::F32(m, v) => {
                m[start..end].copy_from_slice(m_new);
                v[start..end].copy_from_slice(v_new);
            }
            MomentsMut::Bf16(m, v) => {
                for j in 0..len {
                    m[start + j] = bf16::from_f32(m_new[j]);
                    v[start + j] = bf16::from_f32(v_new[j]);
                }
            }
            MomentsMut::Int8 {
                m,
                v,
                m_scale,
                v_scale,
            } => {
                let sm = m_new.iter().fold(0f32, |a, x| a.max(x.abs()));
                let sv = v_new.iter().fold(0f32, |a, x| a.max(x.abs()));
                m_scale[b] = sm;
                v_scale[b] = sv;
                for j in 0..len {
                    m[start + j] = quantize(&maps.signed, normalised(m_new[j], sm));
                    v[start + j] = quantize(&maps.unsigned, normalised(v_new[j], sv));
                }
            }
        }
    }
}

/// `x / scale`, or 0 for an all-zero block.
#[inline]
pub fn normalised(x: f32, scale: f32) -> f32 {
    if scale > 0.0 {
        x / scale
    } else {
        0.0
    }
}

/// Kahan-compensated bf16 master: the step from `theta` to `next` plus what earlier roundings
/// lost (`carried`), rounded to bf16; returns the value to store (exactly representable in
/// bf16) and what this rounding lost.
#[inline]
pub fn kahan(theta: f32, next: f32, carried: f32) -> (f32, f32) {
    let step = (next - theta) + carried;
    let stored = bf16::from_f32(theta + step).to_f32();
    let lost = step - (stored - theta);
    (stored, lost)
}
