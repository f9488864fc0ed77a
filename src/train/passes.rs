//! The forward and backward passes of a step's micro-batches, and where their gradients go.
//!
//! [`Passes`] runs every micro-batch of a step (with its dropout key and its share of the loss
//! scale) and hands each gradient to a [`StepSink`]: summed per parameter ([`Passes::device_gradients`]),
//! sent to the host, or updated as its part of the model settles. The update strategies
//! ([`crate::train::update`]) choose the sink.

use candle_core::{DType, Device, Tensor};

use crate::knobs::Knobs;
use crate::model::autograd::forward_backward;
use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::model::explicit::Products;
use crate::model::gradients::GradientSink;
use crate::model::layers::cast;
use crate::model::recompute::RecomputedBlocks;
use crate::model::{explicit, Ctx, Engine, HeadGradient, Transformer};
use crate::Result;

/// What forward and backward passes read; kept apart from the optimizer so that a step can
/// run passes while it updates the optimizer's state.
pub(crate) struct Passes {
    pub(crate) model: Transformer,
    pub(crate) plan: RecomputedBlocks,
    pub(crate) knobs: Knobs,
    pub(crate) device: Device,
    pub(crate) seed: u64,
    pub(crate) engine: Engine,
    /// How the explicit engine computes the head's weight gradient.
    pub(crate) head: HeadGradient,
    /// Global index of this rank's first micro-batch in every step.
    pub(crate) micro_offset: u64,
    /// Ranks whose gradients are summed: each loss is scaled by `1 / (micro-batches · ranks)`.
    pub(crate) ranks: usize,
}

impl Passes {
    /// The compute dtype and how the blocks' products run, both from the precision; fp8
    /// products are refused outside the explicit engine, where the autograd engines would run
    /// them in bf16 and report fp8.
    pub(crate) fn numerics(&self) -> Result<(DType, Products)> {
        let products = Products::of(self.knobs.precision);
        if products != Products::Compute && self.engine.explicit_attention().is_none() {
            return Err(crate::Error::Usage(format!(
                "fp8 matrix products run in the explicit engine only, not the {:?} one; drop \
                 --engine or use --engine explicit",
                self.engine
            )));
        }
        Ok((
            crate::backend::compute_dtype(self.knobs.precision),
            products,
        ))
    }

    /// Forward and backward passes of every micro-batch of optimizer step `step`, each loss
    /// scaled by `scale / batches`; hands `(micro-batch, parameter index, gradient)` to `sink`
    /// and returns the mean unscaled loss.
    pub(crate) fn for_each_gradient(
        &self,
        step: u64,
        scale: f64,
        batches: &[Batch],
        sink: &mut dyn StepSink,
    ) -> Result<f64> {
        let (dtype, products) = self.numerics()?;
        let factor = scale / (batches.len() * self.ranks) as f64;
        let mut loss_total = 0.0;
        for (micro, batch) in batches.iter().enumerate() {
            let key = Dropout::key(self.seed, step, self.micro_offset + micro as u64);
            let p = self.model.spec().dropout;
            if let Some(attention) = self.engine.explicit_attention() {
                loss_total += explicit::forward_backward(
                    &self.model,
                    &self.plan,
                    batch,
                    (dtype, products),
                    attention,
                    self.head,
                    &Dropout::hashed(p, &self.device, key),
                    factor,
                    &mut MicroBatch { micro, sink },
                )?;
                continue;
            }
            let ctx = Ctx {
                dropout: Dropout::new(p, &self.device, key)?,
                engine: self.engine,
            };
            loss_total += forward_backward(
                &self.model,
                &self.plan,
                batch,
                dtype,
                &ctx,
                factor,
                &mut MicroBatch { micro, sink },
            )?;
        }
        Ok(loss_total / batches.len() as f64)
    }

