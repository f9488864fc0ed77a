//! `SearchDriver`: the pure decision of what to probe next, from the history of trials so far.
//!
//! # Strategy
//!
//! Regimes are explored one at a time, in the space's priority order. Within a regime, with the
//! micro-batch ranging over the space's candidates:
//!
//! 1. **Grow**: probe the start candidate, then repeatedly the smallest candidate at least
//!    twice the largest feasible one (and at least the bases' reach, see below), until one is
//!    infeasible or the largest candidate fits.
//! 2. **Jump**: fit the affine memory model through the two largest measured micro-batches
//!    and probe its predicted largest fitting micro-batch `b*` (rounded down to a candidate,
//!    kept strictly between the largest feasible and the smallest infeasible micro-batch).
//! 3. **Pin**: probe the candidate next to the new bracket edge (`b*+1` after a fit, `b*−1`
//!    after a miss). With an exact law the boundary is now known.
//! 4. **Correct**: once more, the secant through the two largest measured micro-batches.
//!    Device memory bends a little near the boundary (the memory pool reserves in chunks), so
//!    the jump and the pin can both land a step off; the secant through them then lands on the
//!    boundary (gpt-124m: 26 and 25 fitted only inside the headroom, the secant gave 24, which
//!    fits), where bisection of the rest would take three more trials.
//! 5. **Bisect**: after those three model-guided trials, halve the open bracket of candidates.
//! 6. **Look past a soft boundary**: when the bracket closes on a micro-batch that fitted the
//!    device but peaked above the headroom (not an out-of-memory), and the step up to it is
//!    out of line with the growth below (more than twice the secant's slope there, or no
//!    growth to judge by), one trial at twice it checks that memory really grows past it. It
//!    does not always: llama-3.1-8b with compact state on the 24 GB card peaked above the
//!    headroom at batch 2 and below it at batch 4. A fit there reopens the regime from it; a
//!    miss closes it where it was.
//!
//! A trial is *feasible* when it fitted and its peaks stay within the budget's usable bytes
//! (the headroom); an out-of-memory, a crash, or a fit above the usable bytes is infeasible.
//! Feasibility is assumed monotone in the micro-batch (but for step 6), so the bracket's lower
//! edge ends as the **exact** largest feasible candidate.
//!
//! Growth also stops when neither of the last two doublings is shown to raise throughput by
//! the space's `saturation_gain` (the regime is *saturated*): past that point a larger batch
//! buys memory pressure, not speed, and the boundary need not be found. Two, because one short
//! trial's timing can be off by more than the threshold; *shown*, beyond the gain's 95 %
//! interval, so that growth on a noisy device goes on only as far as it measurably pays (see
//! Noise).
//!
//! # Regimes that add memory savings
//!
//! A regime's *bases* are the earlier regimes of the same precision with a subset of its memory
//! savings (plain is a base of checkpointing, offload and both; checkpointing and offload are
//! bases of both). Checkpointing buys device memory with recompute, offload with host work:
//! what such a regime is for is the micro-batches its bases cannot run.
//!
//! - **Dominated**: it is not probed at all when a base that saves nothing stopped growing
//!   before its memory boundary (saturated, or every candidate fit): it would run the same
//!   micro-batches with more work each, and larger ones were already found not to pay.
//! - **Start**: otherwise it grows from its bases' *reach*, the largest micro-batch any base
//!   ran feasibly (or the space's start, if larger), not from the space's start. An offloaded
//!   regime whose offload twin ran first trials the space's start once before that: the
//!   cheapest step measures its host work, which usually prunes it there (see Pruning).
//!   Assumption: the regime's throughput does not fall as the batch grows up to its bases'
//!   reach, so nothing below it beats what is measured from there on. That holds when its
//!   extra step time over a base is a constant (the host-side optimizer) plus a term growing
//!   with the batch (recompute), given that the base's throughput was still rising there (else
//!   the base would dominate it). It does not need the regime to be slower than its base at
//!   equal batches, which is not always so: on the gpt-124m recording checkpointing ran 3–13 %
//!   faster than the plain regime at micro-batches 4–16, while rising monotonically with the
//!   batch. If the first trial does not fit (offload can run out of host memory), the bracket
//!   below it is refined as usual.
//!
//! An fp8 regime (the same training with its blocks' products in fp8) has its bf16 twin as a
//! base in this one sense: it starts at the twin's largest feasible batch, where it fits too
//! (its activations and state are the twin's), and shares the twin's memory secant.
//!
//! # Pruning
//!
//! A regime stops early (is *pruned*) when even an optimistic bound on its throughput, raised by
//! [`PRUNE_SLACK`] for timing noise, cannot beat the best setting measured in an earlier regime.
//! The bound covers every unprobed micro-batch `b` above the largest feasible one `lo`, up to a
//! *reach*: twice the memory model's predicted boundary (the secant through the two largest
//! feasible trials; an offloaded regime with a single feasible trial takes its offload twin's
//! bytes per sequence through that trial, since offload moves optimizer state, not
//! activations), or the largest candidate without a model. It is the smallest of:
//!
//! - `tokens_per_s(lo) · b / lo`: step time does not fall as the batch grows;
//! - what the step-time secant through the two largest feasible trials predicts: step time
//!   grows at least linearly once the device is busy;
//! - for an offloaded regime whose *offload twin* (the same regime without offload) ran
//!   earlier, `tokens · b / (c·b + h)`: the offloaded step runs the twin's passes plus host
//!   work `h` that neither overlaps them nor depends on the batch (each gradient copy waits
//!   for the device, then the update runs on the host); `h` is the offloaded trial's step time
//!   minus the twin's at a batch at least as large, and `c` the twin's smallest rise of step
//!   time per sequence over a doubling of the batch in its upper range. This ends an offloaded
//!   regime after its first trial: on the gpt-124m recording the host work is 0.45 s per step,
//!   against 0.2–0.45 s for a whole plain or checkpointed step at the boundary.
//!
//! Each bound's premises are stated where it is computed (`driver/bound.rs`).
//!
//! # Convergence
//!
//! The same bound ends a regime against its own best: when no open micro-batch up to the
//! reach can raise the regime's best measured throughput by [`RESOLUTION_GAIN`], the regime
//! has *converged* and its bracket (between a feasible and an infeasible micro-batch) is left
//! open. Gains that small are inside a short trial's timing noise, so refining the boundary
//! further would pick among equals at a trial each (gpt-1.3b: 3–4 s per trial near its
//! boundary), and the smaller batch keeps more headroom.
//! A space whose `saturation_gain` is 0 asks for each regime's exact memory boundary, and
//! then no regime converges early either.
//!
//! # Choice and verification
//!
//! When every regime is finished, the feasible search trials are ranked by measured tokens/s
//! (throughput with accumulation equals throughput of one micro-batch, since a step of `a`
//! micro-batches is predicted to take `a` times as long), except that the largest micro-batch
//! of the best's regime within [`RESOLUTION_GAIN`] of it comes first: the trials cannot tell
//! them apart, and throughput does not fall as the batch grows. The best is returned as
//! [`Decision::Verify`]: the caller runs [`SearchDriver::verify_request`] once, with the real
//! accumulation and longer timing, and adds the result to the history. Only a verified setting
//! becomes [`Decision::Chosen`]; a failed verification excludes that setting and the search
//! continues (a regime pruned against it may resume). The verification decides feasibility
//! only: its throughput is what a plan reports as measured, but the ranking stays that of the
//! search trials, which all ran the same way.
//!
//! With a global batch, a plan at a smaller micro-batch accumulates, and accumulation holds an
//! f32 sum of every gradient through the step, which its search trial did not. Where the facts
//! give what that adds (the estimate's plan peak over its trial's, per micro-batch), a plan
//! whose trial's measured peak plus [`ACCUMULATION_TRUST`] of it exceeds the usable bytes is
//! ruled out without a verification, as if its verification had failed
//! ([`SearchDriver::accumulation_ruled_out`]). gpt-1.3b with 32 sequences a step on the 24 GB
//! card verified five accumulated plans that ran out of memory (mb 4 × 8 peaks 22.43 GiB
//! without accumulation, and the estimate adds 5.5 GiB), before its offloaded plan.
//!
//! # Noise
//!
//! Each trial keeps its spread, and from it the error of its median
//! ([`Measurement::relative_error`]): a few short steps on a busy CPU can be off by tens of
//! percent, where the decisions above turn on a few. Where a decision rests on a difference
//! the trials cannot resolve, the trial is run again with more steps
//! ([`RegimeProgress::Remeasuring`], a request with `remeasure` set), and its runs are pooled
//! ([`Measurement::pooled`]) wherever the driver reads it:
//!
//! - **Saturation**: a doubling whose gain's 95 % interval straddles the threshold, before
//!   growth is decided. Once its runs are spent, growth that is not shown to pay stops.
//! - **Convergence**: before a regime converges, its largest feasible micro-batch that measured
//!   slower than a smaller one beyond the tie band: the bound that ends the regime starts from
//!   it, and throughput does not fall as the batch grows, so one of the two was off (on the
//!   PyTorch harness, gpt-124m at 20 sequences measured 171.9k tokens/s against 202.6k at 16
//!   in its first trial and 191.4k when run again; the first figure alone ended the regime).
//! - **Choice**: before verifying, a setting of another regime that the best cannot be told
//!   apart from, or a larger batch of its own regime that measured slower beyond the tie band
//!   (throughput does not fall as the batch grows, so one of the two was off), or a smaller
//!   batch of its own regime that measured faster than the best's interval reaches (the best
//!   leads only as the largest within the tie band, and near the memory boundary a larger
//!   batch can run slower: on the harness on an H200, 20 sequences ran at 177k-200k tokens/s
//!   against 217k-220k at 16).
//!
//! The premise behind the convergence rule and the choice's larger-batch rule yields to
//! evidence: once both settings have been run again and still measure apart beyond their band,
//! the difference stands and neither is run again for it (on the harness on an H100, 20 and 16
//! agreed with their first runs when repeated, and two more runs of each changed nothing).
//!
//! The run of the pair taken fewer times goes first, then the noisier; each setting runs at most
//! [`MAX_REMEASURES`] more times, with enough steps to resolve the
//! difference at the measured spread, within bounds (`remeasure::steps_to_resolve`). In the
//! ranking, the largest micro-batch of the best's regime counts as tied with it within the
//! 95 % interval of their difference, where that is wider than [`RESOLUTION_GAIN`]. On a
//! simulated device whose trials scatter by 2 % and their steps by 10 % more, 17 of 20 seeded
//! searches chose the best setting, and the rest settings within the interval they stated;
//! without remeasurement, 10 did (`tests/noise.rs`). Trials of a quiet GPU scatter little, so
//! they are seldom run again.
//!
//! # Probe count
//!
//! Search trials never repeat knobs, but as remeasurements (at most
//! [`MAX_REMEASURES`] per setting, not counted below). Per regime
//! the count is at most
//! [`SearchDriver::regime_trial_bound`]; for candidates `1..=M` and a boundary `B` with
//! `2^k ≤ B < 2^(k+1) ≤ M` that is `2k + 5` (growth `k + 2`, three model-guided trials,
//! bisection of at most `2^k − 4` open candidates in `k` trials), and `k + 4` when memory
//! follows the affine law exactly (the jump and the pin find the boundary). A regime that grows
//! from its bases' reach `s` and fits there takes no more than that; one that does not fit
//! there refines the `s − 1` candidates below, in at most `4 + ⌈log2(s − 3)⌉` trials. An
//! offloaded regime may add one trial at the space's start before it grows from `s`; when its
//! host work rules it out, that trial is its only one. Add one verification, plus one per
//! failed verification. Example: a memory law of 1 GiB + 37 MiB per sequence against 10 GiB
//! with 5 % headroom takes the 11 trials 1, 2, 4, …, 128, 256 (out of memory), 235 (fits), 236
//! (inside the headroom), then verifies 235.

