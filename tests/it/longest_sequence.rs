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

#[test]
fn seq_len_auto_finds_the_longest_sequence_the_target_fits_and_tunes_at_it() {
    let dir = tempfile::tempdir().unwrap();
    let target = small_cpu(dir.path(), 12);
    let out = autotune_in(
        dir.path(),
        &[
            "tune",
            "--model",
            "tiny",
            "--target",
            &target,
            "--seq-len",
            "auto",
            "--max-trials",
            "4",
            "--json",
        ],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let said = err
        .lines()
        .find_map(|l| l.strip_prefix("the longest sequence on small-cpu: "))
        .unwrap_or_else(|| panic!("{err}"));
    let tokens: u64 = said.split(' ').next().unwrap().parse().unwrap();
    assert!(tokens >= 64 && tokens % 64 == 0, "{said}");
    // The edge trials found it: the longest that fitted of those tried.
    let fitted: Vec<u64> = err
        .lines()
        .filter(|l| l.starts_with("[edge]") && l.contains(": fits,"))
        .map(|l| l.split(' ').nth(4).unwrap().parse().unwrap())
        .collect();
    assert_eq!(fitted.iter().max(), Some(&tokens), "{err}");
    let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["model"]["seq_len"].as_u64(), Some(tokens));
    let measured = plan["longest_sequence"]["measured_tokens"]
        .as_u64()
        .unwrap();
    assert!(measured >= tokens, "{}", plan["longest_sequence"]);
}

#[test]
fn seq_len_auto_is_refused_where_it_cannot_apply() {
    let dir = tempfile::tempdir().unwrap();
    let folder = crate::fine_tune::chat_model(dir.path());
    let folder = folder.to_str().unwrap();
    std::fs::write(dir.path().join("chat.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    for (args, says) in [
        (
            vec![
                "tune",
                "--model",
                folder,
                "--seq-len",
                "auto",
                "--data",
                "chat.jsonl",
            ],
            "--data: the data's examples set the length",
        ),
        (vec!["estimate", "--seq-len", "auto"], "estimate says"),
        (vec!["tune", "--seq-len", "0"], "no sequence length"),
    ] {
        let out = autotune_in(dir.path(), &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
