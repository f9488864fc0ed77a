//! The Transformer language model, built from a [`ModelSpec`].

pub mod autograd;
pub mod batch;
pub mod block;
pub mod dropout;
pub mod explicit;
pub mod gradients;
pub mod layers;
pub mod params;
pub mod recompute;

use candle_core::{DType, Device, Tensor};

use crate::model::block::{Block, InitScheme, RopeTables};
use crate::model::dropout::Dropout;
use crate::model::layers::{cast, Linear, Norm};
use crate::model::params::{Init, InitValues, ParamStore};
use crate::spec::model::{ModelSpec, NormPlacement, Positions};
use crate::Result;

/// Which implementation of norms, softmax and the loss a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// candle's autograd over fused operations that save only what their backward pass needs.
    Fused,
    /// The same maths composed from candle primitives: the reference the fused path is
    /// tested against.
    Composite,
    /// Hand-written forward and backward passes ([`explicit`]) that bypass candle's autograd:
    /// they keep exactly the activations backward needs, fuse bias, activation, dropout and
    /// residual into one pass, regenerate dropout masks instead of storing them, and run flash
    /// attention where the device has kernels for it. The default.
    #[default]
    Explicit,
    /// The explicit engine with attention probabilities materialised and kept for the backward
    /// pass: the reference for flash attention, and what runs where flash attention cannot.
    ExplicitMaterialized,
}

impl Engine {
    /// The attention implementation of an explicit engine; `None` for the autograd engines.
    pub fn explicit_attention(self) -> Option<explicit::Attention> {
        match self {
            Engine::Explicit => Some(explicit::Attention::Flash),
            Engine::ExplicitMaterialized => Some(explicit::Attention::Materialized),
            Engine::Fused | Engine::Composite => None,
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "explicit" => Ok(Engine::Explicit),
            "explicit-materialized" => Ok(Engine::ExplicitMaterialized),
            "fused" => Ok(Engine::Fused),
            "composite" => Ok(Engine::Composite),
            other => Err(format!(
                "unknown engine `{other}`; known: explicit, explicit-materialized, fused, composite"
            )),
        }
    }
}

/// How the explicit engine computes the vocabulary head's weight gradient.
///
/// The head's weight is the largest matrix of most models (gpt-1.3b: 50,257 × 2048), and a
/// tied one's gradient is only complete once the embeddings' part arrives at the very end of
/// the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadGradient {
    /// At once, from the head's backward: an f32 sum of the weight's shape (with the
    /// embeddings' part added in place at the end for a tied head) beside a half-precision
    /// copy of the weight. The fewest products.
    #[default]
    Whole,
    /// By slices of the weight's rows, after the rest of the backward pass: the head's
    /// products read half-precision slices cast from the masters when they run, and each
    /// slice's gradient is recomputed from the kept hidden states and each row's log-sum-exp,
    /// takes the embeddings' part of those rows (tied), and is handed over (and settled) alone;
    /// an untied embedding table's gradient goes by the same slices. No weight-sized buffer
    /// ever exists, for one more head product per step; worth it where
    /// each part is updated as soon as it settles ([`crate::knobs::Update::InBackward`]).
    ByRows,
}

/// Per-forward-pass context: dropout masks and the engine.
pub struct Ctx {
    /// Dropout for this micro-batch (disabled for evaluation). Blocks draw from sub-streams of
    /// it ([`Ctx::block`]); the embedding dropout draws from it directly.
    pub dropout: Dropout,
    /// Implementation choice.
    pub engine: Engine,
}

impl Ctx {
    /// The context of block `index`: its own dropout sub-stream, opened afresh, so that running
    /// the block again (activation checkpointing) draws the same masks.
    pub fn block(&self, index: usize) -> Result<Ctx> {
        Ok(Ctx {
            dropout: self.dropout.sub_stream(index as u64)?,
            engine: self.engine,
        })
    }
}

/// Where a model's f32 master weights live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masters {
    /// The model's `Var`s are the f32 masters, on the training device.
    Device,
    /// The masters live in a host buffer (taken by the offloaded optimizer); the device holds
    /// working copies in [`params::working_dtype`] for this compute dtype.
    Host {
        /// The dtype activations run in.
        compute: DType,
    },
    /// There are no f32 masters: the device's working copies (matrices in this compute
    /// dtype, vectors in f32) are the masters, which a compact state layout updates in place.
    Working {
        /// The dtype activations run in.
        compute: DType,
    },
}

