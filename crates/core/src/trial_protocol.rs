//! The trial protocol: how autotune asks any program, a *trial runner*, to measure one setting,
//! and how it reads the answer. `docs/trial-protocol.md` is the reference for runner authors;
//! this module is its implementation on autotune's side.
//!
//! autotune writes a [`RunnerRequest`] as one JSON line on the runner's stdin and reads one
//! reply line from its stdout, among whatever else the runner prints there: the reply is the
//! line that is a JSON object with a `protocol` key ([`parse_reply_line`]). Both directions
//! carry [`PROTOCOL_VERSION`]. A reply maps to a trial [`Outcome`]
//! ([`RunnerReply::outcome`]); so does everything else a runner can do (crash, hang, print
//! nonsense), which the process side (`autotune::probe::exec`) turns into outcomes.
//!
//! Only a runner that speaks another version of the protocol is an error ([`BadReply::Version`]):
//! every one of its trials would fail alike, so the search stops and says so.

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial::{Measurement, MemoryKind, Outcome, Phase, TrialRequest, MAX_STEP_TIME_S};
use crate::{Error, Result};

/// The protocol version this autotune speaks, in requests and expected in replies.
pub const PROTOCOL_VERSION: u32 = 1;

/// The longest engine name a reply may carry.
pub const MAX_ENGINE_NAME_CHARS: usize = 64;

/// The longest text field (version, device, reason) kept from a reply; longer is cut.
pub const MAX_TEXT_CHARS: usize = 1000;

const WHAT: &str = "trial runner reply";

/// One trial, as a runner is asked for it: everything it needs to build the model, run the
/// setting and emulate the target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunnerRequest {
    /// Always [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The model to train (the spec of plans; `name` is the preset or file name).
    pub model: ModelSpec,
    /// The setting: micro-batch, accumulation, precision, checkpointing, offload (as in plans).
    pub knobs: Knobs,
    /// Untimed steps first.
    pub warmup_steps: usize,
    /// Timed steps, each reported.
    pub timed_steps: usize,
    /// Where to train: `"cuda"` (the first visible GPU) or `"cpu"`.
    pub device: DeviceKind,
    /// The target card's memory: allocations beyond it must fail as out of memory (the
    /// runner emulates the smaller card); `null` on a CPU.
    pub gpu_capacity_bytes: Option<u64>,
    /// The target host's memory: a trial whose peak exceeds it ran out of host memory.
    pub host_budget_bytes: Option<u64>,
}

impl RunnerRequest {
    /// The request for `trial` of `model` on a `device` target with those limits.
    pub fn new(
        model: &ModelSpec,
        trial: &TrialRequest,
        device: DeviceKind,
        gpu_capacity_bytes: Option<u64>,
        host_budget_bytes: Option<u64>,
    ) -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            model: model.clone(),
            knobs: trial.knobs,
            warmup_steps: trial.warmup_steps,
            timed_steps: trial.timed_steps,
            device,
            gpu_capacity_bytes,
            host_budget_bytes,
        }
    }

    /// The request as the one line a runner reads (no newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("requests always serialise")
    }
}

/// Who answered a trial: the framework the runner trains with, and where it ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerIdentity {
    /// The engine (`"pytorch"`): what plans record as their provenance, and what exports
    /// compare with the target tool's.
    pub engine: String,
    /// Its version, if the runner said.
    pub engine_version: Option<String>,
    /// The device as the runner saw it (`"NVIDIA H200"`), if it said.
    pub device: Option<String>,
}

/// A reply, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerReply {
    /// Who answered.
    pub identity: RunnerIdentity,
    /// Whether the runner can serve the next trial in the same process (it then reads the
    /// next request line); otherwise it exits and the next trial starts a new one.
    pub reusable: bool,
    /// What the trial found.
    pub answer: RunnerAnswer,
}

