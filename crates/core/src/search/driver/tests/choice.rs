//! Which setting is chosen: throughput across regimes, global-batch divisibility, failed
//! verifications, hints when nothing fits, crashes, pruning, the trial limit, and events.

use std::cell::RefCell;

use super::*;
use crate::search::AccumulationExtra;

#[test]
fn picks_the_highest_measured_throughput_across_regimes() {
    let b = budget(10 * GIB, 0.05);
    let regimes = vec![bf16(), ckpt()];
    // bf16 saturates and then slows down (time quadratic in b); ckpt has a third more work per
    // sample but fits far more.
    let mut fast = laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.001));
    fast.step_time_s.quadratic = 0.00002;
    let slow = laws(ckpt(), (1024.0, 10.0, 0.0), (0.012, 0.0013));
    let sim = Simulator::with_budget(&b, 1024, vec![fast, slow]);
    let driver = SearchDriver::new(space(regimes, 1024), MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let chosen = outcome.chosen().unwrap();
    // Measured throughput of every feasible search trial; the chosen one is the maximum.
    let best = outcome
        .history
        .iter()
        .filter(|r| driver.is_feasible(r) && r.request.knobs.grad_accum == 1)
        .max_by(|a, b| {
            a.outcome
                .measurement()
                .unwrap()
                .tokens_per_s
                .total_cmp(&b.outcome.measurement().unwrap().tokens_per_s)
        })
        .unwrap();
    assert_eq!(chosen, best.request.knobs);
    assert_eq!(
        chosen.regime(),
        ckpt(),
        "bf16 slows down past ~22 sequences; ckpt keeps scaling"
    );
}

/// One bf16 regime of `fixed_mib` MiB plus 37 MiB a sequence on a 10 GiB card (5 % headroom),
/// searched for 1,536 sequences a step, where accumulating adds `accumulation_bytes`.
fn global_batch_1536(fixed_mib: f64, accumulation_bytes: u64) -> (Budget, SearchSpace, Simulator) {
    let b = budget(10 * GIB, 0.05);
    let s = SearchSpace {
        global_batch: Some(1536),
        ..space(vec![bf16()], 1024)
    };
    let mut sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (fixed_mib, 37.0, 0.0), (0.01, 0.002))],
    );
    sim.accumulation_gpu_bytes = accumulation_bytes;
    (b, s, sim)
}

#[test]
fn honours_global_batch_divisibility_and_verifies_with_accumulation() {
    let (b, s, sim) = global_batch_1536(1024.0, 0);
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    for r in &outcome.history {
        assert_eq!(1536 % r.request.knobs.micro_batch, 0, "{}", r.request.knobs);
    }
    // 235 is the memory boundary; the largest divisor of 1536 below it is 192 (accumulate 8).
    let chosen = outcome.chosen().unwrap();
    assert_eq!((chosen.micro_batch, chosen.grad_accum), (192, 8));
    assert_eq!(outcome.verification().unwrap().request.knobs, chosen);
}

#[test]
fn a_failed_verification_excludes_the_setting_and_the_search_goes_on() {
    // The accumulation buffer pushes 192 over the usable bytes (8128 + 2000 > 9728 MiB).
    let (b, s, sim) = global_batch_1536(1024.0, 2000 * MIB);
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let chosen = outcome.chosen().unwrap();
    assert_eq!((chosen.micro_batch, chosen.grad_accum), (128, 12));
    let verifications: Vec<_> = outcome
        .history
        .iter()
        .filter(|r| r.request.knobs.grad_accum > 1)
        .collect();
    assert_eq!(verifications.len(), 2);
    assert!(!driver.is_feasible(verifications[0]) && driver.is_feasible(verifications[1]));
    assert!(driver
        .candidates(&outcome.history)
        .iter()
        .all(|c| c.knobs.micro_batch != 192));
}

