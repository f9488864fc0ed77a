//! An analytic estimate of a setting's peak GPU and host memory, without running anything:
//! parameters, gradients, optimizer state and activations, for every precision,
//! checkpointing, offload and update placement.
//!
//! The estimate follows the explicit engine's step (`autotune`'s default engine) phase by
//! phase and takes the largest. It is what `autotune estimate` prints; the search itself
//! keeps its cruder prior ([`crate::spec::activations`]) and decides on measured trials.
//!
//! # Notation
//!
//! `P` parameters (`v` of them vectors: biases and norms), `b` the micro-batch, `s` tokens per
//! sequence, `d` the width, `f` the feed-forward width, `H` heads, `L` blocks, `V` the
//! vocabulary (`V′`: padded to a multiple of 64 on a GPU, as the engine pads its head), `e`
//! bytes per activation value (4 in fp32, 2 in bf16 and fp16).
//!
//! # The training state (for the whole step)
//!
//! As [`crate::spec::state::StateBytes`] lays it out: weights `4P` (with offload, half-precision
//! working copies `2(P − v) + 4v`), Adam moments `8P` (none on the device with offload, `8P / N`
//! with the optimizer sharded over `N` GPUs); in half precision without offload one part's
//! weights cast for its pass, `e · max(block, head)`; the padded head's copy `e · (d + 1) · V′`
//! where the head is cast or padded. A GPU adds its CUDA context and libraries (640 MiB,
//! [`crate::spec::activations::CONTEXT_BYTES`]); a CPU process its runtime (2 MiB).
//!
//! # One step, per sequence of the micro-batch
//!
//! - `x = s·d·e`: one residual-stream activation (a block's input, output or gradient).
//! - `K = s·(5d + q + f)·e + 4·s·H` (post-norm blocks `6d`), with `q` the q/k/v product's
//!   width (`3d`, or `(H + 2·KV)·hd` with grouped key/value heads) and `f` the feed-forward
//!   input product's (`d_ff`, or `2·d_ff` for SwiGLU's gate and up): what a block keeps for
//!   its backward pass with flash attention (its input, the q/k/v product's input and output,
//!   the merged heads, the residual sum, the feed-forward input and hidden product, one f32
//!   log-sum-exp per row and head). Materialised attention keeps the heads and probabilities
//!   too, `+ q·s·e + H·s²·e`.
//! - `kept(i) = x` for a block that activation checkpointing recomputes, else `K`; `A = Σ kept`.
//! - `T = 2·s·f·e + x`: what a block's backward pass holds beside `K` (the recomputed
//!   feed-forward activation and its gradient, the incoming gradient); materialised attention
//!   adds the probabilities' gradient `H·s²·e`; on the CPU in half precision the kernels widen
//!   to f32, `+ 3·s·f·4`.
//! - `8·s` bytes of token ids (inputs and targets as u32).
//!
//! The head runs in chunks of `c = max(64, ⌊256 MiB / (V′·e) / 64⌋·64)` rows: at most
//! `min(b·s, c)` rows of logits and their gradient exist at once, `2e` bytes per logit (`2e + 8`
//! on the CPU in half precision, whose cross entropy works in f32), beside the head's f32
//! weight-gradient sum `4·(d + 1)·V′` and one chunk's product `e·d·V′`. The exact update in
//! backward takes the head by slices of `r` rows (16 MiB in the compute dtype) instead: beside
//! the logits, one slice's weights `e·r·d` and the chunk's f32 input gradient `4·c·d`, and
//! no whole copy or gradient of the head's weight.
//!
//! Gradients held once `n` parameters have theirs, `G(n)`: after the backward pass `4n` (with
//! accumulation `4P` throughout: the sum); updating in backward with the exact optimizer
//! `4·min(n, max(largest layer, r·d, positions, head vectors))` (each layer updated as soon as
//! it is done, the head's weight and the embedding table by slices of rows after the rest),
//! with a compact layout `4·min(n, largest part)`; with offload, on a GPU, the parts on their
//! way to the host, `e·min(n, head + 2·block)`, and on the CPU none. Data parallelism adds one
//! 64 MiB f32 bucket being summed. Otherwise, without offload, a tied head's weight gradient
//! (`4·V·d`) waits through the backward pass for the embeddings' part, which it meets at the
//! end.
//!
//! # The peak
//!
//! Beyond the state, the largest of the step's phases:
//!
//! | phase | bytes |
//! |---|---|
//! | head (forward done; loss and its gradient in chunks) | `b·(A + 2x + 8s) + head chunk + G(0)` |
//! | backward of the last block | `b·(A − kept(L−1) + K + T + 8s) + G(head)` |
//! | backward of the first block | `b·(K + T + 8s) + G(P − embeddings)` |
//! | after the backward pass | `b·(x + 8s) + G(P)` |
//!
//! On a GPU the memory pool reserves more than it hands out (blocks freed in stream order that
//! a later request does not fit): 4 % of the phase's bytes, and with checkpointing and offload
//! together 0.55 GiB + 6 % more in the backward phases, which recompute blocks and stream parts
//! to the host, and 0.2 GiB more in the head's (the recordings' logs show 0.24–0.78 GiB
//! reserved beyond use otherwise, 0.36–3.2 GiB with both); the peak is the largest phase with
//! its reserve. These constants were fitted to the committed gpt-1.3b and gpt-2b recordings,
//! where two runs of one setting can differ by 3 % in their peaks; everything else follows
//! from the engine's code.
//!
//! # Host memory
//!
//! On the CPU the device is the host: all of the above, plus what offload keeps beside it. On a
//! GPU the host holds what offload moves there, the largest of a checkpoint's staged tensor
//! (`4 ×` the largest parameter tensor) and one step's token ids (`8·s·b·accumulation`):
//!
//! - streamed offload ([`crate::spec::state::offload_streams`]): f32 masters and moments `12P`,
//!   and host buffers of the largest part, five on a GPU (three downloads, two uploads; the
//!   GPU's are page-locked), three on the CPU;
//! - summed offload (accumulation, fp16, clipping or several GPUs): `16P` (masters, moments,
//!   gradient sums) plus `2P` of staged half-precision copies, and one tensor copied down;
//! - data parallelism: every rank of the host keeps its own.
//!
//! # Accuracy
//!
//! See [`compare`] and the README: against every fitted trial of the recordings made with the
//! current engine, and against CPU probes of small specs.

