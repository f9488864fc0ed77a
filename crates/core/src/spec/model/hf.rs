//! Hugging Face `config.json` files of `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `MistralForCausalLM` and `GPT2LMHeadModel`, read into a [`ModelSpec`] and written back from
//! one.
//!
//! Every field of a config is either honoured, checked to be a value the engine computes the
//! same way (a sliding window no longer than the sequence, no attention dropout, ...), or one
//! of the few that say nothing about the computation (token ids, the `transformers` version,
//! the stored dtype). Any other field is an error naming it: a setting that would be silently
//! dropped would train another model than the user's.
//!
//! Sequences: a config gives the longest context the model supports, not the length to train
//! at. Rotary models train at [`DECODER_SEQ_LEN`] tokens (or their maximum, if shorter);
//! GPT-2 at its `n_positions`, the size of its learned position table. A spec file
//! `{"hf_config": "path/config.json", "seq_len": 4096}` overrides that (see
//! [`ModelSpec::from_file`]).

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::{
    Activation, Biases, ModelSpec, NormKind, NormPlacement, OptimizerSpec, Positions,
    DECODER_SEQ_LEN,
};
use crate::text::escape_controls;
use crate::{Error, Result};

mod config_terms;
mod descriptive;
mod rope;

pub(super) const WHAT: &str = "Hugging Face config";

/// The config's `field` is invalid for `problem`.
fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Error {
    Error::invalid(WHAT, field, problem)
}

/// The model families read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM` (`model_type` `llama`).
    Llama,
    /// `Qwen2ForCausalLM` (`qwen2`): biases on q, k and v.
    Qwen2,
    /// `MistralForCausalLM` (`mistral`): a sliding attention window.
    Mistral,
    /// `GPT2LMHeadModel` (`gpt2`).
    Gpt2,
}

impl Family {
    const ALL: [(Family, &'static str, &'static str); 4] = [
        (Family::Llama, "LlamaForCausalLM", "llama"),
        (Family::Qwen2, "Qwen2ForCausalLM", "qwen2"),
        (Family::Mistral, "MistralForCausalLM", "mistral"),
        (Family::Gpt2, "GPT2LMHeadModel", "gpt2"),
    ];

    /// The class name `transformers` loads the model with.
    pub fn architecture(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(f, ..)| *f == self)
            .map_or("", |e| e.1)
    }

    /// The config's `model_type`.
    pub fn model_type(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(f, ..)| *f == self)
            .map_or("", |e| e.2)
    }
}

/// Whether a JSON document looks like a Hugging Face config rather than a spec of ours.
pub fn is_hf_config(value: &Value) -> bool {
    value.get("model_type").is_some() || value.get("architectures").is_some()
}

/// A config's fields, each taken at most once; what is left at the end was not understood.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    used: BTreeSet<&'a str>,
}

impl<'a> Fields<'a> {
    fn value(&mut self, key: &'a str) -> Option<&'a Value> {
        self.used.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&mut self, key: &'a str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::invalid(WHAT, key, "is missing; it gives the model's shape"))
    }

    fn opt_usize(&mut self, key: &'a str) -> Result<Option<usize>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| Error::invalid(WHAT, key, format!("({v}) must be a whole number"))),
        }
    }

    fn opt_f64(&mut self, key: &'a str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::invalid(WHAT, key, format!("({v}) must be a number"))),
        }
    }

    fn opt_bool(&mut self, key: &'a str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Error::invalid(WHAT, key, format!("({v}) must be true or false"))),
        }
    }

    /// A field that must be absent or equal to what the engine computes.
    fn expect(&mut self, key: &'a str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<()> {
        match self.value(key) {
            Some(v) if !ok(v) => Err(Error::invalid(
                WHAT,
                key,
                format!("({v}) is not supported: {why}"),
            )),
            _ => Ok(()),
        }
    }

    /// Fails on the first field neither read nor descriptive, or descriptive but not of its
    /// kind.
    fn finish(self) -> Result<()> {
        for (key, value) in self.map {
            if self.used.contains(key.as_str()) {
                continue;
            }
            if !descriptive::is_descriptive(key) {
                return Err(invalid(
                    escape_controls(key),
                    "is a setting autotune cannot honour, so it would train a different model; \
                     remove it if it does not change the computation, or use a spec file",
                ));
            }
            descriptive::check(key, value)?;
        }
        Ok(())
    }
}

