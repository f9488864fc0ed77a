//! Packed micro-batches: several examples laid end to end in a sequence, each attending only to
//! itself with positions from its own start. The loss and every gradient of a packed batch are
//! those of the same examples one a sequence (each as it runs alone: causal attention never
//! reaches its padding), in both explicit engines, so no token sees across an example.

use std::path::Path;

use candle_core::Device;

use autotune::data::dataset::{Dataset, Example};
use autotune::data::pack::pack_rows;
use autotune::knobs::{Knobs, Precision};
use autotune::model::Engine;
use autotune::spec::model::ModelSpec;
use autotune::train::step::Trainer;

use crate::ops::assert_close;
use crate::util::{autotune_in, stderr};

/// The tiny Llama fixture (grouped-query attention, rotary positions) with room for 24 tokens.
fn tiny_llama() -> ModelSpec {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/tiny-llama/config.json");
    let mut spec = ModelSpec::from_file(&path).unwrap();
    spec.seq_len = 24;
    spec
}

/// Examples of 3 to 14 tokens from a seeded draw, the first few tokens of each untrained.
fn examples(vocab: u32) -> Vec<Example> {
    let mut state = 0x9E37_79B9u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    (0..9)
        .map(|i| {
            let len = 3 + (next() % 12) as usize;
            Example {
                ids: (0..len).map(|_| next() % vocab).collect(),
                trained: (0..len).map(|t| t > i % 3).collect(),
            }
        })
        .collect()
}

#[test]
fn a_packed_batch_has_the_loss_and_gradients_of_its_examples_one_a_sequence() {
    let spec = tiny_llama();
    let examples = examples(spec.vocab_size as u32);
    let (mut dataset, _) = Dataset::of_examples(&examples, spec.seq_len, 0).unwrap();
    let all: Vec<usize> = (0..dataset.len()).collect();
    let padded = dataset
        .host_batch(&all)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    dataset.set_packing(Some(spec.seq_len));
    let rows = pack_rows(
        &all,
        |i| dataset.get(i).unwrap().ids.len() - 1,
        spec.seq_len,
    );
    assert!(
        rows.len() < all.len() && rows.iter().any(|r| r.len() >= 3),
        "{rows:?}"
    );
    let packed = dataset
        .host_batch_of_rows(&rows)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    assert!(packed.positions.is_some());
    for engine in [Engine::Explicit, Engine::ExplicitMaterialized] {
        let mut trainer =
            Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 3).unwrap();
        trainer.set_engine(engine);
        let (want, want_loss) = trainer.gradients(std::slice::from_ref(&padded)).unwrap();
        let (got, got_loss) = trainer.gradients(std::slice::from_ref(&packed)).unwrap();
        assert!(
            ((got_loss - want_loss) / want_loss).abs() < 1e-5,
            "{engine:?}: packed loss {got_loss} against {want_loss}"
        );
        let names = trainer.model().params().names();
        for ((name, got), want) in names.iter().zip(&got).zip(&want) {
            assert_close(&format!("{engine:?} {name} gradient"), got, want, 1e-5);
        }
        // Evaluation of the packed batch is the same loss.
        let eval = trainer.eval_loss(&packed).unwrap();
        assert!(
            ((eval - want_loss) / want_loss).abs() < 1e-5,
            "{engine:?}: eval {eval}"
        );
    }
    // Positions by index instead (what packing without position ids would do) change the loss:
    // the comparison above can fail.
    let mut crossing = packed.narrow(0, packed.sequences()).unwrap();
    crossing.positions = None;
    let trainer = Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 3).unwrap();
    let (_, crossing_loss) = trainer.gradients(std::slice::from_ref(&crossing)).unwrap();
    let (_, want_loss) = trainer.gradients(std::slice::from_ref(&padded)).unwrap();
    assert!(((crossing_loss - want_loss) / want_loss).abs() > 1e-4);
}

/// A chat dataset of replies of very different lengths.
fn uneven_chat(dir: &Path) {
    let lines: Vec<String> = (0..40)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("Say {i}")},
                {"role": "assistant", "content": "la ".repeat(1 + (i * 7) % 13)},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("chat.jsonl"), lines.join("\n")).unwrap();
}

#[test]
fn records_train_packed_by_default_in_fewer_steps_an_epoch_and_pad_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let folder = crate::fine_tune::chat_model(dir.path());
    // Room for several conversations a sequence (the fixture tokenizer's tokens are short).
    let config = folder.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["max_position_embeddings"] = 512.into();
    std::fs::write(&config, json.to_string()).unwrap();
    uneven_chat(dir.path());
    let folder = folder.to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            &folder,
            "--device",
            "cpu",
            "--data",
            "chat.jsonl",
            "--micro-batch",
            "2",
            "--epochs",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = autotune_in(dir.path(), &args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["steps"].as_u64().unwrap()
    };
    let packed = run(&[]);
    let padded = run(&["--no-pack"]);
    assert_eq!(padded, 20, "40 examples at two a step");
    assert!(
        packed < padded / 2,
        "packed {packed} steps against {padded}"
    );
    assert_eq!(run(&["--pack"]), packed);
}

#[test]
fn packing_a_model_of_learned_positions_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..8)
        .map(|i| serde_json::json!({"text": "la ".repeat(1 + i)}).to_string())
        .collect();
    std::fs::write(dir.path().join("text.jsonl"), lines.join("\n")).unwrap();
    let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/data/tokenizers/llama3/tokenizer.json");
    let tokenizer = tokenizer.to_string_lossy().into_owned();
    let base = [
        "train",
        "--model",
        "gpt-124m",
        "--device",
        "cpu",
        "--data",
        "text.jsonl",
        "--tokenizer",
        &tokenizer,
        "--steps",
        "1",
        "--micro-batch",
        "1",
    ];
    let mut args = base.to_vec();
    args.push("--pack");
    let out = autotune_in(dir.path(), &args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("learns a position table") && stderr(&out).contains("--no-pack"),
        "{}",
        stderr(&out)
    );
}
