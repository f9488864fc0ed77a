//! Training data: synthetic token streams or a file, cut into batches deterministically.
//!
//! Batch `(step, micro)` is a pure function of the run seed and its coordinates, so a resumed
//! run sees exactly the batches an uninterrupted run would have seen.

use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::model::batch::Batch;
use crate::model::dropout::Dropout;
use crate::spec::model::ModelSpec;
use crate::{Error, Result};

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "path")]
pub enum DataSpec {
    /// Uniform random tokens with random targets (the seed workload: nothing to learn).
    Random,
    /// Arithmetic sequences `t, t+k, t+2k, …` modulo the vocabulary, random `t` and small `k`:
    /// learnable structure with no file needed.
    Pattern,
    /// Raw bytes of a text file, one token per byte (vocabulary ≥ 256).
    Text(PathBuf),
    /// A flat file of little-endian u16 token ids (the common `.bin` layout).
    TokensU16(PathBuf),
    /// A flat file of little-endian u32 token ids.
    TokensU32(PathBuf),
}

impl DataSpec {
    /// Parses `random`, `pattern`, or a path; the path's extension picks the format
    /// (`.bin`/`.u16` → u16 tokens, `.u32` → u32 tokens, anything else → text bytes).
    pub fn parse(s: &str) -> Self {
        match s {
            "random" | "synthetic" => DataSpec::Random,
            "pattern" => DataSpec::Pattern,
            path => {
                let p = PathBuf::from(path);
                match p.extension().and_then(|e| e.to_str()) {
                    Some("bin") | Some("u16") => DataSpec::TokensU16(p),
                    Some("u32") => DataSpec::TokensU32(p),
                    _ => DataSpec::Text(p),
                }
            }
        }
    }
}

impl fmt::Display for DataSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSpec::Random => f.write_str("random"),
            DataSpec::Pattern => f.write_str("pattern"),
            DataSpec::Text(p) | DataSpec::TokensU16(p) | DataSpec::TokensU32(p) => {
                write!(f, "{}", p.display())
            }
        }
    }
}

/// An opened data source.
pub struct Data {
    spec: DataSpec,
    vocab: usize,
    seq_len: usize,
    tokens: Option<Vec<u32>>,
}

impl Data {
    /// Opens `spec` for `model`, checking that the data can feed it.
    pub fn open(spec: &DataSpec, model: &ModelSpec) -> Result<Self> {
        let name = spec.to_string();
        let data_err = |problem: String| Error::Data {
            source_name: name.clone(),
            problem,
        };
        let tokens = match spec {
            DataSpec::Random | DataSpec::Pattern => None,
            DataSpec::Text(path) => {
                if model.vocab_size < 256 {
                    return Err(data_err(format!(
                        "text is read as bytes (256 symbols) but the model's vocab_size is {}",
                        model.vocab_size
                    )));
                }
                Some(read(path)?.into_iter().map(u32::from).collect())
            }
            DataSpec::TokensU16(path) => Some(decode(path, 2)?),
            DataSpec::TokensU32(path) => Some(decode(path, 4)?),
        };
        if let Some(tokens) = &tokens {
            if tokens.len() < model.seq_len + 1 {
                return Err(data_err(format!(
                    "holds {} tokens; one sequence needs seq_len + 1 = {}",
                    tokens.len(),
                    model.seq_len + 1
                )));
            }
            if let Some(&max) = tokens.iter().max() {
                if max as usize >= model.vocab_size {
                    return Err(data_err(format!(
                        "contains token id {max}, outside the model's vocab_size {}; check the token width or vocab_size",
                        model.vocab_size
                    )));
                }
            }
        }
        Ok(Self {
            spec: spec.clone(),
            vocab: model.vocab_size,
            seq_len: model.seq_len,
            tokens,
        })
    }

    /// Number of tokens in a file source (`None` for synthetic sources, which never run out).
    pub fn len(&self) -> Option<usize> {
        self.tokens.as_ref().map(Vec::len)
    }

    /// Whether a file source holds no tokens (never true once opened).
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// The micro-batch at `(step, micro)` of a run seeded with `seed`.
    pub fn batch(
        &self,
        seed: u64,
        step: u64,
        micro: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Batch> {
        let mut rng = ChaCha8Rng::seed_from_u64(Dropout::key(seed ^ 0xDA7A, step, micro));
        let s = self.seq_len;
        let mut inputs = Vec::with_capacity(batch * s);
        let mut targets = Vec::with_capacity(batch * s);
        for _ in 0..batch {
            match (&self.spec, &self.tokens) {
                (DataSpec::Random, _) => {
                    inputs.extend((0..s).map(|_| rng.random_range(0..self.vocab as u32)));
                    targets.extend((0..s).map(|_| rng.random_range(0..self.vocab as u32)));
                }
                (_, Some(tokens)) => {
                    let start = rng.random_range(0..tokens.len() - s);
                    inputs.extend_from_slice(&tokens[start..start + s]);
                    targets.extend_from_slice(&tokens[start + 1..start + s + 1]);
                }
                (_, None) => {
                    let v = self.vocab as u64;
                    let first = rng.random_range(0..v);
                    let stride = rng.random_range(1..=v.min(4));
                    let at = |i: usize| ((first + stride * i as u64) % v) as u32;
                    inputs.extend((0..s).map(at));
                    targets.extend((1..=s).map(at));
                }
            }
        }
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, (batch, s), device)?,
            targets: Tensor::from_vec(targets, batch * s, device)?,
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::file("cannot read training data", path, e))
}

fn decode(path: &Path, width: usize) -> Result<Vec<u32>> {
    let bytes = read(path)?;
    if bytes.len() % width != 0 {
        return Err(Error::Data {
            source_name: path.display().to_string(),
            problem: format!(
                "size {} is not a multiple of {width} bytes per token; is the token width right?",
                bytes.len()
            ),
        });
    }
    Ok(bytes
        .chunks_exact(width)
        .map(|c| {
            if width == 2 {
                u16::from_le_bytes([c[0], c[1]]) as u32
            } else {
                u32::from_le_bytes([c[0], c[1], c[2], c[3]])
            }
        })
        .collect())
}
