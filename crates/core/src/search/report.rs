//! Progress events of a search, and the trait that receives them.
//!
//! The library emits events and never prints; a binary renders them (progress bars, JSON lines).

use serde::{Deserialize, Serialize};

use super::decision::{AccumulationRuledOut, Decision, RegimeEnd};
use crate::knobs::{Knobs, Regime};
use crate::trial::{TrialRequest, TrialResult};

/// Why a trial runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// Exploring the search space (always without accumulation).
    Search,
    /// Re-running the best setting exactly as a plan would run it.
    Verify,
    /// Running a setting again, where its timing could not settle a decision (or a check's
    /// verdict).
    Remeasure,
}

/// Something that happened during a search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum Event {
    /// A trial is about to run.
    TrialStarted {
        /// Its position in the history (0-based).
        index: usize,
        /// What it runs.
        request: TrialRequest,
        /// Why.
        purpose: Purpose,
    },
    /// A trial ended (fitted, ran out of memory, or crashed).
    TrialFinished {
        /// Its position in the history.
        index: usize,
        /// What happened.
        result: TrialResult,
        /// Why it ran.
        purpose: Purpose,
        /// Whether it fitted within the budget's usable bytes.
        feasible: bool,
    },
    /// A regime's exploration ended. A regime pruned against a setting that later fails its
    /// verification resumes, and reports again when it ends.
    RegimeDone {
        /// The regime.
        regime: Regime,
        /// How it ended.
        end: RegimeEnd,
        /// Search trials run in it.
        trials: usize,
        /// Its best feasible micro-batch and that setting's measured tokens/s.
        best: Option<(usize, f64)>,
    },
    /// The verification trial of the best setting ended.
    Verified {
        /// Its position in the history.
        index: usize,
        /// The knobs verified.
        knobs: Knobs,
        /// Whether they fitted within the usable bytes; if not, the search goes on without them.
        passed: bool,
    },
    /// A plan will not be verified: accumulating its micro-batches would take its search
    /// trial's peak past the usable bytes (see [`AccumulationRuledOut`]).
    RuledOut(AccumulationRuledOut),
    /// The search is over.
    Finished {
        /// The final decision ([`Decision::Chosen`] or [`Decision::NoFeasible`]).
        decision: Decision,
        /// Trials run, verifications included.
        trials: usize,
    },
}

/// Receives events as they happen.
pub trait Reporter {
    /// Called once per event, in order, on the searching thread.
    fn report(&self, event: &Event);
}

/// Ignores every event.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoReporter;

impl Reporter for NoReporter {
    fn report(&self, _event: &Event) {}
}

/// Any `Fn(&Event)` closure is a reporter.
impl<F: Fn(&Event)> Reporter for F {
    fn report(&self, event: &Event) {
        self(event)
    }
}