use std::collections::HashSet;

use super::decision::{
    AccumulationRuledOut, Candidate, Decision, Next, RegimeEnd, RegimeProgress, RegimeState,
};
use super::facts::MachineFacts;
use super::hint::no_feasible_hint;
use super::relatives;
use super::space::SearchSpace;
use crate::fit::{Capacity, MemoryModel};
use crate::knobs::Knobs;
use crate::spec::budget::Budget;
use crate::trial::{Measurement, Outcome, TrialRequest, TrialResult};
use crate::Result;
pub use remeasure::MAX_REMEASURES;
use remeasure::{Remeasure, Remeasures, Saturation};

/// Slack on the pruning bound: a regime is pruned only when its optimistic throughput, raised
/// by this fraction to cover timing noise, is still below the best measured elsewhere.
pub const PRUNE_SLACK: f64 = 0.05;

/// The smallest throughput gain a regime's open micro-batches must be able to bring for the
/// search to probe them (see the module docs, "Convergence"): below the timing resolution of a
/// search trial. On the 2026-12-04 gpt-1.3b recording
/// (`benches/results/archive/2026-12-04-h200-gpt-1.3b-converged/`), micro-batches 32 to 38
/// with checkpointing measured 39.4k to 40.4k tokens/s in no monotone order, a spread of 2 %
/// where the device's work per sequence is constant.
pub const RESOLUTION_GAIN: f64 = 0.01;

