//! Timing noise: seeded searches against a device whose step times scatter from trial to trial
//! and from step to step agree on the plan, up to the interval each states.

use super::*;
use crate::search::sim::{Scatter, Scattered};

/// Throughput saturating with the batch: 10 ms plus 1.2 ms a sequence, 5 % more with
/// checkpointing. Memory allows 235 sequences without checkpointing (as in the module docs'
/// example). Doublings gain 21 %, 12 % and 6 % from 16 to 128 sequences, and 235 runs 3 %
/// faster than 128, so where growth stops is decided close to the saturation threshold. The
/// best of checkpointing (435 sequences) runs 3 % slower than the best without.
fn saturating() -> (Simulator, SearchDriver) {
    let b = budget(10 * GIB, 0.05);
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![
            laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.0012)),
            laws(ckpt(), (1024.0, 20.0, 0.0), (0.0105, 0.00126)),
        ],
    );
    let s = SearchSpace {
        max_micro_batch: 1024,
        warmup_steps: 1,
        timed_steps: 3,
        verify_timed_steps: 5,
        ..SearchSpace::new(vec![bf16(), ckpt()])
    };
    let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
    (sim, driver)
}

/// The noise-free throughput of `knobs` on `sim`.
fn true_tokens_per_s(sim: &Simulator, knobs: Knobs) -> f64 {
    let request = TrialRequest {
        knobs: Knobs::with_batch(knobs.regime(), knobs.micro_batch, 1),
        warmup_steps: 1,
        timed_steps: 3,
        remeasure: false,
    };
    sim.answer(&request)
        .outcome
        .measurement()
        .unwrap()
        .tokens_per_s
}

/// Each run's choice and the relative half-width of the 95 % interval it states.
fn seeded_runs(scatter: Scatter) -> (Simulator, Vec<(Knobs, f64)>) {
    let (sim, driver) = saturating();
    let runs = (0..20)
        .map(|seed| {
            let mut prober = Scattered::new(sim.clone(), scatter, seed);
            let outcome = run_search(&driver, &mut prober, &NoReporter).unwrap();
            check_invariants(&driver, &outcome);
            let chosen = outcome.chosen().unwrap();
            let stated = driver.candidates(&outcome.history)[0].measurement;
            let (low, high) = stated.tokens_per_s_interval();
            let half = (high - low) / 2.0 / stated.tokens_per_s;
            (chosen, half)
        })
        .collect();
    (sim, runs)
}

#[test]
fn twenty_seeded_searches_agree_up_to_the_interval_each_states() {
    // Trials scatter by 2 % from one to the next and their steps by 10 % more: three timed
    // steps cannot resolve the 3–6 % gains that decide where growth stops, nor the 3 % between
    // the best settings of the two regimes. Without remeasurements 10 of these 20 runs chose
    // the best setting; with them, 17.
    let scatter = Scatter {
        between_trials: 0.02,
        within_trial: 0.10,
    };
    let (sim, runs) = seeded_runs(scatter);
    let best = (1..=235)
        .map(|b| true_tokens_per_s(&sim, Knobs::with_batch(bf16(), b, 1)))
        .fold(0.0, f64::max);
    let top = |knobs: Knobs| true_tokens_per_s(&sim, knobs);
    let same = runs.iter().filter(|r| r.0 == runs[0].0).count();
    assert!(same >= 15, "only {same} of 20 runs chose {}", runs[0].0);
    // Growth stops where it is not shown to gain the saturation threshold: a plan may be that
    // far from the best, as measured to its interval.
    let tolerance = SearchSpace::DEFAULT_SATURATION_GAIN;
    for (i, &(chosen, half)) in runs.iter().enumerate() {
        assert!(half > 0.0 && half < 0.2, "run {i} states ±{half}");
        assert!(
            top(chosen) >= best * (1.0 - half - tolerance),
            "run {i} chose {chosen}: {:.0} tokens/s of {best:.0}, stating ±{:.1} %",
            top(chosen),
            100.0 * half
        );
        for &(other, other_half) in &runs {
            assert!(
                (top(other) / top(chosen) - 1.0).abs() <= half + other_half,
                "run {i} chose {chosen} (±{:.1} %), another {other} (±{:.1} %)",
                100.0 * half,
                100.0 * other_half
            );
        }
    }
}

