//! The 256-value dynamic quantile maps of bitsandbytes' 8-bit optimizers, and quantisation to
//! them.
//!
//! A map covers [−1, 1] (signed, for the first moment) or [0, 1] (unsigned, for the second)
//! with values spaced per decade: for each exponent `e` from −6 to 0 it holds the midpoints of
//! an even split of [0.1, 1] scaled by 10^e, twice as many per decade as the one below. So
//! small normalised moments keep about as many significant digits as large ones, which a linear
//! 8-bit code would flush to zero. The construction follows `create_dynamic_map` (signed, 7
//! exponent decades, 8 bits) step by step in f32, as PyTorch computes it.

/// Codes per map.
pub const CODES: usize = 256;

/// Decades below 1 that a map spans.
const DECADES: i32 = 7;

/// The map's values, ascending: for `signed`, ± the scaled midpoints, 0 and 1; otherwise the
/// scaled midpoints (twice as many per decade), 0 and 1.
///
/// The values are bitsandbytes' own (its `create_dynamic_map` as PyTorch computes it in f32,
/// bit patterns below): a recomputation rounds some midpoints differently by a unit or two in
/// the last place, and the codes must mean exactly what bitsandbytes' codes mean.
/// [`construction`] derives them, and a test checks the tables against it.
pub fn dynamic_map(signed: bool) -> [f32; CODES] {
    let bits = if signed { &SIGNED_BITS } else { &UNSIGNED_BITS };
    bits.map(f32::from_bits)
}

