//! One Transformer block: multi-head self-attention (with grouped key/value heads and rotary
//! positions where the spec has them) and a feed-forward (ReLU, GELU or SwiGLU), pre- or
//! post-norm.

use candle_core::{DType, Device, Tensor};

use crate::model::layers::{softmax_last_dim, Linear, Norm};
use crate::model::params::{Init, ParamStore};
use crate::model::Ctx;
use crate::spec::model::{Activation, ModelSpec, NormPlacement, Positions, Rope};
use crate::Result;

/// Multi-head self-attention with a fused q/k/v projection, as PyTorch's `nn.MultiheadAttention`;
/// its columns are the query heads', then the key and value heads' (fewer with grouped-query
/// attention).
struct SelfAttention {
    qkv: Linear,
    out: Linear,
    n_heads: usize,
    kv_heads: usize,
}

/// A Transformer block.
pub struct Block {
    attn: SelfAttention,
    ff_in: Linear,
    ff_out: Linear,
    norm1: Norm,
    norm2: Norm,
    placement: NormPlacement,
    activation: Activation,
    rope: Option<Rope>,
}

/// The cosines and sines of a rotary embedding for one sequence length, `(seq, hd)` each in the
/// activations' dtype (each frequency twice: the "rotate half" layout), for the autograd engines.
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// The tables of `rope` for heads of `hd` and sequences of `seq` tokens; the angles in f32
    /// as the explicit engine's kernels compute them.
    pub fn new(rope: &Rope, hd: usize, seq: usize, dtype: DType, device: &Device) -> Result<Self> {
        let freqs: Vec<f32> = rope
            .inverse_frequencies(hd)
            .iter()
            .map(|&f| f as f32)
            .collect();
        let half = hd / 2;
        let mut cos = Vec::with_capacity(seq * hd);
        let mut sin = Vec::with_capacity(seq * hd);
        for pos in 0..seq {
            for i in 0..hd {
                let (s, c) = (pos as f32 * freqs[i % half]).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        let table = |v: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, (seq, hd), device)?.to_dtype(dtype)?)
        };
        Ok(Self {
            cos: table(cos)?,
            sin: table(sin)?,
        })
    }

    /// `x·cos + rotate_half(x)·sin` for heads `x` of `(batch, heads, seq, hd)`.
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        let hd = x.dim(3)?;
        let half = hd / 2;
        let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
        Ok((x.broadcast_mul(&self.cos)? + rotated.broadcast_mul(&self.sin)?)?)
    }
}

/// Initialisation scheme: the seed follows PyTorch's layer defaults, GPT-style models GPT-2's,
/// rotary decoders Hugging Face's Llama (N(0, 0.02) everywhere, no residual scaling).
pub(crate) struct InitScheme {
    gpt: bool,
    scale_residuals: bool,
    n_layers: usize,
}