mod compare;
mod device;
mod host;

pub use compare::{compare, compare_host, RecordedError};

use serde::{Deserialize, Serialize};

use crate::knobs::{Knobs, MAX_MICRO_BATCH};
use crate::spec::budget::Budget;
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;

/// Whether attention keeps its probabilities for the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// Flash attention: one log-sum-exp per row and head, the probabilities recomputed.
    Flash,
    /// The probabilities (`H·s²` per sequence) kept.
    Materialized,
}

/// Where in a step the device memory peaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The forward pass is done and the head computes the loss and its gradient in chunks.
    Head,
    /// The backward pass of the last block: every kept activation still held.
    BackwardStart,
    /// The backward pass of the first block: most gradients held.
    BackwardEnd,
    /// After the backward pass, before the update: every gradient held.
    AfterBackward,
}

/// Bytes by what they hold, in one memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Weights: f32 masters, or half-precision working copies.
    pub parameters: u64,
    /// Gradients held at the peak (or gradient sums in host memory).
    pub gradients: u64,
    /// Adam's first and second moments.
    pub optimizer_state: u64,
    /// Activations and what the passes hold besides the weights at the peak.
    pub activations: u64,
    /// Casts, the head's copy and chunk, transfer buffers, a checkpoint's staged tensor.
    pub workspace: u64,
    /// What the GPU memory pool reserves beyond what it hands out.
    pub allocator: u64,
    /// The CUDA context and libraries, or the process's own runtime.
    pub runtime: u64,
}

impl Breakdown {
    /// The components in a fixed order, named for people.
    pub fn parts(&self) -> [(&'static str, u64); 7] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations", self.activations),
            ("workspace", self.workspace),
            ("allocator", self.allocator),
            ("runtime", self.runtime),
        ]
    }

    /// All of it.
    pub fn total(&self) -> u64 {
        self.parts()
            .into_iter()
            .fold(0u64, |sum, (_, bytes)| sum.saturating_add(bytes))
    }

    fn plus(self, other: Breakdown) -> Breakdown {
        Breakdown {
            parameters: self.parameters.saturating_add(other.parameters),
            gradients: self.gradients.saturating_add(other.gradients),
            optimizer_state: self.optimizer_state.saturating_add(other.optimizer_state),
            activations: self.activations.saturating_add(other.activations),
            workspace: self.workspace.saturating_add(other.workspace),
            allocator: self.allocator.saturating_add(other.allocator),
            runtime: self.runtime.saturating_add(other.runtime),
        }
    }
}

