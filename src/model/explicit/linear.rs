//! Linear layers and layer norms with explicit backward passes.

use candle_core::{DType, Tensor, Var};

use super::Grads;
use crate::knobs::Precision;
use crate::model::layers::{Linear, Norm as NormLayer};
use crate::ops::fp8::{
    fp8_product, fp8_product_plus, Fp8Operand, LayerScales, OperandLayout, ScaleHistory,
};
use crate::ops::{self, DropoutMask};
use crate::spec::model::Activation;
use crate::Result;

/// How a block's matrix products run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Products {
    /// In the compute dtype.
    #[default]
    Compute,
    /// In fp8 (see [`ops::fp8`]): the weight and the input in E4M3, the output's gradient in
    /// E5M2, each at the scale its last conversions' largest magnitudes call for (delayed
    /// scaling, [`LayerScales`]), accumulated in f32 and written in the compute dtype (bf16 on a
    /// GPU). On a GPU with fp8 tensor cores the products run on them; on the CPU the
    /// same codes are decoded and multiplied (the emulation). Masters, norms, the head and the
    /// loss are untouched.
    Fp8,
}

impl Products {
    /// How `precision` runs the blocks' products: in fp8 for [`Precision::Fp8`], else in the
    /// compute dtype.
    pub fn of(precision: Precision) -> Self {
        match precision {
            Precision::Fp8 => Products::Fp8,
            _ => Products::Compute,
        }
    }
}

/// A linear layer's weight in the compute dtype (the f32 master where its products run in fp8)
/// and its f32 bias, with the `Var`s their gradients belong to.
pub(crate) struct Lin<'a> {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The bias in the half-precision compute dtype, which the product's own epilogue reads
    /// ([`ops::fused_linear`]); cast once per pass. `None` without a bias or off half precision.
    half_bias: Option<Tensor>,
    weight_var: &'a Var,
    bias_var: Option<&'a Var>,
    /// The layer's delayed-scaling histories, read and extended by fp8 products.
    scales: &'a LayerScales,
    /// The layer's output features; `weight` may have zero rows beyond them (see
    /// [`Lin::pad_outputs`]).
    outputs: usize,
    /// With fp8 products, the weight in E4M3, in the two layouts its products read (`weight`
    /// is then the f32 master they are converted from).
    fp8_weight: Option<Fp8Weight>,
    /// With fp8 products, the output gradient's layout that one of its two products has not
    /// read yet (see [`Lin::gradient_operand`]).
    fp8_gradient: GradientCodes,
}

impl<'a> Lin<'a> {
    /// Casts the weight once per pass (a no-op for half-precision working copies).
    pub(crate) fn new(layer: &'a Linear, dtype: DType) -> Result<Self> {
        Self::with_products(layer, dtype, Products::Compute)
    }

    /// The layer with its products run as `products` says. In fp8 the weight is not cast: its
    /// conversions read the f32 master directly, which moves fewer bytes than casting it to
    /// the compute dtype first and converting that (and rounds once, not twice).
    pub(crate) fn with_products(
        layer: &'a Linear,
        dtype: DType,
        products: Products,
    ) -> Result<Self> {
        // Detached: nothing here may record a graph.
        let master = layer.weight().as_tensor().detach();
        let (weight, fp8_weight) = match products {
            Products::Compute => (ops::to_half(&master, dtype)?, None),
            Products::Fp8 => (master, Some(Fp8Weight::default())),
        };
        let bias = match layer.bias() {
            Some(b) => Some(b.as_tensor().detach().to_dtype(DType::F32)?),
            None => None,
        };
        let half = matches!(dtype, DType::BF16 | DType::F16);
        let half_bias = match &bias {
            Some(b) if half && b.device().is_cuda() => Some(b.to_dtype(dtype)?),
            _ => None,
        };
        Ok(Self {
            outputs: weight.dim(0)?,
            weight,
            bias,
            half_bias,
            weight_var: layer.weight(),
            bias_var: layer.bias(),
            scales: layer.fp8_scales(),
            fp8_weight,
            fp8_gradient: GradientCodes::default(),
        })
    }

    /// Pads the output features with zero weights (and biases) up to a multiple of `multiple`,
    /// so that every dimension of the layer's three products is one, which cuBLAS needs for its
    /// aligned tensor-core kernels. The padded outputs are zero; a consumer must give them a
    /// zero gradient, and then the layer's gradients are exactly the unpadded ones.
    pub(crate) fn pad_outputs(mut self, multiple: usize) -> Result<Self> {
        let padded = self.outputs.div_ceil(multiple.max(1)) * multiple.max(1);
        self.weight = pad_rows(&self.weight, padded)?;
        if let Some(b) = &self.bias {
            self.bias = Some(pad_rows(b, padded)?);
        }
        if let Some(b) = &self.half_bias {
            self.half_bias = Some(pad_rows(b, padded)?);
        }
        Ok(self)
    }