/// Facts that say accumulation adds `mib` MiB at every micro-batch of `space` that accumulates.
fn accumulation_facts(space: &SearchSpace, mib: u64) -> MachineFacts {
    let extra = space
        .candidates()
        .into_iter()
        .filter(|&b| space.plan_knobs(space.regimes[0], b).grad_accum > 1)
        .map(|micro_batch| AccumulationExtra {
            micro_batch,
            bytes: (mib * MIB) as f64,
        })
        .collect();
    MachineFacts {
        accumulation_extra: vec![extra],
        ..MachineFacts::default()
    }
}

#[test]
fn a_plan_that_accumulation_would_push_out_of_memory_is_not_verified() {
    // The summed gradients push 192 over the usable bytes (8128 + 2000 > 9728 MiB), not 128.
    let (b, s, sim) = global_batch_1536(1024.0, 2000 * MIB);
    // (what the facts say accumulation adds, verifications run, of them failed, ruled out)
    let cases: [(Option<u64>, usize, usize, &[usize]); 4] = [
        (None, 2, 1, &[]),
        // Told: 192 is ruled out by its trial, and the first verification passes.
        (Some(2000), 1, 0, &[192]),
        // Told too little: the verification still finds it out.
        (Some(500), 2, 1, &[]),
        // Told too much: 128 (5760 MiB measured) is ruled out, 192 is never tried, and 96 is
        // chosen.
        (Some(5000), 1, 0, &[128]),
    ];
    for (told, verifications_run, failed, ruled_out) in cases {
        let facts = told.map_or_else(MachineFacts::default, |mib| accumulation_facts(&s, mib));
        let driver = SearchDriver::new(s.clone(), facts, b).unwrap();
        let outcome = search(&driver, &sim);
        let chosen = outcome.chosen().unwrap();
        let expected = if told == Some(5000) {
            (96, 16)
        } else {
            (128, 12)
        };
        assert_eq!(
            (chosen.micro_batch, chosen.grad_accum),
            expected,
            "{told:?}"
        );
        let verifications: Vec<_> = outcome
            .history
            .iter()
            .filter(|r| r.request.knobs.grad_accum > 1)
            .collect();
        assert_eq!(verifications.len(), verifications_run, "{told:?}");
        let failures = verifications.iter().filter(|r| !driver.is_feasible(r));
        assert_eq!(failures.count(), failed, "{told:?}");
        let mut said: Vec<usize> = driver
            .accumulation_ruled_out(&outcome.history)
            .iter()
            .map(|r| r.knobs.micro_batch)
            .collect();
        said.sort();
        assert_eq!(said, ruled_out, "{told:?}");
        assert!(driver
            .candidates(&outcome.history)
            .iter()
            .all(|c| !ruled_out.contains(&c.knobs.micro_batch)));
    }
}

#[test]
fn a_search_whose_plans_accumulation_rules_out_says_so_and_what_to_try() {
    let (b, s, sim) = global_batch_1536(7.0 * 1024.0, 3 * GIB);
    let driver = SearchDriver::new(s.clone(), accumulation_facts(&s, 3 * 1024), b).unwrap();
    let events = RefCell::new(Vec::new());
    let reporter = |e: &Event| events.borrow_mut().push(e.clone());
    let outcome = run_search(
        &driver,
        &mut |r: &TrialRequest| Ok(sim.answer(r)),
        &reporter,
    )
    .unwrap();
    let Decision::NoFeasible { hint } = &outcome.decision else {
        panic!("{:?}", outcome.decision)
    };
    assert!(
        hint.contains("accumulating 1536 of them adds about 3.00 GiB")
            && hint.contains("--global-batch")
            && hint.contains("offload"),
        "{hint}"
    );
    assert!(outcome
        .history
        .iter()
        .all(|r| r.request.knobs.grad_accum == 1));
    // Each search trial that fitted was reported as ruled out, once.
    let fitted = outcome
        .history
        .iter()
        .filter(|r| driver.is_feasible(r))
        .count();
    let reported = events
        .borrow()
        .iter()
        .filter(|e| matches!(e, Event::RuledOut(_)))
        .count();
    assert!(fitted > 0);
    assert_eq!(reported, fitted);
}

