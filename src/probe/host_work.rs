//! The host optimizer's speed on this machine: a floor under the host work an offloaded step
//! adds, measured in a fraction of a second before a search.
//!
//! An offloaded step copies every gradient to the host, runs Adam there over the f32 masters
//! and moments, and uploads the new working copies ([`crate::train::optimizer::offload`]). The update
//! alone, [`host_optim::adam_step`] over every parameter, is a part of that work that no batch
//! size amortises. Timing it here on a sample lets the search rule out an offloaded regime
//! without a trial when even this part makes it slower than a setting already measured (an
//! offloaded gpt-124m trial costs about 4 s, most of it host work).

use std::time::Instant;

use crate::ops::host_optim::{self, AdamConsts, HostState};
use crate::spec::model::OptimizerSpec;

/// Elements of the smaller of the two timed samples. Large enough to leave the caches, as the
/// real buffers do (the larger sample is twice this: 4 f32 buffers, 128 MiB).
const SAMPLE: usize = 4 << 20;

/// Repetitions per sample size; the fastest counts (noise only ever adds time).
const REPEATS: usize = 3;

/// Seconds a host Adam update of `parameters` elements takes at the least on this machine, on
/// the threads an offloaded step uses. `None` for no parameters.
///
/// The time per element, times `parameters`: see `per_element_floor_s`. Both samples are
/// smaller than a model's buffers and sit closer in memory, so the estimate errs low, as a
/// floor must.
pub fn adam_update_floor_s(parameters: usize) -> Option<f64> {
    if parameters == 0 {
        return None;
    }
    let small = fastest_update_s(SAMPLE);
    let large = fastest_update_s(2 * SAMPLE);
    Some(per_element_floor_s(small, large, SAMPLE) * parameters as f64)
}

/// Seconds per element from the fastest update of `n` elements (`small_s`) and of `2n`
/// (`large_s`): the smaller of the difference per added element (thread start-up and other
/// fixed costs cancel in it) and the larger sample's time per element (which holds when noise
/// makes the difference meaningless).
fn per_element_floor_s(small_s: f64, large_s: f64, n: usize) -> f64 {
    let n = n as f64;
    let whole = large_s / (2.0 * n);
    let added = (large_s - small_s) / n;
    if added > 0.0 { added.min(whole) } else { whole }.max(0.0)
}

/// The fastest of [`REPEATS`] timed updates of `n` elements, after one untimed update that
/// touches every page.
fn fastest_update_s(n: usize) -> f64 {
    let spec = OptimizerSpec::adamw(1e-4);
    let mut master = vec![0.01f32; n];
    let mut first = vec![0f32; n];
    let mut second = vec![0f32; n];
    let grads = vec![1e-3f32; n];
    let threads = crate::parallel::default_threads();
    let mut fastest = f64::INFINITY;
    for step in 1..=REPEATS as u64 + 1 {
        let consts = AdamConsts::new(&spec, step);
        let state = HostState {
            master: &mut master,
            first: &mut first,
            second: &mut second,
            grads: &grads,
        };
        let started = Instant::now();
        // Without the half-precision copy a real step also writes: less work, still a floor.
        host_optim::adam_step::<f32, f32>(&consts, state, None, threads);
        if step > 1 {
            fastest = fastest.min(started.elapsed().as_secs_f64());
        }
    }
    fastest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_per_element_floor_takes_out_fixed_costs_and_survives_noise() {
        // (small_s, large_s, n, expected seconds per element)
        let table = [
            // 1 ms of fixed cost plus 1 µs per element: the difference shows the 1 µs.
            (0.001 + 1e-6 * 1000.0, 0.001 + 1e-6 * 2000.0, 1000, 1e-6),
            // No fixed cost: both agree.
            (0.5, 1.0, 1_000_000, 0.5e-6),
            // Noise made the smaller sample slower: the larger one's own rate.
            (2.0, 1.0, 1_000_000, 0.5e-6),
            // A difference above the larger sample's rate (noise again) is capped by it.
            (0.1, 1.0, 1_000_000, 0.5e-6),
        ];
        for (small, large, n, want) in table {
            let got = per_element_floor_s(small, large, n);
            assert!(
                (got - want).abs() < 1e-12,
                "{small} {large} {n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn the_measured_floor_is_a_positive_time_for_some_parameters() {
        let floor = adam_update_floor_s(1_000_000).expect("some parameters");
        assert!(floor.is_finite() && floor > 0.0, "{floor}");
        assert_eq!(adam_update_floor_s(0), None);
    }
}
