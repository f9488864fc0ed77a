//! Dropout masks that are a pure function of (run seed, step, micro-batch, call order).
//!
//! candle's CPU RNG cannot be seeded, so `candle_nn::ops::dropout` would make CPU runs
//! irreproducible and a resumed run would diverge from an uninterrupted one. Here each
//! micro-batch gets its own stream: on the CPU a ChaCha generator, on a GPU the device's
//! generator reseeded with the same derived seed, so masks never depend on what ran before.

use std::cell::RefCell;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Result;

/// A source of dropout masks for one forward pass; `None` disables dropout (evaluation).
pub struct Dropout {
    p: f32,
    stream: Option<RefCell<Stream>>,
}

enum Stream {
    Host(ChaCha8Rng),
    Device,
}

impl Dropout {
    /// Dropout off.
    pub fn disabled() -> Self {
        Self {
            p: 0.0,
            stream: None,
        }
    }

    /// Dropout with probability `p` for the micro-batch identified by `key`.
    pub fn new(p: f32, device: &Device, key: u64) -> Result<Self> {
        if p == 0.0 {
            return Ok(Self::disabled());
        }
        let stream = if device.is_cpu() {
            Stream::Host(ChaCha8Rng::seed_from_u64(key))
        } else {
            device.set_seed(key)?;
            Stream::Device
        };
        Ok(Self {
            p,
            stream: Some(RefCell::new(stream)),
        })
    }

    /// Derives a per-micro-batch key from its coordinates (SplitMix64 finaliser).
    pub fn key(seed: u64, step: u64, micro: u64) -> u64 {
        let mut z = seed
            ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ micro.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Zeroes each element of `x` with probability p and scales the rest by 1/(1−p).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let Some(stream) = &self.stream else {
            return Ok(x.clone());
        };
        let keep = 1.0 - self.p;
        let mask = match &mut *stream.borrow_mut() {
            Stream::Host(rng) => {
                let scale = 1.0 / keep;
                let values: Vec<f32> = (0..x.elem_count())
                    .map(|_| {
                        if rng.random::<f32>() < keep {
                            scale
                        } else {
                            0.0
                        }
                    })
                    .collect();
                Tensor::from_vec(values, x.shape(), x.device())?.to_dtype(x.dtype())?
            }
            Stream::Device => {
                let uniform = Tensor::rand(0f32, 1f32, x.shape(), x.device())?;
                (uniform.lt(keep as f64)?.to_dtype(x.dtype())? * (1.0 / keep as f64))?
            }
        };
        Ok(x.mul(&mask)?)
    }
}
