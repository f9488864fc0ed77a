//! The Transformer language model, built from a [`ModelSpec`].

pub mod block;
pub mod dropout;
pub mod layers;
pub mod params;

use candle_core::{DType, Device, Tensor};

use crate::model::block::{Block, InitScheme};
use crate::model::dropout::Dropout;
use crate::model::layers::{cast, LayerNorm, Linear};
use crate::model::params::{Init, ParamStore};
use crate::spec::model::{ModelSpec, NormPlacement, Positions};
use crate::Result;

/// Which implementation of norms, softmax and the loss a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// Fused operations that save only what their backward pass needs (the default).
    #[default]
    Fused,
    /// The same maths composed from candle primitives: the reference the fused path is
    /// tested against.
    Composite,
}

/// Per-forward-pass context: dropout masks and the engine.
pub struct Ctx {
    /// Dropout for this micro-batch (disabled for evaluation).
    pub dropout: Dropout,
    /// Implementation choice.
    pub engine: Engine,
}

/// Embedding → blocks → (final norm) → vocabulary head.
pub struct Transformer {
    spec: ModelSpec,
    embed: candle_core::Var,
    positions: Option<candle_core::Var>,
    blocks: Vec<Block>,
    final_norm: Option<LayerNorm>,
    head: Linear,
    params: ParamStore,
}

impl Transformer {
    /// Builds the model with f32 master weights on `device`, initialised from `seed`.
    pub fn new(spec: &ModelSpec, device: &Device, seed: u64) -> Result<Self> {
        let mut store = ParamStore::new(device, seed);
        let init = InitScheme::for_spec(spec);
        let d = spec.d_model;
        let embed_init = match spec.positions {
            // nn.Embedding's default N(0, 1); GPT-2 uses N(0, 0.02).
            Positions::None => Init::Normal(1.0),
            Positions::Learned => Init::Normal(0.02),
        };
        let embed = store.param("embed.weight", &[spec.vocab_size, d], embed_init)?;
        let positions = match spec.positions {
            Positions::None => None,
            Positions::Learned => {
                Some(store.param("positions.weight", &[spec.seq_len, d], Init::Normal(0.01))?)
            }
        };
        let blocks = (0..spec.n_layers)
            .map(|i| Block::new(&mut store, &format!("blocks.{i}"), spec, &init))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = match spec.norm {
            NormPlacement::Pre => Some(LayerNorm::new(&mut store, "final_norm", d, spec.norm_eps)?),
            NormPlacement::Post => None,
        };
        let (head_w, head_b) = init.linear(d);
        let head = Linear::new(
            &mut store,
            "head",
            (d, spec.vocab_size),
            head_w,
            Some(head_b),
        )?;
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

    /// Logits `(batch·seq, vocab)` in `dtype` for `tokens` `(batch, seq)` (u32).
    pub fn forward(&self, tokens: &Tensor, dtype: DType, ctx: &Ctx) -> Result<Tensor> {
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
        let mask = if self.spec.causal {
            Some(causal_mask(s, dtype, tokens.device())?)
        } else {
            None
        };
        for block in &self.blocks {
            x = block.forward(&x, mask.as_ref(), ctx)?;
        }
        if let Some(norm) = &self.final_norm {
            x = norm.forward(&x, ctx.engine)?;
        }
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
