//! How long a trial in another process may run before it is stopped as timed out.
//!
//! A hung kernel or collective would otherwise hang the whole search. The limit is scaled from
//! what the prober's own trials have shown: the slowest step time per sequence seen so far,
//! times the sequences and steps the next trial runs, plus the slowest setup seen, with a
//! generous factor and floor, since settings differ (checkpointing recomputes, offload adds
//! host work, a larger batch may fall off a cache). Until a trial has fitted, the limit is
//! [`TrialTimeout::FIRST_TRIALS`]: the first one also pays a process start, a CUDA context and
//! kernel loads. `tune --trial-timeout` sets one limit for every trial instead.

use std::time::Duration;

use crate::trial::{Outcome, TrialRequest, TrialResult};

/// The time limit of each trial: fixed, or scaled from the trials seen so far.
#[derive(Debug, Clone)]
pub struct TrialTimeout {
    fixed: Option<Duration>,
    /// The slowest step time per sequence (micro-batch × accumulation) of a fitted trial.
    step_s_per_sequence: Option<f64>,
    /// The slowest time a fitted trial spent outside its steps (setup, evaluation, save).
    overhead_s: f64,
}

impl TrialTimeout {
    /// The limit before any trial has fitted.
    pub const FIRST_TRIALS: Duration = Duration::from_secs(900);
    /// How many times its expected duration a trial may take.
    pub const FACTOR: f64 = 10.0;
    /// The least limit a scaled trial gets.
    pub const FLOOR: Duration = Duration::from_secs(120);

    /// Limits scaled from the trials observed.
    pub fn scaled() -> Self {
        Self {
            fixed: None,
            step_s_per_sequence: None,
            overhead_s: 0.0,
        }
    }

    /// The same limit for every trial.
    pub fn fixed(limit: Duration) -> Self {
        Self {
            fixed: Some(limit),
            ..Self::scaled()
        }
    }

    /// The limit for `request`.
    pub fn limit(&self, request: &TrialRequest) -> Duration {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        let Some(per_sequence) = self.step_s_per_sequence else {
            return Self::FIRST_TRIALS;
        };
        let knobs = request.knobs;
        let sequences = knobs.per_rank_batch() as f64;
        // The evaluation pass and the checkpoint dry run cost about a step each.
        let steps = (request.warmup_steps + request.timed_steps + 2) as f64;
        let expected = self.overhead_s + steps * sequences * per_sequence;
        let scaled = Self::FACTOR * expected;
        if scaled.is_finite() && scaled < Self::FIRST_TRIALS.as_secs_f64() * 100.0 {
            Duration::from_secs_f64(scaled).max(Self::FLOOR)
        } else {
            Self::FIRST_TRIALS * 100
        }
    }

    /// Learns from a finished trial.
    pub fn observe(&mut self, result: &TrialResult) {
        let Outcome::Fits(m) = &result.outcome else {
            return;
        };
        let sequences = result.request.knobs.per_rank_batch().max(1) as f64;
        let steps = (result.request.warmup_steps + result.request.timed_steps) as f64;
        let per_sequence = m.step_time_median_s / sequences;
        if per_sequence.is_finite() && per_sequence >= 0.0 {
            let slowest = self
                .step_s_per_sequence
                .map_or(per_sequence, |s| s.max(per_sequence));
            self.step_s_per_sequence = Some(slowest);
        }
        let overhead = result.wall_s - steps * m.step_time_median_s;
        if overhead.is_finite() {
            self.overhead_s = self.overhead_s.max(overhead);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Knobs, Precision};
    use crate::trial::Measurement;

    fn request(micro_batch: usize) -> TrialRequest {
        TrialRequest {
            knobs: Knobs::new(micro_batch, Precision::Fp32),
            warmup_steps: 1,
            timed_steps: 3,
            remeasure: false,
        }
    }

    #[test]
    fn limits_scale_with_the_slowest_trial_seen_and_the_next_trials_work() {
        let mut timeout = TrialTimeout::scaled();
        assert_eq!(timeout.limit(&request(8)), TrialTimeout::FIRST_TRIALS);
        timeout.observe(&TrialResult {
            request: request(4),
            outcome: Outcome::Fits(Measurement {
                peak_gpu_bytes: 0,
                peak_host_bytes: 0,
                step_time_median_s: 8.0,
                step_time_spread: 0.0,
                timed_steps: 3,
                tokens_per_s: 1.0,
                host_link: None,
            }),
            wall_s: 40.0,
        });
        // 2 s per sequence, 8 s outside the steps: 64 sequences × 6 steps take about 776 s.
        let limit = timeout.limit(&request(64)).as_secs_f64();
        assert!((limit - 7_760.0).abs() < 1e-6, "{limit}");
        assert_eq!(timeout.limit(&request(1)).as_secs_f64(), 200.0);
        let fixed = TrialTimeout::fixed(Duration::from_secs(5));
        assert_eq!(fixed.limit(&request(1024)), Duration::from_secs(5));
    }
}
