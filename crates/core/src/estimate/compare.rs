//! The estimate against measured peaks: every trial of a recording that fitted, its training
//! device's measured peak (GPU bytes on a GPU, host bytes on the CPU) beside the estimate; and
//! on a GPU, the host peak of the trials that keep training state in host memory.

use serde::{Deserialize, Serialize};

use super::{estimate, Attention};
use crate::knobs::{Knobs, MomentPlace, Offload};
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial::TrialResult;

/// One trial's measured peak against the estimate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RecordedError {
    /// The trial's setting.
    pub knobs: Knobs,
    /// Its measured peak on the training device, bytes.
    pub measured_bytes: u64,
    /// The estimate, bytes.
    pub estimated_bytes: u64,
    /// `(estimated − measured) / measured`: positive where the estimate is high.
    pub relative_error: f64,
}

impl RecordedError {
    /// The error of `estimated_bytes` against a nonzero `measured_bytes` at `knobs`.
    fn new(knobs: Knobs, measured_bytes: u64, estimated_bytes: u64) -> Self {
        Self {
            knobs,
            measured_bytes,
            estimated_bytes,
            relative_error: (estimated_bytes as f64 - measured_bytes as f64)
                / measured_bytes as f64,
        }
    }
}

/// The estimate of every trial in `trials` that fitted (and measured a nonzero peak), in order,
/// for `model` trained on a device of `kind` with `attention`.
pub fn compare(
    model: &ModelSpec,
    kind: DeviceKind,
    attention: Attention,
    trials: &[TrialResult],
) -> Vec<RecordedError> {
    trials
        .iter()
        .filter_map(|trial| {
            let measured = trial.outcome.measurement()?;
            let measured_bytes = match kind {
                DeviceKind::Cuda => measured.peak_gpu_bytes,
                DeviceKind::Cpu => measured.peak_host_bytes,
            };
            if measured_bytes == 0 {
                return None;
            }
            let knobs = trial.request.knobs;
            let estimated_bytes = estimate(model, &knobs, kind, attention).device_total();
            Some(RecordedError::new(knobs, measured_bytes, estimated_bytes))
        })
        .collect()
}

/// The host peak of every GPU trial in `trials` that fitted and keeps training state in host
/// memory (optimizer offload, or moments in host memory) beside the estimate's host total. The
/// host memory of other GPU trials is the runtime's (libraries, the CUDA context's mappings),
/// which the estimate does not model.
pub fn compare_host(
    model: &ModelSpec,
    attention: Attention,
    trials: &[TrialResult],
) -> Vec<RecordedError> {
    trials
        .iter()
        .filter(|trial| keeps_state_on_the_host(&trial.request.knobs))
        .filter_map(|trial| {
            let measured_bytes = trial.outcome.measurement()?.peak_host_bytes;
            if measured_bytes == 0 {
                return None;
            }
            let knobs = trial.request.knobs;
            let estimated_bytes = estimate(model, &knobs, DeviceKind::Cuda, attention)
                .host
                .total();
            Some(RecordedError::new(knobs, measured_bytes, estimated_bytes))
        })
        .collect()
}

/// Whether a GPU trial at `knobs` keeps part of the training state in host memory.
fn keeps_state_on_the_host(knobs: &Knobs) -> bool {
    knobs.offload == Offload::Optimizer || knobs.state.moments_on == MomentPlace::Host
}
