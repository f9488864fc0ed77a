//! Llama-, Qwen- and Mistral-style decoders and GPT-2 from Hugging Face: published configs as
//! `--model`, parameter counts, weights in and out, and the engines against `transformers`.
//!
//! `tests/fixtures/hf/tiny-*` hold tiny random models saved by `transformers` (float32, eager
//! attention) with their logits, loss and every parameter's gradient on one batch
//! (`tests/fixtures/hf/generate.py` writes them). Tolerances: logits and the loss to 1e-5 of
//! their magnitude, gradients to 1e-4 of each tensor's largest entry (f32 sums in another order,
//! and autotune's rotary angles from f32 products as `transformers`' own).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use autotune::data::source::DataSpec;
use autotune::hf::layout::layout;
use autotune::hf::safetensors::Checkpoint;
use autotune::hf::{export_weights, import_weights, ExportDtype};
use autotune::knobs::{Knobs, Precision};
use autotune::model::batch::Batch;
use autotune::model::dropout::Dropout;
use autotune::model::{Ctx, Engine};
use autotune::spec::model::ModelSpec;
use autotune::train::step::Trainer;

use crate::ops::assert_close;
use crate::util::{autotune, stderr};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

#[test]
fn published_configs_read_to_the_published_parameter_counts() {
    for (file, parameters, preset) in [
        ("Llama-3.2-1B.json", 1_235_814_400, Some("llama-3.2-1b")),
        ("Llama-3.1-8B.json", 8_030_261_248, Some("llama-3.1-8b")),
        ("SmolLM2-135M.json", 134_515_008, Some("smollm2-135m")),
        ("Qwen2.5-0.5B.json", 494_032_768, Some("qwen2.5-0.5b")),
        ("Qwen2.5-1.5B.json", 1_543_714_304, Some("qwen2.5-1.5b")),
        ("Mistral-7B-v0.1.json", 7_241_732_096, Some("mistral-7b")),
        ("gpt2.json", 124_439_808, None),
    ] {
        let spec = ModelSpec::from_file(&fixture("published").join(file)).unwrap();
        assert_eq!(spec.parameter_count(), parameters, "{file}");
        if let Some(preset) = preset {
            let preset = ModelSpec::preset(preset).unwrap();
            assert_eq!(
                ModelSpec {
                    name: preset.name.clone(),
                    ..spec.clone()
                },
                preset,
                "{file}: the preset has the config's shape"
            );
        }
    }
}

#[test]
fn a_config_field_that_cannot_be_honoured_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("published").join("Mistral-7B-v0.1.json")).unwrap(),
    )
    .unwrap();
    for (field, value) in [
        ("sliding_window", serde_json::json!(1024)),
        ("hidden_act", serde_json::json!("gelu")),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        ),
        ("attention_dropout", serde_json::json!(0.1)),
        ("head_dim", serde_json::json!(96)),
        ("qk_layernorm", serde_json::json!(true)),
    ] {
        let mut config = base.clone();
        config[field] = value;
        let path = dir.path().join("config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let out = autotune(&["probe", "--model", path.to_str().unwrap(), "--json"]);
        assert_eq!(out.status.code(), Some(2), "{field}: {}", stderr(&out));
        let message = stderr(&out);
        assert!(message.contains(field), "{field} not named: {message}");
        assert!(message.contains("config.json"), "file not named: {message}");
    }
}

/// The fixture's batch and reference values.
struct Reference {
    batch: Batch,
    loss: f64,
    logits: Tensor,
    grads: HashMap<String, Tensor>,
}

fn reference(dir: &Path) -> Reference {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let tokens =
        |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(json[key].clone()).unwrap() };
    let (inputs, targets) = (tokens("inputs"), tokens("targets"));
    let (b, s) = (inputs.len(), inputs[0].len());
    let flat = |v: Vec<Vec<u32>>| v.into_iter().flatten().collect::<Vec<u32>>();
    let batch = Batch::new(
        Tensor::from_vec(flat(inputs), (b, s), &Device::Cpu).unwrap(),
        Tensor::from_vec(flat(targets), b * s, &Device::Cpu).unwrap(),
    );
    let file = Checkpoint::open(&dir.join("reference.safetensors")).unwrap();
    let grads = file
        .names()
        .filter_map(|n| {
            n.strip_prefix("grad.")
                .map(|p| (p.to_string(), file.read(n).unwrap()))
        })
        .collect();
    Reference {
        batch,
        loss: json["loss"].as_f64().unwrap(),
        logits: file.read("logits").unwrap(),
        grads,
    }
}

