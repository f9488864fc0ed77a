//! Planning from a recorded profile: the recorded plan comes back, and unrecorded trials are
//! predicted or refused by the stated rule.

use super::*;
use crate::knobs::Knobs;
use crate::plan::Plan;
use crate::profile::replay::{Answer, ReplayProber};
use crate::trial::{Measurement, MemoryKind, Outcome, TrialRequest, TrialResult};

/// Runs `driver`'s search with every trial answered by replaying `profile`: the outcome, and
/// how each trial was answered.
fn replay_search(driver: &SearchDriver, profile: Profile) -> (SearchOutcome, Vec<Answer>) {
    let mut replay = ReplayProber::new(profile);
    let mut answers = Vec::new();
    let outcome = run_search(
        driver,
        &mut |r: &TrialRequest| {
            let replayed = replay.replay(r);
            answers.push(replayed.answer);
            Ok(replayed.result)
        },
        &NoReporter,
    )
    .unwrap();
    (outcome, answers)
}

#[test]
fn replaying_a_recording_yields_the_recorded_plan() {
    for space in spaces() {
        let (driver, _, outcome, profile) = recorded(space.clone());
        // Through a file, as `tune --backend replay:P` reads it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        profile.save(&path).unwrap();
        let loaded = Profile::load(&path).unwrap();
        let fresh = loaded.driver().unwrap();
        let (replayed, answers) = replay_search(&fresh, loaded);
        assert_eq!(replayed.decision, outcome.decision, "{space:?}");
        assert!(
            answers.iter().all(|a| *a == Answer::Recorded),
            "{answers:?}"
        );
        let requests = |o: &SearchOutcome| o.history.iter().map(|r| r.request).collect::<Vec<_>>();
        assert_eq!(requests(&replayed), requests(&outcome));

        let plan = |o| Plan::from_search(&driver, o, &model(), &device_profile(), CREATED);
        let (was, now) = (plan(&outcome).unwrap(), plan(&replayed).unwrap());
        assert_eq!(now.knobs, was.knobs);
        assert_eq!(Some(now.knobs), profile.chosen);
        assert_eq!(now.measured.peak_gpu_bytes, was.measured.peak_gpu_bytes);
    }
}

#[test]
fn a_verification_is_answered_by_the_recorded_verification_not_a_remeasurement_of_its_length() {
    let (_, _, _, mut profile) = recorded(spaces().remove(0));
    let search = profile.trials[0].clone();
    let Outcome::Fits(measured) = search.outcome.clone() else {
        panic!("the first recorded trial fits: {search:?}");
    };
    // A remeasurement and a verification of the same knobs with the same steps, the
    // remeasurement first: a recording made by a search that ran it again.
    let steps = 2 * search.request.timed_steps;
    let with = |remeasure: bool, tokens_per_s: f64| TrialResult {
        request: TrialRequest {
            timed_steps: steps,
            remeasure,
            ..search.request
        },
        outcome: Outcome::Fits(Measurement {
            tokens_per_s,
            ..measured
        }),
        ..search.clone()
    };
    let (again, verified) = (with(true, 1.0), with(false, 2.0));
    profile.trials.push(again.clone());
    profile.trials.push(verified.clone());
    let mut replay = ReplayProber::new(profile);
    assert_eq!(replay.answer(&verified.request), verified);
    assert_eq!(replay.answer(&again.request), again);
}

#[test]
fn repeated_requests_are_answered_in_recorded_order() {
    let (_, _, _, mut profile) = recorded(spaces().remove(0));
    let first = profile.trials[0].clone();
    let mut second = first.clone();
    second.outcome = Outcome::OutOfMemory {
        memory: MemoryKind::Gpu,
        phase: crate::trial::Phase::Eval,
    };
    profile.trials.push(second.clone());
    let mut replay = ReplayProber::new(profile);
    assert_eq!(replay.answer(&first.request), first);
    assert_eq!(replay.answer(&first.request), second);
    // Past the recorded ones, the last recorded answers again.
    assert_eq!(replay.answer(&first.request), second);
}

#[test]
fn unrecorded_micro_batches_are_predicted_from_the_fits() {
    // Recorded from micro-batch 1; replayed from 3, which asks other micro-batches. The laws
    // are affine, so the fits are exact and the replay plans as the simulator itself does.
    let (driver, sim, _, profile) = recorded(spaces().remove(0));
    let space = SearchSpace {
        start_micro_batch: 3,
        ..profile.space.clone()
    };
    let other = SearchDriver::new(space, MachineFacts::default(), *driver.budget()).unwrap();
    let direct = run_search(
        &other,
        &mut |r: &TrialRequest| Ok(sim.answer(r)),
        &NoReporter,
    )
    .unwrap();
    let (replayed, answers) = replay_search(&other, profile);
    assert!(answers.contains(&Answer::Predicted), "{answers:?}");
    assert_eq!(replayed.decision, direct.decision);
    for (r, d) in replayed.history.iter().zip(&direct.history) {
        assert_eq!(r.request, d.request);
        assert_eq!(
            r.outcome.measurement().is_some(),
            d.outcome.measurement().is_some()
        );
    }
}

