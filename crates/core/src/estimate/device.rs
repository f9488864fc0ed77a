//! The training device's peak: the state, then the largest phase of the step (see the module
//! docs of [`super`] for the formulas).

use super::{Attention, Breakdown, Phase};
use crate::knobs::{Checkpointing, Knobs, Offload, Precision, Update};
use crate::spec::activations::CONTEXT_BYTES;
use crate::spec::model::{ModelSpec, NormPlacement, ParameterGroups};
use crate::spec::state::{exact_in_backward_gradients, head_slice_rows, StateBytes};

/// The most bytes one chunk of the head's logits takes (the engine's `CHUNK_LOGIT_BYTES`).
const CHUNK_LOGIT_BYTES: f64 = 256.0 * 1024.0 * 1024.0;

/// The multiple of rows a chunk of the head holds, and its fewest rows: the engine's
/// `chunk_rows` keeps its products on aligned kernels.
const CHUNK_ROW_MULTIPLE: f64 = 64.0;

/// The multiple a GPU head pads the vocabulary to (the engine's `head_row_multiple`).
const GPU_VOCAB_MULTIPLE: usize = 64;

/// The f32 bucket a data-parallel step sums gradients over ranks in (the engine's
/// `BUCKET_ELEMS`, 2^24 values).
const BUCKET_BYTES: f64 = 4.0 * (1u64 << 24) as f64;

/// What a CPU process holds besides training: its thread pools' and kernels' scratch.
pub(super) const CPU_RUNTIME_BYTES: f64 = 2.0 * 1024.0 * 1024.0;

/// The pool's reserve beyond use, as a fraction of a phase's bytes.
const POOL_RESERVE: f64 = 0.04;

/// With checkpointing and offload together, the backward pass's recomputed blocks and parts
/// streamed to the host free memory in an order that leaves more of the pool unused: this much
/// more in a backward phase, plus [`POOL_RESERVE_CHECKPOINT_OFFLOAD`] of the phase. What is
/// left unused varies from run to run (gpt-1.3b at micro-batch 16 on an H100 reserved 0.31 and
/// 0.55 GiB beyond its bytes in two recordings, gpt-2b at 10 on an H200 1.85 GiB); this is the
/// value that keeps every recorded trial within the estimate's stated bound.
const POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES: f64 = 0.55 * GIB;

/// See [`POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES`].
const POOL_RESERVE_CHECKPOINT_OFFLOAD: f64 = 0.06;

/// The head's phase runs before the backward pass's recomputation, and its chunks find most of
/// the blocks the last step freed: with checkpointing and offload it reserves only this much
/// more (gpt-1.3b at micro-batch 8 on an H100, whose peak is there, measured 5.36 GiB, 0.6 GiB
/// below the backward phases' reserve on the same bytes).
const POOL_RESERVE_CHECKPOINT_OFFLOAD_HEAD_BYTES: f64 = 0.2 * GIB;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Bytes of an f32 value: gradients, log-sum-exps and the CPU's widened values are f32
/// whatever the precision.
const F32_BYTES: f64 = 4.0;

/// Token-id bytes per position: the input and the target, a u32 each.
const TOKEN_ID_BYTES: f64 = 8.0;

/// The `d`-wide tensors a pre-norm block keeps for its backward pass (the engine's `Saved`):
/// its input, the q/k/v product's input, the merged heads, the residual sum and the
/// feed-forward input.
const PRE_NORM_KEPT_WIDTHS: f64 = 5.0;

/// A post-norm block keeps the same and the second norm's input.
const POST_NORM_KEPT_WIDTHS: f64 = 6.0;

/// The `f`-wide tensors a block's backward pass widens to f32 on the CPU in half precision,
/// whose kernels compute in f32.
const CPU_WIDENED_FF_TENSORS: f64 = 3.0;

/// Bytes per logit the CPU's half-precision cross entropy adds: it works on f32 copies of
/// the logits and their gradient.
const CPU_HALF_LOSS_BYTES: f64 = 8.0;

/// Parts whose gradients may wait on a GPU for the host with offload, the host being the
/// slower side (the engine's `PARTS_IN_FLIGHT`): counted as the head and this many blocks.
const PARTS_IN_FLIGHT: usize = 2;

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
        Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => 2.0,
    }
}

