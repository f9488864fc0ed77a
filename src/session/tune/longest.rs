//! The longest single sequence: after a live search, the one the plan's setting can take (the
//! memory estimate, scaled by the plan's measured peak over its estimate, predicts it; trials
//! at that edge, one sequence a micro-batch at the plan's other knobs, measure it); and before
//! one (`--seq-len auto`), the longest the target fits for the model at all
//! ([`longest_context`]). [`EdgeSearch`] decides where the trials go.

use super::TuneObserver;
use crate::estimate;
use crate::knobs::{Knobs, Regime};
use crate::model::Engine;
use crate::plan::schema::Plan;
use crate::plan::{EdgeSearch, LongestSequence};
use crate::session::estimate::LONGEST_CONSIDERED;
use crate::session::prober::prober_for;
use crate::settings::estimate::attention;
use crate::settings::tune::LiveSettings;
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial::{Outcome, TrialRequest};
use crate::Result;

/// On a CPU, a trial's step at more tokens than this takes minutes: the prediction stands.
const CPU_TRIAL_TOKENS: usize = 8192;

/// Trials spent finding the longest sequence the target fits (`--seq-len auto`): from no
/// known fit, the bisection needs a few more than at a plan's edge.
const CONTEXT_TRIALS: usize = 6;

/// The edge trials after a search may take as long as the search did, and at least this many
/// seconds: at a long sequence an offloaded plan's step can take half a minute, and the edge
/// is what the plan says beside its setting, not what the tune is for.
const EDGE_TIME_FLOOR_S: f64 = 60.0;

/// The longest single sequence `plan` (the outcome of a search `settings` describe, which took
/// `search_s` seconds) can take: predicted, and measured by at most `settings.edge_trials`
/// trials at the edge, which together take about as long as the search at most.
pub fn longest_sequence(
    settings: &LiveSettings,
    plan: &Plan,
    search_s: f64,
    observer: &dyn TuneObserver,
) -> Result<LongestSequence> {
    let predicted = predicted_tokens(settings, plan)?;
    let unmeasured = |note: String| LongestSequence {
        predicted_tokens: predicted,
        measured_tokens: None,
        exceeded_tokens: None,
        trials: Vec::new(),
        note: Some(note),
    };
    let Some(tokens) = predicted else {
        return Ok(unmeasured(
            "not even one token's estimate fits the budget at these knobs".into(),
        ));
    };
    if let Some(why) = no_edge_trials(settings, plan, tokens) {
        return Ok(unmeasured(why));
    }
    let search = EdgeSearch::new(plan.model.seq_len, tokens, settings.edge_trials)
        .within(search_s.max(EDGE_TIME_FLOOR_S));
    let one_sequence = Knobs {
        micro_batch: 1,
        grad_accum: 1,
        ..plan.knobs
    };
    let search = run_edge(settings, &plan.model, one_sequence, search, observer)?;
    Ok(search.finish(predicted))
}

/// The longest sequence the target fits for the model `settings` tune, and the setting that
/// holds it: the regime whose estimate holds the longest single sequence, measured at the
/// edge. `None` when no regime holds even one token.
pub fn longest_context(
    settings: &LiveSettings,
    observer: &dyn TuneObserver,
) -> Result<Option<LongestContext>> {
    let kind = settings.target.kind;
    // A CPU step at a long sequence takes minutes: the search there stays within reach.
    let cap = match kind {
        DeviceKind::Cpu => CPU_TRIAL_TOKENS,
        DeviceKind::Cuda => LONGEST_CONSIDERED,
    };
    let mut best: Option<(usize, Regime)> = None;
    for regime in settings
        .space
        .regimes
        .iter()
        .filter(|r| r.data_parallel.is_single())
    {
        let knobs = Knobs::with_batch(*regime, 1, 1);
        let at = attention(
            Engine::default(),
            &settings.spec,
            &settings.target,
            regime.precision,
        )?;
        let spec = &settings.spec;
        let tokens = estimate::longest_sequence(spec, &knobs, kind, at, &settings.budget, 1.0, cap);
        if let Some(tokens) = tokens.filter(|&t| best.is_none_or(|(b, _)| t > b)) {
            best = Some((tokens, *regime));
        }
    }
    let Some((predicted, regime)) = best else {
        return Ok(None);
    };
    let search = EdgeSearch::new(0, predicted, CONTEXT_TRIALS);
    let knobs = Knobs::with_batch(regime, 1, 1);
    let search = run_edge(settings, &settings.spec, knobs, search, observer)?;
    let sequence = search.finish(Some(predicted));
    Ok(sequence.measured_tokens.map(|tokens| LongestContext {
        tokens,
        regime,
        sequence,
    }))
}

