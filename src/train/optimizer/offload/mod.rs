//! Optimizer offload (ZeRO-Offload style): f32 master weights and Adam moments in host memory.
//!
//! The device holds only working copies of the parameters (matrices in the compute dtype,
//! vectors in f32, see [`crate::model::params::working_dtype`]), which the forward pass uses as
//! they are. Two ways to step:
//!
//! - **Streamed** ([`stream`]), when one micro-batch's gradients are the update's (no
//!   accumulation, no loss scale to check, no clipping, one GPU): each part of the model goes
//!   to the host as soon as the backward pass settles it, and is updated and uploaded there
//!   while the device runs the parts before it. Host state: masters and moments, 12 bytes per
//!   parameter, plus page-locked buffers for a few parts in flight.
//! - **Summed**: per micro-batch each gradient is copied to the host and summed in f32 there,
//!   so accumulation costs no device memory and loses no precision; the Adam update then runs
//!   on the host over flat buffers with every core ([`crate::ops::host_optim`]), writing the
//!   new half-precision working copies in the same pass, and those are uploaded. The sums and
//!   the staged copies (6 bytes per parameter more) are allocated by the first summed step.
//!
//! On a CPU device the placement changes nothing, but the same code runs, so tests cover it.
//! All host state is ordinary heap memory, which the trials' counting allocator measures.

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;

use candle_core::backend::BackendDevice;
use candle_core::cpu_backend::CpuDevice;
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor, Var};

use super::AdamProgress;
use crate::knobs::{Knobs, Offload};
use crate::ops::host_optim::{self, HostState};
use crate::spec::model::{ModelSpec, OptimizerSpec};
use crate::spec::state::offload_streams;
use crate::train::tensor_file::{self, Entry};
use crate::Result;

pub mod stream;

/// Adam / AdamW whose masters, moments and gradient sums live in host memory.
pub struct OffloadAdam {
    pub(in crate::train::optimizer) progress: AdamProgress,
    /// Device working copies, updated after every applied step.
    vars: Vec<Var>,
    /// Each parameter's span in the flat buffers.
    ranges: Vec<Range<usize>>,
    master: Vec<f32>,
    first: Vec<f32>,
    second: Vec<f32>,
    /// f32 gradient sums of a summed step, like `master`; empty until the first.
    grads: Vec<f32>,
    /// The half-precision dtype of the working copies that are not f32, if any.
    half: Option<DType>,
    /// Half-precision working copies laid out like `master`, for a summed step's upload (f32
    /// ones upload straight from `master`); allocated by the first.
    staging: Option<CpuStorage>,
    /// The streamed step's host buffers, allocated by the first.
    transfers: Option<stream::Transfers>,
    threads: usize,
}

impl OffloadAdam {
    /// Zero moments for the working copies `vars` whose f32 masters are `master` (flat, in
    /// `vars` order).
    pub fn new(vars: &[Var], master: Vec<f32>, spec: OptimizerSpec) -> Result<Self> {
        let mut ranges = Vec::with_capacity(vars.len());
        let mut end = 0;
        for v in vars {
            ranges.push(end..end + v.elem_count());
            end += v.elem_count();
        }
        if end != master.len() {
            return Err(crate::Error::internal(format!(
                "{} master values for {end} parameters",
                master.len()
            )));
        }
        let half: Vec<DType> = vars
            .iter()
            .map(|v| v.dtype())
            .filter(|&d| d != DType::F32)
            .collect();
        if let Some(&dtype) = half.first() {
            if half.iter().any(|&d| d != dtype) {
                return Err(crate::Error::internal(format!(
                    "working copies mix {half:?}"
                )));
            }
        }
        let threads = crate::parallel::default_threads();
        let state = Self {
            progress: AdamProgress::new(spec),
            vars: vars.to_vec(),
            ranges,
            first: crate::parallel::touched_zeros(end, threads),
            second: crate::parallel::touched_zeros(end, threads),
            grads: Vec::new(),
            half: half.first().copied(),
            master,
            staging: None,
            transfers: None,
            threads,
        };
        Ok(state)
    }

