//! One parameter's compact optimizer state, in each of the places it can live (exact f32
//! vectors on the device, host vectors on a CPU device, device tensors, page-locked host
//! memory), and how it is made, saved into a checkpoint and restored from one.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};
use half::bf16;

use crate::knobs::{MasterFormat, MomentFormat, StateLayout};
use crate::ops::compact_adam::BLOCK;
use crate::ops::transfer::{self, HostBuffer, Link};
use crate::Result;

/// One parameter's state.
pub(super) enum ParamState {
    /// Exact f32 moments on the device (vectors).
    Exact { m: Tensor, v: Tensor },
    /// A matrix's state in host vectors (CPU devices).
    Cpu(Box<CpuState>),
    /// A matrix's state in device tensors.
    Device(DeviceState),
    /// A matrix's moments in a page-locked buffer; its compensation on the device.
    Host {
        /// Locked to read it for a checkpoint through a shared borrow.
        buffer: Mutex<HostBuffer>,
        /// Offsets of m, v and (8-bit) the two scale vectors.
        at: [usize; 4],
        comp: Option<Tensor>,
    },
}

/// A matrix's state on a CPU device: its moments and, with Kahan masters, the compensation.
pub(super) struct CpuState {
    pub(super) moments: CpuMoments,
    pub(super) comp: Option<Vec<bf16>>,
}

/// A matrix's moments in host vectors, in the layout's format.
pub(super) enum CpuMoments {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<bf16>, Vec<bf16>),
    Int8 {
        m: Vec<u8>,
        v: Vec<u8>,
        m_scale: Vec<f32>,
        v_scale: Vec<f32>,
    },
}

/// A matrix's state in device tensors: m, v, the block scales of 8-bit moments and the Kahan
/// compensation.
pub(super) struct DeviceState {
    pub(super) m: Tensor,
    pub(super) v: Tensor,
    pub(super) scales: Option<(Tensor, Tensor)>,
    pub(super) comp: Option<Tensor>,
}

/// The moments' dtype in `layout`.
fn moment_dtype(layout: StateLayout) -> DType {
    match layout.moments {
        MomentFormat::F32 => DType::F32,
        MomentFormat::Bf16 => DType::BF16,
        MomentFormat::Int8Blockwise => DType::U8,
    }
}

/// Zero moments (and scales, compensation) for `n` elements on `device`.
pub(super) fn device_state(layout: StateLayout, n: usize, device: &Device) -> Result<DeviceState> {
    let dtype = moment_dtype(layout);
    let scales = match layout.moments {
        MomentFormat::Int8Blockwise => Some((
            Tensor::zeros(n.div_ceil(BLOCK), DType::F32, device)?,
            Tensor::zeros(n.div_ceil(BLOCK), DType::F32, device)?,
        )),
        _ => None,
    };
    Ok(DeviceState {
        m: Tensor::zeros(n, dtype, device)?,
        v: Tensor::zeros(n, dtype, device)?,
        scales,
        comp: compensation(layout, n, device)?,
    })
}

fn compensation(layout: StateLayout, n: usize, device: &Device) -> Result<Option<Tensor>> {
    Ok(match layout.masters {
        MasterFormat::Bf16Kahan => Some(Tensor::zeros(n, DType::BF16, device)?),
        _ => None,
    })
}

/// The byte sizes of a matrix's m, v and scale vectors in `layout`.
pub(super) fn moment_sizes(layout: StateLayout, n: usize) -> [usize; 4] {
    let e = moment_dtype(layout).size_in_bytes();
    let s = match layout.moments {
        MomentFormat::Int8Blockwise => 4 * n.div_ceil(BLOCK),
        _ => 0,
    };
    [e * n, e * n, s, s]
}

/// One parameter's tensors in a checkpoint's optimizer state.
pub(super) struct SavedParam<'a> {
    pub(super) tensors: &'a HashMap<String, Tensor>,
    pub(super) name: &'a str,
}

