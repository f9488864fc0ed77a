//! Checkpoints: weights, optimizer moments and run state, written atomically.
//!
//! Layout of a checkpoint directory `DIR/step-000120/`:
//! `model.safetensors` (f32 master weights), `optimizer.safetensors` (`m.*`, `v.*`), and
//! `state.json` ([`RunState`]). With optimizer offload the masters and moments are streamed from
//! host memory; the files are the same, so a checkpoint resumes under either placement. A checkpoint is written into a hidden temporary directory and
//! renamed into place, then `DIR/latest` is replaced atomically, so an interrupted save never
//! leaves a half-written checkpoint behind `latest`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Device;

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::spec::model::ModelSpec;
use crate::train::data::DataSpec;
use crate::train::optim::Optimizer;
use crate::train::scaler::LossScaler;
use crate::train::step::Trainer;
use crate::{Error, Result};

/// Version of the checkpoint layout; readers refuse others.
pub const CHECKPOINT_VERSION: u32 = 1;

/// Everything besides tensors that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunState {
    /// Layout version ([`CHECKPOINT_VERSION`]).
    pub version: u32,
    /// Optimizer steps completed (including skipped ones).
    pub step: u64,
    /// Optimizer updates applied (Adam's bias-correction counter).
    pub optimizer_steps: u64,
    /// Run seed.
    pub seed: u64,
    /// Loss-scale state.
    pub scaler: LossScaler,
    /// The model trained.
    pub model: ModelSpec,
    /// The knobs trained with.
    pub knobs: Knobs,
    /// The data trained on.
    pub data: DataSpec,
    /// Tokens consumed so far.
    pub tokens_seen: u64,
}

/// Writes a checkpoint of `trainer` under `dir` and points `dir/latest` at it.
pub fn save(dir: &Path, trainer: &Trainer, data: &DataSpec, tokens_seen: u64) -> Result<PathBuf> {
    save_with_moments(dir, trainer, data, tokens_seen, None)
}

/// [`save`], with the optimizer moments given (those a sharded optimizer gathered from every
/// rank, see [`Trainer::gather_optimizer_state`]) instead of read from the trainer's optimizer.
pub fn save_with_moments(
    dir: &Path,
    trainer: &Trainer,
    data: &DataSpec,
    tokens_seen: u64,
    moments: Option<HashMap<String, candle_core::Tensor>>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::file("cannot create checkpoint directory", dir, e))?;
    let name = format!("step-{:06}", trainer.steps());
    let final_path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .map_err(|e| Error::file("cannot clear stale temporary checkpoint", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::file("cannot create checkpoint directory", &tmp, e))?;

    let params = trainer.model().params();
    let model_file = tmp.join("model.safetensors");
    let optim_file = tmp.join("optimizer.safetensors");
    let cannot = "cannot write checkpoint";
    match trainer.optimizer() {
        Optimizer::OnDevice(adam) => {
            candle_core::safetensors::save(&params.named_tensors(), &model_file)
                .map_err(|e| Error::file(cannot, &model_file, e))?;
            let moments = moments.unwrap_or_else(|| adam.state_tensors(params.names()));
            candle_core::safetensors::save(&moments, &optim_file)
                .map_err(|e| Error::file(cannot, &optim_file, e))?;
        }
        Optimizer::Offloaded(offload) => {
            write_streamed(&model_file, |w| offload.write_masters(w, params.names()))
                .map_err(|e| Error::file(cannot, &model_file, e))?;
            write_streamed(&optim_file, |w| offload.write_moments(w, params.names()))
                .map_err(|e| Error::file(cannot, &optim_file, e))?;
        }
    }
    let state = RunState {
        version: CHECKPOINT_VERSION,
        step: trainer.steps(),
        optimizer_steps: trainer.optimizer().steps(),
        seed: trainer.seed(),
        scaler: *trainer.scaler(),
        model: trainer.model().spec().clone(),
        knobs: trainer.knobs(),
        data: data.clone(),
        tokens_seen,
    };
    let state_json = serde_json::to_vec_pretty(&state).expect("run state always serialises");
    write_synced(&tmp.join("state.json"), &state_json)?;

    if final_path.exists() {
        std::fs::remove_dir_all(&final_path)
            .map_err(|e| Error::file("cannot replace old checkpoint", &final_path, e))?;
    }
    std::fs::rename(&tmp, &final_path)
        .map_err(|e| Error::file("cannot move checkpoint into place", &final_path, e))?;
    write_atomic(&dir.join("latest"), name.as_bytes())?;
    Ok(final_path)
}

/// The checkpoint `dir/latest` points at, if any.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = dir.join("latest");
    if !pointer.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer)
        .map_err(|e| Error::file("cannot read checkpoint pointer", &pointer, e))?;
    Ok(Some(dir.join(name.trim())))
}

/// Reads a checkpoint's run state.
pub fn read_state(checkpoint: &Path) -> Result<RunState> {
    let path = checkpoint.join("state.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::file("cannot read checkpoint state", &path, e))?;
    let state: RunState = serde_json::from_str(&text)
        .map_err(|e| Error::file("corrupt checkpoint state", &path, e))?;
    if state.version != CHECKPOINT_VERSION {
        return Err(Error::CheckpointMismatch {
            path: checkpoint.to_path_buf(),
            problem: format!(
                "layout version {} is not the supported {CHECKPOINT_VERSION}",
                state.version
            ),
        });
    }
    Ok(state)
}

/// Loads weights, optimizer moments and counters from `checkpoint` into `trainer`.
pub fn restore(checkpoint: &Path, trainer: &mut Trainer) -> Result<RunState> {
    let state = read_state(checkpoint)?;
    let mismatch = |problem: String| Error::CheckpointMismatch {
        path: checkpoint.to_path_buf(),
        problem,
    };
    if &state.model != trainer.model().spec() {
        return Err(mismatch(format!(
            "it was written for model `{}` with a different shape",
            state.model.name
        )));
    }
    // Offloaded masters and moments live in host memory: load them there.
    let device = if trainer.optimizer().is_offloaded() {
        Device::Cpu
    } else {
        trainer.device().clone()
    };
    let model_file = checkpoint.join("model.safetensors");
    let weights = candle_core::safetensors::load(&model_file, &device)
        .map_err(|e| Error::file("corrupt checkpoint weights", &model_file, e))?;
    trainer.load_master_weights(&weights).map_err(mismatch)?;
    drop(weights);
    let optim_file = checkpoint.join("optimizer.safetensors");
    let moments = candle_core::safetensors::load(&optim_file, &device)
        .map_err(|e| Error::file("corrupt checkpoint optimizer state", &optim_file, e))?;
    let names = trainer.model().params().names().to_vec();
    trainer
        .optimizer_mut()
        .load_state(&names, &moments, state.optimizer_steps)
        .map_err(mismatch)?;
    *trainer.scaler_mut() = state.scaler;
    trainer.set_steps(state.step);
    Ok(state)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so readers never see a
/// partial file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::atomic_file::write(path, bytes).map_err(|e| Error::file("cannot write", path, e))
}

/// Creates `path`, lets `write` stream into it and syncs it to disk.
fn write_streamed(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<&std::fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let file = std::fs::File::create(path)?;
    let mut out = std::io::BufWriter::new(&file);
    write(&mut out)?;
    out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file =
        std::fs::File::create(path).map_err(|e| Error::file("cannot create", path, e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| Error::file("cannot write", path, e))
}
