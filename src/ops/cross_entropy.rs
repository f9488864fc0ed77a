//! Softmax cross-entropy from logits as one differentiable op.
//!
//! Memory: the graph keeps the logits (the op's input, in their own dtype) and the per-row f32
//! loss; nothing else. Backward rebuilds each row's log-sum-exp as `loss + logit[target]` and
//! writes `(softmax − onehot) · upstream` straight into a logits-dtype buffer, so no f32 copy,
//! probability or log-probability tensor ever exists. The composite reference keeps an f32
//! copy (for bf16/f16 logits), the shifted logits, their exponentials and the log-probabilities.
//!
//! Padding: a row may hold more columns than classes ([`cross_entropy_rows_padded`]). The
//! explicit engine pads the vocabulary head to a multiple of 64 rows, because cuBLAS picks
//! aligned tensor-core kernels only when every matrix dimension is; GPT-2's 50257 classes
//! otherwise run the three head products on a far slower kernel. Padding columns take no part
//! in the loss and get a zero gradient, so the padded head's results are the unpadded ones.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::{check_input, contiguous, input_f32, output, rows_cols};

const NAME: &str = "fused-cross-entropy";

/// Mean softmax cross-entropy of `logits` (`rows × classes`; f32, bf16 or f16; any layout)
/// against `targets` (`rows` u32 class indices), as an f32 scalar. Accumulates in f32.
///
/// Memory saved for backward: the logits and one f32 per row (see the module doc).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_rows(logits, targets)?.mean_all()
}

/// Per-row softmax cross-entropy (`rows`, f32): `logsumexp(logits[r]) − logits[r][targets[r]]`.
///
/// Differentiable with respect to `logits` (the gradient has the logits' dtype); `targets` get
/// none. An out-of-range target is an error on the CPU and a NaN loss on the GPU, where a
/// kernel cannot report errors. Memory saved for backward: the logits and the returned losses.
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_rows_padded(logits, targets, logits.dims2()?.1)
}

/// [`cross_entropy_rows`] over the first `classes` columns of each row; the others are padding
/// that takes no part in the loss (and gets a zero gradient).
pub fn cross_entropy_rows_padded(
    logits: &Tensor,
    targets: &Tensor,
    classes: usize,
) -> Result<Tensor> {
    check_input(logits, NAME)?;
    let (rows, cols) = logits.dims2()?;
    check_classes(classes, cols)?;
    let targets = check_targets(targets, rows)?;
    logits
        .contiguous()?
        .apply_op2(&targets, CrossEntropy { classes })
}

/// `targets` as a contiguous vector of `rows` u32 class indices, or an error.
fn check_targets(targets: &Tensor, rows: usize) -> Result<Tensor> {
    let targets = targets.flatten_all()?;
    if targets.dtype() != DType::U32 || targets.elem_count() != rows {
        bail!(
            "{NAME}: targets must be {rows} u32 class indices, got {:?} {:?}",
            targets.dtype(),
            targets.shape()
        );
    }
    targets.contiguous()
}

fn check_classes(classes: usize, cols: usize) -> Result<()> {
    if classes == 0 || classes > cols {
        bail!("{NAME}: {classes} classes in rows of {cols} columns");
    }
    Ok(())
}

/// The gradient of the logits from per-row `losses` (as [`cross_entropy_rows_padded`] returns
/// them for the same `classes`) and the per-row upstream gradient `row_grad` (`rows`, f32),
/// outside any graph, in the logits' dtype; zero in padding columns.
pub fn cross_entropy_backward(
    logits: &Tensor,
    targets: &Tensor,
    classes: usize,
    losses: &Tensor,
    row_grad: &Tensor,
) -> Result<Tensor> {
    check_classes(classes, logits.dims2()?.1)?;
    let loss_grad = Tensor::cat(
        &[
            &losses.detach().to_dtype(DType::F32)?,
            &row_grad.detach().to_dtype(DType::F32)?,
        ],
        0,
    )?;
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.flatten_all()?.contiguous()?,
        &loss_grad,
        &CrossEntropyGrad {
            classes,
            lse: Lse::FromLoss,
        },
    )
}

/// Each row's log-sum-exp over its first `classes` columns, rebuilt (f32) from the per-row
/// `losses` [`cross_entropy_rows_padded`] returned for `logits`: `loss + logits[target]`, as
/// [`cross_entropy_backward`] does inside its kernel. What a later backward over some of the
/// columns alone needs ([`cross_entropy_backward_columns`]).
pub fn cross_entropy_lse(logits: &Tensor, targets: &Tensor, losses: &Tensor) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    let ids = targets.flatten_all()?.contiguous()?.reshape((rows, 1))?;
    let picked = logits.contiguous()?.gather(&ids, 1)?.reshape(rows)?;
    picked.to_dtype(DType::F32)? + losses.detach().to_dtype(DType::F32)?
}

