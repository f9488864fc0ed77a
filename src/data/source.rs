//! Training data: synthetic token streams, a file of tokens, or a dataset of records made
//! examples by the model's tokenizer ([`super::load`]), cut into batches deterministically.
//!
//! Batch `(step, micro)` is a pure function of the run seed and its coordinates, so a resumed
//! run sees exactly the batches an uninterrupted run would have seen. Token files are
//! read a window at a time ([`TokenFile`]): a batch reads only the tokens it uses. Examples are walked in
//! seeded epochs and padded to the longest of each micro-batch, the padding and the untrained
//! tokens masked out of the loss ([`Dataset`]).

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::data::dataset::{Cut, Dataset};
use crate::data::format::{refusal, DataFormat, TextTokens};
use crate::data::load::{Loading, RecordsSpec};
use crate::data::loader::{Loader, StepBatches};
use crate::data::token_file::TokenFile;
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
    /// Record files (documents, JSON lines, JSON) tokenized by the model's tokenizer.
    Records(Box<RecordsSpec>),
}

impl DataSpec {
    /// Reads `--data`: `random`, `pattern`, or a path whose format ([`DataFormat`]) autotune
    /// reads as given: a token file (`.bin`/`.u16` → u16 ids, `.u32` → u32 ids), or text as
    /// raw bytes when `tokens` is [`TextTokens::Bytes`]. Every other file is refused with the
    /// fix, never read as bytes.
    pub fn resolve(s: &str, tokens: TextTokens) -> Result<Self> {
        let path = match s {
            "random" | "synthetic" => return Ok(DataSpec::Random),
            "pattern" => return Ok(DataSpec::Pattern),
            path => PathBuf::from(path),
        };
        if !path.exists() {
            let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
            return Err(Error::file("cannot read training data", &path, missing));
        }
        let format = DataFormat::of(&path);
        if let Some(problem) = refusal(&path, &format, tokens) {
            return Err(Error::Usage(problem));
        }
        Ok(match format {
            DataFormat::TokensU16 => DataSpec::TokensU16(path),
            DataFormat::TokensU32 => DataSpec::TokensU32(path),
            _ => DataSpec::Text(path),
        })
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
            DataSpec::Records(records) => {
                let files: Vec<String> = records
                    .files
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                f.write_str(&files.join(", "))
            }
        }
    }
}

/// An opened data source.
pub struct Data {
    spec: DataSpec,
    vocab: usize,
    seq_len: usize,
    tokens: Option<TokenFile>,
    /// A dataset's examples, and what cutting them to the sequence did.
    examples: Option<(Dataset, Cut)>,
    /// Examples held out of training for its evaluation.
    held_out: Option<Dataset>,
    /// The dataset's loader, made at the first step (once the walk's stride is set).
    loader: OnceLock<Loader>,
}

impl Data {
    /// Opens `spec` for `model`, checking that the data can feed it; a dataset of records is
    /// tokenized without a cache.
    pub fn open(spec: &DataSpec, model: &ModelSpec) -> Result<Self> {
        Self::open_with(spec, model, &Loading::quiet())
    }

    /// [`Data::open`], loading a dataset of records as `loading` says.
    pub fn open_with(spec: &DataSpec, model: &ModelSpec, loading: &Loading) -> Result<Self> {
        let need = model.seq_len + 1;
        let vocab = model.vocab_size;
        let (mut examples, mut held_out) = (None, None);
        let tokens = match spec {
            DataSpec::Random | DataSpec::Pattern => None,
            DataSpec::Records(records) => {
                let loaded = records.load(model, loading)?;
                examples = Some((loaded.train, loaded.cut));
                held_out = loaded.held_out;
                None
            }
            DataSpec::Text(path) => {
                if vocab < 256 {
                    return Err(Error::Data {
                        source_name: spec.to_string(),
                        problem: format!(
                            "text is read as bytes (256 symbols) but the model's vocab_size is {vocab}"
                        ),
                    });
                }
                Some(TokenFile::open(path, 1, need, vocab)?)
            }
            DataSpec::TokensU16(path) => Some(TokenFile::open(path, 2, need, vocab)?),
            DataSpec::TokensU32(path) => Some(TokenFile::open(path, 4, need, vocab)?),
        };
        Ok(Self {
            spec: spec.clone(),
            vocab,
            seq_len: model.seq_len,
            tokens,
            examples,
            held_out,
            loader: OnceLock::new(),
        })
    }

