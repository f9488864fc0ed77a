//! [`UpdateStrategy`]: how a step turns gradients into new weights, the one valid combination
//! of where the optimizer runs, its state's layout and when it updates.
//!
//! The knobs name these choices one by one (`offload`, `update`, `state`, the data-parallel
//! sharding), and not every combination can be run exactly. [`UpdateStrategy::of`] is the only
//! place that decides which can, and which way the trainer then steps; knob validation, the
//! trainer and the memory model all ask it.

use super::{Knobs, MomentPlace, Offload, Precision, StateLayout, Update};

/// How a step updates the weights; built only by [`UpdateStrategy::of`], so every value is a
/// combination the trainer can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpdateStrategy {
    /// Exact AdamW on the device after the backward pass: every gradient summed over the
    /// micro-batches (and the ranks), checked for fp16 overflow and clipped, then one update;
    /// `shard_optimizer` splits the moments between the ranks (ZeRO-1).
    AfterBackward {
        /// Whether each rank owns a share of the moments.
        shard_optimizer: bool,
    },
    /// Exact AdamW on the device, each layer updated as soon as the backward pass settles it, so
    /// the whole model's gradients never exist at once.
    InBackward,
    /// f32 masters and moments in host memory; each micro-batch's gradients are summed there and
    /// the update runs on the host after the backward pass.
    Offloaded,
    /// Offloaded, each part of the model sent to the host and updated there while the backward
    /// pass goes on with the parts before it.
    OffloadedStreamed,
    /// A compact or host-placed state layout on one device.
    Compact {
        /// The layout (never exact AdamW on the device).
        layout: StateLayout,
        /// Whether each part is updated as the backward pass settles it.
        in_backward: bool,
    },
}

/// Why knobs cannot be run: the knob at fault (a field of [`Knobs`]) and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StrategyConflict {
    /// The field of [`Knobs`] to change (`state`, `update`, `data_parallel.shard_optimizer`).
    pub field: &'static str,
    /// The problem and its fix, in words.
    pub problem: String,
}

impl UpdateStrategy {
    /// The strategy `knobs` ask for, for a model that clips gradients to a global norm when
    /// `clips_gradients` (known only with the model: [`Knobs::validate`] passes `false`), or why
    /// it cannot run.
    pub fn of(knobs: &Knobs, clips_gradients: bool) -> Result<Self, StrategyConflict> {
        let sharded = knobs.data_parallel.shard_optimizer;
        if sharded && knobs.offload == Offload::Optimizer {
            return Err(conflict(
                "data_parallel.shard_optimizer",
                "cannot be combined with optimizer offload yet; shard the optimizer or offload it, not both",
            ));
        }
        if let Some(problem) = state_conflict(knobs) {
            return Err(conflict("state", problem));
        }
        let in_backward = knobs.update == Update::InBackward;
        if in_backward {
            if let Some(why) = knobs.in_backward_conflict() {
                return Err(conflict(
                    "update",
                    format!(
                        "in-backward is exactly the normal step only without {why}; use after-backward"
                    ),
                ));
            }
            if clips_gradients {
                return Err(conflict(
                    "update",
                    "in-backward cannot clip gradients to a global norm (that needs every \
                     gradient before the first update); use after-backward, or drop the model's \
                     optimizer.grad_clip",
                ));
            }
        }
        Ok(if !knobs.state.is_exact() {
            UpdateStrategy::Compact {
                layout: knobs.state,
                in_backward,
            }
        } else if knobs.offload == Offload::Optimizer {
            if offload_can_stream(knobs, clips_gradients) {
                UpdateStrategy::OffloadedStreamed
            } else {
                UpdateStrategy::Offloaded
            }
        } else if in_backward {
            UpdateStrategy::InBackward
        } else {
            UpdateStrategy::AfterBackward {
                shard_optimizer: sharded,
            }
        })
    }

    /// Whether the optimizer's masters and moments live in host memory.
    pub fn is_offloaded(self) -> bool {
        matches!(
            self,
            UpdateStrategy::Offloaded | UpdateStrategy::OffloadedStreamed
        )
    }
}

impl Knobs {
    /// What, among these knobs, needs every gradient before the first update (so the update
    /// cannot run in backward); `None` when nothing does. Global-norm clipping, the model's
    /// own setting, is checked where the model is known ([`UpdateStrategy::of`]).
    pub fn in_backward_conflict(&self) -> Option<&'static str> {
        if self.grad_accum > 1 {
            Some("accumulation (grad_accum above 1)")
        } else if self.precision.needs_loss_scaling() {
            Some("fp16's overflow check (use bf16 or fp32)")
        } else if self.offload != Offload::None {
            Some("optimizer offload")
        } else if self.data_parallel.degree > 1 {
            Some("data parallelism (gradients are summed over the GPUs first)")
        } else {
            None
        }
    }
}

fn conflict(field: &'static str, problem: impl Into<String>) -> StrategyConflict {
    StrategyConflict {
        field,
        problem: problem.into(),
    }
}

/// Whether an offloaded step can stream each part through the host as the backward pass
/// settles it: nothing needs every gradient before the first update (no accumulation, no fp16
/// loss scale, one GPU, no gradient clipping).
fn offload_can_stream(knobs: &Knobs, clips_gradients: bool) -> bool {
    knobs.grad_accum == 1
        && !knobs.precision.needs_loss_scaling()
        && knobs.data_parallel.degree == 1
        && !clips_gradients
}

