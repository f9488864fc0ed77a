//! `MachineFacts`: what is true of the machine and the target a search runs for, beside the
//! settings it tries ([`SearchSpace`](super::SearchSpace)).
//!
//! The space says what to try; the facts say what the search may assume before a trial: how
//! long the host's part of an offloaded step takes at the least, how fast the target's host
//! link is, where each regime's memory boundary is predicted to lie, and what accumulation adds
//! to the memory a search trial measures. A recorded search keeps
//! both, so that its replay decides exactly as the live search did.

use serde::{Deserialize, Serialize};

use crate::spec::activations::MemoryLaw;
use crate::{Error, Result};

const WHAT: &str = "machine facts";

/// Facts about the machine and the target that guide a search; see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFacts {
    /// Seconds of host work an offloaded optimizer step adds at the least, measured on the
    /// machine before the search (the host update alone, see the runtime's
    /// `probe::host_work`); it lets an offloaded regime be pruned before its first trial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_host_floor_s: Option<f64>,
    /// The target machine's host-to-device link, GB/s, when it is slower than the one trials
    /// run on: offloaded trials are retimed for it as they come in
    /// ([`crate::trial::Measurement::retimed_for_link`]), so a plan for a PCIe 4 desktop is not
    /// chosen on a PCIe 5 server's copy times. From the target's `host_to_device_gbps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_link_gbps: Option<f64>,
    /// An analytic memory law per regime of the space (same order), or none: a regime's first
    /// trial then goes to half its predicted boundary instead of the space's start (see
    /// [`MachineFacts::prior_start`]), saving the doublings up to it; trials decide the rest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_prior: Vec<MemoryLaw>,
    /// Per regime of the space (same order), or none: what accumulating adds to the device
    /// peak at each micro-batch whose plan accumulates (a space with a global batch), over
    /// its search trial without accumulation, by the analytic estimate. Accumulation holds an
    /// f32 sum of every gradient through the step, which a search trial does not measure; a
    /// plan whose search trial plus this cannot fit is not verified (see the driver's
    /// "Choice and verification").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accumulation_extra: Vec<Vec<AccumulationExtra>>,
}

/// The device bytes accumulation adds to one regime's peak at one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccumulationExtra {
    /// The micro-batch.
    pub micro_batch: usize,
    /// The bytes added to its peak, at the plan's accumulation.
    pub bytes: f64,
}

impl MachineFacts {
    /// The names of the fields, as they appear in JSON: profiles of schema version 1 kept them
    /// inside the space.
    pub const FIELDS: [&'static str; 3] =
        ["offload_host_floor_s", "target_link_gbps", "memory_prior"];

    /// Checks the facts for a space of `regimes` regimes; errors name the field.
    pub fn validate(&self, regimes: usize) -> Result<()> {
        let bad = |field: &str, problem: String| Err(Error::invalid(WHAT, field, problem));
        // A list of `what` per regime, or none.
        let one_per_regime = |field: &str, what: &str, len: usize| {
            if len == 0 || len == regimes {
                return Ok(());
            }
            bad(
                field,
                format!("has {len} {what} for {regimes} regimes; give one per regime or none"),
            )
        };
        one_per_regime("memory_prior", "laws", self.memory_prior.len())?;
        if let Some(i) = self.memory_prior.iter().position(|law| {
            !(law.fixed_bytes.is_finite()
                && law.fixed_bytes >= 0.0
                && law.per_sequence_bytes.is_finite()
                && law.per_sequence_bytes > 0.0)
        }) {
            return bad(
                &format!("memory_prior[{i}]"),
                "needs finite bytes, at least 0 fixed and more than 0 per sequence".into(),
            );
        }
        one_per_regime("accumulation_extra", "lists", self.accumulation_extra.len())?;
        for (i, extras) in self.accumulation_extra.iter().enumerate() {
            if let Some(j) = extras
                .iter()
                .position(|e| !(e.bytes.is_finite() && e.bytes >= 0.0 && e.micro_batch >= 1))
            {
                return bad(
                    &format!("accumulation_extra[{i}][{j}]"),
                    "needs a micro-batch of at least 1 and finite bytes, at least 0".into(),
                );
            }
        }
        if let Some(g) = self.target_link_gbps {
            if !(g > 0.0 && g.is_finite()) {
                return bad(
                    "target_link_gbps",
                    format!("({g}) must be a positive number of GB/s"),
                );
            }
        }
        if let Some(h) = self.offload_host_floor_s {
            if !(h.is_finite() && h >= 0.0) {
                return bad(
                    "offload_host_floor_s",
                    format!("({h}) must be a finite number of seconds, at least 0"),
                );
            }
        }
        Ok(())
    }

    /// Where regime `i`'s first trial goes by the memory prior: the largest power of two at
    /// most half its predicted boundary within `usable_bytes` (the device's, or the host's on
    /// a CPU), and 1 when the prior predicts nothing fits; `None` without a prior. Half, so
    /// that the trial there and the doubling after it give the memory model two points below
    /// the boundary, as growth from 1 would have, in fewer trials.
    pub fn prior_start(&self, i: usize, usable_bytes: f64) -> Option<usize> {
        let law = self.memory_prior.get(i)?;
        let half = law.capacity(usable_bytes) / 2;
        Some(if half == 0 { 1 } else { 1 << half.ilog2() })
    }

    /// The bytes accumulation adds to regime `i`'s peak at `micro_batch`, when known.
    pub fn accumulation_extra_bytes(&self, i: usize, micro_batch: usize) -> Option<f64> {
        self.accumulation_extra
            .get(i)?
            .iter()
            .find(|e| e.micro_batch == micro_batch)
            .map(|e| e.bytes)
    }
}
