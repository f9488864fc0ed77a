//! `Profile`: the trials a search ran on a real machine, as a versioned JSON document.
//!
//! # Wire format (schema version 2)
//!
//! A profile file holds one JSON object; recorded profiles live under [`RECORDED_DIR`].
//! Readers check `kind` first (so a plan or any other JSON file is refused as "not a profile"
//! rather than reported field by field), then `schema_version`, then reject unknown fields.
//! Units are those of plans: bytes as integers, seconds, tokens per second.
//!
//! Version 1 differs only in where the machine's facts are: inside `space`, as its fields
//! `offload_host_floor_s`, `target_link_gbps` and `memory_prior`, with no `facts`. A reader
//! moves them into `facts` (see [`Profile::from_json`]), so a recording of either version
//! replays exactly as it was searched.
//!
//! | field | type | meaning |
//! |---|---|---|
//! | `schema_version` | integer | `2` for this format (`1` for the earlier one, still read). |
//! | `kind` | string | Always `"autotune-profile"`. |
//! | `tool` | object | `{"name": "autotune", "version": "0.1.0"}`: what recorded the profile. |
//! | `candle_version` | string | The candle release the trials ran on (the runtime's `backend::CANDLE_VERSION`). |
//! | `device` | object | `profile` (the target `DeviceSpec` the trials emulated), `name` (the device as detected, e.g. `"NVIDIA H200"` or `"cpu"`), `memory_bytes` (its total memory; `null` on a CPU or when unknown), `driver`, `cuda` (driver and CUDA versions, or `null`). |
//! | `model` | object | The model spec (`ModelSpec` JSON, as in plans). |
//! | `budget` | object | The limits the trials ran under: `gpu_bytes` (the emulated device capacity; `null` on a CPU), `host_bytes` (the host heap limit), `headroom`. |
//! | `space` | object | The search space that asked for the trials (`SearchSpace` JSON: regimes, micro-batch bounds, global batch, trial lengths, trial limit, saturation gain), so a replay can ask the same ones. |
//! | `facts` | object | What the search assumed of the machine and the target (`MachineFacts` JSON, each field absent when unknown): `offload_host_floor_s` (the host update's measured floor under an offloaded step), `target_link_gbps` (the target's host link, which offloaded trials were retimed for), `memory_prior` (an analytic memory law per regime of `space`, in its order), `accumulation_extra` (per regime of `space`, a list of `{micro_batch, bytes}`: what accumulation adds to the device peak at each micro-batch whose plan accumulates, by the estimate). |
//! | `created_unix_s` | integer | When the profile was recorded, seconds since the Unix epoch. |
//! | `probes` | array | Every trial in the order it ran, as in a plan's `evidence`: the request's knobs and trial lengths, the outcome (`fits` with `peak_gpu_bytes`, `peak_host_bytes`, `step_time_median_s`, `step_time_spread`, `timed_steps`, `tokens_per_s`; `out_of_memory` with `memory` and `phase`; or `crashed` with `reason`), and `wall_s`. |
//! | `chosen` | object or null | The knobs the search chose, or `null` when nothing was feasible. |
//! | `engine` | string | The framework a trial runner trained with (`"pytorch"`), for a profile recorded through one (`tune --backend exec`); absent for autotune's own engine. Replays of it make plans of that engine. `candle_version` is then the recording autotune's, not what the trials ran on. |
//! | `engine_version` | string | That framework's version, when the runner reported it; absent otherwise. |
//! | `allocator` | string | The `PYTORCH_CUDA_ALLOC_CONF` the runner's trials ran under (`""`: PyTorch's default), when autotune set it; `check --backend exec` runs the runner under it again. |
//! | `spec_hash` | string | SHA-256 of the model spec and the target device spec as recorded (see [`spec_hash`]); a reader recomputes it and refuses a profile whose model or device was edited after recording. Profiles recorded before it have none, and are read unchecked. |

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::knobs::Knobs;
use crate::plan::Tool;
use crate::search::{MachineFacts, SearchDriver, SearchOutcome, SearchSpace};
use crate::spec::budget::Budget;
use crate::spec::device::{DeviceKind, DeviceSpec};
use crate::spec::model::ModelSpec;
use crate::trial::TrialResult;
use crate::{Error, Result};

/// The profile format this version writes; it also reads [`PROFILE_SCHEMA_VERSION_1`].
pub const PROFILE_SCHEMA_VERSION: u32 = 2;

