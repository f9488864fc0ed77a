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

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};

use super::AdamProgress;
use crate::knobs::{MasterFormat, MomentFormat, MomentPlace, StateLayout};
use crate::ops::compact_adam::cpu::{self, Maps, MomentsMut, Weight};
use crate::ops::compact_adam::{quantile, rounding_seed};
use crate::ops::host_optim::AdamConsts;
use crate::ops::transfer::Link;
use crate::spec::model::OptimizerSpec;
use crate::spec::state::Components;
use crate::Result;

/// Adam over a compact layout.
pub struct CompactAdam {
    pub(super) progress: AdamProgress,
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
mod state;

use state::{moment_sizes, CpuMoments, CpuState, ParamState, SavedParam};

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
    pub(super) fn load_moments(
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

#[cfg(feature = "cuda")]
fn cuda_update(
    var: &Var,
    g: &Tensor,
    s: &state::DeviceState,
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
