//! Parquet tables and Arrow files as `datasets` and `pyarrow` write them
//! (`tests/fixtures/data/records/generate.py`): every row read as the record it holds, and a
//! row of the wrong shape named by its number.

use std::path::{Path, PathBuf};

use serde_json::Value;

use autotune::data::columnar;
use autotune::data::records::{record, Columns, Origin, Record};

use crate::util::{autotune_in, stderr};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/records")
}

/// The records `expected.json` says `name` holds, read from JSON as a JSON-lines file is.
fn expected(name: &str, columns: &Columns) -> Vec<Record> {
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
            .unwrap();
    all[name]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let origin = Origin {
                file: PathBuf::from(name),
                unit: "row",
                number: i + 1,
            };
            record(row.as_object().unwrap(), columns, &origin).unwrap()
        })
        .collect()
}

#[test]
fn every_row_of_parquet_and_arrow_files_is_the_record_it_holds() {
    let plain = Columns::default();
    let alpaca = Columns::parse("instruction=question,input=context,output=answer").unwrap();
    let read = |name: &str, columns: &Columns| {
        let path = fixtures().join(name);
        if name.ends_with(".parquet") {
            columnar::parquet(&path, columns).unwrap()
        } else {
            columnar::arrow(&path, columns).unwrap()
        }
    };
    for (name, columns) in [
        ("chat.parquet", &plain),
        ("alpaca.parquet", &alpaca),
        ("saved", &plain),
        ("saved-dict", &plain),
    ] {
        let records = read(name, columns);
        assert_eq!(records, expected(name, columns), "{name}");
        assert!(!records.is_empty());
    }
    assert!(matches!(read("chat.parquet", &plain)[0], Record::Chat(_)));
    assert!(matches!(
        read("alpaca.parquet", &alpaca)[0],
        Record::Instruction { .. }
    ));
    assert_eq!(read("saved", &plain).len(), 3, "both shards, in order");
}

#[test]
fn a_row_of_the_wrong_shape_is_named_by_file_and_row() {
    let path = fixtures().join("completions.parquet");
    let why = columnar::parquet(&path, &Columns::default())
        .unwrap_err()
        .to_string();
    assert!(
        why.contains("completions.parquet") && why.contains("row 3"),
        "{why}"
    );
    let not_parquet = fixtures().join("expected.json");
    let why = columnar::parquet(&not_parquet, &Columns::default())
        .unwrap_err()
        .to_string();
    assert!(
        why.contains("expected.json") && why.contains("Parquet"),
        "{why}"
    );
    let why = columnar::arrow(&not_parquet, &Columns::default())
        .unwrap_err()
        .to_string();
    assert!(why.contains("cannot be read as Arrow"), "{why}");
}

#[test]
fn a_saved_dataset_folder_trains_and_shows_through_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let folder = crate::fine_tune::chat_model(dir.path())
        .to_string_lossy()
        .into_owned();
    let saved = fixtures().join("saved").to_string_lossy().into_owned();
    let shown = autotune_in(
        dir.path(),
        &[
            "data",
            "--model",
            &folder,
            "--data",
            &saved,
            "--cache-dir",
            "c",
        ],
    );
    assert_eq!(shown.status.code(), Some(0), "{}", stderr(&shown));
    let out = String::from_utf8(shown.stdout).unwrap();
    assert!(out.contains("3 examples: 3 kept"), "{out}");
    assert!(out.contains("⟦Blue, on a clear day.<|eot_id|>⟧"), "{out}");
    let parquet = fixtures()
        .join("chat.parquet")
        .to_string_lossy()
        .into_owned();
    let trained = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            &folder,
            "--data",
            &parquet,
            "--steps",
            "2",
            "--micro-batch",
            "2",
            "--cache-dir",
            "c",
        ],
    );
    assert_eq!(trained.status.code(), Some(0), "{}", stderr(&trained));
}
