//! `Budget`: how much of a device's memory a plan may use, and byte-size parsing for flags.
//!
//! A [`DeviceSpec`] says what the hardware has; a budget says what the user allows of it and
//! keeps a safety margin ([`Budget::headroom`]) between the measured peak and the limit.

use serde::{Deserialize, Serialize};

use super::device::DeviceSpec;
use crate::trial::{Measurement, MemoryKind};
use crate::{Error, Result};

/// Memory a plan may use.
///
/// JSON form: `{"gpu_bytes": 25757220864, "host_bytes": 34359738368, "headroom": 0.05}`
/// (`gpu_bytes` is `null` on a CPU; unknown fields are rejected).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Device memory limit in bytes; `null` when training runs on the CPU.
    pub gpu_bytes: Option<u64>,
    /// Host memory limit in bytes.
    pub host_bytes: u64,
    /// Fraction of each limit kept free: a setting is feasible only if its measured peak stays
    /// within `(1 − headroom) ×` the limit. In `[0, 1)`.
    pub headroom: f64,
}

impl Budget {
    /// The default headroom: 5 % of each limit is kept free.
    ///
    /// Why 5 %: a trial measures a few steps, while a full run also meets allocator fragmentation,
    /// evaluation and checkpoint passes, and longer-lived allocations; "the finder's batch size
    /// OOMs later" is the most common complaint about batch-size finders. The peers converge on
    /// about this margin: Lightning's binary-search finder keeps a 5 % `margin` (v2.6), and
    /// DeepSpeed's autotuner trials 0.95 × its computed maximum micro-batch. Larger margins (20 %
    /// in batch-probe, 40 % in Ultralytics) protect estimators; ours is a measured peak, and the
    /// chosen setting is re-run once before it is accepted.
    pub const DEFAULT_HEADROOM: f64 = 0.05;

    /// The whole device and host memory of `device`, with the default headroom.
    pub fn from_device(device: &DeviceSpec) -> Self {
        Self {
            gpu_bytes: device.gpu_memory_bytes,
            host_bytes: device.host_memory_bytes,
            headroom: Self::DEFAULT_HEADROOM,
        }
    }

    /// Checks the headroom is a fraction and the host limit is positive.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.headroom) {
            return Err(Error::invalid(
                "budget",
                "headroom",
                format!("({}) must be in [0, 1)", self.headroom),
            ));
        }
        if self.host_bytes == 0 {
            return Err(Error::invalid(
                "budget",
                "host_bytes",
                "must be a positive byte count",
            ));
        }
        if self.gpu_bytes == Some(0) {
            return Err(Error::invalid(
                "budget",
                "gpu_bytes",
                "must be a positive byte count, or null on a CPU",
            ));
        }
        Ok(())
    }

    /// Device bytes a feasible setting may peak at; `None` on a CPU.
    pub fn usable_gpu_bytes(&self) -> Option<u64> {
        self.gpu_bytes.map(|b| self.usable(b))
    }

    /// Host bytes a feasible setting may peak at.
    pub fn usable_host_bytes(&self) -> u64 {
        self.usable(self.host_bytes)
    }

    fn usable(&self, bytes: u64) -> u64 {
        // Rounded down so that "usable" never exceeds the stated margin.
        (bytes as f64 * (1.0 - self.headroom)).floor() as u64
    }

    /// Whether a measured peak stays within the usable bytes of both memories.
    pub fn fits(&self, measurement: &Measurement) -> bool {
        self.exceeded(measurement).is_none()
    }

    /// The peak of the memory training runs in under this budget: the GPU's, or the host's
    /// where there is no GPU.
    pub fn training_peak(&self, measurement: &Measurement) -> u64 {
        match self.gpu_bytes {
            Some(_) => measurement.peak_gpu_bytes,
            None => measurement.peak_host_bytes,
        }
    }

    /// Which memory a measured peak exceeds the usable bytes of (device first), if any.
    pub fn exceeded(&self, measurement: &Measurement) -> Option<MemoryKind> {
        if let Some(usable) = self.usable_gpu_bytes() {
            if measurement.peak_gpu_bytes > usable {
                return Some(MemoryKind::Gpu);
            }
        }
        (measurement.peak_host_bytes > self.usable_host_bytes()).then_some(MemoryKind::Host)
    }
}

