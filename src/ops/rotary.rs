//! Rotary position embedding of the query and key heads, in place in the q/k/v product.
//!
//! Llama's attention rotates each query and key head by its token's position before the
//! scores: pairs `(i, i + hd/2)` ("rotate half", Hugging Face's layout) turn by
//! `position · inv_freq[i]`. Here the rotation runs once on the q/k/v product's rows, in place,
//! so flash attention reads rotated heads straight from them and saves them for its backward
//! pass with no copy; the backward pass turns the q and k columns of the product's gradient by
//! the opposite angles (a rotation's transpose is its inverse). Values are untouched.
//!
//! The angles are computed in f32 from the f64 frequencies rounded to f32, as `transformers`
//! does; positions are the row's index within its sequence, or, for packed sequences, its
//! position id within its own example ([`rotate_packed_in_place`]), so each example turns as
//! it would alone.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, DType, Device, InplaceOp2, InplaceOp3, Layout, Result, Tensor,
};

const NAME: &str = "rotary";

/// Which way to turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// By `+position · frequency`: the forward pass.
    Forward,
    /// By `−position · frequency`: the gradient of a forwards rotation.
    Backward,
}

impl Rotation {
    fn sign(self) -> f32 {
        match self {
            Rotation::Forward => 1.0,
            Rotation::Backward => -1.0,
        }
    }
}

/// The frequencies of one call, uploaded once per device and step.
pub fn frequencies(inverse_frequencies: &[f64], device: &Device) -> Result<Tensor> {
    let f32s: Vec<f32> = inverse_frequencies.iter().map(|&f| f as f32).collect();
    Tensor::from_vec(f32s, inverse_frequencies.len(), device)
}

/// Rotates, in place, the first `heads` heads of width `hd` of every row of `x` (`(batch·seq,
/// width)`, contiguous, f32/bf16/f16): the query and key heads of a q/k/v product. `freqs` is
/// [`frequencies`] of `hd/2` values on `x`'s device. `x` must not be shared with a tensor that
/// still needs the values it holds.
pub fn rotate_in_place(
    x: &Tensor,
    freqs: &Tensor,
    heads: usize,
    hd: usize,
    seq: usize,
    rotation: Rotation,
) -> Result<()> {
    check(x, freqs, heads, hd, seq)?;
    x.inplace_op2(
        &freqs.contiguous()?,
        &Rotary {
            heads,
            hd,
            seq,
            sign: rotation.sign(),
        },
    )
}

/// [`rotate_in_place`] of packed sequences: row `r` turns by its position id
/// `position_ids[r]` (u32, one per row, on `x`'s device) instead of its index in its sequence.
pub fn rotate_packed_in_place(
    x: &Tensor,
    freqs: &Tensor,
    heads: usize,
    hd: usize,
    seq: usize,
    rotation: Rotation,
    position_ids: &Tensor,
) -> Result<()> {
    let rows = x.dim(0)?;
    if position_ids.dims() != [rows] || position_ids.dtype() != DType::U32 {
        bail!(
            "{NAME}: expected {rows} u32 position ids, got {:?} {:?}",
            position_ids.dtype(),
            position_ids.shape()
        );
    }
    // The checks of the unpacked call, on a view that leaves `x` as it is.
    check(x, freqs, heads, hd, seq)?;
    x.inplace_op3(
        &freqs.contiguous()?,
        &position_ids.contiguous()?,
        &Rotary {
            heads,
            hd,
            seq,
            sign: rotation.sign(),
        },
    )
}

/// The shapes [`rotate_in_place`] needs.
fn check(x: &Tensor, freqs: &Tensor, heads: usize, hd: usize, seq: usize) -> Result<()> {
    let (rows, width) = x.dims2()?;
    if !x.is_contiguous() {
        bail!("{NAME}: the q/k/v rows must be contiguous");
    }
    if hd % 2 != 0 || heads * hd > width || seq == 0 || rows % seq != 0 {
        bail!(
            "{NAME}: {heads} heads of width {hd} do not fit rows {:?} of sequences of {seq}",
            x.shape()
        );
    }
    if freqs.dims() != [hd / 2] || freqs.dtype() != DType::F32 {
        bail!(
            "{NAME}: expected {} f32 frequencies, got {:?} {:?}",
            hd / 2,
            freqs.dtype(),
            freqs.shape()
        );
    }
    Ok(())
}

