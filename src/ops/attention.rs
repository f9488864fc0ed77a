//! Flash attention over the rows of a q/k/v product: `softmax(q kᵀ/√hd) v` per head, with an
//! optional causal mask and dropout on the probabilities, forward and backward, without the
//! `(batch, heads, seq, seq)` score and probability tensors.
//!
//! The materialised path ([`super::attention_softmax`] between two batched products) keeps the
//! probabilities for the backward pass: at seq 1024 that is `2·heads·seq²` bytes per sequence
//! and layer in bf16 (24 MiB for gpt-124m, 288 MiB per sequence over its 12 layers, more than
//! every other activation together), and it splits and merges heads with three permute copies.
//! Here the forward pass keeps one f32 log-sum-exp per row and head, and the backward pass
//! recomputes the probabilities from q and k.
//!
//! Inputs and outputs stay in the token-major layout of the linear layers around attention:
//! `qkv` is `(batch·seq, (heads + 2·kv_heads)·hd)` with columns `[q | k | v]`, query head `h` in
//! columns `h·hd .. (h+1)·hd` of q and key/value head `g` in the same place of k and v; the
//! output and its gradient are `(batch·seq, d)`, `d = heads·hd`; the gradient of `qkv` has
//! `qkv`'s shape. With grouped-query attention (`kv_heads < heads`) query head `h` reads
//! key/value head `h / (heads / kv_heads)`: the shared heads are read in place, never repeated,
//! and their gradients sum over the query heads of their group. Dropout masks use the element index of the probability tensor the
//! materialised path would have, so both paths draw the same masks.
//!
//! Key padding ([`flash_attention_padded`]): per sequence, keys from a given length on are
//! masked for every query, as PyTorch's `key_padding_mask`; the kernels skip their tiles.
//!
//! Packed sequences ([`flash_attention_packed`]): a sequence holds several examples one after
//! the other, and each token's position within its own example (`position_ids`, restarting at
//! 0 where an example begins) says where that example starts. A query sees only the keys of
//! its own example, up to itself: causal attention inside each example, never across them,
//! with the tiles before the example skipped. Running the examples one by one computes the
//! same function.
//!
//! CPU: straightforward f32 loops (f64 row sums), one thread per group of heads, for any head
//! width; the reference the CUDA kernels (`kernels/attention.cu`) are tested against. CUDA: bf16
//! and f16 with head widths [`FLASH_HEAD_DIMS`]; see [`flash_attention_supported`].

mod cpu;
#[cfg(feature = "cuda")]
mod gpu;

use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor};

use super::{check_input, input_f32, output, DropoutMask};

const NAME: &str = "flash-attention";

/// Head widths the CUDA kernels are built for: up to 64 with 64-row tiles, the wider ones (128:
/// gpt-1.3b, Llama, Mistral) with 32-row tiles (see `kernels/attention.cu`).
pub const FLASH_HEAD_DIMS: [usize; 6] = [16, 32, 64, 80, 96, 128];

/// The geometry of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads: `heads`, or a divisor of it (grouped-query attention).
    pub kv_heads: usize,
    /// Whether query `i` sees only keys `0..=i`.
    pub causal: bool,
}

impl AttentionShape {
    /// The output width `d = heads·hd` of a `(batch·seq, (heads + 2·kv_heads)·hd)` q/k/v
    /// product, after checking its shape.
    fn width(&self, qkv: &Tensor) -> Result<usize> {
        let (rows, cols) = qkv.dims2()?;
        let parts = self.heads + 2 * self.kv_heads;
        if rows != self.batch * self.seq
            || self.kv_heads == 0
            || self.heads % self.kv_heads != 0
            || cols % parts != 0
            || cols == 0
        {
            bail!(
                "{NAME}: q/k/v rows {:?} do not fit batch {} × seq {} with {} query and {} \
                 key/value heads",
                qkv.shape(),
                self.batch,
                self.seq,
                self.heads,
                self.kv_heads
            );
        }
        Ok(cols / parts * self.heads)
    }

    fn head_dim(&self, d: usize) -> usize {
        d / self.heads
    }

    /// Scores are scaled by 1/√hd.
    fn scale(&self, d: usize) -> f32 {
        1.0 / (self.head_dim(d) as f32).sqrt()
    }
}

