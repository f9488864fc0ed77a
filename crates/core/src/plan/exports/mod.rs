//! A plan in other tools' vocabularies: a DeepSpeed config, Hugging Face `TrainingArguments`, an
//! Accelerate config and Lightning `Trainer` arguments.
//!
//! These are translations of the chosen setting, not guarantees: a plan's memory and speed
//! were measured by the engine its provenance names ([`crate::plan::Provenance`]), and another
//! framework allocates differently (autotune's own engine needs 0.57–0.62× PyTorch's memory at
//! the same batch, so its largest batch runs out of memory in PyTorch). [`engine_mismatch`]
//! says when an export would hand a tool a batch measured elsewhere.
//!
//! Each translation returns the document and its [`Notes`]: what the target cannot express or
//! what the user must still do. Notes are for people and go to stderr, never into the document,
//! which the tool must load as it is.
//!
//! A data-parallel plan's micro-batch and accumulation are per GPU, as in DeepSpeed, so a plan
//! measured on the GPUs of one host carries over to a cluster of such hosts by raising the
//! world size: the global batch grows with it and the per-GPU memory stays what was measured.

pub mod deepspeed;
pub mod fidelity;
pub mod hf;
pub mod lightning;

pub use deepspeed::{deepspeed_config, DeepSpeedConfig};
pub use fidelity::{changes, Changes};
pub use hf::{accelerate_config, trainer_args, TrainerArgs};
pub use lightning::{lightning_args, LightningArgs};

use crate::plan::Provenance;

/// What a user still has to know about an export: one sentence each.
pub type Notes = Vec<String>;

/// The tools a plan exports to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportFormat {
    /// A `ds_config.json`.
    DeepSpeed,
    /// Hugging Face `TrainingArguments` as JSON (`HfArgumentParser.parse_dict`).
    Trainer,
    /// An Accelerate config YAML (`accelerate launch --config_file`).
    Accelerate,
    /// Lightning `Trainer(**kwargs)` as JSON.
    Lightning,
}

impl ExportFormat {
    /// Every format, by its command-line name.
    pub const ALL: [(&'static str, ExportFormat); 4] = [
        ("deepspeed", ExportFormat::DeepSpeed),
        ("trainer", ExportFormat::Trainer),
        ("accelerate", ExportFormat::Accelerate),
        ("lightning", ExportFormat::Lightning),
    ];

    /// The format named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }

    /// The tool's name, as people know it.
    pub fn tool_name(self) -> &'static str {
        match self {
            ExportFormat::DeepSpeed => "DeepSpeed",
            ExportFormat::Trainer => "the Hugging Face Trainer",
            ExportFormat::Accelerate => "Accelerate",
            ExportFormat::Lightning => "Lightning",
        }
    }

    /// The engine the tool trains with: all four run PyTorch.
    pub fn engine(self) -> &'static str {
        "pytorch"
    }
}

/// Why exporting a plan measured by `provenance`'s engine to `format` would mislead, or `None`
/// when the engines agree. A plan without provenance (written before plans recorded it) was
/// measured by autotune's own engine, the only one there was.
pub fn engine_mismatch(provenance: Option<&Provenance>, format: ExportFormat) -> Option<String> {
    let engine = provenance.map_or(Provenance::OWN_ENGINE, |p| p.engine.as_str());
    (engine != format.engine()).then(|| {
        format!(
            "the plan's batch was measured on the {engine} engine, but the target trains with \
             {target}, which needs more memory at the same batch (autotune's engine takes \
             0.57-0.62x PyTorch's): its micro-batch may run out of memory there. Tune through \
             the target's own framework, or pass --allow-engine-mismatch to export anyway",
            target = format.engine()
        )
    })
}

/// The environment line a training from the plan needs (`PYTORCH_CUDA_ALLOC_CONF=…`): the
/// allocator setting its trial runner's trials ran under, where that is not PyTorch's default.
/// A batch measured under one allocator setting may run out of memory under another.
pub fn environment_line(provenance: Option<&Provenance>) -> Option<String> {
    let setting = provenance?.allocator.as_deref()?;
    crate::trial_protocol::allocator::environment_line(setting)
}

/// The note that tells a user of `format` to start their training with `line` (see
/// [`environment_line`]).
pub fn environment_note(line: &str, format: ExportFormat) -> String {
    format!(
        "environment: {line} -- start {tool} with it set: the plan's batch was measured under \
         this allocator setting, and PyTorch's default allocator can run out of memory at it",
        tool = format.tool_name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runner_plan_names_its_allocator_setting_unless_it_is_the_default() {
        let mut provenance = Provenance::for_test("pytorch");
        assert_eq!(environment_line(Some(&provenance)), None, "not recorded");
        provenance.allocator = Some(String::new());
        assert_eq!(environment_line(Some(&provenance)), None, "the default");
        provenance.allocator = Some("expandable_segments:True".into());
        let line = environment_line(Some(&provenance)).unwrap();
        assert_eq!(line, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
        let note = environment_note(&line, ExportFormat::DeepSpeed);
        assert!(note.contains(&line) && note.contains("DeepSpeed"), "{note}");
        assert_eq!(environment_line(None), None);
    }

    #[test]
    fn an_export_to_another_engine_is_flagged_and_the_same_engine_is_not() {
        let ours = Provenance::for_test("autotune");
        let theirs = Provenance::for_test("pytorch");
        for (_, format) in ExportFormat::ALL {
            let why = engine_mismatch(Some(&ours), format).expect("autotune vs pytorch");
            assert!(why.contains("--allow-engine-mismatch"), "{why}");
            assert!(
                engine_mismatch(None, format).is_some(),
                "no provenance: ours"
            );
            assert_eq!(engine_mismatch(Some(&theirs), format), None);
        }
        assert_eq!(
            ExportFormat::parse("lightning"),
            Some(ExportFormat::Lightning)
        );
        assert_eq!(ExportFormat::parse("keras"), None);
    }
}
