//! `autotune probe`'s flags and [`ProbeSettings`]: one trial of a model at knobs given by
//! hand, on a device, under the limits asked for.

use clap::Args;

use super::flags::{self, as_flag};
use super::knobs::ByHandArgs;
use super::model::resolve_model;
use crate::model::Engine;
use crate::spec::budget::parse_bytes;
use crate::spec::limits;
use crate::spec::model::ModelSpec;
use crate::trial::TrialRequest;
use crate::{Error, Result};

/// The flags of `autotune probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub by_hand: ByHandArgs,
    /// Untimed steps before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Host heap budget (e.g. 8GiB); exceeding it is an out-of-memory outcome.
    #[arg(long)]
    pub host_budget: Option<String>,
    /// Make the GPU behave as one of this size (e.g. 24564MiB for an RTX 4090) by holding back
    /// the rest, so out-of-memory happens where it would on the smaller card.
    #[arg(long)]
    pub gpu_capacity: Option<String>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// A validated `probe`.
#[derive(Debug)]
pub struct ProbeSettings {
    /// The model.
    pub spec: ModelSpec,
    /// The trial.
    pub request: TrialRequest,
    /// The device to run on: `cpu`, `cuda`, `cuda:N` or `auto`.
    pub device: String,
    /// The engine (data-parallel trials run the default one).
    pub engine: Engine,
    /// The emulated GPU's capacity, if any.
    pub gpu_capacity: Option<u64>,
    /// The host heap budget, if any.
    pub host_budget: Option<u64>,
}

impl ProbeSettings {
    /// Resolves and checks `args`.
    pub fn from_args(args: &ProbeArgs) -> Result<Self> {
        let spec = resolve_model(
            &args.by_hand.model.model,
            args.by_hand.model.seq_len.map(|n| n as usize),
        )?;
        let knobs = args.by_hand.knobs.knobs();
        let host_budget = args.host_budget.as_deref().map(bytes).transpose()?;
        let request = TrialRequest {
            knobs,
            warmup_steps: args.warmup,
            timed_steps: args.steps,
            remeasure: false,
        };
        request
            .validate("knobs", "")
            .and_then(|()| limits::check_knobs(&spec, &knobs, "knobs", ""))
            .map_err(|e| as_flag(e, flags::PROBE))?;
        let gpu_capacity = args.gpu_capacity.as_deref().map(bytes).transpose()?;
        if knobs.data_parallel.degree > 1 && args.by_hand.model.engine != Engine::default() {
            return Err(Error::Usage(
                "`--engine` applies to single-GPU trials; drop it or --data-parallel".into(),
            ));
        }
        Ok(Self {
            spec,
            request,
            device: args.by_hand.model.device.clone(),
            engine: args.by_hand.model.engine,
            gpu_capacity,
            host_budget,
        })
    }
}

fn bytes(text: &str) -> Result<u64> {
    parse_bytes(text).map_err(Error::Usage)
}
