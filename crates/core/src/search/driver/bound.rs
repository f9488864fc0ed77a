//! The optimistic throughput bound that prunes a regime (see the driver docs, "Pruning").
//!
//! Each bound caps the tokens/s of every micro-batch a regime could still run, from above the
//! largest feasible one up to a reach; the regime is pruned when the smallest of them, raised by
//! [`PRUNE_SLACK`](super::PRUNE_SLACK), is below the best measured elsewhere. Every bound holds
//! under an assumption about how step time and memory grow with the batch; the assumptions are
//! stated where the bound is computed, and the slack covers timing noise, not a wrong premise.

use super::{secant_memory_model, RelativeTrials, SearchDriver, Trials, MEMORY_REACH_FACTOR};
use crate::fit::memory::UPPER_RANGE_DIVISOR;
use crate::fit::{AffineBytes, Capacity, MemoryModel};
use crate::trial::TrialResult;

/// A fitted trial's micro-batch, step time (seconds per micro-batch) and tokens/s.
#[derive(Debug, Clone, Copy)]
struct Timed {
    micro_batch: usize,
    step_s: f64,
    tokens_per_s: f64,
}

impl Timed {
    /// Tokens per sequence, from the trial itself (`tokens/s · t / b`).
    fn tokens_per_sequence(&self) -> f64 {
        self.tokens_per_s * self.step_s / self.micro_batch as f64
    }
}

/// The trials among `results` that ran to the end, by micro-batch.
fn timed<'h>(results: impl Iterator<Item = &'h TrialResult>) -> Vec<Timed> {
    let mut points: Vec<Timed> = results
        .filter_map(|r| {
            let m = r.outcome.measurement()?;
            (m.step_time_median_s > 0.0).then_some(Timed {
                micro_batch: r.request.knobs.micro_batch,
                step_s: m.step_time_median_s,
                tokens_per_s: m.tokens_per_s,
            })
        })
        .collect();
    points.sort_by_key(|p| p.micro_batch);
    points
}

impl SearchDriver {
    /// The smallest optimistic bound on the tokens/s of this regime's micro-batches above `lo`
    /// (its largest feasible one, which ran at `lo_tokens_per_s`) up to `top_open` (its largest
    /// open candidate). `related.offload_twin` holds the trials of the same regime without offload,
    /// when this one offloads and that one was searched earlier.
    pub(super) fn throughput_bound(
        &self,
        trials: &Trials<'_>,
        related: &RelativeTrials<'_, '_>,
        lo: usize,
        lo_tokens_per_s: f64,
        top_open: usize,
    ) -> f64 {
        let offload_twin = related.offload_twin;
        let reach = self
            .memory_reach(trials, related)
            .map_or(top_open, |r| r.min(top_open));
        // Step time does not fall as the batch grows.
        let by_step_time = lo_tokens_per_s * reach as f64 / lo as f64;
        let by_secant = self.secant_bound(trials, reach);
        let floor = self.facts.offload_host_floor_s.unwrap_or(0.0);
        let by_host_time = offload_twin.and_then(|twin| {
            host_time_bound(trials, &self.feasible_timed(twin), twin, floor, reach)
        });
        [by_secant, by_host_time]
            .into_iter()
            .flatten()
            .fold(by_step_time, f64::min)
    }

