//! A fine-tune as a user runs it: a Hugging Face model folder (config, tokenizer, chat
//! template) and a JSONL of conversations, trained on the assistant's turns through the model's
//! own template and tokenizer, then exported.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::util::{autotune_in, stderr};

/// A tiny Llama folder with the Llama-3-style fixture tokenizer and Llama 3.1's chat template
/// (its end of turn, `<|eot_id|>`, is the EOS as in the released instruct models).
pub fn chat_model(dir: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let folder = dir.join("tiny-chat");
    std::fs::create_dir_all(&folder).unwrap();
    let read = |p: PathBuf| -> Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let mut config = read(root.join("hf/tiny-llama/config.json"));
    config["vocab_size"] = 384.into();
    config["max_position_embeddings"] = 128.into();
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    let tokenizers = root.join("data/tokenizers/llama3");
    std::fs::copy(
        tokenizers.join("tokenizer.json"),
        folder.join("tokenizer.json"),
    )
    .unwrap();
    let mut tokenizer_config = read(tokenizers.join("tokenizer_config.json"));
    let template = read(root.join("data/templates/llama-3.1/tokenizer_config.json"));
    tokenizer_config["chat_template"] = template["chat_template"].clone();
    tokenizer_config["eos_token"] = "<|eot_id|>".into();
    std::fs::write(
        folder.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
    folder
}

/// Each step's loss from a metrics log.
fn losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_chat_fine_tune_learns_the_assistants_turns_through_the_models_template() {
    let dir = tempfile::tempdir().unwrap();
    let folder = chat_model(dir.path()).to_string_lossy().into_owned();
    let colours = ["red", "blue", "green", "black"];
    let lines: Vec<String> = (0..24)
        .map(|i| {
            json!({"messages": [
                {"role": "user", "content": format!("Colour of {}?", i % 4)},
                {"role": "assistant", "content": colours[i % 4]},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.path().join("chat.jsonl"), lines.join("\n")).unwrap();
    // What training sees: the assistant's reply and its end of turn, nothing of the prompt.
    let shown = autotune_in(
        dir.path(),
        &[
            "data",
            "--model",
            &folder,
            "--data",
            "chat.jsonl",
            "--show",
            "1",
        ],
    );
    let text = String::from_utf8(shown.stdout.clone()).unwrap();
    assert_eq!(shown.status.code(), Some(0), "{}", stderr(&shown));
    assert!(
        text.contains("⟦red<|eot_id|>⟧"),
        "the reply is trained on: {text}"
    );
    assert_eq!(text.matches('⟦').count(), 1, "and nothing else: {text}");
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--data",
            "chat.jsonl",
            "--micro-batch",
            "8",
            "--epochs",
            "60",
            "--lr",
            "0.01",
            "--metrics",
            "m.jsonl",
            "--checkpoint-dir",
            "ck",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let losses = losses(&dir.path().join("m.jsonl"));
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    // Four answers of one token each, the end of turn certain: a learnt reply costs well under
    // ln(4)/2 nats a trained token, where the untrained model starts near ln(384).
    assert!(first > 4.0, "{first}");
    assert!(last < 0.7, "the replies are learnt: {first} to {last}");
    let export = autotune_in(
        dir.path(),
        &["export-weights", "--checkpoint", "ck", "--out", "exported"],
    );
    assert_eq!(export.status.code(), Some(0), "{}", stderr(&export));
    // A complete folder: the tokenizer the data was read with, its ids in the config, and a
    // generation config that stops at the end of a turn.
    let exported = dir.path().join("exported");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(exported.join(file).is_file(), "{file}");
    }
    let read = |file: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(exported.join(file)).unwrap()).unwrap()
    };
    let (config, generation) = (read("config.json"), read("generation_config.json"));
    let tokenizer = autotune::data::tokenizer::Tokenizer::from_folder(&exported).unwrap();
    let eot = tokenizer.eos().unwrap();
    assert_eq!(eot.text, "<|eot_id|>");
    assert_eq!(config["eos_token_id"], eot.id);
    assert_eq!(generation["eos_token_id"], eot.id);
    assert_eq!(config["bos_token_id"], tokenizer.bos().unwrap().id);
    transformers_loads(&exported);
    // The export is a model folder again: its config, tokenizer, template and weights.
    let again = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            "exported",
            "--device",
            "cpu",
            "--data",
            "chat.jsonl",
            "--micro-batch",
            "8",
            "--steps",
            "1",
            "--json",
        ],
    );
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
    let report: Value = serde_json::from_slice(&again.stdout).unwrap();
    let resumed_loss = report["last_loss"].as_f64().unwrap();
    assert!(
        resumed_loss < 0.7,
        "the exported weights are the trained ones: {resumed_loss}"
    );
    // A plan tuned on the export remembers its folder: training with it starts from the
    // trained weights and reads the data with the folder's tokenizer.
    let tuned = autotune_in(
        dir.path(),
        &[
            "tune",
            "--model",
            "exported",
            "--target",
            "cpu",
            "--data",
            "chat.jsonl",
            "--max-trials",
            "2",
            "--out",
            "plan.json",
        ],
    );
    assert_eq!(tuned.status.code(), Some(0), "{}", stderr(&tuned));
    let planned = autotune_in(
        dir.path(),
        &[
            "train",
            "--plan",
            "plan.json",
            "--data",
            "chat.jsonl",
            "--steps",
            "1",
            "--json",
        ],
    );
    assert_eq!(planned.status.code(), Some(0), "{}", stderr(&planned));
    let report: Value = serde_json::from_slice(&planned.stdout).unwrap();
    let planned_loss = report["last_loss"].as_f64().unwrap();
    assert!(planned_loss < 0.7, "from the plan's folder: {planned_loss}");
}

/// Where Python's `transformers` is installed: it loads the folder's config and tokenizer and
/// renders a conversation with its template; where torch is installed too, it loads the model
/// and generates each trained reply greedily, stopping at the end of turn.
fn transformers_loads(folder: &Path) {
    let script = r#"
import sys
from transformers import AutoConfig, AutoTokenizer
folder = sys.argv[1]
config = AutoConfig.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
out = tokenizer.apply_chat_template([{"role": "user", "content": "Colour of 1?"}], add_generation_prompt=True)
ids = out["input_ids"] if hasattr(out, "keys") else out
assert config.eos_token_id == tokenizer.eos_token_id, (config.eos_token_id, tokenizer.eos_token_id)
assert ids[0] == config.bos_token_id, ids
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    eot = model.generation_config.eos_token_id
    for i, colour in enumerate(["red", "blue", "green", "black"]):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Colour of {i}?"}],
            add_generation_prompt=True, return_tensors="pt")
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=eot)
        reply = out[0, prompt.shape[1]:].tolist()
        assert reply[-1] == eot, reply
        assert tokenizer.decode(reply, skip_special_tokens=True) == colour, reply
print("loaded", len(ids), "generated" if torch is not None else "")
"#;
    let present = std::process::Command::new("python3")
        .args(["-c", "import transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        eprintln!("transformers is not installed: the folder's Python load is not checked");
        return;
    }
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(folder)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers loads the export: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
