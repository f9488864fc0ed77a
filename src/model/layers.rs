//! Differentiable building blocks.
//!
//! candle's fused `softmax_last_dim`, `layer_norm` and `rms_norm` have no backward pass and cut
//! gradients silently. Norms, softmax and the loss here dispatch on [`Engine`]: the fused ops of
//! [`crate::ops`] (with backward passes that keep only what they need) by default, or the same
//! maths composed from differentiable candle primitives, kept as the reference.
//! Weights are f32 masters; [`Linear::forward`] casts them to the activations' dtype, which is
//! how mixed precision works here (the cast's backward returns f32 gradients to the master).

use candle_core::{DType, Tensor, D};

use crate::model::batch::LossMask;
use crate::model::params::{Init, ParamStore};
use crate::model::Engine;
use crate::spec::model::NormKind;
use crate::Result;

/// `y = x·Wᵀ + b` over the last dimension.
pub struct Linear {
    weight: candle_core::Var,
    bias: Option<candle_core::Var>,
    /// Where the layer's products run in fp8: the scales its operands were last converted at.
    /// Training state like the weight, kept from step to step.
    fp8: crate::ops::fp8::LayerScales,
}

impl Linear {
    /// Creates `name.weight` (`out × in`) and, if `bias`, `name.bias`.
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        (d_in, d_out): (usize, usize),
        weight_init: Init,
        bias_init: Option<Init>,
    ) -> Result<Self> {
        let weight = store.param(&format!("{name}.weight"), &[d_out, d_in], weight_init)?;
        let bias = match bias_init {
            Some(init) => Some(store.param(&format!("{name}.bias"), &[d_out], init)?),
            None => None,
        };
        Ok(Self::tied(weight, bias))
    }

    /// A layer over existing parameters: the vocabulary head that reuses the token embedding
    /// table (`vocab × d`) as its weight.
    pub fn tied(weight: candle_core::Var, bias: Option<candle_core::Var>) -> Self {
        Self {
            weight,
            bias,
            fp8: Default::default(),
        }
    }

    /// The weight (`out × in`).
    pub fn weight(&self) -> &candle_core::Var {
        &self.weight
    }

    /// The bias, if the layer has one.
    pub fn bias(&self) -> Option<&candle_core::Var> {
        self.bias.as_ref()
    }

    /// Delayed scaling's histories for the layer's fp8 products.
    pub fn fp8_scales(&self) -> &crate::ops::fp8::LayerScales {
        &self.fp8
    }

    /// Applies the layer to `x` of shape `(..., d_in)`, computing in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let dims = x.dims().to_vec();
        let d_in = *dims
            .last()
            .expect("activations have at least one dimension");
        let rows = x.elem_count() / d_in;
        let w = cast(self.weight.as_tensor(), dtype)?;
        let y = x.reshape((rows, d_in))?.matmul(&w.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&cast(b.as_tensor(), dtype)?)?,
            None => y,
        };
        let mut out_dims = dims;
        *out_dims.last_mut().expect("non-empty") = y.dim(1)?;
        Ok(y.reshape(out_dims)?)
    }
}

/// Layer or RMS normalisation over the last dimension, computed in f32 whatever the input
/// dtype.
pub struct Norm {
    gamma: candle_core::Var,
    /// The shift; RMS norm has none.
    beta: Option<candle_core::Var>,
    eps: f64,
    kind: NormKind,
}

impl Norm {
    /// Creates `name.weight` (ones) and, for layer norm, `name.bias` (zeros) of width `d`.
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        d: usize,
        eps: f64,
        kind: NormKind,
    ) -> Result<Self> {
        let gamma = store.param(&format!("{name}.weight"), &[d], Init::Ones)?;
        let beta = match kind {
            NormKind::Layer => Some(store.param(&format!("{name}.bias"), &[d], Init::Zeros)?),
            NormKind::Rms => None,
        };
        Ok(Self {
            gamma,
            beta,
            eps,
            kind,
        })
    }

    /// The scale (`gamma`), the shift (`beta`, layer norm only) and epsilon.
    pub fn params(&self) -> (&candle_core::Var, Option<&candle_core::Var>, f64) {
        (&self.gamma, self.beta.as_ref(), self.eps)
    }

    /// Layer or RMS norm.
    pub fn kind(&self) -> NormKind {
        self.kind
    }

    /// Normalises `x` and returns it in `x`'s dtype.
    pub fn forward(&self, x: &Tensor, engine: Engine) -> Result<Tensor> {
        let gamma = self.gamma.as_tensor();
        if engine != Engine::Composite {
            return Ok(match &self.beta {
                Some(beta) => crate::ops::layer_norm(x, gamma, beta.as_tensor(), self.eps)?,
                None => crate::ops::rms_norm(x, gamma, self.eps)?,
            });
        }
        let dtype = x.dtype();
        let x = cast(x, DType::F32)?;
        let centred = match self.kind {
            NormKind::Layer => x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?,
            NormKind::Rms => x,
        };
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let y = normed.broadcast_mul(gamma)?;
        let y = match &self.beta {
            Some(beta) => y.broadcast_add(beta.as_tensor())?,
            None => y,
        };
        cast(&y, dtype)
    }
}

/// Softmax over the last dimension. The subtracted maximum is detached: softmax does not depend
/// on it, so its gradient is zero and tracking it would only cost memory and time.
pub fn softmax_last_dim(x: &Tensor, engine: Engine) -> Result<Tensor> {
    if engine != Engine::Composite {
        return Ok(crate::ops::softmax_last_dim(x)?);
    }
    let max = x.max_keepdim(D::Minus1)?.detach();
    let exp = x.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    Ok(exp.broadcast_div(&sum)?)
}

/// Mean cross-entropy of `logits` (`rows × classes`, any float dtype) against `targets` (`rows`,
/// u32), computed in f32, over the targets `mask` counts (every one without a mask).
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&LossMask>,
    engine: Engine,
) -> Result<Tensor> {
    let per_row = if engine != Engine::Composite {
        crate::ops::cross_entropy_rows(logits, targets)?
    } else {
        let logits = cast(logits, DType::F32)?;
        let max = logits.max_keepdim(D::Minus1)?.detach();
        let shifted = logits.broadcast_sub(&max)?;
        let log_sum_exp = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let log_probs = shifted.broadcast_sub(&log_sum_exp)?;
        log_probs
            .gather(&targets.unsqueeze(1)?, 1)?
            .squeeze(1)?
            .neg()?
    };
    Ok(match mask {
        None => per_row.mean_all()?,
        Some(mask) => ((per_row * &mask.weights)?.sum_all()? / mask.counted.max(1) as f64)?,
    })
}

/// Casts only when needed (a same-dtype cast would still copy).
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        Ok(x.to_dtype(dtype)?)
    }
}
