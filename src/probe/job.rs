//! What a prober's trials run with, and what every prober whose trials run in other processes
//! holds: the setup each trial process is handed ([`TrialSetup`], with the trial in a
//! [`TrialJob`]), the program started, and the trials' time limit ([`TrialProcesses`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::timeout::TrialTimeout;
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial::TrialRequest;

/// What every trial of one prober runs with: the model, the device and the limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrialSetup {
    /// The model.
    pub model: ModelSpec,
    /// `cpu`, `cuda`, `cuda:N` (ranks of a data-parallel trial pin `cuda:rank`).
    pub device: String,
    /// Emulated GPU capacity in bytes.
    pub gpu_capacity: Option<u64>,
    /// Host heap budget in bytes.
    pub host_budget: Option<u64>,
}

impl TrialSetup {
    /// Trials of `model` on `device` within those limits.
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
        }
    }

    /// The kind of device the trials open.
    pub fn device_kind(&self) -> DeviceKind {
        if self.device.starts_with("cuda") {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        }
    }
}

/// The device a trial of a `kind` target opens, as trial processes are told it.
pub fn device_name(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
    }
}

/// Everything a trial process (a child, a worker, a rank) needs to run one trial.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrialJob {
    /// What every trial of the prober runs with.
    pub setup: TrialSetup,
    /// The trial.
    pub request: TrialRequest,
}

/// The base of every prober whose trials run in processes it starts: the `program` (the
/// autotune executable, or a trial runner's command), the setup every trial runs with, and the
/// trials' time limit.
#[derive(Debug, Clone)]
pub struct TrialProcesses<P = PathBuf> {
    /// What each trial process runs.
    pub program: P,
    /// What every trial runs with.
    pub setup: TrialSetup,
    /// How long a trial may run before it is stopped as timed out.
    pub timeout: TrialTimeout,
}

impl<P> TrialProcesses<P> {
    /// Trials of `setup` run by `program`, limited by the scaled default timeout.
    pub fn new(program: P, setup: TrialSetup) -> Self {
        Self {
            program,
            setup,
            timeout: TrialTimeout::scaled(),
        }
    }

    /// Trials limited by `timeout` instead of the scaled default.
    pub fn with_timeout(mut self, timeout: TrialTimeout) -> Self {
        self.timeout = timeout;
        self
    }

    /// The job that runs `request`.
    pub fn job(&self, request: &TrialRequest) -> TrialJob {
        TrialJob {
            setup: self.setup.clone(),
            request: *request,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::{Knobs, Precision};

    #[test]
    fn a_job_carries_the_setup_and_the_trial_and_reads_back() {
        let setup = TrialSetup::new(&ModelSpec::tiny(), "cuda", Some(24 << 30), Some(32 << 30));
        assert_eq!(setup.device_kind(), DeviceKind::Cuda);
        assert_eq!(
            TrialSetup::new(&ModelSpec::tiny(), device_name(DeviceKind::Cpu), None, None)
                .device_kind(),
            DeviceKind::Cpu
        );
        let trials = TrialProcesses::new(PathBuf::from("autotune"), setup.clone());
        let request = TrialRequest {
            knobs: Knobs::new(4, Precision::Bf16),
            warmup_steps: 1,
            timed_steps: 3,
            remeasure: false,
        };
        let job = trials.job(&request);
        let back: TrialJob = serde_json::from_str(&serde_json::to_string(&job).unwrap()).unwrap();
        assert_eq!((back.setup, back.request), (setup, request));
    }
}