    /// The bound on an offloaded regime that has not run a trial yet, from its offload twin
    /// and the host work floor measured before the search ([`MachineFacts::offload_host_floor_s`]
    /// (crate::search::MachineFacts::offload_host_floor_s)): `tokens · b / (c·b + h)` as in
    /// [`host_time_bound`], with `h` the floor and `b` the most the regime could reach.
    ///
    /// Reach: the twin's memory model (the secant through its two largest feasible trials, with
    /// the bytes per sequence of [`peers_per_sample`](Self::peers_per_sample)) with no fixed
    /// part at all, doubled as every reach is. Offload moves the optimizer's state off
    /// the device and keeps the activation bytes per sequence (see [`borrowed_memory_model`]),
    /// so the regime's fixed part lies somewhere between the twin's and nothing.
    ///
    /// `c`: the twin's per-sequence floor, or where the twin has no two trials a doubling apart
    /// in its upper range (it grew from its bases' reach), the largest of its bases' floors.
    /// Assumption: memory savings add work per sequence (recompute) and never remove any, so a
    /// regime's step time grows at least as fast with the batch as its bases' does.
    ///
    /// The twin's step time at `b` is also taken from the secant through its two largest
    /// feasible trials, as [`secant_bound`](Self::secant_bound) does for a probed regime, and
    /// the smaller of the two bounds holds.
    ///
    /// `None` without a floor, a twin with a memory model, or a twin trial that ran.
    pub(super) fn unprobed_offload_bound(&self, related: &RelativeTrials<'_, '_>) -> Option<f64> {
        let host_s = self.facts.offload_host_floor_s.filter(|h| *h > 0.0)?;
        let twin = related.offload_twin?;
        let model = secant_memory_model(self.feasible(twin).iter())?;
        let per_sample = self.peers_per_sample(&related.activation_peers, &model);
        let usable = self.budget.usable_gpu_bytes()? as f64;
        if per_sample.is_nan() || per_sample <= 0.0 {
            return None;
        }
        let top = *self.candidates.last()? as f64;
        let reach = ((usable / per_sample).floor() * MEMORY_REACH_FACTOR as f64).min(top);
        let timed_twin = timed(twin.iter().map(|(_, r)| *r));
        let tokens = timed_twin.first()?.tokens_per_sequence();
        let c = match per_sequence_floor(&timed_twin) {
            c if c > 0.0 => c,
            _ => related
                .twin_bases
                .iter()
                .map(|base| per_sequence_floor(&timed(base.iter().map(|(_, r)| *r))))
                .fold(0.0, f64::max),
        };
        let by_floor = tokens * reach / (c * reach + host_s);
        // The twin's own secant, as `secant_bound` reads it: where the twin's trials are no
        // doubling apart (48 and 72 sequences, say), its bases' floor misses what the twin
        // adds per sequence (recompute), and the secant still holds it.
        let by_secant = secant_step_s(&self.feasible_timed(twin), reach as usize)
            .map(|t| tokens * reach / (t + host_s));
        Some(by_secant.map_or(by_floor, |s| s.min(by_floor)))
    }

    /// The feasible ones among `trials`.
    fn feasible<'h>(&self, trials: &Trials<'h>) -> Vec<(usize, &'h TrialResult)> {
        trials
            .iter()
            .filter(|(_, r)| self.is_feasible(r))
            .copied()
            .collect()
    }

    /// Throughput at `b` predicted by the step-time secant through the two largest feasible
    /// trials, `t(b) = t0 + c·b`; `None` unless the secant rises (c > 0). Step time grows at
    /// least linearly once the device is saturated, so this is already an optimistic bound
    /// there; it is what lets a slow regime (offload, recompute) be pruned before its memory
    /// boundary.
    fn secant_bound(&self, trials: &Trials<'_>, b: usize) -> Option<f64> {
        let points = self.feasible_timed(trials);
        let tokens = points.last()?.tokens_per_sequence();
        Some(tokens * b as f64 / secant_step_s(&points, b)?)
    }

    /// The trials among `trials` that ran to the end within the budget, by micro-batch.
    fn feasible_timed(&self, trials: &Trials<'_>) -> Vec<Timed> {
        timed(
            trials
                .iter()
                .map(|(_, r)| *r)
                .filter(|r| self.is_feasible(r)),
        )
    }

    /// The largest micro-batch this regime could still reach, for the pruning bound: twice the
    /// memory model's largest fitting micro-batch. The model is the secant through the regime's
    /// two largest feasible trials (as for the jump); an offloaded regime with a single feasible
    /// trial borrows the per-sequence bytes of its twin without offload instead (see
    /// [`borrowed_memory_model`]). The factor two keeps the bound optimistic when memory grows
    /// less than linearly; `None` when no model can be fitted or memory does not grow.
    fn memory_reach(&self, trials: &Trials<'_>, related: &RelativeTrials<'_, '_>) -> Option<usize> {
        let own = self.feasible(trials);
        let model = secant_memory_model(own.iter()).or_else(|| {
            let mut twin = secant_memory_model(self.feasible(related.offload_twin?).iter())?;
            twin.gpu.per_sample_bytes = self.peers_per_sample(&related.activation_peers, &twin);
            let (_, largest) = own
                .iter()
                .max_by_key(|(_, r)| r.request.knobs.micro_batch)?;
            borrowed_memory_model(&twin, largest)
        })?;
        match model.max_micro_batch_within(&self.budget) {
            Capacity::UpTo(b) => Some(b.saturating_mul(MEMORY_REACH_FACTOR)),
            Capacity::Unbounded => None,
        }
    }
}