/// The family a config names by `architectures` and `model_type`: where both are given they
/// must agree, since `transformers` builds the class `architectures` names with the settings
/// `model_type`'s config class reads.
fn family(map: &Map<String, Value>) -> Result<Family> {
    let by_class = match map.get("architectures").filter(|v| !v.is_null()) {
        Some(list) => Some(family_of_architectures(list)?),
        None => None,
    };
    let by_type = match map.get("model_type").filter(|v| !v.is_null()) {
        Some(t) => Some(family_of_model_type(t)?),
        None => None,
    };
    match (by_class, by_type) {
        (Some(class), Some(kind)) if class != kind => Err(invalid(
            "architectures",
            format!(
                "([\"{}\"]) disagrees with model_type (\"{}\"): one config describes one \
                 model; make model_type \"{}\" or architectures [\"{}\"]",
                class.architecture(),
                kind.model_type(),
                class.model_type(),
                kind.architecture()
            ),
        )),
        (Some(family), _) | (None, Some(family)) => Ok(family),
        (None, None) => Err(invalid(
            "model_type",
            format!("is missing; give one of {}", known_model_types()),
        )),
    }
}

/// The one family every entry of `architectures` names.
fn family_of_architectures(list: &Value) -> Result<Family> {
    let entries = list.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        invalid(
            "architectures",
            format!("({list}) must be a list of class names such as [\"LlamaForCausalLM\"]"),
        )
    })?;
    let mut found = None;
    for entry in entries {
        let family = entry.as_str().and_then(|name| {
            Family::ALL
                .iter()
                .find(|(_, arch, _)| *arch == name)
                .map(|e| e.0)
        });
        match (family, found) {
            (None, _) => {
                return Err(invalid(
                    "architectures",
                    format!(
                        "({entry}) names no model autotune builds; it reads {}",
                        known_families()
                    ),
                ))
            }
            (Some(f), Some(g)) if f != g => {
                return Err(invalid(
                    "architectures",
                    format!("({list}) names two models; keep the one the weights are"),
                ))
            }
            (Some(f), _) => found = Some(f),
        }
    }
    found.ok_or_else(|| invalid("architectures", "is empty"))
}

/// The family `model_type` names.
fn family_of_model_type(value: &Value) -> Result<Family> {
    let name = value.as_str().unwrap_or_default();
    Family::ALL
        .iter()
        .find(|(.., t)| *t == name)
        .map(|e| e.0)
        .ok_or_else(|| {
            invalid(
                "model_type",
                format!(
                    "({value}) is not one autotune builds; it reads {}",
                    known_model_types()
                ),
            )
        })
}

