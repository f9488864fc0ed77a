//! What an export changes of a plan: the knobs each tool can express, and what the rest costs.
//! None of the four tools updates in the backward pass; bitsandbytes' 8-bit AdamW (the
//! Trainer's `optim`) keeps 8-bit moments but f32 masters; nothing else keeps a compact state.
//! A plan measured with such knobs runs, exported, with more training state than it was
//! measured with, so its batch may not fit: the export says so, or is refused. fp8 products
//! run through Transformer Engine in Accelerate and Lightning; the Trainer and DeepSpeed run
//! them in bf16, slower than measured, which is refused the same way.

use super::ExportFormat;
use crate::knobs::{Knobs, MasterFormat, MomentFormat, MomentPlace, StateLayout, Update};
use crate::spec::budget::format_bytes;
use crate::spec::model::ModelSpec;
use crate::spec::state::StateBytes;

/// What an export changes of a plan, and its cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Changes {
    /// One sentence per change.
    pub changes: Vec<String>,
    /// The training state's bytes on the GPU as exported, less the plan's (negative: less).
    pub extra_state_bytes: i64,
}

impl Changes {
    /// Whether the export runs the plan's knobs as measured.
    pub fn is_faithful(&self) -> bool {
        self.changes.is_empty()
    }

    /// The changes and their cost in one sentence.
    pub fn describe(&self) -> String {
        let cost = if self.extra_state_bytes >= 0 {
            format!("{} more", format_bytes(self.extra_state_bytes as u64))
        } else {
            format!(
                "{} less",
                format_bytes(self.extra_state_bytes.unsigned_abs())
            )
        };
        format!(
            "{}; in all, the training state takes {cost} GPU memory than the plan measured",
            self.changes.join("; ")
        )
    }
}

/// The knobs `format`'s tool runs when given the export of `knobs`.
pub fn as_exported(knobs: &Knobs, format: ExportFormat) -> Knobs {
    let state = match (format, knobs.state.moments) {
        _ if knobs.state.is_exact() => knobs.state,
        (ExportFormat::Trainer, MomentFormat::Int8Blockwise) => StateLayout {
            moments: MomentFormat::Int8Blockwise,
            masters: MasterFormat::F32,
            moments_on: MomentPlace::Device,
        },
        _ => StateLayout::EXACT,
    };
    let precision = match format {
        ExportFormat::Accelerate | ExportFormat::Lightning => knobs.precision,
        ExportFormat::Trainer | ExportFormat::DeepSpeed => knobs.precision.compute(),
    };
    Knobs {
        update: Update::AfterBackward,
        state,
        precision,
        ..*knobs
    }
}

/// The Trainer's `optim` for a plan's state: bitsandbytes' 8-bit AdamW for 8-bit moments,
/// paged (moved to host memory under pressure) where the plan keeps them in host memory.
pub fn trainer_optim(knobs: &Knobs) -> Option<&'static str> {
    match (knobs.state.moments, knobs.state.moments_on) {
        (MomentFormat::Int8Blockwise, MomentPlace::Host) => Some("paged_adamw_8bit"),
        (MomentFormat::Int8Blockwise, MomentPlace::Device) => Some("adamw_bnb_8bit"),
        _ => None,
    }
}

