//! `ModelSpec`: the shape of the Transformer to train, its presets, and loading from JSON.
//!
//! A spec comes from a preset name (`seed`, `gpt-124m`, ...) or a JSON file. A file may name a
//! `preset` and override any field of it; unknown fields are rejected so that a typo is an error
//! and not a silently ignored setting.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::json;
use crate::spec::limits::{self, MAX_DIMENSION, MAX_LAYERS, MAX_PARAMETERS, MAX_TENSOR_BYTES};
use crate::{Error, Result};

/// Where layer normalisation sits in a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormPlacement {
    /// `x = norm(x + sublayer(x))`, as PyTorch's `nn.TransformerEncoderLayer` by default.
    Post,
    /// `x = x + sublayer(norm(x))`, as GPT-2, with a final norm before the head.
    Pre,
}

/// Which normalisation the blocks (and the final norm of pre-norm models) apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// `(x − mean) / √(var + eps) · γ + β`, as GPT-2 and PyTorch's encoder.
    #[default]
    Layer,
    /// `x / √(mean(x²) + eps) · γ`, no shift, as Llama, Qwen and Mistral.
    Rms,
}

/// Feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// max(0, x).
    Relu,
    /// GELU, tanh approximation.
    Gelu,
    /// The gated SiLU of Llama, Qwen and Mistral: `down(silu(gate(x)) ⊙ up(x))`, where
    /// `d_ff` is the width of each of `gate` and `up` (one product of width `2·d_ff`).
    Swiglu,
}

/// Llama 3's rescaling of the rotary frequencies for long contexts (`rope_scaling` with
/// `rope_type: "llama3"` in a Hugging Face config): wavelengths beyond
/// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those below
/// `original_max_position_embeddings / high_freq_factor` kept, and the band between blended.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// How much longer the context is than the original.
    pub factor: f64,
    /// Below this multiple of the original context, wavelengths are scaled by `factor`.
    pub low_freq_factor: f64,
    /// Above this multiple, wavelengths are kept.
    pub high_freq_factor: f64,
    /// The context the frequencies were trained for.
    pub original_max_position_embeddings: usize,
}

/// Rotary position embedding: pairs `(i, i + hd/2)` of each query and key head are rotated by
/// `position · θ^(−2i/hd)` (the "rotate half" layout of Hugging Face's Llama).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rope {
    /// The base θ of the frequencies (10 000 in Llama 2, 500 000 in Llama 3, 1 000 000 in Qwen 2).
    pub theta: f64,
    /// Llama 3 frequency scaling, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<RopeScaling>,
}

impl Rope {
    /// The `hd/2` angular frequencies of heads of width `head_dim`, scaled as `scaling` says
    /// (as `transformers`' `_compute_llama3_parameters`).
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f64> {
        let half = head_dim / 2;
        (0..half)
            .map(|i| {
                let f = self.theta.powf(-((2 * i) as f64) / head_dim as f64);
                match &self.scaling {
                    None => f,
                    Some(s) => llama3_scaled(f, s),
                }
            })
            .collect()
    }
}

fn llama3_scaled(freq: f64, s: &RopeScaling) -> f64 {
    let original = s.original_max_position_embeddings as f64;
    let low_wavelen = original / s.low_freq_factor;
    let high_wavelen = original / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    if wavelen > low_wavelen {
        freq / s.factor
    } else if wavelen < high_wavelen {
        freq
    } else {
        let smooth =
            (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}

/// Position information given to the attention.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// None (the seed model, like its PyTorch original, has no positional encoding).
    None,
    /// A learned table of `seq_len` vectors added to the token embeddings, as GPT-2.
    Learned,
    /// Rotary embeddings of queries and keys, as Llama: no parameters.
    Rotary(Rope),
}

/// Which projections have a bias. GPT-2 and the seed have all of them; Llama and Mistral
/// none; Qwen 2 only on q, k and v.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Biases {
    /// The q/k/v projection.
    pub qkv: bool,
    /// The attention output projection.
    pub out: bool,
    /// Both feed-forward projections.
    pub mlp: bool,
    /// The vocabulary head.
    pub head: bool,
}

impl Default for Biases {
    fn default() -> Self {
        Self::ALL
    }
}