/// What a runner found.
#[derive(Debug, Clone, PartialEq)]
pub enum RunnerAnswer {
    /// The setting ran.
    Fits {
        /// Seconds of each timed step (all micro-batches of one optimizer step).
        step_times_s: Vec<f64>,
        /// The most device memory held at once, as it counts against the card.
        peak_gpu_bytes: u64,
        /// The most host memory held at once.
        peak_host_bytes: u64,
        /// Throughput as the runner counts it; by default tokens a step ÷ median step time.
        tokens_per_s: Option<f64>,
    },
    /// Memory ran out.
    OutOfMemory {
        /// Which memory.
        memory: MemoryKind,
        /// Where in the trial.
        phase: Phase,
    },
    /// This trial failed (an exception, a bad batch): infeasible at these knobs.
    Error {
        /// What happened.
        reason: String,
    },
    /// The runner cannot run this regime at any micro-batch (a library it lacks, a setting
    /// it does not implement): every trial of the regime would answer the same.
    Unsupported {
        /// Why.
        reason: String,
    },
}

/// A reply line that cannot be used.
#[derive(Debug)]
pub enum BadReply {
    /// The runner speaks another protocol version (the value found): no trial of it can be
    /// read, so the search stops.
    Version(String),
    /// Not a valid reply: this trial failed.
    Invalid(Error),
}

/// The fields every reply carries, beside its outcome's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Common {
    engine: String,
    #[serde(default)]
    engine_version: Option<String>,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    reusable: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FitsFields {
    step_times_s: Vec<f64>,
    peak_gpu_bytes: u64,
    peak_host_bytes: u64,
    #[serde(default)]
    tokens_per_s: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OutOfMemoryFields {
    memory: MemoryKind,
    #[serde(default)]
    phase: Option<Phase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonFields {
    reason: String,
}

/// The keys of [`Common`], split from the outcome's own.
const COMMON_KEYS: [&str; 4] = ["engine", "engine_version", "device", "reusable"];

/// Reads one line of a runner's stdout: `None` when it is not a reply (anything but a JSON
/// object with a `protocol` key: the runner's own output), else the reply or why it is bad.
pub fn parse_reply_line(line: &str) -> Option<std::result::Result<RunnerReply, BadReply>> {
    let trimmed = line.trim();
    if !trimmed.starts_with('{') {
        return None;
    }
    let serde_json::Value::Object(mut object) = serde_json::from_str(trimmed).ok()? else {
        return None;
    };
    let version = object.remove("protocol")?;
    if version.as_u64() != Some(u64::from(PROTOCOL_VERSION)) {
        return Some(Err(BadReply::Version(version.to_string())));
    }
    Some(reply_fields(object).map_err(BadReply::Invalid))
}

/// A reply's fields (its `protocol` taken): the outcome first, then the fields every reply
/// carries, then the outcome's own, then the engine's name; the first bad one is the error.
fn reply_fields(mut object: serde_json::Map<String, serde_json::Value>) -> Result<RunnerReply> {
    let outcome = object
        .remove("outcome")
        .ok_or_else(|| Error::invalid(WHAT, "outcome", "is missing"))?;
    let mut common = serde_json::Map::new();
    for key in COMMON_KEYS {
        if let Some(value) = object.remove(key) {
            common.insert(key.into(), value);
        }
    }
    let common: Common = crate::json::from_value(WHAT, common.into())?;
    let answer = answer(&outcome, serde_json::Value::Object(object))?;
    Ok(RunnerReply {
        identity: RunnerIdentity {
            engine: engine_name(&common.engine)?,
            engine_version: common.engine_version.map(text),
            device: common.device.map(text),
        },
        reusable: common.reusable,
        answer,
    })
}

/// The answer an `outcome` names, from the reply's fields beside the common ones.
fn answer(outcome: &serde_json::Value, rest: serde_json::Value) -> Result<RunnerAnswer> {
    Ok(match outcome.as_str() {
        Some("fits") => fits(crate::json::from_value(WHAT, rest)?)?,
        Some("out_of_memory") => {
            let f: OutOfMemoryFields = crate::json::from_value(WHAT, rest)?;
            RunnerAnswer::OutOfMemory {
                memory: f.memory,
                phase: f.phase.unwrap_or(Phase::ForwardBackward),
            }
        }
        Some("error") => RunnerAnswer::Error {
            reason: text(crate::json::from_value::<ReasonFields>(WHAT, rest)?.reason),
        },
        Some("unsupported") => RunnerAnswer::Unsupported {
            reason: text(crate::json::from_value::<ReasonFields>(WHAT, rest)?.reason),
        },
        _ => {
            return Err(Error::invalid(
                WHAT,
                "outcome",
                format!(
                "is {outcome}; expected \"fits\", \"out_of_memory\", \"error\" or \"unsupported\""
            ),
            ))
        }
    })
}

/// A fit, once every step time is seconds within bounds and the rate a finite number.
fn fits(f: FitsFields) -> Result<RunnerAnswer> {
    for (i, &t) in f.step_times_s.iter().enumerate() {
        if !(t.is_finite() && t > 0.0 && t <= MAX_STEP_TIME_S) {
            return Err(Error::invalid(
                WHAT,
                format!("step_times_s[{i}]"),
                format!("({t}) must be seconds above 0 and at most {MAX_STEP_TIME_S:e}"),
            ));
        }
    }
    if let Some(t) = f.tokens_per_s {
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::invalid(
                WHAT,
                "tokens_per_s",
                format!("({t}) must be a finite number, at least 0"),
            ));
        }
    }
    Ok(RunnerAnswer::Fits {
        step_times_s: f.step_times_s,
        peak_gpu_bytes: f.peak_gpu_bytes,
        peak_host_bytes: f.peak_host_bytes,
        tokens_per_s: f.tokens_per_s,
    })
}