fn known_model_types() -> String {
    Family::ALL
        .iter()
        .map(|(.., t)| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

fn known_families() -> String {
    Family::ALL
        .iter()
        .map(|(_, arch, _)| *arch)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads a Hugging Face config (already parsed) into a spec named `name`.
pub fn from_hf_config(config: &Value, name: &str) -> Result<ModelSpec> {
    let map = config
        .as_object()
        .ok_or_else(|| Error::invalid(WHAT, crate::json::DOCUMENT, "must be a JSON object"))?;
    let family = family(map)?;
    let mut f = Fields {
        map,
        used: BTreeSet::new(),
    };
    let spec = match family {
        Family::Gpt2 => gpt2(&mut f, name)?,
        Family::Llama | Family::Qwen2 | Family::Mistral => decoder(&mut f, family, name)?,
    };
    f.finish()?;
    spec.validate()
        .map_err(|e| config_terms::in_config_terms(e, family, map))?;
    Ok(spec)
}

/// A Llama, Qwen 2 or Mistral config. The fields are read in a fixed order, so that of several
/// bad ones the same is named every time.
fn decoder<'a>(f: &mut Fields<'a>, family: Family, name: &str) -> Result<ModelSpec> {
    let shape = attention_shape(f)?;
    check_decoder_computation(f)?;
    check_sliding_window(f, family, shape.seq_len)?;
    let biases = decoder_biases(f, family)?;
    let rope = rope::rope(f)?;
    Ok(ModelSpec {
        name: name.into(),
        vocab_size: f.usize("vocab_size")?,
        d_model: shape.hidden,
        n_heads: shape.heads,
        n_layers: f.usize("num_hidden_layers")?,
        d_ff: f.usize("intermediate_size")?,
        seq_len: shape.seq_len,
        causal: true,
        norm: NormPlacement::Pre,
        activation: Activation::Swiglu,
        positions: Positions::Rotary(rope),
        dropout: 0.0,
        norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
        optimizer: OptimizerSpec::adamw(3e-4),
        norm_kind: NormKind::Rms,
        n_kv_heads: Some(shape.kv_heads),
        biases,
        // Llama's and Mistral's default is untied; Qwen 2's configs always say.
        tied_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
    })
}

/// A decoder's width, heads and the length it trains at.
struct AttentionShape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    seq_len: usize,
}

/// The width, the query and key/value heads (as many as the queries' unless given), and the
/// training length: [`DECODER_SEQ_LEN`], or the model's maximum if shorter. A `head_dim` must
/// be the width over the heads, the only head width the engine builds.
fn attention_shape(f: &mut Fields<'_>) -> Result<AttentionShape> {
    let hidden = f.usize("hidden_size")?;
    let heads = f.usize("num_attention_heads")?;
    let kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(heads);
    let max_positions = f
        .opt_usize("max_position_embeddings")?
        .unwrap_or(DECODER_SEQ_LEN);
    let seq_len = DECODER_SEQ_LEN.min(max_positions);
    if let Some(head_dim) = f.opt_usize("head_dim")? {
        if head_dim.checked_mul(heads) != Some(hidden) || heads == 0 {
            return Err(Error::invalid(
                WHAT,
                "head_dim",
                format!(
                    "({head_dim}) must be hidden_size / num_attention_heads ({hidden} / {heads}): \
                     heads of another width are not supported"
                ),
            ));
        }
    }
    Ok(AttentionShape {
        hidden,
        heads,
        kv_heads,
        seq_len,
    })
}

/// The settings a decoder's config may carry only at the value the engine computes with.
fn check_decoder_computation(f: &mut Fields<'_>) -> Result<()> {
    f.expect(
        "hidden_act",
        |v| v == "silu",
        "the feed-forward is SwiGLU, whose gate runs SiLU (\"silu\")",
    )?;
    f.expect(
        "attention_dropout",
        |v| v.as_f64() == Some(0.0),
        "attention dropout must be 0.0",
    )?;
    f.expect(
        "layer_types",
        |v| {
            v.as_array()
                .is_some_and(|a| a.iter().all(|t| t == "full_attention"))
        },
        "every layer must attend to the whole sequence (\"full_attention\")",
    )?;
    f.expect(
        "use_mrope",
        |v| v == false,
        "multimodal rotary sections are not supported",
    )?;
    f.expect(
        "rope_interleaved",
        |v| v == false,
        "rotary pairs are (i, i + hd/2) (\"rotate half\"), not interleaved",
    )?;
    f.expect(
        "pretraining_tp",
        |v| v.as_u64() == Some(1),
        "tensor-parallel slicing of the projections must be 1",
    )
}

/// A sliding attention window that applies must span the whole training sequence: windowed
/// attention is not built.
fn check_sliding_window(f: &mut Fields<'_>, family: Family, seq_len: usize) -> Result<()> {
    // Qwen 2 runs a sliding window only where `use_sliding_window` is true; Mistral always.
    let window_applies = match family {
        Family::Qwen2 => f.opt_bool("use_sliding_window")?.unwrap_or(false),
        _ => true,
    };
    if let Some(window) = f.opt_usize("sliding_window")? {
        if window_applies && window < seq_len {
            return Err(Error::invalid(
                WHAT,
                "sliding_window",
                format!(
                    "({window}) is shorter than the {seq_len} tokens trained at: windowed attention \
                     is not supported; train at seq_len ≤ {window} (a spec file \
                     {{\"hf_config\": ..., \"seq_len\": {window}}})"
                ),
            ));
        }
    }
    Ok(())
}

/// Qwen 2's biases are on q, k and v, always; Llama's and Mistral's as `attention_bias` and
/// `mlp_bias` say (none by default). Qwen 2 reads neither field, so either is an error there.
fn decoder_biases(f: &mut Fields<'_>, family: Family) -> Result<Biases> {
    Ok(match family {
        Family::Qwen2 => Biases {
            qkv: true,
            ..Biases::NONE
        },
        _ => {
            let attention = f.opt_bool("attention_bias")?.unwrap_or(false);
            let mlp = f.opt_bool("mlp_bias")?.unwrap_or(false);
            Biases {
                qkv: attention,
                out: attention,
                mlp,
                head: false,
            }
        }
    })
}

fn gpt2<'a>(f: &mut Fields<'a>, name: &str) -> Result<ModelSpec> {
    let d = f.usize("n_embd")?;
    let positions = f.usize("n_positions")?;
    f.expect(
        "activation_function",
        |v| v == "gelu_new" || v == "gelu_pytorch_tanh",
        "the feed-forward runs GELU's tanh approximation (\"gelu_new\")",
    )?;
    for (key, why) in [
        (
            "scale_attn_by_inverse_layer_idx",
            "scores are scaled by 1/√head_dim only",
        ),
        (
            "reorder_and_upcast_attn",
            "attention accumulates in f32 already; the reordering is not supported",
        ),
        (
            "add_cross_attention",
            "a causal decoder has no cross-attention",
        ),
    ] {
        f.expect(key, |v| v == false, why)?;
    }
    f.expect(
        "scale_attn_weights",
        |v| v == true,
        "scores are scaled by 1/√head_dim",
    )?;
    // One dropout probability serves embeddings, attention and residuals.
    let mut dropout: Option<f64> = None;
    for key in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        if let Some(p) = f.opt_f64(key)? {
            match dropout {
                Some(q) if q != p => {
                    return Err(Error::invalid(
                        WHAT,
                        key,
                        format!(
                            "({p}) differs from the other dropout probabilities ({q}); one \
                             probability serves embeddings, attention and residuals"
                        ),
                    ))
                }
                _ => dropout = Some(p),
            }
        }
    }
    // `transformers`' default width; a width past any bound is refused by the spec's checks.
    let d_ff = f.opt_usize("n_inner")?.unwrap_or(d.saturating_mul(4));
    Ok(ModelSpec {
        name: name.into(),
        vocab_size: f.usize("vocab_size")?,
        d_model: d,
        n_heads: f.usize("n_head")?,
        n_layers: f.usize("n_layer")?,
        d_ff,
        seq_len: positions,
        causal: true,
        norm: NormPlacement::Pre,
        activation: Activation::Gelu,
        positions: Positions::Learned,
        dropout: dropout.unwrap_or(0.1) as f32,
        norm_eps: f.opt_f64("layer_norm_epsilon")?.unwrap_or(1e-5),
        optimizer: OptimizerSpec::adamw(3e-4),
        norm_kind: NormKind::Layer,
        n_kv_heads: None,
        biases: Biases {
            head: false,
            ..Biases::ALL
        },
        tied_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
    })
}

