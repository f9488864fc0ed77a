//! What `estimate` computes from its settings: one setting's peaks, whether they fit and the
//! largest micro-batch that does; or every fitted trial of a recording against its estimate.

use crate::estimate::{self, Estimate, RecordedError};
use crate::model::Engine;
use crate::profile::record::Profile;
use crate::settings::estimate::attention;
use crate::spec::budget::Budget;
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::model::ModelSpec;
use crate::{Knobs, Result};

/// One setting's estimate and its verdict.
#[derive(Debug)]
pub struct Estimated {
    /// The peaks by component.
    pub estimate: Estimate,
    /// Whether they fit the budget.
    pub fits: bool,
    /// The largest micro-batch at these knobs that fits, if any.
    pub largest_micro_batch: Option<usize>,
    /// The longest single sequence (one a micro-batch) at these knobs that fits, in tokens.
    pub longest_sequence: Option<usize>,
}

/// The longest sequence an estimate considers, in tokens.
pub const LONGEST_CONSIDERED: usize = 1 << 20;

/// The estimate of `knobs` for `model` on `target`, judged by `budget`.
pub fn setting(
    model: &ModelSpec,
    target: &DeviceSpec,
    knobs: &Knobs,
    attention: estimate::Attention,
    budget: &Budget,
) -> Estimated {
    let est = estimate::estimate(model, knobs, target.kind, attention);
    Estimated {
        fits: est.fits(budget),
        largest_micro_batch: estimate::largest_micro_batch(
            model,
            knobs,
            target.kind,
            attention,
            budget,
        ),
        longest_sequence: estimate::longest_sequence(
            model,
            knobs,
            target.kind,
            attention,
            budget,
            1.0,
            LONGEST_CONSIDERED,
        ),
        estimate: est,
    }
}

/// A recording's fitted trials against their estimates.
#[derive(Debug)]
pub struct Comparison {
    /// Each fitted trial's measured and estimated peak on its training device.
    pub trials: Vec<RecordedError>,
    /// The largest relative error, if any trial fitted.
    pub worst: Option<f64>,
    /// The mean relative error, if any trial fitted.
    pub mean: Option<f64>,
    /// On a GPU, the host peak of each fitted trial that keeps training state in host memory
    /// (offload, or moments in host memory) against the estimate's host total.
    pub host_trials: Vec<RecordedError>,
}

/// The largest and the mean relative error of `trials`, if there are any.
pub fn worst_and_mean(trials: &[RecordedError]) -> (Option<f64>, Option<f64>) {
    let errors: Vec<f64> = trials.iter().map(|t| t.relative_error.abs()).collect();
    let worst = errors.iter().copied().reduce(f64::max);
    let mean = (!errors.is_empty()).then(|| errors.iter().sum::<f64>() / errors.len() as f64);
    (worst, mean)
}

/// Every fitted trial of `profile` against the estimate of `engine`; each trial's precision
/// decides whether its attention ran flash.
pub fn against_recording(profile: &Profile, engine: Engine) -> Result<Comparison> {
    let target = &profile.device.target;
    let mut trials = Vec::new();
    let mut host_trials = Vec::new();
    for trial in &profile.trials {
        let precision = trial.request.knobs.precision;
        let at = attention(engine, &profile.model, target, precision)?;
        let one = std::slice::from_ref(trial);
        trials.extend(estimate::compare(&profile.model, target.kind, at, one));
        if target.kind == DeviceKind::Cuda {
            host_trials.extend(estimate::compare_host(&profile.model, at, one));
        }
    }
    let (worst, mean) = worst_and_mean(&trials);
    Ok(Comparison {
        trials,
        worst,
        mean,
        host_trials,
    })
}