#[test]
fn predicted_trials_cost_their_steps_plus_the_regimes_recorded_overhead() {
    let (_, _, _, mut profile) = recorded(spaces().remove(0));
    // The simulator's trials are all steps; give the recorded ones that fitted a setup cost
    // that grows with the batch (1.0 s, 1.1 s, …) and leave out-of-memory trials as they are.
    let mut added = Vec::new();
    for r in &mut profile.trials {
        if r.outcome.measurement().is_some() && r.request.knobs.regime() == bf16() {
            let overhead = 1.0 + 0.1 * added.len() as f64;
            r.wall_s += overhead;
            added.push(overhead);
        }
    }
    let median = added[added.len() / 2];
    // Out-of-memory trials fail in their first step: a predicted one costs what recorded ones
    // did.
    let mut oom_walls = Vec::new();
    for r in &mut profile.trials {
        if matches!(r.outcome, Outcome::OutOfMemory { .. }) && r.request.knobs.regime() == bf16() {
            r.wall_s = 0.7 + 0.1 * oom_walls.len() as f64;
            oom_walls.push(r.wall_s);
        }
    }
    let smallest_oom = profile
        .trials
        .iter()
        .filter(|r| r.request.knobs.regime() == bf16())
        .filter(|r| matches!(r.outcome, Outcome::OutOfMemory { .. }))
        .map(|r| r.request.knobs.micro_batch)
        .min()
        .expect("bf16 runs out of memory in the fixture");
    let ask = |replay: &mut ReplayProber, micro_batch| {
        replay.replay(&TrialRequest {
            knobs: Knobs::with_batch(bf16(), micro_batch, 1),
            warmup_steps: 1,
            timed_steps: 4,
            remeasure: false,
        })
    };
    let mut replay = ReplayProber::new(profile);
    let fits = ask(&mut replay, 3);
    assert_eq!(fits.answer, Answer::Predicted);
    let m = fits.result.outcome.measurement().expect("3 sequences fit");
    let expected = 5.0 * m.step_time_median_s + median;
    assert!(
        (fits.result.wall_s - expected).abs() < 1e-9,
        "{} vs {expected}",
        fits.result.wall_s
    );
    let oom = ask(&mut replay, smallest_oom + 1);
    assert_eq!(oom.answer, Answer::Predicted);
    assert!(oom.result.outcome.measurement().is_none());
    assert_eq!(oom.result.wall_s, oom_walls[oom_walls.len() / 2]);
}

#[test]
fn predictions_respect_recorded_ooms_and_the_budget() {
    let (_, _, _, profile) = recorded(spaces().remove(0));
    let smallest_oom = profile
        .trials
        .iter()
        .filter(|r| r.request.knobs.regime() == bf16())
        .filter(|r| matches!(r.outcome, Outcome::OutOfMemory { .. }))
        .map(|r| r.request.knobs.micro_batch)
        .min()
        .expect("bf16 runs out of memory in the fixture");
    let ask = |replay: &mut ReplayProber, micro_batch, grad_accum| {
        let knobs = Knobs {
            grad_accum,
            ..Knobs::with_batch(bf16(), micro_batch, 1)
        };
        replay.replay(&TrialRequest {
            knobs,
            warmup_steps: 1,
            timed_steps: 4,
            remeasure: false,
        })
    };
    let mut replay = ReplayProber::new(profile.clone());
    // Above a recorded out-of-memory: out of memory, whatever the model says.
    let above = ask(&mut replay, smallest_oom + 1, 1);
    assert_eq!(above.answer, Answer::Predicted);
    assert!(matches!(above.result.outcome, Outcome::OutOfMemory { .. }));
    // Below it, not recorded: predicted from the fit, with the asked lengths and accumulation.
    let fits = ask(&mut replay, 3, 2);
    assert_eq!(fits.answer, Answer::Predicted);
    let m = fits.result.outcome.measurement().expect("3 sequences fit");
    assert_eq!(m.timed_steps, 4);
    let expected_gpu = 3000.0 * MIB + 3.0 * 1500.0 * MIB;
    assert!((m.peak_gpu_bytes as f64 - expected_gpu).abs() < 2.0);
    assert!((m.step_time_median_s - 2.0 * (0.02 + 3.0 * 0.0045)).abs() < 1e-9);
    // The same knobs with other trial lengths: the recorded trial.
    let recorded = profile.trials[0].request;
    let again = replay.replay(&TrialRequest {
        timed_steps: 99,
        ..recorded
    });
    assert_eq!(again.answer, Answer::SameKnobs);
    assert_eq!(again.result.request.timed_steps, 99);
    assert_eq!(again.result.outcome, profile.trials[0].outcome);
}

