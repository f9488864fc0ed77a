//! When nothing searched fits, the opt-in regimes that would: compact optimizer state is not
//! searched unless asked (`--allow-compact-state`: its update is not exactly AdamW's), so a
//! model whose exact state cannot fit would otherwise get "no feasible plan" with no word of
//! the mode that trains it.

use super::space::SearchSpace;
use crate::estimate::{self, Attention};
use crate::knobs::{Knobs, Precision, Regime};
use crate::spec::budget::{format_bytes, Budget};
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;

/// An opt-in regime the estimate fits, and how far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptIn {
    /// The regime.
    pub regime: Regime,
    /// Its estimated peak device memory at one sequence a micro-batch (the GPU's, or the
    /// host's on a CPU).
    pub device_bytes: u64,
    /// Its estimated host memory at one sequence.
    pub host_bytes: u64,
    /// The largest micro-batch the estimate fits.
    pub largest_micro_batch: usize,
}

/// The compact-state regime (of the compact variants of `regimes`) whose estimate fits the
/// budget with the largest micro-batch, when `regimes` hold none already; `attention` says
/// how attention runs at a precision.
pub fn compact_way_out(
    model: &ModelSpec,
    kind: DeviceKind,
    budget: &Budget,
    regimes: &[Regime],
    attention: &dyn Fn(Precision) -> Attention,
) -> Option<OptIn> {
    if regimes.iter().any(|r| r.state.is_compact()) {
        return None;
    }
    let mut best: Option<OptIn> = None;
    for regime in SearchSpace::compact_layouts(regimes) {
        let knobs = Knobs::with_batch(regime, 1, 1);
        let at = attention(regime.precision);
        let Some(largest) = estimate::largest_micro_batch(model, &knobs, kind, at, budget) else {
            continue;
        };
        let one = estimate::estimate(model, &knobs, kind, at);
        let found = OptIn {
            regime,
            device_bytes: one.device_total(),
            host_bytes: one.host.total(),
            largest_micro_batch: largest,
        };
        if best.is_none_or(|b| largest > b.largest_micro_batch) {
            best = Some(found);
        }
    }
    best
}

impl OptIn {
    /// The way out in a sentence, to follow a "no feasible plan".
    pub fn describe(&self, kind: DeviceKind) -> String {
        let peaks = match kind {
            DeviceKind::Cuda => format!(
                "GPU {} and host {}",
                format_bytes(self.device_bytes),
                format_bytes(self.host_bytes)
            ),
            DeviceKind::Cpu => format!("host {}", format_bytes(self.device_bytes)),
        };
        format!(
            "--allow-compact-state lets the search try 8-bit Adam moments with bf16 masters (4 \
             bytes a parameter instead of 16; not exactly AdamW): the estimate fits {} at \
             micro-batch 1 with {peaks}, and up to micro-batch {}",
            self.regime, self.largest_micro_batch
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Checkpointing, Offload};
    use crate::search::space::SpaceRequest;
    use crate::spec::device::DeviceSpec;

    fn exact_regimes(model: &ModelSpec, target: &DeviceSpec) -> Vec<Regime> {
        let request = SpaceRequest {
            precisions: vec![Precision::Bf16],
            checkpointing: vec![Checkpointing::None, Checkpointing::EveryKth(1)],
            offload: vec![Offload::None],
            ..SpaceRequest::default()
        };
        SearchSpace::for_target(target, model, &request)
            .unwrap()
            .regimes
    }

    #[test]
    fn an_8b_model_is_pointed_at_the_compact_state_that_fits_a_24_gb_card() {
        let model = ModelSpec::preset("llama-3.1-8b").unwrap();
        let target = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let budget = Budget::from_device(&target);
        let regimes = exact_regimes(&model, &target);
        let flash = |_| Attention::Flash;
        let way = compact_way_out(&model, DeviceKind::Cuda, &budget, &regimes, &flash)
            .expect("compact state fits 8B on 24 GB");
        assert!(way.regime.state.is_compact());
        assert_eq!(way.regime.checkpointing, Checkpointing::EveryKth(1));
        assert!(way.device_bytes <= budget.usable_gpu_bytes().unwrap());
        let said = way.describe(DeviceKind::Cuda);
        assert!(
            said.contains("--allow-compact-state") && said.contains("GiB"),
            "{said}"
        );
        // Already searched: nothing more to offer.
        let with_compact: Vec<Regime> = regimes
            .iter()
            .copied()
            .chain(SearchSpace::compact_layouts(&regimes))
            .collect();
        let again = compact_way_out(&model, DeviceKind::Cuda, &budget, &with_compact, &flash);
        assert_eq!(again, None);
    }

    #[test]
    fn no_way_out_is_offered_where_compact_state_does_not_fit_either() {
        let model = ModelSpec::preset("llama-3.1-8b").unwrap();
        let target = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let budget = Budget {
            gpu_bytes: Some(8 << 30),
            ..Budget::from_device(&target)
        };
        let regimes = exact_regimes(&model, &target);
        let flash = |_| Attention::Flash;
        assert_eq!(
            compact_way_out(&model, DeviceKind::Cuda, &budget, &regimes, &flash),
            None
        );
    }
}
