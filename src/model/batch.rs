//! One micro-batch of token ids, as every engine takes it, and which of its targets the loss
//! counts.
//!
//! Fine-tuning data trains on some tokens only (an assistant's reply, a completion) and pads
//! examples to the longest of the micro-batch; the loss is the mean over the targets that count.
//! A masked target still holds a valid class (the engines' kernels read it), but its row weighs
//! nothing: its loss is left out of the sum and its gradient is zero. Without a mask every
//! target counts, exactly as before masks existed.
//!
//! Packed micro-batches hold several examples in each sequence, one after the other; their
//! position ids (each token's position within its own example) keep every example's attention
//! and rotary positions as if it ran alone.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use crate::Result;

/// One micro-batch: `inputs` `(batch, seq)` and `targets` `(batch·seq)`, both u32.
pub struct Batch {
    /// Input token ids.
    pub inputs: Tensor,
    /// Target token id for every input position, flattened.
    pub targets: Tensor,
    /// Which targets the loss counts; `None`: every one.
    pub mask: Option<LossMask>,
    /// Packed sequences: each input's position within its own example (u32, `batch·seq`), 0
    /// where an example begins. `None`: one example a sequence, positions by index.
    pub positions: Option<Tensor>,
    /// Inputs that are tokens of an example, not padding; `None`: every one.
    pub real_tokens: Option<usize>,
}

/// Which targets a batch's loss counts.
#[derive(Debug, Clone)]
pub struct LossMask {
    /// One f32 per target: 1 where the loss counts it, 0 where it does not.
    pub weights: Tensor,
    /// How many targets count (the weights' sum), known when the batch is made so that no
    /// step waits on the device to count them.
    pub counted: usize,
}

impl Batch {
    /// A batch whose every target counts.
    pub fn new(inputs: Tensor, targets: Tensor) -> Self {
        Self {
            inputs,
            targets,
            mask: None,
            positions: None,
            real_tokens: None,
        }
    }

    /// Sequences `start..start + len` of this batch (a mask's count is recounted, which reads
    /// its weights).
    pub fn narrow(&self, start: usize, len: usize) -> Result<Batch> {
        let seq = self.inputs.dim(1)?;
        let mask = match &self.mask {
            None => None,
            Some(mask) => {
                let weights = mask.weights.narrow(0, start * seq, len * seq)?;
                let counted = weights.sum_all()?.to_scalar::<f32>()? as usize;
                Some(LossMask { weights, counted })
            }
        };
        let positions = match &self.positions {
            Some(p) => Some(p.narrow(0, start * seq, len * seq)?),
            None => None,
        };
        Ok(Batch {
            inputs: self.inputs.narrow(0, start, len)?,
            targets: self.targets.narrow(0, start * seq, len * seq)?,
            mask,
            positions,
            // A part of a batch knows its real tokens only when it is the whole.
            real_tokens: self
                .real_tokens
                .filter(|_| start == 0 && len == self.sequences()),
        })
    }

    /// Inputs that are tokens of an example rather than padding.
    pub fn real_tokens(&self) -> usize {
        self.real_tokens
            .unwrap_or_else(|| self.targets.elem_count())
    }

    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.inputs.dims()[0]
    }

    /// How the loss of this batch's targets is reduced.
    pub fn reduction(&self) -> Reduction<'_> {
        Reduction {
            mask: self.mask.as_ref(),
            rows: self.targets.elem_count(),
        }
    }
}

/// How a batch's per-target losses become its loss, the mean over the targets that count, and
/// what gradient each target's row gets.
#[derive(Debug, Clone, Copy)]
pub struct Reduction<'a> {
    mask: Option<&'a LossMask>,
    rows: usize,
}

impl Reduction<'_> {
    /// The reduction of `rows` targets that all count.
    pub fn every(rows: usize) -> Reduction<'static> {
        Reduction { mask: None, rows }
    }

    /// What the sum of the counted losses is divided by (at least 1: a batch of which no target
    /// counts has a loss and a gradient of zero).
    pub fn divisor(&self) -> f64 {
        match self.mask {
            None => self.rows as f64,
            Some(mask) => mask.counted.max(1) as f64,
        }
    }

    /// The upstream gradient of rows `range` for `factor ×` the loss: `factor / divisor` where
    /// a row counts, zero where it does not.
    pub fn row_grads(&self, range: Range<usize>, factor: f64, device: &Device) -> Result<Tensor> {
        let each = (factor / self.divisor()) as f32;
        Ok(match self.mask {
            None => Tensor::full(each, range.len(), device)?,
            Some(mask) => (mask.weights.narrow(0, range.start, range.len())? * f64::from(each))?,
        })
    }

    /// The sum of rows `range`'s `losses` (f32, one per row) that count, as an f64 scalar.
    pub fn sum(&self, losses: &Tensor, range: Range<usize>) -> Result<Tensor> {
        let losses = match self.mask {
            None => losses.clone(),
            Some(mask) => (losses * mask.weights.narrow(0, range.start, range.len())?)?,
        };
        Ok(losses.to_dtype(DType::F64)?.sum_all()?)
    }
}
