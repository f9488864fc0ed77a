//! A search as one self-contained HTML page: per regime, peak GPU and host memory against
//! micro-batch with the budget, the headroom line, the out-of-memory points and the fitted
//! memory model and its error; tokens per second against micro-batch; and the chosen setting
//! with its alternatives.
//!
//! A profile holds every trial and the machine it ran on; a plan holds every trial too (its
//! evidence) and adds what the choice was based on: predictions, the verification, model
//! errors and alternatives. [`Report`] takes either (or both, after `tune --report`) and shows
//! what it holds. The charts are inline SVG built by [`svg`]; the page has no script and loads
//! nothing. A plan tuned on a dataset adds its length histogram, with where the plan's
//! sequence and its longest single sequence fall. A training run's metrics log makes a page of
//! its own: its loss curves ([`curves`]).

mod charts;
pub mod curves;
mod data;
mod html;
pub mod svg;

use crate::fit::RegimeFit;
use crate::knobs::{Knobs, Regime};
use crate::plan::{
    Alternative, DataProfile, Headroom, LongestSequence, ModelError, Plan, Predicted, Provenance,
};
use crate::profile::record::Profile;
use crate::spec::budget::Budget;
use crate::spec::device::DeviceSpec;
use crate::spec::model::ModelSpec;
use crate::trial::{Measurement, Outcome, TrialResult};

/// What the report was made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A plan file.
    Plan,
    /// A recorded profile.
    Profile,
    /// A search just run (its profile and, if one was found, its plan).
    Search,
}

/// What only a plan holds: the basis of its choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The fitted models' predictions at the chosen knobs.
    pub predicted: Predicted,
    /// The verification trial.
    pub measured: Measurement,
    /// Budget bytes left unused at the measured peak.
    pub headroom: Headroom,
    /// Held-out errors of the chosen regime's fits.
    pub model_error: ModelError,
    /// Other feasible settings, best first.
    pub alternatives: Vec<Alternative>,
    /// What measured the plan, when it says.
    pub provenance: Option<Provenance>,
    /// The longest single sequence the plan takes, when it says.
    pub longest_sequence: Option<LongestSequence>,
    /// Where memory did not grow with the micro-batch.
    pub non_monotone: Vec<crate::fit::NonMonotone>,
    /// The settings not verified because accumulation would not have fit.
    pub ruled_out: Vec<crate::search::AccumulationRuledOut>,
}

/// Everything the page shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// What it was made from.
    pub source: Source,
    /// The model trained.
    pub model: ModelSpec,
    /// The target device.
    pub target: DeviceSpec,
    /// The device the trials ran on, as detected (a profile's, or a plan's provenance).
    pub ran_on: Option<String>,
    /// The limits the trials ran under.
    pub budget: Budget,
    /// Every trial, in order.
    pub trials: Vec<TrialResult>,
    /// The chosen setting, if any.
    pub chosen: Option<Knobs>,
    /// A plan's basis for its choice.
    pub choice: Option<Choice>,
    /// When the plan or profile was made, seconds since the Unix epoch.
    pub created_unix_s: u64,
    /// The dataset a plan was tuned on, when it was.
    pub data: Option<DataProfile>,
}

impl Report {
    /// The report of a plan: its evidence, choice and alternatives.
    pub fn from_plan(plan: &Plan) -> Self {
        Self {
            source: Source::Plan,
            model: plan.model.clone(),
            target: plan.device.clone(),
            ran_on: plan.provenance.as_ref().map(|p| p.device.clone()),
            budget: plan.budget,
            trials: plan.evidence.clone(),
            chosen: Some(plan.knobs),
            choice: Some(Choice {
                predicted: plan.predicted,
                measured: plan.measured,
                headroom: plan.headroom,
                model_error: plan.model_error,
                alternatives: plan.alternatives.clone(),
                provenance: plan.provenance.clone(),
                longest_sequence: plan.longest_sequence.clone(),
                non_monotone: plan.non_monotone.clone(),
                ruled_out: plan.ruled_out.clone(),
            }),
            created_unix_s: plan.created_unix_s,
            data: plan.data.clone(),
        }
    }

