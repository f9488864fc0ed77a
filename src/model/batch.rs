//! One micro-batch of token ids, as every engine takes it.

use candle_core::Tensor;

use crate::Result;

/// One micro-batch: `inputs` `(batch, seq)` and `targets` `(batch·seq)`, both u32.
pub struct Batch {
    /// Input token ids.
    pub inputs: Tensor,
    /// Target token id for every input position, flattened.
    pub targets: Tensor,
}

impl Batch {
    /// Sequences `start..start + len` of this batch.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Batch> {
        let seq = self.inputs.dim(1)?;
        Ok(Batch {
            inputs: self.inputs.narrow(0, start, len)?,
            targets: self.targets.narrow(0, start * seq, len * seq)?,
        })
    }

    /// Number of sequences.
    pub fn sequences(&self) -> usize {
        self.inputs.dims()[0]
    }
}