    /// A dataset's examples and what cutting them to the sequence did; `None` for other sources.
    pub fn examples(&self) -> Option<&(Dataset, Cut)> {
        self.examples.as_ref()
    }

    /// Sets the micro-batches one optimizer step takes over all ranks (accumulation × ranks):
    /// how far a dataset's walk goes each step.
    pub fn set_micros_per_step(&mut self, micros: usize) {
        if let Some((dataset, _)) = &mut self.examples {
            dataset.set_micros_per_step(micros);
        }
        self.loader = OnceLock::new();
    }

    /// Packs a dataset's training micro-batches into sequences of `seq_len` positions (`None`:
    /// pads each example); held-out batches stay padded, one example a sequence.
    pub fn set_packing(&mut self, seq_len: Option<usize>) {
        if let Some((dataset, _)) = &mut self.examples {
            dataset.set_packing(seq_len);
        }
        self.loader = OnceLock::new();
    }

    /// The micro-batches `micros` of step `step` (this rank's share of it) of a run seeded
    /// with `seed`. A dataset's are assembled a step ahead, on the loader's thread.
    pub fn step_batches(
        &self,
        seed: u64,
        step: u64,
        micros: Range<u64>,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Batch>> {
        let Some((dataset, _)) = &self.examples else {
            return micros
                .map(|micro| self.batch(seed, step, micro, batch, device))
                .collect();
        };
        let loader = self.loader.get_or_init(|| Loader::new(dataset.clone()));
        let wanted = StepBatches {
            seed,
            step,
            micros,
            micro_batch: batch,
        };
        loader
            .step(&wanted)?
            .into_iter()
            .map(|host| host.to_device(device))
            .collect()
    }

    /// The micro-batches of the held-out loss: a dataset's held-out examples in order, else one
    /// micro-batch no training step draws.
    pub fn eval_batches(&self, seed: u64, batch: usize, device: &Device) -> Result<Vec<Batch>> {
        if let Some(held_out) = &self.held_out {
            let n = held_out.len();
            let picks: Vec<usize> = (0..n).collect();
            return picks
                .chunks(batch.max(1))
                .map(|chunk| held_out.batch_of(chunk, device))
                .collect();
        }
        Ok(vec![match &self.examples {
            // The first examples of an order no epoch of training takes.
            Some((dataset, _)) => dataset.batch_of(&dataset.eval_picks(seed, batch), device)?,
            None => self.batch(seed, u64::MAX, 0, batch, device)?,
        }])
    }

    /// What the data was opened as.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// The examples held out for the evaluation, if the dataset holds some out.
    pub fn held_out(&self) -> Option<&Dataset> {
        self.held_out.as_ref()
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
        if let Some((dataset, _)) = &self.examples {
            return dataset.batch(seed, step, micro, batch, device);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(Dropout::key(seed ^ 0xDA7A, step, micro));
        let s = self.seq_len;
        let mut inputs = Vec::with_capacity(batch * s);
        let mut targets = Vec::with_capacity(batch * s);
        let mut window = Vec::with_capacity(s + 1);
        for _ in 0..batch {
            match (&self.spec, &self.tokens) {
                (DataSpec::Random, _) => {
                    inputs.extend((0..s).map(|_| rng.random_range(0..self.vocab as u32)));
                    targets.extend((0..s).map(|_| rng.random_range(0..self.vocab as u32)));
                }
                (_, Some(tokens)) => {
                    // One window of s + 1 tokens: the inputs, and the targets one further.
                    let start = rng.random_range(0..tokens.len() - s);
                    window.clear();
                    tokens.extend(&mut window, start, s + 1)?;
                    inputs.extend_from_slice(&window[..s]);
                    targets.extend_from_slice(&window[1..]);
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
        Ok(Batch::new(
            Tensor::from_vec(inputs, (batch, s), device)?,
            Tensor::from_vec(targets, batch * s, device)?,
        ))
    }
}