    /// The layer's output features, without padding.
    pub(crate) fn outputs(&self) -> usize {
        self.outputs
    }

    /// The layer's output features with padding: the columns of its products.
    pub(crate) fn padded_outputs(&self) -> Result<usize> {
        Ok(self.weight.dim(0)?)
    }

    /// `x · Wᵀ` for `x` of `(rows, in)`: the product before the epilogue.
    pub(crate) fn product(&self, x: &Tensor) -> Result<Tensor> {
        let Some(w) = &self.fp8_weight else {
            return Ok(x.matmul(&self.weight.t()?)?);
        };
        let qx = self.scales.input.quantize(x, OperandLayout::Rows)?;
        let w = w.layout(&self.weight, &self.scales.weight, OperandLayout::Rows)?;
        Ok(fp8_product(&qx, w, x.dtype())?)
    }

    /// `residual + x · Wᵀ + b` with the bias and the residual in the product's own epilogue,
    /// where that applies on a GPU (see [`ops::fused_linear`] and [`fp8_product_plus`]); `None`
    /// where the caller's separate passes run instead.
    fn fused_product(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Option<Tensor>> {
        let Some(w) = &self.fp8_weight else {
            let fused = ops::fused_linear(x, &self.weight, self.half_bias.as_ref(), residual)?;
            return Ok(fused.computed());
        };
        if !x.device().is_cuda() || (self.half_bias.is_none() && residual.is_none()) {
            return Ok(None);
        }
        // The input is converted once: delayed scaling records each conversion's magnitude,
        // so the fallback multiplies these same codes.
        let qx = self.scales.input.quantize(x, OperandLayout::Rows)?;
        let w = w.layout(&self.weight, &self.scales.weight, OperandLayout::Rows)?;
        let fused = fp8_product_plus(&qx, w, x.dtype(), self.half_bias.as_ref(), residual)?;
        if let Some(y) = fused.computed() {
            return Ok(Some(y));
        }
        let y = fp8_product(&qx, w, x.dtype())?;
        Ok(Some(ops::epilogue(
            &y,
            self.bias.as_ref(),
            None,
            None,
            residual,
        )?))
    }

    /// The f32 bias, if the layer has one.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `residual + dropout(act(x · Wᵀ + b))`; the product alone when there is nothing to add
    /// (no pass that would only copy it).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        act: Option<Activation>,
        dropout: Option<DropoutMask>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let no_dropout = dropout.is_none_or(|m| m.threshold() == 0);
        // A bias and a residual alone go into the product's own epilogue on a GPU, the bias as
        // its half-precision copy.
        let fusable_bias = self.bias.is_none() || self.half_bias.is_some();
        if act.is_none() && no_dropout && fusable_bias {
            if let Some(y) = self.fused_product(x, residual)? {
                return Ok(y);
            }
        }
        let y = self.product(x)?;
        if self.bias.is_none() && act.is_none() && no_dropout && residual.is_none() {
            return Ok(y);
        }
        Ok(ops::epilogue(
            &y,
            self.bias.as_ref(),
            act,
            dropout,
            residual,
        )?)
    }

    /// The epilogue alone on a saved product `y` (recomputing an activation in backward).
    pub(crate) fn epilogue(
        &self,
        y: &Tensor,
        act: Option<Activation>,
        dropout: Option<DropoutMask>,
    ) -> Result<Tensor> {
        Ok(ops::epilogue(y, self.bias.as_ref(), act, dropout, None)?)
    }

    /// Gradient of the product's input from the gradient `dy` of `y = x · Wᵀ + b` (after the
    /// epilogue's own backward); hands the weight's and bias's gradients to `grads`.
    pub(crate) fn backward(&self, dy: &Tensor, x: &Tensor, grads: &mut Grads) -> Result<Tensor> {
        let (dw, db) = self.parameter_grads(dy, x)?;
        self.put_grads(dw, db, grads)?;
        self.input_grad(dy)
    }

    /// The weight's and bias's gradients from `dy` and the product's input `x` (rows of a
    /// padded weight included), in the compute dtype and f32.
    pub(crate) fn parameter_grads(
        &self,
        dy: &Tensor,
        x: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        Ok((self.weight_grad(dy, x)?, self.bias_grad(dy)?))
    }