/// The share of the estimate's accumulation bytes counted against a plan before its
/// verification is skipped (see the module docs, "Choice and verification"): the estimate's
/// phases are within a few percent of the recordings, and skipping a plan that would have fit
/// loses more than one quick out-of-memory trial costs.
pub const ACCUMULATION_TRUST: f64 = 0.9;

/// How far past the memory model's predicted boundary the pruning bound still looks (see
/// the module docs, "Pruning").
const MEMORY_REACH_FACTOR: usize = 2;

/// Model-guided trials per regime before falling back to bisection: the jump, the pin and the
/// correction.
const MODEL_GUIDED_PROBES: usize = 3;

/// The pure search policy: history in, next action out. See the module docs for the strategy.
#[derive(Debug, Clone)]
pub struct SearchDriver {
    space: SearchSpace,
    facts: MachineFacts,
    budget: Budget,
    candidates: Vec<usize>,
}

/// One regime's search trials: `(history index, result)` in history order.
type Trials<'h> = [(usize, &'h TrialResult)];

/// Where a regime's boundary can still be: above the largest feasible micro-batch `lo` (0 if
/// none fitted) and below the smallest infeasible one above it, `hi`, if any.
struct Bracket {
    lo: usize,
    hi: Option<usize>,
    /// The candidates strictly inside the bracket, ascending.
    open: Vec<usize>,
}

/// The next trial of a regime: micro-batch `b`.
fn explore(b: usize) -> RegimeProgress {
    RegimeProgress::Exploring {
        next_micro_batch: b,
    }
}

/// What earlier regimes of the space tell about one regime (see [`relatives`]).
struct RelativeTrials<'a, 'h> {
    /// Where the regime's first trial goes (before rounding up to a candidate).
    start: usize,
    /// The largest micro-batch that a base of the regime (the same training with fewer memory
    /// savings), or its bf16 twin for an fp8 regime, ran feasibly; 0 if none did. Growth does
    /// not probe below it.
    bases_reach: usize,
    /// The search trials of the regime's offload twin, when the regime offloads and its twin
    /// was searched before it.
    offload_twin: Option<&'a Trials<'h>>,
    /// The search trials of the earlier regimes that are bases of the offload twin.
    twin_bases: Vec<&'a Trials<'h>>,
    /// The search trials of the earlier regimes with the same activations per sequence (see
    /// [`relatives::same_activations`]): their memory secants bound how fast this regime's
    /// device memory grows with the batch.
    activation_peers: Vec<&'a Trials<'h>>,
}

/// The history sorted into search trials per regime and verification results.
pub(super) struct SortedHistory<'h> {
    /// Per regime of the space (same order): `(history index, result)` of its search trials.
    pub(super) search: Vec<Vec<(usize, &'h TrialResult)>>,
    /// Search trials in total (those of regimes outside the space included).
    pub(super) search_count: usize,
    /// Verified knobs and whether the verification passed.
    pub(super) verifications: Vec<(Knobs, bool)>,
    /// How many times each search trial's knobs were run again.
    pub(super) remeasures: Remeasures,
}