/// Bytes for people, the one way the tool writes them: the largest binary unit that keeps the
/// number at least 1, with two decimals ("22.43 GiB", "40.00 MiB"), or whole bytes below 1 KiB.
/// [`parse_bytes`] reads every form this writes.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Parses a byte size for a command-line flag: `123`, `500MiB`, `24GiB`, `1.5GB`, `8g`.
///
/// Units are case-insensitive: `B`; decimal `KB MB GB TB` (powers of 1000); binary
/// `KiB MiB GiB TiB` (powers of 1024). A bare `K M G T` means the binary unit, as in `docker
/// --memory` and `ulimit`. A space between number and unit is allowed. Fractions are rounded
/// down to whole bytes.
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let err = |why: &str| {
        format!("invalid byte size `{text}`: {why} (examples: 24GiB, 500MiB, 1.5GB, 123)")
    };
    if number.is_empty() {
        return Err(err("expected a number first"));
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        _ => return Err(err("unknown unit")),
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(multiplier)
            .ok_or_else(|| err("too large"));
    }
    let value: f64 = number.parse().map_err(|_| err("not a number"))?;
    let bytes = value * multiplier as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(bytes.floor() as u64)
}

#[cfg(test)]
mod tests {

    #[test]
    fn bytes_are_written_in_the_unit_that_fits_and_read_back() {
        assert_eq!(format_bytes(24 << 30), "24.00 GiB");
        assert_eq!(format_bytes((3 << 30) / 2), "1.50 GiB");
        assert_eq!(format_bytes(40 << 20), "40.00 MiB");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(0), "0 B");
        for bytes in [0u64, 1023, 40 << 20, 24 << 30, 5 << 40] {
            let back = parse_bytes(&format_bytes(bytes)).unwrap();
            assert!(
                back.abs_diff(bytes) as f64 <= bytes as f64 * 0.005,
                "{bytes} -> {back}"
            );
        }
    }
    use super::*;

    fn measured(gpu: u64, host: u64) -> Measurement {
        Measurement {
            peak_gpu_bytes: gpu,
            peak_host_bytes: host,
            step_time_median_s: 1.0,
            step_time_spread: 0.0,
            timed_steps: 1,
            tokens_per_s: 1.0,
            host_link: None,
        }
    }

    #[test]
    fn usable_bytes_keep_the_headroom() {
        let budget = Budget {
            gpu_bytes: Some(1000),
            host_bytes: 2000,
            headroom: 0.05,
        };
        assert_eq!(budget.usable_gpu_bytes(), Some(950));
        assert_eq!(budget.usable_host_bytes(), 1900);
        assert!(budget.fits(&measured(950, 1900)));
        assert_eq!(budget.exceeded(&measured(951, 0)), Some(MemoryKind::Gpu));
        assert_eq!(budget.exceeded(&measured(0, 1901)), Some(MemoryKind::Host));
        let cpu = Budget {
            gpu_bytes: None,
            ..budget
        };
        assert!(
            cpu.fits(&measured(u64::MAX, 1900)),
            "device bytes are ignored on a CPU"
        );
    }

    #[test]
    fn default_budget_is_the_whole_device() {
        let device = DeviceSpec::builtin("rtx4090-32g").unwrap();
        let budget = Budget::from_device(&device);
        assert_eq!(budget.gpu_bytes, device.gpu_memory_bytes);
        assert_eq!(budget.headroom, Budget::DEFAULT_HEADROOM);
        budget.validate().unwrap();
        assert!(Budget {
            headroom: 1.0,
            ..budget
        }
        .validate()
        .is_err());
        assert!(Budget {
            headroom: -0.1,
            ..budget
        }
        .validate()
        .is_err());
        assert!(Budget {
            headroom: f64::NAN,
            ..budget
        }
        .validate()
        .is_err());
    }

    #[test]
    fn byte_sizes_parse() {
        let table: [(&str, u64); 10] = [
            ("123", 123),
            ("24GiB", 24 << 30),
            ("24 gib", 24 << 30),
            ("500MiB", 500 << 20),
            ("1.5GB", 1_500_000_000),
            ("1.5GiB", 3 << 29),
            ("8g", 8 << 30),
            ("2KB", 2000),
            ("0", 0),
            ("10B", 10),
        ];
        for (text, bytes) in table {
            assert_eq!(parse_bytes(text), Ok(bytes), "{text}");
        }
        for bad in [
            "",
            "GiB",
            "12 parsecs",
            "1.2.3GB",
            "-5",
            "99999999999TiB",
            "1e3",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad} should not parse");
        }
    }
}
