//! The driver against simulated devices with known laws. This file: shared helpers, exact
//! boundaries and trial counts. `choice`: throughput choice, global batch, verification,
//! hints, pruning, limits and events. `related`: regimes that add memory savings to earlier ones.

use std::collections::HashSet;

use super::*;
use crate::knobs::{Checkpointing, Offload, Precision, Regime};
use crate::search::report::{Event, NoReporter};
use crate::search::run::{run_search, SearchOutcome};
use crate::search::sim::{Law, SimRegime, Simulator};
use crate::trial::{MemoryKind, Outcome, Phase};

mod choice;
mod noise;
mod non_monotone;
mod relatives;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn regime(precision: Precision, checkpointing: Checkpointing, offload: Offload) -> Regime {
    Regime {
        precision,
        checkpointing,
        offload,
        data_parallel: crate::knobs::DataParallel::SINGLE,
        update: Default::default(),
        state: Default::default(),
    }
}

fn bf16() -> Regime {
    regime(Precision::Bf16, Checkpointing::None, Offload::None)
}

fn ckpt() -> Regime {
    regime(Precision::Bf16, Checkpointing::EveryKth(1), Offload::None)
}

fn offload() -> Regime {
    regime(Precision::Bf16, Checkpointing::None, Offload::Optimizer)
}

/// Laws in MiB and seconds.
fn laws(regime: Regime, gpu_mib: (f64, f64, f64), step_s: (f64, f64)) -> SimRegime {
    let mib = MIB as f64;
    SimRegime {
        regime,
        gpu_bytes: Law {
            fixed: gpu_mib.0 * mib,
            linear: gpu_mib.1 * mib,
            quadratic: gpu_mib.2 * mib,
        },
        host_bytes: Law::affine(2.0 * GIB as f64, 0.0),
        step_time_s: Law::affine(step_s.0, step_s.1),
    }
}

fn budget(gpu: u64, headroom: f64) -> Budget {
    Budget {
        gpu_bytes: Some(gpu),
        host_bytes: 32 * GIB,
        headroom,
    }
}

/// A space that grows to the memory boundary (no saturation stop), so that boundary finding is
/// what these tables test; `choice::stops_growing_once_throughput_saturates` tests the stop.
fn space(regimes: Vec<Regime>, max_micro_batch: usize) -> SearchSpace {
    SearchSpace {
        max_micro_batch,
        saturation_gain: 0.0,
        ..SearchSpace::new(regimes)
    }
}

fn search(driver: &SearchDriver, sim: &Simulator) -> SearchOutcome {
    let outcome = run_search(
        driver,
        &mut |r: &TrialRequest| Ok(sim.answer(r)),
        &NoReporter,
    )
    .unwrap();
    check_invariants(driver, &outcome);
    outcome
}

/// Holds for every search: search trials never repeat (but as remeasurements of one search
/// trial), run without accumulation on candidate micro-batches, and a chosen setting is the best
/// feasible one and was verified last.
fn check_invariants(driver: &SearchDriver, outcome: &SearchOutcome) {
    let candidates = driver.space().candidates();
    let mut seen = HashSet::new();
    let mut remeasured = 0;
    for (i, r) in outcome.history.iter().enumerate() {
        if r.request.remeasure {
            remeasured += 1;
            let first = outcome.history[..i]
                .iter()
                .filter(|e| e.request.knobs == r.request.knobs && !e.request.remeasure)
                .count();
            assert_eq!(first, 1, "a remeasurement repeats one search trial");
        }
    }
    let verifications: Vec<_> = outcome
        .history
        .iter()
        .filter(|r| !r.request.remeasure)
        .filter(|r| r.request.knobs.grad_accum != 1 || !seen.insert(r.request.knobs))
        .collect();
    let search_trials = outcome.history.len() - verifications.len() - remeasured;
    assert_eq!(seen.len(), search_trials, "a search trial repeated knobs");
    for knobs in &seen {
        assert!(
            candidates.contains(&knobs.micro_batch),
            "{knobs} is not a candidate"
        );
    }
    for v in &verifications {
        assert_eq!(v.request.timed_steps, driver.space().verify_timed_steps);
    }
    if let Decision::Chosen(knobs) = outcome.decision {
        let last = outcome.history.last().unwrap();
        assert_eq!(
            last.request.knobs, knobs,
            "the last trial must verify the choice"
        );
        assert!(driver.is_feasible(last));
        assert_eq!(
            knobs.global_batch(),
            driver.space().global_batch.unwrap_or(knobs.micro_batch)
        );
        let best = driver.candidates(&outcome.history)[0];
        assert_eq!(best.knobs, knobs);
        let candidates = driver.candidates(&outcome.history);
        let top = candidates
            .iter()
            .max_by(|a, b| {
                a.measurement
                    .tokens_per_s
                    .total_cmp(&b.measurement.tokens_per_s)
            })
            .unwrap();
        // The best measured, or a larger batch of its regime that the timing cannot tell from
        // it (see `remeasure::tie_band`).
        let band = super::remeasure::tie_band(&best.measurement, &top.measurement);
        assert!(
            best.measurement.tokens_per_s >= top.measurement.tokens_per_s * (1.0 - band)
                || verifications.len() > 1
        );
    }
}

