//! Adam / AdamW over compact optimizer state: moments in f32, bf16 or 8-bit block-wise codes,
//! masters in f32 or in bf16 (Kahan-compensated or stochastically rounded). See
//! [`crate::knobs::StateLayout`] for the layouts and `autotune_core::spec::state` for their
//! bytes.
//!
//! [`cpu::update`] is the reference and what a CPU device runs; on CUDA one launch per tensor
//! (`update_cuda`) does the same arithmetic element by element, so the two agree bit for bit
//! (the tests compare them). The update reads the old moments, computes the new ones in f32,
//! applies them to the weights unrounded, and only then stores them in their format: bitsandbytes'
//! order, which keeps the step itself exact and confines the error to what the state remembers.

pub mod cpu;
#[cfg(feature = "cuda")]
mod gpu;
pub mod quantile;

/// Elements per quantisation block (and per CUDA block).
pub const BLOCK: usize = crate::knobs::INT8_BLOCK;

/// SplitMix64's finaliser over `seed` and element `i`: the bits that round element `i`
/// stochastically. Twin of `ca_random_bits` in `kernels/compact_adam.cu`.
#[inline]
pub fn random_bits(seed: u64, i: u64) -> u32 {
    let mut z = seed.wrapping_add((i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    z as u32
}

/// `x` rounded to a bf16 value (returned as f32) up or down, with the probability of each
/// proportional to how close it is: adding 16 random bits below bf16's last bit and truncating.
/// So the expected stored value is `x`, and updates smaller than half a bf16 step still move
/// the weight on average. Infinities and NaN round to nearest. Twin of `ca_round_stochastic`.
#[inline]
pub fn round_stochastic(x: f32, r: u32) -> f32 {
    let bits = x.to_bits();
    if bits & 0x7f80_0000 == 0x7f80_0000 {
        return half::bf16::from_f32(x).to_f32();
    }
    f32::from_bits(bits.wrapping_add(r & 0xffff) & 0xffff_0000)
}

/// The seed of the stochastic rounding of parameter `index` in optimizer step `step` of a run
/// seeded `seed`: distinct per step and tensor, reproducible on resume.
pub fn rounding_seed(seed: u64, step: u64, index: usize) -> u64 {
    random_bits(seed ^ 0xC0FF_EE00, step) as u64 | ((random_bits(seed, index as u64) as u64) << 32)
}

#[cfg(feature = "cuda")]
pub use gpu::{update_cuda, DeviceState, Mark, Stager};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stochastic_rounding_lands_on_a_neighbour_and_averages_to_the_value() {
        let x = 1.0f32 + 3.0 * 2f32.powi(-10); // between two bf16 values (step 2^-7)
        let below = half::bf16::from_f32(1.0).to_f32();
        let above = f32::from_bits(below.to_bits() + 0x1_0000);
        let n = 20_000u64;
        let mut sum = 0f64;
        for i in 0..n {
            let r = round_stochastic(x, random_bits(7, i));
            assert!(r == below || r == above, "{r}");
            sum += r as f64;
        }
        let mean = sum / n as f64;
        assert!((mean - x as f64).abs() < 2e-4, "{mean} vs {x}");
        assert_eq!(round_stochastic(f32::INFINITY, 5), f32::INFINITY);
        // A value bf16 holds exactly never moves; a negative one rounds away from zero or
        // towards it.
        assert_eq!(round_stochastic(-2.0, 0xffff_ffff), -2.0);
        let r = round_stochastic(-x, 0xffff_ffff);
        assert_eq!(r, -above);
        assert_eq!(round_stochastic(-x, 0), -below);
    }
}