    /// The staged working copies, allocated on first use.
    fn staging(&mut self) -> Result<Option<&mut CpuStorage>> {
        if let (None, Some(dtype)) = (&self.staging, self.half) {
            self.staging = Some(CpuDevice.zeros_impl(&Shape::from(self.master.len()), dtype)?);
        }
        Ok(self.staging.as_mut())
    }

    /// The gradient sums, allocated (zero) on first use.
    fn sums(&mut self) -> &mut Vec<f32> {
        if self.grads.len() != self.master.len() {
            self.grads = vec![0.0; self.master.len()];
        }
        &mut self.grads
    }

    /// Adds parameter `index`'s gradient of one micro-batch (any float dtype, any device) to
    /// the host sum; `first` starts a new sum.
    pub fn accumulate(&mut self, index: usize, grad: &Tensor, first: bool) -> Result<()> {
        // One device-to-host copy per gradient; on the CPU this is the tensor itself.
        let host = grad.to_device(&Device::Cpu)?.contiguous()?;
        let (storage, layout) = host.storage_and_layout();
        let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets())
        else {
            return Err(crate::Error::internal(format!(
                "gradient {index} did not arrive as a contiguous host tensor"
            )));
        };
        let range = self.ranges[index].clone();
        let t = self.threads;
        let dst = &mut self.sums()[range];
        match cpu {
            CpuStorage::F32(v) => host_optim::accumulate(dst, &v[start..end], first, t),
            CpuStorage::BF16(v) => host_optim::accumulate(dst, &v[start..end], first, t),
            CpuStorage::F16(v) => host_optim::accumulate(dst, &v[start..end], first, t),
            _ => {
                return Err(crate::Error::internal(format!(
                    "gradient {index} has dtype {:?}",
                    grad.dtype()
                )))
            }
        }
        Ok(())
    }

    /// The gradient sums, flat in parameter order: data-parallel ranks add theirs together
    /// here before the update.
    pub fn gradient_sums_mut(&mut self) -> &mut [f32] {
        self.sums()
    }

    /// Divides the summed gradients by the loss scale and reports whether all are finite.
    pub fn unscale_and_check(&mut self, scale: f64) -> bool {
        let inv = (scale != 1.0).then_some((1.0 / scale) as f32);
        host_optim::unscale_and_check(&mut self.grads, inv, self.threads)
    }

    /// Host bytes by component: the f32 masters and the staged half-precision copies, the
    /// moments, the f32 gradient sums.
    pub fn host_bytes(&self) -> autotune_core::spec::state::Components {
        let f32_bytes = |v: &Vec<f32>| (v.len() * std::mem::size_of::<f32>()) as u64;
        let staged = match &self.staging {
            Some(CpuStorage::BF16(v)) => (v.len() * 2) as u64,
            Some(CpuStorage::F16(v)) => (v.len() * 2) as u64,
            _ => 0,
        };
        autotune_core::spec::state::Components {
            weights: f32_bytes(&self.master) + staged,
            moments: f32_bytes(&self.first) + f32_bytes(&self.second),
            gradients: f32_bytes(&self.grads),
        }
    }

    /// Clips the summed gradients to the global L2 norm `max`; returns the norm before.
    pub fn clip_global_norm(&mut self, max: f64) -> f64 {
        host_optim::clip_global_norm(&mut self.grads, max, self.threads)
    }

    /// Applies one update with the summed gradients and uploads the new working copies.
    pub fn step(&mut self) -> Result<()> {
        let c = self.progress.begin_step();
        self.sums();
        self.staging()?;
        let state = HostState {
            master: &mut self.master,
            first: &mut self.first,
            second: &mut self.second,
            grads: &self.grads,
        };
        let t = self.threads;
        match &mut self.staging {
            None => host_optim::adam_step::<f32, f32>(&c, state, None, t),
            Some(CpuStorage::BF16(w)) => host_optim::adam_step(&c, state, Some(w), t),
            Some(CpuStorage::F16(w)) => host_optim::adam_step(&c, state, Some(w), t),
            Some(_) => {
                return Err(crate::Error::internal(
                    "working copies must be f32, bf16 or f16".to_string(),
                ))
            }
        }
        self.upload()
    }

    /// Copies every working copy to its device `Var` from the host buffers.
    fn upload(&self) -> Result<()> {
        for (var, r) in self.vars.iter().zip(&self.ranges) {
            let (dims, dev) = (var.dims(), var.device());
            let t = match (&self.staging, var.dtype()) {
                (_, DType::F32) => Tensor::from_slice(&self.master[r.clone()], dims, dev)?,
                (Some(CpuStorage::BF16(w)), _) => Tensor::from_slice(&w[r.clone()], dims, dev)?,
                (Some(CpuStorage::F16(w)), _) => Tensor::from_slice(&w[r.clone()], dims, dev)?,
                (_, dtype) => {
                    return Err(crate::Error::internal(format!(
                        "no host staging for a {dtype:?} working copy"
                    )))
                }
            };
            var.set(&t)?;
        }
        Ok(())
    }

    /// Uploads every working copy made afresh from the masters, one tensor at a time (no
    /// model-sized staging: a resumed streamed run never needs one).
    fn refresh_working(&mut self) -> Result<()> {
        let t = self.threads;
        for (var, r) in self.vars.iter().zip(&self.ranges) {
            let master = &self.master[r.clone()];
            let (dims, dev) = (var.dims(), var.device());
            let working = match var.dtype() {
                DType::F32 => Tensor::from_slice(master, dims, dev)?,
                DType::BF16 => {
                    let mut w = vec![half::bf16::ZERO; r.len()];
                    host_optim::fill_working(master, &mut w, t);
                    Tensor::from_vec(w, dims, dev)?
                }
                DType::F16 => {
                    let mut w = vec![half::f16::ZERO; r.len()];
                    host_optim::fill_working(master, &mut w, t);
                    Tensor::from_vec(w, dims, dev)?
                }
                dtype => {
                    return Err(crate::Error::internal(format!(
                        "no working copy of dtype {dtype:?}"
                    )))
                }
            };
            var.set(&working)?;
        }
        Ok(())
    }

    /// Copies of the f32 masters as host tensors, in parameter order.
    pub fn master_tensors(&self) -> Result<Vec<Tensor>> {
        self.vars
            .iter()
            .zip(&self.ranges)
            .map(|(v, r)| {
                Ok(Tensor::from_slice(
                    &self.master[r.clone()],
                    v.dims(),
                    &Device::Cpu,
                )?)
            })
            .collect()
    }

    /// Streams the f32 masters, named `names`, as a safetensors file to `out`.
    pub fn write_masters<W: Write>(&self, out: W, names: &[String]) -> std::io::Result<()> {
        let entries: Vec<Entry<'_>> = names
            .iter()
            .zip(self.vars.iter().zip(&self.ranges))
            .map(|(name, (v, r))| Entry {
                name,
                shape: v.dims(),
                values: &self.master[r.clone()],
            })
            .collect();
        tensor_file::write_f32(out, &entries)
    }

    /// What a save's streaming takes in host memory, without its time: the masters of the
    /// largest parameter alone, to `out`. A save writes every tensor through the same bounded
    /// staging buffer, so its peak is this one's; streaming all 12 bytes per parameter took
    /// 7.6 s of a gpt-1.3b trial.
    pub fn write_largest_master<W: Write>(&self, out: W, names: &[String]) -> std::io::Result<()> {
        let largest = names
            .iter()
            .zip(self.vars.iter().zip(&self.ranges))
            .max_by_key(|(_, (_, r))| r.len());
        let entries: Vec<Entry<'_>> = largest
            .into_iter()
            .map(|(name, (v, r))| Entry {
                name,
                shape: v.dims(),
                values: &self.master[r.clone()],
            })
            .collect();
        tensor_file::write_f32(out, &entries)
    }

    /// Streams the moments (`m.<name>`, `v.<name>`) as a safetensors file to `out`.
    pub fn write_moments<W: Write>(&self, out: W, names: &[String]) -> std::io::Result<()> {
        let keys: Vec<(String, String)> = names
            .iter()
            .map(|n| (format!("m.{n}"), format!("v.{n}")))
            .collect();
        let mut entries = Vec::with_capacity(2 * names.len());
        for ((m, v), (var, r)) in keys.iter().zip(self.vars.iter().zip(&self.ranges)) {
            entries.push(Entry {
                name: m,
                shape: var.dims(),
                values: &self.first[r.clone()],
            });
            entries.push(Entry {
                name: v,
                shape: var.dims(),
                values: &self.second[r.clone()],
            });
        }
        tensor_file::write_f32(out, &entries)
    }

    /// Overwrites the masters from `tensors` (keyed by `names`) and refreshes the working copies.
    pub fn load_masters(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        self.load_masters_with(names, &mut |name| {
            tensors
                .get(name)
                .cloned()
                .ok_or_else(|| format!("parameter `{name}` is missing"))
        })
    }

    /// [`OffloadAdam::load_masters`] one parameter at a time from `get`.
    pub fn load_masters_with(
        &mut self,
        names: &[String],
        get: &mut dyn FnMut(&str) -> std::result::Result<Tensor, String>,
    ) -> std::result::Result<(), String> {
        for (i, name) in names.iter().enumerate() {
            let r = self.ranges[i].clone();
            let t = get(name)?;
            copy_tensor_into(
                &mut self.master[r],
                self.vars[i].dims(),
                &t,
                name,
                "parameter",
            )?;
        }
        self.refresh_working().map_err(|e| e.to_string())
    }
}

