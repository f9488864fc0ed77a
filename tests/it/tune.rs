use std::path::Path;
use std::sync::OnceLock;

use serde_json::Value;

use crate::util::{autotune, autotune_in, stderr, stdout};

/// A model small enough that a CPU trial takes milliseconds, whose host heap grows by about
/// 0.4 MB per sequence.
const MICRO: &str = r#"{"preset": "tiny", "name": "micro", "d_model": 32, "n_heads": 2, "d_ff": 64, "seq_len": 32}"#;

/// A CPU with 40 MiB of host memory: the micro model's boundary sits at a couple of hundred
/// sequences.
const SMALL_CPU: &str = r#"{"name": "small-cpu", "kind": "cpu", "gpu_memory_bytes": null, "host_memory_bytes": 41943040}"#;

fn workdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("micro.json"), MICRO).unwrap();
    std::fs::write(dir.path().join("small-cpu.json"), SMALL_CPU).unwrap();
    dir
}

/// `autotune tune --model micro.json --device small-cpu.json ARGS --json` in `dir`: it must
/// succeed, and its stdout is the plan.
fn tune_micro(dir: &Path, args: &[&str]) -> Value {
    tune_micro_on(dir, "small-cpu.json", args)
}

/// [`tune_micro`] for the device spec file `device` in `dir`.
fn tune_micro_on(dir: &Path, device: &str, args: &[&str]) -> Value {
    let mut argv = vec!["tune", "--model", "micro.json", "--target", device];
    argv.extend_from_slice(args);
    argv.push("--json");
    let out = autotune_in(dir, &argv);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&stdout(&out)).expect("stdout is exactly one JSON document")
}

fn tune_to_boundary(dir: &Path) -> Value {
    tune_micro(
        dir,
        &[
            "--precision",
            "fp32",
            "--saturation-gain",
            "0",
            "--max-micro-batch",
            "256",
            "--out",
            "plan.json",
        ],
    )
}

/// The micro model tuned to its host-memory boundary on the small CPU, run once for every test
/// that reads it: the plan printed (as JSON) and the plan file written.
fn boundary_plan() -> &'static (Value, String) {
    static PLAN: OnceLock<(Value, String)> = OnceLock::new();
    PLAN.get_or_init(|| {
        let dir = workdir();
        let plan = tune_to_boundary(dir.path());
        let file = std::fs::read_to_string(dir.path().join("plan.json")).unwrap();
        (plan, file)
    })
}

fn probe_fits(dir: &Path, micro_batch: usize, host_budget: u64) -> bool {
    let mb = micro_batch.to_string();
    let budget = host_budget.to_string();
    let out = autotune_in(
        dir,
        &[
            "probe",
            "--model",
            "micro.json",
            "--micro-batch",
            &mb,
            "--warmup",
            "1",
            "--steps",
            "3",
            "--host-budget",
            &budget,
            "--json",
        ],
    );
    let line: Value = serde_json::from_str(&stdout(&out)).expect("probe prints one JSON line");
    match line["outcome"].as_str() {
        Some("fits") => true,
        Some("out_of_memory") => {
            assert_eq!(line["memory"], "host");
            false
        }
        other => panic!("unexpected outcome {other:?}: {line}"),
    }
}

