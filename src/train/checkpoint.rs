//! Checkpoints: weights, optimizer moments and run state, written atomically and verified
//! before they are resumed.
//!
//! Layout of a checkpoint directory `DIR/step-000120/`:
//! `model.safetensors` (f32 master weights), `optimizer.safetensors` (`m.*`, `v.*`),
//! `state.json` ([`RunState`]) and `manifest.json` (every other file's length and SHA-256, see
//! [`manifest`]). With optimizer offload the masters and moments are streamed from host memory;
//! the files are the same, so a checkpoint resumes under either placement.
//!
//! A checkpoint is written into a hidden temporary directory (removed again if the save fails)
//! and renamed into place, then `DIR/latest` is replaced atomically, so an interrupted save
//! never leaves a half-written checkpoint behind `latest`. Weights that are not finite are
//! never saved. `latest` holds a checkpoint's name, never a path: it cannot point outside `DIR`.
//!
//! A resume trusts nothing it reads: the manifest must list every file by its plain name, the
//! state's step must be the one the directory is named for, each tensor's header entry is
//! checked against the file before its bytes are read, and every tensor must be finite.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::Device;

use serde::{Deserialize, Serialize};

pub mod manifest;

use crate::data::source::DataSpec;
use crate::knobs::Knobs;
use crate::ops::fp8::LayerScalesState;
use crate::spec::model::ModelSpec;
use crate::train::optimizer::OptimizerState;
use crate::train::scaler::LossScaler;
use crate::train::schedule::LrSchedule;
use crate::train::step::Trainer;
use crate::{Error, Result};

/// Version of the checkpoint layout: 2 adds the manifest. Readers take versions 1 (unverified:
/// it has no manifest) and 2, and refuse others.
pub const CHECKPOINT_VERSION: u32 = 2;

/// The layout before manifests, still read.
const UNVERIFIED_VERSION: u32 = 1;

/// The files a checkpoint holds besides its manifest.
const FILES: [&str; 3] = ["model.safetensors", "optimizer.safetensors", "state.json"];

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
    /// The learning rate by step (absent in checkpoints of runs before schedules: the base
    /// rate throughout).
    #[serde(default, skip_serializing_if = "is_constant")]
    pub schedule: LrSchedule,
    /// With fp8 products, each block layer's scale histories by its weight's name, so that a
    /// resumed run converts at the scales the run it continues had reached (absent otherwise).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fp8_scales: BTreeMap<String, LayerScalesState>,
}

fn is_constant(schedule: &LrSchedule) -> bool {
    schedule.canonical() == LrSchedule::CONSTANT
}

/// Writes a checkpoint of `trainer` under `dir` and points `dir/latest` at it.
pub fn save(dir: &Path, trainer: &Trainer, data: &DataSpec, tokens_seen: u64) -> Result<PathBuf> {
    save_with_moments(dir, trainer, data, tokens_seen, None)
}

