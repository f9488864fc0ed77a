//! Adam / AdamW over a compact state layout ([`StateLayout`]): bf16 or 8-bit block-wise
//! moments, bf16 masters with Kahan compensation or stochastic rounding, and the moments on
//! the device or in page-locked host memory.
//!
//! Matrices take the layout; vectors (norms, biases) keep exact f32 moments on the device.
//! With bf16 masters the model's matrices are the masters ([`crate::model::Masters::Working`])
//! and their gradients arrive in bf16.
//!
//! With the moments in host memory each matrix's state is one page-locked buffer. Its update
//! queues the upload of the moments into fresh device tensors, the kernel, and the download
//! back, all on the device's one stream, then drops the device tensors: the memory pool is
//! stream-ordered, so a later kernel reuses that memory only after the download. So the device
//! holds one part's moments at a time, and the host never waits.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};
use half::bf16;

use super::{AdamProgress, Optimizer};
use crate::knobs::{MasterFormat, MomentFormat, MomentPlace, StateLayout};
use crate::ops::compact_adam::cpu::{self, Maps, MomentsMut, Weight};
use crate::ops::compact_adam::{quantile, rounding_seed, BLOCK};
use crate::ops::host_optim::AdamConsts;
use crate::ops::transfer::{self, HostBuffer, Link};
use crate::spec::model::OptimizerSpec;
use crate::spec::state::Components;
use crate::Result;

/// Adam over a compact layout.
pub struct CompactAdam {
    progress: AdamProgress,
    layout: StateLayout,
    vars: Vec<Var>,
    states: Vec<ParamState>,
    seed: u64,
    maps: Maps,
    /// The maps on the device, for 8-bit moments on a GPU.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device_maps: Option<(Tensor, Tensor)>,
    /// The most moment bytes a host-placed update held on the device at once.
    staged_peak: u64,
    /// The copy stream and staging of host-placed moments on a GPU.
    #[cfg(feature = "cuda")]
    overlap: Option<overlap::Overlap>,
}

#[cfg(feature = "cuda")]
mod overlap;

/// One parameter's state.
enum ParamState {
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

struct CpuState {
    moments: CpuMoments,
    comp: Option<Vec<bf16>>,
}

enum CpuMoments {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<bf16>, Vec<bf16>),
    Int8 {
        m: Vec<u8>,
        v: Vec<u8>,
        m_scale: Vec<f32>,
        v_scale: Vec<f32>,
    },
}