#[test]
fn tune_finds_the_exact_host_memory_boundary_within_the_stated_probe_count() {
    let dir = workdir();
    let (plan, _) = boundary_plan();
    let usable = (plan["budget"]["host_bytes"].as_f64().unwrap()
        * (1.0 - plan["budget"]["headroom"].as_f64().unwrap())) as u64;
    // The first regime's search trials: plain fp32, no accumulation, the update after the
    // backward pass. (The update-in-backward regime shares the checkpointing; its own trials,
    // at batches its timing decides, are not this regime's.)
    let trials: Vec<&Value> = plan["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["request"]["knobs"]["checkpointing"]["mode"] == "none")
        .filter(|t| t["request"]["knobs"]["update"] != "in_backward")
        .collect();
    let feasible =
        |t: &Value| t["outcome"] == "fits" && t["peak_host_bytes"].as_u64().unwrap() <= usable;
    let largest = trials
        .iter()
        .filter(|t| feasible(t))
        .map(|t| t["request"]["knobs"]["micro_batch"].as_u64().unwrap())
        .max()
        .unwrap();
    let next = trials
        .iter()
        .find(|t| t["request"]["knobs"]["micro_batch"].as_u64() == Some(largest + 1));
    assert!(
        next.is_some_and(|t| !feasible(t)),
        "the search must pin the boundary: {largest} fits and {} does not",
        largest + 1
    );

    // The documented bound: at most 2k + 5 search trials for a boundary B with 2^k ≤ B.
    let k = 63 - largest.leading_zeros() as usize;
    let distinct: std::collections::HashSet<u64> = trials
        .iter()
        .map(|t| t["request"]["knobs"]["micro_batch"].as_u64().unwrap())
        .collect();
    assert!(
        distinct.len() <= 2 * k + 5,
        "{} trials for boundary {largest}",
        distinct.len()
    );

    // Independently of the search: a fresh probe at the boundary fits the usable bytes, one past it does not.
    assert!(probe_fits(dir.path(), largest as usize, usable));
    assert!(!probe_fits(dir.path(), largest as usize + 1, usable));
}

#[test]
fn the_fitted_memory_model_predicts_held_out_trials_within_three_percent() {
    let (plan, _) = boundary_plan();
    let error = plan["model_error"]["memory_loo_rel_error"]
        .as_f64()
        .expect("enough trials to hold one out");
    assert!(error <= 0.03, "leave-one-out relative error {error}");
    let predicted = plan["predicted"]["peak_host_bytes"].as_f64().unwrap();
    let measured = plan["measured"]["peak_host_bytes"].as_f64().unwrap();
    assert!(
        (predicted - measured).abs() / measured <= 0.03,
        "predicted {predicted} vs measured {measured}"
    );
}

#[test]
fn a_tuned_plan_trains_without_running_out_of_memory() {
    let dir = workdir();
    let (plan, file) = boundary_plan();
    std::fs::write(dir.path().join("plan.json"), file).unwrap();
    assert!(plan["measured"]["peak_host_bytes"].as_u64().unwrap() > 0);
    // `train --plan` enforces the plan's host budget and fails if training exceeds it.
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--plan",
            "plan.json",
            "--steps",
            "4",
            "--data",
            "pattern",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(report["steps"], 4);
    assert_eq!(report["knobs"], plan["knobs"]);
}

#[test]
fn run_tunes_then_trains_and_leaves_plan_and_checkpoint() {
    let dir = workdir();
    let out = autotune_in(
        dir.path(),
        &[
            "run",
            "--model",
            "micro.json",
            "--target",
            "cpu",
            "--steps",
            "6",
            "--run-dir",
            "job",
            "--lr-warmup-steps",
            "3",
            "--metrics",
            "metrics.jsonl",
            "--report",
            "search.html",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out)).expect("one JSON document");
    assert_eq!(report["training"]["steps"], 6);
    assert_eq!(report["plan"]["knobs"], report["training"]["knobs"]);
    assert!(dir.path().join("job/plan.json").exists());
    assert!(dir.path().join("job/checkpoints/latest").exists());
    assert!(dir.path().join("search.html").exists());
    // The training half warms its learning rate up over three steps, and logs every step.
    let rates: Vec<f64> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["lr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(rates.len(), 6);
    assert!(rates[0] < rates[1] && rates[1] < rates[2], "{rates:?}");
    assert!(rates[3..].iter().all(|r| *r == rates[2]), "{rates:?}");
}

/// A CPU with 12 MiB of host memory: 96 micro-model sequences at once need ~16 MiB.
const TWELVE_MIB_CPU: &str = r#"{"name": "twelve-mib-cpu", "kind": "cpu", "gpu_memory_bytes": null, "host_memory_bytes": 12582912}"#;

#[test]
fn global_batch_is_honoured_with_accumulation() {
    let dir = workdir();
    std::fs::write(dir.path().join("twelve-mib-cpu.json"), TWELVE_MIB_CPU).unwrap();
    let plan = tune_micro_on(
        dir.path(),
        "twelve-mib-cpu.json",
        &[
            "--precision",
            "fp32",
            "--checkpointing",
            "none",
            "--global-batch",
            "96",
        ],
    );
    let (mb, accum) = (
        plan["knobs"]["micro_batch"].as_u64().unwrap(),
        plan["knobs"]["grad_accum"].as_u64().unwrap(),
    );
    assert_eq!(mb * accum, 96, "{}", plan["knobs"]);
    // 96 sequences at once need ~16 MiB of heap, over the 12 MiB host (checkpointing, which
    // would fit them, is not searched): accumulation is required.
    assert!(accum > 1, "{}", plan["knobs"]);
}

#[test]
fn no_feasible_plan_is_an_answer_with_a_hint() {
    let dir = workdir();
    std::fs::write(
        dir.path().join("tiny-host.json"),
        r#"{"name": "tiny-host", "kind": "cpu", "gpu_memory_bytes": null, "host_memory_bytes": 2000000}"#,
    )
    .unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "tune",
            "--model",
            "micro.json",
            "--target",
            "tiny-host.json",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("no feasible plan") && text.contains("hint:"),
        "{text}"
    );
}

#[test]
fn malformed_plans_profiles_and_budgets_exit_2_with_the_problem_named() {
    let dir = workdir();
    let cases: [(&str, &str, &[&str], &[&str]); 5] = [
        (
            "truncated.json",
            r#"{"schema_version": 1, "tool": {"#,
            &["train", "--plan", "truncated.json"],
            &["truncated.json"],
        ),
        (
            "future.json",
            r#"{"schema_version": 7}"#,
            &["train", "--plan", "future.json"],
            &["future.json", "schema_version"],
        ),
        (
            "gpu-cpu.json",
            r#"{"name": "x", "kind": "cpu", "gpu_memory_bytes": 100, "host_memory_bytes": 1000000000}"#,
            &["tune", "--model", "micro.json", "--target", "gpu-cpu.json"],
            &["gpu-cpu.json", "gpu_memory_bytes"],
        ),
        (
            "zero-host.json",
            r#"{"name": "x", "kind": "cpu", "gpu_memory_bytes": null, "host_memory_bytes": 0}"#,
            &[
                "tune",
                "--model",
                "micro.json",
                "--target",
                "zero-host.json",
            ],
            &["zero-host.json", "host_memory_bytes"],
        ),
        (
            "unused.json",
            "{}",
            &[
                "tune",
                "--model",
                "micro.json",
                "--target",
                "cpu",
                "--headroom",
                "1.5",
            ],
            &["headroom"],
        ),
    ];
    for (file, content, args, needles) in cases {
        std::fs::write(dir.path().join(file), content).unwrap();
        let out = autotune_in(dir.path(), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        for needle in needles {
            assert!(
                err.contains(needle),
                "{args:?}: `{needle}` not named in: {err}"
            );
        }
    }
}

#[test]
fn a_recorded_search_replays_offline_to_the_same_plan() {
    let dir = workdir();
    let out = autotune_in(
        dir.path(),
        &[
            "tune",
            "--model",
            "micro.json",
            "--target",
            "small-cpu.json",
            "--record",
            "rec/micro.json",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let live: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let out = autotune_in(
        dir.path(),
        &["tune", "--backend", "replay:rec/micro.json", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let replayed: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(replayed["knobs"], live["knobs"]);
    assert_eq!(
        replayed["evidence"], live["evidence"],
        "the replay asks the recorded trials in the same order"
    );
}

#[test]
fn knob_filters_restrict_the_searched_regimes() {
    let dir = workdir();
    let plan = tune_micro(
        dir.path(),
        &[
            "--checkpointing",
            "none",
            "--offload",
            "none",
            "--saturation-gain",
            "0",
            "--max-micro-batch",
            "256",
        ],
    );
    let evidence = plan["evidence"].as_array().unwrap();
    assert!(!evidence.is_empty());
    for e in evidence {
        let knobs = &e["request"]["knobs"];
        assert_eq!(knobs["checkpointing"]["mode"], "none", "{knobs}");
        assert_eq!(knobs["offload"], "none", "{knobs}");
    }
    // Without the filters the CPU space also searches checkpointing (the plain regime runs out
    // of the 40 MiB budget, so checkpointing is worth a look).
    let plan = tune_micro(
        dir.path(),
        &["--saturation-gain", "0", "--max-micro-batch", "256"],
    );
    assert!(plan["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["request"]["knobs"]["checkpointing"]["mode"] != "none"));
}

#[test]
fn a_model_only_compact_state_fits_is_pointed_at_it_with_the_estimate() {
    let out = autotune(&["tune", "--model", "llama-3.1-8b", "--target", "rtx4090-32g"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    assert!(text.contains("no feasible plan"), "{text}");
    let way = text
        .split("--allow-compact-state")
        .nth(1)
        .unwrap_or_else(|| panic!("names the opt-in: {text}"));
    // The estimate behind it: the regime, its peaks, within the 24 GB card's budget.
    assert!(
        way.contains("moments=int8") && way.contains("GPU 22."),
        "{way}"
    );
    assert!(
        way.contains("host 16."),
        "the moments in host memory: {way}"
    );
}

#[test]
fn a_run_trains_a_number_of_tokens_whichever_batch_its_plan_chose() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |max: &str| {
        let out = autotune_in(
            dir.path(),
            &[
                "run",
                "--run-dir",
                max,
                "--target",
                "cpu",
                "--max-micro-batch",
                max,
                "--max-trials",
                "4",
                "--tokens",
                "20000",
                "--eval-every",
                "0",
                "--json",
            ],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let report: Value = serde_json::from_str(&stdout(&out)).unwrap();
        let knobs = &report["plan"]["knobs"];
        let per_step = knobs["micro_batch"].as_u64().unwrap()
            * knobs["grad_accum"].as_u64().unwrap()
            * report["plan"]["model"]["seq_len"].as_u64().unwrap();
        (report["training"]["steps"].as_u64().unwrap(), per_step)
    };
    let runs: Vec<(u64, u64)> = ["1", "8"].into_iter().map(plan).collect();
    for &(steps, per_step) in &runs {
        // The fewest steps that reach 20,000 tokens.
        assert!(steps * per_step >= 20_000, "{steps} × {per_step}");
        assert!((steps - 1) * per_step < 20_000, "{steps} × {per_step}");
    }
    assert!(
        runs[0].1 < runs[1].1,
        "the larger space plans a larger batch: {runs:?}"
    );
    assert!(
        runs[0].0 > runs[1].0,
        "a smaller batch takes more steps: {runs:?}"
    );
}

/// The PyTorch harness's gpt-124m recording on an H100 (a copy of the profile in
/// `benches/results/2026-12-07-h100-harness-choice/`): 20 sequences fit but ran slower than 16.
/// The plan is 16, and says why it is not the larger batch.
#[test]
fn a_plan_below_a_larger_feasible_batch_says_the_larger_one_measured_slower() {
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/harness/gpt-124m-h100.profile.json"
    );
    let out = autotune(&["tune", "--backend", &format!("replay:{profile}")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("plan: mb=16 "), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("also fits"))
        .unwrap_or_else(|| panic!("no line names the larger batch: {text}"));
    assert!(
        line.contains("micro-batch 20 also fits") && line.contains("% slower"),
        "{line}"
    );

    // The same plan as JSON carries 20 among its alternatives, slower than the plan.
    let out = autotune(&["tune", "--backend", &format!("replay:{profile}"), "--json"]);
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let measured = plan["measured"]["tokens_per_s"].as_f64().unwrap();
    let twenty = plan["alternatives"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["knobs"]["micro_batch"] == 20)
        .expect("20 is an alternative");
    assert!(twenty["tokens_per_s"].as_f64().unwrap() < measured);
}