impl SavedParam<'_> {
    /// The tensor `key` of the parameter, flat, checked to be `len` elements of `dtype`.
    fn get(&self, key: &str, dtype: DType, len: usize) -> std::result::Result<Tensor, String> {
        let full = format!("{key}.{}", self.name);
        let t = self
            .tensors
            .get(&full)
            .ok_or_else(|| format!("optimizer state `{full}` is missing"))?;
        if t.dtype() != dtype || t.elem_count() != len {
            return Err(format!(
                "optimizer state `{full}` is {:?} of {} elements, expected {dtype:?} of {len} (a checkpoint of another state layout?)",
                t.dtype(),
                t.elem_count()
            ));
        }
        t.flatten_all().map_err(|e| e.to_string())
    }
}

/// A checkpoint's error text for a candle error.
fn text(e: candle_core::Error) -> String {
    e.to_string()
}

impl ParamState {
    /// Zero state in `layout` for `var` on `device`; `link` is there when the matrices'
    /// moments go to page-locked host memory.
    pub(super) fn zeros(
        var: &Var,
        layout: StateLayout,
        device: &Device,
        link: Option<&Link>,
    ) -> Result<Self> {
        let n = var.elem_count();
        let want = if var.rank() >= 2 && layout.masters.is_half() {
            DType::BF16
        } else {
            DType::F32
        };
        if var.dtype() != want {
            return Err(crate::Error::internal(format!(
                "compact state: a {:?} parameter where {want:?} was expected",
                var.dtype()
            )));
        }
        Ok(if var.rank() < 2 {
            ParamState::Exact {
                m: Tensor::zeros(n, DType::F32, device)?,
                v: Tensor::zeros(n, DType::F32, device)?,
            }
        } else if device.is_cpu() {
            ParamState::Cpu(Box::new(CpuState::zeros(layout, n)))
        } else if let Some(link) = link {
            host_state(layout, n, device, link)?
        } else {
            ParamState::Device(device_state(layout, n, device)?)
        })
    }

    /// The state of a parameter of `n` elements as `(key, tensor)` pairs for a checkpoint
    /// (see [`CompactAdam::state_tensors`]).
    pub(super) fn tensors(
        &self,
        layout: StateLayout,
        n: usize,
    ) -> Result<Vec<(&'static str, Tensor)>> {
        Ok(match self {
            ParamState::Exact { m, v } => vec![("m", m.clone()), ("v", v.clone())],
            ParamState::Cpu(s) => s.tensors()?,
            ParamState::Device(s) => s.tensors(),
            ParamState::Host { buffer, at, comp } => {
                let mut out = host_tensors(buffer, at, layout, n)?;
                if let Some(c) = comp {
                    out.push(("kahan", c.clone()));
                }
                out
            }
        })
    }

    /// Restores the state of a parameter of `n` elements from `saved`.
    pub(super) fn load(
        &mut self,
        saved: &SavedParam<'_>,
        layout: StateLayout,
        n: usize,
    ) -> std::result::Result<(), String> {
        match self {
            ParamState::Exact { m, v } => {
                *m = saved
                    .get("m", DType::F32, n)?
                    .to_device(m.device())
                    .map_err(text)?;
                *v = saved
                    .get("v", DType::F32, n)?
                    .to_device(v.device())
                    .map_err(text)?;
                Ok(())
            }
            ParamState::Cpu(s) => s.load(saved, layout, n),
            ParamState::Device(s) => s.load(saved, layout, n),
            ParamState::Host { buffer, at, comp } => {
                load_host(saved, buffer, at, layout, n)?;
                if let (MasterFormat::Bf16Kahan, Some(c)) = (layout.masters, comp.as_mut()) {
                    *c = saved
                        .get("kahan", DType::BF16, n)?
                        .to_device(c.device())
                        .map_err(text)?;
                }
                Ok(())
            }
        }
    }
}

impl CpuState {
    /// Zero moments (and compensation) for `n` elements in `layout`.
    fn zeros(layout: StateLayout, n: usize) -> Self {
        Self {
            moments: match layout.moments {
                MomentFormat::F32 => CpuMoments::F32(vec![0.0; n], vec![0.0; n]),
                MomentFormat::Bf16 => CpuMoments::Bf16(vec![bf16::ZERO; n], vec![bf16::ZERO; n]),
                MomentFormat::Int8Blockwise => CpuMoments::Int8 {
                    m: vec![0; n],
                    v: vec![0; n],
                    m_scale: vec![0.0; n.div_ceil(BLOCK)],
                    v_scale: vec![0.0; n.div_ceil(BLOCK)],
                },
            },
            comp: (layout.masters == MasterFormat::Bf16Kahan).then(|| vec![bf16::ZERO; n]),
        }
    }