    /// Per-parameter f32 sums of the micro-batch gradients on the device, unscaled.
    pub(crate) fn device_gradients(
        &self,
        step: u64,
        scale: f64,
        batches: &[Batch],
    ) -> Result<(Vec<Tensor>, f64)> {
        let mut sums = Summed {
            sums: vec![None; self.model.params().vars().len()],
            vars: self.model.params().vars(),
        };
        let loss = self.for_each_gradient(step, scale, batches, &mut sums)?;
        let grads = sums
            .sums
            .into_iter()
            .map(|g| {
                let g = g.expect("one gradient per parameter after at least one micro-batch");
                if scale == 1.0 {
                    Ok(g)
                } else {
                    Ok((g * (1.0 / scale))?)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((grads, loss))
    }
}

/// Per-parameter f32 sums of the micro-batches' gradients.
struct Summed<'a> {
    sums: Vec<Option<Tensor>>,
    vars: &'a [candle_core::Var],
}

impl StepSink for Summed<'_> {
    fn gradient(&mut self, _micro: usize, i: usize, g: Tensor) -> Result<()> {
        // Working copies in half precision (offload) have half-precision gradients.
        let g = cast(&g, DType::F32)?;
        self.sums[i] = Some(match self.sums[i].take() {
            Some(acc) => (acc + g)?,
            None => g,
        });
        Ok(())
    }

    /// Rows go into a sum of the parameter's shape: copied by the first micro-batch (the bits
    /// a whole gradient's sum would start from), added by the later ones.
    fn gradient_rows(&mut self, micro: usize, i: usize, first: usize, g: Tensor) -> Result<()> {
        let g = cast(&g, DType::F32)?.contiguous()?;
        let sum = match &self.sums[i] {
            Some(sum) => sum.clone(),
            None => {
                let var = &self.vars[i];
                let zeros = Tensor::zeros(var.shape(), DType::F32, var.device())?;
                self.sums[i] = Some(zeros.clone());
                zeros
            }
        };
        if micro == 0 {
            sum.slice_set(&g, 0, first)?;
        } else {
            crate::ops::accumulate_into(&sum.narrow(0, first, g.dim(0)?)?, &g)?;
        }
        Ok(())
    }
}

/// What a step does with the gradients of its micro-batches: `gradient(micro, index, grad)` for
/// every parameter of every micro-batch, and `settled` when a part of the model is done with
/// (see [`GradientSink`]).
pub(crate) trait StepSink {
    fn gradient(&mut self, micro: usize, index: usize, grad: Tensor) -> Result<()>;

    /// Rows of a gradient (see [`GradientSink::gradient_rows`]).
    fn gradient_rows(
        &mut self,
        micro: usize,
        index: usize,
        first: usize,
        grad: Tensor,
    ) -> Result<()> {
        let _ = (micro, first, grad);
        Err(crate::Error::internal(format!(
            "parameter {index}'s gradient came in rows to a step that takes whole gradients"
        )))
    }

    fn settled(&mut self) -> Result<()> {
        Ok(())
    }

    fn settled_layer(&mut self) -> Result<()> {
        Ok(())
    }
}

impl<F: FnMut(usize, usize, Tensor) -> Result<()>> StepSink for F {
    fn gradient(&mut self, micro: usize, index: usize, grad: Tensor) -> Result<()> {
        self(micro, index, grad)
    }
}

/// A gradient sink of one micro-batch's pass as a step's sink.
pub(crate) struct PassSink<'a>(pub(crate) &'a mut dyn GradientSink);

impl StepSink for PassSink<'_> {
    fn gradient(&mut self, _micro: usize, index: usize, grad: Tensor) -> Result<()> {
        self.0.gradient(index, grad)
    }

    fn settled(&mut self) -> Result<()> {
        self.0.settled()
    }
}

/// One micro-batch's pass feeding a step's sink.
struct MicroBatch<'a> {
    micro: usize,
    sink: &'a mut dyn StepSink,
}

impl GradientSink for MicroBatch<'_> {
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
        self.sink.gradient(self.micro, index, grad)
    }

    fn gradient_rows(&mut self, index: usize, first: usize, grad: Tensor) -> Result<()> {
        self.sink.gradient_rows(self.micro, index, first, grad)
    }

    fn settled(&mut self) -> Result<()> {
        self.sink.settled()
    }

    fn settled_layer(&mut self) -> Result<()> {
        self.sink.settled_layer()
    }
}