/// The estimated peaks of one setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// GPU memory per GPU (`None` when training runs on the CPU).
    pub gpu: Option<Breakdown>,
    /// Host memory (all ranks of the host together).
    pub host: Breakdown,
    /// The phase of the step where the training device's memory peaks.
    pub peak_phase: Phase,
}

impl Estimate {
    /// The training device's total: the GPU's, or the host's on a CPU.
    pub fn device_total(&self) -> u64 {
        self.gpu.map_or(self.host.total(), |g| g.total())
    }

    /// Whether both peaks stay within `budget`'s usable bytes (its headroom kept free).
    pub fn fits(&self, budget: &Budget) -> bool {
        let gpu = match (self.gpu, budget.usable_gpu_bytes()) {
            (Some(g), Some(usable)) => g.total() <= usable,
            _ => true,
        };
        gpu && self.host.total() <= budget.usable_host_bytes()
    }
}

/// The estimated peak memory of training `model` at `knobs` on a device of `kind`, with
/// attention as `attention` says. `model` and `knobs` should be valid (see
/// [`ModelSpec::validate`] and [`Knobs::validate`]); byte counts saturate rather than wrap.
pub fn estimate(
    model: &ModelSpec,
    knobs: &Knobs,
    kind: DeviceKind,
    attention: Attention,
) -> Estimate {
    let on_gpu = kind == DeviceKind::Cuda;
    let (device, peak_phase) = device::peak(model, knobs, on_gpu, attention);
    let beside = host::beside_device(model, knobs, on_gpu);
    if on_gpu {
        Estimate {
            gpu: Some(device),
            host: beside,
            peak_phase,
        }
    } else {
        Estimate {
            gpu: None,
            host: device.plus(beside),
            peak_phase,
        }
    }
}

/// The largest micro-batch (at `knobs`' other settings) whose estimate fits `budget`, or `None`
/// when not even one sequence does. The estimate grows with the micro-batch, so a bisection
/// finds it.
pub fn largest_micro_batch(
    model: &ModelSpec,
    knobs: &Knobs,
    kind: DeviceKind,
    attention: Attention,
    budget: &Budget,
) -> Option<usize> {
    let fits = |b: usize| {
        let at = Knobs {
            micro_batch: b,
            ..*knobs
        };
        estimate(model, &at, kind, attention).fits(budget)
    };
    largest_within(MAX_MICRO_BATCH, fits)
}

/// The longest single sequence (one a micro-batch, no accumulation, at `knobs`' other
/// settings) whose estimate, multiplied by `scale`, fits `budget`, up to `longest_allowed`
/// tokens; `None` when not even one token's does. `scale` calibrates the estimate to a
/// measurement (a plan's measured peak over its estimate).
pub fn longest_sequence(
    model: &ModelSpec,
    knobs: &Knobs,
    kind: DeviceKind,
    attention: Attention,
    budget: &Budget,
    scale: f64,
    longest_allowed: usize,
) -> Option<usize> {
    let one = Knobs {
        micro_batch: 1,
        grad_accum: 1,
        ..*knobs
    };
    let fits = |tokens: usize| {
        let at = ModelSpec {
            seq_len: tokens,
            ..model.clone()
        };
        let total = estimate(&at, &one, kind, attention);
        let scaled = |bytes: u64| (bytes as f64 * scale) as u64;
        let gpu = match (total.gpu, budget.usable_gpu_bytes()) {
            (Some(g), Some(usable)) => scaled(g.total()) <= usable,
            _ => true,
        };
        gpu && scaled(total.host.total()) <= budget.usable_host_bytes()
    };
    largest_within(longest_allowed, fits)
}

/// The largest `n` from 1 to `most` for which `fits(n)`, or `None` when not even 1 does, for a
/// `fits` that holds up to a point and not past it (an estimate grows with what `n` counts):
/// a bisection finds it.
fn largest_within(most: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if !fits(1) {
        return None;
    }
    let (mut low, mut high) = (1usize, most.max(1));
    if fits(high) {
        return Some(high);
    }
    // `low` fits and `high` does not.
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        if fits(mid) {
            low = mid;
        } else {
            high = mid;
        }
    }
    Some(low)
}

#[cfg(test)]
mod tests;
