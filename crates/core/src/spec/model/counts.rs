//! The parameters a spec builds, by the parts whose gradients a backward pass completes
//! together, counted in 64 bits with overflow checked (a spec may be any size until it is
//! validated).

use super::{Activation, ModelSpec, NormKind, NormPlacement, Positions};

/// Parameters of each part of a model, and how many of them are vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Token embeddings (shared with the head when tied) and learned positions.
    pub embeddings: u64,
    /// The token embedding table alone.
    pub vocab_rows: u64,
    /// One Transformer block.
    pub block: u64,
    /// A block's largest layer: a matrix with its bias, or a norm.
    pub layer: u64,
    /// The final norm and the head's own parameters (none of the matrix when tied).
    pub head: u64,
    /// Bias and norm vectors of one block.
    pub block_vectors: u64,
    /// Bias and norm vectors of the head part.
    pub head_vectors: u64,
}

impl Counts {
    /// The counts of `spec`; `None` when one overflows 64 bits.
    pub(crate) fn of(spec: &ModelSpec) -> Option<Self> {
        let n = |x: usize| x as u64;
        let (d, vocab) = (n(spec.d_model), n(spec.vocab_size));
        let qkv = n(spec.n_heads)
            .checked_add(n(spec.kv_heads()).checked_mul(2)?)?
            .checked_mul(n(spec.head_dim()))?;
        let ff = n(spec.d_ff);
        let ff_in = match spec.activation {
            Activation::Swiglu => ff.checked_mul(2)?,
            Activation::Relu | Activation::Gelu => ff,
        };
        let norm = match spec.norm_kind {
            NormKind::Layer => d.checked_mul(2)?,
            NormKind::Rms => d,
        };
        let b = spec.biases;
        let bias = |on: bool, width: u64| if on { width } else { 0 };
        let block_vectors = bias(b.qkv, qkv)
            .checked_add(bias(b.out, d))?
            .checked_add(bias(b.mlp, ff_in.checked_add(d)?))?
            .checked_add(norm.checked_mul(2)?)?;
        let matrices = d
            .checked_mul(qkv)?
            .checked_add(d.checked_mul(d)?)?
            .checked_add(d.checked_mul(ff_in)?)?
            .checked_add(ff.checked_mul(d)?)?;
        let layer = (d.checked_mul(qkv)?.checked_add(bias(b.qkv, qkv))?)
            .max(d.checked_mul(d)?.checked_add(bias(b.out, d))?)
            .max(d.checked_mul(ff_in)?.checked_add(bias(b.mlp, ff_in))?)
            .max(ff.checked_mul(d)?.checked_add(bias(b.mlp, d))?)
            .max(norm);
        let positions = match spec.positions {
            Positions::None | Positions::Rotary(_) => 0,
            Positions::Learned => n(spec.seq_len).checked_mul(d)?,
        };
        let final_norm = match spec.norm {
            NormPlacement::Pre => norm,
            NormPlacement::Post => 0,
        };
        let head_vectors = final_norm.checked_add(bias(b.head, vocab))?;
        let head_matrix = if spec.tied_embeddings {
            0
        } else {
            vocab.checked_mul(d)?
        };
        Some(Self {
            embeddings: vocab.checked_mul(d)?.checked_add(positions)?,
            vocab_rows: vocab.checked_mul(d)?,
            block: matrices.checked_add(block_vectors)?,
            layer,
            head: head_matrix.checked_add(head_vectors)?,
            block_vectors,
            head_vectors,
        })
    }

    /// Every parameter of a model of `layers` blocks.
    pub(crate) fn total(&self, layers: usize) -> Option<u64> {
        (layers as u64)
            .checked_mul(self.block)?
            .checked_add(self.embeddings)?
            .checked_add(self.head)
    }

    /// The vector parameters of a model of `layers` blocks.
    pub(crate) fn vectors(&self, layers: usize) -> Option<u64> {
        (layers as u64)
            .checked_mul(self.block_vectors)?
            .checked_add(self.head_vectors)
    }
}
