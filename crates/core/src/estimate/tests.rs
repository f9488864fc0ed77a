use super::*;
use crate::knobs::{Checkpointing, DataParallel, Offload, Precision, Update};

fn knobs(micro_batch: usize, precision: Precision) -> Knobs {
    Knobs::new(micro_batch, precision)
}

fn gpu(model: &ModelSpec, knobs: &Knobs) -> Breakdown {
    estimate(model, knobs, DeviceKind::Cuda, Attention::Flash)
        .gpu
        .expect("a GPU estimate")
}

#[test]
fn on_the_cpu_the_state_and_the_activations_follow_the_formula() {
    // fp32 on the CPU: no padding, no casts, no pool; the state is exact. A small vocabulary
    // keeps the head's logits below a block's backward pass.
    let model = ModelSpec {
        vocab_size: 32,
        ..ModelSpec::tiny()
    };
    let p = model.parameter_count() as u64;
    let at = |b| {
        estimate(
            &model,
            &knobs(b, Precision::Fp32),
            DeviceKind::Cpu,
            Attention::Flash,
        )
    };
    let one = at(1);
    assert!(one.gpu.is_none());
    assert_eq!(one.host.parameters, 4 * p);
    assert_eq!(one.host.optimizer_state, 8 * p);
    assert_eq!(one.host.allocator, 0);
    assert_eq!(one.host.runtime, 2 << 20);
    // Without accumulation the step never holds every gradient beside the activations: at a
    // large batch the peak is the start of the backward pass, with the head's gradients only.
    let big = at(64);
    assert_eq!(big.peak_phase, Phase::BackwardStart);
    let groups = model.parameter_groups();
    assert_eq!(big.host.gradients, 4 * groups.head as u64);
    // Its activations: every block's kept tensors, the last block's backward transients and
    // the token ids, per sequence (pre-norm: 8d + f rows, one f32 log-sum-exp per head).
    let (s, d, f, h) = (64u64, 64u64, 256u64, 4u64);
    let kept = s * (8 * d + f) * 4 + 4 * s * h;
    let transient = 2 * s * f * 4 + s * d * 4;
    let per_sequence = 2 * kept + transient + 8 * s;
    assert_eq!(big.host.activations, 64 * per_sequence);
}

#[test]
fn every_saving_knob_lowers_the_part_it_should() {
    let model = ModelSpec::preset("gpt-1.3b").unwrap();
    let plain = knobs(8, Precision::Bf16);
    let base = gpu(&model, &plain);
    let checkpointed = gpu(
        &model,
        &Knobs {
            checkpointing: Checkpointing::EveryKth(1),
            ..plain
        },
    );
    assert!(checkpointed.activations < base.activations / 3);
    assert_eq!(checkpointed.optimizer_state, base.optimizer_state);

    // Updating in backward saves the gradients where they set the peak (one sequence: after
    // the backward pass, every gradient held); at eight sequences, where the head's backward
    // sets the peak, it saves the head's whole f32 gradient and half-precision weight copy,
    // since it takes the head by slices of rows.
    let in_backward = |b| Knobs {
        update: Update::InBackward,
        ..knobs(b, Precision::Bf16)
    };
    let one = gpu(&model, &knobs(1, Precision::Bf16));
    let fused = gpu(&model, &in_backward(1));
    assert!(fused.gradients <= 4 * model.parameter_groups().layer as u64);
    let p = model.parameter_count() as u64;
    assert!(fused.total() + 2 * p < one.total(), "{fused:?} vs {one:?}");
    let head = (model.vocab_size * model.d_model) as u64;
    assert!(gpu(&model, &in_backward(8)).total() + 6 * head <= base.total());

    let offload = Knobs {
        offload: Offload::Optimizer,
        ..plain
    };
    let est = estimate(&model, &offload, DeviceKind::Cuda, Attention::Flash);
    let on_gpu = est.gpu.unwrap();
    assert_eq!(on_gpu.optimizer_state, 0);
    assert!(
        on_gpu.parameters < base.parameters * 51 / 100,
        "half-precision working copies"
    );
    assert_eq!(
        est.host.optimizer_state,
        8 * p,
        "the moments move to the host"
    );
    assert_eq!(est.host.parameters, 4 * p, "and the f32 masters");
    let plain_host = estimate(&model, &plain, DeviceKind::Cuda, Attention::Flash).host;
    assert!(plain_host.total() < est.host.total() / 10);

    let sharded = gpu(
        &model,
        &Knobs {
            data_parallel: DataParallel {
                degree: 4,
                shard_optimizer: true,
            },
            ..plain
        },
    );
    assert_eq!(sharded.optimizer_state, base.optimizer_state / 4);
}

#[test]
fn precision_and_attention_change_the_activations() {
    let model = ModelSpec::preset("gpt-124m").unwrap();
    let bf16 = gpu(&model, &knobs(16, Precision::Bf16));
    let fp32 = gpu(&model, &knobs(16, Precision::Fp32));
    assert!(fp32.activations > bf16.activations * 19 / 10);
    let materialized = estimate(
        &model,
        &knobs(16, Precision::Bf16),
        DeviceKind::Cuda,
        Attention::Materialized,
    )
    .gpu
    .unwrap();
    // The probabilities: heads × seq² values per block and sequence.
    let probabilities = 12 * 12 * 1024 * 1024 * 2 * 16;
    assert!(materialized.activations > bf16.activations + probabilities);
}