impl SearchDriver {
    /// A driver for `space`, knowing `facts`, under `budget`; all three are validated.
    pub fn new(space: SearchSpace, facts: MachineFacts, budget: Budget) -> Result<Self> {
        space.validate()?;
        facts.validate(space.regimes.len())?;
        budget.validate()?;
        let candidates = space.candidates();
        Ok(Self {
            space,
            facts,
            budget,
            candidates,
        })
    }

    /// The space searched.
    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// What the search assumes of the machine and the target.
    pub fn facts(&self) -> &MachineFacts {
        &self.facts
    }

    /// The budget a setting must fit.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The verification trial for knobs returned in [`Decision::Verify`].
    pub fn verify_request(&self, knobs: Knobs) -> TrialRequest {
        self.space.verify_request(knobs)
    }

    /// Whether a result counts as feasible: it fitted within the budget's usable bytes.
    pub fn is_feasible(&self, result: &TrialResult) -> bool {
        result
            .outcome
            .measurement()
            .is_some_and(|m| self.budget.fits(m))
    }

    /// What to do next, given every result so far in the order they were obtained.
    pub fn next(&self, history: &[TrialResult]) -> Next {
        let pooled = remeasure::pooled_history(history);
        let sorted = self.sorted(&pooled);
        let limit_reached = self
            .space
            .max_trials
            .is_some_and(|max| sorted.search_count >= max);
        if !limit_reached {
            for (i, state) in self.survey(&sorted).iter().enumerate() {
                match state.progress {
                    RegimeProgress::Exploring { next_micro_batch } => {
                        let regime = self.space.regimes[i];
                        return Next::Probe(self.space.search_request(regime, next_micro_batch));
                    }
                    RegimeProgress::Remeasuring {
                        micro_batch,
                        timed_steps,
                    } => {
                        let knobs = Knobs::with_batch(self.space.regimes[i], micro_batch, 1);
                        return Next::Probe(
                            self.remeasure_request(Remeasure { knobs, timed_steps }),
                        );
                    }
                    _ => {}
                }
            }
        }
        let ranked = self.ranked(&sorted);
        if !limit_reached {
            if let Some(again) = self.choice_remeasure(&ranked, &pooled, &sorted.remeasures) {
                return Next::Probe(self.remeasure_request(again));
            }
        }
        let passed: Vec<Knobs> = sorted
            .verifications
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(k, _)| *k)
            .collect();
        Next::Done(match ranked.first() {
            Some(best) if passed.contains(&best.knobs) => Decision::Chosen(best.knobs),
            Some(best) => Decision::Verify(best.knobs),
            None => Decision::NoFeasible {
                hint: no_feasible_hint(self, &sorted, limit_reached),
            },
        })
    }

    /// Every regime's state after `history`, in priority order.
    pub fn regime_states(&self, history: &[TrialResult]) -> Vec<RegimeState> {
        self.survey(&self.sorted(&remeasure::pooled_history(history)))
    }

    /// Feasible settings measured in `history`, best first (tokens/s, then regime priority,
    /// then smaller micro-batch), without those whose verification failed. Remeasured settings
    /// carry their pooled measurement.
    pub fn candidates(&self, history: &[TrialResult]) -> Vec<Candidate> {
        self.ranked(&self.sorted(&remeasure::pooled_history(history)))
    }

    /// The trial that runs a search trial's knobs again, with the steps asked for.
    fn remeasure_request(&self, again: Remeasure) -> TrialRequest {
        TrialRequest {
            timed_steps: again.timed_steps.min(crate::trial::MAX_TRIAL_STEPS),
            remeasure: true,
            ..self
                .space
                .search_request(again.knobs.regime(), again.knobs.micro_batch)
        }
    }

    /// The most search trials one regime can take: the worst case over where it grows from
    /// (the space's start, or any larger candidate where its bases stopped, see the module
    /// docs) and over where the growth phase meets its first infeasible candidate, of the
    /// growth trials plus the refinement of that bracket (three model-guided trials, then
    /// bisection). An offloaded regime with a twin in the space may add one trial at the
    /// space's start before it grows from its bases' reach.
    pub fn regime_trial_bound(&self) -> usize {
        let regimes = &self.space.regimes;
        let offload_first = (0..regimes.len()).any(|i| {
            regimes[..i]
                .iter()
                .any(|&earlier| relatives::is_offload_twin(earlier, regimes[i]))
        });
        let first = self
            .candidates
            .partition_point(|&b| b < self.space.start_micro_batch);
        (first..self.candidates.len())
            .map(|from| self.probe_bound_from(from) + usize::from(offload_first && from > first))
            .max()
            .unwrap_or(0)
    }

    /// [`Self::regime_trial_bound`] for a regime whose first trial is candidate `start` (an
    /// index).
    fn probe_bound_from(&self, start: usize) -> usize {
        let c = &self.candidates;
        // Growth chain as indices into the candidates.
        let mut chain = vec![start];
        while let Some(&last) = chain.last() {
            if last + 1 >= c.len() {
                break;
            }
            chain.push(c.partition_point(|&b| b < 2 * c[last]).min(c.len() - 1));
        }
        // Open candidates below the first probed one (the start fails), or between chain links.
        let mut worst = 1 + refinement_bound(start);
        for j in 1..chain.len() {
            let open = chain[j] - chain[j - 1] - 1;
            worst = worst.max(j + 1 + refinement_bound(open));
        }
        // One trial past a boundary set by a fit above the headroom (step 6).
        worst.max(chain.len()) + 1
    }

    pub(super) fn sorted<'h>(&self, history: &'h [TrialResult]) -> SortedHistory<'h> {
        let mut sorted = SortedHistory {
            search: vec![Vec::new(); self.space.regimes.len()],
            search_count: 0,
            verifications: Vec::new(),
            remeasures: Remeasures::new(),
        };
        let mut seen = HashSet::new();
        for (index, result) in history.iter().enumerate() {
            let knobs = result.request.knobs;
            // Pooled into the search trial it repeats (see `remeasure::pooled_history`).
            if result.request.remeasure {
                sorted.search_count += 1;
                *sorted.remeasures.entry(knobs).or_default() += 1;
                continue;
            }
            // The driver asks for search trials only without accumulation and never twice, so
            // anything else is a verification.
            if knobs.grad_accum != 1 || !seen.insert(knobs) {
                sorted.verifications.push((knobs, self.is_feasible(result)));
                continue;
            }
            sorted.search_count += 1;
            let regime = self.space.regimes.iter().position(|r| *r == knobs.regime());
            if let Some(i) =
                regime.filter(|_| self.candidates.binary_search(&knobs.micro_batch).is_ok())
            {
                sorted.search[i].push((index, result));
            }
        }
        sorted
    }

    /// What the regimes before regime `i` tell about it.
    fn relative_trials<'a, 'h>(
        &self,
        sorted: &'a SortedHistory<'h>,
        i: usize,
    ) -> RelativeTrials<'a, 'h> {
        let regime = self.space.regimes[i];
        let earlier = || self.space.regimes[..i].iter().zip(&sorted.search);
        // An fp8 regime fits where its bf16 twin did: it reaches as far.
        let bases_reach = earlier()
            .filter(|(r, _)| {
                relatives::is_base(**r, regime) || relatives::is_bf16_twin(**r, regime)
            })
            .flat_map(|(_, trials)| trials.iter())
            .filter(|(_, r)| self.is_feasible(r))
            .map(|(_, r)| r.request.knobs.micro_batch)
            .max()
            .unwrap_or(0);
        let twin = earlier().find(|(r, _)| relatives::is_offload_twin(**r, regime));
        let offload_twin = twin.map(|(_, trials)| trials.as_slice());
        let twin_bases = match twin {
            Some((&twin, _)) => earlier()
                .filter(|(r, _)| relatives::is_base(**r, twin))
                .map(|(_, trials)| trials.as_slice())
                .collect(),
            None => Vec::new(),
        };
        let activation_peers = earlier()
            .filter(|(r, _)| relatives::same_activations(**r, regime))
            .map(|(_, trials)| trials.as_slice())
            .collect();
        // An offloaded regime with a twin first measures its host work where a step is
        // cheapest; every other regime starts where its bases stopped, or at half the
        // boundary its memory prior predicts, whichever is larger.
        let usable = self
            .budget
            .usable_gpu_bytes()
            .unwrap_or_else(|| self.budget.usable_host_bytes()) as f64;
        let prior = self.facts.prior_start(i, usable).unwrap_or(0);
        let start = match offload_twin {
            Some(_) => self.space.start_micro_batch,
            None => self.space.start_micro_batch.max(bases_reach).max(prior),
        };
        RelativeTrials {
            start,
            bases_reach,
            offload_twin,
            twin_bases,
            activation_peers,
        }
    }

    fn survey(&self, sorted: &SortedHistory<'_>) -> Vec<RegimeState> {
        let failed = self.excluded(sorted);
        let mut best_earlier = 0.0_f64;
        let mut exploring = false;
        let mut states = Vec::with_capacity(self.space.regimes.len());
        for (i, &regime) in self.space.regimes.iter().enumerate() {
            let trials = &sorted.search[i];
            let dominator = || {
                states
                    .iter()
                    .position(|s: &RegimeState| relatives::dominates(s, regime))
            };
            let progress = if exploring && trials.is_empty() {
                RegimeProgress::Waiting
            } else if let Some(by) = trials.is_empty().then(dominator).flatten() {
                RegimeProgress::Finished(RegimeEnd::Dominated { by })
            } else {
                // A micro-batch whose plan failed its verification is infeasible here too: the
                // regime's bracket closes below it again.
                let failed_here: Vec<usize> = trials
                    .iter()
                    .map(|(_, r)| r.request.knobs.micro_batch)
                    .filter(|&b| failed.contains(&self.space.plan_knobs(regime, b)))
                    .collect();
                let related = self.relative_trials(sorted, i);
                let remeasures = &sorted.remeasures;
                self.progress(trials, &failed_here, &related, best_earlier, remeasures)
            };
            exploring |= !matches!(
                progress,
                RegimeProgress::Waiting | RegimeProgress::Finished(_)
            );
            let best = trials
                .iter()
                .filter(|(_, r)| self.is_feasible(r))
                .filter(|(_, r)| {
                    !failed.contains(&self.space.plan_knobs(regime, r.request.knobs.micro_batch))
                })
                .filter_map(|(_, r)| {
                    Some((
                        r.request.knobs.micro_batch,
                        r.outcome.measurement()?.tokens_per_s,
                    ))
                })
                .max_by(|a, b| a.1.total_cmp(&b.1));
            best_earlier = best_earlier.max(best.map_or(0.0, |(_, t)| t));
            states.push(RegimeState {
                regime,
                progress,
                trials: trials.len(),
                best,
            });
        }
        states
    }

    /// The next step of one regime, given what earlier regimes found: the best throughput
    /// measured there, and the trials of related regimes.
    fn progress(
        &self,
        trials: &Trials<'_>,
        failed: &[usize],
        related: &RelativeTrials<'_, '_>,
        best_earlier: f64,
        remeasures: &Remeasures,
    ) -> RegimeProgress {
        if trials.is_empty() {
            return self.first_trial(related, best_earlier);
        }
        let bracket = self.bracket(trials, failed);
        if bracket.open.is_empty() {
            if let Some(past) = self.past_soft_boundary(trials, failed, &bracket) {
                return explore(past);
            }
            let top = *self
                .candidates
                .last()
                .expect("a validated space has candidates");
            return RegimeProgress::Finished(match (bracket.lo, bracket.hi) {
                (0, _) => RegimeEnd::NothingFits,
                (lo, Some(_)) => RegimeEnd::Boundary { largest: lo },
                (_, None) => RegimeEnd::AllFit { largest: top },
            });
        }
        if let Some(pruned) = self.pruned(trials, related, &bracket, best_earlier) {
            return RegimeProgress::Finished(pruned);
        }
        if let Some(converged) = self.converged(trials, failed, related, &bracket) {
            if let Some(again) = self.convergence_remeasure(trials, bracket.lo, remeasures) {
                return RegimeProgress::Remeasuring {
                    micro_batch: again.knobs.micro_batch,
                    timed_steps: again.timed_steps,
                };
            }
            return RegimeProgress::Finished(converged);
        }
        match bracket.hi {
            None => self.grow(trials, related, &bracket, remeasures),
            Some(hi) => self.refine(trials, failed, &bracket, hi),
        }
    }

    /// A regime with no trials yet: pruned on its offload bound alone, or its first trial at
    /// its start (rounded up to a candidate).
    fn first_trial(&self, related: &RelativeTrials<'_, '_>, best_earlier: f64) -> RegimeProgress {
        if let Some(bound) = self.unprobed_offload_bound(related) {
            if bound * (1.0 + PRUNE_SLACK) < best_earlier {
                return RegimeProgress::Finished(RegimeEnd::Pruned {
                    largest: 0,
                    upper_bound_tokens_per_s: bound,
                    best_tokens_per_s: best_earlier,
                });
            }
        }
        let c = &self.candidates;
        explore(c[c.partition_point(|&b| b < related.start).min(c.len() - 1)])
    }

    /// The largest feasible micro-batch, the smallest infeasible one above it, and the
    /// candidates strictly between them that are still open; micro-batches in `failed` (whose
    /// plan failed its verification) count as infeasible.
    fn bracket(&self, trials: &Trials<'_>, failed: &[usize]) -> Bracket {
        let c = &self.candidates;
        let mb = |r: &TrialResult| r.request.knobs.micro_batch;
        let feasible = |r: &TrialResult| self.is_feasible(r) && !failed.contains(&mb(r));
        let lo = trials
            .iter()
            .filter(|(_, r)| feasible(r))
            .map(|(_, r)| mb(r))
            .max()
            .unwrap_or(0);
        let hi = trials
            .iter()
            .filter(|(_, r)| !feasible(r) && mb(r) > lo)
            .map(|(_, r)| mb(r))
            .min();
        let open = match hi {
            Some(hi) => &c[c.partition_point(|&b| b <= lo)..c.partition_point(|&b| b < hi)],
            None => &c[c.partition_point(|&b| b <= lo)..],
        };
        Bracket {
            lo,
            hi,
            open: open.to_vec(),
        }
    }

    /// The one trial past a boundary that only a fit above the headroom set (see the module
    /// docs' step 6): twice the boundary, when no trial of the regime went past it yet.
    fn past_soft_boundary(
        &self,
        trials: &Trials<'_>,
        failed: &[usize],
        bracket: &Bracket,
    ) -> Option<usize> {
        let (lo, hi) = (bracket.lo, bracket.hi?);
        let mb = |r: &TrialResult| r.request.knobs.micro_batch;
        let soft = trials.iter().any(|(_, r)| {
            mb(r) == hi
                && !failed.contains(&hi)
                && matches!(&r.outcome, Outcome::Fits(m) if self.budget.exceeded(m).is_some())
        });
        let beyond = trials.iter().any(|(_, r)| mb(r) > hi);
        if lo == 0 || !soft || beyond || self.grows_steadily_to(trials, lo, hi) {
            return None;
        }
        let c = &self.candidates;
        let past = c[c.partition_point(|&b| b < 2 * hi).min(c.len() - 1)];
        (past > hi).then_some(past)
    }

    /// Whether the peak's step from `lo` to `hi` is in line with its growth below `lo` (at most
    /// twice the secant's slope through the two largest feasible micro-batches): then the
    /// boundary stands without a trial past it. With one feasible point there is no growth to
    /// judge by.
    fn grows_steadily_to(&self, trials: &Trials<'_>, lo: usize, hi: usize) -> bool {
        let peak_at = |b: usize, feasible: bool| {
            trials
                .iter()
                .rev()
                .filter(|(_, r)| r.request.knobs.micro_batch == b)
                .filter(|(_, r)| !feasible || self.is_feasible(r))
                .find_map(|(_, r)| r.outcome.measurement())
                .map(|m| self.budget.training_peak(m) as f64)
        };
        let below = trials
            .iter()
            .map(|(_, r)| r.request.knobs.micro_batch)
            .filter(|&b| b < lo && peak_at(b, true).is_some())
            .max();
        let (Some(b1), Some(p2), Some(top)) = (below, peak_at(lo, true), peak_at(hi, false)) else {
            return false;
        };
        let Some(p1) = peak_at(b1, true) else {
            return false;
        };
        let slope = ((p2 - p1) / (lo - b1) as f64).max(0.0);
        (top - p2) / (hi - lo) as f64 <= 2.0 * slope
    }

    /// Whether even the optimistic bound on the open micro-batches cannot beat the best earlier
    /// regime (see the module docs' Pruning).
    fn pruned(
        &self,
        trials: &Trials<'_>,
        related: &RelativeTrials<'_, '_>,
        bracket: &Bracket,
        best_earlier: f64,
    ) -> Option<RegimeEnd> {
        let lo = bracket.lo;
        if lo == 0 {
            return None;
        }
        let lo_tokens = trials
            .iter()
            .find(|(_, r)| r.request.knobs.micro_batch == lo)
            .and_then(|(_, r)| r.outcome.measurement())
            .map_or(0.0, |m| m.tokens_per_s);
        let top_open = *bracket.open.last().expect("open is not empty");
        let bound = self.throughput_bound(trials, related, lo, lo_tokens, top_open);
        (bound * (1.0 + PRUNE_SLACK) < best_earlier).then_some(RegimeEnd::Pruned {
            largest: lo,
            upper_bound_tokens_per_s: bound,
            best_tokens_per_s: best_earlier,
        })
    }

    /// Whether even the optimistic bound on the open micro-batches cannot raise the regime's own
    /// best by [`RESOLUTION_GAIN`] (see the module docs' Convergence).
    fn converged(
        &self,
        trials: &Trials<'_>,
        failed: &[usize],
        related: &RelativeTrials<'_, '_>,
        bracket: &Bracket,
    ) -> Option<RegimeEnd> {
        let lo = bracket.lo;
        // A space without a saturation stop asks for every regime's exact memory boundary.
        // While a regime still grows (no miss yet), saturation decides when growth stops:
        // convergence only spares refining a bracket whose gains are noise.
        if lo == 0 || bracket.hi.is_none() || self.space.saturation_gain <= 0.0 {
            return None;
        }
        let tokens = |b: usize| {
            trials
                .iter()
                .filter(|(_, r)| r.request.knobs.micro_batch == b)
                .find_map(|(_, r)| r.outcome.measurement())
                .map_or(0.0, |m| m.tokens_per_s)
        };
        let best = trials
            .iter()
            .map(|(_, r)| r.request.knobs.micro_batch)
            .filter(|b| *b <= lo && !failed.contains(b))
            .filter(|&b| {
                trials
                    .iter()
                    .any(|(_, r)| r.request.knobs.micro_batch == b && self.is_feasible(r))
            })
            .map(tokens)
            .fold(0.0, f64::max);
        let top_open = *bracket.open.last().expect("open is not empty");
        let bound = self.throughput_bound(trials, related, lo, tokens(lo), top_open);
        (best > 0.0 && bound < best * (1.0 + RESOLUTION_GAIN)).then_some(RegimeEnd::Converged {
            largest: lo,
            upper_bound_tokens_per_s: bound,
            best_tokens_per_s: best,
        })
    }

    /// No infeasible trial yet: saturated, or at least double the largest feasible micro-batch
    /// and not below what the bases ran.
    fn grow(
        &self,
        trials: &Trials<'_>,
        related: &RelativeTrials<'_, '_>,
        bracket: &Bracket,
        remeasures: &Remeasures,
    ) -> RegimeProgress {
        let lo = bracket.lo;
        let saturation = (self.space.saturation_gain > 0.0)
            .then(|| self.saturation(trials, lo, remeasures))
            .flatten();
        match saturation {
            Some(Saturation::Stopped { gain }) => {
                return RegimeProgress::Finished(RegimeEnd::Saturated { largest: lo, gain });
            }
            Some(Saturation::Remeasure(again)) => {
                return RegimeProgress::Remeasuring {
                    micro_batch: again.knobs.micro_batch,
                    timed_steps: again.timed_steps,
                };
            }
            Some(Saturation::Growing) | None => {}
        }
        let open = &bracket.open;
        let next = (2 * lo).max(related.bases_reach);
        explore(open[open.partition_point(|&b| b < next).min(open.len() - 1)])
    }

    /// A bracket to close: the memory model's guess for the first [`MODEL_GUIDED_PROBES`]
    /// trials after the first miss (an infeasible trial, or one whose plan is excluded), then
    /// bisection.
    fn refine(
        &self,
        trials: &Trials<'_>,
        failed: &[usize],
        bracket: &Bracket,
        hi: usize,
    ) -> RegimeProgress {
        let (lo, open) = (bracket.lo, &bracket.open);
        let missed =
            |r: &TrialResult| !self.is_feasible(r) || failed.contains(&r.request.knobs.micro_batch);
        let first_miss = trials
            .iter()
            .position(|(_, r)| missed(r))
            .unwrap_or(trials.len());
        let refinements = trials.len().saturating_sub(first_miss + 1);
        if refinements < MODEL_GUIDED_PROBES {
            if let Some(guess) = self.model_guess(trials, lo, hi, open) {
                return explore(guess);
            }
        }
        explore(open[open.len() / 2])
    }

    /// The memory model's largest fitting candidate, kept inside the open bracket.
    fn model_guess(
        &self,
        trials: &[(usize, &TrialResult)],
        lo: usize,
        hi: usize,
        open: &[usize],
    ) -> Option<usize> {
        let predicted =
            match secant_memory_model(trials.iter())?.max_micro_batch_within(&self.budget) {
                Capacity::UpTo(b) => b,
                Capacity::Unbounded => usize::MAX,
            };
        Some(if predicted <= lo {
            open[0]
        } else if predicted >= hi {
            open[open.len() - 1]
        } else {
            open[open.partition_point(|&b| b <= predicted).saturating_sub(1)]
        })
    }

    /// The plans that cannot be chosen: those whose verification failed, and those that
    /// accumulation rules out before one.
    fn excluded(&self, sorted: &SortedHistory<'_>) -> Vec<Knobs> {
        let failed = sorted
            .verifications
            .iter()
            .filter(|(_, ok)| !*ok)
            .map(|(k, _)| *k);
        let ruled_out = self.ruled_out(sorted).into_iter().map(|r| r.knobs);
        failed.chain(ruled_out).collect()
    }

    /// The plans in `history` that accumulation rules out (see [`AccumulationRuledOut`]), in
    /// the order of the regimes and then of their search trials.
    pub fn accumulation_ruled_out(&self, history: &[TrialResult]) -> Vec<AccumulationRuledOut> {
        self.ruled_out(&self.sorted(&remeasure::pooled_history(history)))
    }

    pub(super) fn ruled_out(&self, sorted: &SortedHistory<'_>) -> Vec<AccumulationRuledOut> {
        let Some(usable) = self.budget.usable_gpu_bytes() else {
            return Vec::new();
        };
        let mut ruled_out = Vec::new();
        for (i, trials) in sorted.search.iter().enumerate() {
            for (_, result) in trials.iter() {
                let Some(m) = result.outcome.measurement().filter(|m| self.budget.fits(m)) else {
                    continue;
                };
                let b = result.request.knobs.micro_batch;
                let knobs = self.space.plan_knobs(self.space.regimes[i], b);
                let Some(added) = self.facts.accumulation_extra_bytes(i, b) else {
                    continue;
                };
                let predicted = m.peak_gpu_bytes as f64 + ACCUMULATION_TRUST * added;
                if knobs.grad_accum > 1 && predicted > usable as f64 {
                    ruled_out.push(AccumulationRuledOut {
                        knobs,
                        measured_gpu_bytes: m.peak_gpu_bytes,
                        added_bytes: added,
                    });
                }
            }
        }
        ruled_out
    }

    fn ranked(&self, sorted: &SortedHistory<'_>) -> Vec<Candidate> {
        let failed = self.excluded(sorted);
        let mut ranked: Vec<(usize, Candidate)> = Vec::new();
        for (i, trials) in sorted.search.iter().enumerate() {
            for &(history_index, result) in trials {
                let Some(measurement) =
                    result.outcome.measurement().filter(|m| self.budget.fits(m))
                else {
                    continue;
                };
                let knobs = self
                    .space
                    .plan_knobs(self.space.regimes[i], result.request.knobs.micro_batch);
                if !failed.contains(&knobs) {
                    let candidate = Candidate {
                        knobs,
                        measurement: *measurement,
                        history_index,
                    };
                    ranked.push((i, candidate));
                }
            }
        }
        ranked.sort_by(|(ra, a), (rb, b)| {
            b.measurement
                .tokens_per_s
                .total_cmp(&a.measurement.tokens_per_s)
                .then(ra.cmp(rb))
                .then(a.knobs.micro_batch.cmp(&b.knobs.micro_batch))
        });
        // Within the timing resolution of the best (or the 95 % interval of the difference,
        // where that is wider), a larger micro-batch of the same regime is as fast as far as
        // the trials can tell, and throughput does not fall as the batch grows: the largest
        // such comes first.
        if let Some(&(best_regime, ref best)) = ranked.first() {
            let tied_with_best =
                |c: &Candidate| !remeasure::slower_beyond_band(&c.measurement, &best.measurement);
            let tied = ranked
                .iter()
                .enumerate()
                .filter(|(_, (r, c))| *r == best_regime && tied_with_best(c))
                .max_by_key(|(_, (_, c))| c.knobs.micro_batch)
                .map(|(i, _)| i);
            if let Some(i) = tied.filter(|&i| i > 0) {
                let largest = ranked.remove(i);
                ranked.insert(0, largest);
            }
        }
        ranked.into_iter().map(|(_, c)| c).collect()
    }
}

