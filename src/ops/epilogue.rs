//! Elementwise epilogues of a matrix product, the embedding lookup, and their backward passes,
//! for the explicit engine ([`crate::model::explicit`]), which runs them outside any graph.
//!
//! - [`epilogue`]: `residual + dropout(act(y + bias))`, each part optional, in one pass.
//! - [`epilogue_backward`]: `dropout(dout) ⊙ act'(y + bias)`, the gradient of `y`.
//! - [`embed`] / [`embed_backward`]: `dropout(table[ids] + positions)` and the scatter-add of
//!   its gradient into an f32 table ([`embed_backward_into`]: into one that already holds a
//!   tied head's part).
//!
//! Dropout masks are a pure function of a key and the element index ([`DropoutMask::keeps`]),
//! so the backward pass regenerates the forward's mask instead of keeping it, and CPU and GPU
//! draw the same masks. Everything computes in f32 whatever the tensors' dtype.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Tensor, WithDType,
};

use super::{contiguous, input_f32, output};
use crate::hash::{splitmix64, GOLDEN};
use crate::spec::model::Activation;

const NAME: &str = "epilogue";

/// Dropout with probability `p`, its mask drawn from `key`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    /// Probability of zeroing an element.
    pub p: f32,
    /// The mask's key: equal keys give equal masks.
    pub key: u64,
}

impl DropoutMask {
    /// Elements are dropped when the top 32 bits of their hash fall below this.
    pub(crate) fn threshold(&self) -> u32 {
        (f64::from(self.p.clamp(0.0, 1.0)) * 4_294_967_296.0).min(u32::MAX as f64) as u32
    }

    /// What kept elements are multiplied by, `1/(1 − p)`.
    pub(crate) fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// Whether element `i` survives (SplitMix64 of the key and the index; the CUDA kernels use
    /// the same function).
    pub fn keeps(&self, i: u64) -> bool {
        keep(self.key, i, self.threshold())
    }
}

fn keep(key: u64, i: u64, threshold: u32) -> bool {
    let z = splitmix64(key.wrapping_add((i + 1).wrapping_mul(GOLDEN)));
    (z >> 32) as u32 >= threshold
}

/// The activation an epilogue applies (`None`: identity); SwiGLU, which halves the columns,
/// is an op of its own ([`super::swiglu`]).
fn act_code(act: Option<Activation>) -> Result<i32> {
    match act {
        None => Ok(0),
        Some(Activation::Relu) => Ok(1),
        Some(Activation::Gelu) => Ok(2),
        Some(Activation::Swiglu) => bail!("{NAME}: SwiGLU runs as its own op, not in an epilogue"),
    }
}

const GELU_C: f32 = 0.797_884_6; // √(2/π)

fn activate(z: f32, act: i32) -> f32 {
    match act {
        1 => z.max(0.0),
        2 => 0.5 * z * (1.0 + (GELU_C * (z + 0.044715 * z * z * z)).tanh()),
        _ => z,
    }
}

fn activate_grad(z: f32, act: i32) -> f32 {
    match act {
        1 => {
            if z > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        2 => {
            let t = (GELU_C * (z + 0.044715 * z * z * z)).tanh();
            0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * z * z)
        }
        _ => 1.0,
    }
}

/// A dropout mask as the elementwise kernels take it (`threshold`, `scale`, `key` arguments):
/// a threshold of 0 drops nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelDropout {
    pub(crate) threshold: u32,
    pub(crate) scale: f32,
    pub(crate) key: u64,
}

impl KernelDropout {
    pub(crate) fn new(mask: Option<DropoutMask>) -> Self {
        let (threshold, scale, key) = match mask {
            Some(m) if m.threshold() > 0 => (m.threshold(), m.scale(), m.key),
            _ => (0, 1.0, 0),
        };
        Self {
            threshold,
            scale,
            key,
        }
    }

    /// `v`, the value of element `i`, after dropout: as it is, scaled by `1/(1 − p)`, or 0.
    pub(crate) fn apply(&self, i: usize, v: f32) -> f32 {
        if self.threshold == 0 {
            v
        } else if keep(self.key, i as u64, self.threshold) {
            v * self.scale
        } else {
            0.0
        }
    }
}