/// The largest micro-batch the simulated law allows within the usable bytes, by brute force.
fn true_boundary(sim: &Simulator, budget: &Budget, regime: Regime, candidates: &[usize]) -> usize {
    let laws = sim.regimes.iter().find(|r| r.regime == regime).unwrap();
    let usable = budget.usable_gpu_bytes().unwrap() as f64;
    candidates
        .iter()
        .copied()
        .filter(|&b| laws.gpu_bytes.at(b).round() <= usable)
        .max()
        .unwrap_or(0)
}

fn log2_floor(b: usize) -> usize {
    (usize::BITS - 1 - b.leading_zeros()) as usize
}

#[test]
fn finds_the_exact_boundary_within_the_stated_probe_count() {
    struct Case {
        name: &'static str,
        gpu_mib: (f64, f64, f64),
        budget_mib: u64,
        headroom: f64,
        max_micro_batch: usize,
        start: usize,
        affine: bool,
    }
    let case = |name, gpu_mib, budget_mib, headroom, max_micro_batch, start| Case {
        name,
        gpu_mib,
        budget_mib,
        headroom,
        max_micro_batch,
        start,
        affine: gpu_mib.2 == 0.0,
    };
    let cases = [
        case(
            "headroom boundary",
            (1024.0, 37.0, 0.0),
            10 * 1024,
            0.05,
            1024,
            1,
        ),
        case(
            "power-of-two boundary",
            (1024.0, 64.0, 0.0),
            9216,
            0.0,
            1024,
            1,
        ),
        case(
            "only one fits",
            (9000.0, 500.0, 0.0),
            10 * 1024,
            0.05,
            1024,
            1,
        ),
        case("three fit", (1024.0, 2500.0, 0.0), 10 * 1024, 0.05, 1024, 1),
        case(
            "everything fits",
            (1024.0, 37.0, 0.0),
            10 * 1024,
            0.05,
            128,
            1,
        ),
        case(
            "h200 scale",
            (20480.0, 3.0, 0.0),
            140 * 1024,
            0.05,
            65536,
            1,
        ),
        case("bent law", (1024.0, 20.0, 0.05), 10 * 1024, 0.05, 1024, 1),
        case(
            "strongly bent law",
            (512.0, 1.0, 0.4),
            24 * 1024,
            0.05,
            1024,
            1,
        ),
        case(
            "start above the boundary",
            (1024.0, 2500.0, 0.0),
            10 * 1024,
            0.05,
            1024,
            8,
        ),
        case(
            "start below the boundary",
            (1024.0, 37.0, 0.0),
            10 * 1024,
            0.05,
            1024,
            16,
        ),
    ];
    for c in cases {
        let b = budget(c.budget_mib * MIB, c.headroom);
        let s = SearchSpace {
            start_micro_batch: c.start,
            ..space(vec![bf16()], c.max_micro_batch)
        };
        let driver = SearchDriver::new(s, MachineFacts::default(), b).unwrap();
        let sim = Simulator::with_budget(&b, 1024, vec![laws(bf16(), c.gpu_mib, (0.01, 0.002))]);
        let outcome = search(&driver, &sim);
        let expected = true_boundary(&sim, &b, bf16(), &driver.space().candidates());
        let state = driver.regime_states(&outcome.history)[0];
        let end = match state.progress {
            RegimeProgress::Finished(end) => end,
            other => panic!("{}: regime not finished: {other:?}", c.name),
        };
        let largest = match end {
            RegimeEnd::Boundary { largest } | RegimeEnd::AllFit { largest } => largest,
            other => panic!("{}: unexpected end {other:?}", c.name),
        };
        assert_eq!(largest, expected, "{}: boundary", c.name);
        // Step time is affine, so throughput rises with the batch: the boundary is the best.
        assert_eq!(
            outcome.chosen().unwrap().micro_batch,
            expected,
            "{}",
            c.name
        );
        let trials = state.trials;
        assert!(
            trials <= driver.regime_trial_bound(),
            "{}: {trials} > {}",
            c.name,
            driver.regime_trial_bound()
        );
        if c.start == 1 && expected < c.max_micro_batch {
            let k = log2_floor(expected);
            let bound = if c.affine { k + 4 } else { 2 * k + 5 };
            assert!(
                trials <= bound,
                "{}: {trials} trials for boundary {expected}, bound {bound}",
                c.name
            );
        }
        assert_eq!(
            outcome.history.len(),
            trials + 1,
            "{}: one verification",
            c.name
        );
    }
}