/// The device's peak and the phase it falls in.
pub(super) fn peak(
    model: &ModelSpec,
    knobs: &Knobs,
    on_gpu: bool,
    attention: Attention,
) -> (Breakdown, Phase) {
    let step = Step::new(model, knobs, on_gpu);
    // The pool's reserve differs by phase, so the peak is the largest phase with its reserve.
    let top = largest(step.phases(attention), |p| p.total() + step.pool_reserve(p));
    let state = StateBytes::of(model, knobs).device;
    (
        Breakdown {
            parameters: bytes(state.weights as f64),
            gradients: bytes(top.gradients),
            optimizer_state: bytes(device_moments(state.moments, knobs)),
            activations: bytes(top.activations),
            workspace: bytes(step.weight_casts() + step.head_copy() + top.workspace),
            allocator: bytes(step.pool_reserve(&top)),
            runtime: bytes(if on_gpu {
                CONTEXT_BYTES
            } else {
                CPU_RUNTIME_BYTES
            }),
        },
        top.phase,
    )
}

/// The phase with the most bytes by `size` (the first of equals).
fn largest(phases: [PhaseBytes; 4], size: impl Fn(&PhaseBytes) -> f64) -> PhaseBytes {
    phases.into_iter().fold(
        phases[0],
        |best, p| {
            if size(&p) > size(&best) {
                p
            } else {
                best
            }
        },
    )
}

/// Adam's moments on the device: each of `N` ranks keeps `1/N` of them when they are sharded.
fn device_moments(moments: u64, knobs: &Knobs) -> f64 {
    let shards = knobs.data_parallel.degree.max(1) as f64;
    if knobs.data_parallel.shard_optimizer {
        moments as f64 / shards
    } else {
        moments as f64
    }
}

/// What the formulas read of one setting on one device.
struct Step<'a> {
    model: &'a ModelSpec,
    knobs: &'a Knobs,
    on_gpu: bool,
    groups: ParameterGroups,
    /// Bytes per activation value (`e`).
    element: f64,
    /// Whether the passes run in bf16 or fp16.
    half: bool,
    /// Whether the optimizer runs on the host.
    offload: bool,
    /// The head's rows: the vocabulary, padded on a GPU (`V′`).
    vocab: f64,
    /// The exact update in backward differentiates the head by slices of rows: no whole copy
    /// or gradient of its weight exists.
    head_by_rows: bool,
}

impl<'a> Step<'a> {
    fn new(model: &'a ModelSpec, knobs: &'a Knobs, on_gpu: bool) -> Self {
        let offload = knobs.offload == Offload::Optimizer;
        let vocab = if on_gpu {
            model.vocab_size.div_ceil(GPU_VOCAB_MULTIPLE) * GPU_VOCAB_MULTIPLE
        } else {
            model.vocab_size
        } as f64;
        Step {
            model,
            knobs,
            on_gpu,
            groups: model.parameter_groups(),
            element: activation_bytes(knobs.precision),
            half: knobs.precision != Precision::Fp32,
            offload,
            vocab,
            head_by_rows: knobs.update == Update::InBackward && knobs.state.is_exact() && !offload,
        }
    }

    /// The four phases of the step, beyond the state.
    fn phases(&self, attention: Attention) -> [PhaseBytes; 4] {
        let batch = self.knobs.micro_batch as f64;
        let SequenceActivations {
            residual,
            kept_block,
            transient,
            tokens,
            all_kept,
            last_kept,
        } = self.sequence_activations(attention);
        let held = self.held_gradients();
        let tied = self.tied_head_gradient();
        let parameters = self.model.parameter_count() as f64;
        [
            PhaseBytes {
                phase: Phase::Head,
                // Beside every block's kept tensors, the head's input and the gradient it
                // returns.
                activations: batch * (all_kept + 2.0 * residual + tokens),
                gradients: held.once(0.0),
                workspace: self.head_workspace(),
            },
            PhaseBytes {
                phase: Phase::BackwardStart,
                activations: batch * (all_kept - last_kept + kept_block + transient + tokens),
                gradients: held.once(self.groups.head as f64) + tied,
                workspace: 0.0,
            },
            PhaseBytes {
                phase: Phase::BackwardEnd,
                activations: batch * (kept_block + transient + tokens),
                gradients: held.once(parameters - self.groups.embeddings as f64) + tied,
                workspace: 0.0,
            },
            PhaseBytes {
                phase: Phase::AfterBackward,
                activations: batch * (residual + tokens),
                gradients: held.once(parameters) + tied,
                workspace: 0.0,
            },
        ]
    }