impl InitScheme {
    pub(crate) fn for_spec(spec: &ModelSpec) -> Self {
        Self {
            gpt: spec.positions != Positions::None,
            scale_residuals: spec.positions == Positions::Learned,
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
        if self.gpt && !self.scale_residuals {
            (Init::Normal(0.02), Init::Zeros)
        } else if self.gpt {
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
    /// The fused q/k/v projection (`d → (heads + 2·kv_heads)·hd`).
    pub qkv: &'a Linear,
    /// The attention output projection.
    pub out: &'a Linear,
    /// The feed-forward input projection (`d → d_ff`, or `2·d_ff` for SwiGLU's gate and up).
    pub ff_in: &'a Linear,
    /// The feed-forward output projection.
    pub ff_out: &'a Linear,
    /// The first norm (before attention, or after its residual in post-norm blocks).
    pub norm1: &'a Norm,
    /// The second norm.
    pub norm2: &'a Norm,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Norm placement.
    pub placement: NormPlacement,
    /// Feed-forward activation.
    pub activation: Activation,
    /// The rotary embedding of queries and keys, if any.
    pub rope: Option<Rope>,
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
            kv_heads: self.attn.kv_heads,
            placement: self.placement,
            activation: self.activation,
            rope: self.rope,
        }
    }

    pub(crate) fn new(
        store: &mut ParamStore,
        name: &str,
        spec: &ModelSpec,
        init: &InitScheme,
    ) -> Result<Self> {
        let d = spec.d_model;
        let b = spec.biases;
        let (qkv_w, qkv_b) = init.qkv(d);
        let (out_w, out_b) = init.residual(d);
        let (in_w, in_b) = init.linear(d);
        let (ff_out_w, ff_out_b) = if init.gpt {
            init.residual(spec.d_ff)
        } else {
            init.linear(spec.d_ff)
        };
        let norm = |store: &mut ParamStore, which: &str| {
            Norm::new(
                store,
                &format!("{name}.{which}"),
                d,
                spec.norm_eps,
                spec.norm_kind,
            )
        };
        let rope = match spec.positions {
            Positions::Rotary(rope) => Some(rope),
            Positions::None | Positions::Learned => None,
        };
        Ok(Self {
            attn: SelfAttention {
                qkv: Linear::new(
                    store,
                    &format!("{name}.attn.qkv"),
                    (d, spec.qkv_width()),
                    qkv_w,
                    b.qkv.then_some(qkv_b),
                )?,
                out: Linear::new(
                    store,
                    &format!("{name}.attn.out"),
                    (d, d),
                    out_w,
                    b.out.then_some(out_b),
                )?,
                n_heads: spec.n_heads,
                kv_heads: spec.kv_heads(),
            },
            ff_in: Linear::new(
                store,
                &format!("{name}.ff.in"),
                (d, spec.ff_in_width()),
                in_w,
                b.mlp.then_some(in_b),
            )?,
            ff_out: Linear::new(
                store,
                &format!("{name}.ff.out"),
                (spec.d_ff, d),
                ff_out_w,
                b.mlp.then_some(ff_out_b),
            )?,
            norm1: norm(store, "norm1")?,
            norm2: norm(store, "norm2")?,
            placement: spec.norm,
            activation: spec.activation,
            rope,
        })
    }

    /// `x`: `(batch, seq, d_model)`; `mask`: additive `(seq, seq)` attention mask or `None`;
    /// `rope`: the rotary tables when the model has rotary positions.
    pub fn forward(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: Option<&RopeTables>,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        match self.placement {
            NormPlacement::Post => {
                let a = ctx.dropout.apply(&self.attn.forward(x, mask, rope, ctx)?)?;
                let x = self.norm1.forward(&(x + a)?, ctx.engine)?;
                let f = ctx.dropout.apply(&self.feed_forward(&x, ctx)?)?;
                self.norm2.forward(&(x + f)?, ctx.engine)
            }
            NormPlacement::Pre => {
                let a = ctx.dropout.apply(&self.attn.forward(
                    &self.norm1.forward(x, ctx.engine)?,
                    mask,
                    rope,
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
            Activation::Swiglu => {
                let f = h.dim(candle_core::D::Minus1)? / 2;
                let (gate, up) = (h.narrow(2, 0, f)?, h.narrow(2, f, f)?);
                // silu(g) = g · σ(g), from differentiable primitives.
                let sigmoid = (gate.neg()?.exp()? + 1.0)?.recip()?;
                ((gate * sigmoid)? * up)?
            }
        };
        self.ff_out.forward(&ctx.dropout.apply(&h)?)
    }
}

impl SelfAttention {
    fn forward(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: Option<&RopeTables>,
        ctx: &Ctx,
    ) -> Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let (h, kv) = (self.n_heads, self.kv_heads);
        let hd = d / h;
        let qkv = self.qkv.forward(x)?;
        // Columns [q (h heads) | k (kv heads) | v (kv heads)] → (b, heads, s, hd) each.
        let heads = |start: usize, n: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, start * hd, n * hd)?
                .reshape((b, s, n, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (mut q, mut k, v) = (heads(0, h)?, heads(h, kv)?, heads(h + kv, kv)?);
        if let Some(tables) = rope {
            q = tables.rotate(&q)?;
            k = tables.rotate(&k)?;
        }
        // Each key/value head serves h / kv query heads.
        let repeat = |t: Tensor| -> Result<Tensor> {
            if kv == h {
                return Ok(t);
            }
            Ok(t.unsqueeze(2)?
                .broadcast_as((b, kv, h / kv, s, hd))?
                .reshape((b, h, s, hd))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let q = (q * (1.0 / (hd as f64).sqrt()))?;
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
