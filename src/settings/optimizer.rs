//! The optimizer settings a fine-tuner sets on the command line, over the model spec's own:
//! the learning rate, weight decay and Adam's betas (`train`, `tune`, `run`).

use clap::Args;

use super::flags::{as_flag, FlagNames};
use crate::spec::model::ModelSpec;
use crate::Result;

/// The optimizer's flags; each one left out keeps the model spec's value.
#[derive(Debug, Clone, Default, Args)]
pub struct OptimizerArgs {
    /// Learning rate (default: the model spec's `optimizer.lr`).
    #[arg(long, value_name = "LR")]
    pub lr: Option<f64>,
    /// Weight decay: decoupled for AdamW, L2 for Adam (default: the model spec's).
    #[arg(long, value_name = "DECAY")]
    pub weight_decay: Option<f64>,
    /// Adam's first-moment decay, in [0, 1) (default: the model spec's, 0.9 for the presets).
    #[arg(long, value_name = "BETA")]
    pub beta1: Option<f64>,
    /// Adam's second-moment decay, in [0, 1) (default: the model spec's).
    #[arg(long, value_name = "BETA")]
    pub beta2: Option<f64>,
}

/// The spec's optimizer fields by the flag that sets them.
const FLAGS: FlagNames = &[
    ("optimizer.lr", "--lr"),
    ("optimizer.weight_decay", "--weight-decay"),
    ("optimizer.beta1", "--beta1"),
    ("optimizer.beta2", "--beta2"),
];

impl OptimizerArgs {
    /// `spec` with the flags' settings, checked as the spec checks its own (an error names
    /// the flag).
    pub fn apply(&self, spec: &mut ModelSpec) -> Result<()> {
        let optimizer = &mut spec.optimizer;
        let given = [
            (self.lr, &mut optimizer.lr),
            (self.weight_decay, &mut optimizer.weight_decay),
            (self.beta1, &mut optimizer.beta1),
            (self.beta2, &mut optimizer.beta2),
        ];
        for (value, field) in given {
            if let Some(value) = value {
                *field = value;
            }
        }
        spec.validate().map_err(|e| as_flag(e, FLAGS).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_spec_and_bad_values_name_the_flag() {
        let mut spec = ModelSpec::preset("tiny").unwrap();
        let kept = spec.optimizer;
        OptimizerArgs::default().apply(&mut spec).unwrap();
        assert_eq!(spec.optimizer, kept, "no flag changes nothing");
        let args = OptimizerArgs {
            lr: Some(1e-5),
            weight_decay: Some(0.1),
            beta1: None,
            beta2: Some(0.95),
        };
        args.apply(&mut spec).unwrap();
        let o = spec.optimizer;
        assert_eq!(
            (o.lr, o.weight_decay, o.beta1, o.beta2),
            (1e-5, 0.1, kept.beta1, 0.95)
        );
        for (bad, flag) in [
            (
                OptimizerArgs {
                    lr: Some(0.0),
                    ..args.clone()
                },
                "--lr",
            ),
            (
                OptimizerArgs {
                    beta2: Some(1.0),
                    ..args.clone()
                },
                "--beta2",
            ),
            (
                OptimizerArgs {
                    weight_decay: Some(f64::NAN),
                    ..args.clone()
                },
                "--weight-decay",
            ),
        ] {
            let err = bad
                .apply(&mut ModelSpec::preset("tiny").unwrap())
                .unwrap_err();
            assert!(err.to_string().contains(flag), "{err}");
        }
    }
}
