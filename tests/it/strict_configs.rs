//! Hugging Face configs, checkpoints and flags that would otherwise be read as something else:
//! each is refused with exit 2, a message naming the file and the key (or the flag) in the
//! user's own terms, and nothing written or changed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{json, Value};

use crate::util::{autotune_in, stderr, stdout};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The tiny Llama fixture's config: a valid model that trains in milliseconds.
fn base_config() -> Value {
    let text = std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every file under `dir` (links not followed) and its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                pending.push(path);
            } else if meta.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                files.insert(path, target.into_os_string().into_encoded_bytes());
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// Whether `text` holds `word` as a whole word (not inside a longer name such as
/// `rms_norm_eps`).
fn names_word(text: &str, word: &str) -> bool {
    let is_name = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(is_name) && !after.is_some_and(is_name)
    })
}

/// Runs `args` in `dir` and checks the refusal: exit 2, a message naming `file` and `key`,
/// nothing on stdout, no raw control character on stderr, and every file as it was.
fn assert_refused(dir: &Path, args: &[&str], file: &str, key: &str) -> Output {
    let before = snapshot(dir);
    let out = autotune_in(dir, args);
    let err = stderr(&out);
    let case = format!("{args:?} ({key})");
    assert_eq!(out.status.code(), Some(2), "{case}: {err}");
    assert!(err.contains(file), "{case}: file `{file}` not named: {err}");
    assert!(err.contains(key), "{case}: `{key}` not named: {err}");
    assert!(
        !err.contains(['\u{1b}', '\r', '\u{9b}']),
        "{case}: raw control characters: {err:?}"
    );
    assert_eq!(stdout(&out), "", "{case}: wrote to stdout");
    assert_eq!(snapshot(dir), before, "{case}: files changed");
    out
}

/// Our field names, which a message about a config must not use.
const INTERNAL: [&str; 8] = [
    "d_model",
    "n_heads",
    "n_kv_heads",
    "n_layers",
    "d_ff",
    "seq_len",
    "norm_eps",
    "positions.rotary",
];

