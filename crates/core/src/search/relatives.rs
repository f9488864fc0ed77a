//! How the regimes of one space relate: which one is the same training with fewer memory
//! savings, and which one differs only by offload.
//!
//! Checkpointing and offload buy device memory with extra work (recompute, the host-side
//! optimizer). A regime with fewer of them is measured first in the default space, and what it
//! measured bounds what the later regime can gain (see the driver docs).

use super::decision::{RegimeEnd, RegimeProgress, RegimeState};
use crate::knobs::{Checkpointing, Offload, Precision, Regime};

/// Whether `earlier` is a base of `regime`: the same precision and GPU count, and each memory
/// saving of `earlier` (checkpointing, offload, sharding, the update in backward) is off or the
/// same as in `regime`, which has at least one more.
pub(super) fn is_base(earlier: Regime, regime: Regime) -> bool {
    earlier != regime
        && earlier.precision == regime.precision
        && earlier.data_parallel.degree == regime.data_parallel.degree
        && (earlier.checkpointing == Checkpointing::None
            || earlier.checkpointing == regime.checkpointing)
        && (earlier.offload == Offload::None || earlier.offload == regime.offload)
        && (earlier.update.is_after_backward() || earlier.update == regime.update)
        && (!earlier.data_parallel.shard_optimizer || regime.data_parallel.shard_optimizer)
}

/// Whether `earlier` is `regime` in bf16 and `regime` runs its products in fp8: the same
/// training, the same activations and state (an fp8 product's codes live only while it runs),
/// each sequence's products faster.
pub(super) fn is_bf16_twin(earlier: Regime, regime: Regime) -> bool {
    regime.precision == Precision::Fp8
        && earlier
            == Regime {
                precision: Precision::Bf16,
                ..regime
            }
}

/// Whether `earlier` is `regime` without optimizer offload (and `regime` offloads).
pub(super) fn is_offload_twin(earlier: Regime, regime: Regime) -> bool {
    regime.offload == Offload::Optimizer
        && earlier
            == Regime {
                offload: Offload::None,
                ..regime
            }
}

/// Whether `earlier` keeps the same activations per sequence as `regime`: the same compute
/// precision (fp8 keeps bf16's activations), checkpointing and GPU count. Offload and the update's placement move optimizer state and
/// gradients, which do not grow with the batch, so such regimes add the same device bytes per
/// added sequence; they differ in which of their peaks (activations, or the optimizer's
/// transients) is the highest at small batches.
pub(super) fn same_activations(earlier: Regime, regime: Regime) -> bool {
    earlier.precision.compute() == regime.precision.compute()
        && earlier.checkpointing == regime.checkpointing
        && earlier.data_parallel.degree == regime.data_parallel.degree
}