/// Whether [`flash_attention`] runs on `device` for `dtype` activations and heads of
/// `head_dim`: always on the CPU; on CUDA for bf16 and f16 (the tensor-core products) with a
/// head width in [`FLASH_HEAD_DIMS`]. Elsewhere attention materialises its probabilities.
pub fn flash_attention_supported(device: &Device, dtype: DType, head_dim: usize) -> bool {
    match device {
        Device::Cpu => true,
        Device::Cuda(_) => {
            matches!(dtype, DType::BF16 | DType::F16) && FLASH_HEAD_DIMS.contains(&head_dim)
        }
        _ => false,
    }
}

/// `(output rows (batch·seq, d) in qkv's dtype, log-sum-exp (batch, heads, seq) f32)` of
/// attention over `qkv`; the log-sum-exp is what [`flash_attention_backward`] needs besides
/// `qkv` and the output. No graph is recorded.
pub fn flash_attention(
    qkv: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
) -> Result<(Tensor, Tensor)> {
    forward(qkv, shape, dropout, KeyMask::None)
}

/// [`flash_attention`] with padded keys: in sequence `b`, the keys at positions
/// `key_lengths[b]` and beyond are padding that no query sees. `key_lengths` holds `batch` u32
/// values in `1..=seq` on `qkv`'s device; out of range is an error on the CPU and clamped into
/// range on CUDA, where a kernel cannot report errors. Padding queries still attend to the real
/// keys (their rows are whatever a loss makes of them).
pub fn flash_attention_padded(
    qkv: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    key_lengths: &Tensor,
) -> Result<(Tensor, Tensor)> {
    forward(qkv, shape, dropout, KeyMask::Padded(key_lengths))
}

/// [`flash_attention`] over packed sequences: `position_ids` (`batch·seq` u32 on `qkv`'s
/// device) holds each token's position within its example, 0 where an example begins and one
/// more than its left neighbour's elsewhere; a query sees the keys of its own example up to
/// itself. Causal attention only. On the CPU positions that break those rules are an error; on
/// CUDA, where a kernel cannot report errors, a position larger than the token's index in its
/// sequence is clamped to it.
pub fn flash_attention_packed(
    qkv: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    position_ids: &Tensor,
) -> Result<(Tensor, Tensor)> {
    forward(qkv, shape, dropout, KeyMask::Packed(position_ids))
}

/// Which keys a query may see besides the causal rule.
#[derive(Clone, Copy)]
enum KeyMask<'a> {
    /// Every key.
    None,
    /// Per sequence, the keys before a length (u32, `batch`).
    Padded(&'a Tensor),
    /// The keys of the query's own example, by position ids (u32, `batch·seq`).
    Packed(&'a Tensor),
}

fn forward(
    qkv: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    mask: KeyMask,
) -> Result<(Tensor, Tensor)> {
    check_input(qkv, NAME)?;
    let d = shape.width(qkv)?;
    let qkv = aligned(qkv)?;
    let lens = MaskTensors::new(mask, shape)?;
    let args = Args::new(shape, d, dropout, lens.on_cpu(shape.seq)?)?;
    let (storage, layout) = qkv.storage_and_layout();
    let (out, lse) = match &*storage {
        Storage::Cpu(s) => {
            let (out, lse) = cpu::forward(&input_f32(s, layout, NAME)?, &args);
            (
                Storage::Cpu(output(out, qkv.dtype())?),
                Storage::Cpu(candle_core::CpuStorage::F32(lse)),
            )
        }
        #[cfg(feature = "cuda")]
        Storage::Cuda(s) => {
            let (lens, positions) = (lens.lengths(), lens.positions());
            let masks = gpu::Masks {
                lengths: lens.as_ref().map(|(s, l)| (&**s, *l)),
                positions: positions.as_ref().map(|(s, l)| (&**s, *l)),
            };
            let (out, lse) = gpu::forward(s, layout, masks, &args)?;
            (Storage::Cuda(out), Storage::Cuda(lse))
        }
        _ => bail!("{NAME}: runs on the CPU and CUDA only"),
    };
    let rows = shape.batch * shape.seq;
    Ok((
        fresh(out, (rows, d)),
        fresh(lse, (shape.batch, shape.heads, shape.seq)),
    ))
}

/// The gradient of `qkv` (its shape and dtype) from the gradient `dout` of
/// [`flash_attention`]'s output, given `qkv`, that output and its log-sum-exp.
pub fn flash_attention_backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
) -> Result<Tensor> {
    backward(qkv, out, lse, dout, shape, dropout, KeyMask::None)
}

/// [`flash_attention_backward`] of [`flash_attention_padded`], with the same `key_lengths`;
/// padding keys get zero gradients.
pub fn flash_attention_padded_backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    key_lengths: &Tensor,
) -> Result<Tensor> {
    backward(
        qkv,
        out,
        lse,
        dout,
        shape,
        dropout,
        KeyMask::Padded(key_lengths),
    )
}

