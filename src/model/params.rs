//! `ParamStore`: the model's trainable parameters, named and in a fixed order.
//!
//! Order matters: the optimizer state and checkpoints are aligned with it, and a fixed order
//! makes runs reproducible. Initial values come from a seeded host RNG, so the same seed gives
//! the same model on the CPU and on the GPU, wherever its master weights live.
//!
//! By default the store's `Var`s *are* the f32 master weights. With host masters (optimizer
//! offload) the store also fills one flat f32 buffer in host memory with every parameter's initial
//! value, in order, and the `Var`s become device working copies: matrices in the compute dtype,
//! vectors in f32 (see [`working_dtype`]).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::hash::{splitmix64, GOLDEN};
use crate::ops::transfer::{self, HostBuffer, Link};
use crate::Result;

/// How a parameter is initialised (PyTorch's defaults for each layer kind).
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// All ones (layer norm scale).
    Ones,
    /// All zeros (biases that PyTorch zeroes).
    Zeros,
    /// Normal with mean 0 and this standard deviation.
    Normal(f32),
    /// Uniform in ±bound.
    Uniform(f32),
}

/// The dtype of a parameter's device working copy when its f32 master lives in host memory.
///
/// Matrices (linear weights, embeddings) run in the compute dtype, so storing them in it halves
/// their device memory at bf16/f16 and makes the per-use cast a no-op. Vectors (biases, norm
/// scales and shifts) stay f32: norms compute in f32, and vectors are a negligible share of the
/// parameters.
pub fn working_dtype(shape: &[usize], compute: DType) -> DType {
    if shape.len() >= 2 {
        compute
    } else {
        DType::F32
    }
}

/// Where initial values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InitValues {
    /// Drawn on the host from the seed: the same model on every device, for training.
    #[default]
    Seeded,
    /// Drawn by the device's own generator from the same distributions, for trials, whose
    /// memory and speed depend on shapes and dtypes, not on values: on a GPU this skips
    /// drawing every value on the host and copying it over (0.4 s of each gpt-124m trial).
    /// Stores with host masters download what the device drew: one copy of 4 bytes per
    /// parameter instead of a single-threaded draw (10 s for gpt-1.3b).
    OnDevice,
}

/// Named trainable parameters, in creation order.
pub struct ParamStore {
    device: Device,
    rng: ChaCha8Rng,
    names: Vec<String>,
    vars: Vec<Var>,
    host: Option<HostMasters>,
    /// With half-precision masters: the compute dtype the matrices are created in (the
    /// `Var`s are the masters, and there is no f32 copy anywhere).
    working: Option<DType>,
    values: InitValues,
}

/// f32 master values kept in host memory while the `Var`s are working copies.
struct HostMasters {
    compute: DType,
    values: Vec<f32>,
    /// Device-drawn values come down through a page-locked buffer into `values`, which is
    /// mapped to its full capacity first; this counts the values written.
    downloaded: Option<Download>,
}

/// The state of device-drawn masters' download (see [`HostMasters::download`]).
struct Download {
    link: Link,
    staging: HostBuffer,
    filled: usize,
}

impl HostMasters {
    /// Appends the values of the f32 device tensor `drawn`.
    ///
    /// One parameter at a time through a page-locked buffer (a DMA copy at the link's speed)
    /// and copied on every core into a master buffer whose pages were mapped up front, also on
    /// every core: building gpt-2b's 2.1G masters one pageable `to_vec1` at a time, each into
    /// freshly faulted pages, took 15 s of every offloaded trial.
    fn download(&mut self, drawn: &Tensor) -> Result<()> {
        let threads = crate::parallel::default_threads();
        if self.downloaded.is_none() {
            let link = Link::new(drawn.device())?;
            self.values = crate::parallel::touched_zeros(self.values.capacity(), threads);
            self.downloaded = Some(Download {
                staging: HostBuffer::new(&link),
                link,
                filled: 0,
            });
        }
        let Some(d) = self.downloaded.as_mut() else {
            return Err(crate::Error::internal("master download state"));
        };
        let n = drawn.elem_count();
        if d.filled + n > self.values.len() {
            // More parameters than the capacity foresaw: grow, unfaulted.
            self.values.resize(d.filled + n, 0.0);
        }
        d.staging.reserve(n * 4)?;
        d.staging.download(&d.link, &[(0, drawn)])?;
        let bytes = d.staging.bytes()?;
        let src: &[f32] = transfer::typed(&bytes[..n * 4])?;
        crate::parallel::copy_parallel(&mut self.values[d.filled..d.filled + n], src, threads);
        d.filled += n;
        Ok(())
    }

    /// The masters written so far.
    fn into_values(mut self) -> Vec<f32> {
        if let Some(d) = &self.downloaded {
            self.values.truncate(d.filled);
        }
        self.values
    }
}

