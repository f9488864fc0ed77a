//! `Trainer`: one optimizer step that honours the knobs (micro-batch, accumulation, precision,
//! activation checkpointing, optimizer offload).
//!
//! Accumulation sums the gradients of `grad_accum` micro-batches, each loss scaled by
//! `1/grad_accum`, so 4 × 8 sequences give the gradient of one batch of 32 up to float rounding.
//! Mixed precision keeps f32 master weights and optimizer state; activations and matrix products
//! run in bf16 or f16, and f16 adds dynamic loss scaling. Checkpointed blocks are recomputed in
//! the backward pass ([`crate::model::recompute`]); with offload the gradient sums, masters and
//! moments live in host memory and the update runs there ([`crate::train::offload`]).
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

use crate::collective::{balanced_ranges, Collective};
use crate::knobs::{Knobs, Offload, Update};
use crate::model::autograd::forward_backward;
use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::model::gradients::GradientSink;
use crate::model::layers::{cast, cross_entropy};
use crate::model::params::InitValues;
use crate::model::recompute::RecomputedBlocks;
use crate::model::{explicit, Ctx, Engine, HeadGradient, Masters, Transformer};
use crate::spec::model::ModelSpec;
use crate::spec::state::{Components, StateBytes};
use crate::train::compact::CompactAdam;
use crate::train::data::Data;
use crate::train::offload::OffloadAdam;
use crate::train::optim::{Adam, Optimizer};
use crate::train::scaler::{LossScaler, ScaleDecision};
use crate::train::schedule::LrSchedule;
use crate::Result;

/// Gradient buckets summed over ranks hold at most this many f32 values (64 MiB), so the
/// transient copy costs a bounded amount of device memory whatever the model size.
const BUCKET_ELEMS: usize = 1 << 24;

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
    /// The learning rate the step ran at (its schedule's, see [`Trainer::set_schedule`]).
    #[serde(default)]
    pub lr: f64,
}

/// A model, its optimizer and the knobs it trains with.
pub struct Trainer {
    passes: Passes,
    optimizer: Optimizer,
    scaler: LossScaler,
    steps: u64,
    group: Collective,
    /// The most gradient bytes the last step held on the device at once.
    gradient_bytes: u64,
    /// The learning rate by step (the base rate throughout unless set).
    schedule: LrSchedule,
}

