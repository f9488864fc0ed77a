//! Upper bounds on every size a spec, a plan, a recording or a flag may give, and the least
//! memory a model takes whatever the setting.
//!
//! The bounds keep every product the tool forms (parameters, bytes, tokens per step) inside
//! 64 bits, and refuse sizes no machine could allocate or a kernel index, as input errors that
//! name the field. They sit far above anything trainable: a dimension of 16 Mi, 65 536 layers,
//! a single tensor of 1 TiB, 2^48 parameters, a micro-batch of 1 Mi sequences.
//!
//! The footprint ([`state_bytes`], [`logits_bytes`]) is a floor, not a model: a setting whose
//! floor exceeds the memory it may use cannot fit, so the answer ("no feasible plan", an
//! out-of-memory trial) is given without allocating it.

pub use crate::knobs::{MAX_DATA_PARALLEL, MAX_GRAD_ACCUM, MAX_MICRO_BATCH};
pub use crate::trial::{MAX_STEP_TIME_S, MAX_TRIAL_STEPS};

use crate::knobs::{Knobs, Precision};
use crate::spec::budget::{format_bytes, Budget};
use crate::spec::model::ModelSpec;
use crate::{Error, Result};

/// The largest vocabulary, width, feed-forward width or sequence length.
pub const MAX_DIMENSION: usize = 1 << 24;
/// The most Transformer blocks.
pub const MAX_LAYERS: usize = 1 << 16;
/// The largest single tensor, in f32 bytes: 1 TiB, more than any one device or host holds.
pub const MAX_TENSOR_BYTES: u64 = 1 << 40;
/// The most parameters a model may have (its training state is then 4 PiB).
pub const MAX_PARAMETERS: u64 = 1 << 48;
/// The largest global batch a search may fix, in sequences: the most micro-batches a step may
/// accumulate, since the search may settle on a micro-batch of one sequence on one GPU, and
/// a plan must run whichever micro-batch it chooses.
pub const MAX_GLOBAL_BATCH: usize = MAX_GRAD_ACCUM;
/// The most tokens one optimizer step may take over all ranks.
pub const MAX_TOKENS_PER_STEP: u64 = 1 << 40;

/// Bytes of training state per parameter, wherever it lives: the f32 master weight, its f32
/// gradient and Adam's two f32 moments.
pub const STATE_BYTES_PER_PARAMETER: u64 = 16;

/// The parameters `spec` builds, counted in 64 bits; `None` past [`u64::MAX`].
pub fn parameter_count(spec: &ModelSpec) -> Option<u64> {
    crate::spec::model::parameter_counts(spec)?.total(spec.n_layers)
}

/// The training state of `spec` (see [`STATE_BYTES_PER_PARAMETER`]); saturates at
/// [`u64::MAX`] for specs that [`ModelSpec::validate`] refuses.
pub fn state_bytes(spec: &ModelSpec) -> u64 {
    parameter_count(spec).map_or(u64::MAX, |p| p.saturating_mul(STATE_BYTES_PER_PARAMETER))
}

/// Bytes of one micro-batch's logits (every token scores every vocabulary entry) in the
/// precision's compute type: the largest activation of most models, and always allocated.
pub fn logits_bytes(spec: &ModelSpec, micro_batch: usize, precision: Precision) -> u64 {
    let element = match precision {
        Precision::Fp32 => 4,
        Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => 2,
    };
    (micro_batch as u64)
        .saturating_mul(spec.seq_len as u64)
        .saturating_mul(spec.vocab_size as u64)
        .saturating_mul(element)
}

/// The largest micro-batch whose logits in `precision` fit in `bytes` (at least 1).
pub fn largest_micro_batch_within(spec: &ModelSpec, precision: Precision, bytes: u64) -> usize {
    let per_sequence = logits_bytes(spec, 1, precision).max(1);
    usize::try_from(bytes / per_sequence)
        .unwrap_or(usize::MAX)
        .clamp(1, MAX_MICRO_BATCH)
}