impl Biases {
    /// Every projection has a bias (GPT-2, the seed).
    pub const ALL: Self = Self {
        qkv: true,
        out: true,
        mlp: true,
        head: true,
    };
    /// No projection has one (Llama, Mistral).
    pub const NONE: Self = Self {
        qkv: false,
        out: false,
        mlp: false,
        head: false,
    };

    fn is_all(&self) -> bool {
        *self == Self::ALL
    }
}

/// Which Adam variant the optimizer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with L2 weight decay folded into the gradient (PyTorch `torch.optim.Adam`).
    Adam,
    /// Adam with decoupled weight decay (PyTorch `torch.optim.AdamW`).
    AdamW,
}

/// Optimizer hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    /// Adam or AdamW.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Weight decay (L2 for Adam, decoupled for AdamW).
    pub weight_decay: f64,
    /// Clip the gradients to this global L2 norm before each update (PyTorch's
    /// `clip_grad_norm_`), or not at all. Clipping needs every gradient before the first
    /// update, so it rules out the update in backward ([`crate::knobs::Update::InBackward`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f64>,
}

impl OptimizerSpec {
    /// PyTorch's `torch.optim.Adam` defaults.
    pub fn adam(lr: f64) -> Self {
        Self {
            kind: OptimizerKind::Adam,
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: None,
        }
    }

    /// AdamW as commonly used for GPT pre-training.
    pub fn adamw(lr: f64) -> Self {
        Self {
            kind: OptimizerKind::AdamW,
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: None,
        }
    }
}

/// A Transformer language model and how it is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Human name, used in plans and profiles.
    pub name: String,
    /// Token vocabulary size (input embedding rows and output classes).
    pub vocab_size: usize,
    /// Hidden width.
    pub d_model: usize,
    /// Attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Feed-forward inner width.
    pub d_ff: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Causal (decoder) attention, or bidirectional (encoder).
    pub causal: bool,
    /// Norm placement.
    pub norm: NormPlacement,
    /// Feed-forward activation.
    pub activation: Activation,
    /// Positional encoding.
    pub positions: Positions,
    /// Dropout probability after attention, inside and after the feed-forward.
    pub dropout: f32,
    /// Norm epsilon.
    pub norm_eps: f64,
    /// Optimizer.
    pub optimizer: OptimizerSpec,
    /// Layer norm (the default) or RMS norm.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm_kind: NormKind,
    /// Key/value heads, each shared by `n_heads / n_kv_heads` query heads (grouped-query
    /// attention; 1 is multi-query attention). Absent: as many as query heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Which projections have a bias (default: all).
    #[serde(default, skip_serializing_if = "Biases::is_all")]
    pub biases: Biases,
    /// Whether the vocabulary head reuses the token embedding table (GPT-2, Llama 3.2,
    /// Qwen 2.5 up to 3B) instead of a matrix of its own.
    #[serde(default, skip_serializing_if = "is_default")]
    pub tied_embeddings: bool,
}

/// A Hugging Face model's name: the last part of its `_name_or_path`, else the folder that
/// holds its config, else `hf-model`; with any character that would act on a terminal escaped,
/// since the name is printed and stored in plans.
fn hf_model_name(config: &serde_json::Value, path: &Path) -> String {
    let from_config = config
        .get("_name_or_path")
        .and_then(serde_json::Value::as_str)
        .and_then(|n| n.rsplit('/').find(|part| !part.is_empty()));
    let from_folder = path
        .parent()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty());
    let name = from_config
        .or(from_folder)
        .unwrap_or("hf-model")
        .to_lowercase();
    crate::text::escape_controls(&name).into_owned()
}