/// The earlier format, whose space held the machine's facts; read and migrated on load.
pub const PROFILE_SCHEMA_VERSION_1: u32 = 1;

/// The fixed `kind` tag of a profile document.
pub const PROFILE_KIND: &str = "autotune-profile";

/// Where recorded profiles are kept, relative to the project root.
pub const RECORDED_DIR: &str = "profiles/recorded";

const WHAT: &str = "profile";

/// Trials recorded on one machine for one model; see the module docs for the JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Always [`PROFILE_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Always [`PROFILE_KIND`].
    pub kind: String,
    /// What recorded the profile.
    pub tool: Tool,
    /// The candle release the trials ran on.
    pub candle_version: String,
    /// The machine the trials ran on.
    pub device: RecordedDevice,
    /// The model trained.
    pub model: ModelSpec,
    /// The limits the trials ran under (the prober enforced their full bytes).
    pub budget: Budget,
    /// The search space that asked for the trials.
    pub space: SearchSpace,
    /// What the search assumed of the machine and the target.
    pub facts: MachineFacts,
    /// Seconds since the Unix epoch when the profile was recorded (supplied by the caller).
    pub created_unix_s: u64,
    /// Every trial in the order it ran (`probes` in the file, its name since version 1).
    #[serde(rename = "probes")]
    pub trials: Vec<TrialResult>,
    /// The knobs the search chose, if any.
    pub chosen: Option<Knobs>,
    /// [`spec_hash`] of `model` and `device.target` when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_hash: Option<String>,
    /// The framework a trial runner measured with; `None` for autotune's own engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// That framework's version, if the runner reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_version: Option<String>,
    /// The allocator setting the runner's trials ran under (`PYTORCH_CUDA_ALLOC_CONF`, empty
    /// for PyTorch's default), which a re-measurement runs under again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<String>,
}

/// What identifies the setup a profile's trials measured: the SHA-256, lowercase hex, of the
/// model spec and the target device spec as JSON (keys sorted, so that it depends only on their
/// values). Two recordings compare only if their hashes agree.
pub fn spec_hash(model: &ModelSpec, target: &DeviceSpec) -> String {
    use sha2::{Digest, Sha256};
    let value = serde_json::json!({"model": model, "device": target});
    let bytes = serde_json::to_vec(&value).expect("specs always serialise");
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks the schema version of `value`, a profile document, and migrates a version 1 profile
/// to the current version.
fn read_version(value: &mut serde_json::Value) -> Result<()> {
    let version = value.get("schema_version");
    let found = version.map_or("missing".to_string(), |v| format!("{v}"));
    match version.and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(PROFILE_SCHEMA_VERSION) => Ok(()),
        Some(v) if v == u64::from(PROFILE_SCHEMA_VERSION_1) => migrate_version_1(value),
        _ => Err(Error::invalid(
            WHAT,
            "schema_version",
            format!(
                "is {found}, but {} {} reads only versions {PROFILE_SCHEMA_VERSION_1} and \
                 {PROFILE_SCHEMA_VERSION}; record the profile again or use the autotune that \
                 wrote it",
                env!("CARGO_PKG_NAME"),
                env!("CARGO_PKG_VERSION")
            ),
        )),
    }
}

/// `value`, a version 1 profile, as version 2: the machine's facts its `space` held move into
/// `facts`, and its version becomes [`PROFILE_SCHEMA_VERSION`]. Anything else is left for the
/// field-by-field reading to judge.
fn migrate_version_1(value: &mut serde_json::Value) -> Result<()> {
    let Some(object) = value.as_object_mut() else {
        return Ok(());
    };
    if object.contains_key("facts") {
        return Err(Error::invalid(
            WHAT,
            "facts",
            "is a field of schema version 2; a version 1 profile keeps its facts in `space`",
        ));
    }
    let mut facts = serde_json::Map::new();
    if let Some(space) = object.get_mut("space").and_then(|s| s.as_object_mut()) {
        for field in MachineFacts::FIELDS {
            if let Some(fact) = space.remove(field) {
                facts.insert(field.to_string(), fact);
            }
        }
    }
    object.insert("facts".into(), facts.into());
    object.insert("schema_version".into(), PROFILE_SCHEMA_VERSION.into());
    Ok(())
}

