//! `Trainer`: one optimizer step that honours the knobs (micro-batch, accumulation, precision,
//! activation checkpointing, optimizer offload, the update's timing and state layout).
//!
//! Accumulation sums the gradients of `grad_accum` micro-batches, each loss scaled by
//! `1/grad_accum`, so 4 × 8 sequences give the gradient of one batch of 32 up to float rounding.
//! Mixed precision keeps f32 master weights and optimizer state; activations and matrix products
//! run in bf16 or f16, and f16 adds dynamic loss scaling. Checkpointed blocks are recomputed in
//! the backward pass ([`crate::model::recompute`]). How the gradients become new weights (after
//! the backward pass or during it, on the device, offloaded to the host, in a compact layout)
//! is the knobs' [`UpdateStrategy`], which the trainer picks once when it is built
//! (`train::update`).
//!
//! Data parallel: each rank of a [`Collective`] runs micro-batches `rank·grad_accum ..
//! (rank+1)·grad_accum` of the step (data and dropout are functions of the global micro index),
//! scales each loss by `1/(grad_accum·ranks)` exactly as one process accumulating all of them
//! would, and the per-rank sums are summed over ranks before the update. So N ranks of `a`
//! micro-batches compute the gradient of one process accumulating `N·a`; with `a = 1` it is
//! the same floating-point sum in the same order (bit-identical), otherwise it differs only in
//! how the sum is associated. The fp16 overflow decision reads the summed gradients, which
//! every rank holds identically, so all ranks skip or apply together. With optimizer sharding
//! ([`crate::knobs::DataParallel::shard_optimizer`]) each rank's Adam owns a contiguous share of
//! the parameters and, after its update, broadcasts that share to the others.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use crate::collective::Collective;
use crate::data::source::Data;
use crate::knobs::{Knobs, UpdateStrategy};
use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::model::layers::cross_entropy;
use crate::model::params::InitValues;
use crate::model::recompute::RecomputedBlocks;
use crate::model::{explicit, Ctx, Engine, HeadGradient, Transformer};
use crate::spec::model::ModelSpec;
use crate::spec::state::StateBytes;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::passes::Passes;
use crate::train::scaler::{LossScaler, ScaleDecision};
use crate::train::schedule::LrSchedule;
use crate::train::update::{self, StepEnv, Updater};
use crate::{Error, Result};

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepReport {
    /// Mean training loss over the step's micro-batches of all ranks (unscaled).
    pub loss: f64,
    /// Whether the update was skipped because f16 gradients overflowed.
    pub skipped: bool,
    /// Loss scale after the step (1 unless fp16).
    pub loss_scale: f64,
    /// Tokens the step consumed, over all ranks.
    pub tokens: usize,
    /// Of those, the tokens of examples rather than padding.
    #[serde(default)]
    pub real_tokens: usize,
    /// The learning rate the step ran at (its schedule's, see [`Trainer::set_schedule`]).
    #[serde(default)]
    pub lr: f64,
}

/// A model, its optimizer and the knobs it trains with.
pub struct Trainer {
    passes: Passes,
    /// How a step updates the weights, with the optimizer's state.
    update: Box<dyn Updater>,
    scaler: LossScaler,
    steps: u64,
    group: Collective,
    /// The most gradient bytes the last step held on the device at once.
    gradient_bytes: u64,
    /// The learning rate by step (the base rate throughout unless set).
    schedule: LrSchedule,
}

impl Trainer {
    /// Builds the model and optimizer on `device`; `seed` fixes initial weights, data and dropout.
    ///
    /// With `Offload::Optimizer` the f32 masters and moments are allocated in host memory and
    /// the model's parameters on `device` are working copies.
    pub fn new(spec: &ModelSpec, knobs: Knobs, device: &Device, seed: u64) -> Result<Self> {
        Self::in_group(spec, knobs, device, seed, Collective::Single)
    }

    /// [`Trainer::new`] as one rank of a data-parallel `group`, whose size must be the knobs'
    /// data-parallel degree. Every rank starts from the same seed, hence the same weights.
    pub fn in_group(
        spec: &ModelSpec,
        knobs: Knobs,
        device: &Device,
        seed: u64,
        group: Collective,
    ) -> Result<Self> {
        Self::build(spec, knobs, device, seed, group, InitValues::Seeded)
    }

