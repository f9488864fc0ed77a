use std::cell::Cell;

use super::*;
use crate::knobs::Checkpointing;

const FLASH: [usize; 6] = [16, 32, 64, 80, 96, 128];

fn gpu() -> DeviceSpec {
    DeviceSpec::builtin("rtx4090-32g").unwrap()
}

/// Resolves for autotune's own engine; see [`resolve_for`].
fn resolve(
    model: &ModelSpec,
    target: &DeviceSpec,
    request: &SpaceRequest,
    flash_head_dims: &[usize],
) -> (SearchSetup, usize) {
    resolve_for(model, target, request, flash_head_dims, true)
}

/// Resolves with a floor of 0.25 s, and counts how often the floor was measured.
fn resolve_for(
    model: &ModelSpec,
    target: &DeviceSpec,
    request: &SpaceRequest,
    flash_head_dims: &[usize],
    own_engine: bool,
) -> (SearchSetup, usize) {
    let measured = Cell::new(0);
    let floor = |parameters: usize| {
        assert_eq!(parameters, model.parameter_count());
        measured.set(measured.get() + 1);
        Some(0.25)
    };
    let runtime = Runtime {
        flash_head_dims,
        host_adam_floor_s: &floor,
        own_engine,
    };
    let budget = Budget::from_device(target);
    let setup = SearchSetup::resolve(model, target, &budget, request, &runtime).unwrap();
    (setup, measured.get())
}

fn offload(offload: Vec<Offload>) -> SpaceRequest {
    SpaceRequest {
        offload,
        ..SpaceRequest::default()
    }
}

#[test]
fn the_host_floor_and_the_link_are_facts_only_where_an_offloaded_regime_is_searched() {
    let model = ModelSpec::tiny();
    let (with, measured) = resolve(&model, &gpu(), &SpaceRequest::default(), &FLASH);
    assert!(with
        .space
        .regimes
        .iter()
        .any(|r| r.offload == Offload::Optimizer));
    assert_eq!(measured, 1);
    assert_eq!(with.facts.offload_host_floor_s, Some(0.25));
    assert_eq!(with.facts.target_link_gbps, Some(25.0));

    let (without, measured) = resolve(&model, &gpu(), &offload(vec![Offload::None]), &FLASH);
    assert_eq!(measured, 0, "nothing offloads: the floor is not measured");
    assert_eq!(without.facts.offload_host_floor_s, None);
    assert_eq!(without.facts.target_link_gbps, None);
    assert_eq!(without.space.regimes, with.space.regimes[..4].to_vec());
}

#[test]
fn moments_in_host_memory_cross_the_link_without_a_host_floor() {
    let request = SpaceRequest {
        compact_state: true,
        ..offload(vec![Offload::None])
    };
    let (setup, measured) = resolve(&ModelSpec::tiny(), &gpu(), &request, &FLASH);
    assert!(setup
        .space
        .regimes
        .iter()
        .any(|r| r.state.moments_on == MomentPlace::Host));
    assert_eq!(measured, 0);
    assert_eq!(setup.facts.offload_host_floor_s, None);
    assert_eq!(setup.facts.target_link_gbps, Some(25.0));
}

#[test]
fn a_gpu_search_has_a_memory_prior_per_regime_and_a_cpu_search_none() {
    let model = ModelSpec::tiny();
    let (on_gpu, _) = resolve(&model, &gpu(), &SpaceRequest::default(), &FLASH);
    assert_eq!(on_gpu.facts.memory_prior.len(), on_gpu.space.regimes.len());
    on_gpu.facts.validate(on_gpu.space.regimes.len()).unwrap();
    for (law, &regime) in on_gpu.facts.memory_prior.iter().zip(&on_gpu.space.regimes) {
        assert_eq!(*law, device_memory(&model, regime, true, true), "{regime}");
    }
    // A head width the kernels do not cover keeps attention's probabilities: more per sequence.
    let (materialized, _) = resolve(&model, &gpu(), &SpaceRequest::default(), &[]);
    let per_sequence = |s: &SearchSetup| s.facts.memory_prior[0].per_sequence_bytes;
    assert!(per_sequence(&materialized) > per_sequence(&on_gpu));

    let cpu = DeviceSpec::builtin("cpu").unwrap();
    let (on_cpu, measured) = resolve(&model, &cpu, &SpaceRequest::default(), &FLASH);
    assert_eq!(on_cpu.facts, MachineFacts::default());
    assert_eq!(measured, 0);
}

