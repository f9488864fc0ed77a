//! The search loop: ask the driver, run the trial, record the result, report, repeat.

use serde::{Deserialize, Serialize};

use super::decision::{Decision, Next, RegimeProgress};
use super::driver::SearchDriver;
use super::report::{Event, Purpose, Reporter};
use crate::knobs::Knobs;
use crate::trial::{Outcome, Prober, TrialResult};
use crate::Result;

/// What a search found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchOutcome {
    /// Every trial in the order it ran, verifications included.
    pub history: Vec<TrialResult>,
    /// The final decision: [`Decision::Chosen`] or [`Decision::NoFeasible`].
    pub decision: Decision,
}

impl SearchOutcome {
    /// The chosen knobs, if any.
    pub fn chosen(&self) -> Option<Knobs> {
        match self.decision {
            Decision::Chosen(knobs) => Some(knobs),
            _ => None,
        }
    }

    /// The verification trial of the chosen knobs: the last trial of the history.
    pub fn verification(&self) -> Option<&TrialResult> {
        let knobs = self.chosen()?;
        self.history.last().filter(|r| r.request.knobs == knobs)
    }
}

/// Runs a search from scratch; see [`resume_search`].
pub fn run_search(
    driver: &SearchDriver,
    prober: &mut dyn Prober,
    reporter: &dyn Reporter,
) -> Result<SearchOutcome> {
    resume_search(driver, Vec::new(), prober, reporter)
}

/// Continues a search from an earlier `history` (e.g. one interrupted, or recorded).
///
/// `prober` runs one trial; an expected outcome (out of memory, a crash) is an `Ok` result, and
/// an `Err` aborts the search. The driver terminates on its own: every search trial is new knobs
/// from a finite space, and every failed verification removes a candidate.
pub fn resume_search(
    driver: &SearchDriver,
    mut history: Vec<TrialResult>,
    prober: &mut dyn Prober,
    reporter: &dyn Reporter,
) -> Result<SearchOutcome> {
    let mut finished = finished_regimes(driver, &history);
    loop {
        let (request, purpose) = match driver.next(&history) {
            Next::Probe(request) if request.remeasure => (request, Purpose::Remeasure),
            Next::Probe(request) => (request, Purpose::Search),
            Next::Done(Decision::Verify(knobs)) => (driver.verify_request(knobs), Purpose::Verify),
            Next::Done(decision) => {
                reporter.report(&Event::Finished {
                    decision: decision.clone(),
                    trials: history.len(),
                });
                return Ok(SearchOutcome { history, decision });
            }
        };
        let index = history.len();
        reporter.report(&Event::TrialStarted {
            index,
            request,
            purpose,
        });
        let result = retimed(prober.probe(&request)?, driver.facts().target_link_gbps);
        let feasible = driver.is_feasible(&result);
        reporter.report(&Event::TrialFinished {
            index,
            result: result.clone(),
            purpose,
            feasible,
        });
        history.push(result);
        if purpose == Purpose::Verify {
            reporter.report(&Event::Verified {
                index,
                knobs: request.knobs,
                passed: feasible,
            });
        }
        if purpose == Purpose::Search {
            // Only this trial's own plan can be newly ruled out.
            let ruled_out = driver.accumulation_ruled_out(&history);
            if let Some(r) = ruled_out.iter().find(|r| r.is_plan_of(&request.knobs)) {
                reporter.report(&Event::RuledOut(*r));
            }
        }
        for (i, state) in driver.regime_states(&history).into_iter().enumerate() {
            let done = matches!(state.progress, RegimeProgress::Finished(_));
            if let (true, false, RegimeProgress::Finished(end)) =
                (done, finished[i], state.progress)
            {
                reporter.report(&Event::RegimeDone {
                    regime: state.regime,
                    end,
                    trials: state.trials,
                    best: state.best,
                });
            }
            finished[i] = done;
        }
    }
}

/// `result` with an offloaded measurement retimed for the target's link, which the search and
/// the recorded history then see.
fn retimed(mut result: TrialResult, target_link_gbps: Option<f64>) -> TrialResult {
    if let Outcome::Fits(m) = &mut result.outcome {
        *m = m.retimed_for_link(target_link_gbps);
    }
    result
}

fn finished_regimes(driver: &SearchDriver, history: &[TrialResult]) -> Vec<bool> {
    driver
        .regime_states(history)
        .iter()
        .map(|s| matches!(s.progress, RegimeProgress::Finished(_)))
        .collect()
}