    /// The state as `(key, tensor)` pairs, on the CPU.
    fn tensors(&self) -> Result<Vec<(&'static str, Tensor)>> {
        let cpu = &Device::Cpu;
        let mut out = match &self.moments {
            CpuMoments::F32(m, v) => vec![
                ("m", Tensor::new(m.as_slice(), cpu)?),
                ("v", Tensor::new(v.as_slice(), cpu)?),
            ],
            CpuMoments::Bf16(m, v) => vec![
                ("m", Tensor::new(m.as_slice(), cpu)?),
                ("v", Tensor::new(v.as_slice(), cpu)?),
            ],
            CpuMoments::Int8 {
                m,
                v,
                m_scale,
                v_scale,
            } => vec![
                ("m", Tensor::new(m.as_slice(), cpu)?),
                ("v", Tensor::new(v.as_slice(), cpu)?),
                ("m_scale", Tensor::new(m_scale.as_slice(), cpu)?),
                ("v_scale", Tensor::new(v_scale.as_slice(), cpu)?),
            ],
        };
        if let Some(c) = &self.comp {
            out.push(("kahan", Tensor::new(c.as_slice(), cpu)?));
        }
        Ok(out)
    }

    /// Restores the state of `n` elements in `layout` from `saved`.
    fn load(
        &mut self,
        saved: &SavedParam<'_>,
        layout: StateLayout,
        n: usize,
    ) -> std::result::Result<(), String> {
        let dtype = moment_dtype(layout);
        let blocks = n.div_ceil(BLOCK);
        self.moments = match layout.moments {
            MomentFormat::F32 => CpuMoments::F32(
                saved.get("m", dtype, n)?.to_vec1().map_err(text)?,
                saved.get("v", dtype, n)?.to_vec1().map_err(text)?,
            ),
            MomentFormat::Bf16 => CpuMoments::Bf16(
                saved.get("m", dtype, n)?.to_vec1().map_err(text)?,
                saved.get("v", dtype, n)?.to_vec1().map_err(text)?,
            ),
            MomentFormat::Int8Blockwise => CpuMoments::Int8 {
                m: saved.get("m", dtype, n)?.to_vec1().map_err(text)?,
                v: saved.get("v", dtype, n)?.to_vec1().map_err(text)?,
                m_scale: saved
                    .get("m_scale", DType::F32, blocks)?
                    .to_vec1()
                    .map_err(text)?,
                v_scale: saved
                    .get("v_scale", DType::F32, blocks)?
                    .to_vec1()
                    .map_err(text)?,
            },
        };
        if layout.masters == MasterFormat::Bf16Kahan {
            self.comp = Some(
                saved
                    .get("kahan", DType::BF16, n)?
                    .to_vec1()
                    .map_err(text)?,
            );
        }
        Ok(())
    }
}

impl DeviceState {
    /// The state as `(key, tensor)` pairs, where it is.
    fn tensors(&self) -> Vec<(&'static str, Tensor)> {
        let mut out = vec![("m", self.m.clone()), ("v", self.v.clone())];
        if let Some((a, b)) = &self.scales {
            out.push(("m_scale", a.clone()));
            out.push(("v_scale", b.clone()));
        }
        if let Some(c) = &self.comp {
            out.push(("kahan", c.clone()));
        }
        out
    }

    /// Restores the state of `n` elements in `layout` from `saved`, onto the device it is on.
    fn load(
        &mut self,
        saved: &SavedParam<'_>,
        layout: StateLayout,
        n: usize,
    ) -> std::result::Result<(), String> {
        let dtype = moment_dtype(layout);
        let blocks = n.div_ceil(BLOCK);
        let dev = self.m.device().clone();
        self.m = saved.get("m", dtype, n)?.to_device(&dev).map_err(text)?;
        self.v = saved.get("v", dtype, n)?.to_device(&dev).map_err(text)?;
        if layout.moments == MomentFormat::Int8Blockwise {
            self.scales = Some((
                saved
                    .get("m_scale", DType::F32, blocks)?
                    .to_device(&dev)
                    .map_err(text)?,
                saved
                    .get("v_scale", DType::F32, blocks)?
                    .to_device(&dev)
                    .map_err(text)?,
            ));
        }
        if layout.masters == MasterFormat::Bf16Kahan {
            self.comp = Some(
                saved
                    .get("kahan", DType::BF16, n)?
                    .to_device(&dev)
                    .map_err(text)?,
            );
        }
        Ok(())
    }
}