/// The parameter counts of `spec` by part (see [`ModelSpec::parameter_groups`]).
pub(crate) fn parameter_counts(spec: &ModelSpec) -> Option<counts::Counts> {
    counts::Counts::of(spec)
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

const WHAT: &str = "model spec";

pub(crate) mod counts;
pub mod hf;
mod presets;

pub use presets::DECODER_SEQ_LEN;

/// The names accepted by [`ModelSpec::preset`]: the seed, GPT-2-style models, and decoders of
/// the Llama, Qwen 2.5 and Mistral families with their published shapes.
pub const PRESETS: [&str; 13] = [
    "tiny",
    "seed",
    "gpt-124m",
    "gpt-350m",
    "gpt-1.3b",
    "gpt-2b",
    "smollm2-135m",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "qwen2.5-1.5b",
    "llama-3.2-3b",
    "mistral-7b",
    "llama-3.1-8b",
];

impl ModelSpec {
    /// The model our users start from: `nn.Embedding(10000, 512)` → 6 × `nn.TransformerEncoderLayer(512, 8)`
    /// (feed-forward 2048, ReLU, dropout 0.1, post-norm) → `nn.Linear(512, 10000)`, Adam, sequences of 128.
    pub fn seed() -> Self {
        Self {
            name: "seed".into(),
            vocab_size: 10_000,
            d_model: 512,
            n_heads: 8,
            n_layers: 6,
            d_ff: 2048,
            seq_len: 128,
            causal: false,
            norm: NormPlacement::Post,
            activation: Activation::Relu,
            positions: Positions::None,
            dropout: 0.1,
            norm_eps: 1e-5,
            optimizer: OptimizerSpec::adam(1e-3),
            norm_kind: NormKind::Layer,
            n_kv_heads: None,
            biases: Biases::ALL,
            tied_embeddings: false,
        }
    }

    /// A byte-level causal model small enough for CPU tests and the CPU default run.
    pub fn tiny() -> Self {
        Self {
            name: "tiny".into(),
            vocab_size: 256,
            d_model: 64,
            n_heads: 4,
            n_layers: 2,
            d_ff: 256,
            seq_len: 64,
            // Small models tolerate (and need, to learn within a CPU-minute) a larger step.
            optimizer: OptimizerSpec::adamw(3e-3),
            ..Self::gpt("tiny", 0, 0, 0)
        }
    }

    fn gpt(name: &str, d_model: usize, n_heads: usize, n_layers: usize) -> Self {
        Self {
            name: name.into(),
            vocab_size: 50_257,
            d_model,
            n_heads,
            n_layers,
            d_ff: 4 * d_model,
            seq_len: 1024,
            causal: true,
            norm: NormPlacement::Pre,
            activation: Activation::Gelu,
            positions: Positions::Learned,
            dropout: 0.0,
            norm_eps: 1e-5,
            optimizer: OptimizerSpec::adamw(3e-4),
            norm_kind: NormKind::Layer,
            n_kv_heads: None,
            biases: Biases::ALL,
            tied_embeddings: false,
        }
    }

    /// A preset by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        Ok(match name {
            "tiny" => Self::tiny(),
            "seed" => Self::seed(),
            "gpt-124m" => Self::gpt("gpt-124m", 768, 12, 12),
            "gpt-350m" => Self::gpt("gpt-350m", 1024, 16, 24),
            "gpt-1.3b" => Self::gpt("gpt-1.3b", 2048, 16, 24),
            // The largest GPT whose exact AdamW state (12 bytes per parameter, streamed
            // offload) fits the 32 GB host of the RTX 4090 box with room for the rest.
            "gpt-2b" => Self::gpt("gpt-2b", 2560, 20, 24),
            other => match presets::decoder(other) {
                Some(spec) => spec,
                None => {
                    return Err(Error::UnknownName {
                        what: "model preset",
                        name: name.into(),
                        known: PRESETS.join(", "),
                    })
                }
            },
        })
    }

    /// A preset name, a path to a JSON spec file, or a Hugging Face model folder (its
    /// `config.json`, as `from_pretrained` reads it).
    pub fn resolve(name_or_path: &str) -> Result<Self> {
        let path = Path::new(name_or_path);
        if PRESETS.contains(&name_or_path) || !(path.exists() || name_or_path.ends_with(".json")) {
            return Self::preset(name_or_path);
        }
        if path.is_dir() {
            let config = path.join("config.json");
            // Whatever it is: the reader says what is wrong with one that is no regular file.
            if !config.exists() {
                return Err(Error::file(
                    "no config.json in the model folder",
                    path,
                    "a model is a preset, a JSON spec file, or a Hugging Face model folder \
                     holding config.json (and its weights, model.safetensors)",
                ));
            }
            return Self::from_file(&config);
        }
        Self::from_file(path)
    }

    /// Loads and validates a JSON spec file: a full spec, `{"preset": NAME, ...overrides}`, a
    /// Hugging Face `config.json` ([`hf`]), or `{"hf_config": PATH, ...overrides}` with `PATH`
    /// relative to the spec file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT)
            .map_err(|e| Error::file("cannot read model spec", path, e))?;
        Self::from_json_at(&text, path).map_err(|e| match e {
            Error::InvalidSpec { .. } | Error::UnknownName { .. } => Error::file(
                "invalid model spec",
                path,
                Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
            ),
            other => other,
        })
    }

    fn from_json_at(text: &str, path: &Path) -> Result<Self> {
        let mut value = json::parse_value(WHAT, text)?;
        if hf::is_hf_config(&value) {
            return hf::from_hf_config(&value, &hf_model_name(&value, path));
        }
        let Some(hf_path) = value.as_object_mut().and_then(|o| o.remove("hf_config")) else {
            return Self::from_json(text);
        };
        let relative = hf_path
            .as_str()
            .ok_or_else(|| Error::invalid(WHAT, "hf_config", "must be a path (a string)"))?;
        let hf_file = path.parent().unwrap_or(Path::new(".")).join(relative);
        let hf_text =
            crate::input_file::read_to_string(&hf_file, crate::input_file::DOCUMENT_LIMIT)
                .map_err(|e| Error::file("cannot read the Hugging Face config", &hf_file, e))?;
        let hf_value = json::parse_value(hf::WHAT, &hf_text)?;
        let base =
            hf::from_hf_config(&hf_value, &hf_model_name(&hf_value, &hf_file)).map_err(|e| {
                Error::file(
                    "invalid Hugging Face config",
                    &hf_file,
                    Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
                )
            })?;
        let mut merged = serde_json::to_value(base).expect("a spec always serialises");
        merge(&mut merged, value);
        let spec: Self = json::from_value(WHAT, merged)?;
        spec.validate()?;
        Ok(spec)
    }

    /// Parses and validates a JSON spec (see [`ModelSpec::from_file`]).
    pub fn from_json(text: &str) -> Result<Self> {
        let mut value = json::parse_value(WHAT, text)?;
        if hf::is_hf_config(&value) {
            return hf::from_hf_config(&value, &hf_model_name(&value, Path::new("")));
        }
        let object = value
            .as_object_mut()
            .ok_or_else(|| Error::invalid(WHAT, json::DOCUMENT, "must be a JSON object"))?;
        let spec_value = match object.remove("preset") {
            Some(preset) => {
                let name = preset
                    .as_str()
                    .ok_or_else(|| Error::invalid(WHAT, "preset", "must be a string"))?;
                let mut base =
                    serde_json::to_value(Self::preset(name)?).expect("a spec always serialises");
                merge(&mut base, value);
                base
            }
            None => value,
        };
        let spec: Self = json::from_value(WHAT, spec_value)?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks that the numbers describe a model that can be built. The checks run in a fixed
    /// order: of several bad fields, the first of them is named.
    pub fn validate(&self) -> Result<()> {
        self.validate_dimensions()?;
        self.validate_sizes()?;
        self.validate_heads()?;
        if let Positions::Rotary(rope) = &self.positions {
            self.validate_rotary(rope)?;
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return invalid("dropout", format!("({}) must be in [0, 1)", self.dropout));
        }
        if !(is_positive(self.norm_eps) && self.norm_eps.is_finite()) {
            return invalid("norm_eps", "must be a positive number".into());
        }
        validate_optimizer(&self.optimizer)?;
        // The name is printed and stored in plans: it must not rewrite a terminal.
        if crate::text::has_controls(&self.name) {
            return invalid(
                "name",
                format!(
                    "(\"{}\") holds control characters; use printable text",
                    crate::text::escape_controls(&self.name)
                ),
            );
        }
        Ok(())
    }

    /// Every dimension at least 1 and within its bound.
    fn validate_dimensions(&self) -> Result<()> {
        for (field, value, max) in [
            ("vocab_size", self.vocab_size, MAX_DIMENSION),
            ("d_model", self.d_model, MAX_DIMENSION),
            ("n_heads", self.n_heads, MAX_DIMENSION),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("d_ff", self.d_ff, MAX_DIMENSION),
            ("seq_len", self.seq_len, MAX_DIMENSION),
        ] {
            if value == 0 {
                return invalid(field, "must be at least 1".into());
            }
            if value > max {
                return invalid(field, format!("({value}) must be at most {max}"));
            }
        }
        Ok(())
    }

    /// The query heads split the width evenly, and the key/value heads the query heads.
    fn validate_heads(&self) -> Result<()> {
        if self.d_model % self.n_heads != 0 {
            return invalid(
                "n_heads",
                format!(
                    "({}) must divide d_model ({}); try {}",
                    self.n_heads,
                    self.d_model,
                    nearest_divisor(self.d_model, self.n_heads)
                ),
            );
        }
        if let Some(kv) = self.n_kv_heads {
            if kv == 0 || kv > MAX_DIMENSION || self.n_heads % kv != 0 {
                return invalid(
                    "n_kv_heads",
                    format!(
                        "({kv}) must divide n_heads ({}): each key/value head serves a whole group \
                         of query heads; try {}",
                        self.n_heads,
                        nearest_divisor(self.n_heads, kv.max(1))
                    ),
                );
            }
        }
        Ok(())
    }

    /// Rotary positions rotate pairs of a head's values, at a finite base above 1, with a
    /// frequency scaling that keeps the frequencies in order.
    fn validate_rotary(&self, rope: &Rope) -> Result<()> {
        if self.head_dim() % 2 != 0 {
            return invalid(
                "positions.rotary",
                format!(
                    "needs an even head width; d_model / n_heads is {}",
                    self.head_dim()
                ),
            );
        }
        if !(rope.theta > 1.0 && rope.theta.is_finite()) {
            return invalid(
                "positions.rotary.theta",
                format!("({}) must be a finite number above 1", rope.theta),
            );
        }
        if let Some(s) = &rope.scaling {
            let ok = s.factor >= 1.0
                && s.factor.is_finite()
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.high_freq_factor.is_finite()
                && s.original_max_position_embeddings > 0;
            if !ok {
                return invalid(
                    "positions.rotary.scaling",
                    format!(
                        "(factor {}, low_freq_factor {}, high_freq_factor {}, \
                         original_max_position_embeddings {}) needs factor ≥ 1, \
                         0 < low_freq_factor < high_freq_factor and \
                         original_max_position_embeddings ≥ 1",
                        s.factor,
                        s.low_freq_factor,
                        s.high_freq_factor,
                        s.original_max_position_embeddings
                    ),
                );
            }
        }
        Ok(())
    }

    /// The largest tensors the model builds, each within [`MAX_TENSOR_BYTES`], and its
    /// parameter count within [`MAX_PARAMETERS`]: a model no machine could allocate is an input
    /// error naming the field that makes it so, not an abort halfway through building it.
    fn validate_sizes(&self) -> Result<()> {
        let n = |x: usize| x as u64;
        let activation_width = n(self.vocab_size)
            .max(2 * n(self.d_ff))
            .max(3 * n(self.d_model));
        // Every product has factors of at most 2^24, so none overflows.
        let tensors = [
            (
                "vocab_size",
                n(self.vocab_size) * n(self.d_model),
                "the embedding table",
            ),
            (
                "d_ff",
                2 * n(self.d_ff) * n(self.d_model),
                "a feed-forward weight",
            ),
            (
                "d_model",
                3 * n(self.d_model) * n(self.d_model),
                "the attention projections",
            ),
            (
                "seq_len",
                n(self.seq_len) * activation_width,
                "one sequence's widest activation",
            ),
        ];
        for (field, elements, what) in tensors {
            let bytes = elements.saturating_mul(4);
            if bytes > MAX_TENSOR_BYTES {
                return Err(Error::invalid(
                    WHAT,
                    field,
                    format!(
                        "makes {what} {} (f32), over the {} a single tensor may take; make it smaller",
                        crate::spec::budget::format_bytes(bytes),
                        crate::spec::budget::format_bytes(MAX_TENSOR_BYTES)
                    ),
                ));
            }
        }
        match limits::parameter_count(self) {
            Some(p) if p <= MAX_PARAMETERS => Ok(()),
            count => Err(Error::invalid(
                WHAT,
                "n_layers",
                format!(
                    "({}) makes {} parameters, over the {MAX_PARAMETERS} a model may have; use fewer or narrower layers",
                    self.n_layers,
                    count.map_or("more than 2^64".to_string(), |p| p.to_string())
                ),
            )),
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Key/value heads: [`ModelSpec::n_kv_heads`], or one per query head.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Columns of the q/k/v product: the query heads', then the key and value heads'.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.kv_heads()) * self.head_dim()
    }

    /// Columns of the feed-forward input product (SwiGLU's gate and up side by side).
    pub fn ff_in_width(&self) -> usize {
        match self.activation {
            Activation::Swiglu => 2 * self.d_ff,
            Activation::Relu | Activation::Gelu => self.d_ff,
        }
    }

    /// Trainable parameters, counted from the shapes the model builds (saturating for a spec
    /// that [`ModelSpec::validate`] refuses).
    pub fn parameter_count(&self) -> usize {
        limits::parameter_count(self)
            .and_then(|p| usize::try_from(p).ok())
            .unwrap_or(usize::MAX)
    }

    /// The parameters by the parts of the model whose gradients a backward pass completes
    /// together: the head (with the final norm), each block, the embeddings. A tied head's
    /// matrix is the embeddings': its gradient completes with theirs.
    pub fn parameter_groups(&self) -> ParameterGroups {
        let counts = counts::Counts::of(self);
        let get = |f: fn(&counts::Counts) -> u64| {
            counts
                .as_ref()
                .map_or(usize::MAX, |c| usize::try_from(f(c)).unwrap_or(usize::MAX))
        };
        ParameterGroups {
            embeddings: get(|c| c.embeddings),
            block: get(|c| c.block),
            layer: get(|c| c.layer),
            head: get(|c| c.head),
            head_vectors: get(|c| c.head_vectors),
            positions: get(|c| c.embeddings - c.vocab_rows),
        }
    }

    /// The parameters that are vectors (biases, norm scales and shifts) rather than matrices:
    /// they stay f32 where matrices run in half precision.
    pub fn vector_parameter_count(&self) -> usize {
        counts::Counts::of(self)
            .and_then(|c| c.vectors(self.n_layers))
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(usize::MAX)
    }
}