    /// [`Trainer::in_group`] for a trial, which measures memory and speed and trains nothing
    /// worth keeping: on a GPU the initial weights are drawn on the device
    /// ([`InitValues::OnDevice`]), from the same distributions but not from `seed`. Ranks of a
    /// data-parallel trial still start from the seed, so that they hold the same weights as
    /// training's ranks do.
    pub fn for_trial(
        spec: &ModelSpec,
        knobs: Knobs,
        device: &Device,
        seed: u64,
        group: Collective,
    ) -> Result<Self> {
        let values = if device.is_cuda() && group.world_size() == 1 {
            InitValues::OnDevice
        } else {
            InitValues::Seeded
        };
        Self::build(spec, knobs, device, seed, group, values)
    }

    fn build(
        spec: &ModelSpec,
        knobs: Knobs,
        device: &Device,
        seed: u64,
        group: Collective,
        values: InitValues,
    ) -> Result<Self> {
        knobs.validate("knobs", "")?;
        let strategy = UpdateStrategy::of(&knobs, spec.optimizer.grad_clip.is_some())
            .map_err(|c| crate::Error::invalid("knobs", c.field, c.problem))?;
        if knobs.data_parallel.degree != group.world_size() {
            return Err(crate::Error::invalid(
                "knobs",
                "data_parallel.degree",
                format!(
                    "is {} but this process is one of {} ranks; data parallelism runs through `autotune train --data-parallel N`",
                    knobs.data_parallel.degree,
                    group.world_size()
                ),
            ));
        }
        let compute = crate::backend::compute_dtype(knobs.precision);
        let started = std::time::Instant::now();
        let masters = update::masters(strategy, compute);
        let mut model = Transformer::build(spec, device, seed, masters, values)?;
        let built_s = started.elapsed().as_secs_f64();
        let update = update::build(strategy, &mut model, spec.optimizer, &group, seed)?;
        tracing::debug!(
            built_s,
            optimizer_s = started.elapsed().as_secs_f64() - built_s,
            ?strategy,
            "trainer set up"
        );
        let scaler = if knobs.precision.needs_loss_scaling() {
            LossScaler::default()
        } else {
            LossScaler::identity()
        };
        Ok(Self {
            passes: Passes {
                plan: RecomputedBlocks::new(knobs.checkpointing, spec.n_layers),
                model,
                knobs,
                device: device.clone(),
                seed,
                engine: Engine::default(),
                head: update.head_gradient(),
                micro_offset: (group.rank() * knobs.grad_accum) as u64,
                ranks: group.world_size(),
            },
            update,
            scaler,
            steps: 0,
            group,
            gradient_bytes: 0,
            schedule: LrSchedule::CONSTANT,
        })
    }

    /// The data-parallel group this trainer is a rank of ([`Collective::Single`] alone).
    pub fn group(&self) -> &Collective {
        &self.group
    }
    /// Whether this is the rank that writes checkpoints and output (always, alone).
    pub fn is_root(&self) -> bool {
        self.group.is_root()
    }
    /// Whether any rank asks to stop; every rank gets the same answer, so all stop together.
    pub fn any_rank(&mut self, flag: bool) -> Result<bool> {
        self.group.any(flag)
    }

    /// With a sharded optimizer, the moments of every parameter gathered from their owners
    /// (on the root rank, as host tensors named `m.<name>`, `v.<name>`; empty elsewhere). Every
    /// rank must call it together. `None` when this rank's optimizer holds all of them.
    pub fn gather_optimizer_state(&mut self) -> Result<Option<HashMap<String, Tensor>>> {
        self.update
            .gathered_moments(&mut self.group, &self.passes.model)
    }
    /// Sets the learning rate by step: each step runs at `schedule`'s rate for its index, of
    /// the model spec's `optimizer.lr`.
    pub fn set_schedule(&mut self, schedule: LrSchedule) {
        self.schedule = schedule;
    }
    /// The learning-rate schedule.
    pub fn schedule(&self) -> LrSchedule {
        self.schedule
    }
    /// Chooses the fused or the composite (reference) implementation of norms, softmax and loss.
    pub fn set_engine(&mut self, engine: Engine) {
        self.passes.engine = engine;
    }
    /// The engine in use.
    pub fn engine(&self) -> Engine {
        self.passes.engine
    }

