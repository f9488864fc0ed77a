//! Weights between a `transformers` checkpoint and a trainer: [`import_weights`] fills a
//! trainer's master weights from a checkpoint folder, [`export_weights`] turns one of our
//! checkpoints into a folder `transformers` loads (`config.json` and `model.safetensors`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

use super::layout::{canonical_name, is_buffer, layout, HfTensor, ParamLayout};
use super::safetensors::{Checkpoint, SafetensorsFile, Writer};
use crate::spec::model::hf::to_hf_config;
use crate::spec::model::ModelSpec;
use crate::train::step::Trainer;
use crate::{Error, Result};

/// The dtype of exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExportDtype {
    /// The f32 masters as they are.
    #[default]
    F32,
    /// Rounded to bf16, as most published checkpoints are (half the size).
    Bf16,
}

fn mismatch(path: &Path, problem: impl Into<String>) -> Error {
    Error::Weights {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// The first field in which `theirs` (from a checkpoint's config) computes something else than
/// `ours`: the architecture must agree; name, sequence length, dropout and optimizer may not.
fn architecture_difference(ours: &ModelSpec, theirs: &ModelSpec) -> Option<String> {
    let fields: [(&str, String, String); 13] = [
        (
            "vocab_size",
            ours.vocab_size.to_string(),
            theirs.vocab_size.to_string(),
        ),
        (
            "hidden size (d_model)",
            ours.d_model.to_string(),
            theirs.d_model.to_string(),
        ),
        (
            "attention heads",
            ours.n_heads.to_string(),
            theirs.n_heads.to_string(),
        ),
        (
            "key/value heads",
            ours.kv_heads().to_string(),
            theirs.kv_heads().to_string(),
        ),
        (
            "layers",
            ours.n_layers.to_string(),
            theirs.n_layers.to_string(),
        ),
        (
            "intermediate size (d_ff)",
            ours.d_ff.to_string(),
            theirs.d_ff.to_string(),
        ),
        ("causal", ours.causal.to_string(), theirs.causal.to_string()),
        (
            "norm",
            format!("{:?} {:?}", ours.norm, ours.norm_kind),
            format!("{:?} {:?}", theirs.norm, theirs.norm_kind),
        ),
        (
            "norm epsilon",
            ours.norm_eps.to_string(),
            theirs.norm_eps.to_string(),
        ),
        (
            "activation",
            format!("{:?}", ours.activation),
            format!("{:?}", theirs.activation),
        ),
        (
            "positions",
            format!("{:?}", ours.positions),
            format!("{:?}", theirs.positions),
        ),
        (
            "biases",
            format!("{:?}", ours.biases),
            format!("{:?}", theirs.biases),
        ),
        (
            "tied embeddings",
            ours.tied_embeddings.to_string(),
            theirs.tied_embeddings.to_string(),
        ),
    ];
    fields
        .into_iter()
        .find(|(_, a, b)| a != b)
        .map(|(field, a, b)| format!("its config.json has {field} {b} where the model has {a}"))
}

/// What [`import_weights`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Imported {
    /// Tensors read from the checkpoint.
    pub tensors: usize,
    /// Their elements.
    pub elements: usize,
}

/// Fills `trainer`'s master weights (and working copies) from the `transformers` checkpoint at
/// `path` (a folder with `model.safetensors` or a sharded index, or one file), in bf16, f16 or
/// f32. The folder's `config.json`, when there is one, must describe the trainer's model; every
/// parameter must be there with its shape, and every tensor must be used (buffers and a tied
/// head's copy aside).
pub fn import_weights(path: &Path, trainer: &mut Trainer) -> Result<Imported> {
    let spec = trainer.model().spec().clone();
    let (family, params) = layout(&spec).ok_or_else(|| {
        mismatch(
            path,
            format!(
                "model `{}` has no Hugging Face counterpart (Llama, Qwen 2, Mistral or GPT-2 \
                 shapes), so it cannot load their weights",
                spec.name
            ),
        )
    })?;
    check_config(path, &spec)?;
    let checkpoint = Checkpoint::open(path)?;
    // Our name for each of the checkpoint's tensors (GPT-2's prefix made uniform).
    let names: HashMap<String, String> = checkpoint
        .names()
        .map(|n| (canonical_name(family, n), n.to_string()))
        .collect();
    let by_param: HashMap<&str, &ParamLayout> =
        params.iter().map(|p| (p.param.as_str(), p)).collect();
    let model_params = trainer.model().params();
    let our_shapes: HashMap<String, Vec<usize>> = model_params
        .names()
        .iter()
        .zip(model_params.vars())
        .map(|(name, var)| (name.clone(), var.dims().to_vec()))
        .collect();
    let mut used = HashSet::new();
    let mut elements = 0usize;
    trainer
        .load_master_weights_with(&mut |param| {
            let layout = by_param
                .get(param)
                .ok_or_else(|| format!("parameter `{param}` has no Hugging Face tensor"))?;
            let mut parts = Vec::with_capacity(layout.parts.len());
            for part in &layout.parts {
                let stored = names
                    .get(&part.name)
                    .ok_or_else(|| format!("tensor `{}` is missing", part.name))?;
                let ours = our_shapes.get(param).map_or(&[][..], Vec::as_slice);
                let t = read_part(&checkpoint, stored, part, ours)?;
                elements += t.elem_count();
                used.insert(stored.clone());
                parts.push(t);
            }
            match parts.len() {
                1 => Ok(parts.remove(0)),
                _ => Tensor::cat(&parts, 0).map_err(|e| e.to_string()),
            }
        })
        .map_err(|problem| mismatch(path, problem))?;
    check_all_used(path, &checkpoint, &used, &spec)?;
    Ok(Imported {
        tensors: used.len(),
        elements,
    })
}

/// Checks that the `config.json` beside a checkpoint folder at `path`, if there is one,
/// describes `spec`'s architecture.
fn check_config(path: &Path, spec: &ModelSpec) -> Result<()> {
    let config = path.join("config.json");
    if path.is_dir() && config.is_file() {
        // Read as `--model` reads it, so that its errors name the file and field the same way.
        let theirs = ModelSpec::from_file(&config)?;
        if let Some(difference) = architecture_difference(spec, &theirs) {
            return Err(mismatch(
                path,
                format!("{difference}: it holds another model"),
            ));
        }
    }
    Ok(())
}

/// The shape of `part` of our parameter of shape `ours` as a checkpoint stores it: its rows
/// of ours, transposed where the format stores it so; `None` for a parameter without rows.
fn stored_shape(ours: &[usize], part: &HfTensor) -> Option<Vec<usize>> {
    let mut shape = ours.to_vec();
    *shape.first_mut()? = part.rows;
    if part.transposed {
        shape.reverse();
    }
    Some(shape)
}

/// The checkpoint's tensor `stored` as `part` of one of our parameters (of shape `ours`): in
/// f32, in our orientation. Its shape is checked before its bytes are read, so a header that
/// claims a huge tensor is refused, not allocated.
fn read_part(
    checkpoint: &Checkpoint,
    stored: &str,
    part: &HfTensor,
    ours: &[usize],
) -> std::result::Result<Tensor, String> {
    let want = stored_shape(ours, part);
    let found = checkpoint.shape(stored).unwrap_or(&[]);
    if want.as_deref() != Some(found) {
        return Err(format!(
            "tensor `{}` has shape {found:?}; the model needs {:?} there",
            part.name,
            want.unwrap_or_default()
        ));
    }
    let t = checkpoint.read(stored).map_err(|e| e.to_string())?;
    let t = t.to_dtype(DType::F32).map_err(|e| e.to_string())?;
    let t = if part.transposed {
        t.t()
            .and_then(|t| t.contiguous())
            .map_err(|e| e.to_string())?
    } else {
        t
    };
    Ok(t)
}

/// Checks that every tensor of `checkpoint` at `path` was `used`, buffers and a tied head's
/// copy of the embeddings aside.
fn check_all_used(
    path: &Path,
    checkpoint: &Checkpoint,
    used: &HashSet<String>,
    spec: &ModelSpec,
) -> Result<()> {
    let tied_copy = |n: &str| spec.tied_embeddings && n == "lm_head.weight";
    let mut unused: Vec<&str> = checkpoint
        .names()
        .filter(|n| !used.contains(*n) && !is_buffer(n) && !tied_copy(n))
        .collect();
    unused.sort();
    if let Some(first) = unused.first() {
        return Err(mismatch(
            path,
            format!(
                "tensor `{first}` (and {} more) has no place in model `{}`: the checkpoint holds \
                 another model",
                unused.len() - 1,
                spec.name
            ),
        ));
    }
    Ok(())
}

/// What [`export_weights`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    /// The folder written.
    pub folder: PathBuf,
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// The `transformers` class that loads it.
    pub architecture: &'static str,
    /// The tokenizer's folder its files were copied from, and the files; `None` when no
    /// tokenizer was known.
    pub tokenizer: Option<(PathBuf, Vec<String>)>,
}