/// What exporting `knobs` (of `model`) to `format` changes.
pub fn changes(model: &ModelSpec, knobs: &Knobs, format: ExportFormat) -> Changes {
    let exported = as_exported(knobs, format);
    let tool = format.tool_name();
    let mut changes = Vec::new();
    if knobs.update == Update::InBackward {
        changes.push(format!(
            "{tool} has no update in the backward pass: the update runs after it, with every \
             gradient held at once"
        ));
    }
    if exported.precision != knobs.precision {
        changes.push(format!(
            "{tool} has no fp8 matrix products: the blocks' products run in {}, slower than the \
             plan measured",
            exported.precision
        ));
    }
    if exported.state != knobs.state {
        let kept = match exported.state {
            s if s.is_exact() => "plain AdamW with f32 masters and moments".to_string(),
            s => format!(
                "{s} (`optim: {}`)",
                trainer_optim(knobs).unwrap_or("adamw_torch")
            ),
        };
        changes.push(format!(
            "{tool} cannot keep the {} state: {kept}",
            knobs.state
        ));
    }
    let state = |k: &Knobs| StateBytes::of(model, k).device.total() as i64;
    Changes {
        changes,
        extra_state_bytes: state(&exported) - state(knobs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Checkpointing, Precision};

    fn compact(moments_on: MomentPlace, update: Update) -> Knobs {
        Knobs {
            checkpointing: Checkpointing::EveryKth(1),
            update,
            state: StateLayout {
                moments: MomentFormat::Int8Blockwise,
                masters: MasterFormat::Bf16Stochastic,
                moments_on,
            },
            ..Knobs::new(4, Precision::Bf16)
        }
    }

    #[test]
    fn fp8_products_export_through_transformer_engine_or_as_a_stated_change() {
        let model = ModelSpec::preset("gpt-1.3b").unwrap();
        let fp8 = Knobs::new(4, Precision::Fp8);
        for (_, format) in ExportFormat::ALL {
            let found = changes(&model, &fp8, format);
            match format {
                ExportFormat::Accelerate | ExportFormat::Lightning => {
                    assert!(found.is_faithful(), "{format:?}: {found:?}")
                }
                ExportFormat::Trainer | ExportFormat::DeepSpeed => {
                    assert_eq!(found.changes.len(), 1, "{format:?}");
                    assert!(found.changes[0].contains("no fp8"), "{found:?}");
                    assert!(found.changes[0].contains("bf16"), "{found:?}");
                    // The same training state: the cost is speed.
                    assert_eq!(found.extra_state_bytes, 0);
                }
            }
        }
        let (yaml, notes) = super::super::hf::accelerate_config(&fp8);
        assert!(yaml.contains("mixed_precision: fp8\n"), "{yaml}");
        assert!(yaml.contains("fp8_config:\n  backend: TE\n"), "{yaml}");
        assert!(
            notes.iter().any(|n| n.contains("Transformer Engine")),
            "{notes:?}"
        );
        let optimizer = crate::spec::model::OptimizerSpec::adamw(3e-4);
        let (args, _) = super::super::hf::trainer_args(&fp8, &optimizer);
        assert!(args.bf16, "the Trainer trains an fp8 plan in bf16");
        let (args, notes) = super::super::lightning::lightning_args(&fp8, None);
        assert_eq!(args.precision, "transformer-engine");
        assert!(
            notes.iter().any(|n| n.contains("Transformer Engine")),
            "{notes:?}"
        );
    }

    #[test]
    fn each_tool_says_what_it_changes_of_each_kind_of_plan() {
        let model = ModelSpec::preset("llama-3.1-8b").unwrap();
        let plain = Knobs::new(4, Precision::Bf16);
        let in_backward = Knobs {
            update: Update::InBackward,
            ..plain
        };
        let host = compact(MomentPlace::Host, Update::InBackward);
        let device = compact(MomentPlace::Device, Update::AfterBackward);
        for (_, format) in ExportFormat::ALL {
            assert!(changes(&model, &plain, format).is_faithful(), "{format:?}");
            let found = changes(&model, &in_backward, format);
            assert_eq!(found.changes.len(), 1, "{format:?}");
            assert!(found.extra_state_bytes > 0, "every gradient held");
            let found = changes(&model, &host, format);
            assert_eq!(found.changes.len(), 2, "{format:?}: {found:?}");
            // 8B: the exported state is tens of GiB more than the plan's.
            assert!(found.extra_state_bytes > 20 << 30, "{format:?}: {found:?}");
            assert!(
                found.describe().contains("more GPU memory"),
                "{}",
                found.describe()
            );
        }
        // The Trainer keeps 8-bit moments through bitsandbytes, with f32 masters.
        let trainer = changes(&model, &device, ExportFormat::Trainer);
        assert_eq!(trainer.changes.len(), 1);
        assert!(trainer.changes[0].contains("adamw_bnb_8bit"), "{trainer:?}");
        let lightning = changes(&model, &device, ExportFormat::Lightning);
        assert!(
            lightning.changes[0].contains("plain AdamW"),
            "{lightning:?}"
        );
        assert!(trainer.extra_state_bytes < lightning.extra_state_bytes);
        assert_eq!(trainer_optim(&host), Some("paged_adamw_8bit"));
        assert_eq!(trainer_optim(&plain), None);
    }
}
