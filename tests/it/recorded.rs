//! The GPU recordings committed under `profiles/recorded/`: offline replays reproduce the plans
//! chosen on the GPU, and the GPU re-runs of a recording pass its check.

use std::path::{Path, PathBuf};

use serde_json::Value;

use autotune::profile::check::{check, Tolerance};
use autotune::profile::record::Profile;
use autotune::profile::replay::{Answer, ReplayProber};
use autotune::search::{run_search, NoReporter};
use autotune::trial::{Outcome, TrialRequest, TrialResult};

use crate::util::{autotune, stderr, stdout};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The seed recorded with the earlier (autograd-based, fused) engine, which the two GPU
/// re-runs below were checked against.
const FUSED_ENGINE_SEED: &str = "profiles/recorded/rtx4090-32g-on-h200/fused-engine/seed.json";

/// Every committed recording: the fused engine's, the explicit engine's with materialised
/// attention, flash attention's with trials in child processes, and the current ones (the
/// padded vocabulary head, trials in a worker, offload pruned by the measured host floor, the
/// memory pool reusing memory in stream order only), and the big models' (gpt-1.3b without
/// offload and its brackets left open once converged, gpt-2b with the streamed offload, its
/// trials retimed for the target's link, llama-3.2-1b).
const RECORDINGS: [&str; 11] = [
    FUSED_ENGINE_SEED,
    "profiles/recorded/rtx4090-32g-on-h200/fused-engine/gpt-124m.json",
    "profiles/recorded/rtx4090-32g-on-h200/explicit-materialized/seed.json",
    "profiles/recorded/rtx4090-32g-on-h200/explicit-materialized/gpt-124m.json",
    "profiles/recorded/rtx4090-32g-on-h200/child-trials/seed.json",
    "profiles/recorded/rtx4090-32g-on-h200/child-trials/gpt-124m.json",
    "profiles/recorded/rtx4090-32g-on-h200/seed.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-124m.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-1.3b.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-2b.json",
    "profiles/recorded/rtx4090-32g-on-h200/llama-3.2-1b.json",
];

/// Replays a recording's search in this process: how each trial was answered, and the knobs
/// the search chose.
fn replay_answers(profile: &Profile) -> (Vec<Answer>, Option<autotune::Knobs>) {
    let driver = profile.driver().unwrap();
    let mut replay = ReplayProber::new(profile.clone());
    let mut answers = Vec::new();
    let outcome = run_search(
        &driver,
        &mut |r: &TrialRequest| {
            let replayed = replay.replay(r);
            answers.push(replayed.answer);
            Ok(replayed.result)
        },
        &NoReporter,
    )
    .unwrap();
    (answers, outcome.chosen())
}

/// The recordings made by a search that asked the same trials as the search asks now: a replay
/// of one asks exactly the trials the GPU ran, in the same order.
const CURRENT_SEARCH: [&str; 8] = [
    "profiles/recorded/rtx4090-32g-on-h100/llama-3.1-8b.json",
    GLOBAL_BATCH_32,
    "profiles/recorded/rtx4090-32g-on-h200/child-trials/seed.json",
    "profiles/recorded/rtx4090-32g-on-h200/seed.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-124m.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-1.3b.json",
    "profiles/recorded/rtx4090-32g-on-h200/gpt-2b.json",
    "profiles/recorded/rtx4090-32g-on-h200/llama-3.2-1b.json",
];

/// gpt-1.3b tuned for 32 sequences a step: every accumulated plan it verified ran out of memory
/// (its facts did not yet say what accumulation adds).
const GLOBAL_BATCH_32: &str = "profiles/recorded/rtx4090-32g-on-h100/gpt-1.3b-global-batch-32.json";

/// Recordings of a search that refined brackets the search now leaves open once they have
/// converged (see the driver's "Convergence"): a replay asks only trials the GPU ran, fewer of
/// them, and chooses the same plan. The older ones were recorded by an earlier search, which
/// asked other micro-batches, so a replay of them is answered partly from their fitted models.
const CONVERGED_EARLIER: [&str; 1] =
    ["profiles/recorded/rtx4090-32g-on-h200/child-trials/gpt-124m.json"];