impl OffloadAdam {
    /// Restores the moments from a checkpoint's tensors (`m.<name>`, `v.<name>`).
    pub(in crate::train::optimizer) fn load_moments(
        &mut self,
        names: &[String],
        tensors: &HashMap<String, Tensor>,
    ) -> std::result::Result<(), String> {
        for (i, name) in names.iter().enumerate() {
            let (r, dims) = (self.ranges[i].clone(), self.vars[i].dims());
            let what = "optimizer state";
            copy_into(
                &mut self.first[r.clone()],
                dims,
                tensors,
                &format!("m.{name}"),
                what,
            )?;
            copy_into(
                &mut self.second[r],
                dims,
                tensors,
                &format!("v.{name}"),
                what,
            )?;
        }
        Ok(())
    }
}

/// Copies tensor `key` of `tensors` (any float dtype) into `dst`, checking its shape.
fn copy_into(
    dst: &mut [f32],
    dims: &[usize],
    tensors: &HashMap<String, Tensor>,
    key: &str,
    what: &str,
) -> std::result::Result<(), String> {
    let t = tensors
        .get(key)
        .ok_or_else(|| format!("{what} `{key}` is missing"))?;
    copy_tensor_into(dst, dims, t, key, what)
}

fn copy_tensor_into(
    dst: &mut [f32],
    dims: &[usize],
    t: &Tensor,
    key: &str,
    what: &str,
) -> std::result::Result<(), String> {
    if t.dims() != dims {
        return Err(format!(
            "{what} `{key}` has shape {:?}, expected {dims:?}",
            t.dims()
        ));
    }
    let values = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| e.to_string())?;
    dst.copy_from_slice(&values);
    Ok(())
}