impl ParamStore {
    /// An empty store whose initial values derive from `seed`; its `Var`s are f32 masters.
    pub fn new(device: &Device, seed: u64) -> Self {
        Self {
            device: device.clone(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            names: Vec::new(),
            vars: Vec::new(),
            host: None,
            working: None,
            values: InitValues::Seeded,
        }
    }

    /// An empty store whose `Var`s are created in [`working_dtype`]`(shape, compute)` and are
    /// the masters themselves (bf16 masters of a compact state layout).
    pub fn with_working_masters(device: &Device, seed: u64, compute: DType) -> Self {
        Self {
            working: Some(compute),
            ..Self::new(device, seed)
        }
    }

    /// This store, with initial values from `values`.
    pub fn with_values(self, values: InitValues) -> Self {
        Self { values, ..self }
    }

    /// An empty store that keeps f32 masters in host memory and creates device working copies
    /// in [`working_dtype`]`(shape, compute)`. `capacity` (total elements expected) sizes the
    /// host buffer once, so that building the model never holds two copies of it.
    pub fn with_host_masters(device: &Device, seed: u64, compute: DType, capacity: usize) -> Self {
        Self {
            host: Some(HostMasters {
                compute,
                values: Vec::with_capacity(capacity),
                downloaded: None,
            }),
            ..Self::new(device, seed)
        }
    }

    /// Creates a parameter of `shape` named `name`: an f32 master, or with host masters an f32
    /// host value plus a device working copy.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        if self.values == InitValues::OnDevice {
            let drawn = drawn_on(&self.device, shape, init)?;
            let working = match &mut self.host {
                None => match self.working {
                    Some(compute) => drawn.to_dtype(working_dtype(shape, compute))?,
                    None => drawn,
                },
                Some(host) => {
                    host.download(&drawn)?;
                    drawn.to_dtype(working_dtype(shape, host.compute))?
                }
            };
            let var = Var::from_tensor(&working)?;
            self.names.push(name.to_string());
            self.vars.push(var.clone());
            return Ok(var);
        }
        let n: usize = shape.iter().product();
        let values: Vec<f32> = match init {
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
            random => fill_random(random, n, self.rng.random::<u64>()),
        };
        let dtype = match &mut self.host {
            None => self
                .working
                .map_or(DType::F32, |compute| working_dtype(shape, compute)),
            Some(host) => {
                host.values.extend_from_slice(&values);
                working_dtype(shape, host.compute)
            }
        };
        let tensor = Tensor::from_vec(values, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(&self.device)?;
        let var = Var::from_tensor(&tensor)?;
        self.names.push(name.to_string());
        self.vars.push(var.clone());
        Ok(var)
    }

    /// Hands over the flat host master buffer (creation order), if this store keeps one.
    pub fn take_host_masters(&mut self) -> Option<Vec<f32>> {
        self.host.take().map(HostMasters::into_values)
    }

