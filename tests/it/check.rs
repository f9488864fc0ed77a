//! `autotune check` end to end on the CPU: a live re-run of a recorded profile passes, a
//! replayed slowdown fails with exit 1, and a file that is not a profile exits 2 naming it.

use std::path::Path;

use serde_json::Value;

use autotune::plan::Plan;
use autotune::profile::record::{Profile, RecordedDevice};
use autotune::search::space::SearchSpace;
use autotune::trial::Outcome;

use crate::util::{autotune_in, stderr, stdout};

/// A model small enough that a CPU trial takes milliseconds.
const MICRO: &str = r#"{"preset": "tiny", "name": "micro", "d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 32}"#;

/// Tunes the micro model over micro-batches up to 32 (all far inside the host memory), growing
/// to the top so that each regime has several compute-bound trials, and records the trials as a
/// profile at `dir/profile.json`.
fn record(dir: &Path) -> Profile {
    std::fs::write(dir.join("micro.json"), MICRO).unwrap();
    let out = autotune_in(
        dir,
        &[
            "tune",
            "--model",
            "micro.json",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--max-micro-batch",
            "32",
            "--saturation-gain",
            "0",
            "--out",
            "plan.json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan = Plan::load(&dir.join("plan.json")).unwrap();
    let profile = Profile::from_json(
        &serde_json::json!({
            "schema_version": 1,
            "kind": "autotune-profile",
            "tool": plan.tool,
            "candle_version": autotune::backend::CANDLE_VERSION,
            "device": RecordedDevice::new(plan.device.clone(), "cpu"),
            "model": plan.model,
            "budget": plan.budget,
            "space": SearchSpace::new(vec![plan.knobs.regime()]),
            "created_unix_s": plan.created_unix_s,
            "probes": plan.evidence,
            "chosen": plan.knobs,
        })
        .to_string(),
    )
    .unwrap();
    profile.save(&dir.join("profile.json")).unwrap();
    profile
}

#[test]
fn a_live_rerun_of_a_recording_passes() {
    let dir = tempfile::tempdir().unwrap();
    let profile = record(dir.path());
    // Step times of millisecond CPU trials in a busy test run are not what this checks.
    let out = autotune_in(
        dir.path(),
        &[
            "check",
            "--profile",
            "profile.json",
            "--time-tolerance",
            "100",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).expect("one JSON document");
    assert_eq!(report["passed"], true);
    assert_eq!(report["regressions"], 0);
    assert_eq!(
        report["settings"].as_array().unwrap().len(),
        profile.trials.len()
    );
    assert!(stderr(&out).contains(&format!("[{n}/{n}]", n = profile.trials.len())));
}

#[test]
fn a_replayed_slowdown_fails_with_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let profile = record(dir.path());
    let mut slower = profile.clone();
    for r in &mut slower.trials {
        if let Outcome::Fits(m) = &mut r.outcome {
            m.step_time_median_s *= 1.5;
            m.step_time_spread = 0.0;
        }
    }
    slower.save(&dir.path().join("slower.json")).unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "check",
            "--profile",
            "profile.json",
            "--backend",
            "replay:slower.json",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(table.contains("SLOWER +50.0%"), "{table}");
    // Against itself, a replay changes nothing.
    let out = autotune_in(
        dir.path(),
        &[
            "check",
            "--profile",
            "profile.json",
            "--backend",
            "replay:profile.json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_file_that_is_not_a_profile_exits_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello.json"), r#"{"hello": 1}"#).unwrap();
    let out = autotune_in(dir.path(), &["check", "--profile", "hello.json"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("hello.json") && err.contains("not an autotune profile"),
        "{err}"
    );
    std::fs::write(
        dir.path().join("cut.json"),
        r#"{"schema_version": 1, "kind": "#,
    )
    .unwrap();
    let out = autotune_in(dir.path(), &["check", "--profile", "cut.json"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("cut.json") && err.contains("truncated"),
        "{err}"
    );
}