    /// The report of a recorded profile: its trials and the setting it chose.
    pub fn from_profile(profile: &Profile) -> Self {
        Self {
            source: Source::Profile,
            model: profile.model.clone(),
            target: profile.device.target.clone(),
            ran_on: Some(profile.device.name.clone()),
            budget: profile.budget,
            trials: profile.trials.clone(),
            chosen: profile.chosen,
            choice: None,
            created_unix_s: profile.created_unix_s,
            data: None,
        }
    }

    /// The report of a search just run: its profile, and its plan's choice when it made one.
    pub fn from_search(profile: &Profile, plan: Option<&Plan>) -> Self {
        let choice = plan.and_then(|p| Report::from_plan(p).choice);
        Self {
            source: Source::Search,
            chosen: plan.map(|p| p.knobs).or(profile.chosen),
            choice,
            data: plan.and_then(|p| p.data.clone()),
            ..Self::from_profile(profile)
        }
    }

    /// The page.
    pub fn to_html(&self) -> String {
        html::page(self)
    }

    /// What the chosen setting measured: a plan's verification, or a profile's last trial of
    /// exactly those knobs.
    pub fn chosen_measurement(&self) -> Option<Measurement> {
        let knobs = self.chosen?;
        self.choice.as_ref().map(|c| c.measured).or_else(|| {
            self.trials
                .iter()
                .rev()
                .filter(|t| t.request.knobs == knobs)
                .find_map(|t| t.outcome.measurement().copied())
        })
    }

    /// The regimes the trials measured, in the order they first appear.
    pub fn regimes(&self) -> Vec<RegimeView> {
        let mut order: Vec<Regime> = Vec::new();
        for t in &self.trials {
            let regime = t.request.knobs.regime();
            if !order.contains(&regime) {
                order.push(regime);
            }
        }
        order
            .into_iter()
            .map(|regime| RegimeView::new(regime, self))
            .collect()
    }
}

/// One regime's trials, fits and verdicts.
#[derive(Debug, Clone, PartialEq)]
pub struct RegimeView {
    /// The regime.
    pub regime: Regime,
    /// Its trials, in order.
    pub trials: Vec<TrialResult>,
    /// Its memory and step-time models (fitted to its trials without accumulation).
    pub fit: RegimeFit,
    /// Whether the chosen setting is of this regime.
    pub chosen: bool,
    /// The fastest trial that fitted within the usable budget: `(micro-batch, tokens/s)`.
    pub best: Option<(usize, f64)>,
    /// The smallest micro-batch that ran out of memory.
    pub first_oom: Option<usize>,
}

impl RegimeView {
    fn new(regime: Regime, report: &Report) -> Self {
        let trials: Vec<TrialResult> = report
            .trials
            .iter()
            .filter(|t| t.request.knobs.regime() == regime)
            .cloned()
            .collect();
        let best = trials
            .iter()
            .filter_map(|t| Some((t.request.knobs.micro_batch, t.outcome.measurement()?)))
            .filter(|(_, m)| report.budget.fits(m))
            .map(|(b, m)| (b, m.tokens_per_s))
            .fold(None, |best: Option<(usize, f64)>, (b, r)| match best {
                Some((_, top)) if top >= r => best,
                _ => Some((b, r)),
            });
        let first_oom = trials
            .iter()
            .filter(|t| matches!(t.outcome, Outcome::OutOfMemory { .. }))
            .map(|t| t.request.knobs.micro_batch)
            .min();
        Self {
            fit: RegimeFit::from_history(regime, &report.trials),
            chosen: report.chosen.is_some_and(|k| k.regime() == regime),
            regime,
            trials,
            best,
            first_oom,
        }
    }

    /// A name for the page's anchors and attributes: the regime's words joined by dashes.
    pub fn slug(&self) -> String {
        self.regime
            .to_string()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect()
    }
}

/// A trial's outcome in words: "fits", "out of GPU memory", "crashed", "timed out after 900 s".
fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Fits(_) => "fits".into(),
        Outcome::OutOfMemory { memory, .. } => format!(
            "out of {} memory",
            match memory {
                crate::trial::MemoryKind::Gpu => "GPU",
                crate::trial::MemoryKind::Host => "host",
            }
        ),
        Outcome::Crashed { .. } => "crashed".into(),
        Outcome::TimedOut { after_s } => format!("timed out after {after_s:.0} s"),
    }
}

#[cfg(test)]
mod tests;
