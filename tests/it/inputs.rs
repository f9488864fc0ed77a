//! Inputs that are no regular file: a FIFO (which would block a reader forever) or a link to
//! `/dev/zero` (which never ends) given where autotune reads a file is refused at once, exit
//! 2, naming the file and what it is, and nothing is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use crate::util::{command, signal, stderr};

/// What a row puts where a file is read.
#[derive(Debug, Clone, Copy)]
pub enum Special {
    /// A named pipe no process writes.
    Fifo,
    /// A link to `/dev/zero`.
    DevZero,
}

impl Special {
    /// Creates it at `path`.
    pub fn make(self, path: &Path) {
        match self {
            Special::Fifo => {
                let made = std::process::Command::new("mkfifo")
                    .arg(path)
                    .status()
                    .expect("mkfifo runs");
                assert!(made.success(), "mkfifo {}", path.display());
            }
            Special::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
        }
    }

    /// How the refusal calls it.
    pub fn words(self) -> &'static str {
        match self {
            Special::Fifo => "a FIFO",
            Special::DevZero => "a character device",
        }
    }
}

/// Runs the binary in `dir`; one that has not ended after two minutes blocked on its input
/// and fails the test (a watchdog, not a timing assertion: a refusal takes milliseconds).
pub fn run_bounded(dir: &Path, args: &[&str]) -> Output {
    let child = command()
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the test binary starts");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(out) => out.expect("the child ends"),
        Err(_) => {
            signal(pid, "-KILL");
            panic!("{args:?} never ended: it blocked on an input");
        }
    }
}

/// Everything under `dir`: a regular file's bytes, a link's target, and what anything else
/// is, so that a refused command is seen to have changed nothing. Special files are not read.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        // A lock file notes its last holder's pid: every run that takes the lock rewrites it.
        if path.file_name().is_some_and(|n| n == ".lock") {
            continue;
        }
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let held = if meta.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                pending.push(entry.unwrap().path());
            }
            b"folder".to_vec()
        } else if meta.file_type().is_symlink() {
            std::fs::read_link(&path)
                .unwrap()
                .to_string_lossy()
                .into_owned()
                .into_bytes()
        } else if meta.is_file() {
            std::fs::read(&path).unwrap()
        } else {
            b"special".to_vec()
        };
        found.insert(path, held);
    }
    found
}

/// The tiny Llama fixture copied into `dir/model`, without its weights when `weights` is off.
fn model_folder(dir: &Path, weights: bool) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/tiny-llama");
    let folder = dir.join("model");
    std::fs::create_dir(&folder).unwrap();
    std::fs::copy(fixture.join("config.json"), folder.join("config.json")).unwrap();
    if weights {
        let weights = "model.safetensors";
        std::fs::copy(fixture.join(weights), folder.join(weights)).unwrap();
    }
    folder
}

/// One place autotune reads a file: how to lay out the rest of the inputs, which file is made
/// special, and the command that reads it.
struct Row {
    what: &'static str,
    setup: fn(&Path),
    special: &'static str,
    args: &'static [&'static str],
    /// What a link to `/dev/zero` is refused for, where that comes before the file's kind: a
    /// checkpoint holds its files themselves, and a model's weights lie inside its folder.
    link_refused_as: Option<&'static str>,
}

const TRAIN_ONE: [&str; 6] = ["--steps", "1", "--micro-batch", "2", "--device", "cpu"];

