//! Dropout masks that are a pure function of (run seed, step, micro-batch, block, call order).
//!
//! candle's CPU RNG cannot be seeded, so `candle_nn::ops::dropout` would make CPU runs
//! irreproducible and a resumed run would diverge from an uninterrupted one. Here each
//! micro-batch gets its own stream: on the CPU a ChaCha generator, on a GPU the device's
//! generator reseeded with the same derived seed, so masks never depend on what ran before.
//!
//! Each Transformer block draws from its own sub-stream ([`Dropout::sub_stream`]), keyed by the
//! micro-batch key and the block index. Activation checkpointing relies on this: a block that is
//! recomputed in the backward pass opens its sub-stream again and gets exactly the masks its
//! forward pass used, whatever ran in between.

use std::cell::RefCell;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::hash::{splitmix64, GOLDEN};
use crate::Result;

/// A source of dropout masks for one forward pass; `None` disables dropout (evaluation).
pub struct Dropout {
    p: f32,
    stream: Option<Enabled>,
}

/// An active stream and what is needed to derive sub-streams from it.
struct Enabled {
    key: u64,
    device: Device,
    rng: RefCell<Stream>,
}

enum Stream {
    // Boxed: the generator is 320 bytes, the other variants none.
    Host(Box<ChaCha8Rng>),
    Device,
    /// Masks come only from [`Dropout::mask`] (hashed inside the kernels); no generator.
    Hashed,
}

/// Mixed into sub-stream keys so that they never coincide with a micro-batch key.
const SUB_STREAM_TAG: u64 = 0xB10C_5EED;

/// Mixed into the keys of hashed masks ([`Dropout::mask`]).
const SITE_TAG: u64 = 0x517E_D0D0;

impl Dropout {
    /// Dropout off.
    pub fn disabled() -> Self {
        Self {
            p: 0.0,
            stream: None,
        }
    }

    /// Dropout with probability `p` for the micro-batch identified by `key`.
    ///
    /// On a GPU this reseeds the device's generator, so the stream must be opened right before
    /// its masks are drawn.
    pub fn new(p: f32, device: &Device, key: u64) -> Result<Self> {
        if p == 0.0 {
            return Ok(Self::disabled());
        }
        let rng = if device.is_cpu() {
            Stream::Host(Box::new(ChaCha8Rng::seed_from_u64(key)))
        } else {
            device.set_seed(key)?;
            Stream::Device
        };
        Ok(Self {
            p,
            stream: Some(Enabled {
                key,
                device: device.clone(),
                rng: RefCell::new(rng),
            }),
        })
    }

    /// An independent stream for part `index` of this pass (a Transformer block), opened afresh:
    /// calling it twice with the same index gives the same masks, on the CPU and on a GPU.
    pub fn sub_stream(&self, index: u64) -> Result<Self> {
        match &self.stream {
            None => Ok(Self::disabled()),
            Some(s) => {
                let key = Self::key(s.key, SUB_STREAM_TAG, index);
                if matches!(*s.rng.borrow(), Stream::Hashed) {
                    Ok(Self::hashed(self.p, &s.device, key))
                } else {
                    Self::new(self.p, &s.device, key)
                }
            }
        }
    }

    /// The hashed mask of dropout site `site` in part `part` of this pass (the explicit engine's
    /// masks: a pure function of the pass's key, the part and the site, drawn inside the
    /// kernels), or `None` when dropout is off.
    pub fn mask(&self, part: u64, site: u64) -> Option<crate::ops::DropoutMask> {
        let stream = self.stream.as_ref()?;
        let block = Self::key(stream.key, SUB_STREAM_TAG, part);
        Some(crate::ops::DropoutMask {
            p: self.p,
            key: Self::key(block, SITE_TAG, site),
        })
    }

    /// A stream with probability `p` keyed by `key` whose only use is [`Dropout::mask`]: unlike
    /// [`Dropout::new`] it touches no device generator.
    pub fn hashed(p: f32, device: &Device, key: u64) -> Self {
        if p == 0.0 {
            return Self::disabled();
        }
        Self {
            p,
            stream: Some(Enabled {
                key,
                device: device.clone(),
                rng: RefCell::new(Stream::Hashed),
            }),
        }
    }

    /// Derives a per-micro-batch key from its coordinates (SplitMix64 finaliser).
    pub fn key(seed: u64, step: u64, micro: u64) -> u64 {
        splitmix64(seed ^ step.wrapping_mul(GOLDEN) ^ micro.wrapping_mul(0xBF58_476D_1CE4_E5B9))
    }

    /// Zeroes each element of `x` with probability p and scales the rest by 1/(1−p).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let Some(stream) = &self.stream else {
            return Ok(x.clone());
        };
        let keep = 1.0 - self.p;
        let mask = match &mut *stream.rng.borrow_mut() {
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
            Stream::Hashed => {
                return Err(crate::Error::internal(
                    "a hashed dropout stream draws its masks through Dropout::mask",
                ))
            }
        };
        Ok(x.mul(&mask)?)
    }
}