/// Where a checkpoint of the run at `step` lies in `dir`.
pub fn path_for_step(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:06}"))
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
    if let Some(name) = first_non_finite(trainer)? {
        return Err(Error::NonFinite {
            step: trainer.steps(),
            what: format!("parameter `{name}`"),
        });
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::file("cannot create checkpoint directory", dir, e))?;
    let final_path = path_for_step(dir, trainer.steps());
    let name = final_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .map_err(|e| Error::file("cannot clear stale temporary checkpoint", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::file("cannot create checkpoint directory", &tmp, e))?;
    if let Err(e) = write_files(&tmp, trainer, data, tokens_seen, moments) {
        // Best effort: the error that matters is the save's, not the clean-up's.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if final_path.exists() {
        std::fs::remove_dir_all(&final_path)
            .map_err(|e| Error::file("cannot replace old checkpoint", &final_path, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, &final_path) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(Error::file(
            "cannot move checkpoint into place",
            &final_path,
            e,
        ));
    }
    write_atomic(
        &dir.join(crate::train::checkpoint_dir::LATEST),
        name.as_bytes(),
    )?;
    Ok(final_path)
}

/// Writes a checkpoint's files into `tmp`, the manifest last.
fn write_files(
    tmp: &Path,
    trainer: &Trainer,
    data: &DataSpec,
    tokens_seen: u64,
    moments: Option<HashMap<String, candle_core::Tensor>>,
) -> Result<()> {
    let params = trainer.model().params();
    let model_file = tmp.join(FILES[0]);
    let optim_file = tmp.join(FILES[1]);
    let cannot = "cannot write checkpoint";
    match trainer.optimizer() {
        OptimizerState::Device(adam) => {
            candle_core::safetensors::save(&params.named_tensors(), &model_file)
                .map_err(|e| Error::file(cannot, &model_file, e))?;
            let moments = moments.unwrap_or_else(|| adam.state_tensors(params.names()));
            candle_core::safetensors::save(&moments, &optim_file)
                .map_err(|e| Error::file(cannot, &optim_file, e))?;
        }
        OptimizerState::Compact(compact) => {
            candle_core::safetensors::save(&params.named_tensors(), &model_file)
                .map_err(|e| Error::file(cannot, &model_file, e))?;
            let state = compact.state_tensors(params.names())?;
            candle_core::safetensors::save(&state, &optim_file)
                .map_err(|e| Error::file(cannot, &optim_file, e))?;
        }
        OptimizerState::Host(offload) => {
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
        schedule: trainer.schedule(),
        fp8_scales: fp8_scales(trainer)?,
    };
    let state_json = serde_json::to_vec_pretty(&state).expect("run state always serialises");
    write_synced(&tmp.join(FILES[2]), &state_json)?;
    manifest::Manifest::of(tmp, &FILES)?.write(tmp)
}

/// The block layers' fp8 scale histories that hold any conversion, by weight name.
fn fp8_scales(trainer: &Trainer) -> Result<BTreeMap<String, LayerScalesState>> {
    let mut out = BTreeMap::new();
    for (name, linear) in trainer.model().block_linears() {
        let state = linear.fp8_scales().state()?;
        if !state.is_empty() {
            out.insert(name.to_string(), state);
        }
    }
    Ok(out)
}

/// Puts the block layers' fp8 scale histories of `state` back (and starts the others over).
fn restore_fp8_scales(
    state: &BTreeMap<String, LayerScalesState>,
    trainer: &Trainer,
) -> std::result::Result<(), String> {
    let linears = trainer.model().block_linears();
    if let Some(unknown) = state.keys().find(|k| !linears.iter().any(|(n, _)| n == k)) {
        return Err(format!(
            "it holds fp8 scales for `{unknown}`, which the model has not"
        ));
    }
    let empty = LayerScalesState::default();
    for (name, linear) in linears {
        let saved = state.get(name).unwrap_or(&empty);
        linear
            .fp8_scales()
            .restore(saved, trainer.device())
            .map_err(|e| format!("the fp8 scales of `{name}`: {e}"))?;
    }
    Ok(())
}

/// The name of the first parameter of `trainer` holding a NaN or an infinity, if any.
pub fn first_non_finite(trainer: &Trainer) -> Result<Option<String>> {
    let params = trainer.model().params();
    for (name, var) in params.names().iter().zip(params.vars()) {
        if !is_finite(var.as_tensor())? {
            return Ok(Some(name.clone()));
        }
    }
    Ok(None)
}

/// A host copy of `tensor` that owns its bytes: what a save of it reads. On the CPU
/// `to_device` would hand back the same storage and copy nothing.
pub fn host_copy(tensor: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    if tensor.device().is_cpu() {
        Ok(tensor.copy()?)
    } else {
        Ok(tensor.to_device(&Device::Cpu)?)
    }
}

/// The checkpoint `dir/latest` points at, if any. `latest` must name a checkpoint of `dir`
/// (`step-NNNNNN`), never a path, so a resume cannot be led into another run's directory.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    let pointer = dir.join(crate::train::checkpoint_dir::LATEST);
    if !pointer.exists() {
        return Ok(None);
    }
    let name = crate::input_file::read_to_string(&pointer, crate::input_file::DOCUMENT_LIMIT)
        .map_err(|e| Error::file("cannot read checkpoint pointer", &pointer, e))?;
    let name = name.trim();
    if !crate::train::checkpoint_dir::is_checkpoint_name(name) {
        return Err(Error::invalid(
            "checkpoint pointer",
            pointer.display().to_string(),
            format!(
                "names `{name}`, which is not a checkpoint of this directory; write the name of one of its step-NNNNNN checkpoints into it"
            ),
        ));
    }
    Ok(Some(dir.join(name)))
}

/// Reads a checkpoint's run state.
pub fn read_state(checkpoint: &Path) -> Result<RunState> {
    let path = checkpoint.join(FILES[2]);
    let text = crate::input_file::read_to_string(&path, crate::input_file::DOCUMENT_LIMIT)
        .map_err(|e| Error::file("cannot read checkpoint state", &path, e))?;
    let state = RunState::from_json(&text)
        .map_err(|e| Error::file("corrupt checkpoint state", &path, e))?;
    if ![UNVERIFIED_VERSION, CHECKPOINT_VERSION].contains(&state.version) {
        return Err(Error::CheckpointMismatch {
            path: checkpoint.to_path_buf(),
            problem: format!(
                "layout version {} is not one of the supported {UNVERIFIED_VERSION} and {CHECKPOINT_VERSION}",
                state.version
            ),
        });
    }
    Ok(state)
}

impl RunState {
    /// Parses and checks a run state: every field present and of its type (named by path
    /// otherwise), a valid model and knobs, a finite positive loss scale, and counters that
    /// agree (no more updates than steps).
    pub fn from_json(text: &str) -> autotune_core::Result<Self> {
        const WHAT: &str = "checkpoint state";
        let state: Self = autotune_core::json::from_str(WHAT, text)?;
        state.model.validate()?;
        state.knobs.validate(WHAT, "knobs.")?;
        crate::spec::limits::check_knobs(&state.model, &state.knobs, WHAT, "knobs.")?;
        state.schedule.validate(WHAT, "schedule.")?;
        let bad =
            |field: &str, problem: String| Err(autotune_core::Error::invalid(WHAT, field, problem));
        if !(state.scaler.scale.is_finite() && state.scaler.scale > 0.0) {
            return bad(
                "scaler.scale",
                format!("({}) must be a positive number", state.scaler.scale),
            );
        }
        if state.optimizer_steps > state.step {
            return bad(
                "optimizer_steps",
                format!(
                    "({}) must be at most step ({}): a skipped step updates nothing",
                    state.optimizer_steps, state.step
                ),
            );
        }
        Ok(state)
    }
}

/// Whether the checkpoint is intact: its manifest verifies (a version 1 checkpoint has none and
/// is trusted as it was). A damaged one is an error naming what is damaged and the newest
/// intact checkpoint beside it.
pub fn verify(checkpoint: &Path) -> Result<()> {
    let version = read_state(checkpoint).map(|s| s.version).ok();
    if version == Some(UNVERIFIED_VERSION) {
        tracing::warn!(
            path = %checkpoint.display(),
            "a version 1 checkpoint has no manifest; its contents are not verified"
        );
        return Ok(());
    }
    let checked = manifest::verify(checkpoint).and_then(|()| {
        let state = read_state(checkpoint).map_err(|e| with_causes(&e))?;
        step_matches_name(checkpoint, &state)
    });
    match checked {
        Ok(()) => Ok(()),
        Err(damage) => Err(damaged(checkpoint, damage)),
    }
}

/// `error` and every cause under it, in one line: the cause says which field is wrong.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text.push_str(&format!(" ({inner})"));
        cause = inner.source();
    }
    text
}

