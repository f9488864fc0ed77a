//! Exact AdamW on the device after the backward pass: every micro-batch's gradients summed per
//! parameter, summed over the data-parallel ranks, then checked, clipped and applied at once.
//!
//! With the moments sharded ([`crate::knobs::DataParallel::shard_optimizer`]) each rank's Adam
//! owns a contiguous share of the parameters and, after its update, broadcasts that share to
//! the others.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Device, Tensor, Var};

use super::gradients::{finish_whole_step, tensor_bytes};
use super::{StepEnv, Stepped, Updater};
use crate::collective::{balanced_ranges, Collective};
use crate::model::batch::Batch;
use crate::model::Transformer;
use crate::spec::model::OptimizerSpec;
use crate::train::optimizer::adam::Adam;
use crate::train::optimizer::{OptimizerState, OptimizerStateMut};
use crate::train::scaler::ScaleDecision;
use crate::Result;

/// Gradient buckets summed over ranks hold at most this many f32 values (64 MiB), so the
/// transient copy costs a bounded amount of device memory whatever the model size.
const BUCKET_ELEMS: usize = 1 << 24;

/// The update after the backward pass, on the device.
pub(super) struct AfterBackward {
    adam: Adam,
    shard_optimizer: bool,
}

impl AfterBackward {
    /// Zero moments for `model`'s parameters, or with `shard_optimizer` for this rank's share.
    pub(super) fn new(
        model: &Transformer,
        spec: OptimizerSpec,
        shard_optimizer: bool,
        group: &Collective,
    ) -> Result<Self> {
        let vars = model.params().vars();
        let share = if shard_optimizer {
            share_ranges(vars, group.world_size())[group.rank()].clone()
        } else {
            0..vars.len()
        };
        Ok(Self {
            adam: Adam::for_share(vars, share, spec)?,
            shard_optimizer,
        })
    }
}

impl Updater for AfterBackward {
    fn step(&mut self, env: &mut StepEnv<'_>, batches: &[Batch]) -> Result<Stepped> {
        let (grads, loss) = env
            .passes
            .device_gradients(env.index, env.scaler.scale, batches)?;
        let gradient_bytes = tensor_bytes(&grads);
        let grads = sum_over_ranks(env.group, grads)?;
        let adam = &mut self.adam;
        let decision = finish_whole_step(env, grads, |grads| adam.step(grads))?;
        if decision == ScaleDecision::Apply && self.shard_optimizer {
            share_updated_weights(env.group, &env.passes.model, self.adam.owned())?;
        }
        Ok(Stepped {
            loss,
            decision,
            gradient_bytes,
        })
    }

    fn optimizer(&self) -> OptimizerState<'_> {
        OptimizerState::Device(&self.adam)
    }

    fn optimizer_mut(&mut self) -> OptimizerStateMut<'_> {
        OptimizerStateMut::Device(&mut self.adam)
    }

    fn gathered_moments(
        &self,
        group: &mut Collective,
        model: &Transformer,
    ) -> Result<Option<HashMap<String, Tensor>>> {
        if !self.shard_optimizer {
            return Ok(None);
        }
        let params = model.params();
        let owners = share_owners(params.vars(), group.world_size());
        let mut out = HashMap::new();
        for (i, (var, name)) in params.vars().iter().zip(params.names()).enumerate() {
            let zeros = var.as_tensor().zeros_like()?;
            let (m, v) = self.adam.moments(i).unwrap_or((&zeros, &zeros));
            for (prefix, moment) in [("m", m), ("v", v)] {
                let full = group.broadcast(moment, owners[i])?;
                if group.is_root() {
                    out.insert(format!("{prefix}.{name}"), full.to_device(&Device::Cpu)?);
                }
            }
        }
        Ok(Some(out))
    }
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
    owned: Range<usize>,
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
fn share_ranges(vars: &[Var], ranks: usize) -> Vec<Range<usize>> {
    let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
    balanced_ranges(&sizes, ranks)
}

/// The rank owning each parameter under [`share_ranges`].
fn share_owners(vars: &[Var], ranks: usize) -> Vec<usize> {
    let mut owners = vec![0; vars.len()];
    for (rank, range) in share_ranges(vars, ranks).into_iter().enumerate() {
        owners[range].iter_mut().for_each(|o| *o = rank);
    }
    owners
}