/// The PyTorch harness's gpt-124m search on an H100 capped at 24 GB (2026-12-06): 16 fitted at
/// 202.6k tokens/s, 32 and 24 ran out of memory, 20 fitted at 171.9k in its first trial and
/// 191.4k when run again. Peaks grow by 0.61 GiB a sequence, so 21 and 22 may fit the
/// headroom (PyTorch's exact largest feasible batch was 21). The regime's convergence rested on
/// 20's first trial alone; now it waits for 20 to be run again.
#[test]
fn a_largest_batch_slower_than_a_smaller_one_is_run_again_before_its_regime_converges() {
    let (s, driver) = harness_driver(vec![bf16(), ckpt()]);
    let fits = |mb: usize, gib: f64, step_s: f64, spread: f64, steps: usize, again: bool| {
        harness_trial(&s, mb, gib, step_s, spread, steps, again)
    };
    let oom = |mb: usize| harness_oom(&s, mb);
    let mut history = vec![
        fits(16, 18.877, 0.080856, 0.0054, 3, false),
        oom(32),
        oom(24),
        fits(20, 21.320, 0.119145, 0.0252, 3, false),
    ];
    // Before: the slow 20 ended the regime ("converged") and the plan stopped at 20.
    match driver.next(&history) {
        Next::Probe(r) => {
            assert!(r.remeasure, "{r:?}");
            assert_eq!(
                r.knobs.micro_batch, 20,
                "the slower, noisier trial goes first"
            );
            assert!(r.timed_steps > 3, "{r:?}");
        }
        other => panic!("expected the slow trial run again, got {other:?}"),
    }
    history.push(fits(20, 21.320, 0.107003, 0.2594, 6, true));
    // Pooled, 20 measures 184k tokens/s, inside the band its spread leaves against 16: the
    // regime converges on the pooled figure (no open batch can beat 16, whose trial is the
    // faster), and the search moves on to checkpointing from the plain regime's reach.
    let states = driver.regime_states(&history);
    let RegimeProgress::Finished(RegimeEnd::Converged {
        largest,
        upper_bound_tokens_per_s,
        ..
    }) = states[0].progress
    else {
        panic!("expected convergence, got {:?}", states[0]);
    };
    assert_eq!(largest, 20);
    let pooled = driver
        .candidates(&history)
        .iter()
        .find(|c| c.knobs.micro_batch == 20)
        .map(|c| c.measurement.tokens_per_s)
        .unwrap();
    assert!(pooled > 171_900.0 && pooled < 191_400.0, "{pooled}");
    // The bound through a batch slower than a smaller one is that batch's own throughput.
    assert!(
        (upper_bound_tokens_per_s - pooled).abs() < 1e-6 * pooled,
        "{upper_bound_tokens_per_s}"
    );
    match driver.next(&history) {
        Next::Probe(r) => assert_eq!((r.knobs.regime(), r.knobs.micro_batch), (ckpt(), 20)),
        other => panic!("expected checkpointing next, got {other:?}"),
    }
}

/// The gpt-124m harness search's space over `regimes` and its budget (24 GB card, 5 %
/// headroom).
fn harness_driver(regimes: Vec<Regime>) -> (SearchSpace, SearchDriver) {
    let b = Budget {
        gpu_bytes: Some(25_757_220_864),
        host_bytes: 32 * GIB,
        headroom: 0.05,
    };
    let s = SearchSpace {
        max_micro_batch: 554,
        warmup_steps: 1,
        timed_steps: 3,
        ..SearchSpace::new(regimes)
    };
    let driver = SearchDriver::new(s.clone(), MachineFacts::default(), b).unwrap();
    (s, driver)
}

/// A plain bf16 harness trial of `mb` sequences of 1,024 tokens that fitted, peaking at
/// `peak_gib` with a median step of `step_s`.
fn harness_trial(
    s: &SearchSpace,
    mb: usize,
    peak_gib: f64,
    step_s: f64,
    spread: f64,
    steps: usize,
    again: bool,
) -> TrialResult {
    TrialResult {
        request: TrialRequest {
            timed_steps: steps,
            remeasure: again,
            ..s.search_request(bf16(), mb)
        },
        outcome: Outcome::Fits(Measurement {
            peak_gpu_bytes: (peak_gib * GIB as f64) as u64,
            peak_host_bytes: GIB,
            step_time_median_s: step_s,
            step_time_spread: spread,
            timed_steps: steps,
            tokens_per_s: 1024.0 * mb as f64 / step_s,
            host_link: None,
        }),
        wall_s: 1.0,
    }
}

/// [`harness_trial`] at `tokens_per_s`, peaking as measured: 9.12 GiB and 0.61 GiB a
/// sequence.
fn harness_fits(
    s: &SearchSpace,
    mb: usize,
    tokens_per_s: f64,
    spread: f64,
    steps: usize,
    again: bool,
) -> TrialResult {
    let peak_gib = 9.12 + 0.61 * mb as f64;
    let step_s = 1024.0 * mb as f64 / tokens_per_s;
    harness_trial(s, mb, peak_gib, step_s, spread, steps, again)
}