/// What an epilogue does besides reading `y`.
#[derive(Debug, Clone, Copy)]
struct EpilogueOps {
    has_bias: bool,
    has_residual: bool,
    act: i32,
    dropout: KernelDropout,
}

impl EpilogueOps {
    fn new(
        has_bias: bool,
        has_residual: bool,
        act: Option<Activation>,
        dropout: Option<DropoutMask>,
    ) -> Result<Self> {
        Ok(Self {
            has_bias,
            has_residual,
            act: act_code(act)?,
            dropout: KernelDropout::new(dropout),
        })
    }

    fn drop(&self, i: usize, v: f32) -> f32 {
        self.dropout.apply(i, v)
    }
}

/// `residual + dropout(act(y + bias))` over `y` (`rows × cols`, any float dtype, contiguous
/// or not), in `y`'s dtype. `bias` is an f32 (or castable) vector of `cols`; `residual` has
/// `y`'s shape and dtype. No graph is recorded.
pub fn epilogue(
    y: &Tensor,
    bias: Option<&Tensor>,
    act: Option<Activation>,
    dropout: Option<DropoutMask>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let y = y.contiguous()?;
    let ops = EpilogueOps::new(bias.is_some(), residual.is_some(), act, dropout)?;
    let bias = bias_or_dummy(NAME, &y, bias)?;
    let residual = match residual {
        Some(r) => {
            if r.dims() != y.dims() {
                bail!(
                    "{NAME}: residual {:?} does not match {:?}",
                    r.shape(),
                    y.shape()
                );
            }
            r.to_dtype(y.dtype())?.contiguous()?
        }
        None => y.clone(),
    };
    y.apply_op3_no_bwd(&bias, &residual, &Epilogue { ops })
}

/// Dropout alone: `dropout(x)` with `mask` (the identity when `p` is 0).
pub fn dropout(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    epilogue(x, None, None, Some(mask), None)
}

/// The gradient of [`epilogue`]'s `y` from the gradient of its output: `dropout(dout) ⊙
/// act'(y + bias)` (the residual's gradient is `dout` itself; the bias's is the column sum of
/// the returned tensor).
pub fn epilogue_backward(
    dout: &Tensor,
    y: &Tensor,
    bias: Option<&Tensor>,
    act: Option<Activation>,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let y = y.contiguous()?;
    let ops = EpilogueOps::new(bias.is_some(), false, act, dropout)?;
    let bias = bias_or_dummy(NAME, &y, bias)?;
    let dout = dout.to_dtype(y.dtype())?.contiguous()?;
    dout.apply_op3_no_bwd(&y, &bias, &EpilogueGrad { ops })
}

/// The f32 bias of op `op` over the columns of `y`, or a placeholder the kernels never read
/// (they see `has_bias = 0`).
pub(super) fn bias_or_dummy(op: &str, y: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let cols = y.dim(candle_core::D::Minus1)?;
    match bias {
        Some(b) => {
            if b.dims() != [cols] {
                bail!("{op}: bias must have shape [{cols}], got {:?}", b.shape());
            }
            b.to_dtype(DType::F32)?.contiguous()
        }
        // Never read: the kernels see has_bias = 0.
        None => Tensor::zeros(1, DType::F32, y.device()),
    }
}

/// `dropout(table[ids[r]] + positions[r % seq])` for `ids` (`rows` u32): `rows × d` in
/// `table`'s dtype. `positions` (`seq × d`) must have `table`'s dtype. No graph is recorded.
pub fn embed(
    ids: &Tensor,
    table: &Tensor,
    positions: Option<&Tensor>,
    seq: usize,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    let ids = ids.flatten_all()?.contiguous()?;
    if ids.dtype() != DType::U32 {
        bail!("embed: ids must be u32, got {:?}", ids.dtype());
    }
    let (_, d) = table.dims2()?;
    let table = table.contiguous()?;
    let ops = EpilogueOps::new(false, false, None, dropout)?;
    let has_positions = positions.is_some();
    let positions = match positions {
        Some(p) => {
            if p.dims2()?.1 != d || p.dim(0)? < seq || seq == 0 {
                bail!("embed: positions {:?} do not cover {seq} × {d}", p.shape());
            }
            p.narrow(0, 0, seq)?.to_dtype(table.dtype())?.contiguous()?
        }
        None => table.clone(),
    };
    ids.apply_op3_no_bwd(
        &table,
        &positions,
        &Embed {
            ops,
            seq,
            has_positions,
        },
    )
}