#[test]
fn no_feasible_setting_gets_a_hint() {
    let b = budget(10 * GIB, 0.05);
    let too_big = |r| laws(r, (12.0 * 1024.0, 37.0, 0.0), (0.01, 0.002));
    let sim = Simulator::with_budget(&b, 1024, vec![too_big(bf16())]);
    let driver = SearchDriver::new(space(vec![bf16()], 1024), MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let Decision::NoFeasible { hint } = &outcome.decision else {
        panic!("{:?}", outcome.decision)
    };
    assert_eq!(
        outcome.history.len(),
        1,
        "one trial per regime when mb=1 is out"
    );
    assert!(
        hint.contains("GPU memory") && hint.contains("checkpointing") && hint.contains("offload"),
        "{hint}"
    );

    // Offload runs out of host memory instead; a regime the simulator lacks crashes.
    let mut host_bound = too_big(offload());
    host_bound.gpu_bytes = Law::affine(GIB as f64, MIB as f64);
    host_bound.host_bytes = Law::affine(40.0 * GIB as f64, 0.0);
    let sim = Simulator::with_budget(&b, 1024, vec![too_big(bf16()), host_bound]);
    let driver = SearchDriver::new(
        space(vec![bf16(), offload(), ckpt()], 1024),
        MachineFacts::default(),
        b,
    )
    .unwrap();
    let outcome = search(&driver, &sim);
    let Decision::NoFeasible { hint } = &outcome.decision else {
        panic!("{:?}", outcome.decision)
    };
    assert!(
        hint.contains("host memory") && hint.contains("no optimizer offload"),
        "{hint}"
    );
    assert!(
        hint.contains("crashed") && !hint.contains("try activation checkpointing"),
        "{hint}"
    );
}

#[test]
fn crashed_and_timed_out_trials_are_infeasible_micro_batches() {
    let failures = [
        Outcome::Crashed {
            reason: "illegal address".into(),
        },
        Outcome::TimedOut { after_s: 120.0 },
    ];
    for failure in failures {
        let b = budget(10 * GIB, 0.05);
        let driver =
            SearchDriver::new(space(vec![bf16()], 1024), MachineFacts::default(), b).unwrap();
        let sim = Simulator::with_budget(
            &b,
            1024,
            vec![laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002))],
        );
        let mut probe = |r: &TrialRequest| {
            let mut result = sim.answer(r);
            if r.knobs.micro_batch == 64 {
                result.outcome = failure.clone();
            }
            Ok(result)
        };
        let outcome = run_search(&driver, &mut probe, &NoReporter).unwrap();
        check_invariants(&driver, &outcome);
        // Feasibility is taken as monotone: 64 failed, so the boundary is 63.
        assert_eq!(outcome.chosen().unwrap().micro_batch, 63, "{failure:?}");
    }
}

#[test]
fn prunes_a_regime_that_cannot_win() {
    let b = budget(10 * GIB, 0.05);
    let fast = laws(bf16(), (1024.0, 37.0, 0.0), (0.001, 0.002));
    // fp32 regime: same memory, four times the work per sample.
    let fp32 = regime(Precision::Fp32, Checkpointing::None, Offload::None);
    let slow = laws(fp32, (1024.0, 37.0, 0.0), (0.001, 0.008));
    let sim = Simulator::with_budget(&b, 1024, vec![fast, slow]);
    let driver =
        SearchDriver::new(space(vec![bf16(), fp32], 1024), MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(
        matches!(
            states[1].progress,
            RegimeProgress::Finished(RegimeEnd::Pruned { .. })
        ),
        "{:?}",
        states[1]
    );
    assert!(states[1].trials < states[0].trials, "{states:?}");
    assert_eq!(outcome.chosen().unwrap().regime(), bf16());
}

#[test]
fn the_probe_limit_stops_exploration() {
    let b = budget(10 * GIB, 0.05);
    let s = SearchSpace {
        max_trials: Some(5),
        ..space(vec![bf16(), ckpt()], 1024)
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002)),
            laws(ckpt(), (1024.0, 10.0, 0.0), (0.01, 0.002)),
        ],
    );
    let outcome = search(&driver, &sim);
    assert_eq!(
        outcome.history.len(),
        6,
        "five search trials and one verification"
    );
    assert_eq!(outcome.chosen().unwrap().micro_batch, 16);
}