/// What forward and backward passes read; kept apart from the optimizer so that a step can
/// run passes while it updates the optimizer's state.
struct Passes {
    model: Transformer,
    plan: RecomputedBlocks,
    knobs: Knobs,
    device: Device,
    seed: u64,
    engine: Engine,
    /// How the explicit engine computes the head's weight gradient.
    head: HeadGradient,
    /// Global index of this rank's first micro-batch in every step.
    micro_offset: u64,
    /// Ranks whose gradients are summed: each loss is scaled by `1 / (micro-batches · ranks)`.
    ranks: usize,
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
        if knobs.update == Update::InBackward && spec.optimizer.grad_clip.is_some() {
            return Err(crate::Error::invalid(
                "knobs",
                "update",
                "in-backward cannot clip gradients to a global norm (that needs every gradient \
                 before the first update); use after-backward, or drop the model's \
                 optimizer.grad_clip",
            ));
        }
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
        let masters = match knobs.offload {
            Offload::None if knobs.state.masters.is_half() => Masters::Working { compute },
            Offload::None => Masters::Device,
            Offload::Optimizer => Masters::Host {
                compute: crate::backend::compute_dtype(knobs.precision),
            },
        };
        let started = std::time::Instant::now();
        let mut model = Transformer::build(spec, device, seed, masters, values)?;
        let built_s = started.elapsed().as_secs_f64();
        let vars = model.params().vars();
        let share = if knobs.data_parallel.shard_optimizer {
            share_ranges(vars, group.world_size())[group.rank()].clone()
        } else {
            0..vars.len()
        };
        let optimizer = match model.params_mut().take_host_masters() {
            None if !knobs.state.is_exact() => Optimizer::Compact(Box::new(CompactAdam::new(
                model.params().vars(),
                spec.optimizer,
                knobs.state,
                seed,
            )?)),
            None => Optimizer::OnDevice(Adam::for_share(
                model.params().vars(),
                share,
                spec.optimizer,
            )?),
            Some(master) => Optimizer::Offloaded(OffloadAdam::new(
                model.params().vars(),
                master,
                spec.optimizer,
            )?),
        };
        tracing::debug!(
            built_s,
            optimizer_s = started.elapsed().as_secs_f64() - built_s,
            "trainer set up"
        );
        // By rows where each slice is updated as soon as it settles: the exact update in
        // backward. Elsewhere the whole gradient is held anyway, and the extra product is waste.
        let head = match (&optimizer, knobs.update) {
            (Optimizer::OnDevice(_), Update::InBackward) => HeadGradient::ByRows,
            _ => HeadGradient::Whole,
        };
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
                head,
                micro_offset: (group.rank() * knobs.grad_accum) as u64,
                ranks: group.world_size(),
            },
            optimizer,
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
        let Optimizer::OnDevice(adam) = &self.optimizer else {
            return Ok(None);
        };
        if !self.passes.knobs.data_parallel.shard_optimizer {
            return Ok(None);
        }
        let params = self.passes.model.params();
        let owners = share_owners(params.vars(), self.group.world_size());
        let mut out = HashMap::new();
        for (i, (var, name)) in params.vars().iter().zip(params.names()).enumerate() {
            let zeros = var.as_tensor().zeros_like()?;
            let (m, v) = adam.moments(i).unwrap_or((&zeros, &zeros));
            for (prefix, moment) in [("m", m), ("v", v)] {
                let full = self.group.broadcast(moment, owners[i])?;
                if self.group.is_root() {
                    out.insert(format!("{prefix}.{name}"), full.to_device(&Device::Cpu)?);
                }
            }
        }
        Ok(Some(out))
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
        if head == HeadGradient::ByRows && !matches!(self.optimizer, Optimizer::OnDevice(_)) {
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

    /// Bytes an offloaded step copies over the host link, `None` without offload: each
    /// micro-batch's gradients come down in their working dtype and the new working copies go
    /// up once.
    pub fn host_link_bytes_per_step(&self) -> Option<u64> {
        if let Optimizer::Compact(compact) = &self.optimizer {
            return compact.link_bytes_per_step();
        }
        let Optimizer::Offloaded(_) = &self.optimizer else {
            return None;
        };
        let working: u64 = self
            .passes
            .model
            .params()
            .vars()
            .iter()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        Some(working * (self.passes.knobs.grad_accum as u64 + 1))
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// Mutable access to the optimizer (checkpoint restore).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
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
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        let weights = self
            .passes
            .model
            .params()
            .vars()
            .iter()
            .map(|v| bytes(v.as_tensor()))
            .sum();
        match &self.optimizer {
            Optimizer::OnDevice(adam) => StateBytes {
                device: Components {
                    weights,
                    moments: adam
                        .owned()
                        .filter_map(|i| adam.moments(i))
                        .map(|(m, v)| bytes(m) + bytes(v))
                        .sum(),
                    gradients: self.gradient_bytes,
                },
                host: Components::default(),
            },
            Optimizer::Offloaded(offload) => StateBytes {
                device: Components {
                    weights,
                    moments: 0,
                    gradients: 0,
                },
                host: offload.host_bytes(),
            },
            Optimizer::Compact(compact) => {
                let (device, host) = compact.bytes();
                StateBytes {
                    device: Components {
                        gradients: self.gradient_bytes,
                        ..device
                    },
                    host,
                }
            }
        }
    }

    /// The f32 master weights in parameter order: the model's parameters, or with offload
    /// host copies of the masters.
    pub fn master_weights(&self) -> Result<Vec<Tensor>> {
        match &self.optimizer {
            Optimizer::OnDevice(_) | Optimizer::Compact(_) => Ok(self
                .model()
                .params()
                .vars()
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect()),
            Optimizer::Offloaded(o) => o.master_tensors(),
        }
    }

    /// Overwrites the master weights (and with offload the working copies) from `tensors`.
    pub fn load_master_weights(
        &mut self,
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        match &mut self.optimizer {
            Optimizer::OnDevice(_) | Optimizer::Compact(_) => {
                self.passes.model.params().load_from(tensors)
            }
            Optimizer::Offloaded(o) => o.load_masters(self.passes.model.params().names(), tensors),
        }
    }

    /// [`Trainer::load_master_weights`] one parameter at a time, from what `get` returns for
    /// each name (in parameter order).
    pub fn load_master_weights_with(
        &mut self,
        get: &mut dyn FnMut(&str) -> std::result::Result<Tensor, String>,
    ) -> std::result::Result<(), String> {
        match &mut self.optimizer {
            Optimizer::OnDevice(_) | Optimizer::Compact(_) => {
                self.passes.model.params().load_with(get)
            }
            Optimizer::Offloaded(o) => o.load_masters_with(self.passes.model.params().names(), get),
        }
    }

    /// Runs one optimizer step on the next `grad_accum` micro-batches of `data`.
    pub fn step(&mut self, data: &Data) -> Result<StepReport> {
        let started = std::time::Instant::now();
        let knobs = self.passes.knobs;
        let batches = (0..knobs.grad_accum as u64)
            .map(|micro| {
                data.batch(
                    self.passes.seed,
                    self.steps,
                    self.passes.micro_offset + micro,
                    knobs.micro_batch,
                    &self.passes.device,
                )
            })
            .collect::<Result<Vec<_>>>()?;
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

    /// Runs one optimizer step on explicit micro-batches (this rank's share of the step).
    pub fn step_on(&mut self, batches: &[Batch]) -> Result<StepReport> {
        let lr = self
            .schedule
            .lr(self.passes.model.spec().optimizer.lr, self.steps);
        self.optimizer.set_learning_rate(lr);
        let check = self.passes.knobs.precision.needs_loss_scaling();
        let scale = self.scaler.scale;
        let shard = self.passes.knobs.data_parallel.shard_optimizer;
        let (loss, decision) = match &mut self.optimizer {
            Optimizer::OnDevice(adam) if self.passes.knobs.update == Update::InBackward => {
                // Validated at build: one micro-batch, no loss scale, no ranks, no clipping.
                let step = adam.begin_step();
                let mut sink = UpdateInBackward::new(|part: &[Pending]| {
                    let mut whole = Vec::with_capacity(part.len());
                    for p in part {
                        match p.first_row {
                            Some(first) => adam.update_rows(&step, p.index, first, &p.grad)?,
                            None => whole.push((p.index, p.grad.clone())),
                        }
                    }
                    adam.update(&step, &whole)
                });
                // Each layer's gradients are dropped as soon as it settles.
                sink.by_layer = true;
                let loss = self
                    .passes
                    .for_each_gradient(self.steps, scale, batches, &mut sink)?;
                self.gradient_bytes = sink.peak_bytes;
                (loss, ScaleDecision::Apply)
            }
            Optimizer::OnDevice(adam) => {
                let (grads, loss) = self.passes.device_gradients(self.steps, scale, batches)?;
                self.gradient_bytes = tensor_bytes(&grads);
                let mut grads = sum_over_ranks(&mut self.group, grads)?;
                let finite = !check || all_finite(&grads)?;
                let decision = self.scaler.update(finite);
                if decision == ScaleDecision::Apply {
                    if let Some(max) = self.passes.model.spec().optimizer.grad_clip {
                        clip_global_norm(&mut grads, max)?;
                    }
                    adam.step(&grads)?;
                    if shard {
                        drop(grads);
                        share_updated_weights(&mut self.group, &self.passes.model, adam.owned())?;
                    }
                }
                (loss, decision)
            }
            Optimizer::Compact(compact) if self.passes.knobs.update == Update::InBackward => {
                // Validated at build: one micro-batch, no loss scale, no ranks, no clipping.
                let consts = compact.begin_step();
                // Whole parts: host-placed moments move a part at a time.
                let mut sink = UpdateInBackward::new(|part: &[Pending]| {
                    let whole = part
                        .iter()
                        .map(|p| match p.first_row {
                            None => Ok((p.index, p.grad.clone())),
                            Some(_) => Err(crate::Error::internal(
                                "the compact optimizer takes whole gradients",
                            )),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    compact.update(&consts, &whole)
                });
                let loss = self
                    .passes
                    .for_each_gradient(self.steps, scale, batches, &mut sink)?;
                self.gradient_bytes = sink.peak_bytes;
                drop(sink);
                compact.finish_step()?;
                (loss, ScaleDecision::Apply)
            }
            Optimizer::Compact(compact) => {
                let (mut grads, loss) = self.passes.device_gradients(self.steps, scale, batches)?;
                self.gradient_bytes = tensor_bytes(&grads);
                let finite = !check || all_finite(&grads)?;
                let decision = self.scaler.update(finite);
                if decision == ScaleDecision::Apply {
                    if let Some(max) = self.passes.model.spec().optimizer.grad_clip {
                        clip_global_norm(&mut grads, max)?;
                    }
                    compact.step(&grads)?;
                }
                (loss, decision)
            }
            Optimizer::Offloaded(offload)
                if crate::train::offload::streams(self.passes.model.spec(), &self.passes.knobs) =>
            {
                let (passes, steps) = (&self.passes, self.steps);
                let loss = offload.streamed_step(&mut |sink| {
                    passes.for_each_gradient(steps, scale, batches, &mut Streamed(sink))
                })?;
                (loss, ScaleDecision::Apply)
            }
            Optimizer::Offloaded(offload) => {
                let loss = self.passes.for_each_gradient(
                    self.steps,
                    scale,
                    batches,
                    &mut |micro: usize, i: usize, g: Tensor| offload.accumulate(i, &g, micro == 0),
                )?;
                self.group
                    .all_reduce_sum_host(offload.gradient_sums_mut(), &self.passes.device)?;
                // Without loss scaling the scale is 1 and there is nothing to unscale or check.
                let finite = !check || offload.unscale_and_check(scale);
                let decision = self.scaler.update(finite);
                if decision == ScaleDecision::Apply {
                    if let Some(max) = self.passes.model.spec().optimizer.grad_clip {
                        offload.clip_global_norm(max);
                    }
                    offload.step()?;
                }
                (loss, decision)
            }
        };
        // The global mean: every rank ran as many micro-batches, so the mean of the rank means.
        let mut losses = [loss];
        self.group.sum_scalars(&mut losses)?;
        let loss = losses[0] / self.passes.ranks as f64;
        self.steps += 1;
        let tokens = self.passes.ranks
            * batches
                .iter()
                .map(|b| b.targets.elem_count())
                .sum::<usize>();
        Ok(StepReport {
            loss,
            skipped: decision == ScaleDecision::Skip,
            loss_scale: self.scaler.scale,
            tokens,
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
        let dtype = crate::backend::compute_dtype(self.passes.knobs.precision);
        if let Some(attention) = self.passes.engine.explicit_attention() {
            return explicit::eval_loss(&self.passes.model, batch, dtype, attention);
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
        let loss = cross_entropy(&logits, &batch.targets, self.passes.engine)?;
        Ok(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?)
    }
}

impl Passes {
    /// Forward and backward passes of every micro-batch of optimizer step `step`, each loss
    /// scaled by `scale / batches`; hands `(micro-batch, parameter index, gradient)` to `sink`
    /// and returns the mean unscaled loss.
    fn for_each_gradient(
        &self,
        step: u64,
        scale: f64,
        batches: &[Batch],
        sink: &mut dyn StepSink,
    ) -> Result<f64> {
        let dtype = crate::backend::compute_dtype(self.knobs.precision);
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
                    dtype,
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
    fn device_gradients(
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
trait StepSink {
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
struct Streamed<'a>(&'a mut dyn GradientSink);

impl StepSink for Streamed<'_> {
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

/// A gradient waiting for its part to settle: a parameter's whole gradient, or its rows from
/// `first_row` on.
struct Pending {
    index: usize,
    first_row: Option<usize>,
    grad: Tensor,
}

/// The update in backward: each settled part of the model is updated at once by `update` (in
/// the step begun before the pass), and its gradients dropped.
struct UpdateInBackward<F> {
    update: F,
    pending: Vec<Pending>,
    /// Whether a settled layer (not only a whole part) is updated at once.
    by_layer: bool,
    /// The most gradient bytes pending at once.
    peak_bytes: u64,
}

impl<F: FnMut(&[Pending]) -> Result<()>> UpdateInBackward<F> {
    fn new(update: F) -> Self {
        Self {
            update,
            pending: Vec::new(),
            by_layer: false,
            peak_bytes: 0,
        }
    }

    fn push(&mut self, pending: Pending) {
        self.pending.push(pending);
        let bytes = tensor_bytes(self.pending.iter().map(|p| &p.grad));
        self.peak_bytes = self.peak_bytes.max(bytes);
    }
}

impl<F: FnMut(&[Pending]) -> Result<()>> StepSink for UpdateInBackward<F> {
    fn gradient(&mut self, _micro: usize, index: usize, grad: Tensor) -> Result<()> {
        self.push(Pending {
            index,
            first_row: None,
            grad,
        });
        Ok(())
    }

    fn gradient_rows(
        &mut self,
        _micro: usize,
        index: usize,
        first: usize,
        grad: Tensor,
    ) -> Result<()> {
        self.push(Pending {
            index,
            first_row: Some(first),
            grad,
        });
        Ok(())
    }

    fn settled(&mut self) -> Result<()> {
        // Layers settle where nothing is pending (a block's last layer, then the block).
        if self.by_layer && self.pending.is_empty() {
            return Ok(());
        }
        (self.update)(&self.pending)?;
        self.pending.clear();
        Ok(())
    }

    fn settled_layer(&mut self) -> Result<()> {
        if self.by_layer {
            self.settled()?;
        }
        Ok(())
    }
}

/// The bytes of `tensors` together.
fn tensor_bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors
        .into_iter()
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum()
}

/// Scales `grads` so that their global L2 norm is at most `max`, as PyTorch's
/// `clip_grad_norm_` does (by `max / (norm + 1e-6)` when that is below 1); returns the norm
/// before clipping. One device reduction per tensor and one host read in all.
fn clip_global_norm(grads: &mut [Tensor], max: f64) -> Result<f64> {
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let norm = f64::from(Tensor::stack(&squares, 0)?.sum_all()?.to_scalar::<f32>()?).sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

/// Sums each rank's gradients over the group, in buckets of at most [`BUCKET_ELEMS`] values
/// (consecutive parameters concatenated into one flat tensor, so a bucket is one collective).
fn sum_over_ranks(group: &mut Collective, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
    if group.world_size() == 1 {
        return Ok(grads);
    }
    let mut out = Vec::with_capacity(grads.len());
    let mut start = 0;
    while start < grads.len() {
        let mut end = start + 1;
        let mut elems = grads[start].elem_count();
        while end < grads.len() && elems + grads[end].elem_count() <= BUCKET_ELEMS {
            elems += grads[end].elem_count();
            end += 1;
        }
        let flat: Vec<Tensor> = grads[start..end]
            .iter()
            .map(|g| g.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let summed = group.all_reduce_sum(Tensor::cat(&flat, 0)?)?;
        let mut at = 0;
        for g in &grads[start..end] {
            let n = g.elem_count();
            out.push(summed.narrow(0, at, n)?.reshape(g.dims())?);
            at += n;
        }
        start = end;
    }
    Ok(out)
}

/// After a sharded update: every parameter is broadcast from the rank that updated it, and the
/// others overwrite their copy with it.
fn share_updated_weights(
    group: &mut Collective,
    model: &Transformer,
    owned: std::ops::Range<usize>,
) -> Result<()> {
    let vars = model.params().vars();
    for (i, owner) in share_owners(vars, group.world_size())
        .into_iter()
        .enumerate()
    {
        let updated = group.broadcast(vars[i].as_tensor(), owner)?;
        if !owned.contains(&i) {
            vars[i].set(&updated)?;
        }
    }
    Ok(())
}

/// Each rank's contiguous share of the parameters, balanced by element count; every rank
/// computes the same split on its own.
fn share_ranges(vars: &[candle_core::Var], ranks: usize) -> Vec<std::ops::Range<usize>> {
    let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
    balanced_ranges(&sizes, ranks)
}

/// The rank owning each parameter under [`share_ranges`].
fn share_owners(vars: &[candle_core::Var], ranks: usize) -> Vec<usize> {
    let mut owners = vec![0; vars.len()];
    for (rank, range) in share_ranges(vars, ranks).into_iter().enumerate() {
        owners[range].iter_mut().for_each(|o| *o = rank);
    }
    owners
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
