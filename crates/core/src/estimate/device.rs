//! The training device's peak: the state, then the largest phase of the step (see the module
//! docs of [`super`] for the formulas).

use super::{Attention, Breakdown, Phase};
use crate::knobs::{Knobs, Offload, Precision, Update};
use crate::spec::activations::CONTEXT_BYTES;
use crate::spec::model::{ModelSpec, NormPlacement};
use crate::spec::state::StateBytes;

/// The most bytes one chunk of the head's logits takes (the engine's `CHUNK_LOGIT_BYTES`).
const CHUNK_LOGIT_BYTES: f64 = 256.0 * 1024.0 * 1024.0;

/// The multiple a GPU head pads the vocabulary to (the engine's `head_row_multiple`).
const GPU_VOCAB_MULTIPLE: usize = 64;

/// The f32 bucket a data-parallel step sums gradients over ranks in (the engine's
/// `BUCKET_ELEMS`, 2^24 values).
const BUCKET_BYTES: f64 = 4.0 * (1u64 << 24) as f64;

/// What a CPU process holds besides training: its thread pools' and kernels' scratch.
pub(super) const CPU_RUNTIME_BYTES: f64 = 2.0 * 1024.0 * 1024.0;

/// The pool's reserve beyond use, as a fraction of a phase's bytes.
const POOL_RESERVE: f64 = 0.04;

/// With checkpointing and offload together, recomputed blocks and parts streamed to the host
/// free memory in an order that leaves more of the pool unused: this much more, plus
/// [`POOL_RESERVE_CHECKPOINT_OFFLOAD`] of the phase.
const POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES: f64 = 0.4 * 1024.0 * 1024.0 * 1024.0;

/// See [`POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES`].
const POOL_RESERVE_CHECKPOINT_OFFLOAD: f64 = 0.10;

/// One phase's bytes beyond the state.
#[derive(Debug, Clone, Copy)]
struct PhaseBytes {
    phase: Phase,
    activations: f64,
    gradients: f64,
    workspace: f64,
}

impl PhaseBytes {
    fn total(&self) -> f64 {
        self.activations + self.gradients + self.workspace
    }
}

/// Bytes per activation value at `precision`.
pub(super) fn activation_bytes(precision: Precision) -> f64 {
    match precision {
        Precision::Fp32 => 4.0,
        Precision::Bf16 | Precision::Fp16 => 2.0,
    }
}

