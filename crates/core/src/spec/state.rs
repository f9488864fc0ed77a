//! The bytes of training state a setting keeps through a step, on the device and on the host,
//! by component: what every micro-batch pays before its activations.
//!
//! Per parameter (`P` in all):
//!
//! | component | on the device | on the host |
//! |---|---|---|
//! | weights | 4 (the f32 masters are the model) or, with offload, 2 (bf16/f16 working copies of the matrices; 4 in fp32 and for vectors) | with offload, 4 (f32 masters), and 2 more for the half-precision copies staged for upload |
//! | Adam moments | 8, or none with offload | with offload, 8 |
//! | gradients | 4 (f32, all of them until the update) or, updating in backward, 4 × the most parameters whose gradients wait at once ([`exact_in_backward_gradients`]) | with offload, 4 (f32 sums) |
//!
//! So the normal step holds 16 bytes per parameter on the device, the update in backward
//! 12 plus one layer's gradients, and offload in bf16 2 on the device and, on the host, 12 when
//! the step streams ([`offload_streams`]: the gradients and new weights of a few parts in
//! flight are not state) or 18 when it sums (f32 gradient sums and staged copies). Transients are
//! not state: the half-precision copy of one block's weights while it runs, and with offload
//! one tensor's gradient on its way to the host.
//!
//! A compact [`StateLayout`] (opt-in, not exact AdamW) changes the matrices' bytes; vectors
//! keep 4 + 8 (f32 weights and moments):
//!
//! | component | f32 | compact |
//! |---|---|---|
//! | weights (masters) | 4 | 2 (bf16, stochastic rounding) or 4 (bf16 + bf16 Kahan compensation) |
//! | moments | 8 | 4 (bf16) or 2 + 8 per [`INT8_BLOCK`] elements of each tensor (8-bit codes and two f32 scales per block) |
//! | gradients | 4 | 2 in backward (bf16, as the working copies produce them), 4 after backward (f32 sums) |
//!
//! With the moments in host memory ([`MomentPlace::Host`]) the device holds the largest part's
//! moments while it updates, and the host all of them (page-locked). So llama-3.1-8b's
//! 8-bit moments with bf16 stochastic masters come to about 2 bytes per parameter on the device
//! plus one part's gradients and moments, and 2 on the host.

use crate::knobs::{
    Knobs, MasterFormat, MomentFormat, MomentPlace, Offload, Precision, StateLayout, Update,
    UpdateStrategy, INT8_BLOCK,
};
use crate::spec::model::ModelSpec;

/// Whether an offloaded step with `knobs` streams each part of the model through the host as
/// the backward pass settles it ([`UpdateStrategy::OffloadedStreamed`]).
pub fn offload_streams(model: &ModelSpec, knobs: &Knobs) -> bool {
    UpdateStrategy::of(knobs, model.optimizer.grad_clip.is_some())
        == Ok(UpdateStrategy::OffloadedStreamed)
}

/// State bytes by component in one place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Components {
    /// Model weights (f32 masters, or half-precision working copies).
    pub weights: u64,
    /// Adam's first and second moments.
    pub moments: u64,
    /// Gradients held at once.
    pub gradients: u64,
}

impl Components {
    /// All components together.
    pub fn total(&self) -> u64 {
        self.weights + self.moments + self.gradients
    }
}

/// Where a setting's state lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// On the training device (host memory when training on the CPU).
    pub device: Components,
    /// In host memory beside a device (offload).
    pub host: Components,
}

