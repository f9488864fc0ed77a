//! Regression verdicts: noise passes, real changes fail, and re-runs cover every recorded trial.

use std::cell::RefCell;

use super::*;
use crate::profile::check::{check, recheck, Tolerance, Verdict};
use crate::search::{Event, Purpose};
use crate::trial::{Measurement, MemoryKind, Outcome, Phase, TrialResult};

fn fixture() -> Profile {
    recorded(spaces().remove(1)).3
}

/// The profile's trials with `f` applied to every measurement.
fn edited(profile: &Profile, f: impl Fn(&mut Measurement)) -> Vec<TrialResult> {
    let mut fresh = profile.trials.clone();
    for r in &mut fresh {
        if let Outcome::Fits(m) = &mut r.outcome {
            f(m);
        }
    }
    fresh
}

fn fitting(profile: &Profile) -> usize {
    profile
        .trials
        .iter()
        .filter(|r| r.outcome.measurement().is_some())
        .count()
}

#[test]
fn an_unchanged_rerun_passes() {
    let profile = fixture();
    let report = check(&profile, &profile.trials, Tolerance::default());
    assert!(report.passed());
    assert_eq!(
        (report.regressions, report.improvements, report.missing),
        (0, 0, 0)
    );
    assert_eq!(report.settings.len(), profile.trials.len());
    assert!(report
        .settings
        .iter()
        .all(|s| s.verdicts == vec![Verdict::Unchanged]));
}

#[test]
fn ten_percent_more_memory_everywhere_fails() {
    let profile = fixture();
    let fresh = edited(&profile, |m| {
        m.peak_gpu_bytes = m.peak_gpu_bytes * 11 / 10;
    });
    let report = check(&profile, &fresh, Tolerance::default());
    assert!(!report.passed());
    assert_eq!(report.regressions, fitting(&profile));
    for s in report.settings.iter().filter(|s| s.regression) {
        match s.verdicts.as_slice() {
            [Verdict::MoreMemory {
                memory: MemoryKind::Gpu,
                change,
                ..
            }] => assert!((change - 0.1).abs() < 1e-6),
            other => panic!("expected more device memory, got {other:?}"),
        }
    }
    // 1 % (or under 16 MiB) is within the memory tolerance.
    let fresh = edited(&profile, |m| {
        m.peak_gpu_bytes += m.peak_gpu_bytes / 100;
        m.peak_host_bytes += 15 << 20;
    });
    assert!(check(&profile, &fresh, Tolerance::default()).passed());
}

#[test]
fn time_noise_within_the_band_passes_and_a_real_slowdown_fails() {
    let profile = fixture();
    let tolerance = Tolerance::default();
    // Noisy trials (spread 30 %, five steps): an 8 % difference is within the band of
    // 3 · √2 · 1.2533 · 0.3 / 2.5631 / √5 ≈ 28 %.
    let noisy = |m: &mut Measurement| {
        m.step_time_spread = 0.3;
        m.timed_steps = 5;
    };
    let mut recorded = profile.clone();
    recorded.trials = edited(&profile, noisy);
    let fresh = edited(&recorded, |m| m.step_time_median_s *= 1.08);
    assert!(check(&recorded, &fresh, tolerance).passed());
    // Quiet trials: 4 % is below the 5 % floor, 30 % is a regression.
    let mut quiet = profile.clone();
    quiet.trials = edited(&profile, |m| {
        m.step_time_spread = 0.01;
        m.timed_steps = 5;
    });
    let fresh = edited(&quiet, |m| m.step_time_median_s *= 1.04);
    assert!(check(&quiet, &fresh, tolerance).passed());
    let fresh = edited(&quiet, |m| m.step_time_median_s *= 1.3);
    let report = check(&quiet, &fresh, tolerance);
    // A time regression needs its regime to have slowed over at least three settings.
    let mut per_regime = std::collections::HashMap::new();
    for r in profile
        .trials
        .iter()
        .filter(|r| r.outcome.measurement().is_some())
    {
        *per_regime.entry(r.request.knobs.regime()).or_insert(0usize) += 1;
    }
    let countable: usize = per_regime
        .values()
        .filter(|&&n| n >= crate::profile::check::MIN_SETTINGS_FOR_TIME)
        .sum();
    assert!(countable > 0);
    assert_eq!(report.regressions, countable);
    let slower = &report
        .settings
        .iter()
        .find(|s| s.regression)
        .unwrap()
        .verdicts;
    assert!(
        matches!(slower.as_slice(), [Verdict::Slower { change, band, .. }]
            if (change - 0.3).abs() < 1e-9 && (band - 0.05).abs() < 1e-12),
        "{slower:?}"
    );
    // The same 30 % faster is an improvement, not a failure.
    let fresh = edited(&quiet, |m| m.step_time_median_s /= 1.3);
    let report = check(&quiet, &fresh, tolerance);
    assert!(report.passed());
    assert_eq!(report.improvements, fitting(&profile));
}

