//! Regimes that add memory savings to earlier ones: where they start, and when the host time of
//! an offloaded optimizer prunes them.

use super::*;

fn both() -> Regime {
    regime(
        Precision::Bf16,
        Checkpointing::EveryKth(1),
        Offload::Optimizer,
    )
}

/// A trial of `regime` at `micro_batch` that fitted with `gpu_mib` and `step_s`, 1024 tokens per
/// sequence.
fn fitted(regime: Regime, micro_batch: usize, gpu_mib: f64, step_s: f64) -> TrialResult {
    TrialResult {
        request: SearchSpace::new(vec![regime]).search_request(regime, micro_batch),
        outcome: Outcome::Fits(Measurement {
            peak_gpu_bytes: (gpu_mib * MIB as f64) as u64,
            peak_host_bytes: GIB,
            step_time_median_s: step_s,
            step_time_spread: 0.0,
            timed_steps: 5,
            tokens_per_s: 1024.0 * micro_batch as f64 / step_s,
            host_link: None,
        }),
        wall_s: 1.0,
    }
}

fn out_of_memory(regime: Regime, micro_batch: usize) -> TrialResult {
    TrialResult {
        request: SearchSpace::new(vec![regime]).search_request(regime, micro_batch),
        outcome: Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward,
        },
        wall_s: 0.5,
    }
}

/// Trials at `batches` following `gpu = fixed + per·b` MiB and `step = t0 + c·b` s, with
/// out-of-memory trials at `ooms`.
fn trials(
    regime: Regime,
    batches: &[usize],
    ooms: &[usize],
    gpu: (f64, f64),
    step: (f64, f64),
) -> Vec<TrialResult> {
    let mut out: Vec<TrialResult> = batches
        .iter()
        .map(|&b| {
            let b_f = b as f64;
            fitted(regime, b, gpu.0 + gpu.1 * b_f, step.0 + step.1 * b_f)
        })
        .collect();
    out.extend(ooms.iter().map(|&b| out_of_memory(regime, b)));
    out
}

/// `(history, next action)` for the space plain, checkpointing, offload, both on a 24 GiB card
/// (5 % headroom: 23347 MiB usable), laws shaped like the gpt-124m recording: plain 800 MiB and
/// 7 ms per sequence (boundary 26), checkpointing 290 MiB and 6.5 ms (boundary 73, 151k
/// tokens/s there), offload saving 1900 MiB and adding 0.45 s of host work per step.
#[test]
fn next_actions_of_regimes_that_add_memory_savings() {
    let b = budget(24 * GIB, 0.05);
    let s = SearchSpace::new(vec![bf16(), ckpt(), offload(), both()]);
    let driver = SearchDriver::new(s.clone(), MachineFacts::default(), b).unwrap();
    let probe =
        |regime: Regime, micro_batch: usize| Next::Probe(s.search_request(regime, micro_batch));
    let plain = trials(
        bf16(),
        &[1, 2, 4, 8, 16, 26],
        &[32, 27],
        (2048.0, 800.0),
        (0.02, 0.007),
    );
    let recompute = trials(
        ckpt(),
        &[26, 52, 73],
        &[104, 74],
        (2048.0, 290.0),
        (0.02, 0.0065),
    );
    let with = |parts: &[&[TrialResult]]| parts.concat();
    // The offloaded trial of `regime` at `micro_batch`: its twin's memory less 1900 MiB, its
    // twin's step time plus `host_s`.
    let offloaded = |regime: Regime, micro_batch: usize, host_s: f64| {
        let (per_mib, per_s) = if regime == both() {
            (290.0, 0.0065)
        } else {
            (800.0, 0.007)
        };
        let b_f = micro_batch as f64;
        fitted(
            regime,
            micro_batch,
            148.0 + per_mib * b_f,
            0.02 + per_s * b_f + host_s,
        )
    };
    let ckpt_best = Knobs::with_batch(ckpt(), 73, 1);
    let table: Vec<(&str, Vec<TrialResult>, Next)> = vec![
        (
            "checkpointing starts where the plain regime's feasible batches end",
            plain.clone(),
            probe(ckpt(), 26),
        ),
        (
            "offload first measures its host work at the space's start",
            with(&[&plain, &recompute]),
            probe(offload(), 1),
        ),
        (
            "offload is pruned after one trial: 0.45 s of host time per step caps it at \
             1024·58/(0.007·58 + 0.45) ≈ 69k tokens/s up to twice its borrowed boundary",
            with(&[&plain, &recompute, &[offloaded(offload(), 1, 0.45)]]),
            probe(both(), 1),
        ),
        (
            "both is pruned after one trial against checkpointing's 151k: its step at 1 is \
             0.29 s slower than checkpointing's at 26",
            with(&[
                &plain,
                &recompute,
                &[offloaded(offload(), 1, 0.45), offloaded(both(), 1, 0.45)],
            ]),
            Next::Done(Decision::Verify(ckpt_best)),
        ),
        (
            "10 ms of host time is not ruled out at 1 (checkpointing's smallest trial is \
             slower): both grows from its bases' largest batch",
            with(&[
                &plain,
                &recompute,
                &[offloaded(offload(), 1, 0.45), offloaded(both(), 1, 0.01)],
            ]),
            probe(both(), 73),
        ),
        (
            "10 ms measured against checkpointing at 73 still leaves 156k within reach: both \
             grows",
            with(&[
                &plain,
                &recompute,
                &[
                    offloaded(offload(), 1, 0.45),
                    offloaded(both(), 1, 0.01),
                    offloaded(both(), 73, 0.01),
                ],
            ]),
            probe(both(), 146),
        ),
        (
            "a base that fitted nothing gives no start: checkpointing starts at 1",
            vec![out_of_memory(bf16(), 1)],
            probe(ckpt(), 1),
        ),
    ];
    for (name, history, expected) in table {
        assert_eq!(driver.next(&history), expected, "{name}");
    }
}

