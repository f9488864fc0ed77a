//! The trial protocol: how autotune asks any program, a *trial runner*, to measure one setting,
//! and how it reads the answer. `docs/trial-protocol.md` is the reference for runner authors;
//! this module is its implementation on autotune's side.
//!
//! autotune writes a [`RunnerRequest`] as one JSON line on the runner's stdin and reads one
//! reply line from its stdout, among whatever else the runner prints there: the reply is the
//! line that is a JSON object with a `protocol` key ([`parse_reply_line`]). Every request
//! carries an `id`; a reply of version 2 ([`PROTOCOL_VERSION`]) echoes it, so that a reply to
//! another request (a duplicate, a late one) is never taken for this trial's
//! ([`BadReply::AnotherRequest`]). A reply of version 1 carries no id and is matched by order.
//! A reply maps to a trial [`Outcome`] ([`RunnerReply::outcome`]) once its numbers are
//! physically possible; so does everything else a runner can do (crash, hang, print nonsense),
//! which the process side (`autotune::probe::exec`) turns into outcomes.
//!
//! Only a runner that speaks another version of the protocol is an error ([`BadReply::Version`]):
//! every one of its trials would fail alike, so the search stops and says so.

pub mod allocator;
mod non_finite;

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::spec::device::DeviceKind;
use crate::spec::model::ModelSpec;
use crate::trial::{
    Measurement, MemoryKind, Outcome, Phase, TrialRequest, MAX_STEP_TIME_S, MAX_TOKENS_PER_S,
    MAX_TRIAL_STEPS, MIN_STEP_TIME_S,
};
use crate::{Error, Result};

/// The newest protocol version this autotune speaks: a reply may be of this version (it echoes
/// its request's `id`) or of version 1.
pub const PROTOCOL_VERSION: u32 = 2;