fn harness_oom(s: &SearchSpace, mb: usize) -> TrialResult {
    TrialResult {
        request: s.search_request(bf16(), mb),
        outcome: Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            phase: Phase::ForwardBackward,
        },
        wall_s: 0.3,
    }
}

/// Runs the search from `history` to its decision, answering 16 and 20 as `at_16` and `at_20`
/// say (remeasured or not), larger batches out of memory and smaller ones slower.
fn harness_decision(
    s: &SearchSpace,
    driver: &SearchDriver,
    mut history: Vec<TrialResult>,
    at_16: (f64, f64),
    at_20: (f64, f64),
) -> (Decision, Vec<TrialResult>) {
    loop {
        match driver.next(&history) {
            Next::Probe(r) => {
                let (mb, steps, again) = (r.knobs.micro_batch, r.timed_steps, r.remeasure);
                history.push(match mb {
                    20 => harness_fits(s, 20, at_20.0, at_20.1, steps, again),
                    16 => harness_fits(s, 16, at_16.0, at_16.1, steps, again),
                    21.. => harness_oom(s, mb),
                    _ => harness_fits(s, mb, 12_000.0 * mb as f64, 0.013, steps, again),
                });
                assert!(history.len() < 30, "the search ends: {history:?}");
            }
            Next::Done(decision) => return (decision, history),
        }
    }
}

/// The same harness on an H200 (2026-12-07): 16 ran at 219.8k and 217.0k tokens/s; 20 at
/// 177.2k, then 199.5k with steps scattered by 24 %. Pooled, 20 falls inside the tie band of 16
/// by a hair, and the largest batch within the band came first: the plan was 20, 9 % slower
/// than 16. Near the memory boundary a larger batch can run slower, so a smaller batch that
/// measured faster than the larger one's interval reaches has it run again before the choice.
#[test]
fn a_larger_batch_ahead_only_by_its_spread_is_run_again_and_the_faster_batch_chosen() {
    let (s, driver) = harness_driver(vec![bf16()]);
    let history = vec![
        harness_fits(&s, 16, 219_840.5, 0.0123, 3, false),
        harness_oom(&s, 32),
        harness_oom(&s, 24),
        harness_fits(&s, 20, 177_211.9, 0.0221, 3, false),
        harness_fits(&s, 20, 199_528.6, 0.2377, 6, true),
        harness_fits(&s, 16, 216_983.9, 0.0133, 6, true),
    ];
    // Each setting runs again as it did: 20 near its verification's 197.5k.
    let at_16 = (218_000.0, 0.0130);
    let at_20 = (197_498.8, 0.2583);
    let (decision, history) = harness_decision(&s, &driver, history, at_16, at_20);
    let remeasured = history.iter().filter(|t| t.request.remeasure).count();
    assert!(remeasured > 2, "20 was run again: {history:?}");
    match decision {
        Decision::Verify(k) => assert_eq!(k.micro_batch, 16, "{history:?}"),
        other => panic!("expected a verification, got {other:?}"),
    }
}

/// The same harness on an H100 (2026-12-07): 16 at 203.8k tokens/s, 20 at 179.4k. Each run
/// again agreed (203.8k; 186.9k), yet the search ran each twice more before its regime
/// converged, and once more each before the choice could have: six trials that could not change
/// the plan. A difference that held when both were run again stands.
#[test]
fn a_difference_that_holds_when_both_are_run_again_ends_the_remeasuring() {
    let (s, driver) = harness_driver(vec![bf16()]);
    let history = vec![
        harness_fits(&s, 16, 203_807.0, 0.0072, 3, false),
        harness_oom(&s, 32),
        harness_oom(&s, 24),
        harness_fits(&s, 20, 179_365.0, 0.0108, 3, false),
    ];
    let (decision, history) = harness_decision(
        &s,
        &driver,
        history,
        (203_819.0, 0.0026),
        (186_885.0, 0.2147),
    );
    let remeasured: Vec<usize> = history
        .iter()
        .filter(|t| t.request.remeasure)
        .map(|t| t.request.knobs.micro_batch)
        .collect();
    assert_eq!(remeasured, [20, 16], "one run again each: {history:?}");
    match decision {
        Decision::Verify(k) => assert_eq!(k.micro_batch, 16, "{history:?}"),
        other => panic!("expected a verification, got {other:?}"),
    }
}