struct Rotary {
    heads: usize,
    hd: usize,
    seq: usize,
    sign: f32,
}

impl Rotary {
    /// Turns the pairs of one row of `width` values, row index `r`.
    fn row<T: Copy>(
        &self,
        row: &mut [T],
        pos: f32,
        freqs: &[f32],
        get: impl Fn(T) -> f32,
        put: impl Fn(f32) -> T,
    ) {
        let half = self.hd / 2;
        for head in 0..self.heads {
            let base = head * self.hd;
            for (p, &f) in freqs.iter().enumerate() {
                let (sn, cs) = (pos * f).sin_cos();
                let sn = sn * self.sign;
                let (a, b) = (get(row[base + p]), get(row[base + p + half]));
                row[base + p] = put(a * cs - b * sn);
                row[base + p + half] = put(b * cs + a * sn);
            }
        }
    }

    fn rows<T: Copy>(
        &self,
        data: &mut [T],
        width: usize,
        (freqs, positions): (&[f32], Option<&[u32]>),
        get: impl Fn(T) -> f32 + Copy,
        put: impl Fn(f32) -> T + Copy,
    ) {
        for (r, row) in data.chunks_exact_mut(width).enumerate() {
            let pos = positions.map_or(r % self.seq, |p| p[r] as usize) as f32;
            self.row(row, pos, freqs, get, put);
        }
    }

    /// Turns the rows of `s1` by `freqs` and, for packed sequences, their `positions`.
    fn cpu_rows(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        freqs: &[f32],
        positions: Option<&[u32]>,
    ) -> Result<()> {
        let (start, end) = match l1.contiguous_offsets() {
            Some(o) => o,
            None => bail!("{NAME}: the q/k/v rows must be contiguous"),
        };
        let width = l1.dims().last().copied().unwrap_or(1);
        let with = (freqs, positions);
        match s1 {
            CpuStorage::F32(v) => self.rows(&mut v[start..end], width, with, |x| x, |x| x),
            CpuStorage::BF16(v) => self.rows(
                &mut v[start..end],
                width,
                with,
                half::bf16::to_f32,
                half::bf16::from_f32,
            ),
            CpuStorage::F16(v) => self.rows(
                &mut v[start..end],
                width,
                with,
                half::f16::to_f32,
                half::f16::from_f32,
            ),
            other => bail!(
                "{NAME}: expected f32, bf16 or f16 rows, got {:?}",
                other.dtype()
            ),
        }
        Ok(())
    }
}

/// The f32 frequencies of a call, contiguous.
fn cpu_freqs<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    super::contiguous(
        match s {
            CpuStorage::F32(v) => v.as_slice(),
            _ => bail!("{NAME}: frequencies must be f32"),
        },
        l,
        NAME,
    )
}

impl InplaceOp2 for Rotary {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        self.cpu_rows(s1, l1, cpu_freqs(s2, l2)?, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        gpu::rotate(s1, l1, (s2, l2), None, self)
    }
}

impl InplaceOp3 for Rotary {
    fn name(&self) -> &'static str {
        NAME
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
        let positions = match s3 {
            CpuStorage::U32(v) => super::contiguous(v.as_slice(), l3, NAME)?,
            _ => bail!("{NAME}: position ids must be u32"),
        };
        self.cpu_rows(s1, l1, cpu_freqs(s2, l2)?, Some(positions))
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
        gpu::rotate(s1, l1, (s2, l2), Some((s3, l3)), self)
    }
}

#[cfg(feature = "cuda")]
mod gpu;
