//! One Transformer block: multi-head self-attention and a feed-forward, pre- or post-norm.

use candle_core::Tensor;

use crate::model::layers::{softmax_last_dim, LayerNorm, Linear};
use crate::model::params::{Init, ParamStore};
use crate::model::Ctx;
use crate::spec::model::{Activation, ModelSpec, NormPlacement, Positions};
use crate::Result;

/// Multi-head self-attention with a fused q/k/v projection, as PyTorch's `nn.MultiheadAttention`.
struct SelfAttention {
    qkv: Linear,
    out: Linear,
    n_heads: usize,
}

/// A Transformer block.
pub struct Block {
    attn: SelfAttention,
    ff_in: Linear,
    ff_out: Linear,
    norm1: LayerNorm,
    norm2: LayerNorm,
    placement: NormPlacement,
    activation: Activation,
}

/// Initialisation scheme: the seed follows PyTorch's layer defaults, GPT-style models GPT-2's.
pub(crate) struct InitScheme {
    gpt: bool,
    n_layers: usize,
}

impl InitScheme {
    pub(crate) fn for_spec(spec: &ModelSpec) -> Self {
        Self {
            gpt: spec.positions == Positions::Learned,
            n_layers: spec.n_layers,
        }
    }

    /// PyTorch `nn.Linear`: kaiming-uniform weights and uniform biases, both ±1/√fan_in.
    /// GPT-2: N(0, 0.02) weights, zero biases.
    pub(crate) fn linear(&self, fan_in: usize) -> (Init, Init) {
        if self.gpt {
            (Init::Normal(0.02), Init::Zeros)
        } else {
            let bound = 1.0 / (fan_in as f32).sqrt();
            (Init::Uniform(bound), Init::Uniform(bound))
        }
    }

    /// Residual output projections: GPT-2 scales them by 1/√(2·layers).
    fn residual(&self, fan_in: usize) -> (Init, Init) {
        if self.gpt {
            (
                Init::Normal(0.02 / (2.0 * self.n_layers as f32).sqrt()),
                Init::Zeros,
            )
        } else {
            (self.linear(fan_in).0, Init::Zeros)
        }
    }

    /// `nn.MultiheadAttention.in_proj_weight`: Xavier-uniform, zero bias.
    fn qkv(&self, d: usize) -> (Init, Init) {
        if self.gpt {
            (Init::Normal(0.02), Init::Zeros)
        } else {
            (Init::Uniform((6.0 / (4 * d) as f32).sqrt()), Init::Zeros)
        }
    }
}

/// A block's layers, for the explicit engine ([`crate::model::explicit`]).
pub struct BlockLayers<'a> {
    /// The fused q/k/v projection (`d → 3d`).
    pub qkv: &'a Linear,
    /// The attention output projection.
    pub out: &'a Linear,
    /// The feed-forward input projection (`d → d_ff`).
    pub ff_in: &'a Linear,
    /// The feed-forward output projection.
    pub ff_out: &'a Linear,
    /// The first norm (before attention, or after its residual in post-norm blocks).
    pub norm1: &'a LayerNorm,
    /// The second norm.
    pub norm2: &'a LayerNorm,
    /// Attention heads.
    pub n_heads: usize,
    /// Norm placement.
    pub placement: NormPlacement,
    /// Feed-forward activation.
    pub activation: Activation,
}

impl Block {
    /// The block's layers.
    pub fn layers(&self) -> BlockLayers<'_> {
        BlockLayers {
            qkv: &self.attn.qkv,
            out: &self.attn.out,
            ff_in: &self.ff_in,
            ff_out: &self.ff_out,
            norm1: &self.norm1,
            norm2: &self.norm2,
            n_heads: self.attn.n_heads,
            placement: self.placement,
            activation: self.activation,
        }
    }

    pub(crate) fn new(
        store: &mut ParamStore,
        name: &str,
        spec: &ModelSpec,
        init: &InitScheme,
    ) -> Result<Self> {
        let d = spec.d_model;
        let (qkv_w, qkv_b) = init.qkv(d);
        let (out_w, out_b) = init.residual(d);
        let (in_w, in_b) = init.linear(d);
        let (ff_out_w, ff_out_b) = if init.gpt {
            init.residual(spec.d_ff)
        } else {
            init.linear(spec.d_ff)
        };
        Ok(Self {
            attn: SelfAttention {
                qkv: Linear::new(
                    store,
                    &format!("{name}.attn.qkv"),
                    (d, 3 * d),
                    qkv_w,
                    Some(qkv_b),
                )?,
                out: Linear::new(
                    store,
                    &format!("{name}.attn.out"),
                    (d, d),
                    out_w,
                    Some(out_b),
                )?,
                n_heads: spec.n_heads,
            },
            ff_in: Linear::new(
                store,
                &format!("{name}.ff.in"),
                (d, spec.d_ff),
                in_w,
                Some(in_b),
            )?,
            ff_out: Linear::new(
                store,
                &format!("{name}.ff.out"),
                (spec.d_ff, d),
                ff_out_w,
                Some(ff_out_b),
            )?,
            norm1: LayerNorm::new(store, &format!("{name}.norm1"), d, spec.norm_eps)?,
            norm2: LayerNorm::new(store, &format!("{name}.norm2"), d, spec.norm_eps)?,
            placement: spec.norm,
            activation: spec.activation,
        })
    }

    /// `x`: `(batch, seq, d_model)`; `mask`: additive `(seq, seq)` attention mask or `None`.
    pub fn forward(&self, x: &Tensor, mask: Option<&Tensor>, ctx: &Ctx) -> Result<Tensor> {
        match self.placement {
            NormPlacement::Post => {
                let a = ctx.dropout.apply(&self.attn.forward(x, mask, ctx)?)?;
                let x = self.norm1.forward(&(x + a)?, ctx.engine)?;
                let f = ctx.dropout.apply(&self.feed_forward(&x, ctx)?)?;
                self.norm2.forward(&(x + f)?, ctx.engine)
            }
            NormPlacement::Pre => {
                let a = ctx.dropout.apply(&self.attn.forward(
                    &self.norm1.forward(x, ctx.engine)?,
                    mask,
                    ctx,
                )?)?;
                let x = (x + a)?;
                let f = ctx
                    .dropout
                    .apply(&self.feed_forward(&self.norm2.forward(&x, ctx.engine)?, ctx)?)?;
                Ok((x + f)?)
            }
        }
    }

    fn feed_forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let h = self.ff_in.forward(x)?;
        let h = match self.activation {
            Activation::Relu => h.relu()?,
            Activation::Gelu => h.gelu()?,
        };
        self.ff_out.forward(&ctx.dropout.apply(&h)?)
    }
}

impl SelfAttention {
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>, ctx: &Ctx) -> Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let h = self.n_heads;
        let hd = d / h;
        // (b, s, 3, h, hd) → (3, b, h, s, hd): one projection, then split per head.
        let qkv = self
            .qkv
            .forward(x)?
            .reshape((b, s, 3, h, hd))?
            .permute((2, 0, 3, 1, 4))?;
        let q = (qkv.get(0)?.contiguous()? * (1.0 / (hd as f64).sqrt()))?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let scores = q.matmul(&k.t()?)?;
        let scores = match mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        let probs = ctx.dropout.apply(&softmax_last_dim(&scores, ctx.engine)?)?;
        let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, s, d))?;
        self.out.forward(&out)
    }
}