struct DeviceState {
    m: Tensor,
    v: Tensor,
    scales: Option<(Tensor, Tensor)>,
    comp: Option<Tensor>,
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
fn device_state(layout: StateLayout, n: usize, device: &Device) -> Result<DeviceState> {
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
fn moment_sizes(layout: StateLayout, n: usize) -> [usize; 4] {
    let e = moment_dtype(layout).size_in_bytes();
    let s = match layout.moments {
        MomentFormat::Int8Blockwise => 4 * n.div_ceil(BLOCK),
        _ => 0,
    };
    [e * n, e * n, s, s]
}

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The maps on the device, for 8-bit moments on a GPU.
fn device_maps(
    maps: &Maps,
    layout: StateLayout,
    device: &Device,
) -> Result<Option<(Tensor, Tensor)>> {
    if device.is_cuda() && layout.moments == MomentFormat::Int8Blockwise {
        Ok(Some((
            Tensor::from_slice(&maps.signed, quantile::CODES, device)?,
            Tensor::from_slice(&maps.unsigned, quantile::CODES, device)?,
        )))
    } else {
        Ok(None)
    }
}

/// One parameter's tensors in a checkpoint's optimizer state.
struct SavedParam<'a> {
    tensors: &'a HashMap<String, Tensor>,
    name: &'a str,
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
    fn zeros(var: &Var, layout: StateLayout, device: &Device, link: Option<&Link>) -> Result<Self> {
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
    fn tensors(&self, layout: StateLayout, n: usize) -> Result<Vec<(&'static str, Tensor)>> {
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
    fn load(
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

impl CompactAdam {
    /// Zero state in `layout` for `vars` (matrices in f32, or bf16 with bf16 masters);
    /// `seed` drives the stochastic rounding. Fresh 8-bit moments are all-zero bytes: every
    /// block's scale is 0, so every code stands for 0 (bitsandbytes starts its codes at 0 too).
    pub fn new(vars: &[Var], spec: OptimizerSpec, layout: StateLayout, seed: u64) -> Result<Self> {
        let device = vars
            .first()
            .map(|v| v.device().clone())
            .unwrap_or(Device::Cpu);
        let host = layout.moments_on == MomentPlace::Host && device.is_cuda();
        let link = if host {
            Some(Link::new(&device)?)
        } else {
            None
        };
        let states = vars
            .iter()
            .map(|var| ParamState::zeros(var, layout, &device, link.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let maps = Maps {
            signed: quantile::dynamic_map(true),
            unsigned: quantile::dynamic_map(false),
        };
        let device_maps = device_maps(&maps, layout, &device)?;
        Ok(Self {
            progress: AdamProgress::new(spec),
            layout,
            vars: vars.to_vec(),
            states,
            seed,
            maps,
            device_maps,
            #[cfg(feature = "cuda")]
            overlap: match &link {
                Some(_) => Some(overlap::Overlap::new(&device)?),
                None => None,
            },
            staged_peak: 0,
        })
    }

    /// The layout.
    pub fn layout(&self) -> StateLayout {
        self.layout
    }

    /// Starts a step whose parameters are then updated in parts ([`Self::update`]), each once,
    /// and ended by [`Self::finish_step`].
    pub fn begin_step(&mut self) -> AdamConsts {
        #[cfg(feature = "cuda")]
        if let Some(o) = self.overlap.as_mut() {
            o.begin_step();
        }
        self.progress.begin_step()
    }

    /// Ends a step begun by [`Self::begin_step`]: the last part's staged moments are freed once
    /// their download is done, so that none is held through the next forward pass.
    pub fn finish_step(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(o) = self.overlap.as_mut() {
            o.finish_step()?;
        }
        Ok(())
    }

    /// One update of every parameter with `grads` (one per parameter, unscaled and averaged).
    pub fn step(&mut self, grads: &[Tensor]) -> Result<()> {
        let consts = self.begin_step();
        let all: Vec<(usize, Tensor)> = grads.iter().cloned().enumerate().collect();
        self.update(&consts, &all)?;
        self.finish_step()
    }

    /// Updates the parameters `grads` names (`(index, gradient)`) in the step `consts` began.
    pub fn update(&mut self, consts: &AdamConsts, grads: &[(usize, Tensor)]) -> Result<()> {
        #[allow(unused_mut)] // only host-placed moments on CUDA stage
        let mut staged = 0u64;
        let mut exact = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        #[cfg(feature = "cuda")]
        let mut hosted: Vec<(usize, Tensor)> = Vec::new();
        for (index, g) in grads {
            let var = &self.vars[*index];
            let seed = rounding_seed(self.seed, self.progress.steps(), *index);
            match &mut self.states[*index] {
                ParamState::Exact { m, v } => {
                    exact.0.push(var.as_tensor().clone());
                    exact.1.push(m.clone());
                    exact.2.push(v.clone());
                    exact
                        .3
                        .push(g.to_dtype(DType::F32)?.flatten_all()?.contiguous()?);
                }
                ParamState::Cpu(state) => {
                    let op = CpuUpdate {
                        state: RefCell::new(state),
                        grad: g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                        masters: self.layout.masters,
                        consts,
                        maps: &self.maps,
                        seed,
                    };
                    var.as_tensor().inplace_op1(&op)?;
                }
                #[cfg(feature = "cuda")]
                ParamState::Device(s) => {
                    let g = kernel_gradient(g, var)?;
                    cuda_update(
                        var,
                        &g,
                        s,
                        self.device_maps.as_ref(),
                        self.layout,
                        consts,
                        seed,
                    )?;
                }
                #[cfg(feature = "cuda")]
                ParamState::Host { .. } => hosted.push((*index, g.clone())),
                #[cfg(not(feature = "cuda"))]
                ParamState::Device(_) | ParamState::Host { .. } => {
                    return Err(crate::Error::internal(
                        "device-placed compact state in a build without CUDA",
                    ));
                }
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(overlap) = self.overlap.as_mut() {
            staged = overlap.update(
                &mut self.states,
                &self.vars,
                &hosted,
                self.device_maps.as_ref(),
                self.layout,
                consts,
                self.seed,
                self.progress.steps(),
            )?;
        }
        if !exact.0.is_empty() {
            let flat = |ts: &[Tensor]| -> Result<Vec<Tensor>> {
                Ok(ts
                    .iter()
                    .map(|t| t.flatten_all())
                    .collect::<candle_core::Result<_>>()?)
            };
            crate::ops::adam_update_all(&flat(&exact.0)?, &exact.1, &exact.2, &exact.3, consts)?;
        }
        self.staged_peak = self.staged_peak.max(staged);
        Ok(())
    }

    /// The state's bytes: on the device, the masters (weights, with any compensation) and the
    /// moments held there (with host-placed moments, the most one update staged); on the host,
    /// the page-locked moments.
    pub fn bytes(&self) -> (Components, Components) {
        let mut device = Components::default();
        let mut host = Components::default();
        for (var, state) in self.vars.iter().zip(&self.states) {
            device.weights += tensor_bytes(var.as_tensor());
            match state {
                ParamState::Exact { m, v } => device.moments += tensor_bytes(m) + tensor_bytes(v),
                ParamState::Cpu(s) => {
                    device.moments += match &s.moments {
                        CpuMoments::F32(m, v) => 4 * (m.len() + v.len()) as u64,
                        CpuMoments::Bf16(m, v) => 2 * (m.len() + v.len()) as u64,
                        CpuMoments::Int8 {
                            m,
                            v,
                            m_scale,
                            v_scale,
                        } => (m.len() + v.len() + 4 * (m_scale.len() + v_scale.len())) as u64,
                    };
                    device.weights += s.comp.as_ref().map_or(0, |c| 2 * c.len() as u64);
                }
                ParamState::Device(s) => {
                    device.moments += tensor_bytes(&s.m) + tensor_bytes(&s.v);
                    if let Some((a, b)) = &s.scales {
                        device.moments += tensor_bytes(a) + tensor_bytes(b);
                    }
                    device.weights += s.comp.as_ref().map_or(0, tensor_bytes);
                }
                ParamState::Host { comp, .. } => {
                    let sizes = moment_sizes(self.layout, var.elem_count());
                    host.moments += sizes.iter().sum::<usize>() as u64;
                    device.weights += comp.as_ref().map_or(0, tensor_bytes);
                }
            }
        }
        device.moments += self.staged_peak;
        (device, host)
    }

    /// Bytes a step moves over the host link (each host-placed moment up and down once).
    pub fn link_bytes_per_step(&self) -> Option<u64> {
        let (_, host) = self.bytes();
        (host.moments > 0).then_some(2 * host.moments)
    }

    /// The state as named tensors for a checkpoint (`m.`, `v.`, and with 8-bit moments
    /// `m_scale.`, `v_scale.`; `kahan.` with Kahan masters), in its stored dtypes.
    pub fn state_tensors(&self, names: &[String]) -> Result<HashMap<String, Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(o) = &self.overlap {
            o.synchronize()?;
        }
        let mut out = HashMap::new();
        for ((name, var), state) in names.iter().zip(&self.vars).zip(&self.states) {
            for (key, t) in state.tensors(self.layout, var.elem_count())? {
                out.insert(format!("{key}.{name}"), t);
            }
        }
        Ok(out)
    }

    /// Restores the moments saved by [`Self::state_tensors`].
    fn load_moments(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        #[cfg(feature = "cuda")]
        if let Some(o) = &self.overlap {
            o.synchronize().map_err(|e| e.to_string())?;
        }
        for ((name, var), state) in names.iter().zip(&self.vars).zip(&mut self.states) {
            let saved = SavedParam { tensors, name };
            state.load(&saved, self.layout, var.elem_count())?;
        }
        Ok(())
    }
}

impl Optimizer for CompactAdam {
    fn progress(&self) -> &AdamProgress {
        &self.progress
    }

    fn progress_mut(&mut self) -> &mut AdamProgress {
        &mut self.progress
    }

    /// Restores the state saved by [`CompactAdam::state_tensors`] and the step count.
    fn load_state(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
        steps: u64,
    ) -> std::result::Result<(), String> {
        self.load_moments(names, tensors)?;
        self.progress.restore(steps);
        Ok(())
    }
}

fn poisoned() -> crate::Error {
    crate::Error::internal("a host moment buffer's lock was poisoned by a panic")
}

#[cfg(feature = "cuda")]
fn cuda_update(
    var: &Var,
    g: &Tensor,
    s: &DeviceState,
    maps: Option<&(Tensor, Tensor)>,
    layout: StateLayout,
    consts: &AdamConsts,
    seed: u64,
) -> Result<()> {
    use crate::ops::compact_adam::{update_cuda, DeviceState as Bufs};
    // The maps are read only with 8-bit moments; any f32 tensor stands in otherwise.
    let (q1, q2) = match maps {
        Some((a, b)) => (a, b),
        None => (&s.m, &s.v),
    };
    let w = var.as_tensor().flatten_all()?;
    update_cuda(
        &w,
        &g.flatten_all()?,
        Bufs {
            m: &s.m,
            v: &s.v,
            scales: s.scales.as_ref().map(|(a, b)| (a, b)),
            comp: s.comp.as_ref(),
        },
        (q1, q2),
        layout,
        consts,
        seed,
    )?;
    Ok(())
}

/// `g` as the kernel takes it: the weights' dtype or f32 as it comes (an f32 sum is not
/// rounded into a second, half-precision copy), contiguous.
#[cfg(feature = "cuda")]
pub(super) fn kernel_gradient(g: &Tensor, var: &Var) -> Result<Tensor> {
    let g = if g.dtype() == var.dtype() || g.dtype() == DType::F32 {
        g.clone()
    } else {
        g.to_dtype(var.dtype())?
    };
    Ok(g.contiguous()?)
}

/// The update of one matrix on the CPU, in place on its weights.
struct CpuUpdate<'a> {
    state: RefCell<&'a mut Box<CpuState>>,
    grad: Vec<f32>,
    masters: MasterFormat,
    consts: &'a AdamConsts,
    maps: &'a Maps,
    seed: u64,
}

impl CpuUpdate<'_> {
    fn run<W: Weight>(&self, w: &mut [W]) -> candle_core::Result<()> {
        let mut state = self.state.borrow_mut();
        let CpuState { moments, comp } = &mut ***state;
        let moments = match moments {
            CpuMoments::F32(m, v) => MomentsMut::F32(m, v),
            CpuMoments::Bf16(m, v) => MomentsMut::Bf16(m, v),
            CpuMoments::Int8 {
                m,
                v,
                m_scale,
                v_scale,
            } => MomentsMut::Int8 {
                m,
                v,
                m_scale,
                v_scale,
            },
        };
        cpu::update(
            w,
            &self.grad,
            moments,
            comp.as_deref_mut(),
            self.masters,
            self.consts,
            self.maps,
            self.seed,
        );
        Ok(())
    }
}

impl InplaceOp1 for CpuUpdate<'_> {
    fn name(&self) -> &'static str {
        "compact-adam"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("compact-adam: the weights must be contiguous");
        };
        if end - start != self.grad.len() {
            candle_core::bail!(
                "compact-adam: {} gradients for {} weights",
                self.grad.len(),
                end - start
            );
        }
        match storage {
            CpuStorage::F32(v) => self.run(&mut v[start..end]),
            CpuStorage::BF16(v) => self.run(&mut v[start..end]),
            _ => candle_core::bail!("compact-adam: weights must be f32 or bf16"),
        }
    }
}
