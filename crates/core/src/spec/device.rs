//! `DeviceSpec`: what the target machine is (GPU memory, host memory, link speed).
//!
//! A profile comes from a built-in name (`rtx4090-32g`, `h200`, `cpu`) or a JSON file. It
//! describes the hardware only; what the user allows of it is a [`Budget`](super::budget::Budget).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The kind of device training runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// An NVIDIA GPU driven through CUDA.
    Cuda,
    /// The host CPU; there is no device memory.
    Cpu,
}

/// A target machine.
///
/// JSON form (every field is required except `gpu_count`, `host_to_device_gbps` and `notes`,
/// unknown fields are rejected):
///
/// ```json
/// {"name": "rtx4090-32g", "kind": "cuda", "gpu_memory_bytes": 25757220864,
///  "host_memory_bytes": 34359738368, "host_to_device_gbps": 25.0, "notes": "..."}
/// ```
///
/// `gpu_count` (default 1, omitted when 1) is how many such GPUs the host has for data
/// parallelism; `gpu_memory_bytes` is per GPU and `host_memory_bytes` is shared by all of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Human name, used in plans and profiles.
    pub name: String,
    /// GPU or CPU.
    pub kind: DeviceKind,
    /// Total device memory in bytes of one GPU; `null` for a CPU.
    #[serde(default)]
    pub gpu_memory_bytes: Option<u64>,
    /// GPUs of this kind in the host, for data parallelism (1 on a CPU).
    #[serde(default = "one_gpu", skip_serializing_if = "is_one_gpu")]
    pub gpu_count: usize,
    /// Host memory in bytes available to training.
    pub host_memory_bytes: u64,
    /// Measured host-to-device copy bandwidth in GB/s (10^9 bytes), if known; `null` for a CPU.
    #[serde(default)]
    pub host_to_device_gbps: Option<f64>,
    /// Whether the GPU multiplies fp8 on its tensor cores (compute capability 8.9 or newer:
    /// RTX 40xx, L4, L40, H100, H200): where fp8 products may be searched (`--allow-fp8`).
    /// Absent means no.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8_tensor_cores: bool,
    /// Free text: where the numbers come from.
    #[serde(default)]
    pub notes: Option<String>,
}

/// Whether a GPU of compute capability `major.minor` multiplies fp8 on its tensor cores (see
/// [`DeviceSpec::fp8_tensor_cores`]): 8.9 (Ada) or newer. The one rule NVML's reports and the
/// CUDA device's attributes are read by.
pub fn has_fp8_tensor_cores_at(major: i32, minor: i32) -> bool {
    (major, minor) >= (8, 9)
}

fn one_gpu() -> usize {
    1
}

fn is_one_gpu(count: &usize) -> bool {
    *count == 1
}

/// The names accepted by [`DeviceSpec::builtin`].
pub const BUILTIN_DEVICES: [&str; 3] = ["rtx4090-32g", "h200", "cpu"];

/// The built-in profiles' JSON, embedded so the binary needs no data files.
const BUILTIN_JSON: [(&str, &str); 3] = [
    (
        "rtx4090-32g",
        include_str!("../../../../profiles/devices/rtx4090-32g.json"),
    ),
    (
        "h200",
        include_str!("../../../../profiles/devices/h200.json"),
    ),
    ("cpu", include_str!("../../../../profiles/devices/cpu.json")),
];

const WHAT: &str = "device spec";

