//! Trials run again where their timing cannot settle a decision (see the driver's module docs,
//! "Noise"): which knobs to remeasure, and a history with every remeasurement pooled into the
//! search trial it repeats.

use std::collections::HashMap;

use super::{SearchDriver, Trials, RESOLUTION_GAIN};
use crate::knobs::Knobs;
use crate::search::decision::Candidate;
use crate::trial::{Measurement, Outcome, TrialResult, Z_95};

/// How often one search trial may be run again: four measurements of a setting, after which
/// the decision takes the pooled figures as they are.
pub const MAX_REMEASURES: usize = 3;

/// The most timed steps of one remeasurement, in search trials' timed steps: enough for a
/// CPU's scattered milliseconds-long steps, a bounded cost for a GPU's seconds-long ones (whose
/// steps scatter little, so they rarely need many).
const MAX_REMEASURE_STEPS_FACTOR: usize = 8;

/// Where a regime's growth stands ([`SearchDriver::saturation`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Saturation {
    /// A doubling gained more than the threshold beyond its noise: grow on.
    Growing,
    /// No doubling is shown to gain the threshold: stop. The larger of the two gains.
    Stopped { gain: f64 },
    /// A doubling's gain cannot be told from the threshold: run this trial again first.
    Remeasure(Remeasure),
}

/// A search trial to run again, with the timed steps it needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Remeasure {
    pub(super) knobs: Knobs,
    pub(super) timed_steps: usize,
}

/// How many times each search trial's knobs were run again.
pub(super) type Remeasures = HashMap<Knobs, usize>;

/// `history` with each remeasurement pooled into the search trial it repeats, at that trial's
/// position. The remeasurements stay in place (the driver skips them), so positions in the
/// pooled history are positions in the real one. A setting that fitted once and ran out of
/// memory (or crashed) when run again takes the failure: it is too close to a limit to plan on.
pub(super) fn pooled_history(history: &[TrialResult]) -> Vec<TrialResult> {
    let mut pooled = history.to_vec();
    let mut runs: HashMap<usize, Vec<&TrialResult>> = HashMap::new();
    for result in history.iter().filter(|r| r.request.remeasure) {
        let repeated = history
            .iter()
            .position(|r| !r.request.remeasure && r.request.knobs == result.request.knobs);
        if let Some(first) = repeated {
            runs.entry(first).or_default().push(result);
        }
    }
    for (first, again) in runs {
        let all: Vec<&TrialResult> = std::iter::once(&history[first]).chain(again).collect();
        let measurements: Vec<Measurement> = all
            .iter()
            .filter_map(|r| r.outcome.measurement().copied())
            .collect();
        let entry = &mut pooled[first];
        entry.wall_s = all.iter().map(|r| r.wall_s).sum();
        if let Some(failed) = all.iter().find(|r| r.outcome.measurement().is_none()) {
            entry.outcome = failed.outcome.clone();
        } else if let Some(pooled) = Measurement::pooled(&measurements) {
            entry.outcome = Outcome::Fits(pooled);
        }
    }
    pooled
}

/// How many times `knobs` has been run again.
fn runs(remeasures: &Remeasures, knobs: &Knobs) -> usize {
    remeasures.get(knobs).copied().unwrap_or(0)
}

/// Whether both of two settings have been run again. A difference beyond their tie band that
/// held through that is the device's, not one run's, and the premise that throughput does not
/// fall as the batch grows yields to it (near the memory boundary a larger batch can run
/// slower): on the harness on an H100, gpt-124m at 20 sequences measured 179k and 187k
/// tokens/s against 204k at 16 twice, and two more runs of each changed nothing.
fn both_run_again(remeasures: &Remeasures, a: &Knobs, b: &Knobs) -> bool {
    runs(remeasures, a) >= 1 && runs(remeasures, b) >= 1
}

/// Whether `slow` measured slower than `fast` beyond their tie band ([`tie_band`]).
pub(super) fn slower_beyond_band(slow: &Measurement, fast: &Measurement) -> bool {
    slow.tokens_per_s < fast.tokens_per_s * (1.0 - tie_band(fast, slow))
}

