//! The vocabulary head with its weight in slices of rows ([`HeadGradient::ByRows`]).
//!
//! [`super::head::Head`] casts the whole weight to the compute dtype and sums its gradient in
//! one f32 buffer of the weight's shape; a tied head's stays whole until the embeddings' part
//! arrives at the end of backward. On gpt-1.3b that is 0.62 GB beside the activations at the
//! step's peak, when everything else is updated as soon as it settles. Here no weight-sized
//! tensor exists:
//!
//! - the head's backward (right after the forward pass, at the peak) computes the loss and the
//!   hidden states' gradient, reading half-precision slices of [`slice_rows`] rows cast from
//!   the masters as each product runs; the weight's gradient waits ([`Deferred`]);
//! - after the rest of the backward pass, each slice's gradient is recomputed from the kept
//!   hidden states and each row's log-sum-exp (one more head product per step), takes the
//!   embeddings' part of its rows for a tied head, and is handed over and settled alone.
//!
//! [`HeadGradient::ByRows`]: crate::model::HeadGradient::ByRows

use candle_core::{DType, Tensor, Var};

use super::head::{add, cat_rows, chunk_rows, chunks};
use super::linear::{column_sum, pad_rows, Norm};
use super::Grads;
use crate::model::batch::Reduction;
use crate::model::Transformer;
use crate::ops;
use crate::Result;

/// Rows per slice of a head weight `width` wide in `dtype`: as many as fit
/// [`crate::spec::state::HEAD_SLICE_BYTES`] (the memory model's figure), a multiple of
/// `row_multiple` so the products keep aligned kernels.
pub(crate) fn slice_rows(width: usize, dtype: DType, row_multiple: usize) -> usize {
    crate::spec::state::head_slice_rows(width, dtype.size_in_bytes(), row_multiple)
}

/// One slice of the weight's rows: `rows` of classes, padded with zero rows to `padded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slice {
    first: usize,
    rows: usize,
    padded: usize,
}

/// The final norm and the vocabulary head, whose weight is read and differentiated by slices
/// of rows.
pub(crate) struct SlicedHead<'a> {
    norm: Option<Norm<'a>>,
    weight: &'a Var,
    /// The bias's `Var` and its f32 values, if the head has one.
    bias: Option<(&'a Var, Tensor)>,
    dtype: DType,
    classes: usize,
    width: usize,
    slices: Vec<Slice>,
    /// The logits' columns: the classes padded to the row multiple.
    columns: usize,
}

/// What the weight's gradient is recomputed from after the rest of the backward pass.
pub(crate) struct Deferred {
    /// The head's input (after the final norm), all rows.
    hidden: Tensor,
    targets: Tensor,
    /// Each row's log-sum-exp over the classes (f32).
    lse: Tensor,
    /// Each row's upstream gradient.
    row_grads: Tensor,
    /// The bias's gradient: handed over after the slices, since the slices' logits read the
    /// bias, which an update in backward would change once it settles.
    bias_grad: Option<Tensor>,
}

impl<'a> SlicedHead<'a> {
    /// The head of `model` in `dtype`, its rows padded to `row_multiple`, in slices of
    /// `slice` rows (rounded up to the multiple).
    pub(crate) fn new(
        model: &'a Transformer,
        dtype: DType,
        row_multiple: usize,
        slice: usize,
    ) -> Result<Self> {
        let layer = model.head_layer();
        let bias = match layer.bias() {
            Some(b) => Some((b, b.as_tensor().detach().to_dtype(DType::F32)?)),
            None => None,
        };
        let weight = layer.weight();
        let (classes, width) = weight.dims2()?;
        let m = row_multiple.max(1);
        let slice = slice.max(1).div_ceil(m) * m;
        let slices = (0..classes)
            .step_by(slice)
            .map(|first| {
                let rows = slice.min(classes - first);
                Slice {
                    first,
                    rows,
                    padded: rows.div_ceil(m) * m,
                }
            })
            .collect();
        Ok(Self {
            norm: model.final_norm().map(Norm::new),
            weight,
            bias,
            dtype,
            classes,
            width,
            slices,
            columns: classes.div_ceil(m) * m,
        })
    }

    /// Rows per chunk of the logits of `x`'s rows.
    pub(crate) fn chunk_rows(&self, x: &Tensor) -> usize {
        chunk_rows(self.columns, x.dtype())
    }