    /// `dyᵀ · x`, in fp8 (E5M2 · E4M3) with fp8 products.
    fn weight_grad(&self, dy: &Tensor, x: &Tensor) -> Result<Tensor> {
        if self.fp8_weight.is_none() {
            return Ok(dy.t()?.matmul(x)?);
        }
        // The inner dimension is the rows: both operands are converted transposed.
        let qdy = self.gradient_operand(dy, OperandLayout::Transposed)?;
        let qx = self.scales.input.quantize(x, OperandLayout::Transposed)?;
        Ok(fp8_product(&qdy, &qx, dy.dtype())?)
    }

    /// Adds the weight's gradient from `dy` and `x` into `acc`, an f32 sum of the padded
    /// weight's shape, without a half-precision copy of it (see [`ops::accumulate_product_tn`]).
    pub(crate) fn accumulate_weight_grad(
        &self,
        acc: &Tensor,
        dy: &Tensor,
        x: &Tensor,
    ) -> Result<()> {
        if self.fp8_weight.is_some() {
            return Ok(ops::accumulate_into(acc, &self.weight_grad(dy, x)?)?);
        }
        Ok(ops::accumulate_product_tn(acc, dy, x)?)
    }

    /// The bias's gradient from `dy`, if the layer has a bias.
    pub(crate) fn bias_grad(&self, dy: &Tensor) -> Result<Option<Tensor>> {
        match self.bias_var {
            Some(_) => Ok(Some(column_sum(dy)?)),
            None => Ok(None),
        }
    }

    /// An f32 sum for the padded weight's gradient, zero.
    pub(crate) fn zero_weight_grad(&self) -> Result<Tensor> {
        Ok(Tensor::zeros(
            self.weight.dims(),
            DType::F32,
            self.weight.device(),
        )?)
    }

    /// Hands over the weight's and bias's gradients, without the rows of a padded weight
    /// beyond the outputs (their gradient is zero).
    pub(crate) fn put_grads(
        &self,
        dw: Tensor,
        db: Option<Tensor>,
        grads: &mut Grads,
    ) -> Result<()> {
        grads.put(self.weight_var, dw.narrow(0, 0, self.outputs)?)?;
        self.put_bias_grad(db, grads)
    }

    /// Hands over the bias's gradient alone (a tied weight's gradient goes elsewhere).
    pub(crate) fn put_bias_grad(&self, db: Option<Tensor>, grads: &mut Grads) -> Result<()> {
        if let (Some(b), Some(db)) = (self.bias_var, db) {
            grads.put(b, db.narrow(0, 0, self.outputs)?)?;
        }
        Ok(())
    }

    /// Gradient of the product's input: `dy · W`.
    pub(crate) fn input_grad(&self, dy: &Tensor) -> Result<Tensor> {
        let Some(w) = &self.fp8_weight else {
            return Ok(dy.matmul(&self.weight)?);
        };
        let qdy = self.gradient_operand(dy, OperandLayout::Rows)?;
        let w = w.layout(&self.weight, &self.scales.weight, OperandLayout::Transposed)?;
        Ok(fp8_product(&qdy, w, dy.dtype())?)
    }

    /// The output gradient `dy` in E5M2 laid out as `layout` says. The weight's gradient reads
    /// it transposed and the input's as it is: the first of the two converts both layouts in
    /// one pass and keeps the other for the second, which takes it (so it lives only between
    /// the two products).
    fn gradient_operand(&self, dy: &Tensor, layout: OperandLayout) -> Result<Fp8Operand> {
        let mut kept = self.fp8_gradient.0.borrow_mut();
        if let Some((id, kept_layout, _)) = &*kept {
            if *id == dy.id() && *kept_layout == layout {
                if let Some((_, _, operand)) = kept.take() {
                    return Ok(operand);
                }
            }
        }
        let (rows, transposed) = self.scales.gradient.quantize_pair(dy)?;
        let (wanted, other, other_layout) = match layout {
            OperandLayout::Rows => (rows, transposed, OperandLayout::Transposed),
            OperandLayout::Transposed => (transposed, rows, OperandLayout::Rows),
        };
        *kept = Some((dy.id(), other_layout, other));
        Ok(wanted)
    }

    /// [`Lin::backward`] through the epilogue first: `dout` is the gradient of the epilogue's
    /// output, `y` the saved product.
    pub(crate) fn backward_through(
        &self,
        dout: &Tensor,
        y: &Tensor,
        x: &Tensor,
        act: Option<Activation>,
        dropout: Option<DropoutMask>,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let dy = if act.is_none() && dropout.is_none() {
            dout.clone()
        } else {
            ops::epilogue_backward(dout, y, self.bias.as_ref(), act, dropout)?
        };
        self.backward(&dy, x, grads)
    }
}

