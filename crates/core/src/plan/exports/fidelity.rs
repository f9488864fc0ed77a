//! What an export changes of a plan: the knobs each tool can express, and what the rest costs.
//! None of the four tools updates in the backward pass; bitsandbytes' 8-bit AdamW (the
//! Trainer's `optim`) keeps 8-bit moments but f32 masters; nothing else keeps a compact state.
//! A plan measured with such knobs runs, exported, with more training state than it was
//! measured with, so its batch may not fit: the export says so, or is refused.

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
    Knobs {
        update: Update::AfterBackward,
        state,
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
