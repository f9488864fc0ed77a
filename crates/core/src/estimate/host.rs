//! Host memory beside the training device: what offload keeps there (or the compact state's
//! moments, when they live in host memory), transfer buffers, a checkpoint's staged tensor and
//! a step's token ids (see the module docs of [`super`]).

use super::device::{activation_bytes, bytes};
use super::Breakdown;
use crate::knobs::{Knobs, Offload};
use crate::spec::model::ModelSpec;
use crate::spec::state::{offload_streams, StateBytes};

/// Host buffers of the largest part a streamed step keeps on a GPU: three gradient downloads
/// and two working-copy uploads (the engine's `DOWNLOAD_BUFFERS + UPLOAD_BUFFERS`).
const GPU_STREAM_BUFFERS: f64 = 5.0;

/// The same on the CPU, where a copy is a `memcpy` and the update keeps pace: about three.
const CPU_STREAM_BUFFERS: f64 = 3.0;

/// Host bytes beside the device's: all ranks of the host together. On the CPU the device's own
/// bytes come on top (the caller adds them).
pub(super) fn beside_device(model: &ModelSpec, knobs: &Knobs, on_gpu: bool) -> Breakdown {
    let e = activation_bytes(knobs.precision);
    let ranks = knobs.data_parallel.degree.max(1) as f64;
    let largest_tensor = largest_tensor(model) as f64;
    let tokens = 8.0 * model.seq_len as f64 * knobs.per_rank_batch() as f64 * ranks;
    let staged = 4.0 * largest_tensor;
    let mut host = Breakdown::default();
    if knobs.offload == Offload::Optimizer {
        let state = StateBytes::of(model, knobs).host;
        let buffers = if offload_streams(model, knobs) {
            let count = if on_gpu {
                GPU_STREAM_BUFFERS
            } else {
                CPU_STREAM_BUFFERS
            };
            count * model.parameter_groups().largest() as f64 * e
        } else {
            largest_tensor * e
        };
        host.parameters = bytes(state.weights as f64 * ranks);
        host.optimizer_state = bytes(state.moments as f64 * ranks);
        host.gradients = bytes(state.gradients as f64 * ranks);
        host.workspace = bytes(buffers * ranks);
    }
    if knobs.offload != Offload::Optimizer {
        // Compact moments kept in page-locked host memory, streamed through each part's
        // update (none for the exact layouts, whose state stays on the device).
        let state = StateBytes::of(model, knobs).host;
        host.optimizer_state = bytes(state.moments as f64 * ranks);
    }
    if on_gpu {
        // The GPU's host side: a checkpoint stages one tensor at a time, and a step's batch
        // waits as token ids; the larger of the two sets the peak.
        host.workspace = host.workspace.saturating_add(bytes(staged.max(tokens)));
    }
    host
}

/// Elements of the largest parameter tensor: the token embedding or the head, a q/k/v
/// matrix, a feed-forward input matrix (SwiGLU's gate and up together), or the position
/// table.
fn largest_tensor(model: &ModelSpec) -> usize {
    let d = model.d_model;
    [
        model.vocab_size.saturating_mul(d),
        model.qkv_width().saturating_mul(d),
        d.saturating_mul(model.ff_in_width()),
        model.seq_len.saturating_mul(d),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
}
