//! Plans tuned on the user's own data: `tune --data` runs its trials on the batches the run
//! will train on (packed sequences, or the widest padded micro-batch), the plan records the
//! dataset, and `train --plan` refuses a plan tuned on other data unless told to go on.

use std::path::Path;

use serde_json::{json, Value};

use crate::fine_tune::chat_model;
use crate::util::{autotune_in, stderr};

/// Conversations whose replies grow a word every second example (95 to 105 tokens for 20,
/// with Llama 3.1's template and its system header).
fn write_chat(dir: &Path, name: &str, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("Count to {i}.")},
                {"role": "assistant", "content": vec!["a"; i / 2 + 1].join(" ")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join(name), lines.join("\n")).unwrap();
}

/// `tune` on the CPU with `extra` flags, its plan read back.
fn tune(dir: &Path, folder: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "tune",
        "--model",
        folder,
        "--target",
        "cpu",
        "--max-trials",
        "2",
        "--out",
        "plan.json",
    ];
    args.extend_from_slice(extra);
    let out = autotune_in(dir, &args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap()
}

fn train_with_plan(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train", "--plan", "plan.json", "--steps", "1"];
    args.extend_from_slice(extra);
    autotune_in(dir, &args)
}

#[test]
fn a_plan_records_its_dataset_and_refuses_another_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    write_chat(dir.path(), "chat.jsonl", 20);
    write_chat(dir.path(), "other.jsonl", 12);
    let plan = tune(dir.path(), &folder, &["--data", "chat.jsonl"]);
    let data = &plan["data"];
    assert_eq!(data["batching"], "packed");
    assert_eq!(data["examples"], 20);
    assert_eq!(data["files"], json!(["chat.jsonl"]));
    assert_eq!(data["sequence_tokens"], plan["model"]["seq_len"]);
    assert_eq!(data["fingerprint"].as_str().unwrap().len(), 64);
    let bucketed: u64 = data["lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["examples"].as_u64().unwrap())
        .sum();
    assert_eq!(bucketed, 20);
    let folder_recorded = plan["model_folder"].as_str().unwrap();
    assert!(folder_recorded.ends_with("tiny-chat"), "{folder_recorded}");
    // The same data trains; the plan's folder gives the tokenizer.
    let same = train_with_plan(dir.path(), &["--data", "chat.jsonl"]);
    assert_eq!(same.status.code(), Some(0), "{}", stderr(&same));
    for (extra, says) in [
        (vec!["--data", "other.jsonl"], "this run's data differs"),
        (
            vec!["--data", "chat.jsonl", "--no-pack"],
            "batches are padded",
        ),
        (vec![], "trains on no dataset"),
    ] {
        let refused = train_with_plan(dir.path(), &extra);
        let err = stderr(&refused);
        assert_eq!(refused.status.code(), Some(2), "{extra:?}: {err}");
        assert!(
            err.contains(says) && err.contains("--allow-data-mismatch"),
            "{extra:?}: {err}"
        );
    }
    let allowed = train_with_plan(
        dir.path(),
        &["--data", "other.jsonl", "--allow-data-mismatch"],
    );
    let err = stderr(&allowed);
    assert_eq!(allowed.status.code(), Some(0), "{err}");
    assert!(
        err.contains("warning: the plan was tuned on chat.jsonl"),
        "{err}"
    );
}

#[test]
fn padded_trials_run_the_longest_example_and_over_long_ones_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    write_chat(dir.path(), "chat.jsonl", 20);
    let plan = tune(dir.path(), &folder, &["--data", "chat.jsonl", "--no-pack"]);
    let data = &plan["data"];
    assert_eq!(data["batching"], "padded");
    let longest = data["longest"].as_u64().unwrap();
    assert!(
        longest < 128,
        "no example reaches the model's 128: {longest}"
    );
    // A padded micro-batch is at most as wide as the longest example's inputs: the trials'.
    assert_eq!(plan["model"]["seq_len"].as_u64().unwrap(), longest - 1);
    // Padding of micro-batches of examples 95 to 105 tokens long: a few percent, none at one
    // example a micro-batch.
    let fill = data["fill"].as_f64().unwrap();
    let micro_batch = plan["knobs"]["micro_batch"].as_u64().unwrap();
    assert!(
        fill > 0.9 && (fill < 1.0 || micro_batch == 1),
        "{fill} at {micro_batch}"
    );
    assert_eq!(data["dropped"], 0);
    // At 100 tokens, the longest examples are dropped and counted, here and in `data`.
    let short = [
        "--data",
        "chat.jsonl",
        "--seq-len",
        "100",
        "--truncate",
        "drop",
    ];
    let plan = tune(dir.path(), &folder, &short);
    let dropped = plan["data"]["dropped"].as_u64().unwrap();
    assert!(dropped > 0, "{}", plan["data"]);
    assert_eq!(plan["data"]["examples"].as_u64().unwrap() + dropped, 20);
    assert!(plan["data"]["longest"].as_u64().unwrap() <= 101);
    assert_eq!(plan["data"]["truncation"], "drop");
    let shown = autotune_in(
        dir.path(),
        &[
            "data",
            "--model",
            &folder,
            "--data",
            "chat.jsonl",
            "--seq-len",
            "100",
            "--truncate",
            "drop",
            "--show",
            "0",
        ],
    );
    let text = String::from_utf8(shown.stdout).unwrap();
    assert!(
        text.contains(&format!("{dropped} longer than it dropped")),
        "{text}"
    );
    assert!(text.contains("lengths (tokens): ≤"), "{text}");
}
