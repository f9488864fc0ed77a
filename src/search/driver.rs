//! `SearchDriver`: the pure decision of what to probe next, from the history of probes so far.
//!
//! # Strategy
//!
//! Regimes are explored one at a time, in the space's priority order. Within a regime, with the
//! micro-batch ranging over the space's candidates:
//!
//! 1. **Grow**: probe the start candidate, then repeatedly the smallest candidate at least
//!    twice the largest feasible one, until one is infeasible or the largest candidate fits.
//! 2. **Jump**: fit the affine memory model through the two largest measured micro-batches
//!    and probe its predicted largest fitting micro-batch `b*` (rounded down to a candidate,
//!    kept strictly between the largest feasible and the smallest infeasible micro-batch).
//! 3. **Pin**: probe the candidate next to the new bracket edge (`b*+1` after a fit, `b*−1`
//!    after a miss). With an exact law the boundary is now known.
//! 4. **Bisect**: after those two model-guided probes, halve the open bracket of candidates.
//!
//! A probe is *feasible* when it fitted and its peaks stay within the budget's usable bytes
//! (the headroom); an out-of-memory, a crash, or a fit above the usable bytes is infeasible.
//! Feasibility is assumed monotone in the micro-batch, so the bracket's lower edge ends as the
//! **exact** largest feasible candidate.
//!
//! Growth also stops when the last doubling raised throughput by less than the space's
//! `saturation_gain` (the regime is *saturated*): past that point a larger batch buys memory
//! pressure, not speed, and the boundary need not be found.
//!
//! A regime that only saves memory (checkpointing, offload) is not probed at all (it is
//! *dominated*) when an earlier regime of the same precision without those knobs stopped
//! growing before its memory boundary (saturated, or every candidate fit): it would run the
//! same micro-batches with more work each, and larger ones were already found not to pay.
//!
//! A regime stops early (is *pruned*) when even an optimistic bound on its throughput cannot
//! beat the best setting measured in an earlier regime: step time does not fall as the batch
//! grows, so every unprobed micro-batch `b` above the largest feasible one `lo` runs at most
//! `tokens_per_s(lo) · b / lo`, and at most what the step-time secant predicts; the bound takes
//! the largest `b` still possible, which is also capped at twice the memory model's predicted
//! boundary.
//!
//! # Choice and verification
//!
//! When every regime is finished, the feasible search probes are ranked by measured tokens/s
//! (throughput with accumulation equals throughput of one micro-batch, since a step of `a`
//! micro-batches is predicted to take `a` times as long). The best is returned as
//! [`Decision::Verify`]: the caller runs [`SearchDriver::verify_request`] once, with the real
//! accumulation and longer timing, and adds the result to the history. Only a verified setting
//! becomes [`Decision::Chosen`]; a failed verification excludes that setting and the search
//! continues (a regime pruned against it may resume). The verification decides feasibility
//! only: its throughput is what a plan reports as measured, but the ranking stays that of the
//! search trials, which all ran the same way.
//!
//! # Probe count
//!
//! Search probes never repeat knobs. Per regime the count is at most
//! [`SearchDriver::regime_probe_bound`]; for candidates `1..=M` and a boundary `B` with
//! `2^k ≤ B < 2^(k+1) ≤ M` that is `2k + 4` (growth `k + 2`, two model-guided probes, bisection
//! of at most `2^k − 3` open candidates in `k` probes), and `k + 4` when memory follows the
//! affine law exactly. Add one verification, plus one per failed verification. Example: a
//! memory law of 1 GiB + 37 MiB per sequence against 10 GiB with 5 % headroom takes the 11
//! trials 1, 2, 4, …, 128, 256 (out of memory), 235 (fits), 236 (inside the headroom), then
//! verifies 235.

use std::collections::HashSet;