/// Host bytes a training run needs beyond the process's baseline when the model trains on a
/// GPU: the planner's cheap test for regimes that cannot fit a host budget.
///
/// With P parameters, L elements in the largest parameter tensor and b bytes per element of
/// the compute dtype (2 for bf16/f16, 4 for fp32):
///
/// - **`Offload::Optimizer`, streamed** ([`offload_streams`]). Allocated once: the f32 master (4 B)
///   and the moments (4 + 4 B), 12 B per parameter, and the step's host buffers, kept from
///   step to step (page-locked on a GPU): `DOWNLOAD_BUFFERS + UPLOAD_BUFFERS` of at most G
///   elements (the largest part, see `ModelSpec::parameter_groups`) at b bytes. Total
///   `12·P + (DOWNLOAD_BUFFERS + UPLOAD_BUFFERS)·G·b`.
/// - **`Offload::Optimizer`, summed.** Allocated once: the f32 master (4 B), first and second
///   moments (4 + 4 B) and the f32 gradient sum (4 B), i.e. 16 B per parameter; at bf16/f16
///   also the working-copy staging buffer (2 B per parameter; fp32 uploads straight from the
///   masters). During the step one gradient at a time is copied down (L·b B; uploads read the
///   staging directly). Total `P·(16 + s) + L·b`, s = 2 at bf16/f16 and 0 at fp32.
/// - Either way checkpoints stream through a 256 KiB buffer.
/// - **`Offload::None`.** The optimizer stays on the device; a checkpoint copies one tensor at a
///   time to the host and then into its byte image: `2·4·L`.
/// - **Both.** One step's token batches, inputs and targets as u32: `8 · global_batch · seq_len`.
/// - **Data parallel.** Every rank of the host holds its own offloaded state: the state term
///   counts `degree` times (the token term already counts all ranks' batches).
///
/// Not included: the process baseline (runtime, the driver's host allocations) and, on a CPU
/// device, the model, activations and gradients, which live in host memory there.
pub fn host_bytes_estimate(spec: &ModelSpec, knobs: &Knobs) -> u64 {
    let p = spec.parameter_count() as u64;
    let d = spec.d_model;
    let largest = [
        spec.vocab_size * d,
        spec.qkv_width() * d,
        d * spec.ff_in_width(),
        spec.seq_len * d,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    let b = crate::backend::compute_dtype(knobs.precision).size_in_bytes() as u64;
    let tokens = 8 * (knobs.global_batch() * spec.seq_len) as u64;
    let state = match knobs.offload {
        Offload::Optimizer if offload_streams(spec, knobs) => {
            let part = spec.parameter_groups().largest() as u64;
            let buffers = (stream::DOWNLOAD_BUFFERS + stream::UPLOAD_BUFFERS) as u64;
            12 * p + buffers * part * b + 256 * 1024
        }
        Offload::Optimizer => {
            let staging = if b < 4 { 2 } else { 0 };
            (p * (16 + staging) + largest * b + 256 * 1024) * knobs.data_parallel.degree as u64
        }
        Offload::None => 2 * 4 * largest,
    };
    state + tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knobs::Precision;

    #[test]
    fn offload_costs_eighteen_bytes_per_parameter_summed_and_twelve_streamed() {
        let spec = ModelSpec::preset("gpt-1.3b").expect("preset");
        let per_param = |knobs: &Knobs| {
            host_bytes_estimate(&spec, knobs) as f64 / spec.parameter_count() as f64
        };
        let on = Knobs {
            offload: Offload::Optimizer,
            ..Knobs::new(8, Precision::Bf16)
        };
        // Streamed: 12 bytes and five parts (the 105M-parameter embeddings the largest) in bf16.
        assert!((12.0..13.0).contains(&per_param(&on)), "{}", per_param(&on));
        let summed = Knobs {
            grad_accum: 2,
            ..on
        };
        assert!(
            (18.0..19.0).contains(&per_param(&summed)),
            "{}",
            per_param(&summed)
        );
        // fp32 sums need no staged half-precision copies.
        let fp32 = Knobs {
            precision: Precision::Fp32,
            ..summed
        };
        assert!(host_bytes_estimate(&spec, &fp32) < host_bytes_estimate(&spec, &summed));
        let off = Knobs::new(8, Precision::Bf16);
        assert!(host_bytes_estimate(&spec, &off) < host_bytes_estimate(&spec, &on) / 5);
    }
}