impl StateBytes {
    /// The state `knobs` keep for `model` on one GPU (data-parallel sharding is not counted:
    /// its share depends on how the tensors split).
    pub fn of(model: &ModelSpec, knobs: &Knobs) -> Self {
        if !knobs.state.is_exact() {
            return Self::compact(model, knobs);
        }
        let p = model.parameter_count() as u64;
        let vectors = model.vector_parameter_count() as u64;
        let gradients = match knobs.update {
            Update::AfterBackward => 4 * p,
            Update::InBackward => exact_in_backward_gradients(model, knobs.precision),
        };
        match knobs.offload {
            Offload::None => Self {
                device: Components {
                    weights: 4 * p,
                    moments: 8 * p,
                    gradients,
                },
                host: Components::default(),
            },
            Offload::Optimizer => Self {
                device: Components {
                    weights: match knobs.precision {
                        Precision::Fp32 => 4 * p,
                        Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => {
                            2 * (p - vectors) + 4 * vectors
                        }
                    },
                    moments: 0,
                    gradients: 0,
                },
                host: if offload_streams(model, knobs) {
                    Components {
                        weights: 4 * p,
                        moments: 8 * p,
                        gradients: 0,
                    }
                } else {
                    Components {
                        weights: match knobs.precision {
                            Precision::Fp32 => 4 * p,
                            Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => 6 * p,
                        },
                        moments: 8 * p,
                        gradients: 4 * p,
                    }
                },
            },
        }
    }
}

impl StateBytes {
    /// [`StateBytes::of`] for a layout other than exact AdamW on the device (validated knobs:
    /// optimizer on one device).
    fn compact(model: &ModelSpec, knobs: &Knobs) -> Self {
        let layout = knobs.state;
        let p = model.parameter_count() as u64;
        let vectors = model.vector_parameter_count() as u64;
        let matrices = p - vectors;
        let groups = model.parameter_groups();
        let matrix_weights = |n: u64| match layout.masters {
            MasterFormat::F32 => 4 * n,
            MasterFormat::Bf16Kahan => 4 * n,
            MasterFormat::Bf16Stochastic => 2 * n,
        };
        let grad_bytes = match (knobs.update, layout.masters) {
            (Update::InBackward, m) if m.is_half() => 2,
            _ => 4,
        };
        let tied = if model.tied_embeddings {
            grad_bytes * (model.vocab_size * model.d_model) as u64
        } else {
            0
        };
        let gradients = match knobs.update {
            Update::AfterBackward => 4 * p,
            Update::InBackward if grad_bytes == 2 => largest_half_part(model) + tied,
            Update::InBackward => 4 * groups.largest() as u64 + tied,
        };
        let moments = moment_bytes(layout, matrices) + 8 * vectors;
        let weights = matrix_weights(matrices) + 4 * vectors;
        match layout.moments_on {
            MomentPlace::Device => Self {
                device: Components {
                    weights,
                    moments,
                    gradients,
                },
                host: Components::default(),
            },
            MomentPlace::Host => Self {
                device: Components {
                    weights,
                    // The part being updated, and the vectors' (kept on the device).
                    moments: moment_bytes(layout, groups.largest() as u64) + 8 * vectors,
                    gradients,
                },
                host: Components {
                    weights: 0,
                    moments: moment_bytes(layout, matrices),
                    gradients: 0,
                },
            },
        }
    }
}

/// The most bytes one half-precision slice of a vocabulary head's weight takes when its
/// gradient goes by rows (the engine's `head_rows`).
pub const HEAD_SLICE_BYTES: usize = 16 << 20;

/// The rows per slice of a head weight `width` wide in elements of `element_bytes`: as many as
/// fit [`HEAD_SLICE_BYTES`], a multiple of `row_multiple` (at least one multiple).
pub fn head_slice_rows(width: usize, element_bytes: usize, row_multiple: usize) -> usize {
    let m = row_multiple.max(1);
    (HEAD_SLICE_BYTES / (width.max(1) * element_bytes.max(1)) / m * m).max(m)
}

