//! `SearchSetup`: a search's space and its machine facts, resolved together in one step from
//! what the user asked, the model, the target and what the runtime knows of itself.
//!
//! Everything about them is decided here, once: the target's regimes narrowed by the request,
//! the largest micro-batch capped at what the budget can hold, the regimes whose state alone
//! cannot fit left out, the analytic memory prior on a GPU (and what accumulation adds to a
//! trial's peak, with a global batch), the host update floor when an offloaded regime is
//! searched, and the target's link when trials cross it. A caller passes inputs in and takes
//! the result whole; nothing is patched afterwards.

use crate::estimate::{estimate, Attention};
use crate::knobs::{Knobs, MomentPlace, Offload, Precision, Regime};
use crate::spec::activations::{device_memory, MemoryLaw};
use crate::spec::budget::Budget;
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::Result;

use super::facts::{AccumulationExtra, MachineFacts};
use super::space::{SearchSpace, SpaceRequest};

/// What the runtime that runs the trials contributes to a search's facts: what its kernels
/// cover, and the one measurement of this machine a search may need.
pub struct Runtime<'a> {
    /// The attention head widths the flash-attention kernels cover on a GPU (in half
    /// precision); attention at another width keeps its probabilities.
    pub flash_head_dims: &'a [usize],
    /// Measures the seconds a host Adam update of this many parameters takes at the least
    /// ([`MachineFacts::offload_host_floor_s`]); called only when an offloaded regime is
    /// searched, since the measurement takes a fraction of a second.
    pub host_adam_floor_s: &'a dyn Fn(usize) -> Option<f64>,
    /// Whether the trials run autotune's own engine, whose memory the estimate follows. A
    /// trial runner's framework holds its gradients its own way (PyTorch sums them in place,
    /// adding nothing), so no accumulation facts are derived for it.
    pub own_engine: bool,
}

/// A search's inputs, resolved: what to try and what to assume.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchSetup {
    /// The settings to try.
    pub space: SearchSpace,
    /// What is true of the machine and the target.
    pub facts: MachineFacts,
    /// The regimes the request asked for that were left out because their training state
    /// alone cannot fit the budget, for the caller to say so.
    pub dropped: Vec<Regime>,
}

impl SearchSetup {
    /// The space and facts of a search of `model` on `target` under `budget`, as `request`
    /// asks, with `runtime`'s kernels and measurement. Errors name the flag to change.
    ///
    /// A GPU trial of a large model costs seconds, so on a GPU each regime's first trial goes
    /// near its predicted boundary (the memory prior); CPU trials cost milliseconds, and
    /// growing from 1 gives `check` the several settings per regime it compares.
    pub fn resolve(
        model: &ModelSpec,
        target: &DeviceSpec,
        budget: &Budget,
        request: &SpaceRequest,
        runtime: &Runtime<'_>,
    ) -> Result<Self> {
        let mut space = SearchSpace::for_target(target, model, request)?;
        cap_micro_batch(&mut space, model, budget);
        let (space, dropped) = space.without_oversized_state(model, budget);
        let on_gpu = target.kind == DeviceKind::Cuda;
        let regimes = &space.regimes;
        let (memory_prior, accumulation_extra) = if on_gpu {
            (
                memory_prior(model, regimes, runtime.flash_head_dims),
                if runtime.own_engine {
                    accumulation_extra(model, &space, runtime.flash_head_dims)
                } else {
                    Vec::new()
                },
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let offloads = regimes.iter().any(|r| r.offload == Offload::Optimizer);
        // Offloaded steps and moments streamed from host memory cross the host link every
        // step: their trials are retimed for the target's link when it is the slower.
        let crosses_link = offloads
            || regimes
                .iter()
                .any(|r| r.state.moments_on == MomentPlace::Host);
        let facts = MachineFacts {
            offload_host_floor_s: offloads
                .then(|| (runtime.host_adam_floor_s)(model.parameter_count()))
                .flatten(),
            target_link_gbps: target.host_to_device_gbps.filter(|_| crosses_link),
            memory_prior,
            accumulation_extra,
        };
        Ok(Self {
            space,
            facts,
            dropped,
        })
    }
}

/// Lowers the space's largest micro-batch to the largest whose logits alone fit in the memory
/// the budget allows (device and host together): larger ones cannot fit, so they need no
/// trial, and the search's list of candidates never grows past what the machine could hold.
fn cap_micro_batch(space: &mut SearchSpace, model: &ModelSpec, budget: &Budget) {
    let usable = budget
        .usable_gpu_bytes()
        .unwrap_or(0)
        .saturating_add(budget.usable_host_bytes());
    let smallest_element = space
        .regimes
        .iter()
        .map(|r| r.precision)
        .min_by_key(|&p| limits::logits_bytes(model, 1, p))
        .unwrap_or(Precision::Fp32);
    let reach = limits::largest_micro_batch_within(model, smallest_element, usable);
    if reach < space.max_micro_batch {
        space.max_micro_batch = reach.max(space.start_micro_batch);
    }
}

/// An analytic device-memory law per regime on a GPU ([`device_memory`]); attention keeps no
/// probabilities where the flash kernels cover the head width in half precision.
fn memory_prior(
    model: &ModelSpec,
    regimes: &[Regime],
    flash_head_dims: &[usize],
) -> Vec<MemoryLaw> {
    regimes
        .iter()
        .map(|&r| {
            let flash = attention(model, r, flash_head_dims) == Attention::Flash;
            device_memory(model, r, true, flash)
        })
        .collect()
}

/// Per regime, what accumulating adds to the device peak at each micro-batch whose plan
/// accumulates, by the estimate: the plan's peak over its search trial's (without
/// accumulation). None when no plan accumulates.
fn accumulation_extra(
    model: &ModelSpec,
    space: &SearchSpace,
    flash_head_dims: &[usize],
) -> Vec<Vec<AccumulationExtra>> {
    let candidates = space.candidates();
    let extras: Vec<Vec<AccumulationExtra>> = space
        .regimes
        .iter()
        .map(|&regime| {
            let attention = attention(model, regime, flash_head_dims);
            let device_peak = |knobs: &Knobs| {
                let peak = estimate(model, knobs, DeviceKind::Cuda, attention);
                peak.gpu.map_or(0, |g| g.total()) as f64
            };
            candidates
                .iter()
                .map(|&b| space.plan_knobs(regime, b))
                .filter(|plan| plan.grad_accum > 1)
                .map(|plan| {
                    let trial = Knobs {
                        grad_accum: 1,
                        ..plan
                    };
                    AccumulationExtra {
                        micro_batch: plan.micro_batch,
                        bytes: (device_peak(&plan) - device_peak(&trial)).max(0.0),
                    }
                })
                .collect()
        })
        .collect();
    if extras.iter().all(Vec::is_empty) {
        Vec::new()
    } else {
        extras
    }
}

/// Flash attention where the kernels cover the model's head width in half precision.
fn attention(model: &ModelSpec, regime: Regime, flash_head_dims: &[usize]) -> Attention {
    if flash_head_dims.contains(&model.head_dim()) && regime.precision != Precision::Fp32 {
        Attention::Flash
    } else {
        Attention::Materialized
    }
}

#[cfg(test)]
mod tests;
