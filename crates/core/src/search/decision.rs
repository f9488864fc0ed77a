//! What the search driver answers: the next action, the decision, and each regime's state.

use serde::{Deserialize, Serialize};

use crate::knobs::{Knobs, Regime};
use crate::trial::{Measurement, TrialRequest};

/// What to do next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Next {
    /// Run this search trial and add its result to the history.
    Probe(TrialRequest),
    /// Exploration is over; see the decision.
    Done(Decision),
}

/// The outcome of exploration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// These knobs (with the real accumulation) are the best found: run
    /// [`SearchDriver::verify_request`](super::driver::SearchDriver::verify_request) for them, add the result to the history, and ask again.
    Verify(Knobs),
    /// These knobs were verified: the final answer.
    Chosen(Knobs),
    /// No setting is feasible; the hint says what ran out and what to try.
    NoFeasible {
        /// One or two sentences for the user.
        hint: String,
    },
}

impl Decision {
    /// Whether this ends the search (everything but [`Decision::Verify`]).
    pub fn is_final(&self) -> bool {
        !matches!(self, Decision::Verify(_))
    }
}

/// How a regime's exploration ended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum RegimeEnd {
    /// The largest feasible micro-batch is known exactly: the next candidate is infeasible.
    Boundary {
        /// The largest feasible micro-batch.
        largest: usize,
    },
    /// Even the largest candidate micro-batch is feasible.
    AllFit {
        /// The largest candidate.
        largest: usize,
    },
    /// Not even the smallest candidate is feasible.
    NothingFits,
    /// Growth stopped: doubling the micro-batch raised throughput by less than the space's
    /// `saturation_gain`, so larger batches would only cost memory.
    Saturated {
        /// The largest micro-batch probed.
        largest: usize,
        /// Relative throughput gain of the last doubling (negative when it got slower).
        gain: f64,
    },
    /// Not probed: the regime only trades speed for memory (checkpointing, offload), and an
    /// earlier regime of the same precision without either stopped growing before memory ran
    /// out (saturated, or every candidate fit). At every micro-batch this regime does at least
    /// that regime's work, and larger batches were already found not to pay.
    Dominated {
        /// The dominating regime's index in the space's priority order.
        by: usize,
    },
    /// Stopped before the boundary was found: an optimistic bound on the open micro-batches'
    /// throughput is within [`RESOLUTION_GAIN`](super::driver::RESOLUTION_GAIN) of the regime's
    /// own best, so a larger batch would buy at most timing noise.
    Converged {
        /// The largest feasible micro-batch.
        largest: usize,
        /// The optimistic bound on the open micro-batches, tokens/s.
        upper_bound_tokens_per_s: f64,
        /// The regime's best measured throughput, tokens/s.
        best_tokens_per_s: f64,
    },
    /// Stopped early: an optimistic bound on its throughput is below the best found earlier.
    Pruned {
        /// Largest feasible micro-batch when pruned (0 if none).
        largest: usize,
        /// The optimistic bound, tokens/s.
        upper_bound_tokens_per_s: f64,
        /// The best measured in an earlier regime, tokens/s.
        best_tokens_per_s: f64,
    },
}

/// Where a regime stands.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RegimeProgress {
    /// Not probed yet.
    Waiting,
    /// Being explored: this micro-batch is the next to probe.
    Exploring {
        /// The next micro-batch.
        next_micro_batch: usize,
    },
    /// A search trial is run again: its timing could not settle whether growth stopped.
    Remeasuring {
        /// Its micro-batch.
        micro_batch: usize,
        /// Timed steps of the new run.
        timed_steps: usize,
    },
    /// Explored.
    Finished(RegimeEnd),
}

/// One regime's state, for progress reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RegimeState {
    /// The regime.
    pub regime: Regime,
    /// Where it stands.
    pub progress: RegimeProgress,
    /// Search trials run in it.
    pub trials: usize,
    /// Its best feasible micro-batch and that setting's measured tokens/s.
    pub best: Option<(usize, f64)>,
}

/// A feasible setting measured during the search.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The knobs a plan would run (with the real accumulation).
    pub knobs: Knobs,
    /// The search trial's measurement (without accumulation).
    pub measurement: Measurement,
    /// Position of that trial in the history.
    pub history_index: usize,
}

/// A plan the search does not verify: its search trial fitted, but the f32 sum of gradients
/// that accumulation holds through the step would take its device peak past the usable bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccumulationRuledOut {
    /// The plan's knobs (with the real accumulation).
    pub knobs: Knobs,
    /// The search trial's measured device peak (without accumulation), bytes.
    pub measured_gpu_bytes: u64,
    /// What accumulation adds, by the estimate, bytes.
    pub added_bytes: f64,
}

impl AccumulationRuledOut {
    /// Whether this is the plan of the search trial that ran `trial` (its regime and
    /// micro-batch, without accumulation).
    pub fn is_plan_of(&self, trial: &Knobs) -> bool {
        self.knobs.regime() == trial.regime() && self.knobs.micro_batch == trial.micro_batch
    }
}