/// The f32 gradient bytes the exact update in backward holds at once. Each layer of a block is
/// updated as soon as its backward pass is done. The head's weight and the embedding table
/// get their gradients by slices of rows after the rest of the backward pass (a tied matrix's
/// once, with both parts), so the head part holds its vectors' (final norm, bias) and the
/// embeddings the positions'.
pub fn exact_in_backward_gradients(model: &ModelSpec, precision: Precision) -> u64 {
    let g = model.parameter_groups();
    let (vocab, d) = (model.vocab_size, model.d_model);
    let element = match precision {
        Precision::Fp32 => 4,
        Precision::Bf16 | Precision::Fp16 | Precision::Fp8 => 2,
    };
    // The GPU's row multiple (the CPU's is 1: the same slices wherever the width is a power
    // of two).
    let slice = head_slice_rows(d, element, 64).min(vocab) * d;
    4 * g.layer.max(g.head_vectors).max(g.positions).max(slice) as u64
}

/// The gradient bytes of the model's largest part when matrices' gradients are bf16 and
/// vectors' f32.
fn largest_half_part(model: &ModelSpec) -> u64 {
    let Some(c) = crate::spec::model::counts::Counts::of(model) else {
        return u64::MAX;
    };
    let bytes = |all: u64, vectors: u64| 2 * (all - vectors) + 4 * vectors;
    bytes(c.embeddings, 0)
        .max(bytes(c.block, c.block_vectors))
        .max(bytes(c.head, c.head_vectors))
}

/// The moments' bytes of `n` matrix parameters in `layout`: with 8-bit codes, two f32 scales
/// per block counted as if the `n` elements were one tensor (a tensor's last, partial block
/// adds at most 8 bytes more).
pub fn moment_bytes(layout: StateLayout, n: u64) -> u64 {
    match layout.moments {
        MomentFormat::F32 => 8 * n,
        MomentFormat::Bf16 => 4 * n,
        MomentFormat::Int8Blockwise => 2 * n + 8 * n.div_ceil(INT8_BLOCK as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::Checkpointing;

    #[test]
    fn bytes_per_parameter_follow_the_layout() {
        let model = ModelSpec::preset("gpt-1.3b").unwrap();
        let p = model.parameter_count() as u64;
        let knobs = |update, offload| Knobs {
            update,
            offload,
            checkpointing: Checkpointing::EveryKth(1),
            ..Knobs::new(4, Precision::Bf16)
        };
        let normal = StateBytes::of(&model, &knobs(Update::AfterBackward, Offload::None));
        assert_eq!(normal.device.total(), 16 * p);
        assert_eq!(normal.host.total(), 0);
        let fused = StateBytes::of(&model, &knobs(Update::InBackward, Offload::None));
        // gpt-1.3b's largest layer is a feed-forward matrix (2048 × 8192) with its bias; its
        // head's slices of 4096 rows (16 MiB in bf16) are smaller.
        let layer = (2048 * 8192 + 8192) as u64;
        assert_eq!(model.parameter_groups().layer as u64, layer);
        assert_eq!(fused.device.total(), 12 * p + 4 * layer);
        assert!(fused.device.total() < 12 * p + p / 20);
        let offload = StateBytes::of(&model, &knobs(Update::AfterBackward, Offload::Optimizer));
        let vectors = model.vector_parameter_count() as u64;
        assert_eq!(offload.device.total(), 2 * p + 2 * vectors);
        assert!(vectors < p / 1000, "vectors are a negligible share");
        assert_eq!(offload.host.total(), 12 * p, "a streamed step");
        let summed = StateBytes::of(
            &model,
            &Knobs {
                grad_accum: 2,
                ..knobs(Update::AfterBackward, Offload::Optimizer)
            },
        );
        assert_eq!(summed.host.total(), 18 * p, "a summed step");
    }

    #[test]
    fn the_groups_add_up_to_the_parameter_count() {
        for name in crate::spec::model::PRESETS {
            let model = ModelSpec::preset(name).unwrap();
            let g = model.parameter_groups();
            assert_eq!(
                g.embeddings + model.n_layers * g.block + g.head,
                model.parameter_count(),
                "{name}"
            );
        }
    }
}
