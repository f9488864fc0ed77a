//! Which `transformers` tensors make up each of our parameters, for the families
//! [`hf::family_of`](crate::spec::model::hf::family_of) recognises.
//!
//! Our blocks keep one q/k/v product and one feed-forward input product (SwiGLU's gate and up
//! side by side); `transformers`' Llama, Qwen 2 and Mistral keep `q_proj`, `k_proj`, `v_proj`,
//! `gate_proj` and `up_proj` apart: each of those is a band of rows of ours. GPT-2's `Conv1D`
//! projections store `in × out`, the transpose of our `out × in`. A tied head has no tensor of
//! its own on either side.

use crate::spec::model::hf::{family_of, Family};
use crate::spec::model::{ModelSpec, NormKind, Positions};

/// One tensor of a `transformers` checkpoint and where it sits in our parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensor {
    /// Its name in the checkpoint.
    pub name: String,
    /// The first of our parameter's rows it holds (dimension 0 of ours).
    pub row: usize,
    /// How many rows of ours it holds.
    pub rows: usize,
    /// Stored transposed (GPT-2's `Conv1D`: `in × out`).
    pub transposed: bool,
}

/// Our parameter and the checkpoint tensors it is made of, in row order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    /// Our parameter's name.
    pub param: String,
    /// Its parts.
    pub parts: Vec<HfTensor>,
}

/// Tensors a checkpoint may hold that are no parameters: GPT-2's causal-mask buffers, old
/// Llama checkpoints' rotary frequencies, and a tied head's copy of the embeddings.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

/// The layout of every parameter of `spec`, in our parameters' creation order; `None` when no
/// `transformers` family computes the model.
pub fn layout(spec: &ModelSpec) -> Option<(Family, Vec<ParamLayout>)> {
    let family = family_of(spec)?;
    let mut out = match family {
        Family::Gpt2 => gpt2_layout(spec),
        Family::Llama | Family::Qwen2 | Family::Mistral => llama_layout(spec),
    };
    if !spec.tied_embeddings {
        out.push(whole(
            "head.weight".into(),
            "lm_head.weight".into(),
            spec.vocab_size,
            false,
        ));
    }
    Some((family, out))
}

/// Our parameter `param` as the one checkpoint tensor `name` of `rows` rows.
fn whole(param: String, name: String, rows: usize, transposed: bool) -> ParamLayout {
    ParamLayout {
        param,
        parts: vec![HfTensor {
            name,
            row: 0,
            rows,
            transposed,
        }],
    }
}

/// Our parameter `param` as the checkpoint tensors `names` (with their rows) stacked in order.
fn bands(param: String, names: &[(String, usize)]) -> ParamLayout {
    let mut row = 0;
    let parts = names
        .iter()
        .map(|(name, rows)| {
            let t = HfTensor {
                name: name.clone(),
                row,
                rows: *rows,
                transposed: false,
            };
            row += rows;
            t
        })
        .collect();
    ParamLayout { param, parts }
}

/// GPT-2's parameters, the tied or untied head aside.
fn gpt2_layout(spec: &ModelSpec) -> Vec<ParamLayout> {
    let d = spec.d_model;
    let t = |s: &str| format!("transformer.{s}");
    let mut out = vec![whole(
        "embed.weight".into(),
        t("wte.weight"),
        spec.vocab_size,
        false,
    )];
    if spec.positions == Positions::Learned {
        out.push(whole(
            "positions.weight".into(),
            t("wpe.weight"),
            spec.seq_len,
            false,
        ));
    }
    for i in 0..spec.n_layers {
        let ours = |s: &str| format!("blocks.{i}.{s}");
        let theirs = |s: &str| t(&format!("h.{i}.{s}"));
        for (our, their, rows, transposed) in [
            ("attn.qkv.weight", "attn.c_attn.weight", 3 * d, true),
            ("attn.qkv.bias", "attn.c_attn.bias", 3 * d, false),
            ("attn.out.weight", "attn.c_proj.weight", d, true),
            ("attn.out.bias", "attn.c_proj.bias", d, false),
            ("ff.in.weight", "mlp.c_fc.weight", spec.d_ff, true),
            ("ff.in.bias", "mlp.c_fc.bias", spec.d_ff, false),
            ("ff.out.weight", "mlp.c_proj.weight", d, true),
            ("ff.out.bias", "mlp.c_proj.bias", d, false),
            ("norm1.weight", "ln_1.weight", d, false),
            ("norm1.bias", "ln_1.bias", d, false),
            ("norm2.weight", "ln_2.weight", d, false),
            ("norm2.bias", "ln_2.bias", d, false),
        ] {
            out.push(whole(ours(our), theirs(their), rows, transposed));
        }
    }
    out.push(whole(
        "final_norm.weight".into(),
        t("ln_f.weight"),
        d,
        false,
    ));
    out.push(whole("final_norm.bias".into(), t("ln_f.bias"), d, false));
    out
}

