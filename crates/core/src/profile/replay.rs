//! `ReplayProber`: answers trials from a recorded profile, without a device.
//!
//! # The rule
//!
//! A request is answered by the first of these that applies:
//!
//! 1. **Recorded**: the profile holds a trial with exactly this request (knobs, trial lengths,
//!    and whether it is a remeasurement: a verification may run as many steps as a
//!    remeasurement did). The `k`-th time a request is asked, the `k`-th recorded trial of that request
//!    answers (the last one once they run out), so a search that asks the recorded sequence
//!    gets the recorded results back in order, even when a verification repeats a search
//!    trial's request. A replay of the recording's search therefore reaches the recorded
//!    decision.
//! 2. **Same knobs**: a recorded trial with the same knobs but other trial lengths: the latest
//!    one answers, under the request asked (its `timed_steps` still say what was measured).
//! 3. **Predicted**: a trial of a recorded regime at another micro-batch or accumulation is
//!    synthesised from that regime's fits ([`RegimeFit`], trials without accumulation):
//!    - out of memory if a recorded trial of the regime ran out of memory at a micro-batch no
//!      larger (with accumulation only if this one accumulates too), since memory grows with
//!      the micro-batch and accumulation only adds to it;
//!    - out of memory if the memory model predicts a peak above the profile's budget limits
//!      (the full bytes, where the recording's prober failed, not the usable ones);
//!    - otherwise it fits, with the predicted peaks, `accum ×` the predicted micro-batch step
//!      time, a zero spread, and the requested timed steps. Beyond the regime's largest
//!      recorded micro-batch the step time is at least proportional to the batch from there
//!      (throughput no higher than recorded at the top): a fit through small batches, where
//!      the device is idle and step time flat, would otherwise predict runaway throughput
//!      (checkpointing recorded at 1–4 sequences, asked at 300). Accumulation's extra gradient
//!      buffer is not modelled (no fit sees it), so a predicted accumulating trial is
//!      optimistic by that buffer.
//!
//!    A predicted trial's `wall_s` estimates what it would have cost on the recorded machine,
//!    so that a replay's summed `wall_s` is the search's cost, not just its timed steps: a
//!    trial that fits takes its steps at the predicted step time plus the median, over the
//!    regime's recorded trials that fitted, of their wall time less their steps (building the
//!    model, the evaluation pass, the checkpoint dry run); one that runs out of memory takes
//!    the median wall time of the regime's recorded out-of-memory trials (of the profile's, if
//!    the regime has none), since it fails in its first step.
//! 4. **Not in profile**: otherwise (an unrecorded regime, or one with fewer than two fitting
//!    micro-batches) the trial is answered as crashed with a reason that says so, which the
//!    search treats as infeasible.
//!
//! Nothing here reads a clock or a random source, so answers depend only on the profile and
//! the sequence of requests.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::record::Profile;
use crate::fit::RegimeFit;
use crate::knobs::{Knobs, Regime};
use crate::trial::{Measurement, MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult};

/// How a replayed trial was answered (see the module docs for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    /// A recorded trial of exactly this request.
    Recorded,
    /// A recorded trial of the same knobs with other trial lengths.
    SameKnobs,
    /// Synthesised from the regime's fitted models and recorded out-of-memory trials.
    Predicted,
    /// Nothing in the profile answers it; the result is a crash that says so.
    NotInProfile,
}

/// A replayed trial and how it was answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Replayed {
    /// The result, with the request as asked.
    pub result: TrialResult,
    /// Where it came from.
    pub answer: Answer,
}

/// What makes two requests the same trial: the knobs, the steps, and whether it is a
/// remeasurement. A verification can ask for as many steps as a recorded remeasurement ran, and
/// answered with it, the driver would take it for a remeasurement and ask again.
type RequestKey = (Knobs, usize, usize, bool);

fn key(request: &TrialRequest) -> RequestKey {
    (
        request.knobs,
        request.warmup_steps,
        request.timed_steps,
        request.remeasure,
    )
}

/// Answers trials from a recorded profile; see the module docs for the rule.
#[derive(Debug, Clone)]
pub struct ReplayProber {
    profile: Profile,
    /// Times each request has been asked so far.
    asked: HashMap<RequestKey, usize>,
    /// Fits per regime, computed on first use (a fit runs an iterative solver).
    fits: HashMap<Regime, RegimeFit>,
}

impl ReplayProber {
    /// A prober answering from `profile`.
    pub fn new(profile: Profile) -> Self {
        Self {
            profile,
            asked: HashMap::new(),
            fits: HashMap::new(),
        }
    }

    /// The profile answered from.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Answers one trial (never an error: a trial the profile cannot answer is a crash).
    pub fn answer(&mut self, request: &TrialRequest) -> TrialResult {
        self.replay(request).result
    }

    /// Answers one trial and says how.
    pub fn replay(&mut self, request: &TrialRequest) -> Replayed {
        let occurrence = {
            let count = self.asked.entry(key(request)).or_insert(0);
            *count += 1;
            *count - 1
        };
        let exact: Vec<&TrialResult> = self
            .profile
            .trials
            .iter()
            .filter(|r| key(&r.request) == key(request))
            .collect();
        if let Some(recorded) = exact.get(occurrence.min(exact.len().saturating_sub(1))) {
            return Replayed {
                result: (*recorded).clone(),
                answer: Answer::Recorded,
            };
        }
        let same_knobs = self
            .profile
            .trials
            .iter()
            .rev()
            .find(|r| r.request.knobs == request.knobs);
        if let Some(recorded) = same_knobs {
            return Replayed {
                result: TrialResult {
                    request: *request,
                    ..recorded.clone()
                },
                answer: Answer::SameKnobs,
            };
        }
        let (outcome, answer) = self.predict(request);
        let wall_s = self.predicted_wall_s(request, &outcome);
        Replayed {
            result: TrialResult {
                request: *request,
                outcome,
                wall_s,
            },
            answer,
        }
    }