    /// The parameters in creation order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The parameter names in creation order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Total number of scalar parameters.
    pub fn element_count(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// The parameters as a name → tensor map (for safetensors); with host masters these are the
    /// working copies, not the masters.
    pub fn named_tensors(&self) -> HashMap<String, Tensor> {
        self.names
            .iter()
            .cloned()
            .zip(self.vars.iter().map(|v| v.as_tensor().clone()))
            .collect()
    }

    /// Overwrites every parameter from `tensors`; each must be present with the same shape. Values
    /// are cast to each parameter's dtype.
    pub fn load_from(&self, tensors: &HashMap<String, Tensor>) -> std::result::Result<(), String> {
        self.load_with(&mut |name| {
            tensors
                .get(name)
                .cloned()
                .ok_or_else(|| format!("parameter `{name}` is missing"))
        })
    }

    /// Overwrites every parameter, in order, with what `get` returns for its name (one tensor
    /// at a time: a source that reads from files never holds a second model). Each must have
    /// the parameter's shape; values are cast to its dtype and moved to its device.
    pub fn load_with(
        &self,
        get: &mut dyn FnMut(&str) -> std::result::Result<Tensor, String>,
    ) -> std::result::Result<(), String> {
        for (name, var) in self.names.iter().zip(&self.vars) {
            let t = get(name)?;
            if t.dims() != var.dims() {
                return Err(format!(
                    "parameter `{name}` has shape {:?}, the model wants {:?}",
                    t.dims(),
                    var.dims()
                ));
            }
            let t = t
                .to_dtype(var.dtype())
                .and_then(|t| t.to_device(var.device()))
                .map_err(|e| e.to_string())?;
            var.set(&t).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// An f32 tensor of `shape` on `device` with values of `init`, drawn by the device.
fn drawn_on(device: &Device, shape: &[usize], init: Init) -> Result<Tensor> {
    Ok(match init {
        Init::Ones => Tensor::ones(shape, DType::F32, device)?,
        Init::Zeros => Tensor::zeros(shape, DType::F32, device)?,
        Init::Normal(std) => Tensor::randn(0f32, std, shape, device)?,
        Init::Uniform(bound) => Tensor::rand(-bound, bound, shape, device)?,
    })
}

/// Elements drawn from one generator stream. Each chunk of a parameter has its own stream
/// (keyed by the parameter's key and the chunk's index), so chunks fill in parallel and the
/// values do not depend on how many threads there are.
const INIT_CHUNK: usize = 1 << 18;

/// `n` values of a random `init` for the parameter keyed `key`, filled on every core: every
/// probe builds a fresh model, and one stream would take seconds for a billion parameters.
fn fill_random(init: Init, n: usize, key: u64) -> Vec<f32> {
    fill_random_on(init, n, key, crate::parallel::default_threads())
}

/// [`fill_random`] over at most `threads` threads.
fn fill_random_on(init: Init, n: usize, key: u64, threads: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    let mut chunks: Vec<(usize, &mut [f32])> = out.chunks_mut(INIT_CHUNK).enumerate().collect();
    let threads = threads.min(chunks.len()).max(1);
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let fill = |group: &mut [(usize, &mut [f32])]| {
        for (index, chunk) in group.iter_mut() {
            let mut rng =
                ChaCha8Rng::seed_from_u64(splitmix64(key ^ (*index as u64).wrapping_mul(GOLDEN)));
            match init {
                Init::Uniform(bound) => chunk
                    .iter_mut()
                    .for_each(|v| *v = rng.random_range(-bound..=bound)),
                Init::Normal(std) => normals(&mut rng, chunk, std),
                Init::Ones | Init::Zeros => unreachable!("constant inits are not random"),
            }
        }
    };
    crate::parallel::run_parallel(chunks.chunks_mut(per_thread), fill);
    out
}

/// Fills `out` with samples of N(0, std²) by Box–Muller, exact enough for initialisation and
/// free of extra dependencies. Each pair of uniforms yields two samples (the cosine and the
/// sine branch).
fn normals(rng: &mut ChaCha8Rng, out: &mut [f32], std: f32) {
    for pair in out.chunks_mut(2) {
        let u1: f32 = rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = rng.random::<f32>();
        let radius = std * (-2.0 * u1.ln()).sqrt();
        let (sin, cos) = (2.0 * std::f32::consts::PI * u2).sin_cos();
        pair[0] = radius * cos;
        if let Some(second) = pair.get_mut(1) {
            *second = radius * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With host masters, values drawn on the device become the masters exactly, and the
    /// working copies are their casts: matrices in the compute dtype, vectors in f32.
    #[test]
    fn device_drawn_values_become_the_host_masters() {
        let mut store = ParamStore::with_host_masters(&Device::Cpu, 0, DType::BF16, 0)
            .with_values(InitValues::OnDevice);
        let w = store.param("w", &[40, 30], Init::Normal(0.02)).unwrap();
        let b = store.param("b", &[30], Init::Uniform(0.5)).unwrap();
        assert_eq!((w.dtype(), b.dtype()), (DType::BF16, DType::F32));
        let masters = store.take_host_masters().unwrap();
        assert_eq!(masters.len(), 40 * 30 + 30);
        let cast = Tensor::from_slice(&masters[..1200], (40, 30), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .unwrap();
        let working: Vec<f32> = w
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(cast, working);
        assert!(masters[..1200].iter().any(|&x| x != 0.0));
        assert_eq!(&masters[1200..], &b.to_vec1::<f32>().unwrap()[..]);
    }

    #[test]
    fn values_drawn_on_the_device_follow_the_same_distributions() {
        let mut store = ParamStore::new(&Device::Cpu, 0).with_values(InitValues::OnDevice);
        let shape = [300, 1001];
        let stats = |v: &Var| {
            let x: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
            let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
            let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            (mean, var.sqrt(), max)
        };
        let normal = store.param("n", &shape, Init::Normal(0.02)).unwrap();
        let (mean, std, _) = stats(&normal);
        assert!(
            mean.abs() < 2e-4 && (std - 0.02).abs() < 2e-4,
            "{mean} {std}"
        );
        let uniform = store.param("u", &shape, Init::Uniform(0.5)).unwrap();
        let (mean, std, max) = stats(&uniform);
        // Uniform on ±0.5: standard deviation 1/√12.
        assert!(
            mean.abs() < 5e-3 && (std - 0.5 / 3f64.sqrt()).abs() < 5e-3,
            "{mean} {std}"
        );
        assert!(max <= 0.5, "{max}");
        let ones = store.param("o", &[7], Init::Ones).unwrap();
        assert_eq!(stats(&ones), (1.0, 0.0, 1.0));
        assert_eq!(normal.dims(), shape);
        assert_eq!(normal.dtype(), DType::F32);
        assert_eq!(store.names(), ["n", "u", "o"]);
    }

    #[test]
    fn normal_init_has_the_requested_moments() {
        let x = fill_random(Init::Normal(0.02), 600_001, 3);
        assert_eq!(x.len(), 600_001);
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
    }

    #[test]
    fn initial_values_do_not_depend_on_the_thread_count() {
        let n = 3 * INIT_CHUNK + 17;
        for init in [Init::Normal(1.0), Init::Uniform(0.5)] {
            let one = fill_random_on(init, n, 11, 1);
            assert_eq!(one, fill_random_on(init, n, 11, 4));
            assert_ne!(
                one,
                fill_random_on(init, n, 12, 4),
                "keys give distinct streams"
            );
            // Chunks are distinct streams, not copies of one.
            assert_ne!(one[..64], one[INIT_CHUNK..INIT_CHUNK + 64]);
        }
    }
}