#[test]
fn a_replay_asks_only_the_trials_the_gpu_ran() {
    for recording in CURRENT_SEARCH.into_iter().chain(CONVERGED_EARLIER) {
        let profile = Profile::load(&repo(recording)).unwrap();
        let (answers, chosen) = replay_answers(&profile);
        if CURRENT_SEARCH.contains(&recording) {
            assert_eq!(answers.len(), profile.trials.len(), "{recording}");
        } else {
            assert!(answers.len() < profile.trials.len(), "{recording}");
        }
        assert!(
            answers.iter().all(|a| *a == Answer::Recorded),
            "{recording}: a trial the GPU search did not run: {answers:?}"
        );
        assert_eq!(chosen, profile.chosen, "{recording}");
    }
}

#[test]
fn replaying_a_gpu_recording_yields_the_plan_chosen_on_the_gpu() {
    for recording in RECORDINGS {
        let path = repo(recording);
        let profile = Profile::load(&path).unwrap();
        let chosen = profile.chosen.expect("the recorded search chose a plan");
        let backend = format!("replay:{}", path.display());
        let out = autotune(&["tune", "--backend", &backend, "--json"]);
        assert_eq!(out.status.code(), Some(0), "{recording}: {}", stderr(&out));
        let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(
            plan["knobs"],
            serde_json::to_value(chosen).unwrap(),
            "{recording}"
        );
        assert_eq!(plan["device"]["name"], "rtx4090-32g");
    }
}

/// The gpt-1.3b search for 32 sequences a step, told what accumulation adds by the estimate as
/// a search on the GPU is now: it verifies no accumulated plan that runs out of memory, chooses
/// the plan the GPU search chose, in fewer trials, and its plan names what it ruled out.
#[test]
fn told_what_accumulation_adds_the_global_batch_search_verifies_no_plan_that_cannot_fit() {
    use autotune::search::{Decision, SearchDriver, SearchSetup, SpaceRequest};
    let profile = Profile::load(&repo(GLOBAL_BATCH_32)).unwrap();
    let recorded_failures = profile
        .trials
        .iter()
        .filter(|r| r.request.knobs.grad_accum > 1 && r.outcome.measurement().is_none())
        .count();
    assert_eq!(recorded_failures, 5);
    // The space and facts a search on the GPU resolves today for the same request.
    let request = SpaceRequest {
        global_batch: Some(32),
        ..SpaceRequest::default()
    };
    let runtime = autotune::search::Runtime {
        flash_head_dims: &autotune::ops::FLASH_HEAD_DIMS,
        host_adam_floor_s: &|_| profile.facts.offload_host_floor_s,
        own_engine: true,
    };
    let target = &profile.device.target;
    let setup =
        SearchSetup::resolve(&profile.model, target, &profile.budget, &request, &runtime).unwrap();
    assert_eq!(setup.space, profile.space);
    let facts = autotune::search::MachineFacts {
        accumulation_extra: setup.facts.accumulation_extra.clone(),
        ..profile.facts.clone()
    };
    assert_eq!(facts, setup.facts);
    let driver = SearchDriver::new(profile.space.clone(), facts, profile.budget).unwrap();
    let mut replay = ReplayProber::new(profile.clone());
    let outcome = run_search(
        &driver,
        &mut |r: &TrialRequest| Ok(replay.replay(r).result),
        &NoReporter,
    )
    .unwrap();
    let failed = outcome
        .history
        .iter()
        .filter(|r| r.request.knobs.grad_accum > 1 && !driver.is_feasible(r))
        .count();
    assert_eq!(failed, 0);
    assert_eq!(outcome.decision, Decision::Chosen(profile.chosen.unwrap()));
    // 12 trials against the recording's 24.
    assert!(outcome.history.len() <= profile.trials.len() / 2);
    // Without checkpointing and with it, one sequence a micro-batch already peaked at 21.99
    // GiB, and 32 of them a step add 2.0 and 0.9 GiB by the estimate (usable: 22.79 GiB): no
    // larger micro-batch, whose plan accumulates more per sequence, was tried.
    let ruled_out: Vec<(usize, usize)> = driver
        .accumulation_ruled_out(&outcome.history)
        .iter()
        .map(|r| (r.knobs.micro_batch, r.knobs.grad_accum))
        .collect();
    assert_eq!(ruled_out, [(1, 32), (1, 32)]);
    plan_names_what_was_ruled_out(&driver, &outcome, &profile);
}

