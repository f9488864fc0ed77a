//! `Plan`: the chosen setting and its evidence, as a versioned JSON document.
//!
//! # Wire format (schema versions 1 and 2)
//!
//! A plan file holds one JSON object. Readers reject unknown fields and any
//! `schema_version` other than 1 or 2, so a plan is never half-understood. Version 1 plans
//! train on one GPU; version 2 is version 1 plus data parallelism (the `data_parallel` fields
//! below), and autotune writes it only for plans that train on several GPUs, so single-GPU
//! plans stay readable by versions of autotune that know version 1 only. Byte counts are
//! integers, times are seconds, throughputs are tokens per second, and relative errors are
//! fractions (0.02 = 2 %). Optional values are `null`, never absent, when written by autotune.
//! The same format is published as a JSON Schema, `docs/plan.schema.json` at the project root,
//! which a test holds every kind of plan autotune writes to.
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `schema_version` | integer | `1` for a single-GPU plan, `2` for a data-parallel one. |
//! | `tool` | object | `{"name": "autotune", "version": "0.1.0"}`: what wrote the plan. |
//! | `created_unix_s` | integer | When the plan was made, seconds since the Unix epoch (UTC). |
//! | `model` | object | The model spec trained (`ModelSpec` JSON: `name`, `vocab_size`, `d_model`, `n_heads`, `n_layers`, `d_ff`, `seq_len`, `causal`, `norm`, `activation`, `positions`, `dropout`, `norm_eps`, `optimizer`). |
//! | `device` | object | The target device spec: `name`, `kind` (`"cuda"` or `"cpu"`), `gpu_memory_bytes` (per GPU; `null` on a CPU), `gpu_count` (version 2, absent when 1), `host_memory_bytes` (shared by all GPUs), `host_to_device_gbps`, `notes`. |
//! | `budget` | object | The limits the plan was chosen under: `gpu_bytes` (`null` on a CPU), `host_bytes`, `headroom` (fraction of each limit kept free). |
//! | `knobs` | object | The chosen setting: `micro_batch`, `grad_accum` (both per GPU), `precision` (`"fp32"`, `"bf16"`, `"fp16"`), `checkpointing` (`{"mode": "none"}` or `{"mode": "every_kth", "k": K}`, K = 1 recomputes every block), `offload` (`"none"` or `"optimizer"`); version 2 adds `data_parallel`: `{"degree": N, "shard_optimizer": bool}` (N GPUs, one process each; `shard_optimizer` is ZeRO stage 1). |
//! | `predicted` | object | What the fitted models predict at `knobs`: `peak_gpu_bytes`, `peak_host_bytes` (integers or `null` when too few trials fitted; `peak_gpu_bytes` is `null` on a CPU), `tokens_per_s` (number or `null`). |
//! | `measured` | object | The verification trial of `knobs`: `peak_gpu_bytes` (the largest of any GPU), `peak_host_bytes` (all ranks together), `step_time_median_s` (one optimizer step, all micro-batches), `step_time_spread` ((p90 − p10) / median), `timed_steps`, `tokens_per_s` (all GPUs). |
//! | `tokens_per_s_interval` | array | `[LOW, HIGH]`: the 95 % interval of `measured.tokens_per_s` from the spread of its timed steps (absent in older plans). |
//! | `headroom` | object | Bytes of the budget left unused at the measured peak: `gpu_bytes` (`null` on a CPU), `host_bytes`. |
//! | `evidence` | array | Every trial of the search, in order, the verification last. Each is `{"request": {"knobs": …, "warmup_steps": N, "timed_steps": N}, "outcome": …, "wall_s": S}` (the request has `"remeasure": true` when it ran a search trial's knobs again because its timing could not settle a decision) plus the outcome's fields: `"outcome": "fits"` with the `measured` fields above; `"outcome": "out_of_memory"` with `memory` (`"gpu"` or `"host"`) and `phase` (`"setup"`, `"forward_backward"`, `"optimizer_step"`, `"eval"`, `"checkpoint"`); or `"outcome": "crashed"` with `reason`. |
//! | `model_error` | object | Worst leave-one-out relative error of the chosen regime's fits: `memory_loo_rel_error`, `time_loo_rel_error` (`null` below three trials). |
//! | `alternatives` | array | Up to five other feasible settings, best first: `{"knobs": …, "tokens_per_s": T, "tokens_per_s_interval": [LOW, HIGH], "peak_gpu_bytes": B, "peak_host_bytes": B}`, measured without accumulation (a remeasured setting's runs pooled), with the 95 % interval of its tokens/s. The best of each other regime is always included. |
//! | `data_parallel` | object | Version 2 only: `degree`, `shard_optimizer` (as in `knobs`), `global_batch` (sequences per step over all GPUs), `single_gpu_tokens_per_s` (the trial of the same per-GPU setting on one GPU: the search's, or one run after the search when it ran none; `null` if that did not fit), `scaling_efficiency` (the chosen setting's search trial tokens/s ÷ (degree × `single_gpu_tokens_per_s`), `null` with it). Both throughputs are measured, never modelled. |
//! | `provenance` | object | What measured the plan (absent in older plans, which autotune's engine measured): `engine` (`"autotune"`, or the framework a trial runner reported, e.g. `"pytorch"`), `engine_version` (a trial runner's, when it reported one), `backend` (`"live"`: autotune's engine on this machine; `"exec"`: a trial runner, `tune --backend exec`; `"replay"`: a recorded profile), `candle_version` (autotune's engine only), `git_revision` (each absent when unknown), `device` (the device the trials ran on, as detected), `allocator` (a trial runner's only: the `PYTORCH_CUDA_ALLOC_CONF` its trials ran under, `""` for PyTorch's default; the exports name it). `autotune export` refuses a plan whose engine is not the target tool's unless `--allow-engine-mismatch` is given. |
//! | `model_folder` | string | The Hugging Face folder the model was read from, as an absolute path (absent for presets and spec files): `autotune train --plan` starts from its weights and reads the data with its tokenizer. |
//! | `non_monotone` | array | Neighbouring trials of one regime (without accumulation) where memory did not grow with the micro-batch, absent when it always did: `{"regime": …, "smaller": B, "larger": B, "what": "…"}`, the peak falling as the batch grows, or a larger batch fitting the budget above a smaller one that did not. The search assumes growth, so these say how far its boundary can be trusted. |
//! | `ruled_out` | array | Settings with a global batch whose search trial fitted but which were not verified, absent when none was: `{"knobs": …, "measured_gpu_bytes": B, "added_bytes": B}`, the plan's knobs (with their accumulation), the trial's measured device peak without accumulation, and what the estimate says accumulating adds (the f32 sum of every gradient, held through the step); that peak plus 90 % of the addition passed the usable bytes. |
//! | `longest_sequence` | object | The longest single sequence the plan's setting can take, one a micro-batch (absent in replays and older plans): `predicted_tokens` (the memory estimate within the budget, scaled by the plan's measured peak over its estimate; `null` when not even one token fits), `measured_tokens` (the longest a trial fitted: at the edge, or the plan's own length when no longer one was tried), `exceeded_tokens` (the shortest that ran out of memory or above the budget, `null` when none did), `trials` (`[{"tokens": N, "fits": bool}]`, in order), `note` (why no trial ran, when none did). |
//! | `data` | object | The dataset the plan was tuned on (absent for synthetic sequences): `fingerprint` (SHA-256 of the data files, the tokenizer and how records become examples), `files`, `batching` (`"packed"` or `"padded"`), `truncation` (`"cut"` or `"drop"`: what happens to an example longer than the sequence), `sequence_tokens` (the trials' sequence length: packed, the length examples are packed into; padded, the longest example's), `examples`, `tokens`, `trained_tokens`, `truncated`, `dropped`, `longest`, `lengths` (`[{"up_to": L, "examples": N}]`: every example's length before any cut, dropped ones included, in buckets that double), `fill` (the share of an epoch's micro-batch positions holding real tokens at the plan's micro-batch). `autotune train` refuses a plan tuned on other data unless `--allow-data-mismatch` is given. |

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::data::DataProfile;
use super::longest::LongestSequence;
use crate::fit::NonMonotone;
use crate::knobs::Knobs;
use crate::search::AccumulationRuledOut;
use crate::spec::budget::Budget;
use crate::spec::device::DeviceSpec;
use crate::spec::model::ModelSpec;
use crate::trial::{Measurement, TrialResult};
use crate::{Error, Result};

