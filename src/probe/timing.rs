//! When a trial has timed enough steps.
//!
//! A trial asks for a number of timed steps; a large model's step takes seconds, and when its
//! first steps already agree, more of them only cost time (the search of gpt-1.3b runs tens of
//! trials). So timing stops early once at least [`MIN_STEPS`] steps took [`LONG_S`] together
//! and their spread is at most [`AGREEING_SPREAD`]; short or noisy steps run every step asked
//! for.

/// The fewest timed steps that give a median and a spread.
pub const MIN_STEPS: usize = 2;

/// Timed seconds after which agreeing steps are enough.
pub const LONG_S: f64 = 2.0;

/// The spread, `(max − min) / median`, under which steps agree.
pub const AGREEING_SPREAD: f64 = 0.03;

/// Whether `times` (the timed steps so far, seconds) suffice for a trial that asked for
/// `wanted` timed steps.
pub fn timing_done(times: &[f64], wanted: usize) -> bool {
    if times.len() >= wanted {
        return true;
    }
    if times.len() < MIN_STEPS || times.iter().sum::<f64>() < LONG_S {
        return false;
    }
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    median > 0.0 && (sorted[sorted.len() - 1] - sorted[0]) / median <= AGREEING_SPREAD
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_agreeing_steps_stop_early_and_the_rest_run_as_asked() {
        // (timed steps so far, wanted, done)
        let table: [(&[f64], usize, bool); 8] = [
            (&[], 3, false),
            (&[0.1, 0.1, 0.1], 3, true),
            (&[0.1, 0.1], 3, false),
            // Long and agreeing: two are enough.
            (&[1.2, 1.21], 3, true),
            // Long but one alone.
            (&[2.5], 3, false),
            // Long but disagreeing by 10 %.
            (&[1.2, 1.32], 3, false),
            // Agreeing but short together.
            (&[0.9, 0.9], 6, false),
            (&[1.2, 1.32, 1.25], 3, true),
        ];
        for (times, wanted, done) in table {
            assert_eq!(timing_done(times, wanted), done, "{times:?} of {wanted}");
        }
    }
}