#[test]
fn events_follow_the_search() {
    let b = budget(10 * GIB, 0.05);
    let driver = SearchDriver::new(
        space(vec![bf16(), ckpt()], 1024),
        MachineFacts::default(),
        b,
    )
    .unwrap();
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002)),
            laws(ckpt(), (1024.0, 30.0, 0.0), (0.02, 0.003)),
        ],
    );
    let events = RefCell::new(Vec::new());
    let reporter = |e: &Event| events.borrow_mut().push(e.clone());
    let outcome = run_search(
        &driver,
        &mut |r: &TrialRequest| Ok(sim.answer(r)),
        &reporter,
    )
    .unwrap();
    let events = events.into_inner();
    let count = |f: &dyn Fn(&Event) -> bool| events.iter().filter(|e| f(e)).count();
    assert_eq!(
        count(&|e| matches!(e, Event::TrialStarted { .. })),
        outcome.history.len()
    );
    assert_eq!(
        count(&|e| matches!(e, Event::TrialFinished { .. })),
        outcome.history.len()
    );
    assert_eq!(count(&|e| matches!(e, Event::RegimeDone { .. })), 2);
    assert_eq!(
        count(&|e| matches!(e, Event::Verified { passed: true, .. })),
        1
    );
    assert!(matches!(
        events.last(),
        Some(Event::Finished {
            decision: Decision::Chosen(_),
            ..
        })
    ));
    // Events serialise as tagged JSON objects (for JSON-lines progress output).
    let json = serde_json::to_string(&events[0]).unwrap();
    assert!(json.starts_with(r#"{"event":"trial_started""#), "{json}");
}

#[test]
fn stops_growing_once_throughput_saturates() {
    // Step time 50 ms + 1 ms per sequence: throughput b/(0.05 + 0.001 b) gains 96 %, 91 %, …
    // per doubling, 2.4 % from 1024 to 2048 and 1.2 % to 4096 (the second doubling in a row
    // under 3 %, where growth stops); memory would allow 5000+ sequences.
    let b = budget(200 * GIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        128,
        vec![laws(bf16(), (1024.0, 37.0, 0.0), (0.05, 0.001))],
    );
    let s = SearchSpace {
        max_micro_batch: 8192,
        ..SearchSpace::new(vec![bf16()])
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    let RegimeProgress::Finished(RegimeEnd::Saturated { largest, gain }) = states[0].progress
    else {
        panic!("expected saturation, got {:?}", states[0]);
    };
    assert!(gain < SearchSpace::DEFAULT_SATURATION_GAIN, "{gain}");
    assert_eq!(largest, 4096, "grew to {largest}");
    // No probe ran into the memory boundary, and the choice is within 3 % of the best possible
    // throughput at any feasible batch (the law's asymptote is 1000 sequences/s).
    assert!(outcome
        .history
        .iter()
        .all(|r| r.outcome.measurement().is_some()));
    let chosen = outcome.chosen().unwrap().micro_batch as f64;
    let rate = chosen / (0.05 + 0.001 * chosen);
    assert!(
        rate > 0.95 * 1000.0,
        "chosen {chosen} runs {rate} sequences/s"
    );
}

#[test]
fn a_bracket_whose_gains_are_noise_is_left_open() {
    // Step time 0.5 ms + 2 ms per sequence: throughput b/(0.0005 + 0.002 b) gains 11 %, 6 %,
    // 3.1 % and 1.5 % per doubling up to 16, then 32 runs out of memory (boundary 20). Nothing
    // in 17..=20 can beat 16 by 1 %, so with a saturation stop the bracket stays open; without
    // one the exact boundary is found.
    let b = budget(2 * GIB, 0.0);
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (1024.0, 51.0, 0.0), (0.0005, 0.002))],
    );
    let boundary = true_boundary(&sim, &b, bf16(), &space(vec![bf16()], 64).candidates());
    assert_eq!(boundary, 20);
    let run = |saturation_gain: f64| {
        let s = SearchSpace {
            saturation_gain,
            ..space(vec![bf16()], 64)
        };
        let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
        let outcome = search(&driver, &sim);
        let state = driver.regime_states(&outcome.history)[0];
        (state, outcome.chosen().unwrap().micro_batch)
    };
    let (converged, chosen) = run(SearchSpace::DEFAULT_SATURATION_GAIN);
    let RegimeProgress::Finished(RegimeEnd::Converged {
        largest,
        upper_bound_tokens_per_s,
        best_tokens_per_s,
    }) = converged.progress
    else {
        panic!("expected convergence, got {converged:?}");
    };
    assert_eq!((largest, chosen), (16, 16));
    assert!(upper_bound_tokens_per_s < best_tokens_per_s * (1.0 + RESOLUTION_GAIN));
    // The bound is optimistic: the true best of the open batches is below it.
    let rate = |b: f64| 1024.0 * b / (0.0005 + 0.002 * b);
    assert!(rate(20.0) <= upper_bound_tokens_per_s);
    let (exact, chosen) = run(0.0);
    assert_eq!(
        exact.progress,
        RegimeProgress::Finished(RegimeEnd::Boundary { largest: 20 })
    );
    assert_eq!(chosen, 20);
    assert!(
        converged.trials < exact.trials,
        "{converged:?} vs {exact:?}"
    );
}