/// The newest plan format this version reads and writes (data-parallel plans).
pub const SCHEMA_VERSION: u32 = 2;

/// The format of single-GPU plans, which autotune keeps writing for them.
pub const SINGLE_GPU_SCHEMA_VERSION: u32 = 1;

const WHAT: &str = "plan";

/// A chosen training setting with the evidence behind it; see the module docs for the JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// [`SINGLE_GPU_SCHEMA_VERSION`], or [`SCHEMA_VERSION`] for a data-parallel plan.
    pub schema_version: u32,
    /// What wrote the plan.
    pub tool: Tool,
    /// Seconds since the Unix epoch when the plan was made (supplied by the caller).
    pub created_unix_s: u64,
    /// The model trained.
    pub model: ModelSpec,
    /// The target device.
    pub device: DeviceSpec,
    /// The limits the plan was chosen under.
    pub budget: Budget,
    /// The chosen setting.
    pub knobs: Knobs,
    /// The fitted models' predictions at `knobs`.
    pub predicted: Predicted,
    /// The verification trial's measurement.
    pub measured: Measurement,
    /// The 95 % interval of `measured.tokens_per_s`, low then high, from the spread of its
    /// steps ([`Measurement::tokens_per_s_interval`]); absent in older plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s_interval: Option<[f64; 2]>,
    /// Budget bytes left unused at the measured peak.
    pub headroom: Headroom,
    /// Every trial of the search, in order; the last verifies `knobs`.
    pub evidence: Vec<TrialResult>,
    /// Held-out errors of the chosen regime's fits.
    pub model_error: ModelError,
    /// Other feasible settings, best first: the best of each other regime, the largest
    /// feasible micro-batch of the plan's own regime where it is larger than the plan's, then
    /// the next best.
    pub alternatives: Vec<Alternative>,
    /// The data-parallel layout and its measured scaling (version 2 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel: Option<DataParallelReport>,
    /// How the chosen state layout's updates differ from exact AdamW
    /// ([`crate::knobs::StateLayout::difference`]); absent when they do not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_note: Option<String>,
    /// How the chosen precision differs from bf16 ([`crate::knobs::Precision::note`]): fp8
    /// products; absent for the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision_note: Option<String>,
    /// What measured the plan; absent in plans written before it was recorded (those were all
    /// measured by autotune's own engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
    /// The Hugging Face folder the model was read from: `train --plan` starts from its weights
    /// and reads data with its tokenizer, as `run` does. Absent for presets and spec files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_folder: Option<std::path::PathBuf>,
    /// Neighbouring trials of a regime where memory did not grow with the micro-batch
    /// ([`crate::fit::non_monotone`]); absent when it always did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub non_monotone: Vec<NonMonotone>,
    /// Settings whose search trial fitted but which were not verified: accumulation would have
    /// taken them past the usable bytes ([`AccumulationRuledOut`]); absent when none was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ruled_out: Vec<AccumulationRuledOut>,
    /// The longest single sequence the plan's setting can take: predicted, and measured at the
    /// edge; absent in plans written before it was recorded, and in replays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub longest_sequence: Option<LongestSequence>,
    /// The dataset the plan was tuned on; absent for plans tuned on synthetic sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataProfile>,
}