/// A checkpoint named `step-N` holds step N: a state copied in from another checkpoint would
/// resume at another step than its name says, and retention would keep the wrong one.
fn step_matches_name(checkpoint: &Path, state: &RunState) -> std::result::Result<(), String> {
    let Some(name) = checkpoint.file_name().and_then(|n| n.to_str()) else {
        return Ok(());
    };
    if !crate::train::checkpoint_dir::is_checkpoint_name(name) {
        return Ok(());
    }
    match name["step-".len()..].parse::<u64>() {
        Ok(step) if step == state.step => Ok(()),
        _ => Err(format!(
            "its state.json says field `step` is {}, but its directory is `{name}`",
            state.step
        )),
    }
}

/// The error for `checkpoint`, damaged as `problem` says, naming the newest intact
/// checkpoint beside it.
fn damaged(checkpoint: &Path, problem: String) -> Error {
    let dir = checkpoint.parent().unwrap_or(Path::new("."));
    Error::CheckpointDamaged {
        path: checkpoint.to_path_buf(),
        problem,
        newest_intact: crate::train::checkpoint_dir::newest_intact(dir, checkpoint),
    }
}

/// Loads weights, optimizer moments and counters from `checkpoint` into `trainer`.
pub fn restore(checkpoint: &Path, trainer: &mut Trainer) -> Result<RunState> {
    verify(checkpoint)?;
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
    let weights = load_tensors(checkpoint, FILES[0], &device)?;
    trainer.load_master_weights(&weights).map_err(mismatch)?;
    drop(weights);
    let moments = load_tensors(checkpoint, FILES[1], &device)?;
    let names = trainer.model().params().names().to_vec();
    trainer
        .optimizer_mut()
        .load_state(&names, &moments, state.optimizer_steps)
        .map_err(mismatch)?;
    restore_fp8_scales(&state.fp8_scales, trainer).map_err(mismatch)?;
    *trainer.scaler_mut() = state.scaler;
    trainer.set_steps(state.step);
    Ok(state)
}

/// The tensors of the checkpoint's file `name`, on `device`. Each is read only after the
/// header's shape and offsets are checked against the file, one at a time, and checked
/// finite: no save writes a NaN or an infinity, so one there was put there since.
fn load_tensors(
    checkpoint: &Path,
    name: &str,
    device: &Device,
) -> Result<HashMap<String, candle_core::Tensor>> {
    let file = crate::train::tensor_reader::SafetensorsFile::open_state(&checkpoint.join(name))?;
    let mut tensors = HashMap::new();
    for tensor in file.names() {
        let values = file.read(tensor)?;
        if !is_finite(&values)? {
            return Err(damaged(
                checkpoint,
                format!(
                    "tensor `{tensor}` of `{name}` holds a value that is not finite (NaN or \
                     infinity), which no save writes"
                ),
            ));
        }
        tensors.insert(tensor.to_string(), values.to_device(device)?);
    }
    Ok(tensors)
}

/// Whether every element of `t` is a finite number.
fn is_finite(t: &candle_core::Tensor) -> Result<bool> {
    // `x - x` is 0 for every finite x and NaN for NaN and ±inf, so the sum is NaN exactly
    // when some element is not finite (a plain sum could overflow to inf on finite values).
    let probe = t.sub(t)?.sum_all()?.to_dtype(candle_core::DType::F32)?;
    Ok(!probe.to_scalar::<f32>()?.is_nan())
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

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file =
        std::fs::File::create(path).map_err(|e| Error::file("cannot create", path, e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| Error::file("cannot write", path, e))
}
