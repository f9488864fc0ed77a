//! Big numbers get an answer, never a crash: a size that cannot be allocated or indexed is
//! exit 2 naming the field or flag, and a model too large for the budget is exit 1.

use std::path::{Path, PathBuf};

use crate::util::{assert_refused, autotune, autotune_in, stderr, stdout};

const U64_MAX: &str = "18446744073709551615";

/// A plan from a committed recording (a replay: no trial runs).
fn recorded_plan(dir: &Path) -> PathBuf {
    let recording = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("profiles/recorded/rtx4090-32g-on-h200/seed.json");
    let path = dir.join("plan.json");
    let backend = format!("replay:{}", recording.display());
    let out = autotune(&[
        "tune",
        "--backend",
        &backend,
        "--out",
        path.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    path
}

#[test]
fn huge_flag_values_are_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert_refused(
        d,
        &["train", "--micro-batch", U64_MAX, "--steps", "1"],
        "--micro-batch",
    );
    assert_refused(
        d,
        &["train", "--grad-accum", U64_MAX, "--steps", "1"],
        "--grad-accum",
    );
    assert_refused(
        d,
        &["train", "--micro-batch", "0", "--steps", "1"],
        "--micro-batch",
    );
    assert_refused(d, &["probe", "--steps", U64_MAX], "--steps");
    assert_refused(d, &["probe", "--warmup", U64_MAX], "--warmup");
    assert_refused(
        d,
        &["tune", "--max-micro-batch", "1073741824"],
        "--max-micro-batch",
    );
    assert_refused(d, &["tune", "--global-batch", U64_MAX], "--global-batch");
    assert_refused(d, &["tune", "--timed-steps", U64_MAX], "--timed-steps");
    assert_refused(
        d,
        &["tune", "--saturation-gain", "NaN"],
        "--saturation-gain",
    );
    let plan = recorded_plan(d);
    let plan = plan.to_str().unwrap();
    let export = [
        "export",
        "--plan",
        plan,
        "--format",
        "deepspeed",
        "--world-size",
    ];
    assert_refused(d, &[&export[..], &[U64_MAX]].concat(), "--world-size");
    assert_refused(d, &[&export[..], &["0"]].concat(), "--world-size");
}

#[test]
fn model_sizes_that_cannot_be_allocated_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for (i, d_model) in ["2147483648", "9223372036854775808"].iter().enumerate() {
        let name = format!("wide{i}.json");
        let spec = format!(r#"{{"preset": "tiny", "d_model": {d_model}}}"#);
        std::fs::write(dir.path().join(&name), spec).unwrap();
        for command in ["train", "tune", "probe"] {
            let out = autotune_in(dir.path(), &[command, "--model", &name]);
            assert_eq!(out.status.code(), Some(2), "{command}: {}", stderr(&out));
            let err = stderr(&out);
            assert!(
                err.contains(&name) && err.contains("d_model"),
                "{command}: {err}"
            );
        }
    }
}

#[test]
fn a_model_whose_state_exceeds_the_budget_has_no_feasible_plan() {
    let dir = tempfile::tempdir().unwrap();
    // About 33 billion parameters: 16 bytes each of state is 0.5 TB, over any host here.
    let spec = r#"{"preset": "gpt-1.3b", "d_model": 8192, "n_layers": 40, "d_ff": 32768}"#;
    std::fs::write(dir.path().join("big.json"), spec).unwrap();
    let out = autotune_in(
        dir.path(),
        &["tune", "--model", "big.json", "--target", "cpu"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("no feasible plan")
            && text.contains("training state")
            && text.contains("GiB"),
        "{text}"
    );
    let train = [
        "train", "--model", "big.json", "--device", "cpu", "--steps", "1",
    ];
    let out = autotune_in(dir.path(), &train);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stdout(&out).contains("does not fit"), "{}", stdout(&out));
    let probe = ["probe", "--model", "big.json", "--device", "cpu", "--json"];
    let out = autotune_in(dir.path(), &probe);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(line["outcome"], "out_of_memory", "{line}");
}