/// The machine a profile was recorded on: the target it emulated and what was detected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedDevice {
    /// The target device the trials emulated (capacity, host memory); `profile` in the file.
    #[serde(rename = "profile")]
    pub target: DeviceSpec,
    /// The device as detected (`"NVIDIA H200"`, `"cpu"`).
    pub name: String,
    /// Total memory of the detected device in bytes; `None` on a CPU or when unknown.
    pub memory_bytes: Option<u64>,
    /// Driver version, if known.
    pub driver: Option<String>,
    /// CUDA version, if known.
    pub cuda: Option<String>,
}

impl RecordedDevice {
    /// A device known only by its target profile and detected name; the caller fills in the
    /// memory and versions it can detect.
    pub fn new(target: DeviceSpec, name: impl Into<String>) -> Self {
        Self {
            target,
            name: name.into(),
            memory_bytes: None,
            driver: None,
            cuda: None,
        }
    }
}

impl Profile {
    /// The profile of a finished search (chosen or not). `driver` must be the one that ran it;
    /// `candle_version` is the release the trials ran on, and `created_unix_s` the caller's
    /// clock (this function reads none).
    pub fn from_search(
        driver: &SearchDriver,
        outcome: &SearchOutcome,
        model: &ModelSpec,
        device: RecordedDevice,
        candle_version: &str,
        created_unix_s: u64,
    ) -> Self {
        let hash = spec_hash(model, &device.target);
        Self {
            schema_version: PROFILE_SCHEMA_VERSION,
            kind: PROFILE_KIND.into(),
            tool: Tool::current(),
            candle_version: candle_version.into(),
            device,
            model: model.clone(),
            budget: *driver.budget(),
            space: driver.space().clone(),
            facts: driver.facts().clone(),
            created_unix_s,
            trials: outcome.history.clone(),
            chosen: outcome.chosen(),
            spec_hash: Some(hash),
            engine: None,
            engine_version: None,
            allocator: None,
        }
    }

    /// The profile of trials a trial runner measured with `engine` (its `version`, if known).
    pub fn measured_by(mut self, engine: &str, version: Option<&str>) -> Self {
        self.engine = Some(engine.to_string());
        self.engine_version = version.map(str::to_string);
        self
    }

    /// The profile of trials run under the allocator `setting` (see [`Profile::allocator`]).
    pub fn under_allocator(mut self, setting: Option<&str>) -> Self {
        self.allocator = setting.map(str::to_string);
        self
    }

    /// The engine the trials measured: the trial runner's, or autotune's own
    /// ([`crate::plan::Provenance::OWN_ENGINE`]).
    pub fn engine_name(&self) -> &str {
        self.engine
            .as_deref()
            .unwrap_or(crate::plan::Provenance::OWN_ENGINE)
    }

    /// A search driver over the recorded space, facts and budget: the driver a replay needs
    /// to ask the recorded trials again (see [`ReplayProber`](super::replay::ReplayProber)).
    pub fn driver(&self) -> Result<SearchDriver> {
        SearchDriver::new(self.space.clone(), self.facts.clone(), self.budget)
    }

    /// The conventional file of this profile: `RECORDED_DIR/<device spec>/<model>.json`
    /// under `root`, with names reduced to characters safe in a path.
    pub fn default_path(&self, root: &Path) -> PathBuf {
        let safe = |s: &str| -> String {
            s.chars()
                .map(|c| match c {
                    'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '-' | '_' => c,
                    _ => '_',
                })
                .collect()
        };
        root.join(RECORDED_DIR)
            .join(safe(&self.device.target.name))
            .join(format!("{}.json", safe(&self.model.name)))
    }