/// Why `knobs` cannot use their state layout, if they cannot.
fn state_conflict(knobs: &Knobs) -> Option<String> {
    if knobs.state.is_exact() {
        return None;
    }
    if knobs.offload != Offload::None {
        return Some(
            "a compact or host-placed state needs the optimizer on the device (offload none); \
             its moments_on: host streams the moments instead"
                .to_string(),
        );
    }
    if knobs.data_parallel.degree > 1 {
        return Some("a compact or host-placed state trains on one GPU only".to_string());
    }
    if knobs.state.masters.is_half() && knobs.precision.compute() != Precision::Bf16 {
        return Some(format!(
            "bf16 masters are the working copies, so they need bf16 precision, not {}",
            knobs.precision
        ));
    }
    if knobs.state.moments_on == MomentPlace::Host && knobs.update != Update::InBackward {
        return Some(
            "moments in host memory stream through the update in backward; set update to in-backward"
                .to_string(),
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Checkpointing, DataParallel, MasterFormat, MomentFormat};

    fn knobs(update: Update, offload: Offload, precision: Precision) -> Knobs {
        Knobs {
            update,
            offload,
            checkpointing: Checkpointing::None,
            ..Knobs::new(4, precision)
        }
    }

    const COMPACT: StateLayout = StateLayout {
        moments: MomentFormat::Int8Blockwise,
        masters: MasterFormat::Bf16Stochastic,
        moments_on: MomentPlace::Host,
    };

    #[test]
    fn every_valid_combination_maps_to_its_strategy() {
        use Offload::{None as OnDevice, Optimizer as Host};
        use Precision::{Bf16, Fp16};
        use Update::{AfterBackward as After, InBackward as During};
        let sharded = Knobs {
            data_parallel: DataParallel {
                degree: 2,
                shard_optimizer: true,
            },
            ..knobs(After, OnDevice, Bf16)
        };
        let accumulating = Knobs {
            grad_accum: 2,
            ..knobs(After, Host, Bf16)
        };
        let compact = Knobs {
            state: COMPACT,
            ..knobs(During, OnDevice, Bf16)
        };
        let compact_after = Knobs {
            state: StateLayout {
                moments_on: MomentPlace::Device,
                ..COMPACT
            },
            ..knobs(After, OnDevice, Bf16)
        };
        let table: [(Knobs, bool, UpdateStrategy); 9] = [
            (
                knobs(After, OnDevice, Bf16),
                false,
                UpdateStrategy::AfterBackward {
                    shard_optimizer: false,
                },
            ),
            (
                sharded,
                true,
                UpdateStrategy::AfterBackward {
                    shard_optimizer: true,
                },
            ),
            (
                knobs(During, OnDevice, Bf16),
                false,
                UpdateStrategy::InBackward,
            ),
            (
                knobs(After, Host, Bf16),
                false,
                UpdateStrategy::OffloadedStreamed,
            ),
            // Clipping, fp16's overflow check or accumulation need every gradient first.
            (knobs(After, Host, Bf16), true, UpdateStrategy::Offloaded),
            (knobs(After, Host, Fp16), false, UpdateStrategy::Offloaded),
            (accumulating, false, UpdateStrategy::Offloaded),
            (
                compact,
                false,
                UpdateStrategy::Compact {
                    layout: COMPACT,
                    in_backward: true,
                },
            ),
            (
                compact_after,
                true,
                UpdateStrategy::Compact {
                    layout: compact_after.state,
                    in_backward: false,
                },
            ),
        ];
        for (k, clips, expected) in table {
            assert_eq!(UpdateStrategy::of(&k, clips), Ok(expected), "{k}");
        }
    }

    #[test]
    fn invalid_combinations_name_the_knob_to_change() {
        use Precision::{Bf16, Fp16, Fp32};
        let field = |k: Knobs, clips: bool| UpdateStrategy::of(&k, clips).unwrap_err().field;
        let host_after = Knobs {
            state: COMPACT,
            ..knobs(Update::AfterBackward, Offload::None, Bf16)
        };
        let half_masters_in_fp32 = Knobs {
            state: StateLayout {
                moments_on: MomentPlace::Device,
                ..COMPACT
            },
            ..knobs(Update::AfterBackward, Offload::None, Fp32)
        };
        let sharded_offload = Knobs {
            data_parallel: DataParallel {
                degree: 2,
                shard_optimizer: true,
            },
            ..knobs(Update::AfterBackward, Offload::Optimizer, Bf16)
        };
        let table = [
            (host_after, false, "state"),
            (half_masters_in_fp32, false, "state"),
            (sharded_offload, false, "data_parallel.shard_optimizer"),
            (
                knobs(Update::InBackward, Offload::None, Fp16),
                false,
                "update",
            ),
            (
                knobs(Update::InBackward, Offload::Optimizer, Bf16),
                false,
                "update",
            ),
            (
                knobs(Update::InBackward, Offload::None, Bf16),
                true,
                "update",
            ),
        ];
        for (k, clips, expected) in table {
            assert_eq!(field(k, clips), expected, "{k}");
        }
    }
}
