//! Every plan says the longest single sequence its setting takes: the estimate's prediction,
//! scaled by the plan's measured peak, and a trial at that edge; `estimate` says it too.

use std::path::Path;

use serde_json::Value;

use crate::util::{autotune_in, stderr, stdout};

/// The built-in CPU profile with `host_mib` of host memory.
fn small_cpu(dir: &Path, host_mib: u64) -> String {
    let profile = serde_json::json!({
        "name": "small-cpu",
        "kind": "cpu",
        "gpu_memory_bytes": null,
        "host_memory_bytes": host_mib << 20,
        "host_to_device_gbps": null,
        "notes": "a CPU whose host memory holds a few thousand tokens of the tiny model",
    });
    std::fs::write(dir.join("small-cpu.json"), profile.to_string()).unwrap();
    "small-cpu.json".into()
}

#[test]
fn a_plan_measures_the_longest_sequence_it_takes_at_the_predicted_edge() {
    let dir = tempfile::tempdir().unwrap();
    let target = small_cpu(dir.path(), 24);
    let args = [
        "tune",
        "--model",
        "tiny",
        "--target",
        &target,
        "--max-trials",
        "3",
        "--json",
    ];
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let longest = &plan["longest_sequence"];
    let predicted = longest["predicted_tokens"].as_u64().unwrap();
    let seq_len = plan["model"]["seq_len"].as_u64().unwrap();
    assert!(predicted > seq_len, "{longest}");
    let trials = longest["trials"].as_array().unwrap();
    assert!(!trials.is_empty(), "{longest}");
    // The first trial is the prediction, rounded down to a multiple of 64 tokens.
    assert_eq!(trials[0]["tokens"].as_u64().unwrap(), predicted / 64 * 64);
    let fitted = trials
        .iter()
        .filter(|t| t["fits"] == true)
        .map(|t| t["tokens"].as_u64().unwrap());
    assert_eq!(longest["measured_tokens"].as_u64(), fitted.max());
    assert!(
        stderr(&out).contains("[edge] one sequence of"),
        "{}",
        stderr(&out)
    );
    // `--edge-trials 0` predicts only, and says so.
    let mut predicted_only = args.to_vec();
    predicted_only.extend(["--edge-trials", "0"]);
    let out = autotune_in(dir.path(), &predicted_only);
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let longest = &plan["longest_sequence"];
    assert!(longest["trials"].as_array().unwrap().is_empty());
    assert!(longest["note"]
        .as_str()
        .unwrap()
        .contains("--edge-trials 0"));
    assert!(longest["predicted_tokens"].as_u64().is_some());
}

#[test]
fn estimate_says_the_longest_sequence_at_its_knobs() {
    let dir = tempfile::tempdir().unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "estimate",
            "--model",
            "llama-3.2-1b",
            "--target",
            "rtx4090-32g",
            "--precision",
            "bf16",
            "--checkpointing",
            "all",
            "--micro-batch",
            "1",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let found: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let longest = found["longest_sequence"].as_u64().unwrap();
    // One sequence holds more than the largest micro-batch of 2048-token ones.
    let largest = found["largest_micro_batch"].as_u64().unwrap();
    assert!(longest >= largest * 2048, "{longest} vs {largest} × 2048");
    let at = |seq: u64| {
        let out = autotune_in(
            dir.path(),
            &[
                "estimate",
                "--model",
                "llama-3.2-1b",
                "--target",
                "rtx4090-32g",
                "--precision",
                "bf16",
                "--checkpointing",
                "all",
                "--micro-batch",
                "1",
                "--seq-len",
                &seq.to_string(),
            ],
        );
        out.status.code()
    };
    assert_eq!(at(longest), Some(0), "the longest fits");
    assert_eq!(at(longest + 1), Some(1), "one more token does not");
}