    /// Slice `s` of the weight in the compute dtype, zero rows up to its padded height.
    fn weight_slice(&self, s: Slice) -> Result<Tensor> {
        let rows = self
            .weight
            .as_tensor()
            .detach()
            .narrow(0, s.first, s.rows)?;
        let w = ops::to_half(&rows, self.dtype)?;
        pad_rows(&w, s.padded)
    }

    /// The logits of slice `s`'s classes (`rows × s.padded`) for the head's input rows `h`
    /// and the slice's half-precision weight `w`: the product, plus the bias if any.
    fn slice_logits(&self, h: &Tensor, w: &Tensor, s: Slice) -> Result<Tensor> {
        let y = h.matmul(&w.t()?)?;
        let Some((_, bias)) = &self.bias else {
            return Ok(y);
        };
        let b = pad_rows(&bias.narrow(0, s.first, s.rows)?, s.padded)?;
        Ok(ops::epilogue(&y, Some(&b), None, None, None)?)
    }

    /// The logits `(rows, columns)` of the head's input rows `h`, slice by slice.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let logits = Tensor::zeros((h.dim(0)?, self.columns), h.dtype(), h.device())?;
        for &s in &self.slices {
            let part = self.slice_logits(h, &self.weight_slice(s)?, s)?;
            logits.slice_set(&part, 1, s.first)?;
        }
        Ok(logits)
    }

    /// The mean loss (a scalar f64 tensor, not read) and the gradient of `x` of
    /// `loss_factor × loss`; hands over the final norm's gradients, and returns what the
    /// weight's gradient is computed from later ([`SlicedHead::weight_grad`]). Runs `chunk`
    /// rows at a time.
    pub(crate) fn loss_and_backward(
        &self,
        x: &Tensor,
        targets: &Tensor,
        reduction: Reduction,
        loss_factor: f64,
        chunk: usize,
        grads: &mut Grads,
    ) -> Result<(Tensor, Tensor, Deferred)> {
        let hidden = match &self.norm {
            Some(n) => n.forward(x)?,
            None => x.clone(),
        };
        let rows = hidden.dim(0)?;
        let row_grads = reduction.row_grads(0..rows, loss_factor, x.device())?;
        let mut total: Option<Tensor> = None;
        let mut lse = Vec::new();
        let mut dhidden = Vec::new();
        let mut db: Option<Tensor> = None;
        for range in chunks(rows, chunk) {
            let h = hidden.narrow(0, range.start, range.len())?;
            let t = targets.narrow(0, range.start, range.len())?;
            let logits = self.logits(&h)?;
            let losses = ops::cross_entropy_rows_padded(&logits, &t, self.classes)?;
            lse.push(ops::cross_entropy_lse(&logits, &t, &losses)?);
            let dlogits = ops::cross_entropy_backward(
                &logits,
                &t,
                self.classes,
                &losses,
                &row_grads.narrow(0, range.start, range.len())?,
            )?;
            drop(logits);
            if self.bias.is_some() {
                db = Some(add(db, column_sum(&dlogits)?)?);
            }
            let dh = Tensor::zeros((range.len(), self.width), DType::F32, x.device())?;
            for &s in &self.slices {
                ops::accumulate_product_nn(&dh, &dlogits, s.first, &self.weight_slice(s)?)?;
            }
            drop(dlogits);
            dhidden.push(dh.to_dtype(x.dtype())?);
            total = Some(add(total, reduction.sum(&losses, range)?)?);
        }
        let dhidden = cat_rows(dhidden)?;
        let dx = match &self.norm {
            Some(n) => n.backward(x, &dhidden, grads)?,
            None => dhidden,
        };
        let total = total.ok_or_else(|| crate::Error::internal("a batch without rows"))?;
        let deferred = Deferred {
            hidden,
            targets: targets.clone(),
            lse: cat_rows(lse)?,
            row_grads,
            bias_grad: db.map(|db| db.narrow(0, 0, self.classes)).transpose()?,
        };
        Ok(((total / reduction.divisor())?, dx, deferred))
    }

    /// Hands over the weight's gradient slice by slice, each settled alone
    /// ([`Grads::layer_settled`]), then the bias's; `embedded` is a tied head's embeddings part: the lookup's
    /// ids and the gradient of its output (dropout already applied).
    pub(crate) fn weight_grad(
        &self,
        deferred: Deferred,
        embedded: Option<(&Tensor, &Tensor)>,
        grads: &mut Grads,
    ) -> Result<()> {
        let Deferred {
            hidden,
            targets,
            lse,
            row_grads,
            bias_grad,
        } = deferred;
        let rows = hidden.dim(0)?;
        let device = hidden.device().clone();
        for &s in &self.slices {
            let w = self.weight_slice(s)?;
            let dw = Tensor::zeros((s.padded, self.width), DType::F32, &device)?;
            for range in chunks(rows, chunk_rows(s.padded, hidden.dtype())) {
                let h = hidden.narrow(0, range.start, range.len())?;
                let logits = self.slice_logits(&h, &w, s)?;
                let dlogits = ops::cross_entropy_backward_columns(
                    &logits,
                    &targets.narrow(0, range.start, range.len())?,
                    s.first,
                    self.classes,
                    &lse.narrow(0, range.start, range.len())?,
                    &row_grads.narrow(0, range.start, range.len())?,
                )?;
                drop(logits);
                ops::accumulate_product_tn(&dw, &dlogits, &h)?;
            }
            drop(w);
            let dw = dw.narrow(0, 0, s.rows)?;
            if let Some((ids, d_out)) = embedded {
                ops::embed_backward_rows_into(ids, d_out, &dw, s.first)?;
            }
            grads.put_rows(self.weight, s.first, dw)?;
            grads.layer_settled()?;
        }
        if let (Some((var, _)), Some(db)) = (&self.bias, bias_grad) {
            grads.put(var, db)?;
            grads.layer_settled()?;
        }
        Ok(())
    }
}