/// Who measured a plan: the engine whose training step its trials ran, how the trials were
/// answered, and on what. Exports read the engine: a batch measured on one engine may run out
/// of memory on another (see `plan::exports::engine_mismatch`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    /// The engine the trials measured: [`Provenance::OWN_ENGINE`], or the framework a trial
    /// runner used (`"pytorch"`).
    pub engine: String,
    /// The engine's version, where a trial runner reported it (autotune's own engine is
    /// `candle_version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_version: Option<String>,
    /// `"live"` (autotune's engine on this machine), `"exec"` (a trial runner on this machine)
    /// or `"replay"` (answered from a recorded profile).
    pub backend: String,
    /// candle's version, for autotune's engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candle_version: Option<String>,
    /// The source revision the binary was built from, when the build knew it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_revision: Option<String>,
    /// The device the trials ran on, as detected (`"NVIDIA H200"`, `"cpu"`): larger than the
    /// target when the target was emulated.
    pub device: String,
    /// The allocator setting a trial runner's trials ran under: the value of
    /// `PYTORCH_CUDA_ALLOC_CONF` ([`crate::trial_protocol::allocator`]), empty for PyTorch's
    /// default. `None` for autotune's engine, and where it was not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<String>,
}

impl Provenance {
    /// The name of autotune's own engine.
    pub const OWN_ENGINE: &'static str = "autotune";

