//! Checks under timing noise: twenty seeded re-runs of an unchanged build pass against a
//! recording made under the same noise, and a real slowdown fails every one of them.

use super::*;
use crate::profile::check::{check, recheck, Tolerance};
use crate::search::sim::{Scatter, Scattered};
use crate::trial::{Outcome, Prober, TrialRequest, TrialResult};

/// Trials scatter by 4 % from one run to the next, and their steps by 10 % more: as a busy
/// two-core CPU does.
const SCATTER: Scatter = Scatter {
    between_trials: 0.04,
    within_trial: 0.10,
};

/// The fixture's search (with the saturation stop) recorded under noise from `seed`.
fn recorded_under_noise(seed: u64) -> (Simulator, Profile) {
    let budget = Budget::from_device(&device_profile());
    let sim = simulator(&budget);
    let space = spaces().remove(3);
    let driver = SearchDriver::new(space, MachineFacts::default(), budget).unwrap();
    let mut prober = Scattered::new(sim.clone(), SCATTER, seed);
    let outcome = run_search(&driver, &mut prober, &NoReporter).unwrap();
    let device = RecordedDevice::new(device_profile(), "NVIDIA GeForce RTX 4090");
    let profile =
        Profile::from_search(&driver, &outcome, &model(), device, CANDLE_VERSION, CREATED);
    (sim, profile)
}

/// Regressions a check of `profile` finds with fresh trials from `prober`.
fn regressions(profile: &Profile, prober: &mut dyn Prober, tolerance: Tolerance) -> usize {
    let fresh = recheck(profile, prober, &NoReporter).unwrap();
    check(profile, &fresh, tolerance).regressions
}

/// `prober`'s answers with every step `factor` times as long.
fn slowed(
    mut prober: Scattered,
    factor: f64,
) -> impl FnMut(&TrialRequest) -> crate::Result<TrialResult> {
    move |request: &TrialRequest| {
        let mut result = prober.probe(request)?;
        if let Outcome::Fits(m) = &mut result.outcome {
            m.step_time_median_s *= factor;
            m.tokens_per_s /= factor;
        }
        Ok(result)
    }
}

#[test]
fn twenty_checks_of_an_unchanged_build_pass_and_a_slower_one_fails_every_time() {
    // The regime's median change over the threshold alone, without its own noise.
    let threshold_only = Tolerance {
        significance_z: 0.0,
        ..Tolerance::default()
    };
    let mut failed_on_threshold_only = 0;
    for seed in 0..20 {
        let (sim, profile) = recorded_under_noise(seed);
        let fresh = || Scattered::new(sim.clone(), SCATTER, 1000 + seed);
        assert_eq!(
            regressions(&profile, &mut fresh(), Tolerance::default()),
            0,
            "seed {seed}: an unchanged build regressed"
        );
        failed_on_threshold_only +=
            usize::from(regressions(&profile, &mut fresh(), threshold_only) > 0);
        assert!(
            regressions(&profile, &mut slowed(fresh(), 1.25), Tolerance::default()) > 0,
            "seed {seed}: 25 % slower passed"
        );
    }
    // This noise is what the significance of the median is for: without it, 6 of the 20
    // unchanged builds failed.
    assert!(failed_on_threshold_only > 0);
}
