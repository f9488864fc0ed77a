//! Recorded profiles: what a search measured on a real machine, kept as versioned JSON so that
//! plans can be made offline and later runs can be checked against it for regressions.
//!
//! - [`record`]: the [`Profile`] document (`profiles/recorded/…`), its loading and atomic save.
//! - [`replay`]: [`ReplayProber`] answers trials from a profile, so `tune --backend replay:P`
//!   plans without a device and reproduces the recorded plan.
//! - [`check`](mod@check): compares fresh trials with the recorded ones under stated noise
//!   tolerances ([`check::check`]), and re-runs a profile's trials ([`check::recheck`]).

pub mod check;
pub mod record;
pub mod replay;

pub use check::{check, recheck, CheckReport, SettingCheck, Tolerance, Verdict};
pub use record::{Profile, RecordedDevice, PROFILE_KIND, PROFILE_SCHEMA_VERSION};
pub use replay::{Answer, ReplayProber, Replayed};

#[cfg(test)]
mod tests;
