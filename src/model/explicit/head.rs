//! The final norm, the vocabulary head and the loss, in chunks of rows.
//!
//! The logits of a whole micro-batch are the largest tensors of a step: rows × vocabulary,
//! and their gradient as many again (gpt-1.3b at micro-batch 8: 8192 × 50304 bf16 values,
//! 0.8 GB each). The head therefore runs on chunks of [`chunk_rows`] rows at a time, forward,
//! loss and backward, and only one chunk's logits exist at once. The weight's gradient sums
//! the chunks' products in f32, each product written into the sum directly
//! ([`crate::ops::accumulate_product_tn`]); with one chunk the arithmetic is the unchunked
//! head's.

use std::ops::Range;

use candle_core::{DType, Tensor};

use super::linear::{Lin, Norm};
use super::Grads;
use crate::model::batch::Reduction;
use crate::model::Transformer;
use crate::ops;
use crate::Result;

/// The most bytes one chunk's logits may take.
const CHUNK_LOGIT_BYTES: usize = 256 << 20;

/// Rows per chunk for logits of `columns` values in `dtype`: as many as fit
/// [`CHUNK_LOGIT_BYTES`], a multiple of 64 (at least 64) so the products keep their aligned
/// kernels.
pub(crate) fn chunk_rows(columns: usize, dtype: DType) -> usize {
    let per_row = columns.max(1) * dtype.size_in_bytes();
    (CHUNK_LOGIT_BYTES / per_row / 64 * 64).max(64)
}

/// The multiple the vocabulary head's rows are padded to on `device`.
///
/// cuBLAS runs its aligned tensor-core kernels only when every matrix dimension is a multiple
/// of 8 half-precision elements; GPT-2's 50257 classes are not, and the head's three products
/// (the largest of the step) then ran on a far slower kernel, in PyTorch too. 64 as in
/// nanoGPT's 50304. The CPU gains nothing and computes no padding.
pub(crate) fn head_row_multiple(device: &candle_core::Device) -> usize {
    if device.is_cuda() {
        64
    } else {
        1
    }
}

/// The final norm (pre-norm models) and the vocabulary head, whose rows may be padded with
/// zeros (the logits then have padding columns after the classes).
pub(crate) struct Head<'a> {
    norm: Option<Norm<'a>>,
    lin: Lin<'a>,
    /// Whether the weight is the token embedding table's, whose gradient is only complete once
    /// the embeddings' part is added.
    tied: bool,
}

impl<'a> Head<'a> {
    pub(crate) fn new(model: &'a Transformer, dtype: DType, row_multiple: usize) -> Result<Self> {
        Ok(Self {
            norm: model.final_norm().map(Norm::new),
            lin: Lin::new(model.head_layer(), dtype)?.pad_outputs(row_multiple)?,
            tied: model.is_tied(),
        })
    }

    /// The vocabulary size: the logits' leading columns that are classes.
    pub(crate) fn classes(&self) -> usize {
        self.lin.outputs()
    }

    /// The rows per chunk for this head's logits in `x`'s dtype.
    pub(crate) fn chunk_rows(&self, x: &Tensor) -> Result<usize> {
        Ok(chunk_rows(self.lin.padded_outputs()?, x.dtype()))
    }

    /// The head's input after the final norm.
    fn hidden(&self, x: &Tensor) -> Result<Tensor> {
        match &self.norm {
            Some(n) => n.forward(x),
            None => Ok(x.clone()),
        }
    }

    /// The mean loss of `x`'s rows against `targets` (a scalar f64 tensor, not read), reduced
    /// as `reduction` says, without gradients.
    pub(crate) fn loss(
        &self,
        x: &Tensor,
        targets: &Tensor,
        reduction: Reduction,
        chunk: usize,
    ) -> Result<Tensor> {
        let hidden = self.hidden(x)?;
        let rows = hidden.dim(0)?;
        let mut total: Option<Tensor> = None;
        for range in chunks(rows, chunk) {
            let logits = self.lin.forward(
                &hidden.narrow(0, range.start, range.len())?,
                None,
                None,
                None,
            )?;
            let losses = ops::cross_entropy_rows_padded(
                &logits,
                &targets.narrow(0, range.start, range.len())?,
                self.classes(),
            )?;
            total = Some(add(total, reduction.sum(&losses, range)?)?);
        }
        let total = total.ok_or_else(|| crate::Error::internal("a batch without rows"))?;
        Ok((total / reduction.divisor())?)
    }

