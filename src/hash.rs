//! The SplitMix64 finaliser: how the crate derives independent stream keys (data, dropout,
//! initialisation chunks) and hashes dropout-mask elements. `src/ops/kernels/epilogue.cu`
//! repeats it for the GPU masks.

/// The golden-ratio increment SplitMix64 adds per step; multiplying an index by it spreads
/// consecutive indices before mixing.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output mix of `z`: a bijection whose output bits each depend on every input bit.
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
