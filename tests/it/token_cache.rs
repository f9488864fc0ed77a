//! A dataset is tokenized once: a later run (of `data` or of training) maps its examples from
//! the token cache, and a changed input is tokenized again, never served stale.

use std::path::Path;

use serde_json::json;

use crate::fine_tune::chat_model;
use crate::util::{autotune_in, stderr, stdout};

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
fn a_second_run_maps_the_cached_examples_and_a_changed_file_is_tokenized_again() {
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
        stderr(&second).contains("12 examples mapped from the token cache"),
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
        stderr(&train).contains("12 examples mapped from the token cache"),
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