use super::decision::{Candidate, Decision, Next, RegimeEnd, RegimeProgress, RegimeState};
use super::hint::no_feasible_hint;
use super::space::SearchSpace;
use crate::fit::{Capacity, MemoryModel};
use crate::knobs::Knobs;
use crate::probe::outcome::{Measurement, ProbeRequest, ProbeResult};
use crate::spec::budget::Budget;
use crate::Result;

/// Slack on the pruning bound: a regime is pruned only when its optimistic throughput, raised
/// by this fraction to cover timing noise, is still below the best measured elsewhere.
pub const PRUNE_SLACK: f64 = 0.05;

/// How far past the memory model's predicted boundary the pruning bound still looks (see
/// `memory_reach`).
const MEMORY_REACH_FACTOR: usize = 2;

/// Model-guided probes per regime before falling back to bisection: the jump and the pin.
const MODEL_GUIDED_PROBES: usize = 2;

/// The pure search policy: history in, next action out. See the module docs for the strategy.
#[derive(Debug, Clone)]
pub struct SearchDriver {
    space: SearchSpace,
    budget: Budget,
    candidates: Vec<usize>,
}

/// The history sorted into search probes per regime and verification results.
pub(super) struct Ledger<'h> {
    /// Per regime of the space (same order): `(history index, result)` of its search probes.
    pub(super) search: Vec<Vec<(usize, &'h ProbeResult)>>,
    /// Search probes in total (those of regimes outside the space included).
    pub(super) search_count: usize,
    /// Verified knobs and whether the verification passed.
    pub(super) verifications: Vec<(Knobs, bool)>,
}

impl SearchDriver {
    /// A driver for `space` under `budget`; both are validated.
    pub fn new(space: SearchSpace, budget: Budget) -> Result<Self> {
        space.validate()?;
        budget.validate()?;
        let candidates = space.candidates();
        Ok(Self {
            space,
            budget,
            candidates,
        })
    }

    /// The space searched.
    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// The budget a setting must fit.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// The verification trial for knobs returned in [`Decision::Verify`].
    pub fn verify_request(&self, knobs: Knobs) -> ProbeRequest {
        self.space.verify_request(knobs)
    }

    /// Whether a result counts as feasible: it fitted within the budget's usable bytes.
    pub fn is_feasible(&self, result: &ProbeResult) -> bool {
        result
            .outcome
            .measurement()
            .is_some_and(|m| self.budget.fits(m))
    }

