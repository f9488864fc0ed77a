//! `autotune estimate`'s flags and [`EstimateSettings`]: one setting of a model on a target
//! with the engine's attention and the budget to judge it by, or a recording to compare the
//! estimate with.

use std::path::PathBuf;

use clap::Args;

use super::flags::{self, as_flag};
use super::knobs::KnobArgs;
use super::target::TargetArgs;
use crate::estimate::Attention;
use crate::model::Engine;
use crate::profile::record::Profile;
use crate::spec::budget::Budget;
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::{Knobs, Precision, Result};

/// The flags of `autotune estimate`.
#[derive(Debug, Args)]
pub struct EstimateArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub planned: TargetArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub knobs: KnobArgs,
    /// The engine to estimate: explicit (flash attention where the GPU has kernels for it) or
    /// explicit-materialized (attention probabilities kept).
    #[arg(long, default_value = "explicit")]
    pub engine: Engine,
    /// Fraction of each memory kept free when saying whether the setting fits (default 0.05).
    #[arg(long)]
    pub headroom: Option<f64>,
    /// Compare the estimate with every fitted trial of this recorded profile instead (its
    /// model and device; the knob flags are not used).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Print one JSON document on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What an `estimate` asks.
#[derive(Debug)]
pub enum EstimateSettings {
    /// One setting, judged against the target's budget.
    Setting {
        /// The model.
        model: Box<ModelSpec>,
        /// The target machine.
        target: Box<DeviceSpec>,
        /// The setting.
        knobs: Knobs,
        /// Whether the engine keeps attention's probabilities.
        attention: Attention,
        /// The budget, with the headroom asked for.
        budget: Budget,
    },
    /// Every fitted trial of a recording, against its estimate.
    Recording {
        /// The recording's file.
        path: PathBuf,
        /// The recording.
        profile: Box<Profile>,
        /// The engine to estimate.
        engine: Engine,
    },
}

impl EstimateSettings {
    /// Resolves and checks `args`; the notes a renamed flag's old name leaves go to `notes`.
    pub fn from_args(args: &EstimateArgs, notes: &mut Vec<String>) -> Result<Self> {
        if let Some(path) = &args.profile {
            return Ok(Self::Recording {
                path: path.clone(),
                profile: Box::new(Profile::load(path)?),
                engine: args.engine,
            });
        }
        notes.extend(args.planned.note());
        if args.planned.longest_asked() {
            return Err(autotune_core::Error::InvalidFlag {
                flag: "--seq-len auto".into(),
                problem: "is for tune and run; estimate says the longest sequence at its knobs \
                          on every run: give --seq-len N, or leave it out"
                    .into(),
            }
            .into());
        }
        let model = args.planned.model_spec()?;
        let target = args.planned.spec()?;
        let knobs = args.knobs.knobs();
        knobs
            .validate("knobs", "")
            .and_then(|()| limits::check_knobs(&model, &knobs, "knobs", ""))
            .map_err(|e| as_flag(e, flags::TRAIN))?;
        let mut budget = Budget::from_device(&target);
        if let Some(h) = args.headroom {
            budget.headroom = h;
        }
        budget
            .validate()
            .map_err(|e| as_flag(e, &[("headroom", "--headroom")]))?;
        let attention = attention(args.engine, &model, &target, knobs.precision)?;
        Ok(Self::Setting {
            model: Box::new(model),
            target: Box::new(target),
            knobs,
            attention,
            budget,
        })
    }
}

/// Whether the engine keeps attention probabilities on `target` at `precision`: the explicit
/// engine runs flash attention on the CPU, and on a GPU in half precision for the head widths
/// its kernels cover.
pub fn attention(
    engine: Engine,
    model: &ModelSpec,
    target: &DeviceSpec,
    precision: Precision,
) -> Result<Attention> {
    match engine {
        Engine::Explicit => {
            let flash = target.kind == DeviceKind::Cpu
                || (precision != Precision::Fp32
                    && crate::ops::FLASH_HEAD_DIMS.contains(&model.head_dim()));
            Ok(if flash {
                Attention::Flash
            } else {
                Attention::Materialized
            })
        }
        Engine::ExplicitMaterialized => Ok(Attention::Materialized),
        Engine::Fused | Engine::Composite => Err(autotune_core::Error::InvalidFlag {
            flag: "--engine".into(),
            problem: "the estimate describes the explicit engine; use explicit or \
                      explicit-materialized"
                .into(),
        }
        .into()),
    }
}