    /// `fitted_s`, the step time the fit predicts at micro-batch `b`, but no less than the
    /// regime's largest recorded micro-batch `b_top` takes per sequence once `b` is beyond it:
    /// `t(b_top) · b / b_top` (see the module docs).
    fn capped_step_time_s(&self, regime: Regime, b: usize, fitted_s: f64) -> f64 {
        let top = crate::fit::samples(regime, &self.profile.trials)
            .into_iter()
            .max_by_key(|(micro_batch, _)| *micro_batch);
        match top {
            Some((b_top, m)) if b > b_top => {
                fitted_s.max(m.step_time_median_s * b as f64 / b_top as f64)
            }
            _ => fitted_s,
        }
    }

    /// What a predicted trial would have cost on the recorded machine (see the module docs).
    fn predicted_wall_s(&self, request: &TrialRequest, outcome: &Outcome) -> f64 {
        let regime = request.knobs.regime();
        let trials = &self.profile.trials;
        let of_regime = || trials.iter().filter(|r| r.request.knobs.regime() == regime);
        let out_of_memory = |r: &&TrialResult| matches!(r.outcome, Outcome::OutOfMemory { .. });
        match outcome.measurement() {
            Some(m) => {
                let steps = |r: &TrialRequest| (r.warmup_steps + r.timed_steps) as f64;
                let overheads = of_regime().filter_map(|r| {
                    let recorded = r.outcome.measurement()?;
                    Some((r.wall_s - recorded.step_time_median_s * steps(&r.request)).max(0.0))
                });
                m.step_time_median_s * steps(request) + median(overheads.collect())
            }
            None => {
                let regime_ooms: Vec<f64> = of_regime()
                    .filter(out_of_memory)
                    .map(|r| r.wall_s)
                    .collect();
                if regime_ooms.is_empty() {
                    median(
                        trials
                            .iter()
                            .filter(out_of_memory)
                            .map(|r| r.wall_s)
                            .collect(),
                    )
                } else {
                    median(regime_ooms)
                }
            }
        }
    }

    fn predict(&mut self, request: &TrialRequest) -> (Outcome, Answer) {
        let knobs = request.knobs;
        let (b, accum) = (knobs.micro_batch, knobs.grad_accum.max(1));
        let regime = knobs.regime();
        let accumulates = |k: &Knobs| k.grad_accum > 1;
        let earlier_oom = self
            .profile
            .trials
            .iter()
            .filter(|r| r.request.knobs.regime() == regime && r.request.knobs.micro_batch <= b)
            .filter(|r| !accumulates(&r.request.knobs) || accumulates(&knobs))
            .find_map(|r| match r.outcome {
                Outcome::OutOfMemory { memory, phase } => Some((memory, phase)),
                _ => None,
            });
        if let Some((memory, phase)) = earlier_oom {
            return (Outcome::OutOfMemory { memory, phase }, Answer::Predicted);
        }
        let trials = &self.profile.trials;
        let fit = self
            .fits
            .entry(regime)
            .or_insert_with(|| RegimeFit::from_history(regime, trials));
        let (Some(memory), Some(time)) = (fit.memory.as_ref(), fit.time) else {
            let reason = format!(
                "replay: {knobs} is not in the recorded profile, and regime {regime} has fewer \
                 than two fitting micro-batches there to predict it from"
            );
            return (Outcome::Crashed { reason }, Answer::NotInProfile);
        };
        let budget = &self.profile.budget;
        let peak = memory.predict(b);
        let bytes = |v: f64| v.max(0.0).round() as u64;
        let gpu = budget.gpu_bytes.map_or(0, |_| bytes(peak.gpu_bytes));
        let host = bytes(peak.host_bytes);
        // The order and phases are those of the simulator: the device fails first, in the
        // forward and backward passes; the host in the optimizer step, where offload allocates.
        if budget.gpu_bytes.is_some_and(|limit| gpu > limit) {
            let oom = Outcome::OutOfMemory {
                memory: MemoryKind::Gpu,
                phase: Phase::ForwardBackward,
            };
            return (oom, Answer::Predicted);
        }
        if host > budget.host_bytes {
            let oom = Outcome::OutOfMemory {
                memory: MemoryKind::Host,
                phase: Phase::OptimizerStep,
            };
            return (oom, Answer::Predicted);
        }
        let step = self.capped_step_time_s(regime, b, time.step_time_s(b)) * accum as f64;
        let tokens = (b * accum * self.profile.model.seq_len) as f64;
        let measurement = Measurement {
            peak_gpu_bytes: gpu,
            peak_host_bytes: host,
            step_time_median_s: step,
            step_time_spread: 0.0,
            timed_steps: request.timed_steps,
            tokens_per_s: if step > 0.0 { tokens / step } else { 0.0 },
            host_link: None,
        };
        (Outcome::Fits(measurement), Answer::Predicted)
    }
}

/// The median of `values` (the upper one of an even count); 0 when there are none.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

impl Prober for ReplayProber {
    fn probe(&mut self, request: &TrialRequest) -> crate::Result<TrialResult> {
        Ok(self.answer(request))
    }
}