    /// The mean loss (a scalar f64 tensor, not read: reading it would stall the device until
    /// the forward pass is done) and the gradient of `x` of `loss_factor × loss`; hands over
    /// the head's and the final norm's parameter gradients, except a tied weight's, which is
    /// returned (f32) for the embeddings to add their part to. Runs `chunk` rows at a time.
    pub(crate) fn loss_and_backward(
        &self,
        x: &Tensor,
        targets: &Tensor,
        reduction: Reduction,
        loss_factor: f64,
        chunk: usize,
        grads: &mut Grads,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let hidden = self.hidden(x)?;
        let rows = hidden.dim(0)?;
        let mut total: Option<Tensor> = None;
        let dw = self.lin.zero_weight_grad()?;
        let mut db: Option<Tensor> = None;
        let mut dhidden = Vec::with_capacity(rows.div_ceil(chunk.max(1)));
        for range in chunks(rows, chunk) {
            let len = range.len();
            let h = hidden.narrow(0, range.start, len)?;
            let t = targets.narrow(0, range.start, len)?;
            let logits = self.lin.forward(&h, None, None, None)?;
            let losses = ops::cross_entropy_rows_padded(&logits, &t, self.classes())?;
            let sum = reduction.sum(&losses, range.clone())?;
            let dlogits = ops::cross_entropy_backward(
                &logits,
                &t,
                self.classes(),
                &losses,
                &reduction.row_grads(range.clone(), loss_factor, x.device())?,
            )?;
            drop(logits);
            self.lin.accumulate_weight_grad(&dw, &dlogits, &h)?;
            let db_part = self.lin.bias_grad(&dlogits)?;
            dhidden.push(self.lin.input_grad(&dlogits)?);
            // The logits' gradient is the largest tensor of the step: gone before the next.
            drop(dlogits);
            total = Some(add(total, sum)?);
            if let Some(part) = db_part {
                db = Some(add(db, part)?);
            }
        }
        let tied_grad = if self.tied {
            self.lin.put_bias_grad(db, grads)?;
            Some(dw.narrow(0, 0, self.classes())?)
        } else {
            self.lin.put_grads(dw, db, grads)?;
            None
        };
        let dhidden = cat_rows(dhidden)?;
        let dx = match &self.norm {
            Some(n) => n.backward(x, &dhidden, grads)?,
            None => dhidden,
        };
        let total = total.ok_or_else(|| crate::Error::internal("a batch without rows"))?;
        Ok(((total / reduction.divisor())?, dx, tied_grad))
    }
}

/// `acc + t`, or `t` for the first part.
pub(super) fn add(acc: Option<Tensor>, t: Tensor) -> Result<Tensor> {
    Ok(match acc {
        Some(acc) => (acc + t)?,
        None => t,
    })
}

/// `rows` in ranges of `chunk` (the last shorter).
pub(super) fn chunks(rows: usize, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    (0..rows)
        .step_by(chunk)
        .map(move |start| start..(start + chunk).min(rows))
}