/// The device's peak and the phase it falls in.
pub(super) fn peak(
    model: &ModelSpec,
    knobs: &Knobs,
    on_gpu: bool,
    attention: Attention,
) -> (Breakdown, Phase) {
    let e = activation_bytes(knobs.precision);
    let half = knobs.precision != Precision::Fp32;
    let offload = knobs.offload == Offload::Optimizer;
    let b = knobs.micro_batch as f64;
    let (s, d, f, h, q) = (
        model.seq_len as f64,
        model.d_model as f64,
        model.ff_in_width() as f64,
        model.n_heads as f64,
        model.qkv_width() as f64,
    );
    let vocab = if on_gpu {
        model.vocab_size.div_ceil(GPU_VOCAB_MULTIPLE) * GPU_VOCAB_MULTIPLE
    } else {
        model.vocab_size
    } as f64;
    let padded = vocab > model.vocab_size as f64;
    // The exact update in backward differentiates the head by slices of rows: no whole copy
    // or gradient of its weight exists.
    let by_rows = knobs.update == Update::InBackward && knobs.state.is_exact() && !offload;
    let slice_rows = crate::spec::state::head_slice_rows(
        model.d_model,
        e as usize,
        if on_gpu { GPU_VOCAB_MULTIPLE } else { 1 },
    )
    .min(model.vocab_size) as f64;
    let materialized = attention == Attention::Materialized;

    // Per sequence.
    let x = s * d * e;
    let rows = match model.norm {
        NormPlacement::Pre => 5.0 * d + q + f,
        NormPlacement::Post => 6.0 * d + q + f,
    };
    let mut kept_block = s * rows * e + 4.0 * s * h;
    let mut transient = 2.0 * s * f * e + x;
    if materialized {
        kept_block += q * s * e + h * s * s * e;
        transient += h * s * s * e;
    }
    if half && !on_gpu {
        transient += 3.0 * s * f * 4.0;
    }
    let tokens = 8.0 * s;
    let kept: Vec<f64> = (0..model.n_layers)
        .map(|i| {
            if knobs.checkpointing.recomputes(i) {
                x
            } else {
                kept_block
            }
        })
        .collect();
    let all_kept: f64 = kept.iter().sum();
    let last_kept = kept.last().copied().unwrap_or(0.0);

    // The head's working set.
    let chunk_rows = ((CHUNK_LOGIT_BYTES / (vocab * e) / 64.0).floor() * 64.0).max(64.0);
    let logit_bytes = 2.0 * e + if half && !on_gpu { 8.0 } else { 0.0 };
    let head_rows = (b * s).min(chunk_rows);
    let head_chunk = if by_rows {
        // One slice's weights, and the chunk's f32 input gradient.
        head_rows * vocab * logit_bytes + e * slice_rows * d + 4.0 * head_rows * d
    } else {
        head_rows * vocab * logit_bytes + 4.0 * (d + 1.0) * vocab + e * d * vocab
    };

    // Gradients held once `n` parameters have theirs.
    let groups = model.parameter_groups();
    let p = model.parameter_count() as f64;
    let largest_part = if by_rows {
        (crate::spec::state::exact_in_backward_gradients(model, knobs.precision) / 4) as f64
    } else {
        groups.largest() as f64
    };
    let accumulating = knobs.grad_accum > 1;
    let bucket = if knobs.data_parallel.degree > 1 {
        BUCKET_BYTES
    } else {
        0.0
    };
    let held = |n: f64| -> f64 {
        let parts = if offload {
            if on_gpu {
                e * n.min((groups.head + 2 * groups.block) as f64)
            } else {
                0.0
            }
        } else if knobs.update == Update::InBackward {
            4.0 * n.min(largest_part)
        } else if accumulating {
            4.0 * p
        } else {
            4.0 * n
        };
        parts + bucket
    };

    // A tied head's f32 weight gradient waits through the backward pass for the embeddings'
    // part, and meets it at the end (without offload, whose parts go to the host).
    let tied = if model.tied_embeddings && !offload && !by_rows {
        4.0 * (model.vocab_size * model.d_model) as f64
    } else {
        0.0
    };
    let phases = [
        PhaseBytes {
            phase: Phase::Head,
            activations: b * (all_kept + 2.0 * x + tokens),
            gradients: held(0.0),
            workspace: head_chunk,
        },
        PhaseBytes {
            phase: Phase::BackwardStart,
            activations: b * (all_kept - last_kept + kept_block + transient + tokens),
            gradients: held(groups.head as f64) + tied,
            workspace: 0.0,
        },
        PhaseBytes {
            phase: Phase::BackwardEnd,
            activations: b * (kept_block + transient + tokens),
            gradients: held(p - groups.embeddings as f64) + tied,
            workspace: 0.0,
        },
        PhaseBytes {
            phase: Phase::AfterBackward,
            activations: b * (x + tokens),
            gradients: held(p) + tied,
            workspace: 0.0,
        },
    ];
    let top = phases.into_iter().fold(
        phases[0],
        |best, p| if p.total() > best.total() { p } else { best },
    );

    // The state on the device.
    let state = StateBytes::of(model, knobs).device;
    let shards = knobs.data_parallel.degree.max(1) as f64;
    let moments = if knobs.data_parallel.shard_optimizer {
        state.moments as f64 / shards
    } else {
        state.moments as f64
    };
    let casts = if half && !offload {
        e * (groups.block.max(if by_rows { 0 } else { groups.head }) as f64)
    } else {
        0.0
    };
    // The head's weights are copied when they are cast (half precision, unless offload keeps
    // them half already) or padded (on a GPU); by rows, a slice at a time (in `head_chunk`).
    let head_copy = if by_rows {
        0.0
    } else if (half && !offload) || (on_gpu && (padded || half)) {
        e * (d + 1.0) * vocab
    } else {
        0.0
    };

    let allocator = if on_gpu {
        let mut reserve = POOL_RESERVE * top.total();
        if offload && knobs.checkpointing != crate::knobs::Checkpointing::None {
            reserve += POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES
                + POOL_RESERVE_CHECKPOINT_OFFLOAD * top.total();
        }
        reserve
    } else {
        0.0
    };
    let runtime = if on_gpu {
        CONTEXT_BYTES
    } else {
        CPU_RUNTIME_BYTES
    };
    (
        Breakdown {
            parameters: bytes(state.weights as f64),
            gradients: bytes(top.gradients),
            optimizer_state: bytes(moments),
            activations: bytes(top.activations),
            workspace: bytes(casts + head_copy + top.workspace),
            allocator: bytes(allocator),
            runtime: bytes(runtime),
        },
        top.phase,
    )
}

/// Whole bytes, saturating at `u64::MAX` (a float too large for it converts to the maximum).
pub(super) fn bytes(value: f64) -> u64 {
    value.max(0.0).round() as u64
}