/// Why no setting of `spec` fits `budget`, when its training state alone is larger than the
/// device and host bytes the budget allows together under every one of `regimes` (the least
/// state among them; the exact layout's 16 bytes per parameter when none is given): every
/// regime keeps its state somewhere (offload only moves it to the host), so the answer needs
/// no trial.
pub fn state_exceeds_budget(
    spec: &ModelSpec,
    budget: &Budget,
    regimes: &[crate::knobs::Regime],
) -> Option<String> {
    let least = regimes
        .iter()
        .map(|r| {
            let s = crate::spec::state::StateBytes::of(spec, &Knobs::with_batch(*r, 1, 1));
            (s.device.total().saturating_add(s.host.total()), *r)
        })
        .min_by_key(|(bytes, _)| *bytes);
    let state = least.map_or_else(|| state_bytes(spec), |(bytes, _)| bytes);
    let gpu = budget.usable_gpu_bytes().unwrap_or(0);
    let host = budget.usable_host_bytes();
    let usable = gpu.saturating_add(host);
    if state <= usable {
        return None;
    }
    let memories = match budget.gpu_bytes {
        Some(_) => format!(
            "{} of GPU and {} of host memory",
            format_bytes(gpu),
            format_bytes(host)
        ),
        None => format!("{} of host memory", format_bytes(host)),
    };
    let what = match least {
        Some((_, r)) if !r.state.is_exact() => format!("with the {} state layout", r.state),
        _ => format!(
            "{} parameters × {STATE_BYTES_PER_PARAMETER} bytes: f32 weights, gradients and two Adam moments",
            spec.parameter_count()
        ),
    };
    Some(format!(
        "the training state of `{}` alone is {} ({what}), more than the {memories} the budget \
         allows after its {:.0}% headroom; train a smaller model or target a device with more \
         memory",
        spec.name,
        format_bytes(state),
        budget.headroom * 100.0
    ))
}

/// The least memory training `spec` at `knobs` takes in one place that holds everything (a
/// CPU's host memory): the training state and one micro-batch's logits.
pub fn setting_floor_bytes(spec: &ModelSpec, knobs: &Knobs) -> u64 {
    state_bytes(spec).saturating_add(logits_bytes(spec, knobs.micro_batch, knobs.precision))
}

/// Why training `spec` at `knobs` cannot fit in `available` bytes of `memory` (e.g. "host
/// memory"), if its floor ([`setting_floor_bytes`]) alone exceeds them.
pub fn setting_exceeds(
    spec: &ModelSpec,
    knobs: &Knobs,
    available: u64,
    memory: &str,
) -> Option<String> {
    let floor = setting_floor_bytes(spec, knobs);
    (floor > available).then(|| {
        format!(
            "training `{}` at {knobs} takes at least {} (its training state {} and one micro-batch's logits {}), more than the {} of {memory}; use a smaller micro-batch or model",
            spec.name,
            format_bytes(floor),
            format_bytes(state_bytes(spec)),
            format_bytes(logits_bytes(spec, knobs.micro_batch, knobs.precision)),
            format_bytes(available),
        )
    })
}

/// Checks `knobs` against the model they train: one micro-batch's logits must be a tensor
/// that can be allocated, and a step's tokens must be countable. `field_prefix` names where
/// the knobs came from, as in [`Knobs::validate`].
pub fn check_knobs(
    spec: &ModelSpec,
    knobs: &Knobs,
    what: &'static str,
    field_prefix: &str,
) -> Result<()> {
    let logits = logits_bytes(spec, knobs.micro_batch, Precision::Fp32);
    if logits > MAX_TENSOR_BYTES {
        return Err(Error::invalid(
            what,
            format!("{field_prefix}micro_batch"),
            format!(
                "({}) makes one micro-batch's logits {} (f32) for `{}`, over the {} a single tensor may take; use a smaller micro-batch and accumulate",
                knobs.micro_batch,
                format_bytes(logits),
                spec.name,
                format_bytes(MAX_TENSOR_BYTES)
            ),
        ));
    }
    let tokens = (knobs.global_batch() as u64).saturating_mul(spec.seq_len as u64);
    if tokens > MAX_TOKENS_PER_STEP {
        return Err(Error::invalid(
            what,
            format!("{field_prefix}grad_accum"),
            format!(
                "({}) makes {tokens} tokens per optimizer step, over the {MAX_TOKENS_PER_STEP} a step may take; accumulate fewer micro-batches",
                knobs.grad_accum
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::model::PRESETS;

    #[test]
    fn the_counts_agree_with_the_specs_own_and_saturate_instead_of_wrapping() {
        for name in PRESETS {
            let spec = ModelSpec::preset(name).unwrap();
            assert_eq!(parameter_count(&spec), Some(spec.parameter_count() as u64));
        }
        let huge = ModelSpec {
            d_model: 1 << 40,
            n_layers: 1 << 30,
            ..ModelSpec::tiny()
        };
        assert_eq!(parameter_count(&huge), None);
        assert_eq!(state_bytes(&huge), u64::MAX);
        assert_eq!(logits_bytes(&huge, usize::MAX, Precision::Fp32), u64::MAX);
    }

    #[test]
    fn the_largest_micro_batch_within_a_budget_keeps_its_logits_inside() {
        let tiny = ModelSpec::tiny();
        let per_sequence = logits_bytes(&tiny, 1, Precision::Fp32);
        assert_eq!(per_sequence, 64 * 256 * 4);
        assert_eq!(
            largest_micro_batch_within(&tiny, Precision::Fp32, 10 * per_sequence + 1),
            10
        );
        assert_eq!(largest_micro_batch_within(&tiny, Precision::Fp32, 0), 1);
        assert_eq!(
            largest_micro_batch_within(&tiny, Precision::Fp32, u64::MAX),
            MAX_MICRO_BATCH
        );
    }
}