/// The plan of `outcome` says which settings accumulation ruled out, in the published schema,
/// and reads back.
fn plan_names_what_was_ruled_out(
    driver: &autotune::search::SearchDriver,
    outcome: &autotune::search::SearchOutcome,
    profile: &Profile,
) {
    let plan = autotune::plan::Plan::from_search(
        driver,
        outcome,
        &profile.model,
        &profile.device.target,
        0,
    )
    .unwrap();
    assert_eq!(
        plan.ruled_out,
        driver.accumulation_ruled_out(&outcome.history)
    );
    let json: Value = serde_json::from_str(&plan.to_json()).unwrap();
    let schema = crate::util::published_schema("plan.schema.json");
    assert_eq!(
        crate::util::schema_violations(&schema, &json),
        Vec::<String>::new()
    );
    assert_eq!(
        json["ruled_out"][0]["measured_gpu_bytes"],
        23_611_637_760_u64
    );
    assert_eq!(
        autotune::plan::Plan::from_json(&plan.to_json()).unwrap(),
        plan
    );
}

/// The committed recordings are of schema version 1, whose space held the machine's facts:
/// they load with those facts moved whole into `facts`, and the gpt-2b recording (offload
/// pruned by the host floor, its trials retimed for the target's link) keeps both.
#[test]
fn version_1_recordings_load_with_their_facts_moved_out_of_the_space() {
    for recording in RECORDINGS {
        let path = repo(recording);
        let raw: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(raw["schema_version"], 1, "{recording}");
        let profile = Profile::load(&path).unwrap();
        let facts = serde_json::to_value(&profile.facts).unwrap();
        for field in autotune::search::MachineFacts::FIELDS {
            let recorded = raw["space"].get(field).cloned().unwrap_or(Value::Null);
            let moved = facts.get(field).cloned().unwrap_or(Value::Null);
            assert_eq!(moved, recorded, "{recording}: {field}");
        }
        let space = serde_json::to_value(&profile.space).unwrap();
        assert!(space.get("memory_prior").is_none(), "{recording}");
    }
    let gpt_2b = Profile::load(&repo("profiles/recorded/rtx4090-32g-on-h200/gpt-2b.json")).unwrap();
    assert!(gpt_2b.facts.offload_host_floor_s.is_some());
    assert_eq!(gpt_2b.facts.target_link_gbps, Some(25.0));
}

/// The fresh trials of a `check --json` report made on the GPU.
fn rerun(report: &str) -> Vec<TrialResult> {
    let text = std::fs::read_to_string(repo(report)).unwrap();
    let report: Value = serde_json::from_str(&text).unwrap();
    report["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| TrialResult {
            request: serde_json::from_value::<TrialRequest>(s["request"].clone()).unwrap(),
            outcome: serde_json::from_value::<Outcome>(s["now"].clone()).unwrap(),
            wall_s: 0.0,
        })
        .collect()
}

#[test]
fn two_gpu_reruns_of_a_recording_pass_and_injected_growth_fails() {
    let profile = Profile::load(&repo(FUSED_ENGINE_SEED)).unwrap();
    for report in [
        "tests/fixtures/check/seed.check1.json",
        "tests/fixtures/check/seed.check2.json",
    ] {
        let fresh = rerun(report);
        let result = check(&profile, &fresh, Tolerance::default());
        let failing: Vec<_> = result
            .settings
            .iter()
            .filter(|s| s.regression)
            .map(|s| &s.verdicts)
            .collect();
        assert!(
            result.passed(),
            "{report}: noise flagged as regression: {failing:?}"
        );

        let grown: Vec<TrialResult> = fresh
            .into_iter()
            .map(|mut r| {
                if let Outcome::Fits(m) = &mut r.outcome {
                    m.peak_gpu_bytes = m.peak_gpu_bytes * 11 / 10;
                }
                r
            })
            .collect();
        assert!(
            !check(&profile, &grown, Tolerance::default()).passed(),
            "{report}: 10 % growth passed"
        );
    }
}
