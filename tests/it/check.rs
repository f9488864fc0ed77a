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
            "--target",
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

/// `check --profile profile.json --backend replay:OTHER`.
fn check_against(dir: &Path, other: &Profile) -> std::process::Output {
    other.save(&dir.join("other.json")).unwrap();
    autotune_in(
        dir,
        &[
            "check",
            "--profile",
            "profile.json",
            "--backend",
            "replay:other.json",
        ],
    )
}

/// Writes `profile` as JSON with `edit` applied (bypassing the writer's own checks).
fn write_edited(dir: &Path, name: &str, profile: &Profile, edit: impl Fn(&mut Value)) {
    let mut value = serde_json::to_value(profile).unwrap();
    edit(&mut value);
    std::fs::write(dir.join(name), value.to_string()).unwrap();
}

#[test]
fn check_refuses_what_it_cannot_compare_and_reports_missing_settings_as_missing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let profile = record(d);
    let fits = profile
        .trials
        .iter()
        .position(|t| matches!(t.outcome, Outcome::Fits(_)))
        .unwrap();
    let refused = |name: &str, needle: &str| {
        let out = autotune_in(
            d,
            &[
                "check",
                "--profile",
                name,
                "--backend",
                "replay:profile.json",
            ],
        );
        assert_eq!(out.status.code(), Some(2), "{name}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{name}: {}", stderr(&out));
    };
    write_edited(d, "empty.json", &profile, |v| {
        v["probes"] = serde_json::json!([])
    });
    refused("empty.json", "holds no trials");
    write_edited(d, "huge.json", &profile, |v| {
        v["probes"][fits]["step_time_median_s"] = 1e308.into()
    });
    refused("huge.json", &format!("probes[{fits}].step_time_median_s"));
    write_edited(d, "negative.json", &profile, |v| {
        v["probes"][fits]["step_time_median_s"] = (-0.5).into()
    });
    refused("negative.json", "step_time_median_s");
    // A profile whose model was edited after recording measured another model.
    let mut sealed = profile.clone();
    sealed.spec_hash = Some(autotune::profile::record::spec_hash(
        &sealed.model,
        &sealed.device.target,
    ));
    write_edited(d, "edited.json", &sealed, |v| {
        v["model"]["n_layers"] = 3.into()
    });
    refused("edited.json", "spec_hash");

    // A recording of another model is not compared.
    let mut other_model = profile.clone();
    other_model.model.n_layers += 1;
    let out = check_against(d, &other_model);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("another model spec (n_layers"),
        "{}",
        stderr(&out)
    );

    // Settings the other recording lacks are missing, not crashed; the rest still compare.
    let mut fewer = profile.clone();
    let dropped = fewer.trials.remove(fits).request.knobs;
    fewer.trials.retain(|t| t.request.knobs != dropped);
    let out = check_against(d, &fewer);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table.contains("missing") && !table.contains("CRASHED"),
        "{table}"
    );
    // A check that compared nothing has not passed.
    let mut none = profile.clone();
    for t in &mut none.trials {
        t.request.knobs.micro_batch += 1000;
    }
    let out = check_against(d, &none);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("could be compared"),
        "{}",
        stderr(&out)
    );
}