impl SlicedHead<'_> {
    /// Hands over an untied embedding `table`'s gradient by the head's slices of rows, each
    /// settled alone: the lookup's `ids` and output gradient `d_out` (dropout applied) are
    /// scattered into one slice at a time.
    pub(crate) fn table_grad(
        &self,
        table: &Var,
        ids: &Tensor,
        d_out: &Tensor,
        grads: &mut Grads,
    ) -> Result<()> {
        if table.dim(0)? != self.classes {
            return Err(crate::Error::internal(
                "an embedding table and a head of different vocabularies",
            ));
        }
        for &s in &self.slices {
            let dw = Tensor::zeros((s.rows, self.width), DType::F32, d_out.device())?;
            ops::embed_backward_rows_into(ids, d_out, &dw, s.first)?;
            grads.put_rows(table, s.first, dw)?;
            grads.layer_settled()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::model::explicit::head::tests::close;
    use crate::model::explicit::head::Head;
    use crate::model::gradients::GradientSink;
    use crate::spec::model::{Biases, ModelSpec};

    /// Collects whole gradients and rows of gradients (assembled), and counts settles.
    #[derive(Default)]
    struct Collect {
        whole: HashMap<usize, Vec<f32>>,
        rows: HashMap<usize, Vec<(usize, Vec<f32>)>>,
        layer_settles: usize,
    }

    impl GradientSink for Collect {
        fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
            self.whole
                .insert(index, grad.flatten_all()?.to_vec1::<f32>()?);
            Ok(())
        }

        fn gradient_rows(&mut self, index: usize, first: usize, grad: Tensor) -> Result<()> {
            let values = grad.flatten_all()?.to_vec1::<f32>()?;
            self.rows.entry(index).or_default().push((first, values));
            Ok(())
        }

        fn settled_layer(&mut self) -> Result<()> {
            self.layer_settles += 1;
            Ok(())
        }
    }

    impl Collect {
        /// Every gradient, the row parts put together in order.
        fn all(mut self) -> HashMap<usize, Vec<f32>> {
            for (i, mut parts) in std::mem::take(&mut self.rows) {
                parts.sort_by_key(|(first, _)| *first);
                self.whole
                    .insert(i, parts.into_iter().flat_map(|(_, v)| v).collect());
            }
            self.whole
        }
    }

    /// The reduction of `targets` that all count.
    fn every_row(targets: &Tensor) -> Reduction<'static> {
        Reduction::every(targets.elem_count())
    }

    struct Case {
        model: Transformer,
        x: Tensor,
        targets: Tensor,
        ids: Tensor,
        d_out: Tensor,
    }

    fn case(tied: bool, head_bias: bool) -> Case {
        let spec = ModelSpec {
            vocab_size: 37,
            tied_embeddings: tied,
            biases: Biases {
                head: head_bias,
                ..Biases::ALL
            },
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
        let ids = Tensor::new(&[5u32, 36, 0, 5, 17, 9, 36, 2], &device).unwrap();
        let d_out = Tensor::randn(0f32, 1.0, (8, spec.d_model), &device).unwrap();
        Case {
            model,
            x,
            targets,
            ids,
            d_out,
        }
    }

    /// The whole head's loss, input gradient and parameter gradients (a tied weight's with the
    /// embeddings' part added).
    fn whole(c: &Case) -> (f64, Vec<f32>, HashMap<usize, Vec<f32>>) {
        let mut sink = Collect::default();
        let (loss, dx, tied) = {
            let mut grads = Grads::new(&c.model, &mut sink);
            let head = Head::new(&c.model, DType::F32, 1).unwrap();
            let (loss, dx, tied) = head
                .loss_and_backward(&c.x, &c.targets, every_row(&c.targets), 1.0, 4, &mut grads)
                .unwrap();
            if let Some(t) = &tied {
                ops::embed_backward_into(&c.ids, &c.d_out, t).unwrap();
                grads.put(c.model.token_embedding(), t.clone()).unwrap();
            }
            (loss, dx, tied)
        };
        drop(tied);
        let grads = sink.all();
        (
            loss.to_scalar::<f64>().unwrap(),
            dx.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            grads,
        )
    }

    /// The same by slices of `slice` rows, padded to `multiple`, with `chunk` rows per chunk;
    /// and the number of layer settles.
    fn sliced(
        c: &Case,
        slice: usize,
        multiple: usize,
        chunk: usize,
    ) -> (f64, Vec<f32>, HashMap<usize, Vec<f32>>, usize) {
        let mut sink = Collect::default();
        let (loss, dx) = {
            let mut grads = Grads::new(&c.model, &mut sink);
            let head = SlicedHead::new(&c.model, DType::F32, multiple, slice).unwrap();
            let (loss, dx, deferred) = head
                .loss_and_backward(
                    &c.x,
                    &c.targets,
                    every_row(&c.targets),
                    1.0,
                    chunk,
                    &mut grads,
                )
                .unwrap();
            let embedded = c.model.is_tied().then_some((&c.ids, &c.d_out));
            head.weight_grad(deferred, embedded, &mut grads).unwrap();
            (loss, dx)
        };
        let settles = sink.layer_settles;
        (
            loss.to_scalar::<f64>().unwrap(),
            dx.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            sink.all(),
            settles,
        )
    }

    #[test]
    fn a_head_by_rows_computes_what_the_whole_head_does() {
        for (tied, bias) in [(true, false), (false, true), (true, true), (false, false)] {
            let c = case(tied, bias);
            let (loss, dx, want) = whole(&c);
            // 37 classes: one slice, slices of 8 (the last of 5), and of 5 padded to 8.
            for (slice, multiple, chunk) in [(64, 1, 64), (8, 1, 3), (5, 8, 4)] {
                let what = format!("tied {tied}, bias {bias}, slices of {slice} by {multiple}");
                let (l, d, got, settles) = sliced(&c, slice, multiple, chunk);
                assert!(
                    (l - loss).abs() <= 1e-6 * loss.abs(),
                    "{what}: {l} vs {loss}"
                );
                close(&format!("{what}: dx"), &d, &dx, 1e-5);
                assert_eq!(got.len(), want.len(), "{what}: gradients");
                for (i, w) in &want {
                    close(&format!("{what}: parameter {i}"), &got[i], w, 1e-5);
                }
                let rows = slice.div_ceil(multiple) * multiple;
                let want = 37usize.div_ceil(rows) + usize::from(bias);
                assert_eq!(settles, want, "{what}: one settle per slice, then the bias");
            }
        }
    }

    #[test]
    fn slices_cover_the_classes_in_aligned_heights() {
        // gpt-1.3b's head in bf16: 4096 rows of 2048 take 16 MiB.
        assert_eq!(slice_rows(2048, DType::BF16, 64), 4096);
        // A weight too wide for one multiple still gets one.
        assert_eq!(slice_rows(1 << 30, DType::F32, 64), 64);
        let c = case(true, false);
        let head = SlicedHead::new(&c.model, DType::F32, 8, 12).unwrap();
        // 12 rounds up to 16: 0..16, 16..32, 32..37 padded to 40.
        let got: Vec<_> = head
            .slices
            .iter()
            .map(|s| (s.first, s.rows, s.padded))
            .collect();
        assert_eq!(got, vec![(0, 16, 16), (16, 16, 16), (32, 5, 8)]);
        assert_eq!(head.columns, 40);
    }
}
