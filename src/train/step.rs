//! `Trainer`: one optimizer step that honours the knobs (micro-batch, accumulation, precision).
//!
//! Accumulation sums the gradients of `grad_accum` micro-batches, each loss scaled by
//! `1/grad_accum`, so 4 × 8 sequences give the gradient of one batch of 32 up to float rounding.
//! Mixed precision keeps f32 master weights and optimizer state; activations and matrix products
//! run in bf16 or f16, and f16 adds dynamic loss scaling.

use candle_core::{DType, Device, Tensor};

use crate::knobs::Knobs;
use crate::model::dropout::Dropout;
use crate::model::layers::cross_entropy;
use crate::model::{Ctx, Engine, Transformer};
use crate::spec::model::ModelSpec;
use crate::train::data::{Batch, Data};
use crate::train::optim::Adam;
use crate::train::scaler::{LossScaler, ScaleDecision};
use crate::{Error, Result};

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Mean training loss over the step's micro-batches (unscaled).
    pub loss: f64,
    /// Whether the update was skipped because f16 gradients overflowed.
    pub skipped: bool,
    /// Loss scale after the step (1 unless fp16).
    pub loss_scale: f64,
    /// Tokens the step consumed.
    pub tokens: usize,
}

/// A model, its optimizer and the knobs it trains with.
pub struct Trainer {
    model: Transformer,
    optimizer: Adam,
    scaler: LossScaler,
    knobs: Knobs,
    device: Device,
    seed: u64,
    steps: u64,
    engine: Engine,
}

impl Trainer {
    /// Builds the model and optimizer on `device`; `seed` fixes initial weights, data and dropout.
    pub fn new(spec: &ModelSpec, knobs: Knobs, device: &Device, seed: u64) -> Result<Self> {
        knobs.validate("knobs", "")?;
        let model = Transformer::new(spec, device, seed)?;
        let optimizer = Adam::new(model.params().vars(), spec.optimizer)?;
        let scaler = if knobs.precision.needs_loss_scaling() {
            LossScaler::default()
        } else {
            LossScaler::identity()
        };
        Ok(Self {
            model,
            optimizer,
            scaler,
            knobs,
            device: device.clone(),
            seed,
            steps: 0,
            engine: Engine::default(),
        })
    }

    /// Chooses the fused or the composite (reference) implementation of norms, softmax and loss.
    pub fn set_engine(&mut self, engine: Engine) {
        self.engine = engine;
    }

    /// The engine in use.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// The model being trained.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The knobs in force.
    pub fn knobs(&self) -> Knobs {
        self.knobs
    }

    /// The device the step runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Optimizer steps taken (including skipped ones).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The run seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The loss scaler (identity unless fp16).
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// Mutable access to the loss scaler, to restore it from a checkpoint or force a scale.
    pub fn scaler_mut(&mut self) -> &mut LossScaler {
        &mut self.scaler
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Adam {
        &self.optimizer
    }

    /// Mutable access to the optimizer (checkpoint restore).
    pub fn optimizer_mut(&mut self) -> &mut Adam {
        &mut self.optimizer
    }

    /// Sets the step counter (checkpoint restore).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Runs one optimizer step on the next `grad_accum` micro-batches of `data`.
    pub fn step(&mut self, data: &Data) -> Result<StepReport> {
        let batches = (0..self.knobs.grad_accum as u64)
            .map(|micro| {
                data.batch(
                    self.seed,
                    self.steps,
                    micro,
                    self.knobs.micro_batch,
                    &self.device,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        self.step_on(&batches)
    }

    /// Runs one optimizer step on explicit micro-batches.
    pub fn step_on(&mut self, batches: &[Batch]) -> Result<StepReport> {
        let (grads, loss) = self.gradients(batches)?;
        let finite = if self.knobs.precision.needs_loss_scaling() {
            all_finite(&grads)?
        } else {
            true
        };
        let decision = self.scaler.update(finite);
        if decision == ScaleDecision::Apply {
            self.optimizer.step(&grads)?;
        }
        self.steps += 1;
        let tokens = batches.iter().map(|b| b.targets.elem_count()).sum();
        Ok(StepReport {
            loss,
            skipped: decision == ScaleDecision::Skip,
            loss_scale: self.scaler.scale,
            tokens,
        })
    }

    /// Gradients of the mean loss over `batches` (one per parameter, f32, unscaled) and that loss.
    ///
    /// Every parameter must receive a gradient: a missing one means an op in the graph has no
    /// backward pass, which would otherwise freeze that parameter silently.
    pub fn gradients(&self, batches: &[Batch]) -> Result<(Vec<Tensor>, f64)> {
        let dtype = self.knobs.precision.compute_dtype();
        let vars = self.model.params().vars();
        let scale = self.scaler.scale;
        let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut loss_total = 0.0;
        for (micro, batch) in batches.iter().enumerate() {
            let key = Dropout::key(self.seed, self.steps, micro as u64);
            let ctx = Ctx {
                dropout: Dropout::new(self.model.spec().dropout, &self.device, key)?,
                engine: self.engine,
            };
            let logits = self.model.forward(&batch.inputs, dtype, &ctx)?;
            let loss = cross_entropy(&logits, &batch.targets, self.engine)?;
            loss_total += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let mut grads = (loss * (scale / batches.len() as f64))?.backward()?;
            for (i, var) in vars.iter().enumerate() {
                let g = grads
                    .remove(var)
                    .ok_or_else(|| missing_gradient(&self.model.params().names()[i]))?;
                sums[i] = Some(match sums[i].take() {
                    Some(acc) => (acc + g)?,
                    None => g,
                });
            }
        }
        let grads = sums
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
        Ok((grads, loss_total / batches.len() as f64))
    }

    /// Mean loss on `batch` without dropout or gradients.
    pub fn eval_loss(&self, batch: &Batch) -> Result<f64> {
        let dtype = self.knobs.precision.compute_dtype();
        let ctx = Ctx {
            dropout: Dropout::disabled(),
            engine: self.engine,
        };
        let logits = self.model.forward(&batch.inputs.detach(), dtype, &ctx)?;
        let loss = cross_entropy(&logits.detach(), &batch.targets, self.engine)?;
        Ok(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?)
    }
}

/// One device reduction and one host read for all gradients: inf or NaN anywhere makes the sum
/// non-finite.
fn all_finite(grads: &[Tensor]) -> Result<bool> {
    let sums = grads
        .iter()
        .map(|g| g.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>()?;
    Ok(total.is_finite())
}

fn missing_gradient(name: &str) -> Error {
    Error::MissingGradient {
        parameter: name.to_string(),
    }
}
