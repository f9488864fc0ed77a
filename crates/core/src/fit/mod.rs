//! Models fitted to trial results, per regime: peak memory and step time against micro-batch.
//!
//! Both are affine in the micro-batch `b` for a fixed regime and sequence length: memory is
//! weights, gradients and optimizer state (fixed) plus activations (per sample), and step time
//! is launch and optimizer overhead (fixed) plus work per sample. The search uses the memory
//! model to jump to the boundary; plans report both models' predictions and held-out errors.
//!
//! Only trials that fitted and ran without accumulation (`grad_accum = 1`) are data points:
//! accumulation holds an extra gradient buffer and amortises the optimizer step, so its
//! measurements follow a different law. Trials that ran out of memory are censored observations
//! (see [`memory::MemoryModel::optimistic_at`]).

pub mod memory;
pub mod monotone;
pub mod time;

pub use memory::{AffineBytes, Capacity, MeasuredPeak, MemoryModel, PeakPrediction};
pub use monotone::{non_monotone, NonMonotone};
pub use time::{StepTimeModel, TimeFitMethod};

use crate::knobs::Regime;
use crate::trial::{Measurement, TrialResult};

/// The data points of `regime` in `history`: `(micro_batch, measurement)` of every trial that
/// fitted with `grad_accum = 1`, in history order.
pub fn samples(regime: Regime, history: &[TrialResult]) -> Vec<(usize, Measurement)> {
    history
        .iter()
        .filter(|r| r.request.knobs.regime() == regime && r.request.knobs.grad_accum == 1)
        .filter_map(|r| {
            r.outcome
                .measurement()
                .map(|m| (r.request.knobs.micro_batch, *m))
        })
        .collect()
}

/// Both models of one regime; either is `None` when the history holds too few points for it.
#[derive(Debug, Clone, PartialEq)]
pub struct RegimeFit {
    /// The regime the models describe.
    pub regime: Regime,
    /// Peak memory against micro-batch (needs two distinct micro-batches).
    pub memory: Option<MemoryModel>,
    /// Step time against micro-batch (needs one point; two for an affine fit).
    pub time: Option<StepTimeModel>,
}

impl RegimeFit {
    /// Fits both models to the regime's data points in `history`.
    pub fn from_history(regime: Regime, history: &[TrialResult]) -> Self {
        let points = samples(regime, history);
        let times: Vec<(usize, f64)> = points
            .iter()
            .map(|(b, m)| (*b, m.step_time_median_s))
            .collect();
        Self {
            regime,
            memory: MemoryModel::fit(&points),
            time: StepTimeModel::fit(&times),
        }
    }
}

/// Leave-one-out relative error: fit on all points but one, predict the one left out, and
/// return the largest `|predicted − actual| / actual` over all points.
///
/// The worst case, not the mean, because a plan lives at its boundary: one badly predicted
/// point is what makes a later run run out of memory. `floor` is the smallest denominator (a
/// CPU run measures zero device bytes). `None` below three points (a fold would have a single
/// point, which no affine model is determined by) or when no fold can be fitted.
pub(crate) fn leave_one_out<P: Copy>(
    points: &[P],
    floor: f64,
    fit_and_predict: impl Fn(&[P], P) -> Option<(f64, f64)>,
) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    let mut worst: Option<f64> = None;
    for i in 0..points.len() {
        let rest: Vec<P> = points
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| *p)
            .collect();
        if let Some((predicted, actual)) = fit_and_predict(&rest, points[i]) {
            let error = (predicted - actual).abs() / actual.abs().max(floor);
            worst = Some(worst.map_or(error, |w: f64| w.max(error)));
        }
    }
    worst
}