/// Embedding → blocks → (final norm) → vocabulary head.
pub struct Transformer {
    spec: ModelSpec,
    embed: candle_core::Var,
    positions: Option<candle_core::Var>,
    blocks: Vec<Block>,
    final_norm: Option<Norm>,
    head: Linear,
    params: ParamStore,
}

impl Transformer {
    /// Builds the model with f32 master weights on `device`, initialised from `seed`.
    pub fn new(spec: &ModelSpec, device: &Device, seed: u64) -> Result<Self> {
        Self::with_masters(spec, device, seed, Masters::Device)
    }

    /// Builds the model with its master weights where `masters` says; the initial values are
    /// the same either way.
    pub fn with_masters(
        spec: &ModelSpec,
        device: &Device,
        seed: u64,
        masters: Masters,
    ) -> Result<Self> {
        Self::build(spec, device, seed, masters, InitValues::Seeded)
    }

    /// [`Transformer::with_masters`] with initial values from `values`.
    pub fn build(
        spec: &ModelSpec,
        device: &Device,
        seed: u64,
        masters: Masters,
        values: InitValues,
    ) -> Result<Self> {
        let mut store = match masters {
            Masters::Device => ParamStore::new(device, seed),
            Masters::Host { compute } => {
                ParamStore::with_host_masters(device, seed, compute, spec.parameter_count())
            }
            Masters::Working { compute } => ParamStore::with_working_masters(device, seed, compute),
        }
        .with_values(values);
        let init = InitScheme::for_spec(spec);
        let d = spec.d_model;
        let embed_init = match spec.positions {
            // nn.Embedding's default N(0, 1); GPT-2 and Llama use N(0, 0.02).
            Positions::None => Init::Normal(1.0),
            Positions::Learned | Positions::Rotary(_) => Init::Normal(0.02),
        };
        let embed = store.param("embed.weight", &[spec.vocab_size, d], embed_init)?;
        let positions = match spec.positions {
            Positions::None | Positions::Rotary(_) => None,
            Positions::Learned => {
                Some(store.param("positions.weight", &[spec.seq_len, d], Init::Normal(0.01))?)
            }
        };
        let blocks = (0..spec.n_layers)
            .map(|i| Block::new(&mut store, &format!("blocks.{i}"), spec, &init))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = match spec.norm {
            NormPlacement::Pre => Some(Norm::new(
                &mut store,
                "final_norm",
                d,
                spec.norm_eps,
                spec.norm_kind,
            )?),
            NormPlacement::Post => None,
        };
        let (head_w, head_b) = init.linear(d);
        let head = if spec.tied_embeddings {
            let bias = match spec.biases.head {
                true => Some(store.param("head.bias", &[spec.vocab_size], head_b)?),
                false => None,
            };
            Linear::tied(embed.clone(), bias)
        } else {
            Linear::new(
                &mut store,
                "head",
                (d, spec.vocab_size),
                head_w,
                spec.biases.head.then_some(head_b),
            )?
        };
        Ok(Self {
            spec: spec.clone(),
            embed,
            positions,
            blocks,
            final_norm,
            head,
            params: store,
        })
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The trainable parameters.
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Mutable access to the parameters (to take the host masters).
    pub fn params_mut(&mut self) -> &mut ParamStore {
        &mut self.params
    }

    /// The token embedding table (`vocab × d`).
    pub fn token_embedding(&self) -> &candle_core::Var {
        &self.embed
    }

    /// The learned position table (`seq × d`), if the model has one.
    pub fn position_embedding(&self) -> Option<&candle_core::Var> {
        self.positions.as_ref()
    }

    /// The final norm of pre-norm models.
    pub fn final_norm(&self) -> Option<&Norm> {
        self.final_norm.as_ref()
    }

    /// The vocabulary head.
    pub fn head_layer(&self) -> &Linear {
        &self.head
    }

    /// The Transformer blocks, in order.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// The blocks' linear layers (the ones whose products may run in fp8), each with its
    /// weight's name, in order.
    pub fn block_linears(&self) -> Vec<(&str, &Linear)> {
        let params = self.params();
        let name_of: std::collections::HashMap<_, &str> = params
            .vars()
            .iter()
            .zip(params.names())
            .map(|(v, n)| (v.as_tensor().id(), n.as_str()))
            .collect();
        let mut out = Vec::new();
        for block in &self.blocks {
            let l = block.layers();
            for linear in [l.qkv, l.out, l.ff_in, l.ff_out] {
                if let Some(name) = name_of.get(&linear.weight().as_tensor().id()) {
                    out.push((*name, linear));
                }
            }
        }
        out
    }

    /// Whether the vocabulary head reuses the token embedding table.
    pub fn is_tied(&self) -> bool {
        self.spec.tied_embeddings
    }

    /// Logits `(batch·seq, vocab)` in `dtype` for `tokens` `(batch, seq)` (u32).
    pub fn forward(&self, tokens: &Tensor, dtype: DType, ctx: &Ctx) -> Result<Tensor> {
        let mask = self.attention_mask(tokens.dim(1)?, dtype, tokens.device())?;
        let rope = self.rope_tables(tokens.dim(1)?, dtype, tokens.device())?;
        let mut x = self.embed(tokens, dtype, ctx)?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, mask.as_ref(), rope.as_ref(), &ctx.block(i)?)?;
        }
        self.head(&x, ctx)
    }

    /// The rotary tables for sequences of `seq` tokens, for models with rotary positions.
    pub(crate) fn rope_tables(
        &self,
        seq: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<RopeTables>> {
        match self.spec.positions {
            Positions::Rotary(rope) => Ok(Some(RopeTables::new(
                &rope,
                self.spec.head_dim(),
                seq,
                dtype,
                device,
            )?)),
            Positions::None | Positions::Learned => Ok(None),
        }
    }

    /// The same logits as [`Transformer::forward`] without keeping the graph beyond one block:
    /// each block's output is detached, so memory holds one block's activations at a time
    /// (evaluation, where no gradient is wanted).
    pub fn forward_detached(&self, tokens: &Tensor, dtype: DType, ctx: &Ctx) -> Result<Tensor> {
        let mask = self.attention_mask(tokens.dim(1)?, dtype, tokens.device())?;
        let rope = self.rope_tables(tokens.dim(1)?, dtype, tokens.device())?;
        let mut x = self.embed(tokens, dtype, ctx)?.detach();
        for (i, block) in self.blocks.iter().enumerate() {
            x = block
                .forward(&x, mask.as_ref(), rope.as_ref(), &ctx.block(i)?)?
                .detach();
        }
        Ok(self.head(&x, ctx)?.detach())
    }

    /// Token (and position) embeddings `(batch, seq, d_model)` in `dtype`, with the embedding
    /// dropout of pre-norm models.
    pub fn embed(&self, tokens: &Tensor, dtype: DType, ctx: &Ctx) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let d = self.spec.d_model;
        let mut x = self
            .embed
            .as_tensor()
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, s, d))?;
        if let Some(pos) = &self.positions {
            x = x.broadcast_add(&pos.as_tensor().narrow(0, 0, s)?)?;
        }
        let mut x = cast(&x, dtype)?;
        if self.spec.norm == NormPlacement::Pre {
            // GPT-2 drops embeddings; PyTorch's encoder stack (the seed) does not.
            x = ctx.dropout.apply(&x)?;
        }
        Ok(x)
    }

    /// The additive attention mask for sequences of `seq` tokens (`None` when not causal).
    pub fn attention_mask(
        &self,
        seq: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        if self.spec.causal {
            Ok(Some(causal_mask(seq, dtype, device)?))
        } else {
            Ok(None)
        }
    }

    /// Final norm (pre-norm models) and vocabulary head: `(batch, seq, d_model)` → logits
    /// `(batch·seq, vocab)`.
    pub fn head(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, s, d) = x.dims3()?;
        let x = match &self.final_norm {
            Some(norm) => norm.forward(x, ctx.engine)?,
            None => x.clone(),
        };
        self.head.forward(&x.reshape((b * s, d))?)
    }
}

/// Additive mask: 0 on and below the diagonal, −∞ above (a token sees only its past).
fn causal_mask(s: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let values: Vec<f32> = (0..s)
        .flat_map(|i| (0..s).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(values, (s, s), device)?.to_dtype(dtype)?)
}