/// The gradient of an embedding table (`vocab × d`, f32) from the lookup's output gradient
/// `d_out` (`rows × d`) and its `ids`. Summed with float atomics on the GPU, so the order of
/// additions (and the last bits) may vary between runs.
pub fn embed_backward(ids: &Tensor, d_out: &Tensor, vocab: usize) -> Result<Tensor> {
    let d = d_out.dim(d_out.rank().saturating_sub(1))?;
    let table = Tensor::zeros((vocab, d), DType::F32, d_out.device())?;
    embed_backward_into(ids, d_out, &table)?;
    Ok(table)
}

/// [`embed_backward`] added in place into `table`, a contiguous f32 `vocab × d` tensor: a tied
/// head's gradient gets the embeddings' part without a second table-sized buffer.
pub fn embed_backward_into(ids: &Tensor, d_out: &Tensor, table: &Tensor) -> Result<()> {
    scatter_into(ids, d_out, table, EmbedGrad { first: None })
}

/// [`embed_backward_into`] for the table's rows `first..first + rows.dim(0)` alone: `rows`, a
/// contiguous f32 `rows × d` tensor, gets the part of the ids in that range, and the other ids
/// are skipped. A table's gradient then exists one slice at a time (the vocabulary head's
/// weight gradient by rows, `model::explicit::head`).
pub fn embed_backward_rows_into(
    ids: &Tensor,
    d_out: &Tensor,
    rows: &Tensor,
    first: usize,
) -> Result<()> {
    let first = u32::try_from(first)
        .map_err(|_| candle_core::Error::Msg(format!("embed: first row {first} is over u32")))?;
    scatter_into(ids, d_out, rows, EmbedGrad { first: Some(first) })
}

/// Runs `op` on `table` (a contiguous f32 matrix as wide as `d_out`'s rows) in place.
fn scatter_into(ids: &Tensor, d_out: &Tensor, table: &Tensor, op: EmbedGrad) -> Result<()> {
    if table.dtype() != DType::F32 || !table.is_contiguous() || table.rank() != 2 {
        bail!("embed: the gradient table must be a contiguous f32 matrix");
    }
    if table.dim(1)? != d_out.dim(d_out.rank().saturating_sub(1))? {
        bail!(
            "embed: a gradient of {:?} does not fit a table of {:?}",
            d_out.shape(),
            table.shape()
        );
    }
    let ids = ids.flatten_all()?.contiguous()?;
    table.inplace_op3(&ids, &d_out.contiguous()?, &op)
}

struct Epilogue {
    ops: EpilogueOps,
}

struct EpilogueGrad {
    ops: EpilogueOps,
}

struct Embed {
    ops: EpilogueOps,
    seq: usize,
    /// Whether the third input holds position embeddings (else it is a placeholder).
    has_positions: bool,
}

/// Scatter-adds rows of an output gradient into an f32 table, in place: the whole table
/// (`first` None: an id past it is an error on the CPU), or its rows from `first` on (ids
/// outside them are skipped).
struct EmbedGrad {
    first: Option<u32>,
}

fn cols_of(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1).max(1)
}

