//! Adam and AdamW over f32 master weights on the device, with state that checkpoints can save
//! and restore.
//!
//! candle-nn's `AdamW` keeps its moments private, so a resumed run could not continue
//! bit-identically; and Adam with L2 decay (the seed's `torch.optim.Adam`) is missing.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Tensor, Var};

use super::AdamProgress;
use crate::ops::host_optim::AdamConsts;
use crate::spec::model::OptimizerSpec;
use crate::Result;

/// Adam / AdamW with per-parameter first and second moments.
///
/// It may own only a contiguous share of the model's parameters (optimizer sharding across
/// data-parallel ranks): it then keeps moments for that share alone and updates only it, while
/// indices and names stay those of the whole model.
pub struct Adam {
    pub(super) progress: AdamProgress,
    vars: Vec<Var>,
    /// Index of `vars[0]` among the model's parameters.
    offset: usize,
    first: Vec<Tensor>,
    second: Vec<Tensor>,
}

impl Adam {
    /// Zero-initialised state for `vars` (all f32).
    pub fn new(vars: &[Var], spec: OptimizerSpec) -> Result<Self> {
        Self::for_share(vars, 0..vars.len(), spec)
    }

    /// Zero-initialised state for the parameters `owned` of `vars` only.
    pub fn for_share(vars: &[Var], owned: Range<usize>, spec: OptimizerSpec) -> Result<Self> {
        let vars = &vars[owned.clone()];
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        Ok(Self {
            progress: AdamProgress::new(spec),
            first: vars.iter().map(zeros).collect::<candle_core::Result<_>>()?,
            second: vars.iter().map(zeros).collect::<candle_core::Result<_>>()?,
            vars: vars.to_vec(),
            offset: owned.start,
        })
    }

    /// The parameters (model indices) this optimizer updates.
    pub fn owned(&self) -> Range<usize> {
        self.offset..self.offset + self.vars.len()
    }

    /// The first and second moments of model parameter `index`, if this optimizer owns it.
    pub fn moments(&self, index: usize) -> Option<(&Tensor, &Tensor)> {
        let i = index.checked_sub(self.offset)?;
        Some((self.first.get(i)?, self.second.get(i)?))
    }

    /// The bytes of the moments this optimizer keeps.
    pub fn moment_bytes(&self) -> u64 {
        self.first
            .iter()
            .chain(&self.second)
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    /// Applies one update with `grads[i]` for model parameter `i` (already unscaled and
    /// averaged; one per model parameter, of which this optimizer reads its own).
    pub fn step(&mut self, grads: &[Tensor]) -> Result<()> {
        let step = self.begin_step();
        let own: Vec<(usize, Tensor)> = grads[self.owned()]
            .iter()
            .enumerate()
            .map(|(i, g)| (self.offset + i, g.clone()))
            .collect();
        self.update(&step, &own)
    }

    /// Starts an optimizer step whose parameters are then updated in parts ([`Adam::update`]),
    /// each once: the update in backward. The arithmetic is [`Adam::step`]'s, element by
    /// element, so the weights come out bit-identical.
    pub fn begin_step(&mut self) -> AdamStep {
        AdamStep(self.progress.begin_step())
    }

    /// Updates the model parameters `grads` name (`(index, gradient)`, unscaled and averaged)
    /// in the step `step`; parameters this optimizer does not own are left alone.
    pub fn update(&self, step: &AdamStep, grads: &[(usize, Tensor)]) -> Result<()> {
        let owned = self.owned();
        let mut weights = Vec::with_capacity(grads.len());
        let mut first = Vec::with_capacity(grads.len());
        let mut second = Vec::with_capacity(grads.len());
        let mut gradients = Vec::with_capacity(grads.len());
        for (index, g) in grads.iter().filter(|(i, _)| owned.contains(i)) {
            let i = index - self.offset;
            weights.push(self.vars[i].as_tensor().clone());
            first.push(self.first[i].clone());
            second.push(self.second[i].clone());
            gradients.push(g.to_dtype(candle_core::DType::F32)?.contiguous()?);
        }
        crate::ops::adam_update_all(&weights, &first, &second, &gradients, &step.0)?;
        Ok(())
    }

    /// Updates rows `first..first + grad.dim(0)` of model parameter `index` (a matrix) with
    /// their gradient in the step `step`: the same arithmetic, element by element, as the
    /// whole parameter's update; nothing if this optimizer does not own it.
    pub fn update_rows(
        &self,
        step: &AdamStep,
        index: usize,
        first: usize,
        grad: &Tensor,
    ) -> Result<()> {
        if !self.owned().contains(&index) {
            return Ok(());
        }
        let i = index - self.offset;
        let rows = grad.dim(0)?;
        let part = |t: &Tensor| t.narrow(0, first, rows);
        crate::ops::adam_update_all(
            &[part(self.vars[i].as_tensor())?],
            &[part(&self.first[i])?],
            &[part(&self.second[i])?],
            &[grad.to_dtype(candle_core::DType::F32)?.contiguous()?],
            &step.0,
        )?;
        Ok(())
    }

    /// The moments as named tensors (`m.<name>`, `v.<name>`) for a checkpoint; `names` are the
    /// model's (a share's optimizer names its own parameters only).
    pub fn state_tensors(&self, names: &[String]) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, name) in names[self.owned()].iter().enumerate() {
            out.insert(format!("m.{name}"), self.first[i].clone());
            out.insert(format!("v.{name}"), self.second[i].clone());
        }
        out
    }
}

/// One optimizer step's constants (its step count's bias corrections), from
/// [`Adam::begin_step`].
pub struct AdamStep(AdamConsts);

impl Adam {
    /// Restores the moments from a checkpoint's tensors (`m.<name>`, `v.<name>`).
    pub(super) fn load_moments(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        let owned = self.owned();
        for (i, name) in names[owned].iter().enumerate() {
            for (prefix, slot) in [("m", &mut self.first[i]), ("v", &mut self.second[i])] {
                let key = format!("{prefix}.{name}");
                let t = tensors
                    .get(&key)
                    .ok_or_else(|| format!("optimizer state `{key}` is missing"))?;
                if t.dims() != slot.dims() {
                    return Err(format!(
                        "optimizer state `{key}` has shape {:?}, expected {:?}",
                        t.dims(),
                        slot.dims()
                    ));
                }
                *slot = t.to_device(slot.device()).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}