    /// What to do next, given every result so far in the order they were obtained.
    pub fn next(&self, history: &[ProbeResult]) -> Next {
        let ledger = self.ledger(history);
        let limit_reached = self
            .space
            .max_probes
            .is_some_and(|max| ledger.search_count >= max);
        if !limit_reached {
            for (i, state) in self.survey(&ledger).iter().enumerate() {
                if let RegimeProgress::Exploring { next_micro_batch } = state.progress {
                    return Next::Probe(
                        self.space
                            .search_request(self.space.regimes[i], next_micro_batch),
                    );
                }
            }
        }
        let passed: Vec<Knobs> = ledger
            .verifications
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(k, _)| *k)
            .collect();
        Next::Done(match self.ranked(&ledger).first() {
            Some(best) if passed.contains(&best.knobs) => Decision::Chosen(best.knobs),
            Some(best) => Decision::Verify(best.knobs),
            None => Decision::NoFeasible {
                hint: no_feasible_hint(self, &ledger, limit_reached),
            },
        })
    }

    /// Every regime's state after `history`, in priority order.
    pub fn regime_states(&self, history: &[ProbeResult]) -> Vec<RegimeState> {
        self.survey(&self.ledger(history))
    }

    /// Feasible settings measured in `history`, best first (tokens/s, then regime priority,
    /// then smaller micro-batch), without those whose verification failed.
    pub fn candidates(&self, history: &[ProbeResult]) -> Vec<Candidate> {
        self.ranked(&self.ledger(history))
    }

    /// The most search probes one regime can take: the worst case over where the growth phase
    /// meets its first infeasible candidate, of the growth probes plus the refinement of that
    /// bracket (two model-guided probes, then bisection).
    pub fn regime_probe_bound(&self) -> usize {
        let c = &self.candidates;
        let start = c.partition_point(|&b| b < self.space.start_micro_batch);
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
        worst.max(chain.len())
    }

    pub(super) fn ledger<'h>(&self, history: &'h [ProbeResult]) -> Ledger<'h> {
        let mut ledger = Ledger {
            search: vec![Vec::new(); self.space.regimes.len()],
            search_count: 0,
            verifications: Vec::new(),
        };
        let mut seen = HashSet::new();
        for (index, result) in history.iter().enumerate() {
            let knobs = result.request.knobs;
            // The driver asks for search trials only without accumulation and never twice, so
            // anything else is a verification.
            if knobs.grad_accum != 1 || !seen.insert(knobs) {
                ledger.verifications.push((knobs, self.is_feasible(result)));
                continue;
            }
            ledger.search_count += 1;
            let regime = self.space.regimes.iter().position(|r| *r == knobs.regime());
            if let Some(i) =
                regime.filter(|_| self.candidates.binary_search(&knobs.micro_batch).is_ok())
            {
                ledger.search[i].push((index, result));
            }
        }
        ledger
    }

    fn survey(&self, ledger: &Ledger<'_>) -> Vec<RegimeState> {
        let failed: Vec<Knobs> = ledger
            .verifications
            .iter()
            .filter(|(_, ok)| !*ok)
            .map(|(k, _)| *k)
            .collect();
        let mut best_earlier = 0.0_f64;
        let mut exploring = false;
        let mut states = Vec::with_capacity(self.space.regimes.len());
        for (i, &regime) in self.space.regimes.iter().enumerate() {
            let probes = &ledger.search[i];
            let dominator = || {
                states
                    .iter()
                    .position(|s: &RegimeState| dominates(s, regime))
            };
            let progress = if exploring && probes.is_empty() {
                RegimeProgress::Waiting
            } else if let Some(by) = probes.is_empty().then(dominator).flatten() {
                RegimeProgress::Finished(RegimeEnd::Dominated { by })
            } else {
                self.progress(probes, best_earlier)
            };
            exploring |= matches!(progress, RegimeProgress::Exploring { .. });
            let best = probes
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
                probes: probes.len(),
                best,
            });
        }
        states
    }

    /// The next step of one regime, given the best throughput measured in earlier regimes.
    fn progress(&self, probes: &[(usize, &ProbeResult)], best_earlier: f64) -> RegimeProgress {
        let c = &self.candidates;
        let top = *c.last().expect("a validated space has candidates");
        let explore = |b| RegimeProgress::Exploring {
            next_micro_batch: b,
        };
        if probes.is_empty() {
            return explore(c[c.partition_point(|&b| b < self.space.start_micro_batch)]);
        }
        let feasible = |r: &ProbeResult| self.is_feasible(r);
        let mb = |r: &ProbeResult| r.request.knobs.micro_batch;
        let lo = probes
            .iter()
            .filter(|(_, r)| feasible(r))
            .map(|(_, r)| mb(r))
            .max()
            .unwrap_or(0);
        let hi = probes
            .iter()
            .filter(|(_, r)| !feasible(r) && mb(r) > lo)
            .map(|(_, r)| mb(r))
            .min();
        let open: &[usize] = match hi {
            Some(hi) => &c[c.partition_point(|&b| b <= lo)..c.partition_point(|&b| b < hi)],
            None => &c[c.partition_point(|&b| b <= lo)..],
        };
        if open.is_empty() {
            return RegimeProgress::Finished(match (lo, hi) {
                (0, _) => RegimeEnd::NothingFits,
                (_, Some(_)) => RegimeEnd::Boundary { largest: lo },
                (_, None) => RegimeEnd::AllFit { largest: top },
            });
        }
        if lo > 0 {
            let lo_tokens = probes
                .iter()
                .find(|(_, r)| mb(r) == lo)
                .and_then(|(_, r)| r.outcome.measurement())
                .map_or(0.0, |m| m.tokens_per_s);
            let top_open = *open.last().expect("open is not empty");
            let reach = self
                .memory_reach(probes)
                .map_or(top_open, |r| r.min(top_open));
            let bound = (lo_tokens * reach as f64 / lo as f64)
                .min(self.secant_bound(probes, reach).unwrap_or(f64::INFINITY));
            if bound * (1.0 + PRUNE_SLACK) < best_earlier {
                return RegimeProgress::Finished(RegimeEnd::Pruned {
                    largest: lo,
                    upper_bound_tokens_per_s: bound,
                    best_tokens_per_s: best_earlier,
                });
            }
        }
        let Some(hi) = hi else {
            let gain = (self.space.saturation_gain > 0.0)
                .then(|| self.last_doubling_gain(probes, lo))
                .flatten();
            if let Some(gain) = gain {
                if gain < self.space.saturation_gain {
                    return RegimeProgress::Finished(RegimeEnd::Saturated { largest: lo, gain });
                }
            }
            // Growth: at least double.
            return explore(open[open.partition_point(|&b| b < 2 * lo).min(open.len() - 1)]);
        };
        let first_miss = probes
            .iter()
            .position(|(_, r)| !feasible(r))
            .unwrap_or(probes.len());
        let refinements = probes.len() - first_miss - 1;
        if refinements < MODEL_GUIDED_PROBES {
            if let Some(guess) = self.model_guess(probes, lo, hi, open) {
                return explore(guess);
            }
        }
        explore(open[open.len() / 2])
    }

    /// Throughput at `b` predicted by the step-time secant through the two largest feasible
    /// trials, `t(b) = t0 + c·b`; `None` unless the secant rises (c > 0). Tokens per sequence
    /// come from the trials themselves (`tokens/s · t / b`). Step time grows at least linearly
    /// once the device is saturated, so this is already an optimistic bound there; it is what
    /// lets a slow regime (offload, recompute) be pruned before its memory boundary.
    fn secant_bound(&self, probes: &[(usize, &ProbeResult)], b: usize) -> Option<f64> {
        let mut points: Vec<(f64, f64, f64)> = probes
            .iter()
            .filter(|(_, r)| self.is_feasible(r))
            .filter_map(|(_, r)| {
                let m = r.outcome.measurement()?;
                Some((
                    r.request.knobs.micro_batch as f64,
                    m.step_time_median_s,
                    m.tokens_per_s,
                ))
            })
            .collect();
        points.sort_by(|a, b| b.0.total_cmp(&a.0));
        let (&(b2, t2, tps2), &(b1, t1, _)) = (points.first()?, points.get(1)?);
        let c = (t2 - t1) / (b2 - b1);
        if c.is_nan() || c <= 0.0 || t2 <= 0.0 {
            return None;
        }
        let tokens_per_sequence = tps2 * t2 / b2;
        let t0 = (t2 - c * b2).max(0.0);
        Some(tokens_per_sequence * b as f64 / (t0 + c * b as f64))
    }

    /// The largest micro-batch this regime could still reach, for the pruning bound: twice the
    /// memory model's largest fitting micro-batch (the secant through the two largest feasible
    /// trials, as for the jump). The factor two keeps the bound optimistic when memory grows
    /// less than linearly; `None` when no model can be fitted or memory does not grow.
    fn memory_reach(&self, probes: &[(usize, &ProbeResult)]) -> Option<usize> {
        let feasible = probes.iter().filter(|(_, r)| self.is_feasible(r));
        match secant_memory_model(feasible)?.max_micro_batch_within(&self.budget) {
            Capacity::UpTo(b) => Some(b.saturating_mul(MEMORY_REACH_FACTOR)),
            Capacity::Unbounded => None,
        }
    }

    /// Relative throughput gain from the second-largest to the largest feasible micro-batch.
    fn last_doubling_gain(&self, probes: &[(usize, &ProbeResult)], lo: usize) -> Option<f64> {
        let tokens = |b: usize| {
            probes
                .iter()
                .filter(|(_, r)| r.request.knobs.micro_batch == b && self.is_feasible(r))
                .find_map(|(_, r)| r.outcome.measurement().map(|m| m.tokens_per_s))
        };
        let previous = probes
            .iter()
            .filter(|(_, r)| self.is_feasible(r))
            .map(|(_, r)| r.request.knobs.micro_batch)
            .filter(|&b| b < lo)
            .max()?;
        let (now, before) = (tokens(lo)?, tokens(previous)?);
        (before > 0.0).then(|| now / before - 1.0)
    }

    /// The memory model's largest fitting candidate, kept inside the open bracket.
    fn model_guess(
        &self,
        probes: &[(usize, &ProbeResult)],
        lo: usize,
        hi: usize,
        open: &[usize],
    ) -> Option<usize> {
        let predicted =
            match secant_memory_model(probes.iter())?.max_micro_batch_within(&self.budget) {
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

    fn ranked(&self, ledger: &Ledger<'_>) -> Vec<Candidate> {
        let failed: Vec<Knobs> = ledger
            .verifications
            .iter()
            .filter(|(_, ok)| !*ok)
            .map(|(k, _)| *k)
            .collect();
        let mut ranked: Vec<(usize, Candidate)> = Vec::new();
        for (i, probes) in ledger.search.iter().enumerate() {
            for &(history_index, result) in probes {
                let Some(measurement) =
                    result.outcome.measurement().filter(|m| self.budget.fits(m))
                else {
                    continue;
                };
                let knobs = self
                    .space
                    .plan_knobs(self.space.regimes[i], result.request.knobs.micro_batch);
                if !failed.contains(&knobs) {
                    ranked.push((
                        i,
                        Candidate {
                            knobs,
                            measurement: *measurement,
                            history_index,
                        },
                    ));
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
        ranked.into_iter().map(|(_, c)| c).collect()
    }
}

/// Probes to bisect `open` candidates down to a boundary: ⌈log2(open + 1)⌉.
/// The memory model through the two largest measured micro-batches of `probes`: on an affine
/// law it is the least-squares line, and on a slightly curved one it follows the curve near the
/// boundary, where a global fit is pulled off by the small batches.
fn secant_memory_model<'h>(
    probes: impl Iterator<Item = &'h (usize, &'h ProbeResult)>,
) -> Option<MemoryModel> {
    let mut points: Vec<(usize, Measurement)> = probes
        .filter_map(|(_, r)| {
            r.outcome
                .measurement()
                .map(|m| (r.request.knobs.micro_batch, *m))
        })
        .collect();
    points.sort_by_key(|(b, _)| std::cmp::Reverse(*b));
    MemoryModel::fit(&points[..points.len().min(2)])
}

/// Whether `earlier` makes `regime` pointless: `regime` saves memory (checkpointing, offload or
/// optimizer sharding) at `earlier`'s precision and GPU count, and `earlier` saves none and
/// stopped growing before its memory boundary.
fn dominates(earlier: &RegimeState, regime: crate::knobs::Regime) -> bool {
    !earlier.regime.saves_memory()
        && regime.saves_memory()
        && earlier.regime.precision == regime.precision
        && earlier.regime.data_parallel.degree == regime.data_parallel.degree
        && matches!(
            earlier.progress,
            RegimeProgress::Finished(RegimeEnd::Saturated { .. } | RegimeEnd::AllFit { .. })
        )
}

fn bisection_bound(open: usize) -> usize {
    (usize::BITS - open.leading_zeros()) as usize
}

/// Probes to refine a bracket of `open` candidates: the model-guided probes (each removes at
/// least one candidate), then bisection of what is left.
fn refinement_bound(open: usize) -> usize {
    if open <= MODEL_GUIDED_PROBES {
        open
    } else {
        MODEL_GUIDED_PROBES + bisection_bound(open - MODEL_GUIDED_PROBES)
    }
}

#[cfg(test)]
mod tests;