/// The version requests say they are: a request of version 2 is one of version 1 with an
/// `id`, which runners of version 1 do not read, so they keep working unchanged.
pub const REQUEST_PROTOCOL_VERSION: u32 = 1;

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
    /// Always [`REQUEST_PROTOCOL_VERSION`].
    pub protocol: u32,
    /// This request among all those of one search: a reply of version 2 echoes it.
    pub id: u64,
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
    /// Request `id`: `trial` of `model` on a `device` target with those limits.
    pub fn new(
        id: u64,
        model: &ModelSpec,
        trial: &TrialRequest,
        device: DeviceKind,
        gpu_capacity_bytes: Option<u64>,
        host_budget_bytes: Option<u64>,
    ) -> Self {
        Self {
            protocol: REQUEST_PROTOCOL_VERSION,
            id,
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
    /// A reply to another request (the id it echoes): a duplicate or a late reply, which is
    /// not this trial's and is skipped.
    AnotherRequest(u64),
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

/// Reads one line of a runner's stdout, written after request `request_id`: `None` when it is
/// not a reply (anything but a JSON object with a `protocol` key: the runner's own output),
/// else the reply or why it cannot be this request's.
pub fn parse_reply_line(
    line: &str,
    request_id: u64,
) -> Option<std::result::Result<RunnerReply, BadReply>> {
    let trimmed = line.trim();
    if !trimmed.starts_with('{') {
        return None;
    }
    let mut object = match serde_json::from_str(trimmed) {
        Ok(serde_json::Value::Object(object)) => object,
        Ok(_) => return None,
        Err(_) => return non_finite_reply(trimmed, request_id),
    };
    let version = object.remove("protocol")?;
    Some(
        addressed(&version, &mut object, request_id)
            .and_then(|()| reply_fields(object).map_err(BadReply::Invalid)),
    )
}

/// Checks that a reply (its `protocol` and `id` taken from `object`) is of a version this
/// autotune reads, and answers request `request_id`.
fn addressed(
    version: &serde_json::Value,
    object: &mut serde_json::Map<String, serde_json::Value>,
    request_id: u64,
) -> std::result::Result<(), BadReply> {
    match version.as_u64() {
        Some(1) => Ok(()),
        Some(v) if v == u64::from(PROTOCOL_VERSION) => {
            let id = object.remove("id");
            match id.as_ref().and_then(serde_json::Value::as_u64) {
                Some(id) if id == request_id => Ok(()),
                Some(id) => Err(BadReply::AnotherRequest(id)),
                None => Err(BadReply::Invalid(Error::invalid(
                    WHAT,
                    "id",
                    format!(
                        "is {}; a reply of protocol {PROTOCOL_VERSION} echoes its request's \
                         `id` (here {request_id})",
                        id.map_or("missing".to_string(), |v| v.to_string())
                    ),
                ))),
            }
        }
        _ => Err(BadReply::Version(version.to_string())),
    }
}

/// A reply line that is JSON but for a `NaN` or an `Infinity` (as Python writes a float that
/// is not finite): refused at once, naming the field, not skipped as output.
fn non_finite_reply(
    line: &str,
    request_id: u64,
) -> Option<std::result::Result<RunnerReply, BadReply>> {
    let (mut object, field, token) = non_finite::read_marked(line)?;
    let version = object.remove("protocol")?;
    if let Err(not_this) = addressed(&version, &mut object, request_id) {
        return Some(Err(not_this));
    }
    Some(Err(BadReply::Invalid(Error::invalid(
        WHAT,
        field,
        format!(
            "is {token}, which is no JSON number; a trial that measured no finite value \
             answers \"outcome\": \"error\" with a reason"
        ),
    ))))
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

/// A fit, once there are step times, each seconds within physical bounds, and the rate a
/// finite number within them too.
fn fits(f: FitsFields) -> Result<RunnerAnswer> {
    if f.step_times_s.is_empty() || f.step_times_s.len() > MAX_TRIAL_STEPS {
        return Err(Error::invalid(
            WHAT,
            "step_times_s",
            format!(
                "has {} step times; a fit reports the seconds of each timed step, 1 to \
                 {MAX_TRIAL_STEPS} of them",
                f.step_times_s.len()
            ),
        ));
    }
    for (i, &t) in f.step_times_s.iter().enumerate() {
        if !(t.is_finite() && (MIN_STEP_TIME_S..=MAX_STEP_TIME_S).contains(&t)) {
            return Err(Error::invalid(
                WHAT,
                format!("step_times_s[{i}]"),
                format!("({t}) must be seconds from {MIN_STEP_TIME_S:e} to {MAX_STEP_TIME_S:e}"),
            ));
        }
    }
    if let Some(t) = f.tokens_per_s {
        if !(t.is_finite() && (0.0..=MAX_TOKENS_PER_S).contains(&t)) {
            return Err(Error::invalid(
                WHAT,
                "tokens_per_s",
                format!("({t}) must be a number from 0 to {MAX_TOKENS_PER_S:e}"),
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
    /// treats as infeasible. A fit whose throughput is beyond [`MAX_TOKENS_PER_S`] is an
    /// invalid reply, naming its step times.
    pub fn outcome(&self, knobs: &Knobs, seq_len: usize) -> Result<Outcome> {
        Ok(match &self.answer {
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
                if m.tokens_per_s > MAX_TOKENS_PER_S {
                    return Err(Error::invalid(
                        WHAT,
                        "step_times_s",
                        format!(
                            "(median {:e} s) makes {tokens} tokens a step {:e} tokens/s, \
                             above the physical bound {MAX_TOKENS_PER_S:e}",
                            m.step_time_median_s, m.tokens_per_s
                        ),
                    ));
                }
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
        })
    }
}

/// The crash reason of every trial of a regime the runner cannot run.
pub fn unsupported_reason(knobs: &Knobs, reason: &str) -> String {
    format!("trial runner cannot run {}: {reason}", knobs.regime())
}

#[cfg(test)]
mod tests;