#[test]
fn a_regime_whose_step_time_caps_its_throughput_is_pruned_before_its_boundary() {
    // The second regime fits far larger batches but its step time grows 4x faster per
    // sequence: its throughput can never reach the first regime's.
    let b = budget(100 * GIB, 0.05);
    let fast = laws(bf16(), (1024.0, 300.0, 0.0), (0.02, 0.001));
    let slow = laws(ckpt(), (1024.0, 10.0, 0.0), (0.02, 0.004));
    let sim = Simulator::with_budget(&b, 128, vec![fast, slow]);
    let driver = SearchDriver::new(
        space(vec![bf16(), ckpt()], 4096),
        MachineFacts::default(),
        b,
    )
    .unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(
        matches!(
            states[1].progress,
            RegimeProgress::Finished(RegimeEnd::Pruned { .. })
        ),
        "{:?}",
        states[1]
    );
    assert!(
        states[1].trials <= 4,
        "pruned after {} trials",
        states[1].trials
    );
    assert_eq!(outcome.chosen().unwrap().regime(), bf16());
}

#[test]
fn memory_saving_regimes_are_not_probed_when_the_plain_regime_never_ran_out() {
    let b = budget(10 * GIB, 0.05);
    // Plain: everything up to 64 fits (AllFit); checkpointing would also fit but is slower.
    let sim = Simulator::with_budget(
        &b,
        64,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002)),
            laws(ckpt(), (1024.0, 10.0, 0.0), (0.01, 0.003)),
            laws(offload(), (512.0, 37.0, 0.0), (0.2, 0.002)),
        ],
    );
    let driver = SearchDriver::new(
        space(vec![bf16(), ckpt(), offload()], 64),
        MachineFacts::default(),
        b,
    )
    .unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(matches!(
        states[0].progress,
        RegimeProgress::Finished(RegimeEnd::AllFit { largest: 64 })
    ));
    for state in &states[1..] {
        assert_eq!(
            state.progress,
            RegimeProgress::Finished(RegimeEnd::Dominated { by: 0 }),
            "{state:?}"
        );
        assert_eq!(state.trials, 0);
    }
    assert_eq!(outcome.chosen().unwrap().regime(), bf16());
}