#[test]
fn with_a_global_batch_the_facts_say_what_accumulation_adds_at_each_micro_batch() {
    let model = ModelSpec::preset("gpt-1.3b").unwrap();
    let request = SpaceRequest {
        global_batch: Some(32),
        offload: vec![Offload::None],
        ..SpaceRequest::default()
    };
    let (setup, _) = resolve(&model, &gpu(), &request, &FLASH);
    let extra = &setup.facts.accumulation_extra;
    assert_eq!(extra.len(), setup.space.regimes.len());
    setup.facts.validate(setup.space.regimes.len()).unwrap();
    for (i, regime) in setup.space.regimes.iter().enumerate() {
        // Every micro-batch but the global batch itself accumulates.
        let batches: Vec<usize> = extra[i].iter().map(|e| e.micro_batch).collect();
        assert_eq!(batches, [1, 2, 4, 8, 16], "{regime}");
        for e in &extra[i] {
            let plan = setup.space.plan_knobs(*regime, e.micro_batch);
            let peak = |k: &Knobs| {
                let at = estimate(&model, k, DeviceKind::Cuda, Attention::Flash);
                at.gpu.unwrap().total() as f64
            };
            let trial = Knobs {
                grad_accum: 1,
                ..plan
            };
            assert_eq!(
                e.bytes,
                peak(&plan) - peak(&trial),
                "{regime} mb {}",
                e.micro_batch
            );
        }
    }
    // Without checkpointing, mb 4 peaks at the head with no gradient held, where the plan holds
    // the f32 sum of all 1.4 billion: about 4 bytes a parameter more.
    let plain = setup
        .space
        .regimes
        .iter()
        .position(|r| r.checkpointing == Checkpointing::None)
        .unwrap();
    let per_parameter =
        setup.facts.accumulation_extra_bytes(plain, 4).unwrap() / model.parameter_count() as f64;
    assert!((3.5..4.5).contains(&per_parameter), "{per_parameter}");

    let (without, _) = resolve(&model, &gpu(), &offload(vec![Offload::None]), &FLASH);
    assert!(without.facts.accumulation_extra.is_empty());
    // A trial runner's framework holds its gradients its own way: the estimate says nothing.
    let (runner, _) = resolve_for(&model, &gpu(), &request, &FLASH, false);
    assert!(runner.facts.accumulation_extra.is_empty());
    assert_eq!(runner.facts.memory_prior, setup.facts.memory_prior);
}

#[test]
fn regimes_whose_state_cannot_fit_are_dropped_with_their_priors() {
    let model = ModelSpec::preset("gpt-2b").unwrap();
    let request = SpaceRequest {
        checkpointing: vec![Checkpointing::EveryKth(1)],
        ..SpaceRequest::default()
    };
    let (setup, measured) = resolve(&model, &gpu(), &request, &FLASH);
    // Its 16 bytes a parameter do not fit a 24 GB card: only the offloaded regime remains.
    assert!(!setup.dropped.is_empty());
    assert!(setup
        .space
        .regimes
        .iter()
        .all(|r| r.offload == Offload::Optimizer));
    assert_eq!(setup.facts.memory_prior.len(), setup.space.regimes.len());
    assert_eq!(measured, 1);
}

#[test]
fn the_largest_micro_batch_is_capped_at_what_the_budget_can_hold() {
    let model = ModelSpec::preset("gpt-1.3b").unwrap();
    let request = SpaceRequest {
        max_micro_batch: 1 << 20,
        ..SpaceRequest::default()
    };
    let (setup, _) = resolve(&model, &gpu(), &request, &FLASH);
    let budget = Budget::from_device(&gpu());
    let usable = budget.usable_gpu_bytes().unwrap() + budget.usable_host_bytes();
    assert_eq!(
        setup.space.max_micro_batch,
        limits::largest_micro_batch_within(&model, Precision::Bf16, usable)
    );
    assert!(setup.space.max_micro_batch < 1 << 20);
}

#[test]
fn errors_name_the_flag() {
    let request = SpaceRequest {
        data_parallel: vec![2],
        ..SpaceRequest::default()
    };
    let runtime = Runtime {
        flash_head_dims: &FLASH,
        host_adam_floor_s: &|_| panic!("no measurement for a refused request"),
        own_engine: true,
    };
    let target = gpu();
    let budget = Budget::from_device(&target);
    match SearchSetup::resolve(&ModelSpec::tiny(), &target, &budget, &request, &runtime) {
        Err(crate::Error::InvalidSpec { field, .. }) => assert_eq!(field, "--data-parallel"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