    /// A provenance naming only `engine`, for tests.
    #[cfg(test)]
    pub(crate) fn for_test(engine: &str) -> Self {
        Self {
            engine: engine.into(),
            engine_version: None,
            backend: "live".into(),
            candle_version: None,
            git_revision: None,
            device: "cpu".into(),
            allocator: None,
        }
    }
}

/// How a data-parallel plan spreads over GPUs, and what that was measured to gain.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataParallelReport {
    /// GPUs, one process each (`knobs.data_parallel.degree`).
    pub degree: usize,
    /// Whether the optimizer state is sharded (ZeRO stage 1).
    pub shard_optimizer: bool,
    /// Sequences per optimizer step over all GPUs.
    pub global_batch: usize,
    /// Measured tokens/s of the same per-GPU setting on one GPU, if the search ran it.
    pub single_gpu_tokens_per_s: Option<f64>,
    /// Measured tokens/s on `degree` GPUs ÷ (`degree` × `single_gpu_tokens_per_s`).
    pub scaling_efficiency: Option<f64>,
}

/// The program that wrote a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Program name.
    pub name: String,
    /// Program version.
    pub version: String,
}

impl Tool {
    /// This program at this version (the core and the binary share the workspace's version).
    pub fn current() -> Self {
        Self {
            name: "autotune".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// Model predictions at the chosen knobs; `null` where a model could not be fitted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicted {
    /// Peak device bytes (`null` on a CPU).
    pub peak_gpu_bytes: Option<u64>,
    /// Peak host bytes.
    pub peak_host_bytes: Option<u64>,
    /// Tokens per second.
    pub tokens_per_s: Option<f64>,
}

/// Budget bytes left unused at the measured peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Headroom {
    /// Device bytes (`null` on a CPU).
    pub gpu_bytes: Option<u64>,
    /// Host bytes.
    pub host_bytes: u64,
}

/// Worst leave-one-out relative errors of the chosen regime's fits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelError {
    /// Of the memory model (the worse of device and host).
    pub memory_loo_rel_error: Option<f64>,
    /// Of the step-time model.
    pub time_loo_rel_error: Option<f64>,
}

/// Another feasible setting and what its search trial measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Alternative {
    /// The setting, with the accumulation a plan would use.
    pub knobs: Knobs,
    /// Measured tokens per second (pooled over its runs, where it was remeasured).
    pub tokens_per_s: f64,
    /// Its 95 % interval, low then high; absent in older plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s_interval: Option<[f64; 2]>,
    /// Measured peak device bytes.
    pub peak_gpu_bytes: u64,
    /// Measured peak host bytes.
    pub peak_host_bytes: u64,
}

impl Plan {
    /// The largest micro-batch of the plan's own regime that also fitted but measured slower,
    /// if the plan records one: near its memory limit a larger batch can run slower (the
    /// allocator under pressure), and the plan is the faster setting.
    pub fn larger_batch_measured_slower(&self) -> Option<&Alternative> {
        self.alternatives
            .iter()
            .filter(|a| a.knobs.regime() == self.knobs.regime())
            .filter(|a| a.knobs.micro_batch > self.knobs.micro_batch)
            .filter(|a| a.tokens_per_s < self.measured.tokens_per_s)
            .max_by_key(|a| a.knobs.micro_batch)
    }