    /// Reads and validates a profile file. Errors name the file and say what is wrong: an
    /// unreadable or truncated file, a JSON document that is not a profile, another schema
    /// version, or a missing, unknown or invalid field.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT)
            .map_err(|e| Error::file("cannot read profile", path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            Error::InvalidSpec { .. } => Error::file(
                "invalid profile",
                path,
                Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
            ),
            other => other,
        })
    }

    /// Parses and validates a profile: the `kind` tag first, then the schema version, then
    /// the fields. A version 1 profile is read as version 2: the facts its space held move
    /// into `facts`.
    pub fn from_json(text: &str) -> Result<Self> {
        let mut value = crate::json::parse_value(WHAT, text)?;
        let object = value
            .as_object()
            .ok_or_else(|| Error::invalid(WHAT, crate::json::DOCUMENT, "must be a JSON object"))?;
        match object.get("kind") {
            Some(kind) if kind.as_str() == Some(PROFILE_KIND) => {}
            found => {
                // A plan is the JSON file most likely to be passed by mistake: say so.
                let looks_like_plan =
                    object.contains_key("evidence") && object.contains_key("knobs");
                let what = if looks_like_plan {
                    "; this looks like an autotune plan, not a recorded profile".to_string()
                } else {
                    String::new()
                };
                let found = found.map_or("missing".to_string(), |k| format!("{k}"));
                return Err(Error::invalid(
                    WHAT,
                    "kind",
                    format!(
                        "is {found}, expected \"{PROFILE_KIND}\": not an autotune profile{what}"
                    ),
                ));
            }
        }
        read_version(&mut value)?;
        let profile: Self = crate::json::from_value(WHAT, value)?;
        profile.validate()?;
        Ok(profile)
    }

    /// Checks the parts against each other: valid model, device, budget, space and knobs, and a
    /// device limit exactly when the target has a GPU.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.device.target.validate()?;
        self.budget.validate()?;
        self.space.validate()?;
        self.facts.validate(self.space.regimes.len())?;
        for (i, probe) in self.trials.iter().enumerate() {
            let at = format!("probes[{i}].");
            probe.validate(WHAT, &at)?;
            crate::spec::limits::check_knobs(
                &self.model,
                &probe.request.knobs,
                WHAT,
                &format!("{at}request.knobs."),
            )?;
        }
        if let Some(chosen) = &self.chosen {
            chosen.validate(WHAT, "chosen.")?;
        }
        if let Some(engine) = &self.engine {
            let max = crate::trial_protocol::MAX_ENGINE_NAME_CHARS;
            if engine.trim().is_empty() || engine.chars().count() > max {
                return Err(Error::invalid(
                    WHAT,
                    "engine",
                    format!("({engine:?}) must name a framework in 1 to {max} characters, or be absent for autotune's own engine"),
                ));
            }
        }
        if let Some(recorded) = &self.spec_hash {
            let now = spec_hash(&self.model, &self.device.target);
            if *recorded != now {
                return Err(Error::invalid(
                    WHAT,
                    "spec_hash",
                    format!(
                        "is {recorded}, but the profile's model and device spec hash to {now}: they were edited after the trials were recorded, which then measured another setup; record the profile again"
                    ),
                ));
            }
        }
        let has_gpu = self.device.target.kind == DeviceKind::Cuda;
        if self.budget.gpu_bytes.is_some() != has_gpu {
            return Err(Error::invalid(
                WHAT,
                "budget.gpu_bytes",
                "must be null exactly when the device spec has no GPU",
            ));
        }
        Ok(())
    }

    /// Why `other`'s trials do not measure what this profile's do, if they do not: another
    /// engine, another model spec (the fields that differ are named) or another target device.
    pub fn setup_differs(&self, other: &Profile) -> Option<String> {
        if self.engine_name() != other.engine_name() {
            return Some(format!(
                "it was measured on the {} engine, this one on the {} engine",
                other.engine_name(),
                self.engine_name()
            ));
        }
        if spec_hash(&self.model, &self.device.target)
            == spec_hash(&other.model, &other.device.target)
        {
            return None;
        }
        if self.model != other.model {
            let (a, b) = (
                serde_json::to_value(&self.model).unwrap_or_default(),
                serde_json::to_value(&other.model).unwrap_or_default(),
            );
            let fields: Vec<String> = a
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| b.get(k.as_str()) != Some(v))
                .map(|(k, v)| {
                    format!(
                        "{k} {v} vs {}",
                        b.get(k.as_str()).unwrap_or(&serde_json::Value::Null)
                    )
                })
                .collect();
            return Some(format!(
                "it was recorded for another model spec ({})",
                fields.join(", ")
            ));
        }
        Some(format!(
            "it was recorded for another target device (`{}` vs `{}`)",
            self.device.target.name, other.device.target.name
        ))
    }

    /// The profile as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile always serialises")
    }

    /// Writes the profile atomically, creating its directory: to a temporary file in the same
    /// directory, then renamed over `path`, so a reader never sees a half-written profile.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::atomic_file::write(path, format!("{}\n", self.to_json()).as_bytes())
            .map_err(|e| Error::file("cannot write profile", path, e))
    }
}