/// The longest sequence the target fits, and where it was found.
#[derive(Debug, Clone)]
pub struct LongestContext {
    /// The longest length that fitted, in tokens.
    pub tokens: usize,
    /// The setting it fitted in, one sequence a micro-batch.
    pub regime: Regime,
    /// The prediction and the trials at the edge.
    pub sequence: LongestSequence,
}

/// Trials `search` asks for, one sequence at `knobs` of `model` at each length, until it has
/// found the edge.
fn run_edge(
    settings: &LiveSettings,
    model: &ModelSpec,
    knobs: Knobs,
    mut search: EdgeSearch,
    observer: &dyn TuneObserver,
) -> Result<EdgeSearch> {
    while let Some(tokens) = search.next() {
        let spec = ModelSpec {
            seq_len: tokens,
            ..model.clone()
        };
        let request = TrialRequest {
            knobs,
            warmup_steps: 1,
            timed_steps: 1,
            remeasure: false,
        };
        // Timed from the prober's start: a trial's process start is part of what it costs.
        let started = std::time::Instant::now();
        let result = prober_for(settings, &spec)?.prober().probe(&request)?;
        let fits = matches!(result.outcome, Outcome::Fits(m) if settings.budget.fits(&m));
        observer.edge_trial(tokens, &result, fits);
        search.record(tokens, fits, started.elapsed().as_secs_f64());
    }
    Ok(search)
}

/// The estimate's longest sequence at the plan's knobs, scaled by the plan's measured peak
/// over its estimate, so that what the estimate misses of this engine on this device counts.
fn predicted_tokens(settings: &LiveSettings, plan: &Plan) -> Result<Option<usize>> {
    let kind = settings.target.kind;
    let at = attention(
        Engine::default(),
        &plan.model,
        &settings.target,
        plan.knobs.precision,
    )?;
    let estimated = estimate::estimate(&plan.model, &plan.knobs, kind, at).device_total();
    let measured = plan.budget.training_peak(&plan.measured);
    // An estimate far off the measurement is no base to scale: it is taken as it is.
    let scale = measured as f64 / estimated.max(1) as f64;
    let scale = if (0.5..=2.0).contains(&scale) {
        scale
    } else {
        1.0
    };
    Ok(estimate::longest_sequence(
        &plan.model,
        &plan.knobs,
        kind,
        at,
        &plan.budget,
        scale,
        LONGEST_CONSIDERED,
    ))
}

/// Why the edge is not measured by a trial, when it is not.
fn no_edge_trials(settings: &LiveSettings, plan: &Plan, predicted: usize) -> Option<String> {
    if settings.edge_trials == 0 {
        return Some("--edge-trials 0: predicted only".into());
    }
    if settings.runner.is_some() {
        return Some(
            "a trial runner measured the plan; the edge is predicted for autotune's engine only"
                .into(),
        );
    }
    if plan.knobs.data_parallel.degree > 1 {
        return Some("measured on one GPU only; a data-parallel plan's edge is predicted".into());
    }
    if settings.target.kind == DeviceKind::Cpu && predicted > CPU_TRIAL_TOKENS {
        return Some(format!(
            "a CPU step at {predicted} tokens would take minutes; the prediction stands"
        ));
    }
    None
}