/// The laws of the next-action table above (gpt-124m-like: offload adds 0.45 s of host work
/// per step), as a simulated device under `budget`.
fn offload_table_sim(budget: &Budget) -> Simulator {
    let law = |regime, fixed: f64, per_mib: f64, t0: f64, per_s: f64| {
        let mut l = laws(regime, (fixed, per_mib, 0.0), (t0, per_s));
        l.host_bytes = Law::affine(3.0 * GIB as f64, 0.0);
        l
    };
    Simulator::with_budget(
        budget,
        1024,
        vec![
            law(bf16(), 2048.0, 800.0, 0.02, 0.007),
            law(ckpt(), 2048.0, 290.0, 0.02, 0.0065),
            law(offload(), 148.0, 800.0, 0.47, 0.007),
            law(both(), 148.0, 290.0, 0.47, 0.0065),
        ],
    )
}

/// Facts that know only the host update's floor.
fn host_floor(floor: Option<f64>) -> MachineFacts {
    MachineFacts {
        offload_host_floor_s: floor,
        ..MachineFacts::default()
    }
}

#[test]
fn offloaded_regimes_are_pruned_after_one_trial_each_or_none_with_a_host_floor() {
    // The table's laws, searched end to end, with and without the host update measured before
    // the search. (floor seconds or none, trials of offload alone and of checkpointing with it)
    let b = budget(24 * GIB, 0.05);
    let sim = offload_table_sim(&b);
    let table: [(Option<f64>, [usize; 2]); 3] = [
        // Less host work than the true 0.45 s still rules both out.
        (Some(0.2), [0, 0]),
        // Next to nothing: the plain twin's own secant (7 ms per sequence, more than the winner
        // takes per sequence) still rules offload out; checkpointing's twin is the winner
        // itself, so checkpointing with offload pays its trial at the space's start.
        (Some(0.001), [0, 1]),
        // Without a floor, as before.
        (None, [1, 1]),
    ];
    for (floor, trials) in table {
        let s = SearchSpace {
            saturation_gain: 0.03,
            ..space(vec![bf16(), ckpt(), offload(), both()], 1024)
        };
        let driver = SearchDriver::new(s, host_floor(floor), b).unwrap();
        let outcome = search(&driver, &sim);
        let states = driver.regime_states(&outcome.history);
        for (state, trials) in states[2..].iter().zip(trials) {
            assert!(
                matches!(
                    state.progress,
                    RegimeProgress::Finished(RegimeEnd::Pruned { .. })
                ),
                "{floor:?}: {state:?}"
            );
            assert_eq!(state.trials, trials, "{floor:?}: {state:?}");
        }
        // Pruning never changes the answer here: checkpointing at its boundary wins.
        assert_eq!(outcome.chosen().unwrap(), Knobs::with_batch(ckpt(), 73, 1));
        // Checkpointing grew from the plain boundary (26, 52, then the memory model's 73).
        assert!(states[1].trials <= 5, "{floor:?}: {:?}", states[1]);
    }
}