impl DeviceSpec {
    /// A built-in profile by name (see [`BUILTIN_DEVICES`]).
    pub fn builtin(name: &str) -> Result<Self> {
        let json = BUILTIN_JSON
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, json)| *json)
            .ok_or_else(|| Error::UnknownName {
                what: WHAT,
                name: name.into(),
                known: BUILTIN_DEVICES.join(", "),
            })?;
        Self::from_json(json)
    }

    /// A built-in name, or else a path to a JSON profile (the rule of `ModelSpec::resolve`).
    pub fn resolve(name_or_path: &str) -> Result<Self> {
        let path = Path::new(name_or_path);
        if BUILTIN_DEVICES.contains(&name_or_path)
            || !(path.exists() || name_or_path.ends_with(".json"))
        {
            return Self::builtin(name_or_path);
        }
        Self::load(path)
    }

    /// Loads and validates a JSON profile; errors name the file and, when invalid, the field.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::input_file::read_to_string(path, crate::input_file::DOCUMENT_LIMIT)
            .map_err(|e| Error::file("cannot read device spec", path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            Error::InvalidSpec { .. } => Error::file(
                "invalid device spec",
                path,
                Box::new(e) as Box<dyn std::error::Error + Send + Sync>,
            ),
            other => other,
        })
    }

    /// Parses and validates a JSON profile.
    pub fn from_json(text: &str) -> Result<Self> {
        let profile: Self = crate::json::from_str(WHAT, text)?;
        profile.validate()?;
        Ok(profile)
    }

    /// Checks that the numbers describe a machine that can train.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, problem: &str| Err(Error::invalid(WHAT, field, problem));
        if self.name.trim().is_empty() {
            return bad("name", "must not be empty");
        }
        match (self.kind, self.gpu_memory_bytes) {
            (DeviceKind::Cuda, None | Some(0)) => {
                return bad(
                    "gpu_memory_bytes",
                    "must be a positive byte count for a cuda device",
                )
            }
            (DeviceKind::Cpu, Some(_)) => {
                return bad(
                    "gpu_memory_bytes",
                    "must be null for a cpu device (it has no device memory)",
                )
            }
            _ => {}
        }
        if self.host_memory_bytes == 0 {
            return bad("host_memory_bytes", "must be a positive byte count");
        }
        match (self.kind, self.gpu_count) {
            (_, 0) => return bad("gpu_count", "must be at least 1 (leave it out for one GPU)"),
            (_, n) if n > crate::knobs::MAX_DATA_PARALLEL => {
                return Err(Error::invalid(
                    WHAT,
                    "gpu_count",
                    format!("({n}) must be at most {}", crate::knobs::MAX_DATA_PARALLEL),
                ))
            }
            (DeviceKind::Cpu, n) if n > 1 => {
                return bad(
                    "gpu_count",
                    "must be 1 (or absent) for a cpu device; data parallelism needs cuda GPUs",
                )
            }
            _ => {}
        }
        if let Some(gbps) = self.host_to_device_gbps {
            if !(gbps > 0.0 && gbps.is_finite()) {
                return bad(
                    "host_to_device_gbps",
                    "must be a positive number of GB/s, or null",
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_tensor_cores_start_at_compute_capability_8_9() {
        let rows = [
            ((8, 0), false),
            ((8, 6), false),
            ((8, 9), true),
            ((9, 0), true),
            ((12, 0), true),
        ];
        for ((major, minor), has) in rows {
            assert_eq!(
                has_fp8_tensor_cores_at(major, minor),
                has,
                "{major}.{minor}"
            );
        }
    }

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn builtins_are_valid_and_sized_as_documented() {
        for name in BUILTIN_DEVICES {
            let profile = DeviceSpec::builtin(name).unwrap();
            assert_eq!(profile.name, name);
        }
        let rtx = DeviceSpec::builtin("rtx4090-32g").unwrap();
        assert_eq!(rtx.gpu_memory_bytes, Some(24564 * MIB));
        assert_eq!(rtx.host_memory_bytes, 32 * GIB);
        let h200 = DeviceSpec::builtin("h200").unwrap();
        assert_eq!(h200.gpu_memory_bytes, Some(143771 * MIB));
        assert_eq!(h200.host_memory_bytes, 128 * GIB);
        let cpu = DeviceSpec::builtin("cpu").unwrap();
        assert_eq!((cpu.kind, cpu.gpu_memory_bytes), (DeviceKind::Cpu, None));
        assert_eq!(cpu.host_memory_bytes, 24 * GIB);
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        match DeviceSpec::resolve("a100") {
            Err(Error::UnknownName { known, .. }) => assert!(known.contains("rtx4090-32g")),
            other => panic!("expected an unknown name, got {other:?}"),
        }
    }

    #[test]
    fn bad_profiles_name_the_field() {
        let field = |json: &str| match DeviceSpec::from_json(json) {
            Err(Error::InvalidSpec { field, .. }) => field,
            other => panic!("expected an invalid profile, got {other:?}"),
        };
        let ok =
            r#""name": "x", "kind": "cuda", "gpu_memory_bytes": 1024, "host_memory_bytes": 2048"#;
        assert!(DeviceSpec::from_json(&format!("{{{ok}}}")).is_ok());
        assert_eq!(field(&format!(r#"{{{ok}, "gpu_mem": 3}}"#)), "gpu_mem");
        assert_eq!(
            field(r#"{"name": "x", "kind": "cuda", "host_memory_bytes": 1}"#),
            "gpu_memory_bytes"
        );
        assert_eq!(
            field(r#"{"name": "x", "kind": "cpu", "gpu_memory_bytes": 5, "host_memory_bytes": 1}"#),
            "gpu_memory_bytes"
        );
        assert_eq!(
            field(r#"{"name": "x", "kind": "cpu", "host_memory_bytes": 0}"#),
            "host_memory_bytes"
        );
        assert_eq!(
            field(&format!(r#"{{{ok}, "host_to_device_gbps": -1}}"#)),
            "host_to_device_gbps"
        );
        assert_eq!(
            field(r#"{"name": "x", "kind": "cpu"}"#),
            "host_memory_bytes"
        );
        assert_eq!(field(&format!(r#"{{{ok}, "gpu_count": 0}}"#)), "gpu_count");
        assert_eq!(
            field(r#"{"name": "x", "kind": "cpu", "host_memory_bytes": 1, "gpu_count": 2}"#),
            "gpu_count"
        );
    }

    #[test]
    fn gpu_count_defaults_to_one_and_is_written_only_when_larger() {
        let one = DeviceSpec::builtin("h200").unwrap();
        assert_eq!(one.gpu_count, 1);
        assert!(!serde_json::to_string(&one).unwrap().contains("gpu_count"));
        let eight = DeviceSpec {
            gpu_count: 8,
            ..one
        };
        let json = serde_json::to_string(&eight).unwrap();
        assert!(json.contains(r#""gpu_count":8"#), "{json}");
        assert_eq!(DeviceSpec::from_json(&json).unwrap(), eight);
    }

    #[test]
    fn files_round_trip_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("box.json");
        let profile = DeviceSpec::builtin("rtx4090-32g").unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&profile).unwrap()).unwrap();
        assert_eq!(
            DeviceSpec::resolve(path.to_str().unwrap()).unwrap(),
            profile
        );

        std::fs::write(
            &path,
            r#"{"name": "x", "kind": "tpu", "host_memory_bytes": 1}"#,
        )
        .unwrap();
        let err = DeviceSpec::load(&path).unwrap_err();
        assert!(
            matches!(&err, Error::File { path: p, .. } if p == &path),
            "{err:?}"
        );
        let missing = dir.path().join("missing.json");
        assert!(matches!(
            DeviceSpec::resolve(missing.to_str().unwrap()),
            Err(Error::File { .. })
        ));
    }
}
