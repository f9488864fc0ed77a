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
        stderr(&other).contains("names no tokenizer.json"),
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

/// A model folder without weights: the tiny Llama's config with the Llama-3-style fixture
/// tokenizer's vocabulary and room for its examples, and that tokenizer.
fn model_folder(dir: &Path) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let folder = dir.join("model");
    std::fs::create_dir_all(&folder).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/hf/tiny-llama/config.json")).unwrap(),
    )
    .unwrap();
    config["vocab_size"] = 384.into();
    config["max_position_embeddings"] = 48.into();
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let from = root
            .join("tests/fixtures/data/tokenizers/llama3")
            .join(file);
        std::fs::copy(from, folder.join(file)).unwrap();
    }
    folder
}

/// The losses of a run's metrics log, in order.
fn losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_completion_dataset_trains_through_the_models_tokenizer_on_its_completions() {
    let dir = tempfile::tempdir().unwrap();
    let folder = model_folder(dir.path());
    let colours = ["red", "blue", "green", "black"];
    let lines: Vec<String> = (0..32)
        .map(|i| {
            let record = serde_json::json!({
                "question": format!("The colour of thing {} is", i % 8),
                "answer": format!(" {}", colours[i % 4]),
            });
            record.to_string()
        })
        .collect();
    std::fs::write(dir.path().join("qa.jsonl"), lines.join("\n")).unwrap();
    let folder = folder.to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--data",
            "qa.jsonl",
            "--columns",
            "prompt=question,completion=answer",
            "--micro-batch",
            "8",
            "--steps",
            "60",
            "--lr",
            "0.01",
            "--metrics",
            "m.jsonl",
        ];
        args.extend_from_slice(extra);
        let out = autotune_in(dir.path(), &args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        (stderr(&out), losses(&dir.path().join("m.jsonl")))
    };
    let (err, completion) = run(&[]);
    assert!(
        err.contains("32 examples"),
        "the examples are counted: {err}"
    );
    let (first, last) = (completion[0], completion[completion.len() - 1]);
    assert!(
        last < first * 0.5,
        "the completions are learnt: {first} to {last}"
    );
    let (_, all) = run(&["--train-on", "all"]);
    assert!(
        (all[0] - completion[0]).abs() > 1e-3,
        "training on the prompts too is another loss: {} against {}",
        all[0],
        completion[0]
    );
    // Without the model's tokenizer the records are refused, never read as bytes.
    let out = autotune_in(dir.path(), &["train", "--data", "qa.jsonl", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--tokenizer"), "{}", stderr(&out));
}

#[test]
fn data_shows_each_example_with_its_labels_and_the_counts() {
    let dir = tempfile::tempdir().unwrap();
    let folder = model_folder(dir.path()).to_string_lossy().into_owned();
    let records = [
        serde_json::json!({"prompt": "Two and two make", "completion": " four"}),
        serde_json::json!({"prompt": "The sky is", "completion": " blue"}),
        serde_json::json!({"text": "a document"}),
    ];
    let lines: Vec<String> = records[..2].iter().map(|r| r.to_string()).collect();
    std::fs::write(dir.path().join("qa.jsonl"), lines.join("\n")).unwrap();
    let json = autotune_in(
        dir.path(),
        &["data", "--model", &folder, "--data", "qa.jsonl", "--json"],
    );
    assert_eq!(json.status.code(), Some(0), "{}", stderr(&json));
    let tokenizer = autotune::data::tokenizer::Tokenizer::from_folder(Path::new(&folder)).unwrap();
    let (bos, eos) = (tokenizer.bos().unwrap().id, tokenizer.eos().unwrap().id);
    let lines: Vec<serde_json::Value> = String::from_utf8(json.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "one line per example, in dataset order");
    for (line, record) in lines.iter().zip(&records) {
        let ids: Vec<u32> = serde_json::from_value(line["input_ids"].clone()).unwrap();
        let labels: Vec<i64> = serde_json::from_value(line["labels"].clone()).unwrap();
        assert_eq!(
            (ids[0], ids[ids.len() - 1]),
            (bos, eos),
            "BOS first, EOS last"
        );
        let prompt = tokenizer
            .encode(record["prompt"].as_str().unwrap())
            .unwrap()
            .ids;
        for (i, (&id, &label)) in ids.iter().zip(&labels).enumerate() {
            let in_prompt = i <= prompt.len();
            assert_eq!(
                label,
                if in_prompt { -100 } else { i64::from(id) },
                "token {i}"
            );
        }
    }
    let text = autotune_in(
        dir.path(),
        &["data", "--model", &folder, "--data", "qa.jsonl"],
    );
    let out = String::from_utf8(text.stdout).unwrap();
    assert!(out.contains("⟦ four"), "the trained span is marked: {out}");
    assert!(out.contains("2 examples: 2 kept"), "{out}");
}

#[test]
fn a_run_of_epochs_resumed_mid_epoch_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let folder = model_folder(dir.path()).to_string_lossy().into_owned();
    let lines: Vec<String> = (0..30)
        .map(|i| serde_json::json!({"prompt": format!("Item {i} is"), "completion": format!(" {}", i % 7)}).to_string())
        .collect();
    std::fs::write(dir.path().join("qa.jsonl"), lines.join("\n")).unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--data",
            "qa.jsonl",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--lr",
            "0.01",
            // One example a sequence, so that epochs have a known number of steps (the packed
            // walk's resume is table-tested in `data::dataset`).
            "--no-pack",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = autotune_in(dir.path(), &args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // Thirty examples at eight a step: four steps an epoch, the last one short.
    let whole = train(&[
        "--epochs",
        "3",
        "--metrics",
        "a.jsonl",
        "--checkpoint-dir",
        "a",
    ]);
    assert_eq!(whole["steps"], 12);
    train(&[
        "--steps",
        "5",
        "--metrics",
        "b.jsonl",
        "--checkpoint-dir",
        "b",
    ]);
    let resumed = train(&[
        "--epochs",
        "3",
        "--resume",
        "--metrics",
        "b.jsonl",
        "--checkpoint-dir",
        "b",
    ]);
    assert_eq!(resumed["steps"], 12);
    let (a, b) = (
        losses(&dir.path().join("a.jsonl")),
        losses(&dir.path().join("b.jsonl")),
    );
    assert_eq!(a.len(), 12);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&a),
        bits(&b),
        "the resumed run takes the same examples in the same order"
    );
    // Another dataset is another run: refused on resume.
    std::fs::write(dir.path().join("qa.jsonl"), lines[..20].join("\n")).unwrap();
    let mut args = vec![
        "train",
        "--model",
        &folder,
        "--device",
        "cpu",
        "--data",
        "qa.jsonl",
        "--micro-batch",
        "4",
        "--grad-accum",
        "2",
        "--lr",
        "0.01",
        "--epochs",
        "3",
        "--resume",
        "--checkpoint-dir",
        "b",
    ];
    args.push("--json");
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--resume"), "{}", stderr(&out));
    // Epochs count passes over records, not over a token stream.
    let out = autotune_in(dir.path(), &["train", "--epochs", "2", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2));
    let out = autotune_in(dir.path(), &["train", "--epochs", "2", "--data", "pattern"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--epochs"), "{}", stderr(&out));
}

#[test]
fn held_out_examples_are_evaluated_into_the_metrics_and_never_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    let folder = model_folder(dir.path()).to_string_lossy().into_owned();
    let colours = ["red", "blue", "green", "black"];
    let line = |i: usize| {
        serde_json::json!({"prompt": format!("Colour of {} is", i % 4), "completion": format!(" {}", colours[i % 4])})
            .to_string()
    };
    let lines: Vec<String> = (0..40).map(line).collect();
    std::fs::write(dir.path().join("qa.jsonl"), lines.join("\n")).unwrap();
    std::fs::write(dir.path().join("eval.jsonl"), lines[..4].join("\n")).unwrap();
    let schema = crate::util::published_schema("metrics.schema.json");
    for held in [["--eval-split", "0.25"], ["--eval-data", "eval.jsonl"]] {
        let mut args = vec![
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--data",
            "qa.jsonl",
            "--micro-batch",
            "8",
            "--steps",
            "30",
            "--lr",
            "0.01",
            "--eval-every",
            "10",
            "--metrics",
            "m.jsonl",
        ];
        args.extend_from_slice(&held);
        let out = autotune_in(dir.path(), &args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let log: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("m.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let evals: Vec<f64> = log.iter().filter_map(|l| l["eval_loss"].as_f64()).collect();
        assert_eq!(evals.len(), 3, "steps 10, 20 and 30 evaluate");
        for l in log.iter().filter(|l| l.get("eval_loss").is_some()) {
            let (loss, ppl) = (
                l["eval_loss"].as_f64().unwrap(),
                l["eval_ppl"].as_f64().unwrap(),
            );
            assert!((ppl - loss.exp()).abs() < 1e-9 * ppl, "{l}");
            assert_eq!(
                crate::util::schema_violations(&schema, l),
                Vec::<String>::new(),
                "{l}"
            );
        }
        assert!(
            evals[2] < evals[0],
            "{held:?}: the held-out loss falls: {evals:?}"
        );
    }
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            &folder,
            "--data",
            "qa.jsonl",
            "--eval-split",
            "1.5",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--eval-split"), "{}", stderr(&out));
}

#[test]
fn several_files_and_folders_are_one_dataset_in_order_and_a_format_can_be_named() {
    let dir = tempfile::tempdir().unwrap();
    let folder = model_folder(dir.path()).to_string_lossy().into_owned();
    let texts = |names: &[&str]| -> String {
        names
            .iter()
            .map(|t| serde_json::json!({ "text": t }).to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    std::fs::write(dir.path().join("first.jsonl"), texts(&["one", "two"])).unwrap();
    std::fs::create_dir_all(dir.path().join("more/deeper")).unwrap();
    std::fs::write(dir.path().join("more/b.jsonl"), texts(&["four"])).unwrap();
    std::fs::write(dir.path().join("more/a.txt"), "three").unwrap();
    std::fs::write(dir.path().join("more/deeper/c.jsonl"), texts(&["five"])).unwrap();
    std::fs::write(dir.path().join("more/notes.csv"), "not,records").unwrap();
    // JSON lines under a name that hides them.
    std::fs::write(dir.path().join("rows.log"), texts(&["six"])).unwrap();
    let data = |args: &[&str]| {
        let mut all = vec!["data", "--model", &folder, "--json"];
        all.extend_from_slice(args);
        autotune_in(dir.path(), &all)
    };
    let shown = data(&["--data", "first.jsonl", "--data", "more"]);
    assert_eq!(shown.status.code(), Some(0), "{}", stderr(&shown));
    let tokenizer = autotune::data::tokenizer::Tokenizer::from_folder(Path::new(&folder)).unwrap();
    let decoded: Vec<String> = String::from_utf8(shown.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids: Vec<u32> = serde_json::from_value(line["input_ids"].clone()).unwrap();
            tokenizer.decode(&ids[1..ids.len() - 1]).unwrap()
        })
        .collect();
    assert_eq!(decoded, ["one", "two", "three", "four", "five"]);

    let hidden = data(&["--data", "rows.log"]);
    assert_eq!(hidden.status.code(), Some(2));
    let why = stderr(&hidden);
    assert!(
        why.contains("rows.log") && why.contains("--data-format"),
        "{why}"
    );
    let named = data(&["--data", "rows.log", "--data-format", "jsonl"]);
    assert_eq!(named.status.code(), Some(0), "{}", stderr(&named));
    assert_eq!(String::from_utf8(named.stdout).unwrap().lines().count(), 1);

    std::fs::create_dir(dir.path().join("empty")).unwrap();
    let empty = data(&["--data", "empty"]);
    assert_eq!(empty.status.code(), Some(2));
    assert!(
        stderr(&empty).contains("holds no record file"),
        "{}",
        stderr(&empty)
    );

    // Training takes the same list, and refuses token files among several.
    std::fs::write(dir.path().join("ids.u16"), [1u8, 0, 2, 0, 3, 0]).unwrap();
    let mixed = train(
        dir.path(),
        "first.jsonl",
        &["--data", "ids.u16", "--model", &folder],
    );
    assert_eq!(mixed.status.code(), Some(2), "{}", stderr(&mixed));
    assert!(stderr(&mixed).contains("ids.u16"), "{}", stderr(&mixed));
    let trained = train(
        dir.path(),
        "first.jsonl",
        &["--data", "more", "--model", &folder, "--micro-batch", "2"],
    );
    assert_eq!(trained.status.code(), Some(0), "{}", stderr(&trained));
    assert!(
        stderr(&trained).contains("5 examples"),
        "{}",
        stderr(&trained)
    );
}
