//! The job a trial process is handed: the model, the device, the limits, and the trial.

use serde::{Deserialize, Serialize};

use crate::knobs::{Knobs, Precision};
use crate::spec::model::ModelSpec;
use crate::trial::TrialRequest;

/// Everything a trial process (a child, a worker, a rank) needs to run one trial.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrialJob {
    /// The model.
    pub model: ModelSpec,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: String,
    /// Emulated GPU capacity in bytes.
    pub gpu_capacity: Option<u64>,
    /// Host heap budget in bytes.
    pub host_budget: Option<u64>,
    /// The trial.
    pub request: TrialRequest,
}

impl TrialJob {
    /// The job for trials of `model` on `device`; each trial sets its own `request`.
    pub fn new(
        model: &ModelSpec,
        device: &str,
        gpu_capacity: Option<u64>,
        host_budget: Option<u64>,
    ) -> Self {
        Self {
            model: model.clone(),
            device: device.to_string(),
            gpu_capacity,
            host_budget,
            request: TrialRequest {
                knobs: Knobs::new(1, Precision::Fp32),
                warmup_steps: 0,
                timed_steps: 0,
            },
        }
    }
}