/// The parameters of Llama, Qwen 2 and Mistral, the tied or untied head aside.
fn llama_layout(spec: &ModelSpec) -> Vec<ParamLayout> {
    let mut out = vec![whole(
        "embed.weight".into(),
        "model.embed_tokens.weight".into(),
        spec.vocab_size,
        false,
    )];
    for i in 0..spec.n_layers {
        llama_block(spec, i, &mut out);
    }
    out.push(whole(
        "final_norm.weight".into(),
        "model.norm.weight".into(),
        spec.d_model,
        false,
    ));
    out
}

/// Block `i`'s parameters in Llama's naming, pushed onto `out`.
fn llama_block(spec: &ModelSpec, i: usize, out: &mut Vec<ParamLayout>) {
    let d = spec.d_model;
    let hd = spec.head_dim();
    let (q, kv) = (spec.n_heads * hd, spec.kv_heads() * hd);
    let b = spec.biases;
    let ours = |s: &str| format!("blocks.{i}.{s}");
    let theirs = |s: &str| format!("model.layers.{i}.{s}");
    let qkv = |suffix: &str| {
        [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            .map(|(p, rows)| (theirs(&format!("self_attn.{p}.{suffix}")), rows))
    };
    let gate_up = |suffix: &str| {
        [("gate_proj", spec.d_ff), ("up_proj", spec.d_ff)]
            .map(|(p, rows)| (theirs(&format!("mlp.{p}.{suffix}")), rows))
    };
    let single = |our: &str, their: &str| whole(ours(our), theirs(their), d, false);
    out.push(bands(ours("attn.qkv.weight"), &qkv("weight")));
    if b.qkv {
        out.push(bands(ours("attn.qkv.bias"), &qkv("bias")));
    }
    out.push(single("attn.out.weight", "self_attn.o_proj.weight"));
    if b.out {
        out.push(single("attn.out.bias", "self_attn.o_proj.bias"));
    }
    out.push(bands(ours("ff.in.weight"), &gate_up("weight")));
    if b.mlp {
        out.push(bands(ours("ff.in.bias"), &gate_up("bias")));
    }
    out.push(single("ff.out.weight", "mlp.down_proj.weight"));
    if b.mlp {
        out.push(single("ff.out.bias", "mlp.down_proj.bias"));
    }
    debug_assert_eq!(spec.norm_kind, NormKind::Rms);
    out.push(single("norm1.weight", "input_layernorm.weight"));
    out.push(single("norm2.weight", "post_attention_layernorm.weight"));
}

/// A checkpoint name with GPT-2's optional `transformer.` prefix added where our layout has
/// it: the checkpoints OpenAI published name `h.0.attn...`, `save_pretrained` writes
/// `transformer.h.0.attn...`.
pub fn canonical_name(family: Family, name: &str) -> String {
    match family {
        Family::Gpt2 if !name.starts_with("transformer.") && name != "lm_head.weight" => {
            format!("transformer.{name}")
        }
        _ => name.to_string(),
    }
}