#[test]
fn outcome_changes_and_missing_trials() {
    let profile = fixture();
    let fits = profile
        .trials
        .iter()
        .position(|r| r.outcome.measurement().is_some())
        .unwrap();
    let oom = profile
        .trials
        .iter()
        .position(|r| matches!(r.outcome, Outcome::OutOfMemory { .. }))
        .unwrap();
    let mut fresh = profile.trials.clone();
    fresh[fits].outcome = Outcome::OutOfMemory {
        memory: MemoryKind::Gpu,
        phase: Phase::Checkpoint,
    };
    fresh[oom].outcome = profile.trials[fits].outcome.clone();
    let dropped = fresh.pop().unwrap();
    let report = check(&profile, &fresh, Tolerance::default());
    assert_eq!(report.regressions, 1);
    assert!(matches!(
        report.settings[fits].verdicts.as_slice(),
        [Verdict::NewlyOom {
            phase: Phase::Checkpoint,
            ..
        }]
    ));
    assert!(matches!(
        report.settings[oom].verdicts.as_slice(),
        [Verdict::NoLongerOom { .. }]
    ));
    assert_eq!(report.improvements, 1);
    let last = report.settings.last().unwrap();
    assert_eq!(last.request, dropped.request);
    assert_eq!(last.verdicts, vec![Verdict::Missing]);
    assert_eq!(report.missing, 1);

    // A crash where it ran before fails the check.
    let mut crashed = profile.trials.clone();
    crashed[fits].outcome = Outcome::Crashed {
        reason: "illegal address".into(),
    };
    assert_eq!(
        check(&profile, &crashed, Tolerance::default()).regressions,
        1
    );
}

#[test]
fn recheck_reruns_every_recorded_trial() {
    let (_, sim, _, profile) = recorded(spaces().remove(1));
    let events = RefCell::new(Vec::new());
    let reporter = |e: &Event| events.borrow_mut().push(e.clone());
    let fresh = recheck(
        &profile,
        &mut |r: &crate::trial::TrialRequest| Ok(sim.answer(r)),
        &reporter,
    )
    .unwrap();
    let requests = |rs: &[TrialResult]| rs.iter().map(|r| r.request).collect::<Vec<_>>();
    assert_eq!(requests(&fresh), requests(&profile.trials));
    let events = events.into_inner();
    assert_eq!(events.len(), 2 * profile.trials.len());
    let verifications = events
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::TrialStarted {
                    purpose: Purpose::Verify,
                    ..
                }
            )
        })
        .count();
    assert_eq!(verifications, 1);
    // The simulator is deterministic, so the re-run passes the check.
    let report = check(&profile, &fresh, Tolerance::default());
    assert!(report.passed());
    // Errors abort the re-run.
    let failing = recheck(
        &profile,
        &mut |_: &crate::trial::TrialRequest| Err(crate::Error::invalid("probe", "x", "fails")),
        &NoReporter,
    );
    assert!(failing.is_err());
}

#[test]
fn reports_and_tolerances_serialise() {
    let profile = fixture();
    let fresh = edited(&profile, |m| m.peak_host_bytes *= 2);
    let report = check(&profile, &fresh, Tolerance::default());
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["regressions"], report.regressions);
    let first = &json["settings"][0];
    assert_eq!(first["verdicts"][0]["verdict"], "more_memory");
    assert_eq!(first["verdicts"][0]["memory"], "host");
    assert_eq!(json["tolerance"]["memory_floor_bytes"], 64 << 20);

    let bad = Tolerance {
        time_threshold: -0.1,
        ..Tolerance::default()
    };
    assert!(bad.validate().is_err());
    Tolerance::default().validate().unwrap();
}

#[test]
fn one_noisy_setting_is_not_a_regression_but_a_whole_regime_slowing_is() {
    let profile = fixture();
    // One setting 40 % slower with a tight spread: flagged, but its regime did not slow.
    let target = profile
        .trials
        .iter()
        .position(|r| r.outcome.measurement().is_some())
        .unwrap();
    let mut fresh = profile.trials.clone();
    if let Outcome::Fits(m) = &mut fresh[target].outcome {
        m.step_time_median_s *= 1.4;
        m.step_time_spread = 0.001;
    }
    let report = check(&profile, &fresh, Tolerance::default());
    assert!(matches!(
        report.settings[target].verdicts[0],
        Verdict::Slower { .. }
    ));
    assert!(report.passed(), "a lone outlier fails the check");

    // Every setting 20 % slower: the regime's median moved, the check fails.
    let fresh = edited(&profile, |m| {
        m.step_time_median_s *= 1.2;
        m.step_time_spread = 0.001;
    });
    assert!(!check(&profile, &fresh, Tolerance::default()).passed());
}

#[test]
fn a_setting_recorded_inside_the_headroom_may_flip_to_out_of_memory() {
    let mut profile = fixture();
    let target = profile
        .trials
        .iter()
        .position(|r| r.outcome.measurement().is_some())
        .unwrap();
    let oom = Outcome::OutOfMemory {
        memory: MemoryKind::Gpu,
        phase: Phase::ForwardBackward,
    };
    let mut fresh = profile.trials.clone();
    fresh[target].outcome = oom.clone();
    // Recorded below the usable bytes: a real regression.
    assert!(!check(&profile, &fresh, Tolerance::default()).passed());
    // Recorded inside the headroom (above the usable bytes): fragmentation decides; not counted.
    let gpu = profile.budget.gpu_bytes.unwrap();
    if let Outcome::Fits(m) = &mut profile.trials[target].outcome {
        m.peak_gpu_bytes = gpu - gpu / 100;
    }
    let report = check(&profile, &fresh, Tolerance::default());
    assert!(matches!(
        report.settings[target].verdicts[0],
        Verdict::NewlyOom { .. }
    ));
    assert!(report.passed());
}