/// The family whose `transformers` class computes what `spec` does, if any.
pub fn family_of(spec: &ModelSpec) -> Option<Family> {
    let decoder = spec.causal
        && spec.norm == NormPlacement::Pre
        && spec.dropout == 0.0
        && spec.norm_kind == NormKind::Rms
        && spec.activation == Activation::Swiglu
        && matches!(spec.positions, Positions::Rotary(_))
        && !spec.biases.head;
    let b = spec.biases;
    if decoder {
        return match (b.qkv, b.out, b.mlp) {
            (true, false, false) => Some(Family::Qwen2),
            (q, o, _) if q == o => Some(Family::Llama),
            _ => None,
        };
    }
    let gpt2 = spec.causal
        && spec.norm == NormPlacement::Pre
        && spec.norm_kind == NormKind::Layer
        && spec.activation == Activation::Gelu
        && spec.positions == Positions::Learned
        && spec.n_kv_heads.is_none_or(|kv| kv == spec.n_heads)
        && b == Biases {
            head: false,
            ..Biases::ALL
        }
        && spec.tied_embeddings;
    gpt2.then_some(Family::Gpt2)
}

/// The `config.json` that makes `transformers` build the model `spec` describes; `None` when no
/// family computes it (see [`family_of`]).
pub fn to_hf_config(spec: &ModelSpec) -> Option<Value> {
    let family = family_of(spec)?;
    let mut c = Map::new();
    c.insert(
        "architectures".into(),
        serde_json::json!([family.architecture()]),
    );
    c.insert("model_type".into(), family.model_type().into());
    c.insert("vocab_size".into(), spec.vocab_size.into());
    c.insert("tie_word_embeddings".into(), spec.tied_embeddings.into());
    c.insert("torch_dtype".into(), "float32".into());
    if family == Family::Gpt2 {
        for (k, v) in [
            ("n_embd", spec.d_model),
            ("n_head", spec.n_heads),
            ("n_layer", spec.n_layers),
            ("n_inner", spec.d_ff),
            ("n_positions", spec.seq_len),
            ("n_ctx", spec.seq_len),
        ] {
            c.insert(k.into(), v.into());
        }
        let p = f64::from(spec.dropout);
        for k in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
            c.insert(k.into(), p.into());
        }
        c.insert("layer_norm_epsilon".into(), spec.norm_eps.into());
        c.insert("activation_function".into(), "gelu_new".into());
        c.insert("scale_attn_weights".into(), true.into());
        return Some(Value::Object(c));
    }
    let Positions::Rotary(rope) = spec.positions else {
        return None;
    };
    for (k, v) in [
        ("hidden_size", spec.d_model),
        ("intermediate_size", spec.d_ff),
        ("num_hidden_layers", spec.n_layers),
        ("num_attention_heads", spec.n_heads),
        ("num_key_value_heads", spec.kv_heads()),
        ("head_dim", spec.head_dim()),
        ("max_position_embeddings", spec.seq_len),
    ] {
        c.insert(k.into(), v.into());
    }
    c.insert("hidden_act".into(), "silu".into());
    c.insert("rms_norm_eps".into(), spec.norm_eps.into());
    c.insert("rope_theta".into(), rope.theta.into());
    c.insert(
        "rope_scaling".into(),
        match rope.scaling {
            None => Value::Null,
            Some(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        },
    );
    c.insert("attention_dropout".into(), 0.0.into());
    if family == Family::Llama {
        c.insert("attention_bias".into(), spec.biases.qkv.into());
        c.insert("mlp_bias".into(), spec.biases.mlp.into());
    } else if spec.biases.mlp {
        return None;
    }
    Some(Value::Object(c))
}