/// Chunks' rows stacked back into one tensor (the one chunk itself when there is one).
pub(super) fn cat_rows(mut parts: Vec<Tensor>) -> Result<Tensor> {
    Ok(match parts.len() {
        1 => parts.remove(0),
        _ => Tensor::cat(&parts, 0)?,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::model::gradients::GradientSink;
    use crate::spec::model::ModelSpec;

    /// The reduction of `targets` that all count.
    fn every(targets: &Tensor) -> Reduction<'static> {
        Reduction::every(targets.elem_count())
    }

    /// Mean loss, input gradient and parameter gradients of the head, `chunk` rows at a time,
    /// its rows padded to `row_multiple`; and the padded logits' width.
    fn head_pass(
        model: &Transformer,
        x: &Tensor,
        targets: &Tensor,
        row_multiple: usize,
        chunk: usize,
    ) -> (f64, Vec<f32>, HashMap<usize, Vec<f32>>, usize) {
        let mut got = HashMap::new();
        let mut sink = |i: usize, g: Tensor| -> Result<()> {
            got.insert(i, g.flatten_all()?.to_vec1::<f32>()?);
            Ok(())
        };
        let sink: &mut dyn GradientSink = &mut sink;
        let mut grads = Grads::new(model, sink);
        let head = Head::new(model, DType::F32, row_multiple).unwrap();
        let columns = head.lin.padded_outputs().unwrap();
        let (loss, dx, _) = head
            .loss_and_backward(x, targets, every(targets), 1.0, chunk, &mut grads)
            .unwrap();
        drop(grads);
        let loss = loss.to_scalar::<f64>().unwrap();
        let eval = head
            .loss(x, targets, every(targets), chunk)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert_eq!(loss, eval, "the training and the evaluation loss agree");
        let dx = dx.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (loss, dx, got, columns)
    }

    /// Same values up to the products' summation order: within `rel` of the largest wanted
    /// magnitude.
    pub(in crate::model::explicit) fn close(what: &str, got: &[f32], want: &[f32], rel: f32) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= rel * scale, "{what}: {g} vs {w}");
        }
    }

    fn fixture() -> (Transformer, Tensor, Tensor) {
        let spec = ModelSpec {
            vocab_size: 37,
            ..ModelSpec::tiny()
        };
        let device = Device::Cpu;
        let model = Transformer::new(&spec, &device, 3).unwrap();
        let rows = 10;
        let x = Tensor::randn(0f32, 1.0, (rows, spec.d_model), &device).unwrap();
        let targets = Tensor::arange(0u32, rows as u32, &device)
            .unwrap()
            .affine(3.0, 1.0)
            .unwrap();
        (model, x, targets)
    }

    #[test]
    fn a_padded_head_computes_what_the_unpadded_one_does() {
        let (model, x, targets) = fixture();
        let (loss, dx, grads, columns) = head_pass(&model, &x, &targets, 1, 64);
        assert_eq!(columns, 37);
        let (padded_loss, padded_dx, padded_grads, padded_columns) =
            head_pass(&model, &x, &targets, 16, 64);
        assert_eq!(padded_columns, 48, "padded to a multiple of 16");
        assert!((padded_loss - loss).abs() <= 1e-6 * loss.abs());
        close("dx", &padded_dx, &dx, 1e-6);
        // The head's weight (and the final norm's parameters) got gradients of the same shape
        // and values: the padding rows were cut off.
        assert!(!grads.is_empty());
        assert_eq!(padded_grads.len(), grads.len());
        for (i, want) in &grads {
            close(&format!("parameter {i}"), &padded_grads[i], want, 1e-6);
        }
        let head_weight = model.head_layer().weight().elem_count();
        assert!(grads.values().any(|g| g.len() == head_weight));
    }

    #[test]
    fn a_head_in_chunks_computes_what_the_whole_head_does() {
        let (model, x, targets) = fixture();
        let (loss, dx, grads, _) = head_pass(&model, &x, &targets, 1, 64);
        // 10 rows in chunks of 3: three full chunks and one of a single row.
        for chunk in [1, 3, 7] {
            let (chunked_loss, chunked_dx, chunked_grads, _) =
                head_pass(&model, &x, &targets, 1, chunk);
            assert!(
                (chunked_loss - loss).abs() <= 1e-6 * loss.abs(),
                "chunk {chunk}: {chunked_loss} vs {loss}"
            );
            close(&format!("chunk {chunk}: dx"), &chunked_dx, &dx, 1e-6);
            assert_eq!(chunked_grads.len(), grads.len());
            for (i, want) in &grads {
                close(
                    &format!("chunk {chunk}: parameter {i}"),
                    &chunked_grads[i],
                    want,
                    1e-6,
                );
            }
        }
    }

    #[test]
    fn chunks_keep_one_chunks_logits_under_the_budget() {
        // gpt-1.3b's padded head in bf16: 50304 columns of 2 bytes.
        let rows = chunk_rows(50_304, DType::BF16);
        assert_eq!(rows % 64, 0);
        assert!(rows * 50_304 * 2 <= CHUNK_LOGIT_BYTES);
        assert!((rows + 64) * 50_304 * 2 > CHUNK_LOGIT_BYTES);
        // A vocabulary too wide for 64 rows still gets 64.
        assert_eq!(chunk_rows(1 << 30, DType::F32), 64);
    }
}