    /// Chooses how the explicit engine computes the head's weight gradient (the trainer picks
    /// [`HeadGradient::ByRows`] for the exact update in backward, else
    /// [`HeadGradient::Whole`]). The compact optimizer and offload take whole gradients only.
    pub fn set_head_gradient(&mut self, head: HeadGradient) -> Result<()> {
        let exact_on_device = matches!(self.update.optimizer(), OptimizerState::Device(_));
        if head == HeadGradient::ByRows && !exact_on_device {
            return Err(crate::Error::internal(
                "the head's gradient by rows needs the exact optimizer on the device",
            ));
        }
        self.passes.head = head;
        Ok(())
    }
    /// How the head's weight gradient is computed.
    pub fn head_gradient(&self) -> HeadGradient {
        self.passes.head
    }
    /// The model being trained (with offload, its parameters are the device working copies).
    pub fn model(&self) -> &Transformer {
        &self.passes.model
    }
    /// The knobs in force.
    pub fn knobs(&self) -> Knobs {
        self.passes.knobs
    }
    /// The device the step runs on.
    pub fn device(&self) -> &Device {
        &self.passes.device
    }
    /// Optimizer steps taken (including skipped ones).
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// The run seed.
    pub fn seed(&self) -> u64 {
        self.passes.seed
    }
    /// The loss scaler (identity unless fp16).
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }
    /// Mutable access to the loss scaler, to restore it from a checkpoint or force a scale.
    pub fn scaler_mut(&mut self) -> &mut LossScaler {
        &mut self.scaler
    }

    /// Bytes a step copies over the host link, `None` when the optimizer stays on the device:
    /// with offload each micro-batch's gradients come down in their working dtype and the new
    /// working copies go up once; host-placed compact moments as their layout says.
    pub fn host_link_bytes_per_step(&self) -> Option<u64> {
        self.update
            .optimizer()
            .host_link_bytes_per_step(self.weight_bytes(), self.passes.knobs.grad_accum as u64)
    }

    /// The optimizer's state.
    pub fn optimizer(&self) -> OptimizerState<'_> {
        self.update.optimizer()
    }

    /// Mutable access to the optimizer (checkpoint restore).
    pub fn optimizer_mut(&mut self) -> OptimizerStateMut<'_> {
        self.update.optimizer_mut()
    }
    /// Sets the step counter (checkpoint restore).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// The training state this trainer holds, measured from its tensors: the model's weights
    /// and the optimizer's moments, and the most gradient bytes the last step held at once on
    /// the device (nothing before a step). Compare with the layout's formula,
    /// [`StateBytes::of`].
    pub fn state_bytes(&self) -> StateBytes {
        self.update
            .optimizer()
            .state_bytes(self.weight_bytes(), self.gradient_bytes)
    }

    /// The bytes of the model's parameters on the device (with offload, the working copies).
    fn weight_bytes(&self) -> u64 {
        let vars = self.passes.model.params().vars();
        update::tensor_bytes(vars.iter().map(|v| v.as_tensor()))
    }

    /// The f32 master weights in parameter order: the model's parameters, or with offload
    /// host copies of the masters.
    pub fn master_weights(&self) -> Result<Vec<Tensor>> {
        match self.update.optimizer() {
            OptimizerState::Host(offload) => offload.master_tensors(),
            OptimizerState::Device(_) | OptimizerState::Compact(_) => Ok(self
                .model()
                .params()
                .vars()
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect()),
        }
    }

    /// Overwrites the master weights (and with offload the working copies) from `tensors`.
    pub fn load_master_weights(
        &mut self,
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        let params = self.passes.model.params();
        match self.update.optimizer_mut() {
            OptimizerStateMut::Host(offload) => offload.load_masters(params.names(), tensors),
            _ => params.load_from(tensors),
        }
    }

    /// [`Trainer::load_master_weights`] one parameter at a time, from what `get` returns for
    /// each name (in parameter order).
    pub fn load_master_weights_with(
        &mut self,
        get: &mut dyn FnMut(&str) -> std::result::Result<Tensor, String>,
    ) -> std::result::Result<(), String> {
        let params = self.passes.model.params();
        match self.update.optimizer_mut() {
            OptimizerStateMut::Host(offload) => offload.load_masters_with(params.names(), get),
            _ => params.load_with(get),
        }
    }

    /// Runs one optimizer step on the next `grad_accum` micro-batches of `data`.
    pub fn step(&mut self, data: &Data) -> Result<StepReport> {
        let started = std::time::Instant::now();
        let knobs = self.passes.knobs;
        let first = self.passes.micro_offset;
        let batches = data.step_batches(
            self.passes.seed,
            self.steps,
            first..first + knobs.grad_accum as u64,
            knobs.micro_batch,
            &self.passes.device,
        );
        let batches = self.agree_on_data(batches, data)?;
        let prepared = started.elapsed();
        let report = self.step_on(&batches)?;
        tracing::trace!(
            target: "autotune::timing",
            batches_ms = prepared.as_secs_f64() * 1e3,
            step_ms = (started.elapsed() - prepared).as_secs_f64() * 1e3,
            "step queued (the optimizer update may still run)"
        );
        Ok(report)
    }

    /// `batches`, read by this rank from `data`, unless the data changed under any rank: then
    /// every rank stops at this step with [`Error::DataChanged`], so that they save a
    /// checkpoint together (ranks read different examples, and would otherwise meet the change
    /// at different steps). Every rank must call it at every read of the data.
    pub fn agree_on_data<T>(&mut self, batches: Result<T>, data: &Data) -> Result<T> {
        if self.passes.ranks == 1 {
            return batches;
        }
        let changed_here = matches!(batches, Err(Error::DataChanged { .. }));
        if !self.group.any(changed_here)? || changed_here {
            return batches;
        }
        Err(Error::DataChanged {
            path: data.spec().to_string().into(),
            problem: "another rank read it cut short at this step".into(),
            checkpoint: None,
        })
    }

    /// Runs one optimizer step on explicit micro-batches (this rank's share of the step).
    pub fn step_on(&mut self, batches: &[Batch]) -> Result<StepReport> {
        let lr = self
            .schedule
            .lr(self.passes.model.spec().optimizer.lr, self.steps);
        self.update
            .optimizer_mut()
            .progress_mut()
            .set_learning_rate(lr);
        let mut env = StepEnv {
            passes: &self.passes,
            index: self.steps,
            scaler: &mut self.scaler,
            group: &mut self.group,
        };
        let stepped = self.update.step(&mut env, batches)?;
        self.gradient_bytes = stepped.gradient_bytes;
        // The global mean: every rank ran as many micro-batches, so the mean of the rank means.
        let mut losses = [stepped.loss];
        self.group.sum_scalars(&mut losses)?;
        let loss = losses[0] / self.passes.ranks as f64;
        self.steps += 1;
        let tokens = self.passes.ranks
            * batches
                .iter()
                .map(|b| b.targets.elem_count())
                .sum::<usize>();
        let real_tokens = self.passes.ranks * batches.iter().map(Batch::real_tokens).sum::<usize>();
        Ok(StepReport {
            loss,
            skipped: stepped.decision == ScaleDecision::Skip,
            loss_scale: self.scaler.scale,
            tokens,
            real_tokens,
            lr,
        })
    }

    /// Gradients of the mean loss over `batches` (one per parameter, f32, unscaled, on the
    /// training device) and that loss, honouring the checkpointing knob.
    ///
    /// Every parameter must receive a gradient: a missing one means an op in the graph has no
    /// backward pass, which would otherwise freeze that parameter silently.
    pub fn gradients(&self, batches: &[Batch]) -> Result<(Vec<Tensor>, f64)> {
        self.passes
            .device_gradients(self.steps, self.scaler.scale, batches)
    }

    /// Mean loss on `batch` without dropout or gradients.
    pub fn eval_loss(&self, batch: &Batch) -> Result<f64> {
        let numerics = self.passes.numerics()?;
        let dtype = numerics.0;
        if let Some(attention) = self.passes.engine.explicit_attention() {
            return explicit::eval_loss(&self.passes.model, batch, numerics, attention);
        }
        let ctx = Ctx {
            dropout: Dropout::disabled(),
            engine: self.passes.engine,
        };
        // Detached block by block: evaluation holds one block's activations at a time, so it
        // never needs more memory than a (checkpointed) training step.
        let logits = self
            .passes
            .model
            .forward_detached(&batch.inputs, dtype, &ctx)?;
        let loss = cross_entropy(
            &logits,
            &batch.targets,
            batch.mask.as_ref(),
            self.passes.engine,
        )?;
        Ok(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?)
    }
}