impl CustomOp3 for Epilogue {
    fn name(&self) -> &'static str {
        NAME
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
        let p = self.ops;
        let cols = cols_of(l1);
        let y = input_f32(s1, l1, NAME)?;
        let bias = input_f32(s2, l2, NAME)?;
        let residual = if p.has_residual {
            Some(input_f32(s3, l3, NAME)?)
        } else {
            None
        };
        let out = y
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let v = if p.has_bias { v + bias[i % cols] } else { v };
                let v = p.drop(i, activate(v, p.act));
                match &residual {
                    Some(r) => v + r[i],
                    None => v,
                }
            })
            .collect();
        Ok((output(out, s1.dtype())?, l1.shape().clone()))
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
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::epilogue(v, l1, (s2, l2), (s3, l3), &self.ops, &s1.device)?
        });
        Ok((out, l1.shape().clone()))
    }
}

impl CustomOp3 for EpilogueGrad {
    fn name(&self) -> &'static str {
        "epilogue-grad"
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
        let p = self.ops;
        let cols = cols_of(l1);
        let dout = input_f32(s1, l1, NAME)?;
        let y = input_f32(s2, l2, NAME)?;
        let bias = input_f32(s3, l3, NAME)?;
        let dy = dout
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                let g = p.drop(i, g);
                if p.act == 0 {
                    g
                } else {
                    let z = if p.has_bias {
                        y[i] + bias[i % cols]
                    } else {
                        y[i]
                    };
                    g * activate_grad(z, p.act)
                }
            })
            .collect();
        Ok((output(dy, s1.dtype())?, l1.shape().clone()))
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
        let out = super::cuda::float_slice!(NAME, s1, v => {
            gpu::epilogue_grad(v, l1, (s2, l2), (s3, l3), &self.ops, &s1.device)?
        });
        Ok((out, l1.shape().clone()))
    }
}

impl CustomOp3 for Embed {
    fn name(&self) -> &'static str {
        "embed"
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
        let p = self.ops;
        let ids = contiguous(u32::cpu_storage_as_slice(s1)?, l1, "embed")?;
        let (vocab, d) = l2.shape().dims2()?;
        let table = input_f32(s2, l2, "embed")?;
        let positions = input_f32(s3, l3, "embed")?;
        let mut out = Vec::with_capacity(ids.len() * d);
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= vocab {
                bail!("embed: token {id} out of range for a vocabulary of {vocab}");
            }
            for c in 0..d {
                let mut v = table[id * d + c];
                if self.has_positions {
                    v += positions[(r % self.seq) * d + c];
                }
                out.push(p.drop(r * d + c, v));
            }
        }
        let rows = ids.len();
        Ok((output(out, s2.dtype())?, Shape::from((rows, d))))
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
        let rows = l1.shape().elem_count();
        let d = l2.shape().dims2()?.1;
        let out = super::cuda::float_slice!("embed", s2, v => {
            gpu::embed(v, l2, (s1, l1), (s3, l3), self, &s1.device)?
        });
        Ok((out, Shape::from((rows, d))))
    }
}

impl InplaceOp3 for EmbedGrad {
    fn name(&self) -> &'static str {
        "embed-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let ids = contiguous(u32::cpu_storage_as_slice(s2)?, l2, "embed")?;
        let d = cols_of(l3);
        let d_out = input_f32(s3, l3, "embed")?;
        let Some((start, end)) = l1.contiguous_offsets() else {
            bail!("embed: the gradient table must be contiguous");
        };
        let CpuStorage::F32(table) = s1 else {
            bail!("embed: the gradient table must be f32");
        };
        let table = &mut table[start..end];
        let vocab = table.len() / d.max(1);
        for (r, &id) in ids.iter().enumerate() {
            // Below `first` the difference wraps past the rows, as on the GPU.
            let id = id.wrapping_sub(self.first.unwrap_or(0)) as usize;
            if id >= vocab {
                if self.first.is_some() {
                    continue;
                }
                bail!("embed: token {id} out of range for a vocabulary of {vocab}");
            }
            for c in 0..d {
                table[id * d + c] += d_out[r * d + c];
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        let dev = s3.device.clone();
        super::cuda::float_slice!("embed", s3, v => {
            gpu::embed_grad(v, l3, (s2, l2), (s1, l1), self.first.unwrap_or(0), &dev)?
        });
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod gpu;
