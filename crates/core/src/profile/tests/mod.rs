//! Recorded profiles against simulated searches. This file: the shared fixture. `record`: the
//! file format; `replay`: planning from a profile; `check`: regression verdicts and re-runs.

use crate::knobs::{Checkpointing, Offload, Precision, Regime};
use crate::profile::record::{Profile, RecordedDevice};
use crate::search::sim::{Law, SimRegime, Simulator};
use crate::search::{
    run_search, MachineFacts, NoReporter, SearchDriver, SearchOutcome, SearchSpace,
};
use crate::spec::budget::Budget;
use crate::spec::device::DeviceSpec;
use crate::spec::model::ModelSpec;

mod check;
mod noise;
mod record;
mod replay;

const MIB: f64 = (1u64 << 20) as f64;

/// When the fixture's profiles were "recorded".
const CREATED: u64 = 1_767_225_600;

/// The backend release the test profiles claim to have been recorded on.
const CANDLE_VERSION: &str = "0.11.1";

fn bf16() -> Regime {
    Regime {
        precision: Precision::Bf16,
        checkpointing: Checkpointing::None,
        offload: Offload::None,
        data_parallel: crate::knobs::DataParallel::SINGLE,
        update: Default::default(),
        state: Default::default(),
    }
}

fn ckpt() -> Regime {
    Regime {
        checkpointing: Checkpointing::EveryKth(1),
        ..bf16()
    }
}

fn model() -> ModelSpec {
    ModelSpec::preset("gpt-124m").unwrap()
}

/// The 4090 profile with bf16 and bf16 + full recompute following affine laws: bf16 runs out of
/// memory within the candidates, recompute is slower per sequence but far smaller.
fn simulator(budget: &Budget) -> Simulator {
    let law = |regime, per_sample_mib: f64, per_sample_s: f64| SimRegime {
        regime,
        gpu_bytes: Law::affine(3000.0 * MIB, per_sample_mib * MIB),
        host_bytes: Law::affine(4000.0 * MIB, 0.0),
        step_time_s: Law::affine(0.02, per_sample_s),
    };
    Simulator {
        accumulation_gpu_bytes: 64 << 20,
        ..Simulator::with_budget(
            budget,
            model().seq_len,
            vec![law(bf16(), 1500.0, 0.0045), law(ckpt(), 250.0, 0.006)],
        )
    }
}

fn device_profile() -> DeviceSpec {
    DeviceSpec::builtin("rtx4090-32g").unwrap()
}

/// The search spaces the fixture records: plain, with a global batch (the verification
/// accumulates), and with verification trials as long as search trials (so the verification
/// repeats a search trial's exact request).
fn spaces() -> Vec<SearchSpace> {
    let plain = SearchSpace {
        saturation_gain: 0.0,
        ..SearchSpace::new(vec![bf16(), ckpt()])
    };
    vec![
        plain.clone(),
        SearchSpace {
            global_batch: Some(96),
            max_micro_batch: 40,
            ..plain.clone()
        },
        SearchSpace {
            verify_timed_steps: plain.timed_steps,
            ..plain.clone()
        },
        SearchSpace {
            saturation_gain: SearchSpace::DEFAULT_SATURATION_GAIN,
            ..plain
        },
    ]
}

/// A simulated search over `space` on the 4090 profile, and its recorded profile.
fn recorded(space: SearchSpace) -> (SearchDriver, Simulator, SearchOutcome, Profile) {
    recorded_with(space, MachineFacts::default())
}

/// [`recorded`], with the search knowing `facts`.
fn recorded_with(
    space: SearchSpace,
    facts: MachineFacts,
) -> (SearchDriver, Simulator, SearchOutcome, Profile) {
    let budget = Budget::from_device(&device_profile());
    let sim = simulator(&budget);
    let driver = SearchDriver::new(space, facts, budget).unwrap();
    let outcome = run_search(
        &driver,
        &mut |r: &crate::trial::TrialRequest| Ok(sim.answer(r)),
        &NoReporter,
    )
    .unwrap();
    let device = RecordedDevice {
        memory_bytes: Some(24564 << 20),
        driver: Some("570.86".into()),
        cuda: Some("12.8".into()),
        ..RecordedDevice::new(device_profile(), "NVIDIA GeForce RTX 4090")
    };
    let profile =
        Profile::from_search(&driver, &outcome, &model(), device, CANDLE_VERSION, CREATED);
    (driver, sim, outcome, profile)
}