/// A weight `W (out × in)` in E4M3, as its products read it, each layout converted when first
/// asked for: a forward pass reads only `W` and a backward pass only `Wᵀ`, and a block that is
/// recomputed builds its layers once for each.
#[derive(Default)]
struct Fp8Weight {
    /// `W` itself, for the forward `x · Wᵀ` (inner dimension `in`).
    rows: std::cell::OnceCell<Fp8Operand>,
    /// `Wᵀ`, for the input's gradient `dy · W` (inner dimension `out`).
    columns: std::cell::OnceCell<Fp8Operand>,
}

/// An output gradient's codes in the layout its second product reads, with the gradient's
/// identity and that layout.
#[derive(Default)]
struct GradientCodes(
    std::cell::RefCell<Option<(candle_core::TensorId, OperandLayout, Fp8Operand)>>,
);

impl Fp8Weight {
    /// `weight` laid out as `layout` says, converted on first use at `history`'s scale.
    fn layout(
        &self,
        weight: &Tensor,
        history: &ScaleHistory,
        layout: OperandLayout,
    ) -> Result<&Fp8Operand> {
        let cell = match layout {
            OperandLayout::Rows => &self.rows,
            OperandLayout::Transposed => &self.columns,
        };
        if let Some(done) = cell.get() {
            return Ok(done);
        }
        let converted = history.quantize(weight, layout)?;
        Ok(cell.get_or_init(|| converted))
    }
}

/// `t` (a vector or a matrix) with zero rows appended up to `rows`; `t` itself when it has
/// as many.
pub(crate) fn pad_rows(t: &Tensor, rows: usize) -> Result<Tensor> {
    let have = t.dim(0)?;
    if have >= rows {
        return Ok(t.clone());
    }
    let mut shape = t.dims().to_vec();
    shape[0] = rows - have;
    let zeros = Tensor::zeros(shape, t.dtype(), t.device())?;
    Ok(Tensor::cat(&[t, &zeros], 0)?)
}

/// Column sums of a `(rows, cols)` matrix as an f32 vector: one product with a row of ones, so
/// the sum runs in cuBLAS with f32 accumulation instead of a strided reduction.
pub(crate) fn column_sum(m: &Tensor) -> Result<Tensor> {
    let rows = m.dim(0)?;
    let ones = Tensor::ones((1, rows), m.dtype(), m.device())?;
    Ok(ones.matmul(m)?.squeeze(0)?.to_dtype(DType::F32)?)
}

/// A layer or RMS norm's f32 parameters and their `Var`s.
pub(crate) struct Norm<'a> {
    gamma: &'a Var,
    /// Layer norm's shift; RMS norm has none.
    beta: Option<&'a Var>,
    eps: f64,
}

impl<'a> Norm<'a> {
    pub(crate) fn new(layer: &'a NormLayer) -> Self {
        let (gamma, beta, eps) = layer.params();
        Self { gamma, beta, eps }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gamma = self.gamma.as_tensor().detach();
        Ok(match self.beta {
            Some(beta) => ops::layer_norm(x, &gamma, &beta.as_tensor().detach(), self.eps)?,
            None => ops::rms_norm(x, &gamma, self.eps)?,
        })
    }

    /// Gradient of the norm's input `x` from its output gradient; hands over gamma's (and
    /// beta's).
    pub(crate) fn backward(&self, x: &Tensor, dy: &Tensor, grads: &mut Grads) -> Result<Tensor> {
        self.backward_plus(x, dy, None, grads)
    }

    /// [`Norm::backward`] with `plus` added to the input's gradient in the same pass: where
    /// the norm's input is also a residual stream, whose own gradient meets it there.
    pub(crate) fn backward_plus(
        &self,
        x: &Tensor,
        dy: &Tensor,
        plus: Option<&Tensor>,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let gamma = self.gamma.as_tensor().detach();
        match self.beta {
            Some(beta) => {
                let (dx, dgamma, dbeta) =
                    ops::layer_norm_backward_plus(x, &gamma, dy, plus, self.eps)?;
                grads.put(self.gamma, dgamma)?;
                grads.put(beta, dbeta)?;
                Ok(dx)
            }
            None => {
                let (dx, dgamma) = ops::rms_norm_backward_plus(x, &gamma, dy, plus, self.eps)?;
                grads.put(self.gamma, dgamma)?;
                Ok(dx)
            }
        }
    }
}
