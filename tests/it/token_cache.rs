//! A dataset is tokenized once: a later run (of `data` or of training) reads its examples from
//! the token cache, and a changed input is tokenized again, never served stale.

use std::path::Path;

use serde_json::json;

use crate::fine_tune::chat_model;
use crate::util::{autotune_in, exit_code, read_until, spawn_in, stderr, stdout};

fn conversations(dir: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("Question {i}?")},
                {"role": "assistant", "content": format!("Answer {i}.")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("chat.jsonl"), lines.join("\n")).unwrap();
}

#[test]
fn a_second_run_reads_the_cached_examples_and_a_changed_file_is_tokenized_again() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    conversations(dir.path(), 12);
    let data = |extra: &[&str]| {
        let mut args = vec![
            "data",
            "--model",
            &folder,
            "--data",
            "chat.jsonl",
            "--json",
            "--cache-dir",
            "cache",
        ];
        args.extend_from_slice(extra);
        autotune_in(dir.path(), &args)
    };
    let first = data(&[]);
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(
        stderr(&first).contains("tokenizing 12 records"),
        "{}",
        stderr(&first)
    );
    assert!(stderr(&first).contains("cached in"), "{}", stderr(&first));
    let cached: Vec<_> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .collect();
    assert_eq!(
        cached.len(),
        1,
        "one file for the dataset, nothing left behind"
    );

    let second = data(&[]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert!(
        stderr(&second).contains("12 examples from the token cache"),
        "{}",
        stderr(&second)
    );
    assert!(
        !stderr(&second).contains("tokenizing"),
        "{}",
        stderr(&second)
    );
    assert_eq!(
        stdout(&first),
        stdout(&second),
        "the same examples, id for id"
    );

    // Other masking is another dataset.
    let all = data(&["--train-on", "all"]);
    assert!(
        stderr(&all).contains("tokenizing 12 records"),
        "{}",
        stderr(&all)
    );
    assert_ne!(stdout(&all), stdout(&first));

    // Training on the file that `data` cached starts from the cache.
    let train = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            &folder,
            "--data",
            "chat.jsonl",
            "--steps",
            "2",
            "--micro-batch",
            "2",
            "--cache-dir",
            "cache",
        ],
    );
    assert!(train.status.success(), "{}", stderr(&train));
    assert!(
        stderr(&train).contains("12 examples from the token cache"),
        "{}",
        stderr(&train)
    );

    // A changed file is a new dataset.
    conversations(dir.path(), 13);
    let changed = data(&[]);
    assert!(
        stderr(&changed).contains("tokenizing 13 records"),
        "{}",
        stderr(&changed)
    );
    assert_eq!(stdout(&changed).lines().count(), 13);
}

#[test]
fn a_damaged_cache_file_is_tokenized_again_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    conversations(dir.path(), 5);
    let data = || {
        autotune_in(
            dir.path(),
            &[
                "data",
                "--model",
                &folder,
                "--data",
                "chat.jsonl",
                "--json",
                "--cache-dir",
                "c",
            ],
        )
    };
    let first = data();
    let file = std::fs::read_dir(dir.path().join("c"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 3]).unwrap();
    let again = data();
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("the token cache is not used"),
        "{}",
        stderr(&again)
    );
    assert!(
        stderr(&again).contains("tokenizing 5 records"),
        "{}",
        stderr(&again)
    );
    assert_eq!(stdout(&first), stdout(&again));
    assert_eq!(std::fs::read(&file).unwrap(), bytes, "written whole again");
}

#[test]
fn a_cache_file_cut_short_under_a_run_ends_it_with_a_checkpoint_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    conversations(dir.path(), 40);
    let run = [
        "train",
        "--model",
        &folder,
        "--data",
        "chat.jsonl",
        "--micro-batch",
        "2",
        "--cache-dir",
        "cache",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "1000000",
    ];
    let cached = autotune_in(
        dir.path(),
        &[
            "data",
            "--model",
            &folder,
            "--data",
            "chat.jsonl",
            "--json",
            "--cache-dir",
            "cache",
        ],
    );
    assert!(cached.status.success(), "{}", stderr(&cached));
    let file = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();

    let (child, lines) = spawn_in(dir.path(), &[&run[..], &["--steps", "1000000"]].concat());
    let started = read_until(&lines, "step 1:").join("\n");
    assert!(started.contains("from the token cache"), "{started}");
    // Only the header is left: every example the next step reads lies past the end.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(96)
        .unwrap();
    let said = read_until(&lines, "error:").join("\n");
    let said = [said, lines.iter().collect::<Vec<_>>().join("\n")].join("\n");
    assert_eq!(exit_code(child), Some(2), "no SIGBUS: {said}");
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        said.contains(&name) && said.contains("changed while the run read it"),
        "{said}"
    );
    let ck = dir.path().join("ck");
    let saved = std::fs::read_to_string(ck.join("latest")).expect("a checkpoint was saved");
    assert!(
        said.contains(saved.trim()),
        "the error names the checkpoint: {said}"
    );
    autotune::train::checkpoint::verify(&ck.join(saved.trim())).unwrap();

    // The resume tokenizes the data again, as the error said, and goes on.
    let step: u64 = saved.trim()["step-".len()..].parse().unwrap();
    let steps = (step + 1).to_string();
    let resumed = autotune_in(
        dir.path(),
        &[&run[..], &["--steps", &steps, "--resume"]].concat(),
    );
    assert_eq!(resumed.status.code(), Some(0), "{}", stderr(&resumed));
    assert!(
        stderr(&resumed).contains("tokenizing again"),
        "{}",
        stderr(&resumed)
    );
}
