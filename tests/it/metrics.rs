//! `train --metrics`: one line per step against the published schema, and a learning-rate
//! schedule that a resumed run continues exactly.

use std::path::Path;

use serde_json::Value;

use autotune::train::schedule::{LrDecay, LrSchedule};

use crate::util::{
    autotune_in, exit_code, published_schema, read_until, schema_violations, signal, spawn_in,
    stderr,
};

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The tiny preset's learning rate.
const BASE_LR: f64 = 3e-3;

fn train_args<'a>(steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--micro-batch",
        "2",
        "--steps",
        steps,
        "--lr-warmup-steps",
        "4",
        "--lr-schedule",
        "cosine",
        "--min-lr",
        "3e-4",
        "--metrics",
        "metrics.jsonl",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn every_step_writes_a_line_that_follows_the_schema_and_the_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let out = autotune_in(dir.path(), &train_args("12", &[]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let schema = published_schema("metrics.schema.json");
    let log = lines(&dir.path().join("metrics.jsonl"));
    assert_eq!(log.len(), 12);
    let schedule = LrSchedule {
        decay: LrDecay::Cosine,
        warmup_steps: 4,
        min_lr: 3e-4,
        decay_steps: 12,
    };
    for (i, line) in log.iter().enumerate() {
        assert_eq!(
            schema_violations(&schema, line),
            Vec::<String>::new(),
            "{line}"
        );
        assert_eq!(line["step"], i as u64 + 1);
        let lr = line["lr"].as_f64().unwrap();
        assert!(
            (lr - schedule.lr(BASE_LR, i as u64)).abs() < 1e-15,
            "step {i}: {lr}"
        );
        assert_eq!(
            line["gpu_bytes"],
            Value::Null,
            "a CPU run has no device memory"
        );
        assert!(line["host_bytes"].as_u64().unwrap() > 0);
        assert!(line["host_peak_bytes"].as_u64() >= line["host_bytes"].as_u64());
    }
    // The warm-up rises, the cosine falls.
    let lrs: Vec<f64> = log.iter().map(|l| l["lr"].as_f64().unwrap()).collect();
    assert!(lrs[..4].windows(2).all(|w| w[0] < w[1]));
    assert!(lrs[4..].windows(2).all(|w| w[0] > w[1]));
    // The schema is not vacuous: a line missing a field, or with a wrong type, fails it.
    let mut broken = log[0].clone();
    broken.as_object_mut().unwrap().remove("lr");
    assert!(!schema_violations(&schema, &broken).is_empty());
    let mut wrong = log[0].clone();
    wrong["skipped"] = Value::from("no");
    assert!(!schema_violations(&schema, &wrong).is_empty());
}

#[test]
fn a_resumed_run_continues_the_log_and_the_schedule_where_the_checkpoint_left_them() {
    let steps = "120";
    // The reference: one run, uninterrupted.
    let whole = tempfile::tempdir().unwrap();
    let out = autotune_in(whole.path(), &train_args(steps, &[]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let reference = lines(&whole.path().join("metrics.jsonl"));

    // The same run, stopped by SIGTERM early on (a checkpoint after the current step), then
    // resumed.
    let split = tempfile::tempdir().unwrap();
    let with_checkpoints = train_args(
        steps,
        &["--checkpoint-dir", "ck", "--checkpoint-every", "3"],
    );
    let (child, lines_seen) = spawn_in(split.path(), &with_checkpoints);
    read_until(&lines_seen, "step 1:");
    signal(child.id(), "-TERM");
    assert_eq!(exit_code(child), Some(130), "stopped by the interrupt");
    let stopped = lines(&split.path().join("metrics.jsonl")).len();
    assert!(stopped < 120, "the run was stopped early ({stopped} steps)");
    let mut resumed_args = with_checkpoints.clone();
    resumed_args.push("--resume");
    let out = autotune_in(split.path(), &resumed_args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let resumed = lines(&split.path().join("metrics.jsonl"));

    assert_eq!(resumed.len(), reference.len());
    for (a, b) in resumed.iter().zip(&reference) {
        for field in ["step", "lr", "loss", "loss_scale", "skipped"] {
            assert_eq!(a[field], b[field], "{field} at step {}", b["step"]);
        }
    }

    // Another schedule is refused on resume, naming the flags to pass.
    let mut other = resumed_args.clone();
    let at = other
        .iter()
        .position(|a| *a == "--lr-warmup-steps")
        .unwrap();
    other[at + 1] = "5";
    let out = autotune_in(split.path(), &other);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--lr-warmup-steps"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_second_run_on_a_metrics_log_in_use_is_refused_and_the_log_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let long = [
        "train",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--micro-batch",
        "2",
        "--steps",
        "1000000",
        "--metrics",
        "m.jsonl",
    ];
    let (first, rx) = spawn_in(dir.path(), &long);
    read_until(&rx, "step 1:");
    let second = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--metrics",
        "m.jsonl",
    ];
    let out = autotune_in(dir.path(), &second);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--metrics m.jsonl") && err.contains("another autotune run"),
        "{err}"
    );
    signal(first.id(), "-INT");
    assert_eq!(exit_code(first), Some(130));
    // Every line is one step of the first run, in order: nothing of the second in between.
    let steps: Vec<u64> = lines(&dir.path().join("m.jsonl"))
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert!(!steps.is_empty());
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
}