#[test]
fn memory_saving_regimes_are_probed_when_the_plain_regime_hits_memory() {
    let b = budget(10 * GIB, 0.05);
    // Plain runs out of memory near 235 while throughput still grows: checkpointing, which
    // fits 1024, is worth exploring and wins.
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.05, 0.001)),
            laws(ckpt(), (1024.0, 8.0, 0.0), (0.05, 0.0011)),
        ],
    );
    let s = SearchSpace {
        saturation_gain: 0.03,
        ..space(vec![bf16(), ckpt()], 1024)
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(
        matches!(
            states[0].progress,
            RegimeProgress::Finished(RegimeEnd::Boundary { .. })
        ),
        "{states:?}"
    );
    assert!(states[1].trials > 0, "{states:?}");
    assert_eq!(outcome.chosen().unwrap().regime(), ckpt());
}

#[test]
fn a_saturated_plain_regime_dominates_only_its_own_precision() {
    let b = budget(10 * GIB, 0.05);
    let fp32_ckpt = regime(Precision::Fp32, Checkpointing::EveryKth(1), Offload::None);
    // bf16 saturates early (step time linear from the start, no fixed cost to amortise).
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.0, 0.002)),
            laws(ckpt(), (1024.0, 10.0, 0.0), (0.0, 0.003)),
            laws(fp32_ckpt, (1024.0, 20.0, 0.0), (0.0, 0.001)),
        ],
    );
    let s = SearchSpace {
        saturation_gain: 0.03,
        ..space(vec![bf16(), ckpt(), fp32_ckpt], 1024)
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(
        matches!(
            states[0].progress,
            RegimeProgress::Finished(RegimeEnd::Saturated { .. })
        ),
        "{states:?}"
    );
    assert_eq!(
        states[1].progress,
        RegimeProgress::Finished(RegimeEnd::Dominated { by: 0 })
    );
    // No plain fp32 regime in the space: fp32 with checkpointing is searched (and is faster).
    assert!(states[2].trials > 0, "{states:?}");
    assert_eq!(outcome.chosen().unwrap().regime(), fp32_ckpt);
}

#[test]
fn a_slow_regime_is_pruned_long_before_its_memory_boundary() {
    let b = budget(24 * GIB, 0.05);
    // Plain: 800 MiB per sequence, boundary near 29; 16 ms + 4 ms per sequence.
    // Offload: 300 MiB per sequence (boundary near 76) but half a second of host work per
    // step. At its memory boundary it would reach 76 / (0.5 + 0.004·76) ≈ 95 sequences/s,
    // against ~200 for the plain regime, yet its step-time secant alone stays optimistic up to
    // the largest candidate (1024 / (0.5 + 4.1) ≈ 220).
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (2048.0, 800.0, 0.0), (0.016, 0.004)),
            laws(offload(), (1024.0, 300.0, 0.0), (0.5, 0.004)),
        ],
    );
    let s = SearchSpace {
        saturation_gain: 0.03,
        ..space(vec![bf16(), offload()], 1024)
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    let outcome = search(&driver, &sim);
    let states = driver.regime_states(&outcome.history);
    assert!(
        matches!(
            states[1].progress,
            RegimeProgress::Finished(RegimeEnd::Pruned { .. })
        ),
        "{states:?}"
    );
    // Growth 1, 2, 4 gives the secant and the memory model; pruned without reaching 64.
    assert!(states[1].trials <= 4, "{states:?}");
    assert_eq!(outcome.chosen().unwrap().regime(), bf16());
}