/// [`flash_attention_backward`] of [`flash_attention_packed`], with the same `position_ids`.
pub fn flash_attention_packed_backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    position_ids: &Tensor,
) -> Result<Tensor> {
    backward(
        qkv,
        out,
        lse,
        dout,
        shape,
        dropout,
        KeyMask::Packed(position_ids),
    )
}

fn backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    shape: &AttentionShape,
    dropout: Option<DropoutMask>,
    mask: KeyMask,
) -> Result<Tensor> {
    check_input(qkv, NAME)?;
    let d = shape.width(qkv)?;
    let rows = shape.batch * shape.seq;
    if out.dims() != [rows, d] || dout.dims() != [rows, d] {
        bail!(
            "{NAME}: output {:?} and its gradient {:?} must be [{rows}, {d}]",
            out.shape(),
            dout.shape()
        );
    }
    if lse.dims() != [shape.batch, shape.heads, shape.seq] || lse.dtype() != DType::F32 {
        bail!(
            "{NAME}: log-sum-exp must be f32 [{}, {}, {}], got {:?} {:?}",
            shape.batch,
            shape.heads,
            shape.seq,
            lse.dtype(),
            lse.shape()
        );
    }
    let qkv = aligned(qkv)?;
    let out = aligned(&out.to_dtype(qkv.dtype())?)?;
    let dout = aligned(&dout.to_dtype(qkv.dtype())?)?;
    let lse = lse.contiguous()?;
    let lens = MaskTensors::new(mask, shape)?;
    let args = Args::new(shape, d, dropout, lens.on_cpu(shape.seq)?)?;
    let (sq, lq) = qkv.storage_and_layout();
    let (so, lo) = out.storage_and_layout();
    let (sl, ll) = lse.storage_and_layout();
    let (sd, ld) = dout.storage_and_layout();
    let dqkv = match (&*sq, &*so, &*sl, &*sd) {
        (Storage::Cpu(q), Storage::Cpu(o), Storage::Cpu(l), Storage::Cpu(g)) => {
            let dqkv = cpu::backward(
                &input_f32(q, lq, NAME)?,
                &input_f32(o, lo, NAME)?,
                &input_f32(l, ll, NAME)?,
                &input_f32(g, ld, NAME)?,
                &args,
            );
            Storage::Cpu(output(dqkv, qkv.dtype())?)
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(q), Storage::Cuda(o), Storage::Cuda(l), Storage::Cuda(g)) => {
            let (lens, positions) = (lens.lengths(), lens.positions());
            let masks = gpu::Masks {
                lengths: lens.as_ref().map(|(s, l)| (&**s, *l)),
                positions: positions.as_ref().map(|(s, l)| (&**s, *l)),
            };
            Storage::Cuda(gpu::backward(
                (q, lq),
                (o, lo),
                (l, ll),
                (g, ld),
                masks,
                &args,
            )?)
        }
        _ => bail!("{NAME}: all inputs must be on one device, the CPU or CUDA"),
    };
    Ok(fresh(dqkv, (rows, args.qkv_width())))
}

/// A call's key mask as tensors, checked against its shape.
struct MaskTensors {
    lengths: Option<Tensor>,
    positions: Option<Tensor>,
}

/// What the CPU implementation reads of a key mask.
#[derive(Debug, Clone, Default)]
struct HostMask {
    /// Real keys per sequence; `None` when every key is real.
    lengths: Option<Vec<u32>>,
    /// Per token, the first position of its example in its sequence; `None` unpacked.
    starts: Option<Vec<u32>>,
}

impl MaskTensors {
    fn new(mask: KeyMask, shape: &AttentionShape) -> Result<Self> {
        let checked = |t: &Tensor, len: usize, what: &str| -> Result<Tensor> {
            if t.dtype() != DType::U32 || t.dims() != [len] {
                bail!(
                    "{NAME}: {what} must be {len} u32 values, got {:?} {:?}",
                    t.dtype(),
                    t.shape()
                );
            }
            t.contiguous()
        };
        Ok(match mask {
            KeyMask::None => Self {
                lengths: None,
                positions: None,
            },
            KeyMask::Padded(t) => Self {
                lengths: Some(checked(t, shape.batch, "key lengths")?),
                positions: None,
            },
            KeyMask::Packed(t) => {
                if !shape.causal {
                    bail!("{NAME}: packed sequences need causal attention");
                }
                Self {
                    lengths: None,
                    positions: Some(checked(t, shape.batch * shape.seq, "position ids")?),
                }
            }
        })
    }