/// [`cross_entropy_backward`] for columns `first..first + n` of the logits alone: `logits` holds
/// those `n` columns of each row (`rows × n`), `lse` each whole row's log-sum-exp
/// ([`cross_entropy_lse`]) and `row_grad` the per-row upstream gradient. The values are the
/// whole backward's in those columns (zero past `classes`), so a vocabulary head's gradient can
/// be computed one slice of classes at a time.
pub fn cross_entropy_backward_columns(
    logits: &Tensor,
    targets: &Tensor,
    first: usize,
    classes: usize,
    lse: &Tensor,
    row_grad: &Tensor,
) -> Result<Tensor> {
    check_input(logits, NAME)?;
    let rows = logits.dim(0)?;
    let targets = check_targets(targets, rows)?;
    if lse.elem_count() != rows || row_grad.elem_count() != rows {
        bail!("{NAME}: one log-sum-exp and one upstream gradient per row");
    }
    let lse_grad = Tensor::cat(
        &[
            &lse.detach().flatten_all()?.to_dtype(DType::F32)?,
            &row_grad.detach().flatten_all()?.to_dtype(DType::F32)?,
        ],
        0,
    )?;
    logits.contiguous()?.apply_op3_no_bwd(
        &targets,
        &lse_grad,
        &CrossEntropyGrad {
            classes,
            lse: Lse::Given { first },
        },
    )
}

/// Forward: `(logits, targets) → per-row loss` over the first `classes` columns.
struct CrossEntropy {
    classes: usize,
}

/// Backward: `(logits, targets, [loss or log-sum-exp; grad]) → grad_logits`. The third input
/// packs a per-row value and the per-row upstream gradients into one `2·rows` f32 tensor
/// because custom ops take at most three inputs.
struct CrossEntropyGrad {
    classes: usize,
    lse: Lse,
}

/// Where the backward gets each row's log-sum-exp, and which columns the logits hold.
#[derive(Debug, Clone, Copy)]
enum Lse {
    /// Whole rows; rebuilt from the per-row loss as `loss + logits[target]`.
    FromLoss,
    /// Given per row; the logits are columns `first..` of each row.
    Given { first: usize },
}

impl Lse {
    /// The column the logits' first one is.
    fn first(self) -> usize {
        match self {
            Lse::FromLoss => 0,
            Lse::Given { first } => first,
        }
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = rows_cols(l1);
        let targets = contiguous(u32::cpu_storage_as_slice(s2)?, l2, NAME)?;
        let loss = fwd_cpu(&input_f32(s1, l1, NAME)?, targets, self.classes, cols)?;
        Ok((CpuStorage::F32(loss), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, _) = rows_cols(l1);
        let loss = super::cuda::float_slice!(NAME, s1, v => gpu::fwd(v, l1, s2, l2, self.classes, &s1.device)?);
        Ok((loss, Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.detach().to_dtype(DType::F32)?;
        let loss_grad = Tensor::cat(&[&loss.detach(), &grad], 0)?;
        let dlogits = logits.apply_op3_no_bwd(
            targets,
            &loss_grad,
            &CrossEntropyGrad {
                classes: self.classes,
                lse: Lse::FromLoss,
            },
        )?;
        Ok((Some(dlogits), None))
    }
}

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l1);
        let targets = contiguous(u32::cpu_storage_as_slice(s2)?, l2, NAME)?;
        let loss_grad = contiguous(f32::cpu_storage_as_slice(s3)?, l3, NAME)?;
        let dx = bwd_cpu(
            &input_f32(s1, l1, NAME)?,
            targets,
            loss_grad,
            self.classes,
            self.lse,
            cols,
        );
        Ok((output(dx, s1.dtype())?, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::float_slice!(NAME, s1, v => gpu::bwd(v, l1, s2, l2, s3, l3, self.classes, self.lse, &s1.device)?);
        Ok((out, l1.shape().clone()))
    }
}

fn fwd_cpu(logits: &[f32], targets: &[u32], classes: usize, cols: usize) -> Result<Vec<f32>> {
    let mut loss = Vec::with_capacity(targets.len());
    for (r, &target) in targets.iter().enumerate() {
        let row = &logits[r * cols..r * cols + classes];
        let t = target as usize;
        if t >= classes {
            bail!("{NAME}: target {t} out of range for {classes} classes");
        }
        let mut max = f32::NEG_INFINITY;
        for &v in row {
            max = max.max(v);
        }
        let mut sum = 0f64;
        for &v in row {
            sum += f64::from((v - max).exp());
        }
        // log(sum) − (x_t − max) rather than max + log(sum) − x_t: no cancellation between
        // large logits.
        loss.push((sum as f32).ln() - (row[t] - max));
    }
    Ok(loss)
}

fn bwd_cpu(
    logits: &[f32],
    targets: &[u32],
    loss_grad: &[f32],
    classes: usize,
    lse: Lse,
    cols: usize,
) -> Vec<f32> {
    let rows = targets.len();
    let first = lse.first();
    let mut dx = vec![0f32; logits.len()];
    for r in 0..rows {
        // Forward already rejected out-of-range targets on this device.
        let t = targets[r] as usize;
        let (row, out) = (
            &logits[r * cols..(r + 1) * cols],
            &mut dx[r * cols..(r + 1) * cols],
        );
        let lse = match lse {
            Lse::FromLoss => loss_grad[r] + row[t],
            Lse::Given { .. } => loss_grad[r],
        };
        let g = loss_grad[rows + r];
        // Columns past the classes (padding) keep their zeros.
        for j in 0..cols.min(classes.saturating_sub(first)) {
            let p = (row[j] - lse).exp();
            out[j] = if first + j == t { (p - 1.0) * g } else { p * g };
        }
    }
    dx
}

#[cfg(feature = "cuda")]
mod gpu;