/// A trainer for the fixture's model, with its weights.
fn loaded(dir: &Path) -> Trainer {
    let spec = ModelSpec::from_file(&dir.join("config.json")).unwrap();
    let mut trainer = Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 0).unwrap();
    import_weights(dir, &mut trainer).unwrap();
    trainer
}

/// Our gradients (parameter order) by `transformers` name: bands of our fused products split
/// off, GPT-2's transposed back.
fn by_hf_name(trainer: &Trainer, grads: &[Tensor]) -> HashMap<String, Tensor> {
    let (_, params) = layout(trainer.model().spec()).unwrap();
    let ours: HashMap<&str, &Tensor> = trainer
        .model()
        .params()
        .names()
        .iter()
        .map(String::as_str)
        .zip(grads)
        .collect();
    let mut out = HashMap::new();
    for p in &params {
        for part in &p.parts {
            let g = ours[p.param.as_str()]
                .narrow(0, part.row, part.rows)
                .unwrap();
            let g = if part.transposed {
                g.t().unwrap().contiguous().unwrap()
            } else {
                g
            };
            out.insert(part.name.clone(), g);
        }
    }
    out
}

#[test]
fn the_engines_match_transformers_on_its_own_weights() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-gpt2"] {
        let dir = fixture(name);
        let want = reference(&dir);
        let mut trainer = loaded(&dir);
        // Logits of the same forward pass.
        let ctx = Ctx {
            dropout: Dropout::disabled(),
            engine: Engine::Composite,
        };
        let logits = trainer
            .model()
            .forward(&want.batch.inputs, DType::F32, &ctx)
            .unwrap();
        assert_close(&format!("{name} logits"), &logits, &want.logits, 1e-5);
        for engine in [Engine::Composite, Engine::Explicit] {
            trainer.set_engine(engine);
            let (grads, loss) = trainer
                .gradients(std::slice::from_ref(&want.batch))
                .unwrap();
            let what = format!("{name} {engine:?}");
            assert!(
                ((loss - want.loss) / want.loss).abs() < 1e-5,
                "{what}: loss {loss} vs {}",
                want.loss
            );
            let ours = by_hf_name(&trainer, &grads);
            // transformers saves GPT-2's parameters under `transformer.`; its gradients are named
            // as its modules are.
            for (hf, reference) in &want.grads {
                let key = if name == "tiny-gpt2"
                    && !hf.starts_with("transformer.")
                    && hf != "lm_head.weight"
                {
                    format!("transformer.{hf}")
                } else {
                    hf.clone()
                };
                if key == "lm_head.weight" && trainer.model().spec().tied_embeddings {
                    continue;
                }
                let got = ours
                    .get(&key)
                    .unwrap_or_else(|| panic!("{what}: no gradient for {key}"));
                assert_close(&format!("{what} {key} gradient"), got, reference, 1e-4);
            }
        }
    }
}

/// Copies of the parameters of a trainer, by name, as f32 CPU tensors (a `Var`'s tensor is
/// updated in place by the optimizer).
fn parameters(trainer: &Trainer) -> HashMap<String, Tensor> {
    let names = trainer.model().params().names().to_vec();
    names
        .into_iter()
        .zip(trainer.master_weights().unwrap())
        .map(|(n, t)| (n, t.to_dtype(DType::F32).unwrap().copy().unwrap()))
        .collect()
}