/// Writes the f32 masters of our checkpoint `checkpoint` (a `step-NNNNNN` folder) as a
/// `transformers` folder `out`: `config.json` and `model.safetensors` (metadata `format: pt`),
/// and the tokenizer of `tokenizer` (a folder or its `tokenizer.json`; by default the one the
/// run's data was read with) with its special tokens' ids and a `generation_config.json`.
pub fn export_weights(
    checkpoint: &Path,
    out: &Path,
    dtype: ExportDtype,
    tokenizer: Option<&Path>,
) -> Result<Exported> {
    let state = crate::train::checkpoint::read_state(checkpoint)?;
    let tokenizer = tokenizer
        .map(super::tokenizer_files::folder)
        .or_else(|| super::tokenizer_files::used_by(&state.data));
    let spec = state.model;
    let (family, params) = layout(&spec).ok_or_else(|| {
        mismatch(
            checkpoint,
            format!(
                "model `{}` has no Hugging Face counterpart (Llama, Qwen 2, Mistral or GPT-2 shapes)",
                spec.name
            ),
        )
    })?;
    let config = to_hf_config(&spec)
        .ok_or_else(|| mismatch(checkpoint, "no Hugging Face config describes this model"))?;
    let ours = SafetensorsFile::open(&checkpoint.join("model.safetensors"))?;
    let shapes = export_shapes(checkpoint, &ours, &params, &spec)?;
    std::fs::create_dir_all(out).map_err(|e| Error::file("cannot create", out, e))?;
    let store = match dtype {
        ExportDtype::F32 => DType::F32,
        ExportDtype::Bf16 => DType::BF16,
    };
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let count = shapes.len();
    let mut writer = Writer::create(&out.join("model.safetensors"), shapes, store, &metadata)?;
    for p in &params {
        let t = ours.read(&p.param)?;
        for part in &p.parts {
            let piece = t.narrow(0, part.row, part.rows)?;
            let piece = if part.transposed {
                piece.t()?.contiguous()?
            } else {
                piece
            };
            writer.write(&piece)?;
        }
    }
    writer.finish()?;
    let mut config = config;
    if let (Some(c), ExportDtype::Bf16) = (config.as_object_mut(), dtype) {
        c.insert("torch_dtype".into(), "bfloat16".into());
    }
    let tokenizer = match tokenizer {
        Some(from) => {
            let copied = super::tokenizer_files::export(&from, out, &mut config)?;
            Some((from, copied))
        }
        None => None,
    };
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::internal(e.to_string()))?;
    crate::train::checkpoint::write_atomic(&out.join("config.json"), text.as_bytes())?;
    Ok(Exported {
        folder: out.to_path_buf(),
        tensors: count,
        architecture: family.architecture(),
        tokenizer,
    })
}

/// The tensors an export writes, with their shapes, from our checkpoint's file `ours`. The
/// parts must cover each parameter's rows: a header with other rows is refused here, before
/// any tensor is read or cut.
fn export_shapes(
    checkpoint: &Path,
    ours: &SafetensorsFile,
    params: &[ParamLayout],
    spec: &ModelSpec,
) -> Result<Vec<(String, Vec<usize>)>> {
    let mut shapes = Vec::new();
    for p in params {
        let dims = ours
            .shape(&p.param)
            .ok_or_else(|| mismatch(checkpoint, format!("has no parameter `{}`", p.param)))?;
        let rows: usize = p.parts.iter().map(|part| part.rows).sum();
        if dims.first() != Some(&rows) {
            return Err(mismatch(
                checkpoint,
                format!(
                    "parameter `{}` has shape {dims:?}; model `{}` has {rows} rows there",
                    p.param, spec.name
                ),
            ));
        }
        for part in &p.parts {
            let shape = stored_shape(dims, part).unwrap_or_default();
            shapes.push((part.name.clone(), shape));
        }
    }
    Ok(shapes)
}