    /// Reads and validates a plan file; errors name the file and, when invalid, the field.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT)
            .map_err(|e| Error::file("cannot read plan", path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            Error::InvalidSpec { .. } => Error::file(
                "invalid plan",
                path,
                Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
            ),
            other => other,
        })
    }

    /// Parses and validates a plan; the schema version is checked before anything else.
    pub fn from_json(text: &str) -> Result<Self> {
        let value = crate::json::parse_value(WHAT, text)?;
        let version = value
            .as_object()
            .ok_or_else(|| Error::invalid(WHAT, crate::json::DOCUMENT, "must be a JSON object"))?
            .get("schema_version")
            .ok_or_else(|| {
                Error::invalid(
                    WHAT,
                    "schema_version",
                    "is missing; is this an autotune plan?",
                )
            })?;
        let known = [SINGLE_GPU_SCHEMA_VERSION, SCHEMA_VERSION].map(u64::from);
        if !version.as_u64().is_some_and(|v| known.contains(&v)) {
            return Err(Error::invalid(
                WHAT,
                "schema_version",
                format!(
                    "is {version}, but {} {} reads only versions {SINGLE_GPU_SCHEMA_VERSION} and {SCHEMA_VERSION}; make \
                     the plan again or use the autotune that wrote it",
                    env!("CARGO_PKG_NAME"),
                    env!("CARGO_PKG_VERSION")
                ),
            ));
        }
        let plan: Self = crate::json::from_value(WHAT, value)?;
        plan.validate()?;
        Ok(plan)
    }

    /// Checks the parts against each other: valid model, device, budget and knobs.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.device.validate()?;
        self.budget.validate()?;
        self.knobs.validate(WHAT, "knobs.")?;
        crate::spec::limits::check_knobs(&self.model, &self.knobs, WHAT, "knobs.")?;
        crate::trial::Outcome::Fits(self.measured).validate(WHAT, "measured.")?;
        for (i, trial) in self.evidence.iter().enumerate() {
            trial.validate(WHAT, &format!("evidence[{i}]."))?;
        }
        for (i, alternative) in self.alternatives.iter().enumerate() {
            alternative
                .knobs
                .validate(WHAT, &format!("alternatives[{i}].knobs."))?;
        }
        if self.budget.gpu_bytes.is_some() != self.device.gpu_memory_bytes.is_some() {
            return Err(Error::invalid(
                WHAT,
                "budget.gpu_bytes",
                "must be null exactly when the device has no GPU",
            ));
        }
        if let Some(data) = &self.data {
            data.validate()?;
        }
        self.validate_data_parallel()
    }

    /// Version 1 plans are single-GPU; version 2 ones carry a `data_parallel` report that
    /// agrees with the knobs, on a device with enough GPUs.
    fn validate_data_parallel(&self) -> Result<()> {
        let dp = self.knobs.data_parallel;
        if self.schema_version == SINGLE_GPU_SCHEMA_VERSION {
            if !dp.is_single() || self.data_parallel.is_some() || self.device.gpu_count > 1 {
                return Err(Error::invalid(
                    WHAT,
                    "schema_version",
                    format!(
                        "is {SINGLE_GPU_SCHEMA_VERSION}, a single-GPU plan, but it has data-parallel fields; \
                         data-parallel plans are version {SCHEMA_VERSION}"
                    ),
                ));
            }
            return Ok(());
        }
        let Some(report) = self.data_parallel else {
            return Err(Error::invalid(
                WHAT,
                "data_parallel",
                format!(
                    "is missing; version {SCHEMA_VERSION} plans carry their data-parallel layout"
                ),
            ));
        };
        if report.degree != dp.degree
            || report.shard_optimizer != dp.shard_optimizer
            || report.global_batch != self.knobs.global_batch()
        {
            return Err(Error::invalid(
                WHAT,
                "data_parallel",
                "disagrees with knobs (degree, shard_optimizer, or global_batch = micro_batch × grad_accum × degree)",
            ));
        }
        if dp.degree > self.device.gpu_count {
            return Err(Error::invalid(
                WHAT,
                "knobs.data_parallel.degree",
                format!(
                    "is {} but device.gpu_count is {}; a plan cannot use more GPUs than its device has",
                    dp.degree, self.device.gpu_count
                ),
            ));
        }
        Ok(())
    }

    /// The plan as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan always serialises")
    }

    /// Writes the plan atomically: to a temporary file in the same directory, then renamed over
    /// `path`, so a reader never sees a half-written plan.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::atomic_file::write(path, format!("{}\n", self.to_json()).as_bytes())
            .map_err(|e| Error::file("cannot write plan", path, e))
    }
}

#[cfg(test)]
mod tests;
