//! Where memory does not grow with the micro-batch: neighbouring trials of one regime whose
//! peak falls as the batch grows, or where a larger batch fits within the budget above a
//! smaller one that did not. The fitted models assume growth; plans and reports list where the
//! trials disagree, so that a user sees how far the boundary can be trusted.

use serde::{Deserialize, Serialize};

use crate::knobs::Regime;
use crate::spec::budget::{format_bytes, Budget};
use crate::trial::{Outcome, TrialResult};

/// Two neighbouring micro-batches of one regime that break the growth of memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NonMonotone {
    /// The regime.
    pub regime: Regime,
    /// The smaller micro-batch.
    pub smaller: usize,
    /// The larger micro-batch, the next one measured.
    pub larger: usize,
    /// What broke, in words.
    pub what: String,
}

/// Every break of growth between neighbouring micro-batches (of trials without accumulation)
/// of each regime in `history`, judged against `budget` (its training memory's peak, see
/// [`Budget::training_peak`]).
pub fn non_monotone(history: &[TrialResult], budget: &Budget) -> Vec<NonMonotone> {
    let mut regimes: Vec<Regime> = Vec::new();
    for r in history {
        let regime = r.request.knobs.regime();
        if !regimes.contains(&regime) {
            regimes.push(regime);
        }
    }
    let mut found = Vec::new();
    for regime in regimes {
        // The latest trial of each micro-batch, in micro-batch order.
        let mut points: Vec<(usize, &TrialResult)> = Vec::new();
        for r in history
            .iter()
            .filter(|r| r.request.knobs.regime() == regime && r.request.knobs.grad_accum == 1)
        {
            let b = r.request.knobs.micro_batch;
            points.retain(|(x, _)| *x != b);
            points.push((b, r));
        }
        points.sort_by_key(|(b, _)| *b);
        for pair in points.windows(2) {
            let ((small, a), (large, b)) = (pair[0], pair[1]);
            if let Some(what) = break_between(a, b, budget) {
                found.push(NonMonotone {
                    regime,
                    smaller: small,
                    larger: large,
                    what,
                });
            }
        }
    }
    found
}

/// How the larger trial `b` breaks growth from the smaller `a`, if it does.
fn break_between(a: &TrialResult, b: &TrialResult, budget: &Budget) -> Option<String> {
    let peak = |m: &crate::trial::Measurement| budget.training_peak(m);
    let within = |r: &TrialResult| r.outcome.measurement().is_some_and(|m| budget.fits(m));
    if !within(a) && within(b) {
        return Some(format!(
            "the larger batch fits the budget and the smaller one did not ({})",
            match &a.outcome {
                Outcome::Fits(_) => "it peaked above the headroom",
                Outcome::OutOfMemory { .. } => "it ran out of memory",
                _ => "it failed",
            }
        ));
    }
    match (&a.outcome, &b.outcome) {
        (Outcome::Fits(ma), Outcome::Fits(mb)) if peak(mb) < peak(ma) => Some(format!(
            "the peak falls from {} to {} as the batch grows",
            format_bytes(peak(ma)),
            format_bytes(peak(mb))
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Knobs, Precision};
    use crate::trial::{Measurement, MemoryKind, Phase, TrialRequest};

    fn trial(b: usize, gib: f64) -> TrialResult {
        let outcome = if gib < 0.0 {
            Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                phase: Phase::ForwardBackward,
            }
        } else {
            Outcome::Fits(Measurement {
                peak_gpu_bytes: (gib * (1u64 << 30) as f64) as u64,
                peak_host_bytes: 1 << 30,
                step_time_median_s: 1.0,
                step_time_spread: 0.0,
                timed_steps: 3,
                tokens_per_s: 1000.0,
                host_link: None,
            })
        };
        TrialResult {
            request: TrialRequest {
                knobs: Knobs::new(b, Precision::Bf16),
                warmup_steps: 1,
                timed_steps: 3,
                remeasure: false,
            },
            outcome,
            wall_s: 1.0,
        }
    }

    #[test]
    fn the_8b_histories_show_their_breaks_and_a_growing_one_none() {
        let budget = Budget {
            gpu_bytes: Some(24 << 30),
            host_bytes: 32 << 30,
            headroom: 0.05,
        };
        // llama-3.1-8b on the H100 held to 24 GB: 22.18, 21.58, 22.68 GiB, then out of memory.
        let history = [
            trial(1, 22.18),
            trial(2, 21.58),
            trial(4, 22.68),
            trial(8, -1.0),
        ];
        let found = non_monotone(&history, &budget);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!((found[0].smaller, found[0].larger), (1, 2));
        assert!(found[0].what.contains("falls"), "{}", found[0].what);
        // The recording: batch 2 above the headroom, 4 within it.
        let history = [trial(1, 22.15), trial(2, 23.55), trial(4, 22.68)];
        let found = non_monotone(&history, &budget);
        let pairs: Vec<(usize, usize)> = found.iter().map(|n| (n.smaller, n.larger)).collect();
        assert_eq!(pairs, [(2, 4)], "{found:?}");
        assert!(found[0].what.contains("above the headroom"));
        let growing = [
            trial(1, 10.0),
            trial(2, 12.0),
            trial(4, 16.0),
            trial(8, -1.0),
        ];
        assert!(non_monotone(&growing, &budget).is_empty());
    }
}