#[test]
fn unrecorded_regimes_are_not_in_the_profile() {
    let (_, _, _, profile) = recorded(spaces().remove(0));
    let mut replay = ReplayProber::new(profile);
    let offload = Regime {
        offload: Offload::Optimizer,
        ..bf16()
    };
    let replayed = replay.replay(&TrialRequest {
        knobs: Knobs::with_batch(offload, 4, 1),
        warmup_steps: 2,
        timed_steps: 5,
        remeasure: false,
    });
    assert_eq!(replayed.answer, Answer::NotInProfile);
    match replayed.result.outcome {
        Outcome::Crashed { reason } => assert!(reason.contains("not in the recorded profile")),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_failed_verification_replays_as_failed() {
    // Verification trials as long as search trials repeat the search trial's request; here the
    // first verification fails (its peak lands above the usable bytes), so the recording goes
    // on to another choice. Answering a repeat with the first recorded result would pass it.
    let space = spaces().remove(2);
    let budget = Budget::from_device(&device_profile());
    let sim = simulator(&budget);
    let driver = SearchDriver::new(space.clone(), MachineFacts::default(), budget).unwrap();
    let usable = budget.usable_gpu_bytes().unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut failed_once = false;
    let outcome = run_search(
        &driver,
        &mut |r: &TrialRequest| {
            let mut result = sim.answer(r);
            if !seen.insert(r.knobs) && !failed_once {
                failed_once = true;
                if let Outcome::Fits(m) = &mut result.outcome {
                    m.peak_gpu_bytes = usable + 1;
                }
            }
            Ok(result)
        },
        &NoReporter,
    )
    .unwrap();
    assert!(failed_once);
    let first_choice = recorded(space.clone()).2.chosen();
    assert_ne!(outcome.chosen(), first_choice);
    let device = RecordedDevice::new(device_profile(), "NVIDIA GeForce RTX 4090");
    let profile =
        Profile::from_search(&driver, &outcome, &model(), device, CANDLE_VERSION, CREATED);
    let mut replay = ReplayProber::new(profile);
    let fresh = SearchDriver::new(space, MachineFacts::default(), budget).unwrap();
    let replayed = run_search(
        &fresh,
        &mut |r: &TrialRequest| Ok(replay.answer(r)),
        &NoReporter,
    )
    .unwrap();
    assert_eq!(replayed.decision, outcome.decision);
    assert_eq!(replayed.history, outcome.history);
}

#[test]
fn the_recorded_8b_search_with_its_batch_4_replays_to_batch_4() {
    // Memory not monotone in the batch (the driver's step 6): see search::driver.
    use crate::knobs::Knobs;
    use crate::profile::replay::ReplayProber;
    use crate::search::Decision;
    use crate::trial::{Measurement, MemoryKind, Outcome, Phase, TrialRequest, TrialResult};
    const GIB: u64 = 1 << 30;
    let tried = |outcome: &SearchOutcome| -> Vec<usize> {
        outcome
            .history
            .iter()
            .map(|r| r.request.knobs.micro_batch)
            .collect()
    };
    let chosen = |outcome: &SearchOutcome| match outcome.decision {
        Decision::Chosen(k) => k.micro_batch,
        ref other => panic!("{other:?}"),
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../profiles/recorded/rtx4090-32g-on-h200/llama-3.1-8b.json");
    let mut profile = Profile::load(&path).unwrap();
    // The recording: batch 1 fits (22.15 GiB), batch 2 only above the headroom (23.55 GiB).
    // Measured since on the same card: batch 4 fits below the headroom, 5 and 8 run out.
    let one = profile.trials[1].clone();
    assert_eq!(one.request.knobs.micro_batch, 1);
    let at = |micro_batch: usize, outcome: Outcome| TrialResult {
        request: TrialRequest {
            knobs: Knobs {
                micro_batch,
                ..one.request.knobs
            },
            ..one.request
        },
        outcome,
        ..one.clone()
    };
    let Outcome::Fits(m) = one.outcome else {
        panic!("batch 1 fits")
    };
    let four = Measurement {
        peak_gpu_bytes: (22.68 * GIB as f64) as u64,
        step_time_median_s: 4.0 * 2048.0 / 4416.0,
        tokens_per_s: 4416.0,
        ..m
    };
    let oom = || Outcome::OutOfMemory {
        memory: MemoryKind::Gpu,
        phase: Phase::ForwardBackward,
    };
    profile.trials.push(at(4, Outcome::Fits(four)));
    profile.trials.push(at(8, oom()));
    profile.trials.push(at(5, oom()));
    let driver = profile.driver().unwrap();
    let mut prober = ReplayProber::new(profile.clone());
    let outcome = run_search(&driver, &mut prober, &NoReporter).unwrap();
    assert_eq!(chosen(&outcome), 4, "{:?}", tried(&outcome));
    // Without the batch-4 trial the replay's model predicts 4 out of memory: batch 1 again.
    let mut stale = profile.clone();
    stale.trials.truncate(stale.trials.len() - 3);
    let mut prober = ReplayProber::new(stale.clone());
    let outcome = run_search(&driver, &mut prober, &NoReporter).unwrap();
    assert!(
        tried(&outcome).contains(&4),
        "looked past batch 2: {:?}",
        tried(&outcome)
    );
}