/// A config edit: the config's key it concerns, and the change.
type Edit = (&'static str, fn(&mut Value));

/// The configs that must be refused, each naming its key.
fn refused_configs() -> Vec<Edit> {
    vec![
        ("rope_parameters", |c| {
            c["rope_parameters"] = json!("garbage")
        }),
        ("rope_parameters", |c| c["rope_parameters"] = json!(3)),
        ("rope_parameters", |c| c["rope_parameters"] = json!([1, 2])),
        ("rope_scaling", |c| {
            c["rope_scaling"] = json!({"rope_type": "default"});
        }),
        ("rope_theta", |c| {
            c["rope_parameters"] = json!({"rope_type": "default"});
            c["rope_theta"] = json!("500000");
        }),
        ("rope_parameters.rope_theta", |c| {
            c["rope_parameters"]["rope_theta"] = json!("500000")
        }),
        ("rope_scaling.rope_theta", |c| {
            c.as_object_mut().unwrap().remove("rope_parameters");
            c["rope_scaling"] = json!({"rope_type": "default", "rope_theta": 1e6});
        }),
        ("rope_parameters.beta_fast", |c| {
            c["rope_parameters"]["beta_fast"] = json!(32)
        }),
        ("rope_parameters.factor", |c| {
            c["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("factor");
        }),
        ("rope_parameters.rope_type", |c| {
            c["rope_parameters"]["rope_type"] = json!("yarn")
        }),
        ("rope_parameters.rope_type", |c| {
            c["rope_parameters"]["rope_type"] = json!(3)
        }),
        ("rope_parameters.original_max_position_embeddings", |c| {
            c["rope_parameters"]["original_max_position_embeddings"] = json!(8192.5)
        }),
        ("rope_parameters", |c| {
            c["rope_parameters"]["factor"] = json!(0.5)
        }),
        // 2 × (2^63 + 16) wraps to 32, the width, in 64 bits.
        ("head_dim", |c| {
            c["num_attention_heads"] = json!(2);
            c["head_dim"] = json!(9_223_372_036_854_775_824_u64);
        }),
        ("architectures", |c| {
            c["architectures"] = json!(["GPT2LMHeadModel"])
        }),
        ("architectures", |c| c["model_type"] = json!("mistral")),
        ("architectures", |c| {
            c["architectures"] = json!(["LlamaForCausalLM", "LlamaForSequenceClassification"])
        }),
        ("model_type", |c| c["model_type"] = json!(["llama"])),
        ("num_attention_heads", |c| {
            c.as_object_mut().unwrap().remove("head_dim");
            c["num_attention_heads"] = json!(3);
        }),
        ("num_key_value_heads", |c| {
            c["num_key_value_heads"] = json!(3)
        }),
        ("rms_norm_eps", |c| c["rms_norm_eps"] = json!(-1)),
        ("max_position_embeddings", |c| {
            c["max_position_embeddings"] = json!(0)
        }),
        ("hidden_size", |c| {
            c.as_object_mut().unwrap().remove("head_dim");
            c["hidden_size"] = json!(1u64 << 40);
        }),
        ("bos_token_id", |c| c["bos_token_id"] = json!("<s>")),
        ("use_cache", |c| c["use_cache"] = json!("yes")),
        ("_name_or_path", |c| c["_name_or_path"] = json!(7)),
        ("x\\u{1b}[2J", |c| c["x\u{1b}[2J"] = json!(1)),
    ]
}

#[test]
fn configs_read_as_something_else_are_refused_in_their_own_terms() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model");
    std::fs::create_dir(&model).unwrap();
    let train = [
        "train", "--model", "model", "--data", "pattern", "--steps", "1",
    ];
    // The unedited config trains: every refusal below is the edit's.
    std::fs::write(model.join("config.json"), base_config().to_string()).unwrap();
    let out = autotune_in(d, &train);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for (key, edit) in refused_configs() {
        let mut config = base_config();
        edit(&mut config);
        std::fs::write(model.join("config.json"), config.to_string()).unwrap();
        let out = assert_refused(d, &train, "config.json", key);
        let err = stderr(&out);
        if let Some(word) = INTERNAL.iter().find(|w| names_word(&err, w)) {
            panic!("{key}: names our field `{word}` instead of the config's: {err}");
        }
    }
}

#[test]
fn a_key_given_twice_is_refused_wherever_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model");
    std::fs::create_dir(&model).unwrap();
    let text = base_config().to_string();
    let top = text.replacen('{', r#"{"hidden_size": 64, "#, 1);
    let nested = text.replacen(
        r#""rope_parameters":{"#,
        r#""rope_parameters":{"factor": 8.0, "#,
        1,
    );
    assert!(nested != text && top != text);
    for (config, key) in [(top, "hidden_size"), (nested, "rope_parameters.factor")] {
        std::fs::write(model.join("config.json"), config).unwrap();
        let train = [
            "train", "--model", "model", "--data", "pattern", "--steps", "1",
        ];
        let out = assert_refused(d, &train, "config.json", key);
        assert!(stderr(&out).contains("twice"), "{}", stderr(&out));
    }
}

/// A model folder at `dir/model` with the tiny Llama's config, and its weights in a folder
/// beside it.
fn folder_and_weights_elsewhere(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&model).unwrap();
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::copy(
        fixture("tiny-llama").join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    let weights = elsewhere.join("weights.safetensors");
    std::fs::copy(fixture("tiny-llama").join("model.safetensors"), &weights).unwrap();
    (model, weights)
}

#[test]
fn weights_linked_from_outside_the_model_folder_are_refused() {
    let train = [
        "train", "--model", "model", "--data", "pattern", "--steps", "1",
    ];
    // The single file, as a link.
    let dir = tempfile::tempdir().unwrap();
    let (model, weights) = folder_and_weights_elsewhere(dir.path());
    std::os::unix::fs::symlink(&weights, model.join("model.safetensors")).unwrap();
    let out = assert_refused(
        dir.path(),
        &train,
        "model.safetensors",
        "outside the model folder",
    );
    assert!(
        stderr(&out).contains("weights.safetensors"),
        "{}",
        stderr(&out)
    );
    // A shard the index lists, as a link.
    let dir = tempfile::tempdir().unwrap();
    let (model, weights) = folder_and_weights_elsewhere(dir.path());
    let shard = "model-00001-of-00001.safetensors";
    std::os::unix::fs::symlink(&weights, model.join(shard)).unwrap();
    let checkpoint = autotune::hf::safetensors::Checkpoint::open(&weights).unwrap();
    let map: serde_json::Map<String, Value> = checkpoint
        .names()
        .map(|n| (n.to_string(), json!(shard)))
        .collect();
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        model.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_refused(dir.path(), &train, shard, "outside the model folder");
    // The same shard copied in loads: the link, not the index, was refused.
    std::fs::remove_file(model.join(shard)).unwrap();
    std::fs::copy(&weights, model.join(shard)).unwrap();
    let out = autotune_in(dir.path(), &train);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn control_characters_from_a_config_are_escaped_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model");
    std::fs::create_dir(&model).unwrap();
    let mut config = base_config();
    config["_name_or_path"] = json!("org/evil\u{1b}[31m\u{202e}name");
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    // The name is printed and stored escaped.
    let out = autotune_in(d, &["estimate", "--model", "model"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("evil\\u{1b}[31m\\u{202e}name") && !text.contains('\u{1b}'),
        "{text:?}"
    );
    let mut tune = vec![
        "tune",
        "--model",
        "model",
        "--target",
        "cpu",
        "--out",
        "plan.json",
    ];
    tune.extend([
        "--max-trials",
        "1",
        "--max-micro-batch",
        "1",
        "--timed-steps",
        "1",
    ]);
    tune.extend(["--trial-warmup-steps", "0"]);
    let out = autotune_in(d, &tune);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan = std::fs::read_to_string(d.join("plan.json")).unwrap();
    let plan: Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(
        plan["model"]["name"],
        json!("evil\\u{1b}[31m\\u{202e}name"),
        "{plan}"
    );
    // A spec of ours holding one is refused, naming its field.
    let spec = json!({"preset": "tiny", "name": "tiny\u{1b}]0;owned\u{7}"});
    std::fs::write(d.join("spec.json"), spec.to_string()).unwrap();
    let train = ["train", "--model", "spec.json", "--steps", "1"];
    assert_refused(d, &train, "spec.json", "`name`");
}

#[test]
fn a_global_batch_no_plan_could_run_is_refused_before_any_trial() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tune = [
        "tune",
        "--model",
        "tiny",
        "--target",
        "cpu",
        "--global-batch",
    ];
    for n in ["16777216", "1048577"] {
        let out = assert_refused(d, &[&tune[..], &[n]].concat(), "", "--global-batch");
        assert!(stderr(&out).starts_with("error:"), "{}", stderr(&out));
    }
    // A step of 2^20 sequences of 2^21 tokens is over the tokens a step may take.
    let spec = json!({"preset": "tiny", "seq_len": 2_097_152});
    std::fs::write(d.join("long.json"), spec.to_string()).unwrap();
    let long = ["tune", "--model", "long.json", "--target", "cpu"];
    let out = assert_refused(
        d,
        &[&long[..], &["--global-batch", "1048576"]].concat(),
        "",
        "--global-batch",
    );
    assert!(stderr(&out).contains("tokens per step"), "{}", stderr(&out));
}
