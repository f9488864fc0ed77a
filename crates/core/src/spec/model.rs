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

/// Feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// max(0, x).
    Relu,
    /// GELU, tanh approximation.
    Gelu,
}

/// Position information added to token embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// None (the seed model, like its PyTorch original, has no positional encoding).
    None,
    /// A learned table of `seq_len` vectors, as GPT-2.
    Learned,
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
    /// Layer norm epsilon.
    pub norm_eps: f64,
    /// Optimizer.
    pub optimizer: OptimizerSpec,
}

const WHAT: &str = "model spec";

/// The names accepted by [`ModelSpec::preset`].
pub const PRESETS: [&str; 6] = ["tiny", "seed", "gpt-124m", "gpt-350m", "gpt-1.3b", "gpt-2b"];

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
            _ => {
                return Err(Error::UnknownName {
                    what: "model preset",
                    name: name.into(),
                    known: PRESETS.join(", "),
                })
            }
        })
    }

    /// A preset name, or else a path to a JSON spec file.
    pub fn resolve(name_or_path: &str) -> Result<Self> {
        let path = Path::new(name_or_path);
        if PRESETS.contains(&name_or_path) || !(path.exists() || name_or_path.ends_with(".json")) {
            return Self::preset(name_or_path);
        }
        Self::from_file(path)
    }

    /// Loads and validates a JSON spec file: a full spec, or `{"preset": NAME, ...overrides}`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::file("cannot read model spec", path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            Error::InvalidSpec { .. } | Error::UnknownName { .. } => Error::file(
                "invalid model spec",
                path,
                Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
            ),
            other => other,
        })
    }

    /// Parses and validates a JSON spec (see [`ModelSpec::from_file`]).
    pub fn from_json(text: &str) -> Result<Self> {
        let mut value = json::parse_value(WHAT, text)?;
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

    /// Checks that the numbers describe a model that can be built.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, problem: String| Err(Error::invalid(WHAT, field, problem));
        for (field, value, max) in [
            ("vocab_size", self.vocab_size, MAX_DIMENSION),
            ("d_model", self.d_model, MAX_DIMENSION),
            ("n_heads", self.n_heads, MAX_DIMENSION),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("d_ff", self.d_ff, MAX_DIMENSION),
            ("seq_len", self.seq_len, MAX_DIMENSION),
        ] {
            if value == 0 {
                return bad(field, "must be at least 1".into());
            }
            if value > max {
                return bad(field, format!("({value}) must be at most {max}"));
            }
        }
        self.validate_sizes()?;
        if self.d_model % self.n_heads != 0 {
            return bad(
                "n_heads",
                format!(
                    "({}) must divide d_model ({}); try {}",
                    self.n_heads,
                    self.d_model,
                    nearest_divisor(self.d_model, self.n_heads)
                ),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("({}) must be in [0, 1)", self.dropout));
        }
        // Written as `is_positive` so that NaN is rejected too.
        let is_positive = |x: f64| x > 0.0;
        if !(is_positive(self.norm_eps) && self.norm_eps.is_finite()) {
            return bad("norm_eps", "must be a positive number".into());
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad("optimizer.lr", format!("({}) must be positive", o.lr));
        }
        for (field, beta) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(field, format!("({beta}) must be in [0, 1)"));
            }
        }
        if !(is_positive(o.eps) && o.eps.is_finite()) {
            return bad("optimizer.eps", "must be a positive number".into());
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return bad(
                "optimizer.weight_decay",
                format!("({}) must be zero or positive", o.weight_decay),
            );
        }
        if let Some(clip) = o.grad_clip {
            if !(is_positive(clip) && clip.is_finite()) {
                return bad(
                    "optimizer.grad_clip",
                    format!("({clip}) must be a positive norm, e.g. 1.0, or absent for none"),
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
            .max(n(self.d_ff))
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
                n(self.d_ff) * n(self.d_model),
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

    /// Trainable parameters, counted from the shapes the model builds (saturating for a spec
    /// that [`ModelSpec::validate`] refuses).
    pub fn parameter_count(&self) -> usize {
        limits::parameter_count(self)
            .and_then(|p| usize::try_from(p).ok())
            .unwrap_or(usize::MAX)
    }

    /// The parameters by the parts of the model whose gradients a backward pass completes
    /// together: the head (with the final norm), each block, the embeddings.
    pub fn parameter_groups(&self) -> ParameterGroups {
        let d = self.d_model;
        let block = 4 * d * d + 4 * d // attention projections and biases
            + 2 * d * self.d_ff + self.d_ff + d // feed-forward
            + 4 * d; // two layer norms
        let positions = match self.positions {
            Positions::None => 0,
            Positions::Learned => self.seq_len * d,
        };
        let final_norm = match self.norm {
            NormPlacement::Pre => 2 * d,
            NormPlacement::Post => 0,
        };
        ParameterGroups {
            embeddings: self.vocab_size * d + positions,
            block,
            head: final_norm + d * self.vocab_size + self.vocab_size,
        }
    }

    /// The parameters that are vectors (biases, norm scales and shifts) rather than matrices:
    /// they stay f32 where matrices run in half precision.
    pub fn vector_parameter_count(&self) -> usize {
        let d = self.d_model;
        // q/k/v and output biases, feed-forward biases, two norms.
        let block = 4 * d + self.d_ff + d + 4 * d;
        let final_norm = match self.norm {
            NormPlacement::Pre => 2 * d,
            NormPlacement::Post => 0,
        };
        self.n_layers * block + final_norm + self.vocab_size
    }
}

/// Parameter counts of the parts of a model ([`ModelSpec::parameter_groups`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParameterGroups {
    /// Token and position embeddings.
    pub embeddings: usize,
    /// One Transformer block.
    pub block: usize,
    /// The final norm and the vocabulary head.
    pub head: usize,
}

impl ParameterGroups {
    /// The largest group: the most parameters whose gradients exist at once when each part is
    /// updated as soon as its backward pass is done.
    pub fn largest(&self) -> usize {
        self.embeddings.max(self.block).max(self.head)
    }
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