/// The memory model through the two largest measured micro-batches of `trials`: on an affine
/// law it is the least-squares line, and on a slightly curved one it follows the curve near the
/// boundary, where a global fit is pulled off by the small batches.
fn secant_memory_model<'h>(
    trials: impl Iterator<Item = &'h (usize, &'h TrialResult)>,
) -> Option<MemoryModel> {
    let mut points: Vec<(usize, Measurement)> = trials
        .filter_map(|(_, r)| {
            r.outcome
                .measurement()
                .map(|m| (r.request.knobs.micro_batch, *m))
        })
        .collect();
    points.sort_by_key(|(b, _)| std::cmp::Reverse(*b));
    MemoryModel::fit(&points[..points.len().min(2)])
}

/// Trials to bisect `open` candidates down to a boundary: ⌈log2(open + 1)⌉.
fn bisection_bound(open: usize) -> usize {
    (usize::BITS - open.leading_zeros()) as usize
}

/// Trials to refine a bracket of `open` candidates: the model-guided trials (each removes at
/// least one candidate), then bisection of what is left.
fn refinement_bound(open: usize) -> usize {
    if open <= MODEL_GUIDED_PROBES {
        open
    } else {
        MODEL_GUIDED_PROBES + bisection_bound(open - MODEL_GUIDED_PROBES)
    }
}

mod bound;
mod remeasure;
#[cfg(test)]
mod tests;
