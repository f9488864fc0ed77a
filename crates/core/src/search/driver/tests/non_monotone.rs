//! Memory that does not grow with the micro-batch everywhere: a boundary set only by a fit
//! above the headroom gets one trial past it (step 6 of the strategy), and the driver reaches
//! the true best batch through a dip, not past a spike or a real out-of-memory.

use super::*;

/// A simulated device whose peaks follow `law` except at the micro-batches `bumps` lists, which
/// peak at the given MiB instead (a dip or a spike of the memory pool).
fn bumpy(
    b: Budget,
    law: SimRegime,
    bumps: &'static [(usize, f64)],
) -> impl FnMut(&TrialRequest) -> crate::Result<TrialResult> {
    let sim = Simulator::with_budget(&b, 2048, vec![law]);
    move |request: &TrialRequest| {
        let mut result = sim.answer(request);
        let bump = bumps
            .iter()
            .find(|(mb, _)| *mb == request.knobs.micro_batch);
        if let (Some((_, mib)), Outcome::Fits(m)) = (bump, &mut result.outcome) {
            m.peak_gpu_bytes = (*mib * MIB as f64) as u64;
        }
        Ok(result)
    }
}

fn run(b: Budget, law: SimRegime, bumps: &'static [(usize, f64)]) -> SearchOutcome {
    let driver = SearchDriver::new(space(vec![ckpt()], 64), MachineFacts::default(), b).unwrap();
    let outcome = run_search(&driver, &mut bumpy(b, law, bumps), &NoReporter).unwrap();
    check_invariants(&driver, &outcome);
    outcome
}

fn tried(outcome: &SearchOutcome) -> Vec<usize> {
    outcome
        .history
        .iter()
        .map(|r| r.request.knobs.micro_batch)
        .collect()
}

fn chosen(outcome: &SearchOutcome) -> usize {
    match outcome.decision {
        Decision::Chosen(k) => k.micro_batch,
        ref other => panic!("{other:?}"),
    }
}

/// 24 GiB with 5 % headroom (23,347 MiB usable); 22,000 MiB fixed and 150 MiB a sequence:
/// micro-batches up to 8 fit the headroom, 9 to 17 only the device.
fn card() -> (Budget, SimRegime) {
    (
        budget(24 * GIB, 0.05),
        laws(ckpt(), (22_000.0, 150.0, 0.0), (0.2, 0.1)),
    )
}

#[test]
fn a_spike_above_the_headroom_is_looked_past_and_the_true_best_batch_found() {
    // Batch 2 peaks above the headroom, as llama-3.1-8b's did: batch 4 fits below it.
    let (b, law) = card();
    let outcome = run(b, law, &[(2, 23_600.0)]);
    assert_eq!(&tried(&outcome)[..3], [1, 2, 4]);
    assert_eq!(chosen(&outcome), 8, "{:?}", tried(&outcome));
}

#[test]
fn a_real_boundary_above_the_headroom_costs_one_trial_and_stands() {
    // 150 MiB a sequence from 23,100: 1 fits, 2 is above the headroom, and so is 4.
    let b = budget(24 * GIB, 0.05);
    let law = laws(ckpt(), (23_100.0, 150.0, 0.0), (0.2, 0.1));
    let outcome = run(b, law, &[]);
    assert_eq!(
        tried(&outcome),
        [1, 2, 4, 1],
        "the extra trial, then the verification"
    );
    assert_eq!(chosen(&outcome), 1);
}

#[test]
fn an_out_of_memory_is_believed_without_a_trial_past_it() {
    // 1 fits; 2 runs out of the device (the law: 3,000 MiB a sequence).
    let b = budget(24 * GIB, 0.05);
    let law = laws(ckpt(), (20_000.0, 3_000.0, 0.0), (0.2, 0.1));
    let outcome = run(b, law, &[]);
    assert_eq!(tried(&outcome), [1, 2, 1]);
    assert_eq!(chosen(&outcome), 1);
}

#[test]
fn a_dip_met_while_growing_is_kept_and_an_out_of_memory_closes_the_regime() {
    // 400 MiB a sequence: up to 3 fit the headroom, 4 and 5 only the device, 6 runs out of it;
    // batch 4 dips below the headroom. Growth meets 4 first: the dip is found and kept, and
    // the out-of-memory at 8 closes the regime without a trial past it.
    let b = budget(24 * GIB, 0.05);
    let law = laws(ckpt(), (22_100.0, 400.0, 0.0), (0.2, 0.1));
    let outcome = run(b, law, &[(4, 23_000.0)]);
    assert_eq!(chosen(&outcome), 4, "{:?}", tried(&outcome));
    assert!(!tried(&outcome).contains(&16), "{:?}", tried(&outcome));
}

#[test]
fn a_boundary_in_line_with_the_growth_below_it_stands_without_a_trial_past_it() {
    // 180 MiB a sequence from 22,000: 7 fits the headroom, 8 only the device, and growth met 8
    // first. The step from 7 to 8 is the slope below 7: 16 is never tried.
    let b = budget(24 * GIB, 0.05);
    let law = laws(ckpt(), (22_000.0, 180.0, 0.0), (0.2, 0.1));
    let outcome = run(b, law, &[]);
    assert_eq!(chosen(&outcome), 7, "{:?}", tried(&outcome));
    assert!(!tried(&outcome).contains(&16), "{:?}", tried(&outcome));
    assert_eq!(tried(&outcome).iter().max(), Some(&8));
}