/// A memory prior sends a regime's first trial to half its predicted boundary: fewer trials,
/// the same exact boundary, whether the prior is right, too optimistic or too cautious.
#[test]
fn a_memory_prior_starts_a_regime_near_its_boundary() {
    use crate::spec::activations::MemoryLaw;
    let b = budget(10 * GIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002))],
    );
    let mib = MIB as f64;
    let run = |prior: Vec<MemoryLaw>| {
        let facts = MachineFacts {
            memory_prior: prior,
            ..MachineFacts::default()
        };
        let driver = SearchDriver::new(space(vec![bf16()], 1024), facts, b).unwrap();
        let outcome = search(&driver, &sim);
        let first = outcome.history[0].request.knobs.micro_batch;
        (
            outcome.chosen().unwrap().micro_batch,
            first,
            outcome.history.len(),
        )
    };
    let (chosen, first, without) = run(Vec::new());
    assert_eq!((chosen, first), (235, 1));
    // (per-sequence MiB of the prior, expected first trial)
    for (per_sequence, expected_first) in [(37.0, 64), (18.5, 128), (148.0, 16)] {
        let prior = vec![MemoryLaw {
            fixed_bytes: 1024.0 * mib,
            per_sequence_bytes: per_sequence * mib,
        }];
        let (chosen, first, trials) = run(prior);
        assert_eq!(chosen, 235, "prior {per_sequence} MiB per sequence");
        assert_eq!(
            first, expected_first,
            "prior {per_sequence} MiB per sequence"
        );
        assert!(
            trials < without,
            "{trials} trials with the prior, {without} without"
        );
    }
}

/// A prior that is far off the other way (the first trial runs out of memory) still finds the
/// boundary, from below.
#[test]
fn a_memory_prior_that_overshoots_still_finds_the_boundary() {
    use crate::spec::activations::MemoryLaw;
    let b = budget(10 * GIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002))],
    );
    let facts = MachineFacts {
        memory_prior: vec![MemoryLaw {
            fixed_bytes: 0.0,
            per_sequence_bytes: (2 * MIB) as f64,
        }],
        ..MachineFacts::default()
    };
    let driver = SearchDriver::new(space(vec![bf16()], 1024), facts, b).unwrap();
    let outcome = search(&driver, &sim);
    assert!(
        !driver.is_feasible(&outcome.history[0]),
        "the first trial overshoots"
    );
    assert_eq!(outcome.chosen().unwrap().micro_batch, 235);
}

/// When the plan's verification fails at the regime's boundary (accumulation needs more
/// memory than its search trial did) and nothing feasible was measured below it, the regime
/// searches below again instead of giving up.
#[test]
fn a_failed_verification_reopens_its_regime_below_it() {
    use crate::spec::activations::MemoryLaw;
    // Accumulation adds 4000 MiB: 128 (5760 MiB) and 192 fit alone, not when accumulating.
    let (b, s, sim) = global_batch_1536(1024.0, 4000 * MIB);
    // The prior starts the regime at 128: nothing below it was tried.
    let facts = MachineFacts {
        memory_prior: vec![MemoryLaw {
            fixed_bytes: 1024.0 * MIB as f64,
            per_sequence_bytes: 30.0 * MIB as f64,
        }],
        ..MachineFacts::default()
    };
    let driver = SearchDriver::new(s, facts, b).unwrap();
    let outcome = search(&driver, &sim);
    let first = outcome.history[0].request.knobs.micro_batch;
    assert_eq!(first, 128);
    let chosen = outcome.chosen().expect("a smaller micro-batch passes");
    assert!(chosen.micro_batch < 128, "{chosen}");
    assert!(driver.is_feasible(outcome.verification().unwrap()));
}
