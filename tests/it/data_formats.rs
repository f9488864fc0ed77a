//! What `--data` accepts: token files, synthetic data, and text only as raw bytes when
//! `--tokenizer bytes` asks for it; datasets of records, model files and unknown files are
//! exit 2 naming the file and the fix, never trained on as bytes. A model folder is a model,
//! and its pretrained weights never train on synthetic data by accident.

use std::path::Path;

use crate::util::{autotune_in, stderr};

/// `train` of the tiny model for one step on `data` in `dir`, with `extra` flags.
fn train(dir: &Path, data: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["train", "--device", "cpu", "--steps", "1", "--data", data];
    args.extend_from_slice(extra);
    autotune_in(dir, &args)
}

#[test]
fn records_model_files_and_unknown_files_are_refused_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let files: [(&str, &[u8], &str); 7] = [
        (
            "chat.jsonl",
            br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            "JSON lines",
        ),
        (
            "alpaca.json",
            br#"[{"instruction": "a", "output": "b"}]"#,
            "JSON document",
        ),
        ("rows.parquet", b"PAR1", "Parquet"),
        (
            "tokenizer.json",
            br#"{"model": {"type": "BPE"}}"#,
            "tokenizer's own file",
        ),
        ("data.csv", b"a,b\n1,2\n", "`.csv` file"),
        (
            "corpus.txt",
            b"plain text to learn from",
            "--tokenizer bytes",
        ),
        ("saved", b"", "folder"),
    ];
    for (name, bytes, why) in files {
        let path = dir.path().join(name);
        if name == "saved" {
            std::fs::create_dir(&path).unwrap();
        } else {
            std::fs::write(&path, bytes).unwrap();
        }
        let out = train(dir.path(), name, &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(name) && err.contains(why), "{name}: {err}");
        assert!(!err.contains("step 1"), "{name} never trains: {err}");
    }
}

#[test]
fn text_trains_as_bytes_only_when_asked_and_token_files_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    std::fs::write(dir.path().join("corpus.txt"), &text).unwrap();
    let tokens: Vec<u8> = (0..4096u16).flat_map(|i| (i % 256).to_le_bytes()).collect();
    std::fs::write(dir.path().join("tokens.bin"), tokens).unwrap();
    let bytes = train(dir.path(), "corpus.txt", &["--tokenizer", "bytes"]);
    assert_eq!(bytes.status.code(), Some(0), "{}", stderr(&bytes));
    let ids = train(dir.path(), "tokens.bin", &[]);
    assert_eq!(ids.status.code(), Some(0), "{}", stderr(&ids));
    let other = train(dir.path(), "corpus.txt", &["--tokenizer", "tokenizer.json"]);
    assert_eq!(other.status.code(), Some(2));
    assert!(
        stderr(&other).contains("--tokenizer bytes"),
        "{}",
        stderr(&other)
    );
}

/// The tiny Llama that `transformers` saved (tests/fixtures/hf/generate.py).
fn tiny_llama() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf/tiny-llama")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn a_model_folder_is_its_config_and_its_weights_which_need_real_data() {
    let dir = tempfile::tempdir().unwrap();
    let folder = tiny_llama();
    // Its weights would train on synthetic sequences: refused, naming the fix.
    let out = autotune_in(
        dir.path(),
        &[
            "train", "--model", &folder, "--device", "cpu", "--steps", "1",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--data"), "{}", stderr(&out));
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--init-from",
            &folder,
            "--model",
            &folder,
            "--steps",
            "1",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // With data named on purpose it trains from the folder's weights.
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--steps",
            "1",
            "--data",
            "pattern",
            "--micro-batch",
            "2",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["model"], "tiny-llama",
        "the folder's config names the model"
    );
    // A folder without a config is no model.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = autotune_in(dir.path(), &["train", "--model", "empty", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("config.json"), "{}", stderr(&out));
}

#[test]
fn optimizer_flags_reach_the_plan_and_bad_values_name_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "tune",
            "--model",
            "tiny",
            "--target",
            "cpu",
            "--max-trials",
            "1",
            "--timed-steps",
            "1",
            "--lr",
            "1e-4",
            "--weight-decay",
            "0.05",
            "--beta2",
            "0.95",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let optimizer = &plan["model"]["optimizer"];
    assert_eq!(optimizer["lr"], 1e-4);
    assert_eq!(optimizer["weight_decay"], 0.05);
    assert_eq!(optimizer["beta2"], 0.95);
    let out = autotune_in(dir.path(), &["train", "--steps", "1", "--lr", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--lr"), "{}", stderr(&out));
}