impl SearchDriver {
    /// The device bytes per added sequence to borrow for an offloaded regime: the most that
    /// `model` (its twin's) or the memory secant of any `peers` (regimes with the same
    /// activations) shows.
    ///
    /// Why the most: a regime's peak is the larger of its activations' and its optimizer's
    /// transients, and at small batches the second can dominate, so the peak hardly grows
    /// there. On the 2026-12-04 gpt-1.3b recording (`benches/results/archive/`) checkpointing
    /// after backward grew by 22 MiB per sequence between 6 and 12 sequences, under its
    /// update's peak; with the update in
    /// backward the same activations grew by 190 MiB per sequence between 24 and 32, and
    /// offloaded by 213 MiB between 48 and 96. A twin's flat secant would put the reach past
    /// every candidate.
    fn peers_per_sample(&self, peers: &[&Trials<'_>], model: &MemoryModel) -> f64 {
        peers
            .iter()
            .filter_map(|peer| secant_memory_model(self.feasible(peer).iter()))
            .map(|m| m.gpu.per_sample_bytes)
            .filter(|b| b.is_finite())
            .fold(model.gpu.per_sample_bytes, f64::max)
    }
}

/// The twin's memory model moved to pass through the offloaded regime's one feasible trial:
/// the same bytes per sequence, a different fixed part.
///
/// Assumption: offload moves the optimizer's state (f32 masters, moments, gradient sums) to the
/// host, and leaves the forward and backward passes, and so the activation bytes per sequence,
/// as they are. On the gpt-124m recording the plain regime grows by 815 MiB per sequence and the
/// offloaded one by 896 MiB between its first two micro-batches.
fn borrowed_memory_model(twin: &MemoryModel, trial: &TrialResult) -> Option<MemoryModel> {
    let m = trial.outcome.measurement()?;
    let b = trial.request.knobs.micro_batch as f64;
    let through = |law: &AffineBytes, bytes: u64| AffineBytes {
        fixed_bytes: bytes as f64 - law.per_sample_bytes * b,
        per_sample_bytes: law.per_sample_bytes,
    };
    Some(MemoryModel {
        gpu: through(&twin.gpu, m.peak_gpu_bytes),
        host: through(&twin.host, m.peak_host_bytes),
        points: 1,
        gpu_loo_rel_error: None,
        host_loo_rel_error: None,
        // A bound stays optimistic: no measured floor.
        measured: Vec::new(),
    })
}

/// The bound on an offloaded regime's throughput at micro-batch `b` that its twin without
/// offload gives: `tokens · b / (c·b + h)`.
///
/// Why: the offloaded step runs the twin's forward and backward passes and adds host work that
/// does not overlap them, because every gradient copy waits for the device and the device waits
/// for the host's sum (the runtime's `OffloadAdam::accumulate`), then
/// the update runs on the host and the new weights are uploaded. That host work (less the
/// twin's on-device update and weight casts) scales with the parameters, not the batch: a
/// constant `h`. So `t_offload(b) ≥ t_twin(b) + h`, and `t_twin(b)` is at least both `c·b`
/// with `c` from [`per_sequence_floor`] and the secant through the twin's two largest feasible
/// trials (`twin_feasible`, as [`secant_step_s`] reads it: step time grows at least linearly
/// once the device is busy).
///
/// `h` is measured: each offloaded trial's step time minus the twin's at the smallest micro-batch
/// at least as large. Step time does not fall as the batch grows, so each difference is at most
/// the one at equal batches, and the largest is taken (the offloaded regime's first trial runs
/// at the space's start, where the twin ran too, unless the twin started higher). `None` when no
/// pair exists or `h` is not positive (then offload is not the slower placement here and the
/// premise fails); otherwise `h` is at least `host_floor_s`, the host update's time measured
/// before the search. The bound rises with `b`, so the caller evaluates it at the largest
/// reachable batch.
fn host_time_bound(
    trials: &Trials<'_>,
    twin_feasible: &[Timed],
    twin: &Trials<'_>,
    host_floor_s: f64,
    b: usize,
) -> Option<f64> {
    // Every trial that ran to the end, feasible or not: one that fitted only inside the
    // headroom still measured its step time.
    let own = timed(trials.iter().map(|(_, r)| *r));
    let twin = timed(twin.iter().map(|(_, r)| *r));
    let host_s = own
        .iter()
        .filter_map(|p| {
            let at_least = twin.iter().find(|q| q.micro_batch >= p.micro_batch)?;
            Some(p.step_s - at_least.step_s)
        })
        .max_by(f64::total_cmp)?;
    // NaN counts as not positive.
    if host_s.is_nan() || host_s <= 0.0 {
        return None;
    }
    // The floor measured before the search holds whatever the pairs show.
    let host_s = host_s.max(host_floor_s);
    let tokens = own.first()?.tokens_per_sequence();
    let twin_s =
        (per_sequence_floor(&twin) * b as f64).max(secant_step_s(twin_feasible, b).unwrap_or(0.0));
    Some(tokens * b as f64 / (twin_s + host_s))
}

/// Step time at `b` on the secant through the two largest of `points` (sorted by micro-batch),
/// `t(b) = t0 + c·b`; `None` unless the secant rises (c > 0).
///
/// A negative fixed part `t0` means the larger trial ran fewer tokens per second than the
/// smaller, which the bound's premise (affine step time with a non-negative fixed part, or
/// bending upward) rules out: on a saturated device that is timing noise (gpt-124m with
/// checkpointing measured 304.8k tokens/s at 48 sequences and 303.2k at 72), or a slow trial
/// (the PyTorch harness measured gpt-124m at 20 sequences 15 % below 16). The line through the
/// larger trial with no fixed part is taken instead: throughput no higher than that trial's,
/// which is what "throughput does not fall as the batch grows" allows past it. Keeping the
/// slope and dropping the fixed part would put the bound below what that trial measured.
fn secant_step_s(points: &[Timed], b: usize) -> Option<f64> {
    let [.., next, top] = points else {
        return None;
    };
    let c = (top.step_s - next.step_s) / (top.micro_batch - next.micro_batch) as f64;
    if c.is_nan() || c <= 0.0 {
        return None;
    }
    let t0 = top.step_s - c * top.micro_batch as f64;
    if t0 < 0.0 {
        return Some(top.step_s * b as f64 / top.micro_batch as f64);
    }
    Some(t0 + c * b as f64)
}

/// A lower bound `c` on step time per sequence, `t(b) ≥ c·b` at every batch, from trials sorted
/// by micro-batch: the smallest rise of step time per added sequence over a doubling of the
/// batch (each trial against the largest one at most half its size), among trials in the upper
/// range (at least 1/[`UPPER_RANGE_DIVISOR`] of the largest, as for the memory fit), and no more
/// than any trial's own time per sequence. 0 without such a pair.
///
/// Assumption: step time is affine in the batch with a non-negative fixed part, or bends upward
/// (the device, once busy, adds at least the same time per sequence). Pairs a doubling apart,
/// not neighbours, because timing noise dominates the difference of close batches: on the
/// gpt-124m recording checkpointing measured 16 ms per sequence between 68 and 69 sequences
/// against 6.4 ms between 32 and 69. Small batches are left out because the device is not busy
/// there and step time hardly grows, which says nothing about large batches.
fn per_sequence_floor(points: &[Timed]) -> f64 {
    let Some(largest) = points.last().map(|p| p.micro_batch) else {
        return 0.0;
    };
    let own = points
        .iter()
        .map(|p| p.step_s / p.micro_batch as f64)
        .fold(f64::INFINITY, f64::min);
    let doubling = points
        .iter()
        .filter(|p| p.micro_batch * UPPER_RANGE_DIVISOR >= largest)
        .filter_map(|p| {
            let half = points
                .iter()
                .rev()
                .find(|q| 2 * q.micro_batch <= p.micro_batch)?;
            Some((p.step_s - half.step_s) / (p.micro_batch - half.micro_batch) as f64)
        })
        .fold(f64::INFINITY, f64::min);
    if doubling.is_finite() {
        doubling.min(own).max(0.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Knobs, Precision};
    use crate::trial::{Measurement, Outcome, TrialRequest};

    /// Fitted trials at `(micro_batch, step seconds)`, 1024 tokens per sequence.
    fn results(trials: &[(usize, f64)]) -> Vec<TrialResult> {
        trials
            .iter()
            .map(|&(b, step_s)| TrialResult {
                request: TrialRequest {
                    knobs: Knobs::new(b, Precision::Bf16),
                    warmup_steps: 1,
                    timed_steps: 3,
                    remeasure: false,
                },
                outcome: Outcome::Fits(Measurement {
                    peak_gpu_bytes: 1 << 30,
                    peak_host_bytes: 1 << 30,
                    step_time_median_s: step_s,
                    step_time_spread: 0.0,
                    timed_steps: 3,
                    tokens_per_s: 1024.0 * b as f64 / step_s,
                    host_link: None,
                }),
                wall_s: 1.0,
            })
            .collect()
    }

    fn trials(results: &[TrialResult]) -> Vec<(usize, &TrialResult)> {
        results.iter().enumerate().collect()
    }

    #[test]
    fn host_time_bound_adds_the_measured_host_work_to_the_twins_floor() {
        // Twin: 10 ms + 5 ms per sequence. Offloaded: the same plus 0.4 s.
        let twin = results(&[(1, 0.015), (2, 0.02), (4, 0.03), (8, 0.05), (16, 0.09)]);
        let twin = trials(&twin);
        // (offloaded trials, expected bound at 100 sequences or None)
        type Row<'a> = (&'a [(usize, f64)], Option<f64>);
        let table: [Row<'_>; 5] = [
            // At equal batches: h = 0.4 s, c = 5 ms.
            (&[(1, 0.415)], Some(1024.0 * 100.0 / (0.5 + 0.4))),
            // At 3, against the twin's next larger batch (4): only h ≥ 0.395 is known.
            (&[(3, 0.425)], Some(1024.0 * 100.0 / (0.5 + 0.395))),
            // With both pairs the larger lower bound on h is taken.
            (&[(3, 0.425), (4, 0.43)], Some(1024.0 * 100.0 / (0.5 + 0.4))),
            // Faster than the twin: no bound.
            (&[(4, 0.025)], None),
            // The twin has no trial at least as large: no pair, no bound.
            (&[(32, 0.6)], None),
        ];
        for (i, (own, expected)) in table.into_iter().enumerate() {
            let own = results(own);
            let got = host_time_bound(&trials(&own), &[], &twin, 0.0, 100);
            match (got, expected) {
                (Some(g), Some(e)) => assert!((g - e).abs() < 1e-6 * e, "row {i}: {g} vs {e}"),
                (None, None) => {}
                _ => panic!("row {i}: {got:?} vs {expected:?}"),
            }
        }
    }

    fn points(law: impl Fn(f64) -> f64, batches: &[usize]) -> Vec<Timed> {
        batches
            .iter()
            .map(|&b| Timed {
                micro_batch: b,
                step_s: law(b as f64),
                tokens_per_s: 1024.0 * b as f64 / law(b as f64),
            })
            .collect()
    }

    #[test]
    fn the_secant_never_bounds_below_the_larger_trial() {
        // Affine, 10 ms + 5 ms a sequence: the secant is the law.
        let affine = points(|b| 0.01 + 0.005 * b, &[8, 16]);
        assert!((secant_step_s(&affine, 32).unwrap() - 0.17).abs() < 1e-12);
        // Throughput falling from 16 to 20 (a slow trial): the line through 20 with no fixed
        // part, so the bound at any batch is 20's own throughput.
        let slow = [
            points(|_| 0.080856, &[16])[0],
            points(|_| 0.119145, &[20])[0],
        ];
        let t = secant_step_s(&slow, 23).unwrap();
        assert!((t - 0.119145 * 23.0 / 20.0).abs() < 1e-12, "{t}");
        // Falling step time (throughput rising faster than linearly): no bound.
        assert_eq!(secant_step_s(&points(|b| 1.0 / b, &[4, 8]), 16), None);
        assert_eq!(secant_step_s(&points(|b| b, &[8]), 16), None);
    }

    #[test]
    fn per_sequence_floor_is_the_slope_of_an_affine_law() {
        let affine = points(|b| 0.02 + 0.004 * b, &[1, 2, 4, 8, 16, 32]);
        assert!((per_sequence_floor(&affine) - 0.004).abs() < 1e-12);
    }

    #[test]
    fn per_sequence_floor_ignores_noise_between_close_batches() {
        // 6.4 ms per sequence over a doubling; 69 measured 10 % slow, which neighbours would
        // read as a slope of (0.4416·1.1 − 0.4352) / 1 = 50 ms per sequence.
        let mut noisy = points(|b| 0.0064 * b, &[8, 16, 32, 68, 69]);
        noisy[4].step_s *= 1.1;
        let floor = per_sequence_floor(&noisy);
        assert!(floor <= 0.0064 + 1e-12, "{floor}");
        assert!(floor > 0.006, "{floor}");
    }

    #[test]
    fn per_sequence_floor_never_exceeds_a_trials_own_time_per_sequence() {
        // Superlinear: slopes over doublings exceed the time per sequence of the largest trial.
        let convex = points(|b| 0.001 * b * b, &[4, 8, 16]);
        assert!((per_sequence_floor(&convex) - 0.004).abs() < 1e-12);
        // Flat step time, or a single trial, gives no floor.
        assert_eq!(per_sequence_floor(&points(|_| 0.1, &[1, 2, 4])), 0.0);
        assert_eq!(per_sequence_floor(&points(|b| b, &[8])), 0.0);
        assert_eq!(per_sequence_floor(&[]), 0.0);
    }
}