#[test]
fn weights_round_trip_through_a_checkpoint_and_an_export() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-gpt2"] {
        let dir = tempfile::tempdir().unwrap();
        let mut trainer = loaded(&fixture(name));
        // A few steps, so that what goes out is no longer what came in.
        let spec = trainer.model().spec().clone();
        let data = autotune::data::source::Data::open(&DataSpec::Pattern, &spec).unwrap();
        let before = parameters(&trainer);
        for _ in 0..2 {
            trainer.step(&data).unwrap();
        }
        let trained = parameters(&trainer);
        let change = (&trained["embed.weight"] - &before["embed.weight"])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(change > 0.0, "{name}: training changed nothing");
        let saved = autotune::train::checkpoint::save(
            &dir.path().join("ckpt"),
            &trainer,
            &DataSpec::Pattern,
            0,
        )
        .unwrap();
        let out = dir.path().join("hf");
        let exported = export_weights(&saved, &out, ExportDtype::F32, None).unwrap();
        assert!(out.join("config.json").is_file() && out.join("model.safetensors").is_file());
        // The exported config reads back to the same model, and the weights to the same values.
        let spec_back = ModelSpec::from_file(&out.join("config.json")).unwrap();
        assert_eq!(
            ModelSpec {
                name: spec.name.clone(),
                optimizer: spec.optimizer,
                ..spec_back
            },
            spec,
            "{name}: config"
        );
        let mut again =
            Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 5).unwrap();
        import_weights(&out, &mut again).unwrap();
        let back = parameters(&again);
        for (param, t) in &trained {
            assert_close(&format!("{name} {param} round trip"), &back[param], t, 0.0);
        }
        // transformers checks the `format` metadata; the header carries it.
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt", "{name}");
        assert_eq!(exported.tensors, header.as_object().unwrap().len() - 1);
        // bf16: half the bytes, the values rounded.
        let half = dir.path().join("hf-bf16");
        export_weights(&saved, &half, ExportDtype::Bf16, None).unwrap();
        let size = |p: &Path| {
            std::fs::metadata(p.join("model.safetensors"))
                .unwrap()
                .len()
        };
        assert!(
            size(&half) * 2 < size(&out) + 4096,
            "{name}: bf16 is half the size"
        );
        let mut rounded =
            Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 5).unwrap();
        import_weights(&half, &mut rounded).unwrap();
        for (param, t) in parameters(&rounded) {
            assert_close(&format!("{name} {param} bf16"), &t, &trained[&param], 1e-2);
        }
    }
}

#[test]
fn weights_of_another_model_are_refused_naming_what_differs() {
    let dir = tempfile::tempdir().unwrap();
    // The Llama fixture's weights into a model with one more layer: the config says otherwise.
    let mut spec = ModelSpec::from_file(&fixture("tiny-llama").join("config.json")).unwrap();
    spec.n_layers += 1;
    let mut trainer = Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 0).unwrap();
    let err = import_weights(&fixture("tiny-llama"), &mut trainer)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layers") && err.contains("config.json"),
        "{err}"
    );
    // Without the config, the missing tensor is named.
    std::fs::copy(
        fixture("tiny-llama").join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = import_weights(dir.path(), &mut trainer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.2."), "{err}");
    // A tensor with no place in the model is named too.
    spec.n_layers -= 2;
    let mut smaller = Trainer::new(&spec, Knobs::new(2, Precision::Fp32), &Device::Cpu, 0).unwrap();
    let err = import_weights(dir.path(), &mut smaller)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.") && err.contains("no place"),
        "{err}"
    );
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let dir = tempfile::tempdir().unwrap();
    let source = fixture("tiny-qwen2");
    let file = Checkpoint::open(&source).unwrap();
    // Two shards and an index, as save_pretrained writes past its shard size.
    let mut names: Vec<String> = file.names().map(String::from).collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (shard, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let tensors: HashMap<String, Tensor> = part
            .iter()
            .map(|n| (n.clone(), file.read(n).unwrap()))
            .collect();
        candle_core::safetensors::save(&tensors, dir.path().join(shard)).unwrap();
        for n in part {
            map.insert(n.clone(), shard.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(source.join("config.json"), dir.path().join("config.json")).unwrap();
    let whole = parameters(&loaded(&source));
    let sharded = parameters(&loaded(dir.path()));
    for (param, t) in &whole {
        assert_close(&format!("{param} sharded"), &sharded[param], t, 0.0);
    }
}