fn rows() -> Vec<Row> {
    vec![
        Row {
            what: "a model spec",
            setup: |_| {},
            special: "spec.json",
            args: &["train", "--model", "spec.json"],
            link_refused_as: None,
        },
        Row {
            what: "a model folder's config.json",
            setup: |d| {
                let folder = model_folder(d, true);
                std::fs::remove_file(folder.join("config.json")).unwrap();
            },
            special: "model/config.json",
            args: &["train", "--model", "model", "--data", "pattern"],
            link_refused_as: None,
        },
        Row {
            what: "a shard of sharded weights",
            setup: |d| {
                let folder = model_folder(d, false);
                let index = r#"{"weight_map": {"model.embed_tokens.weight": "shard.safetensors"}}"#;
                std::fs::write(folder.join("model.safetensors.index.json"), index).unwrap();
            },
            special: "model/shard.safetensors",
            args: &["train", "--model", "model", "--data", "pattern"],
            link_refused_as: Some("outside the model folder"),
        },
        Row {
            what: "weights",
            setup: |d| {
                model_folder(d, false);
            },
            special: "model/model.safetensors",
            args: &["train", "--model", "model", "--data", "pattern"],
            link_refused_as: Some("outside the model folder"),
        },
        Row {
            what: "a tokenizer",
            setup: |d| std::fs::write(d.join("d.jsonl"), r#"{"text": "hello"}"#).unwrap(),
            special: "tokenizer.json",
            args: &[
                "data",
                "--model",
                "tiny",
                "--data",
                "d.jsonl",
                "--tokenizer",
                "tokenizer.json",
            ],
            link_refused_as: None,
        },
        Row {
            what: "a token file",
            setup: |_| {},
            special: "tokens.bin",
            args: &["train", "--model", "tiny", "--data", "tokens.bin"],
            link_refused_as: None,
        },
        Row {
            what: "records",
            setup: |d| {
                let folder = model_folder(d, false);
                let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/data/tokenizers/llama3/tokenizer.json");
                std::fs::copy(tokenizer, folder.join("tokenizer.json")).unwrap();
            },
            special: "d.jsonl",
            args: &["data", "--model", "model", "--data", "d.jsonl"],
            link_refused_as: None,
        },
        Row {
            what: "a plan",
            setup: |_| {},
            special: "plan.json",
            args: &["export", "--plan", "plan.json", "--format", "deepspeed"],
            link_refused_as: None,
        },
        Row {
            what: "a recorded profile",
            setup: |_| {},
            special: "profile.json",
            args: &["check", "--profile", "profile.json"],
            link_refused_as: None,
        },
        Row {
            what: "a checkpoint's state",
            setup: |d| {
                let args = [
                    &["train", "--model", "tiny", "--checkpoint-dir", "ck"],
                    &TRAIN_ONE[..],
                ];
                let out = run_bounded(d, &args.concat());
                assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
                std::fs::remove_file(d.join("ck/step-000001/state.json")).unwrap();
            },
            special: "ck/step-000001/state.json",
            args: &[
                "train",
                "--model",
                "tiny",
                "--checkpoint-dir",
                "ck",
                "--resume",
            ],
            link_refused_as: Some("symbolic link"),
        },
    ]
}

#[test]
fn an_input_that_is_no_regular_file_is_refused_at_once_naming_it() {
    for row in rows() {
        for special in [Special::Fifo, Special::DevZero] {
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            (row.setup)(d);
            special.make(&d.join(row.special));
            let before = snapshot(d);
            // `train` runs one short step on the CPU; the other commands take their own flags.
            let args: Vec<&str> = if row.args[0] == "train" {
                row.args.iter().chain(&TRAIN_ONE).copied().collect()
            } else {
                row.args.to_vec()
            };
            let out = run_bounded(d, &args);
            let err = stderr(&out);
            let case = format!("{} as {special:?}: {err}", row.what);
            assert_eq!(out.status.code(), Some(2), "{case}");
            let name = Path::new(row.special).file_name().unwrap();
            assert!(err.contains(name.to_str().unwrap()), "{case}");
            let words = match (special, row.link_refused_as) {
                (Special::DevZero, Some(words)) => words,
                _ => special.words(),
            };
            assert!(err.contains(words), "{case}");
            assert_eq!(snapshot(d), before, "{case}: something was written");
        }
    }
}

#[test]
fn a_document_larger_than_any_real_one_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    // Sparse: 65 MiB long, no disk taken; past the bound for any JSON document.
    let file = std::fs::File::create(&spec).unwrap();
    file.set_len(65 << 20).unwrap();
    let out = run_bounded(dir.path(), &["train", "--model", "spec.json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("spec.json") && err.contains("bytes"), "{err}");
}

#[test]
fn a_weights_header_claiming_a_huge_tensor_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let folder = model_folder(d, true);
    let weights = folder.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    // The embeddings claim 64 GiB of f32 past the real data: a sparse file holds them without
    // a byte on disk, so only the shape tells them from real weights.
    let data_len = (bytes.len() - 8 - len) as u64;
    let claimed = 64u64 << 30;
    let name = "model.embed_tokens.weight";
    header[name]["dtype"] = "F32".into();
    header[name]["shape"] = serde_json::json!([claimed / 4 / 64, 64]);
    header[name]["data_offsets"] = serde_json::json!([data_len, data_len + claimed]);
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + len..]);
    std::fs::write(&weights, &out).unwrap();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap();
    file.set_len(out.len() as u64 + claimed).unwrap();
    let args = ["train", "--model", "model", "--data", "pattern"];
    let out = run_bounded(d, &[&args[..], &TRAIN_ONE[..]].concat());
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("model") && err.contains(name) && err.contains("has shape"),
        "{err}"
    );
    let mut names: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["model"], "nothing was written beside the model");
}