/// The engine's name, trimmed: 1 to [`MAX_ENGINE_NAME_CHARS`] printable characters.
fn engine_name(engine: &str) -> Result<String> {
    let trimmed = engine.trim().to_string();
    if trimmed.is_empty()
        || trimmed.chars().count() > MAX_ENGINE_NAME_CHARS
        || trimmed.chars().any(char::is_control)
    {
        return Err(Error::invalid(
            WHAT,
            "engine",
            format!(
                "({:?}) must name the framework in 1 to {MAX_ENGINE_NAME_CHARS} printable characters, e.g. \"pytorch\"",
                engine
            ),
        ));
    }
    Ok(trimmed)
}

/// `s` without control characters, cut to [`MAX_TEXT_CHARS`].
fn text(s: String) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_TEXT_CHARS)
        .collect()
}

impl RunnerReply {
    /// The trial outcome this reply means for `knobs` of a model of `seq_len` tokens a
    /// sequence: a fit with its median and spread computed here from the step times, as for
    /// autotune's own trials; an error or an unsupported regime is a crash, which the search
    /// treats as infeasible.
    pub fn outcome(&self, knobs: &Knobs, seq_len: usize) -> Outcome {
        match &self.answer {
            RunnerAnswer::Fits {
                step_times_s,
                peak_gpu_bytes,
                peak_host_bytes,
                tokens_per_s,
            } => {
                let tokens = knobs.global_batch().saturating_mul(seq_len) as f64;
                let mut m = Measurement::from_step_times(
                    step_times_s,
                    tokens,
                    *peak_gpu_bytes,
                    *peak_host_bytes,
                );
                if let Some(t) = tokens_per_s {
                    m.tokens_per_s = *t;
                }
                Outcome::Fits(m)
            }
            RunnerAnswer::OutOfMemory { memory, phase } => Outcome::OutOfMemory {
                memory: *memory,
                phase: *phase,
            },
            RunnerAnswer::Error { reason } => Outcome::Crashed {
                reason: format!("trial runner: {reason}"),
            },
            RunnerAnswer::Unsupported { reason } => Outcome::Crashed {
                reason: unsupported_reason(knobs, reason),
            },
        }
    }
}

/// The crash reason of every trial of a regime the runner cannot run.
pub fn unsupported_reason(knobs: &Knobs, reason: &str) -> String {
    format!("trial runner cannot run {}: {reason}", knobs.regime())
}

#[cfg(test)]
mod tests;