/// The construction of the maps in f64, rounded to f32 at the end.
pub fn construction(signed: bool) -> [f32; CODES] {
    let mut data: Vec<f32> = Vec::with_capacity(CODES);
    for i in 0..DECADES {
        let items = if signed {
            (1usize << i) + 1
        } else {
            (1usize << (i + 1)) + 1
        };
        let bound = |j: usize| 0.1 + 0.9 * j as f64 / (items - 1) as f64;
        let scale = 10f64.powi(i - (DECADES - 1));
        for j in 0..items - 1 {
            let value = (scale * (bound(j) + bound(j + 1)) / 2.0) as f32;
            data.push(value);
            if signed {
                data.push(-value);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.resize(CODES, 0.0);
    data.sort_by(f32::total_cmp);
    let mut out = [0.0; CODES];
    out.copy_from_slice(&data);
    out
}

const SIGNED_BITS: [u32; CODES] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

const UNSIGNED_BITS: [u32; CODES] = [
    0x00000000, 0x34ae7baa, 0x35500998, 0x360e9b38, 0x3692ccf6, 0x36de4c51, 0x3714e5d5, 0x3783126e,
    0x37e171a0, 0x381fe868, 0x384f1800, 0x387e479a, 0x3896bb99, 0x38ae5364, 0x38c5eb31, 0x3906594b,
    0x394154ca, 0x397c5049, 0x399ba5e4, 0x39b923a2, 0x39d6a163, 0x39f41f22, 0x3a08ce71, 0x3a178d50,
    0x3a264c30, 0x3a350b10, 0x3a43c9ef, 0x3a5288d0, 0x3a6147af, 0x3a70068e, 0x3a7ec56e, 0x3a958106,
    0x3aba5e35, 0x3adf3b64, 0x3b020c4a, 0x3b147ae1, 0x3b26e978, 0x3b395810, 0x3b4bc6a7, 0x3b5e3540,
    0x3b70a3d7, 0x3b818937, 0x3b8ac082, 0x3b93f7cf, 0x3b9d2f1a, 0x3ba66666, 0x3baf9db2, 0x3bb8d4fd,
    0x3bc20c4a, 0x3bcb4395, 0x3bd47ae1, 0x3bddb22e, 0x3be6e978, 0x3bf020c5, 0x3bf9580f, 0x3c0147ae,
    0x3c05e354, 0x3c0a7ef9, 0x3c0f1aa0, 0x3c13b645, 0x3c1851eb, 0x3c1ced92, 0x3c218937, 0x3c2f5c2a,
    0x3c466667, 0x3c5d70a3, 0x3c747ae2, 0x3c85c28f, 0x3c9147af, 0x3c9ccccd, 0x3ca851eb, 0x3cb3d70b,
    0x3cbf5c29, 0x3ccae147, 0x3cd66667, 0x3ce1eb87, 0x3ced70a3, 0x3cf8f5c3, 0x3d023d70, 0x3d080000,
    0x3d0dc28f, 0x3d13851f, 0x3d1947af, 0x3d1f0a3d, 0x3d24cccd, 0x3d2a8f5c, 0x3d3051eb, 0x3d36147b,
    0x3d3bd70a, 0x3d41999a, 0x3d475c28, 0x3d4d1eb8, 0x3d52e147, 0x3d58a3d7, 0x3d5e6667, 0x3d6428f7,
    0x3d69eb87, 0x3d6fae15, 0x3d7570a3, 0x3d7b3333, 0x3d807ae2, 0x3d835c2a, 0x3d863d71, 0x3d891eb8,
    0x3d8c0000, 0x3d8ee148, 0x3d91c290, 0x3d94a3d7, 0x3d97851f, 0x3d9a6667, 0x3d9d47af, 0x3da028f6,
    0x3da30a3e, 0x3da5eb85, 0x3da8cccd, 0x3dabae15, 0x3dae8f5c, 0x3db170a4, 0x3db451eb, 0x3db73333,
    0x3dba147b, 0x3dbcf5c3, 0x3dbfd70b, 0x3dc2b852, 0x3dc5999a, 0x3dc87ae2, 0x3dcb5c29, 0x3dd40000,
    0x3de26666, 0x3df0cccd, 0x3dff3333, 0x3e06cccc, 0x3e0e0000, 0x3e153334, 0x3e1c6666, 0x3e23999a,
    0x3e2acccc, 0x3e320000, 0x3e393334, 0x3e406666, 0x3e47999a, 0x3e4ecccc, 0x3e560000, 0x3e5d3334,
    0x3e646666, 0x3e6b999a, 0x3e72cccc, 0x3e7a0000, 0x3e809999, 0x3e843333, 0x3e87cccd, 0x3e8b6666,
    0x3e8f0000, 0x3e92999a, 0x3e963333, 0x3e99cccc, 0x3e9d6666, 0x3ea10000, 0x3ea4999a, 0x3ea83333,
    0x3eabcccc, 0x3eaf6666, 0x3eb30000, 0x3eb6999a, 0x3eba3333, 0x3ebdcccc, 0x3ec16666, 0x3ec50000,
    0x3ec8999a, 0x3ecc3333, 0x3ecfcccc, 0x3ed36666, 0x3ed70000, 0x3eda999a, 0x3ede3333, 0x3ee1cccc,
    0x3ee56666, 0x3ee90000, 0x3eec999a, 0x3ef03333, 0x3ef3cccc, 0x3ef76666, 0x3efb0000, 0x3efe9999,
    0x3f01199a, 0x3f02e666, 0x3f04b333, 0x3f068000, 0x3f084ccc, 0x3f0a199a, 0x3f0be666, 0x3f0db334,
    0x3f0f8000, 0x3f114ccd, 0x3f13199a, 0x3f14e666, 0x3f16b334, 0x3f188000, 0x3f1a4ccd, 0x3f1c199a,
    0x3f1de666, 0x3f1fb334, 0x3f218000, 0x3f234ccd, 0x3f25199a, 0x3f26e666, 0x3f28b334, 0x3f2a8000,
    0x3f2c4ccd, 0x3f2e199a, 0x3f2fe666, 0x3f31b334, 0x3f338000, 0x3f354ccd, 0x3f37199a, 0x3f38e666,
    0x3f3ab334, 0x3f3c8000, 0x3f3e4ccd, 0x3f40199a, 0x3f41e666, 0x3f43b334, 0x3f458000, 0x3f474ccc,
    0x3f49199a, 0x3f4ae666, 0x3f4cb334, 0x3f4e8000, 0x3f504ccc, 0x3f52199a, 0x3f53e666, 0x3f55b334,
    0x3f578000, 0x3f594ccc, 0x3f5b199a, 0x3f5ce666, 0x3f5eb334, 0x3f608000, 0x3f624ccc, 0x3f64199a,
    0x3f65e666, 0x3f67b334, 0x3f698000, 0x3f6b4ccc, 0x3f6d199a, 0x3f6ee666, 0x3f70b334, 0x3f728000,
    0x3f744ccc, 0x3f76199a, 0x3f77e666, 0x3f79b334, 0x3f7b8000, 0x3f7d4ccc, 0x3f7f199a, 0x3f800000,
];

/// The code whose value is nearest `x` in the ascending `map` (the lower one on a tie).
#[inline]
pub fn quantize(map: &[f32; CODES], x: f32) -> u8 {
    // The last code whose value is at most x (0 below the map).
    let (mut lo, mut hi) = (0usize, CODES - 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if map[mid] <= x {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if lo + 1 < CODES && (map[lo + 1] - x).abs() < (x - map[lo]).abs() {
        lo += 1;
    }
    lo as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_are_the_construction_within_two_units_in_the_last_place() {
        for signed in [true, false] {
            for (a, b) in dynamic_map(signed).iter().zip(construction(signed).iter()) {
                assert!(a.to_bits().abs_diff(b.to_bits()) <= 2, "{a} vs {b}");
                assert_eq!(a.signum(), b.signum());
            }
        }
    }

    #[test]
    fn maps_are_sorted_and_span_their_range() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            assert!(map.windows(2).all(|w| w[0] <= w[1]), "sorted");
            assert_eq!(map[CODES - 1], 1.0);
            assert!(map.contains(&0.0));
            let lowest = if signed { -0.99 } else { 0.0 };
            assert!(map[0] <= lowest, "{}", map[0]);
            // Seven decades: the smallest non-zero magnitude is below 1e-6.
            let smallest = map
                .iter()
                .filter(|v| **v != 0.0)
                .map(|v| v.abs())
                .fold(f32::INFINITY, f32::min);
            assert!(smallest < 1e-6 && smallest > 1e-8, "{smallest}");
        }
        let signed = dynamic_map(true);
        // Symmetric around the one zero, except 1.0, which has no negative twin.
        let negatives = signed.iter().filter(|v| **v < 0.0).count();
        let positives = signed.iter().filter(|v| **v > 0.0).count();
        assert_eq!((negatives, positives), (127, 128));
    }

    #[test]
    fn quantize_picks_the_nearest_code() {
        let map = dynamic_map(true);
        for (i, &v) in map.iter().enumerate() {
            assert_eq!(
                map[quantize(&map, v) as usize],
                v,
                "code {i} maps to itself"
            );
        }
        for x in [-1.0f32, -0.37, -1e-5, 0.0, 3e-7, 0.0123, 0.5, 0.999, 1.0] {
            let q = map[quantize(&map, x) as usize];
            let best = map
                .iter()
                .map(|v| (v - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((q - x).abs(), best, "{x}");
        }
        // Out of range values clamp to the ends.
        assert_eq!(quantize(&map, 7.0), (CODES - 1) as u8);
        assert_eq!(quantize(&map, -7.0), 0);
    }
}