/// Zero moments of `n` elements in a fresh page-locked buffer, and the compensation on
/// `device`.
fn host_state(layout: StateLayout, n: usize, device: &Device, link: &Link) -> Result<ParamState> {
    let sizes = moment_sizes(layout, n);
    let (offsets, total) = transfer::layout(sizes);
    let mut buffer = HostBuffer::new(link);
    buffer.reserve(total)?;
    let bytes = buffer.bytes()?;
    bytes.fill(0);
    Ok(ParamState::Host {
        buffer: Mutex::new(buffer),
        at: [offsets[0], offsets[1], offsets[2], offsets[3]],
        comp: compensation(layout, n, device)?,
    })
}

/// The moments of `n` elements in the page-locked `buffer` (at offsets `at`) as `(key,
/// tensor)` pairs, copied to the CPU.
fn host_tensors(
    buffer: &Mutex<HostBuffer>,
    at: &[usize; 4],
    layout: StateLayout,
    n: usize,
) -> Result<Vec<(&'static str, Tensor)>> {
    let sizes = moment_sizes(layout, n);
    let mut buffer = buffer.lock().map_err(|_| poisoned())?;
    let bytes = buffer.bytes()?;
    let dtype = moment_dtype(layout);
    let read = |i: usize, dtype: DType, len: usize| -> Result<Tensor> {
        let raw = &bytes[at[i]..at[i] + sizes[i]];
        Ok(match dtype {
            DType::U8 => Tensor::from_slice(raw, len, &Device::Cpu)?,
            DType::BF16 => Tensor::from_slice(transfer::typed::<bf16>(raw)?, len, &Device::Cpu)?,
            _ => Tensor::from_slice(transfer::typed::<f32>(raw)?, len, &Device::Cpu)?,
        })
    };
    let mut out = vec![("m", read(0, dtype, n)?), ("v", read(1, dtype, n)?)];
    if layout.moments == MomentFormat::Int8Blockwise {
        out.push(("m_scale", read(2, DType::F32, n.div_ceil(BLOCK))?));
        out.push(("v_scale", read(3, DType::F32, n.div_ceil(BLOCK))?));
    }
    Ok(out)
}

/// Writes the saved moments of `n` elements into the page-locked `buffer` (at offsets `at`).
fn load_host(
    saved: &SavedParam<'_>,
    buffer: &mut Mutex<HostBuffer>,
    at: &[usize; 4],
    layout: StateLayout,
    n: usize,
) -> std::result::Result<(), String> {
    let dtype = moment_dtype(layout);
    let blocks = n.div_ceil(BLOCK);
    let sizes = moment_sizes(layout, n);
    let mut parts = vec![saved.get("m", dtype, n)?, saved.get("v", dtype, n)?];
    if layout.moments == MomentFormat::Int8Blockwise {
        parts.push(saved.get("m_scale", DType::F32, blocks)?);
        parts.push(saved.get("v_scale", DType::F32, blocks)?);
    }
    let buffer = buffer.get_mut().map_err(|_| poisoned().to_string())?;
    let bytes = buffer.bytes().map_err(|e| e.to_string())?;
    for (i, t) in parts.iter().enumerate() {
        let raw: Vec<u8> = match t.dtype() {
            DType::U8 => t.to_vec1::<u8>().map_err(text)?,
            DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<bf16>().map_err(text)?).to_vec(),
            _ => bytemuck::cast_slice(&t.to_vec1::<f32>().map_err(text)?).to_vec(),
        };
        bytes[at[i]..at[i] + sizes[i]].copy_from_slice(&raw);
    }
    Ok(())
}

pub(super) fn poisoned() -> crate::Error {
    crate::Error::internal("a host moment buffer's lock was poisoned by a panic")
}