/// Parameter counts of the parts of a model ([`ModelSpec::parameter_groups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParameterGroups {
    /// Token and position embeddings.
    pub embeddings: usize,
    /// One Transformer block.
    pub block: usize,
    /// A block's largest layer (a matrix with its bias, or a norm).
    pub layer: usize,
    /// The final norm and the vocabulary head.
    pub head: usize,
    /// The head part's vectors: the final norm and the head's bias.
    pub head_vectors: usize,
    /// The learned position table (zero without one).
    pub positions: usize,
}

impl ParameterGroups {
    /// The largest group: the most parameters whose gradients exist at once when each part is
    /// updated as soon as its backward pass is done.
    pub fn largest(&self) -> usize {
        self.embeddings.max(self.block).max(self.head)
    }
}

/// The optimizer's settings: a positive learning rate, betas in [0, 1), and a positive
/// epsilon, decay and clipping norm where given.
fn validate_optimizer(o: &OptimizerSpec) -> Result<()> {
    if !(o.lr > 0.0 && o.lr.is_finite()) {
        return invalid("optimizer.lr", format!("({}) must be positive", o.lr));
    }
    for (field, beta) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
        if !(0.0..1.0).contains(&beta) {
            return invalid(field, format!("({beta}) must be in [0, 1)"));
        }
    }
    if !(is_positive(o.eps) && o.eps.is_finite()) {
        return invalid("optimizer.eps", "must be a positive number".into());
    }
    if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
        return invalid(
            "optimizer.weight_decay",
            format!("({}) must be zero or positive", o.weight_decay),
        );
    }
    if let Some(clip) = o.grad_clip {
        if !(is_positive(clip) && clip.is_finite()) {
            return invalid(
                "optimizer.grad_clip",
                format!("({clip}) must be a positive norm, e.g. 1.0, or absent for none"),
            );
        }
    }
    Ok(())
}