#[test]
fn the_documented_example_takes_eleven_probes_and_one_verification() {
    // 1 GiB + 37 MiB·b against 10 GiB with 5 % headroom: 1..128 fit, 256 runs out of memory,
    // the model jumps to 235 (fits), 236 fits only inside the headroom: boundary 235.
    let b = budget(10 * GIB, 0.05);
    let driver = SearchDriver::new(space(vec![bf16()], 1024), MachineFacts::default(), b).unwrap();
    let sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (1024.0, 37.0, 0.0), (0.01, 0.002))],
    );
    let outcome = search(&driver, &sim);
    let batches: Vec<usize> = outcome
        .history
        .iter()
        .map(|r| r.request.knobs.micro_batch)
        .collect();
    assert_eq!(
        batches,
        vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 235, 236, 235]
    );
    assert!(matches!(
        outcome.history[8].outcome,
        Outcome::OutOfMemory {
            memory: MemoryKind::Gpu,
            ..
        }
    ));
    assert!(
        outcome.history[10].outcome.measurement().is_some(),
        "236 fits the device but not the headroom"
    );
    assert_eq!(
        outcome.decision,
        Decision::Chosen(Knobs::new(235, Precision::Bf16))
    );
    // Growth 1 … 512 and 1024 (11), three model-guided trials, bisection of the 508 candidates
    // left between 513 and 1023 (9), one trial past a boundary set above the headroom. Here 236
    // is such a boundary, but 256 already went past it: no trial is added.
    assert_eq!(driver.regime_trial_bound(), 24);
}