#[test]
fn the_estimate_grows_with_the_micro_batch_and_the_largest_fitting_one_is_the_boundary() {
    let model = ModelSpec::preset("gpt-124m").unwrap();
    let regime = Knobs {
        checkpointing: Checkpointing::EveryKth(2),
        ..knobs(1, Precision::Bf16)
    };
    let mut last = 0;
    for b in [1, 2, 3, 5, 8, 13, 21, 34, 55] {
        let total = gpu(
            &model,
            &Knobs {
                micro_batch: b,
                ..regime
            },
        )
        .total();
        assert!(total >= last, "micro-batch {b}");
        last = total;
    }
    let budget = Budget {
        gpu_bytes: Some(24 << 30),
        host_bytes: 32 << 30,
        headroom: 0.05,
    };
    let best = largest_micro_batch(&model, &regime, DeviceKind::Cuda, Attention::Flash, &budget)
        .expect("gpt-124m fits a 24 GiB card");
    let at = |b| {
        estimate(
            &model,
            &Knobs {
                micro_batch: b,
                ..regime
            },
            DeviceKind::Cuda,
            Attention::Flash,
        )
    };
    assert!(at(best).fits(&budget));
    assert!(!at(best + 1).fits(&budget));
    let big = ModelSpec::preset("gpt-2b").unwrap();
    assert_eq!(
        largest_micro_batch(&big, &regime, DeviceKind::Cuda, Attention::Flash, &budget),
        None,
        "gpt-2b's 16 bytes a parameter alone exceed 24 GiB"
    );
}

#[test]
fn accumulation_holds_every_gradient_through_the_step() {
    let model = ModelSpec::preset("gpt-124m").unwrap();
    let one = gpu(&model, &knobs(8, Precision::Bf16));
    let four = gpu(
        &model,
        &Knobs {
            grad_accum: 4,
            ..knobs(8, Precision::Bf16)
        },
    );
    assert_eq!(four.gradients, 4 * model.parameter_count() as u64);
    assert!(four.total() > one.total());
}

#[test]
fn the_longest_sequence_is_the_boundary_of_the_scaled_estimate() {
    let model = ModelSpec::preset("llama-3.2-1b").unwrap();
    let regime = Knobs {
        checkpointing: Checkpointing::EveryKth(1),
        ..knobs(8, Precision::Bf16)
    };
    let budget = Budget {
        gpu_bytes: Some(24 << 30),
        host_bytes: 32 << 30,
        headroom: 0.05,
    };
    let usable = budget.usable_gpu_bytes().unwrap();
    let longest_at = |scale: f64| {
        longest_sequence(
            &model,
            &regime,
            DeviceKind::Cuda,
            Attention::Flash,
            &budget,
            scale,
            1 << 22,
        )
        .expect("one token fits")
    };
    let at = |tokens: usize, scale: f64| {
        let spec = ModelSpec {
            seq_len: tokens,
            ..model.clone()
        };
        let one = Knobs {
            micro_batch: 1,
            ..regime
        };
        let total = gpu(&spec, &one).total();
        (total as f64 * scale) as u64
    };
    let longest = longest_at(1.0);
    assert!(at(longest, 1.0) <= usable && at(longest + 1, 1.0) > usable);
    // Longer than the plan's own 2048 tokens at micro-batch 8: one sequence holds more.
    assert!(longest > 8 * 2048, "{longest}");
    // A measured peak above the estimate shortens it.
    let calibrated = longest_at(1.05);
    assert!(calibrated < longest && at(calibrated, 1.05) <= usable);
    assert_eq!(
        longest_sequence(
            &model,
            &regime,
            DeviceKind::Cuda,
            Attention::Flash,
            &budget,
            1.0,
            4096
        ),
        Some(4096),
        "capped where asked"
    );
    let tiny_card = Budget {
        gpu_bytes: Some(1 << 30),
        ..budget
    };
    assert_eq!(
        longest_sequence(
            &model,
            &regime,
            DeviceKind::Cuda,
            Attention::Flash,
            &tiny_card,
            1.0,
            1 << 22
        ),
        None,
        "the state alone exceeds 1 GiB"
    );
}

#[test]
fn compact_moments_in_host_memory_count_on_the_host() {
    use crate::knobs::{MasterFormat, MomentFormat, MomentPlace, StateLayout};
    let model = ModelSpec::preset("llama-3.1-8b").unwrap();
    let compact = |moments_on| Knobs {
        checkpointing: Checkpointing::EveryKth(1),
        update: Update::InBackward,
        state: StateLayout {
            moments: MomentFormat::Int8Blockwise,
            masters: MasterFormat::Bf16Stochastic,
            moments_on,
        },
        ..knobs(1, Precision::Bf16)
    };
    let host = |knobs: Knobs| estimate(&model, &knobs, DeviceKind::Cuda, Attention::Flash).host;
    let on_host = host(compact(MomentPlace::Host));
    // Two 8-bit moments a parameter of the matrices, and their block scales: about 16 GB for
    // 8B, as measured (15.96 GiB host peak on the H100).
    let p = model.parameter_count() as u64;
    assert!(on_host.optimizer_state > 2 * p * 95 / 100, "{on_host:?}");
    assert!(on_host.optimizer_state < 2 * p * 105 / 100, "{on_host:?}");
    assert_eq!(host(compact(MomentPlace::Device)).optimizer_state, 0);
    assert_eq!(host(knobs(1, Precision::Bf16)).optimizer_state, 0);
}