/// Whether `a` and `b` cannot be told apart: their throughputs differ by less than the 95 %
/// interval of the difference, and that interval is wider than the search's resolution (below
/// it a difference would not matter anyway).
pub(super) fn indistinguishable(a: &Measurement, b: &Measurement) -> bool {
    let noise = difference_noise(a, b);
    let (fast, slow) = if a.tokens_per_s >= b.tokens_per_s {
        (a, b)
    } else {
        (b, a)
    };
    noise > RESOLUTION_GAIN && fast.tokens_per_s < slow.tokens_per_s * (1.0 + noise)
}

/// The relative throughput difference below which two measurements count as equally fast:
/// the search's resolution, or the 95 % interval of their difference where that is wider.
pub(super) fn tie_band(a: &Measurement, b: &Measurement) -> f64 {
    RESOLUTION_GAIN.max(difference_noise(a, b))
}

/// The half-width of the 95 % interval of the relative difference between `a` and `b`.
fn difference_noise(a: &Measurement, b: &Measurement) -> f64 {
    Z_95 * a.relative_error().hypot(b.relative_error())
}

/// Of two measured settings, the one to run again: the one run fewer times, then the noisier,
/// as long as it may still be run again. A few steps' spread can understate a trial's error
/// (three steps give a poor spread, and they share whatever slowed or sped up that one run),
/// so the runs alternate rather than the same one being repeated.
fn next_to_remeasure<'m>(
    remeasures: &Remeasures,
    pair: [(Knobs, &'m Measurement); 2],
) -> Option<(Knobs, &'m Measurement)> {
    let runs = |k: &Knobs| runs(remeasures, k);
    let mut pair = pair;
    pair.sort_by(|(ka, a), (kb, b)| {
        runs(ka)
            .cmp(&runs(kb))
            .then(b.relative_error().total_cmp(&a.relative_error()))
    });
    pair.into_iter().find(|(k, _)| runs(k) < MAX_REMEASURES)
}

/// Timed steps for a remeasurement of `m` that, pooled with it, would tell apart two settings
/// `gap` apart (relatively) if both were that precise: the 95 % interval of their difference,
/// `Z · √2 · error`, within the gap, with the error of a median of `n` steps scattered as `m`'s
/// were. Never below the search's resolution, and between two and
/// [`MAX_REMEASURE_STEPS_FACTOR`] times a search trial's `timed_steps`.
fn steps_to_resolve(m: &Measurement, gap: f64, timed_steps: usize) -> usize {
    let per_step = m.relative_error() * (m.timed_steps.max(1) as f64).sqrt();
    let target = gap.max(RESOLUTION_GAIN) / (Z_95 * std::f64::consts::SQRT_2);
    let total = (per_step / target).powi(2).ceil();
    let wanted = if total.is_finite() {
        (total as usize).saturating_sub(m.timed_steps)
    } else {
        usize::MAX
    };
    wanted.clamp(2 * timed_steps, MAX_REMEASURE_STEPS_FACTOR * timed_steps)
}

impl SearchDriver {
    /// Whether growth has stopped paying, from the last two doublings of the feasible
    /// micro-batches up to `lo` (see the module docs of the driver, "Noise"):
    ///
    /// - a doubling whose gain is above the space's `saturation_gain` by more than its 95 %
    ///   interval shows growth pays, and growth goes on;
    /// - one whose interval straddles the threshold is run again (the trial of the pair run
    ///   fewer times, then the noisier), while it may be;
    /// - otherwise growth is not shown to pay, and stops.
    ///
    /// `None` until there are two doublings: one short trial's timing can be off by more than
    /// the threshold (on an H200, one trial at micro-batch 128 measured 3 % below 64, where 512
    /// runs 30 % faster).
    pub(super) fn saturation(
        &self,
        trials: &Trials<'_>,
        lo: usize,
        remeasures: &Remeasures,
    ) -> Option<Saturation> {
        let measured = |b: usize| {
            trials
                .iter()
                .filter(|(_, r)| r.request.knobs.micro_batch == b && self.is_feasible(r))
                .find_map(|(_, r)| Some((r.request.knobs, r.outcome.measurement()?)))
        };
        let below = |b: usize| {
            trials
                .iter()
                .filter(|(_, r)| self.is_feasible(r))
                .map(|(_, r)| r.request.knobs.micro_batch)
                .filter(|&x| x < b)
                .max()
        };
        let previous = below(lo)?;
        let earlier = below(previous)?;
        let threshold = self.space.saturation_gain;
        let mut doublings = Vec::with_capacity(2);
        for (hi, low) in [(lo, previous), (previous, earlier)] {
            let (top, bottom) = (measured(hi)?, measured(low)?);
            if bottom.1.tokens_per_s.is_nan() || bottom.1.tokens_per_s <= 0.0 {
                return None;
            }
            let gain = top.1.tokens_per_s / bottom.1.tokens_per_s - 1.0;
            let noise = difference_noise(top.1, bottom.1);
            if gain - noise >= threshold {
                return Some(Saturation::Growing);
            }
            doublings.push((gain, noise, [top, bottom]));
        }
        for &(gain, noise, pair) in &doublings {
            if gain + noise >= threshold {
                if let Some(again) = self.remeasure_one(remeasures, pair, threshold - gain) {
                    return Some(Saturation::Remeasure(again));
                }
            }
        }
        let gain = doublings
            .iter()
            .map(|d| d.0)
            .fold(f64::NEG_INFINITY, f64::max);
        Some(Saturation::Stopped { gain })
    }

    /// Before a regime converges at `lo`, its largest feasible micro-batch: the trial to run
    /// again when `lo` measured slower than a smaller feasible micro-batch of the regime beyond
    /// their tie band. The convergence bound grows from `lo`'s throughput, and throughput does
    /// not fall as the batch grows, so one of the two was off; a slow `lo` would otherwise end
    /// the regime short of its boundary. `None` when the two agree, when both have been run again
    /// and still measure apart ([`both_run_again`]), or when their runs are spent.
    pub(super) fn convergence_remeasure(
        &self,
        trials: &Trials<'_>,
        lo: usize,
        remeasures: &Remeasures,
    ) -> Option<Remeasure> {
        let feasible = || {
            trials
                .iter()
                .filter(|(_, r)| self.is_feasible(r))
                .filter_map(|(_, r)| Some((r.request.knobs, r.outcome.measurement()?)))
        };
        let top = feasible().find(|(k, _)| k.micro_batch == lo)?;
        let fastest = feasible()
            .filter(|(k, _)| k.micro_batch < lo)
            .max_by(|(_, a), (_, b)| a.tokens_per_s.total_cmp(&b.tokens_per_s))?;
        if !slower_beyond_band(top.1, fastest.1) || both_run_again(remeasures, &top.0, &fastest.0) {
            return None;
        }
        let gap = fastest.1.tokens_per_s / top.1.tokens_per_s - 1.0;
        self.remeasure_one(remeasures, [top, fastest], gap)
    }

    /// Before the choice is verified: the search trial to run again when the best's lead is in
    /// doubt, against
    ///
    /// - a setting of another regime that cannot be told apart from it ([`indistinguishable`]);
    /// - a larger micro-batch of its own regime that measured slower beyond the tie band:
    ///   throughput does not fall as the batch grows, so one of the two was off (a smaller
    ///   batch's lucky trial would otherwise end its regime's growth and win);
    /// - a smaller micro-batch of its own regime that measured faster than the best's own 95 %
    ///   interval reaches: the best comes first only because it is the largest within the tie band,
    ///   and near the memory boundary throughput can fall as the batch grows (PyTorch's
    ///   allocator under pressure: gpt-124m at 20 sequences ran at 177k-200k tokens/s against
    ///   217k-220k at 16).
    ///
    /// Neither of the last two once the pair still measures apart beyond its band after both
    /// were run again ([`both_run_again`]): the ranking then keeps what they measured.
    /// `pooled` is the pooled history the candidates' positions refer to.
    pub(super) fn choice_remeasure(
        &self,
        ranked: &[Candidate],
        pooled: &[TrialResult],
        remeasures: &Remeasures,
    ) -> Option<Remeasure> {
        let (best, rest) = ranked.split_first()?;
        let search_knobs = |c: &Candidate| pooled[c.history_index].request.knobs;
        let in_doubt = |c: &&Candidate| {
            if c.knobs.regime() != best.knobs.regime() {
                return indistinguishable(&best.measurement, &c.measurement);
            }
            let again = both_run_again(remeasures, &search_knobs(best), &search_knobs(c));
            if c.knobs.micro_batch < best.knobs.micro_batch {
                let (_, best_high) = best.measurement.tokens_per_s_interval();
                return c.measurement.tokens_per_s > best_high
                    && !(again && slower_beyond_band(&best.measurement, &c.measurement));
            }
            slower_beyond_band(&c.measurement, &best.measurement) && !again
        };
        rest.iter().filter(in_doubt).find_map(|c| {
            let gap = best.measurement.tokens_per_s / c.measurement.tokens_per_s - 1.0;
            let pair = [
                (search_knobs(best), &best.measurement),
                (search_knobs(c), &c.measurement),
            ];
            self.remeasure_one(remeasures, pair, gap)
        })
    }

    /// The one of `pair` to run again ([`next_to_remeasure`]), with the steps that would resolve
    /// a relative difference of `gap` at its spread; `None` when both runs are spent.
    fn remeasure_one(
        &self,
        remeasures: &Remeasures,
        pair: [(Knobs, &Measurement); 2],
        gap: f64,
    ) -> Option<Remeasure> {
        let (knobs, m) = next_to_remeasure(remeasures, pair)?;
        let timed_steps = steps_to_resolve(m, gap.abs(), self.space.timed_steps);
        Some(Remeasure { knobs, timed_steps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Checkpointing, DataParallel, Offload, Precision, Regime};
    use crate::trial::TrialRequest;

    fn fp32() -> Regime {
        Regime {
            precision: Precision::Fp32,
            checkpointing: Checkpointing::None,
            offload: Offload::None,
            data_parallel: DataParallel::SINGLE,
            update: Default::default(),
            state: Default::default(),
        }
    }

    fn fits(b: usize, median: f64, spread: f64, remeasure: bool) -> TrialResult {
        TrialResult {
            request: TrialRequest {
                knobs: Knobs::with_batch(fp32(), b, 1),
                warmup_steps: 1,
                timed_steps: 3,
                remeasure,
            },
            outcome: Outcome::Fits(Measurement {
                peak_gpu_bytes: 0,
                peak_host_bytes: 1000,
                step_time_median_s: median,
                step_time_spread: spread,
                timed_steps: 3,
                tokens_per_s: b as f64 / median,
                host_link: None,
            }),
            wall_s: 1.0,
        }
    }

    #[test]
    fn remeasurements_pool_into_the_trial_they_repeat() {
        let history = [
            fits(1, 0.10, 0.0, false),
            fits(2, 0.20, 0.0, false),
            fits(1, 0.12, 0.0, true),
            fits(1, 0.14, 0.0, true),
        ];
        let pooled = pooled_history(&history);
        assert_eq!(pooled.len(), 4);
        let m = pooled[0].outcome.measurement().unwrap();
        assert!((m.step_time_median_s - 0.12).abs() < 1e-12);
        assert_eq!(m.timed_steps, 9);
        assert_eq!(pooled[0].wall_s, 3.0);
        assert_eq!(pooled[1], history[1]);
        assert_eq!(pooled[2..], history[2..]);

        // Out of memory when run again: the setting is infeasible.
        let mut oom = fits(2, 0.2, 0.0, true);
        oom.outcome = Outcome::OutOfMemory {
            memory: crate::trial::MemoryKind::Gpu,
            phase: crate::trial::Phase::ForwardBackward,
        };
        let pooled = pooled_history(&[history[0].clone(), history[1].clone(), oom.clone()]);
        assert_eq!(pooled[1].outcome, oom.outcome);
    }

    #[test]
    fn only_differences_inside_a_wide_interval_are_indistinguishable() {
        let m = |tokens: f64, spread: f64| Measurement {
            peak_gpu_bytes: 0,
            peak_host_bytes: 0,
            step_time_median_s: 1.0,
            step_time_spread: spread,
            timed_steps: 3,
            tokens_per_s: tokens,
            host_link: None,
        };
        // Quiet trials: a 0.5 % difference is below the resolution, so never worth a trial.
        assert!(!indistinguishable(&m(1000.0, 0.0), &m(1005.0, 0.0)));
        assert_eq!(tie_band(&m(1000.0, 0.0), &m(1005.0, 0.0)), RESOLUTION_GAIN);
        // Spreads of 30 % over three steps: a 5 % difference is noise, 40 % is not.
        assert!(indistinguishable(&m(1000.0, 0.3), &m(1050.0, 0.3)));
        assert!(indistinguishable(&m(1050.0, 0.3), &m(1000.0, 0.3)));
        assert!(!indistinguishable(&m(1000.0, 0.3), &m(1400.0, 0.3)));
        assert!(tie_band(&m(1000.0, 0.3), &m(1050.0, 0.3)) > 0.05);
    }
}