    /// What one sequence of the micro-batch keeps and holds through the passes.
    fn sequence_activations(&self, attention: Attention) -> SequenceActivations {
        let model = self.model;
        let e = self.element;
        let (seq_len, width, ff_width, heads, qkv_width) = (
            model.seq_len as f64,
            model.d_model as f64,
            model.ff_in_width() as f64,
            model.n_heads as f64,
            model.qkv_width() as f64,
        );
        let residual = seq_len * width * e;
        let kept_widths = match model.norm {
            NormPlacement::Pre => PRE_NORM_KEPT_WIDTHS * width + qkv_width + ff_width,
            NormPlacement::Post => POST_NORM_KEPT_WIDTHS * width + qkv_width + ff_width,
        };
        // The kept tensors, and one f32 log-sum-exp per row and head.
        let mut kept_block = seq_len * kept_widths * e + F32_BYTES * seq_len * heads;
        // The recomputed feed-forward activation and its gradient, and the incoming gradient.
        let mut transient = 2.0 * seq_len * ff_width * e + residual;
        if attention == Attention::Materialized {
            // The heads and the probabilities kept; the probabilities' gradient in backward.
            kept_block += qkv_width * seq_len * e + heads * seq_len * seq_len * e;
            transient += heads * seq_len * seq_len * e;
        }
        if self.half && !self.on_gpu {
            transient += CPU_WIDENED_FF_TENSORS * seq_len * ff_width * F32_BYTES;
        }
        let kept: Vec<f64> = (0..model.n_layers)
            .map(|i| {
                if self.knobs.checkpointing.recomputes(i) {
                    residual
                } else {
                    kept_block
                }
            })
            .collect();
        SequenceActivations {
            residual,
            kept_block,
            transient,
            tokens: TOKEN_ID_BYTES * seq_len,
            all_kept: kept.iter().sum(),
            last_kept: kept.last().copied().unwrap_or(0.0),
        }
    }

    /// The head's working set: a chunk of logits and their gradient, and either the head's
    /// f32 weight-gradient sum and one chunk's product, or (by rows) one slice's weights and
    /// the chunk's f32 input gradient.
    fn head_workspace(&self) -> f64 {
        let (e, vocab) = (self.element, self.vocab);
        let width = self.model.d_model as f64;
        let batch_rows = self.knobs.micro_batch as f64 * self.model.seq_len as f64;
        let chunk_rows = ((CHUNK_LOGIT_BYTES / (vocab * e) / CHUNK_ROW_MULTIPLE).floor()
            * CHUNK_ROW_MULTIPLE)
            .max(CHUNK_ROW_MULTIPLE);
        // A logit and its gradient.
        let logit_bytes = 2.0 * e
            + if self.half && !self.on_gpu {
                CPU_HALF_LOSS_BYTES
            } else {
                0.0
            };
        let rows = batch_rows.min(chunk_rows);
        if self.head_by_rows {
            let row_multiple = if self.on_gpu { GPU_VOCAB_MULTIPLE } else { 1 };
            let slice_rows = head_slice_rows(self.model.d_model, e as usize, row_multiple)
                .min(self.model.vocab_size) as f64;
            rows * vocab * logit_bytes + e * slice_rows * width + F32_BYTES * rows * width
        } else {
            // The weight gradient has a bias column: `d + 1` values a row.
            rows * vocab * logit_bytes + F32_BYTES * (width + 1.0) * vocab + e * width * vocab
        }
    }

    /// How the step holds gradients as the backward pass goes.
    fn held_gradients(&self) -> HeldGradients {
        let holding = if self.offload {
            if self.on_gpu {
                Holding::OnTheWayToHost {
                    element: self.element,
                    most: (self.groups.head + PARTS_IN_FLIGHT * self.groups.block) as f64,
                }
            } else {
                Holding::Nothing
            }
        } else if self.knobs.update == Update::InBackward {
            Holding::LargestPart(if self.head_by_rows {
                // Bytes of f32 gradients, as values.
                (exact_in_backward_gradients(self.model, self.knobs.precision) / 4) as f64
            } else {
                self.groups.largest() as f64
            })
        } else if self.knobs.grad_accum > 1 {
            Holding::Sum(self.model.parameter_count() as f64)
        } else {
            Holding::SoFar
        };
        HeldGradients {
            holding,
            bucket: if self.knobs.data_parallel.degree > 1 {
                BUCKET_BYTES
            } else {
                0.0
            },
        }
    }