/// Whether `earlier` makes `regime` pointless: `earlier` saves no memory, is a base of
/// `regime`, and stopped growing before its memory boundary.
pub(super) fn dominates(earlier: &RegimeState, regime: Regime) -> bool {
    !earlier.regime.saves_memory()
        && is_base(earlier.regime, regime)
        && matches!(
            earlier.progress,
            RegimeProgress::Finished(RegimeEnd::Saturated { .. } | RegimeEnd::AllFit { .. })
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(precision: Precision, checkpointing: Checkpointing, offload: Offload) -> Regime {
        Regime {
            precision,
            checkpointing,
            offload,
            data_parallel: Default::default(),
            update: Default::default(),
            state: Default::default(),
        }
    }

    #[test]
    fn an_fp8_regime_has_its_bf16_twin_and_its_activations() {
        let all = Checkpointing::EveryKth(1);
        let fp8 = r(Precision::Fp8, all, Offload::None);
        let bf16 = r(Precision::Bf16, all, Offload::None);
        assert!(is_bf16_twin(bf16, fp8));
        assert!(!is_bf16_twin(fp8, bf16), "only fp8 has a bf16 twin");
        assert!(!is_bf16_twin(
            r(Precision::Bf16, Checkpointing::None, Offload::None),
            fp8
        ));
        assert!(!is_bf16_twin(r(Precision::Fp16, all, Offload::None), fp8));
        assert!(!is_base(bf16, fp8), "fp8 saves no memory over bf16");
        assert!(same_activations(bf16, fp8) && same_activations(fp8, bf16));
        assert!(!same_activations(
            r(Precision::Fp32, all, Offload::None),
            fp8
        ));
    }

    #[test]
    fn bases_have_a_subset_of_the_memory_savings_at_the_same_precision() {
        let (none, all, every2) = (
            Checkpointing::None,
            Checkpointing::EveryKth(1),
            Checkpointing::EveryKth(2),
        );
        let bf16 = |c, o| r(Precision::Bf16, c, o);
        let plain = bf16(none, Offload::None);
        let ckpt = bf16(all, Offload::None);
        let offload = bf16(none, Offload::Optimizer);
        let both = bf16(all, Offload::Optimizer);
        // (earlier, later, is a base, is the offload twin)
        let table = [
            (plain, ckpt, true, false),
            (plain, offload, true, true),
            (plain, both, true, false),
            (ckpt, both, true, true),
            (offload, both, true, false),
            (ckpt, offload, false, false),
            (offload, ckpt, false, false),
            (plain, plain, false, false),
            (ckpt, bf16(every2, Offload::None), false, false),
            (r(Precision::Fp32, none, Offload::None), ckpt, false, false),
            (r(Precision::Fp32, all, Offload::None), both, false, false),
        ];
        for (earlier, later, base, twin) in table {
            assert_eq!(is_base(earlier, later), base, "{earlier} → {later}");
            assert_eq!(is_offload_twin(earlier, later), twin, "{earlier} → {later}");
        }
    }

    #[test]
    fn activations_depend_on_precision_and_checkpointing_only() {
        use crate::knobs::Update;
        let (none, all) = (Checkpointing::None, Checkpointing::EveryKth(1));
        let bf16 = |c, o| r(Precision::Bf16, c, o);
        let fused = Regime {
            update: Update::InBackward,
            ..bf16(all, Offload::None)
        };
        // (earlier, later, same activations per sequence)
        let table = [
            (
                bf16(all, Offload::None),
                bf16(all, Offload::Optimizer),
                true,
            ),
            (fused, bf16(all, Offload::Optimizer), true),
            (
                bf16(none, Offload::None),
                bf16(all, Offload::Optimizer),
                false,
            ),
            (r(Precision::Fp32, all, Offload::None), fused, false),
            (
                bf16(all, Offload::None),
                bf16(Checkpointing::EveryKth(2), Offload::None),
                false,
            ),
        ];
        for (earlier, later, same) in table {
            assert_eq!(
                same_activations(earlier, later),
                same,
                "{earlier} → {later}"
            );
        }
    }

    #[test]
    fn the_update_in_backward_is_a_memory_saving_like_the_others() {
        use crate::knobs::Update;
        let bf16 = |c, u| Regime {
            update: u,
            ..r(Precision::Bf16, c, Offload::None)
        };
        let (none, all) = (Checkpointing::None, Checkpointing::EveryKth(1));
        let (after, during) = (Update::AfterBackward, Update::InBackward);
        let plain = bf16(none, after);
        let fused = bf16(none, during);
        let ckpt = bf16(all, after);
        let both = bf16(all, during);
        // (earlier, later, is a base)
        let table = [
            (plain, fused, true),
            (plain, both, true),
            (fused, both, true),
            (ckpt, both, true),
            (fused, ckpt, false),
            (ckpt, fused, false),
            (both, fused, false),
        ];
        for (earlier, later, base) in table {
            assert_eq!(is_base(earlier, later), base, "{earlier} → {later}");
            assert!(!is_offload_twin(earlier, later), "{earlier} → {later}");
        }
        assert!(fused.saves_memory() && !plain.saves_memory());
    }
}