#[test]
fn an_offloaded_regime_that_can_win_is_searched_to_its_boundary() {
    // The plain regime is nearly full of weights and optimizer state; offload frees 16 GiB
    // for 20 ms of host work per step, and its far larger batches are faster. A host floor of
    // 10 ms leaves it to be searched to its boundary, as without one.
    let b = budget(24 * GIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        128,
        vec![
            laws(bf16(), (20480.0, 100.0, 0.0), (0.05, 0.004)),
            laws(offload(), (4096.0, 100.0, 0.0), (0.07, 0.004)),
        ],
    );
    for floor in [None, Some(0.01)] {
        let s = space(vec![bf16(), offload()], 1024);
        let driver = SearchDriver::new(s, host_floor(floor), b).unwrap();
        let outcome = search(&driver, &sim);
        let states = driver.regime_states(&outcome.history);
        assert!(
            matches!(
                states[1].progress,
                RegimeProgress::Finished(RegimeEnd::Boundary { .. })
            ),
            "{floor:?}: {states:?}"
        );
        let expected = true_boundary(&sim, &b, offload(), &driver.space().candidates());
        assert_eq!(
            outcome.chosen().unwrap(),
            Knobs::with_batch(offload(), expected, 1),
            "{floor:?}"
        );
    }
}

#[test]
fn an_invalid_host_floor_is_refused_by_name() {
    for floor in [-1.0, f64::NAN, f64::INFINITY] {
        let s = space(vec![bf16(), offload()], 64);
        let err =
            SearchDriver::new(s, host_floor(Some(floor)), budget(24 * GIB, 0.05)).unwrap_err();
        assert!(err.to_string().contains("offload_host_floor_s"), "{err}");
    }
}

#[test]
fn an_offloaded_regime_is_bounded_by_its_twins_own_secant() {
    // gpt-124m on a 24 GiB card as measured: checkpointing adds ~0.8 ms per sequence to the
    // plain regime's 2.5–2.8 ms, and its trials (48, then 72 below an out-of-memory at 96) are no doubling
    // apart, so its own per-sequence floor is unknown and its base's is too low to rule out
    // checkpointing with offload (0.41 s of host work, 0.07 s of it measured before the search).
    // The twin's secant through 48 and 72 rules it out without a trial.
    let b = budget(24564 * MIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            SimRegime {
                // Step time bends upward: 2.5 ms per added sequence at 4 to 8, 2.8 ms at 16 to
                // 32, the floor a base gives being the smallest.
                step_time_s: Law {
                    fixed: 0.01,
                    linear: 0.0024,
                    quadratic: 0.000008,
                },
                ..laws(bf16(), (2913.0, 415.0, 0.0), (0.0, 0.0))
            },
            laws(ckpt(), (2517.0, 243.0, 0.0), (0.0, 0.00348)),
            laws(both(), (996.0, 241.0, 0.0), (0.41, 0.00348)),
        ],
    );
    let s = SearchSpace {
        saturation_gain: 0.03,
        ..space(vec![bf16(), ckpt(), both()], 1024)
    };
    let driver = SearchDriver::new(s, host_floor(Some(0.07)), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    let ckpt_timed: Vec<usize> = outcome
        .history
        .iter()
        .filter(|r| r.request.knobs.regime() == ckpt() && r.outcome.measurement().is_some())
        .map(|r| r.request.knobs.micro_batch)
        .collect();
    let (lo, hi) = (ckpt_timed.iter().min(), ckpt_timed.iter().max());
    assert!(
        ckpt_timed.len() >= 2 && *hi.unwrap() < 2 * *lo.unwrap(),
        "the premise: two timed checkpointing trials, no two a doubling apart; got {ckpt_timed:?}"
    );
    assert!(
        matches!(
            states[2].progress,
            RegimeProgress::Finished(RegimeEnd::Pruned { .. })
        ),
        "{:?}",
        states[2]
    );
    assert_eq!(states[2].trials, 0, "{:?}", states[2]);
    assert_eq!(outcome.chosen().unwrap().regime(), bf16());
}

#[test]
fn an_fp8_regime_starts_where_its_bf16_twin_reached() {
    let fp8 = regime(Precision::Fp8, Checkpointing::None, Offload::None);
    let b = budget(24 * GIB, 0.05);
    let s = SearchSpace {
        max_micro_batch: 64,
        ..SearchSpace::new(vec![bf16(), fp8])
    };
    let driver = SearchDriver::new(s.clone(), MachineFacts::default(), b).unwrap();
    // bf16: 800 MiB and 7 ms a sequence; its boundary closed at 26 (27 out of memory).
    let history = trials(
        bf16(),
        &[1, 2, 4, 8, 16, 26],
        &[32, 27],
        (2000.0, 800.0),
        (0.01, 0.007),
    );
    assert_eq!(
        driver.regime_states(&history)[0].progress,
        RegimeProgress::Finished(RegimeEnd::Boundary { largest: 26 })
    );
    // fp8 keeps bf16's activations and state: its first trial is at 26, not at 1.
    assert_eq!(
        driver.next(&history),
        Next::Probe(s.search_request(fp8, 26))
    );
}