/// Written as `x > 0` so that NaN is rejected too.
fn is_positive(x: f64) -> bool {
    x > 0.0
}

/// A model spec's `field` is invalid for `problem`.
fn invalid(field: &str, problem: String) -> Result<()> {
    Err(Error::invalid(WHAT, field, problem))
}

/// Overlays `patch`'s fields on `base` (objects merge recursively, anything else replaces).
fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
    match (base, patch) {
        (serde_json::Value::Object(base), serde_json::Value::Object(patch)) => {
            for (key, value) in patch {
                match base.get_mut(&key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (slot, value) => *slot = value,
    }
}

fn nearest_divisor(n: usize, near: usize) -> usize {
    (1..=n)
        .filter(|d| n % d == 0)
        .min_by_key(|&d| d.abs_diff(near))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_no_machine_could_allocate_are_refused_naming_the_field() {
        let field = |json: &str| match ModelSpec::from_json(json) {
            Err(Error::InvalidSpec { field, problem, .. }) => (field, problem),
            other => panic!("expected an invalid spec, got {other:?}"),
        };
        for (json, expected) in [
            (r#"{"preset": "tiny", "d_model": 2147483648}"#, "d_model"),
            (
                r#"{"preset": "tiny", "d_model": 9223372036854775808}"#,
                "d_model",
            ),
            (
                r#"{"preset": "tiny", "d_model": 18446744073709551615}"#,
                "d_model",
            ),
            (r#"{"preset": "tiny", "n_layers": 4294967296}"#, "n_layers"),
            (
                r#"{"preset": "tiny", "vocab_size": 16777216, "d_model": 16777216, "n_heads": 1}"#,
                "vocab_size",
            ),
            (
                r#"{"preset": "tiny", "d_model": 65536, "d_ff": 16777216, "n_heads": 1}"#,
                "d_ff",
            ),
            (
                r#"{"preset": "tiny", "seq_len": 16777216, "vocab_size": 16777216}"#,
                "seq_len",
            ),
            (
                r#"{"preset": "tiny", "d_model": 262144, "d_ff": 16, "n_heads": 1, "n_layers": 65536}"#,
                "n_layers",
            ),
        ] {
            assert_eq!(field(json).0, expected, "{json}: {:?}", field(json));
        }
        // A large but allocatable model is valid: whether it fits is the search's answer.
        let big = r#"{"preset": "gpt-1.3b", "d_model": 8192, "n_layers": 40, "d_ff": 32768}"#;
        let spec = ModelSpec::from_json(big).unwrap();
        assert!(
            spec.parameter_count() > 30_000_000_000,
            "{}",
            spec.parameter_count()
        );
    }

    #[test]
    fn presets_are_valid_and_sized_as_named() {
        for name in PRESETS {
            let spec = ModelSpec::preset(name).unwrap();
            spec.validate().unwrap();
            assert_eq!(spec.name, name);
        }
        let millions = |n: &str| ModelSpec::preset(n).unwrap().parameter_count() as f64 / 1e6;
        // Untied heads, as the reference measurements count them.
        assert!(
            (millions("seed") - 29.2).abs() < 0.5,
            "{}",
            millions("seed")
        );
        assert!(
            (millions("gpt-124m") - 163.0).abs() < 2.0,
            "{}",
            millions("gpt-124m")
        );
        assert!(
            (millions("gpt-350m") - 406.0).abs() < 3.0,
            "{}",
            millions("gpt-350m")
        );
        assert!(
            (millions("gpt-1.3b") - 1420.0).abs() < 10.0,
            "{}",
            millions("gpt-1.3b")
        );
        // PyTorch's module count of the same shape (torch_ref.py builds it): 2,148,228,177.
        assert_eq!(
            ModelSpec::preset("gpt-2b").unwrap().parameter_count(),
            2_148_228_177
        );
    }

    #[test]
    fn file_overrides_a_preset() {
        let spec =
            ModelSpec::from_json(r#"{"preset": "seed", "n_layers": 2, "optimizer": {"lr": 0.01}}"#)
                .unwrap();
        assert_eq!(spec.n_layers, 2);
        assert_eq!(spec.optimizer.lr, 0.01);
        assert_eq!(spec.optimizer.kind, OptimizerKind::Adam);
        assert_eq!(spec.d_model, 512);
    }

    #[test]
    fn bad_specs_name_the_field() {
        let field = |json: &str| match ModelSpec::from_json(json) {
            Err(Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected an invalid spec, got {other:?}"),
        };
        assert_eq!(field(r#"{"preset": "seed", "n_heads": 7}"#), "n_heads");
        assert_eq!(field(r#"{"preset": "seed", "n_layers": 0}"#), "n_layers");
        assert_eq!(field(r#"{"preset": "seed", "n_layer": 3}"#), "n_layer");
        assert_eq!(field(r#"{"preset": "seed", "dropout": 1.5}"#), "dropout");
        assert_eq!(field(r#"{"name": "x"}"#), "vocab_size");
        assert_eq!(
            field(r#"{"preset": "seed", "optimizer": {"lr": "fast"}}"#),
            "optimizer.lr"
        );
        assert_eq!(field(r#"{"preset": "seed", "dropout": "0.1"}"#), "dropout");
        assert!(matches!(
            ModelSpec::from_json(r#"{"preset": "gpt-7b"}"#),
            Err(Error::UnknownName { .. })
        ));
    }
}