    /// A tied head's f32 weight gradient waits through the backward pass for the embeddings'
    /// part, and meets it at the end (without offload, whose parts go to the host, and not by
    /// rows, where the head's weight gradient comes after the backward pass).
    fn tied_head_gradient(&self) -> f64 {
        if self.model.tied_embeddings && !self.offload && !self.head_by_rows {
            F32_BYTES * (self.model.vocab_size * self.model.d_model) as f64
        } else {
            0.0
        }
    }

    /// One part's weights cast to half precision for its pass (offload keeps half-precision
    /// working copies already; by rows the head is cast a slice at a time).
    fn weight_casts(&self) -> f64 {
        if self.half && !self.offload {
            let head = if self.head_by_rows {
                0
            } else {
                self.groups.head
            };
            self.element * (self.groups.block.max(head) as f64)
        } else {
            0.0
        }
    }

    /// The head's weights are copied when they are cast (half precision, unless offload keeps
    /// them half already) or padded (on a GPU); by rows, a slice at a time (in the head's
    /// workspace).
    fn head_copy(&self) -> f64 {
        let padded = self.vocab > self.model.vocab_size as f64;
        let cast = self.half && !self.offload;
        if self.head_by_rows {
            0.0
        } else if cast || (self.on_gpu && (padded || self.half)) {
            self.element * (self.model.d_model as f64 + 1.0) * self.vocab
        } else {
            0.0
        }
    }

    /// What a GPU's memory pool reserves beyond `phase`'s bytes; nothing on the CPU.
    fn pool_reserve(&self, phase: &PhaseBytes) -> f64 {
        if !self.on_gpu {
            return 0.0;
        }
        let phase_bytes = phase.total();
        let reserve = POOL_RESERVE * phase_bytes;
        if !self.offload || self.knobs.checkpointing == Checkpointing::None {
            return reserve;
        }
        reserve
            + match phase.phase {
                Phase::Head => POOL_RESERVE_CHECKPOINT_OFFLOAD_HEAD_BYTES,
                _ => {
                    POOL_RESERVE_CHECKPOINT_OFFLOAD_BYTES
                        + POOL_RESERVE_CHECKPOINT_OFFLOAD * phase_bytes
                }
            }
    }
}

/// Activation bytes of one sequence of the micro-batch (the module docs' names in brackets).
#[derive(Debug, Clone, Copy)]
struct SequenceActivations {
    /// One residual-stream tensor: a block's input, output or gradient (`x`).
    residual: f64,
    /// What a block keeps for its backward pass unless it is recomputed (`K`).
    kept_block: f64,
    /// What a block's backward pass holds beside what it kept (`T`).
    transient: f64,
    /// The token ids.
    tokens: f64,
    /// What every block keeps, recomputed ones their input only (`A`).
    all_kept: f64,
    /// What the last block keeps.
    last_kept: f64,
}

/// The gradient bytes held once some parameters have theirs (`G(n)`).
struct HeldGradients {
    holding: Holding,
    /// The data-parallel bucket being summed over ranks, or nothing on one device.
    bucket: f64,
}

/// How gradients stay on the device as the backward pass goes.
enum Holding {
    /// Offload on a GPU: the parts on their way to the host, at most `most` parameters'.
    OnTheWayToHost { element: f64, most: f64 },
    /// Offload on the CPU: the optimizer takes each part where it is.
    Nothing,
    /// The update in backward: at most the largest part's f32 gradients at once.
    LargestPart(f64),
    /// Accumulation: the f32 sums of every parameter, throughout.
    Sum(f64),
    /// The update after backward: every f32 gradient computed so far.
    SoFar,
}

impl HeldGradients {
    /// The bytes held once `n` parameters have their gradients.
    fn once(&self, n: f64) -> f64 {
        let parts = match self.holding {
            Holding::OnTheWayToHost { element, most } => element * n.min(most),
            Holding::Nothing => 0.0,
            Holding::LargestPart(largest) => F32_BYTES * n.min(largest),
            Holding::Sum(parameters) => F32_BYTES * parameters,
            Holding::SoFar => F32_BYTES * n,
        };
        parts + self.bucket
    }
}

/// Whole bytes, saturating at `u64::MAX` (a float too large for it converts to the maximum).
pub(super) fn bytes(value: f64) -> u64 {
    value.max(0.0).round() as u64
}