    /// The mask as host values, for the CPU implementation (empty on CUDA, where the kernels
    /// read it from device memory).
    fn on_cpu(&self, seq: usize) -> Result<HostMask> {
        let mut host = HostMask::default();
        if let Some(t) = self.lengths.as_ref().filter(|t| t.device().is_cpu()) {
            host.lengths = Some(t.to_vec1::<u32>()?);
        }
        if let Some(t) = self.positions.as_ref().filter(|t| t.device().is_cpu()) {
            host.starts = Some(example_starts(&t.to_vec1::<u32>()?, seq)?);
        }
        Ok(host)
    }

    /// The lengths' storage, when they are given.
    #[cfg(feature = "cuda")]
    fn lengths(&self) -> Option<(candle_core::StorageRef<'_>, &candle_core::Layout)> {
        self.lengths.as_ref().map(|t| t.storage_and_layout())
    }

    /// The position ids' storage, when they are given.
    #[cfg(feature = "cuda")]
    fn positions(&self) -> Option<(candle_core::StorageRef<'_>, &candle_core::Layout)> {
        self.positions.as_ref().map(|t| t.storage_and_layout())
    }
}

/// Each token's example start (its index in its sequence minus its position id) from the
/// position ids of sequences of `seq` tokens. An id that is neither 0 nor one more than its
/// left neighbour's in the sequence is an error: examples are contiguous runs.
fn example_starts(positions: &[u32], seq: usize) -> Result<Vec<u32>> {
    let mut starts = Vec::with_capacity(positions.len());
    for (row, &pos) in positions.iter().enumerate() {
        let i = row % seq;
        let follows = i > 0 && pos == positions[row - 1] + 1;
        if pos != 0 && !follows {
            bail!(
                "{NAME}: position id {pos} at index {i} of sequence {} neither starts an \
                 example (0) nor continues the one before it",
                row / seq
            );
        }
        starts.push((i - pos as usize) as u32);
    }
    Ok(starts)
}

/// What both implementations need to know of a call.
#[derive(Debug, Clone)]
struct Args {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    causal: bool,
    scale: f32,
    /// `(mask, its keep scale)`; `None` without dropout.
    dropout: Option<DropoutMask>,
    /// The key mask on the CPU (empty on CUDA, or when every key is seen).
    mask: HostMask,
}

impl Args {
    fn new(
        shape: &AttentionShape,
        d: usize,
        dropout: Option<DropoutMask>,
        mask: HostMask,
    ) -> Result<Self> {
        if let Some(lens) = &mask.lengths {
            if let Some(bad) = lens.iter().find(|&&l| l == 0 || l as usize > shape.seq) {
                bail!(
                    "{NAME}: key length {bad} is outside 1..={} (the sequence length)",
                    shape.seq
                );
            }
        }
        Ok(Self {
            batch: shape.batch,
            seq: shape.seq,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim(d),
            causal: shape.causal,
            scale: shape.scale(d),
            dropout: dropout.filter(|m| m.threshold() > 0),
            mask,
        })
    }

    /// Keys of sequence `b` that are not padding.
    fn keys(&self, b: usize) -> usize {
        self.mask
            .lengths
            .as_ref()
            .map_or(self.seq, |lens| lens[b] as usize)
    }

    /// The first key query `i` of sequence `b` may see: its example's first token.
    fn first_key(&self, b: usize, i: usize) -> usize {
        self.mask
            .starts
            .as_ref()
            .map_or(0, |starts| starts[b * self.seq + i] as usize)
    }

    /// The output's width: the query heads'.
    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The q/k/v product's width.
    fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The key/value head query head `h` reads.
    fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// The factor of element `(batch·heads index bh, query i, key j)` of the probabilities:
    /// 1 without dropout, else 0 (dropped) or `1/(1 − p)`.
    fn keep_factor(&self, bh: usize, i: usize, j: usize) -> f32 {
        match self.dropout {
            None => 1.0,
            Some(m) => {
                let index = ((bh * self.seq + i) * self.seq + j) as u64;
                if m.keeps(index) {
                    m.scale()
                } else {
                    0.0
                }
            }
        }
    }
}

/// A tensor over a storage just computed, outside any graph.
fn fresh(storage: Storage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// `t` contiguous and starting on a 16-byte boundary of its buffer, as the CUDA kernels' vector
/// loads need (a copy in the rare case it does not).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    if (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 == 0 {
        Ok(t)
    } else {
        t.copy()
    }
}
