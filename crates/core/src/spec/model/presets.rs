//! Decoders of the Llama, Qwen 2.5 and Mistral families with the shapes of their published
//! `config.json` files, so that their parameter counts are the published ones (checked in the
//! tests). Sequences are 2048 tokens, the length fine-tuning recipes train at; a spec file or
//! `seq_len` override changes it.

use super::{Activation, Biases, ModelSpec, NormKind, NormPlacement, OptimizerSpec, Positions};
use super::{Rope, RopeScaling};

/// Tokens per training sequence of the decoder presets.
pub const DECODER_SEQ_LEN: usize = 2048;

/// The shape of one decoder, as its config lists it.
struct Decoder {
    /// The preset's name.
    name: &'static str,
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    theta: f64,
    scaling: Option<RopeScaling>,
    eps: f64,
    tied: bool,
    qkv_bias: bool,
}

/// Llama 3.1 and 3.2's frequency scaling, `factor` 8 (3.1) or 32 (3.2).
const fn llama3(factor: f64) -> Option<RopeScaling> {
    Some(RopeScaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    })
}

/// The decoder presets.
const DECODERS: [Decoder; 7] = [
    // HuggingFaceTB/SmolLM2-135M: 134,515,008 parameters.
    Decoder {
        name: "smollm2-135m",
        vocab: 49_152,
        hidden: 576,
        intermediate: 1536,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        theta: 100_000.0,
        scaling: None,
        eps: 1e-5,
        tied: true,
        qkv_bias: false,
    },
    // Qwen/Qwen2.5-0.5B: 494,032,768.
    Decoder {
        name: "qwen2.5-0.5b",
        vocab: 151_936,
        hidden: 896,
        intermediate: 4864,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        theta: 1_000_000.0,
        scaling: None,
        eps: 1e-6,
        tied: true,
        qkv_bias: true,
    },
    // meta-llama/Llama-3.2-1B: 1,235,814,400.
    Decoder {
        name: "llama-3.2-1b",
        vocab: 128_256,
        hidden: 2048,
        intermediate: 8192,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        theta: 500_000.0,
        scaling: llama3(32.0),
        eps: 1e-5,
        tied: true,
        qkv_bias: false,
    },
    // Qwen/Qwen2.5-1.5B: 1,543,714,304.
    Decoder {
        name: "qwen2.5-1.5b",
        vocab: 151_936,
        hidden: 1536,
        intermediate: 8960,
        layers: 28,
        heads: 12,
        kv_heads: 2,
        theta: 1_000_000.0,
        scaling: None,
        eps: 1e-6,
        tied: true,
        qkv_bias: true,
    },
    // meta-llama/Llama-3.2-3B: 3,212,749,824.
    Decoder {
        name: "llama-3.2-3b",
        vocab: 128_256,
        hidden: 3072,
        intermediate: 8192,
        layers: 28,
        heads: 24,
        kv_heads: 8,
        theta: 500_000.0,
        scaling: llama3(32.0),
        eps: 1e-5,
        tied: true,
        qkv_bias: false,
    },
    // mistralai/Mistral-7B-v0.1: 7,241,732,096.
    Decoder {
        name: "mistral-7b",
        vocab: 32_000,
        hidden: 4096,
        intermediate: 14_336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        theta: 10_000.0,
        scaling: None,
        eps: 1e-5,
        tied: false,
        qkv_bias: false,
    },
    // meta-llama/Llama-3.1-8B: 8,030,261,248.
    Decoder {
        name: "llama-3.1-8b",
        vocab: 128_256,
        hidden: 4096,
        intermediate: 14_336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        theta: 500_000.0,
        scaling: llama3(8.0),
        eps: 1e-5,
        tied: false,
        qkv_bias: false,
    },
];

/// The decoder preset `name`, if there is one.
pub(super) fn decoder(name: &str) -> Option<ModelSpec> {
    DECODERS.iter().find(|d| d.name == name).map(Decoder::spec)
}

impl Decoder {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: self.name.into(),
            vocab_size: self.vocab,
            d_model: self.hidden,
            n_heads: self.heads,
            n_layers: self.layers,
            d_ff: self.intermediate,
            seq_len: DECODER_SEQ_LEN,
            causal: true,
            norm: NormPlacement::Pre,
            activation: Activation::Swiglu,
            positions: Positions::Rotary(Rope {
                theta: self.theta,
                scaling: self.scaling,
            }),
            dropout: 0.0,
            norm_eps: self.eps,
            optimizer: OptimizerSpec::adamw(3e-4),
            norm_kind: NormKind::Rms,
            n_kv_heads: Some(self.kv_heads),
            biases: Biases {
                qkv: self.qkv_bias,
                ..Biases::NONE
            },
            tied_embeddings: self.tied,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::PRESETS;
    use super::*;

    #[test]
    fn parameter_counts_are_the_published_ones() {
        for (name, published) in [
            ("smollm2-135m", 134_515_008),
            ("qwen2.5-0.5b", 494_032_768),
            ("llama-3.2-1b", 1_235_814_400),
            ("qwen2.5-1.5b", 1_543_714_304),
            ("llama-3.2-3b", 3_212_749_824),
            ("mistral-7b", 7_241_732_096),
            ("llama-3.1-8b", 8_030_261_248),
        ] {
            let spec = ModelSpec::preset(name).unwrap();
            spec.validate().unwrap();
            assert_eq!(spec.parameter_count(), published, "{name}");
            assert!(PRESETS.contains(&name), "{name} is listed");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let rope = Rope {
            theta: 500_000.0,
            scaling: llama3(32.0),
        };
        let plain = Rope {
            scaling: None,
            ..rope
        };
        let (scaled, unscaled) = (rope.inverse_frequencies(64), plain.inverse_frequencies(64));
        assert_eq!(scaled.len(), 32);
        // Wavelength 2π < 2048: kept; the lowest frequency's wavelength is far past 8192.
        assert_eq!(scaled[0], unscaled[0]);
        assert!((scaled[31] - unscaled[31] / 32.0).abs() <= 1e-18);
        // In between, blended: between the two.
        let mid = scaled
            .iter()
            .zip(&unscaled)
            .find(|(s, u)| **s != **u && (**s - **u / 32.0).abs() > 1e-18)
            .expect("a blended band");
        assert!(*mid.0 < *mid.1 && *mid.0 > *mid.1 / 32.0);
    }
}