/// `(history of (micro_batch, outcome) in regime bf16)` → the next action, step by step.
#[test]
fn next_actions_from_hand_written_histories() {
    let b = budget(10 * GIB, 0.0);
    let s = SearchSpace {
        max_micro_batch: 64,
        ..SearchSpace::new(vec![bf16(), ckpt()])
    };
    let driver = SearchDriver::new(s.clone(), MachineFacts::default(), b).unwrap();
    let fits = |gpu_mib: u64| {
        Outcome::Fits(Measurement {
            peak_gpu_bytes: gpu_mib * MIB,
            peak_host_bytes: GIB,
            step_time_median_s: 1.0,
            step_time_spread: 0.0,
            timed_steps: 5,
            tokens_per_s: gpu_mib as f64,
            host_link: None,
        })
    };
    let oom = || Outcome::OutOfMemory {
        memory: MemoryKind::Gpu,
        phase: Phase::ForwardBackward,
    };
    let result = |regime: Regime, micro_batch: usize, outcome: Outcome| TrialResult {
        request: s.search_request(regime, micro_batch),
        outcome,
        wall_s: 1.0,
    };
    let probe =
        |regime: Regime, micro_batch: usize| Next::Probe(s.search_request(regime, micro_batch));
    // Memory 1000 + 1000·b MiB against 10240 MiB: the boundary is 9.
    let law = |b: u64| fits(1000 + 1000 * b);
    let table: Vec<(Vec<TrialResult>, Next)> = vec![
        (vec![], probe(bf16(), 1)),
        (vec![result(bf16(), 1, law(1))], probe(bf16(), 2)),
        (
            vec![result(bf16(), 1, law(1)), result(bf16(), 2, law(2))],
            probe(bf16(), 4),
        ),
        // After the first OOM (16) the model predicts 9.
        (
            [1, 2, 4, 8]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([result(bf16(), 16, oom())])
                .collect(),
            probe(bf16(), 9),
        ),
        // 9 fits: pin with 10.
        (
            [1, 2, 4, 8, 9]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([result(bf16(), 16, oom())])
                .collect(),
            probe(bf16(), 10),
        ),
        // 10 is out: bf16 is done at 9; ckpt, which only adds recompute to it, starts where
        // bf16 ended.
        (
            [1, 2, 4, 8, 9]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([result(bf16(), 16, oom()), result(bf16(), 10, oom())])
                .collect(),
            probe(ckpt(), 9),
        ),
        // ckpt does not fit at 9: bisect below it.
        (
            [1, 2, 4, 8, 9]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([
                    result(bf16(), 16, oom()),
                    result(bf16(), 10, oom()),
                    result(ckpt(), 9, oom()),
                ])
                .collect(),
            probe(ckpt(), 5),
        ),
        // Nothing fits in ckpt either at 1: choose bf16 at 9, which is unverified.
        (
            [1, 2, 4, 8, 9]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([
                    result(bf16(), 16, oom()),
                    result(bf16(), 10, oom()),
                    result(ckpt(), 1, oom()),
                ])
                .collect(),
            Next::Done(Decision::Verify(Knobs::new(9, Precision::Bf16))),
        ),
        // Mispredicted model: the law holds only up to 8 and the guess 9 ran out. The bracket
        // (8, 9) is empty, so bf16 ends at 8.
        (
            [1, 2, 4, 8]
                .map(|b| result(bf16(), b, law(b as u64)))
                .into_iter()
                .chain([
                    result(bf16(), 16, oom()),
                    result(bf16(), 9, oom()),
                    result(ckpt(), 1, oom()),
                ])
                .collect(),
            Next::Done(Decision::Verify(Knobs::new(8, Precision::Bf16))),
        ),
    ];
    for (i, (history, expected)) in table.into_iter().enumerate() {
        assert_eq!(driver.next(&history), expected, "row {i}");
    }
}

#[test]
fn bisects_when_the_model_keeps_missing() {
    // The law turns sharply upward after 8, so the affine fit through 1..8 is optimistic.
    let b = budget(10 * GIB, 0.0);
    let driver = SearchDriver::new(space(vec![bf16()], 1024), MachineFacts::default(), b).unwrap();
    let mut sim = Simulator::with_budget(
        &b,
        1024,
        vec![laws(bf16(), (1024.0, 10.0, 0.0), (0.01, 0.002))],
    );
    let steep = sim.regimes[0].gpu_bytes;
    sim.regimes[0].gpu_bytes = Law {
        quadratic: 2.5 * MIB as f64,
        ..steep
    };
    let outcome = search(&driver, &sim);
    let expected = true_boundary(&sim, &b, bf16(), &driver.space().candidates());
    assert_eq!(outcome.chosen().unwrap().micro_batch, expected);
    let state = driver.regime_states(&outcome.history)[0];
    assert!(
        state.trials <= 2 * log2_floor(expected) + 5,
        "{} trials",
        state.trials
    );
}
