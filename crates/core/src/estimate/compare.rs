//! The estimate against measured peaks: every trial of a recording that fitted, its training
//! device's measured peak (GPU bytes on a GPU, host bytes on the CPU) beside the estimate.

use serde::{Deserialize, Serialize};

use super::{estimate, Attention};
use crate::knobs::Knobs;
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
            Some(RecordedError {
                knobs,
                measured_bytes,
                estimated_bytes,
                relative_error: (estimated_bytes as f64 - measured_bytes as f64)
                    / measured_bytes as f64,
            })
        })
        .collect()
}
