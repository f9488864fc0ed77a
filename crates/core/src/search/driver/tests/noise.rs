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
