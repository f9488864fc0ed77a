//! Regression checks: fresh trials of a profile's settings against the recorded ones.
//!
//! # When a difference counts
//!
//! A check has to tell a real change from run-to-run noise. It follows criterion's approach
//! (a change must be statistically significant *and* larger than a noise threshold), adapted
//! to what a trial records: a median step time, the spread `(p90 − p10) / median` and the
//! number of timed steps, not the raw samples.
//!
//! **Step time.** With `Δ = now / recorded − 1` (medians), a trial is [`Verdict::Slower`] when
//! `Δ > band` and [`Verdict::Faster`] when `Δ < −band`, where
//! `band = max(time_threshold, z · √(se_recorded² + se_now²))` and, per trial,
//! `se = 1.2533 · (spread / 2.5631) / √timed_steps` ([`Measurement::relative_error`]):
//!
//! - `spread / 2.5631` is the relative standard deviation (p90 − p10 spans 2.5631 σ of a
//!   normal distribution), and `1.2533 σ / √n` the standard error of a median of `n` steps;
//!   so a noisy or short trial widens the band, and the band is that of the difference.
//! - `z` = [`Tolerance::DEFAULT_SIGNIFICANCE_Z`] (3) keeps false alarms rare (≈ 0.3 % per
//!   setting two-sided under normality) while a check runs a dozen settings.
//! - `time_threshold` = [`Tolerance::DEFAULT_TIME_THRESHOLD`] (5 %) is the floor, criterion's
//!   `noise_threshold`: within one trial the steps are only a few seconds apart, so their
//!   spread misses what differs between runs (GPU clock boost, temperature, other tenants),
//!   which is a few percent on a quiet GPU (the same 5 % the time fit treats as ordinary
//!   residual). Criterion's 1 % suits thousands of samples; a trial has five to ten.
//!
//! **Memory.** Peaks are near-deterministic: a caching allocator reaches the same high-water
//! mark for the same shapes. A device or host peak is [`Verdict::MoreMemory`] or
//! [`Verdict::LessMemory`] when it moved by more than
//! `max(memory_threshold · recorded, memory_floor_bytes)` (defaults 2 % and 64 MiB): the floor
//! absorbs the CUDA memory pool's reservation granularity (re-runs of one build on the H200
//! differed by exactly 32 and 64 MiB at small batches) and driver workspaces; the fraction
//! absorbs fragmentation and host-heap jitter.
//!
//! **Outcomes.** A recorded fit that now runs out of memory is [`Verdict::NewlyOom`]; a recorded
//! out-of-memory (or crash) that now fits is [`Verdict::NoLongerOom`]; a trial that now crashes
//! where it did not before is [`Verdict::Crashed`].
//!
//! Regressions are `MoreMemory`, `Slower`, `NewlyOom` and `Crashed`; a check with any fails
//! (the CLI exits 1). Two refinements, measured necessary on a GPU where two re-runs of one
//! build disagreed by up to 45 % on single short trials: a `Slower` verdict fails the check only
//! when its regime's median change does too, and a `NewlyOom` only for a setting recorded below
//! the budget's usable bytes (see `settle_regressions`).

use serde::{Deserialize, Serialize};

use super::record::Profile;
use crate::search::{Event, Purpose, Reporter};
use crate::trial::{
    Measurement, MemoryKind, Outcome, Phase, Prober, TrialRequest, TrialResult, MEDIAN_EFFICIENCY,
};
use crate::{Error, Result};

/// What separates a change from noise; see the module docs for the rule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    /// Smallest relative step-time change that counts, whatever the spreads (0.05 = 5 %).
    pub time_threshold: f64,
    /// Standard errors of the difference of medians a time change must also exceed.
    pub significance_z: f64,
    /// Smallest relative peak-memory change that counts (0.02 = 2 %).
    pub memory_threshold: f64,
    /// Smallest absolute peak-memory change that counts, bytes.
    pub memory_floor_bytes: u64,
}

impl Tolerance {
    /// Default [`Tolerance::time_threshold`]: 5 %.
    pub const DEFAULT_TIME_THRESHOLD: f64 = 0.05;
    /// Default [`Tolerance::significance_z`]: 3.
    pub const DEFAULT_SIGNIFICANCE_Z: f64 = 3.0;
    /// Default [`Tolerance::memory_threshold`]: 2 %.
    pub const DEFAULT_MEMORY_THRESHOLD: f64 = 0.02;
    /// Default [`Tolerance::memory_floor_bytes`]: 64 MiB.
    pub const DEFAULT_MEMORY_FLOOR_BYTES: u64 = 64 << 20;

    /// Checks every figure is a finite, non-negative number.
    pub fn validate(&self) -> Result<()> {
        let figures = [
            ("time_threshold", self.time_threshold),
            ("significance_z", self.significance_z),
            ("memory_threshold", self.memory_threshold),
        ];
        for (field, value) in figures {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::invalid(
                    "tolerance",
                    field,
                    format!("({value}) must be a non-negative number"),
                ));
            }
        }
        Ok(())
    }

    /// The relative step-time change `recorded` and `now` must exceed to count.
    pub fn time_band(&self, recorded: &Measurement, now: &Measurement) -> f64 {
        let noise = self.significance_z * recorded.relative_error().hypot(now.relative_error());
        self.time_threshold.max(noise)
    }

    /// The byte change a peak of `recorded` bytes must exceed to count.
    pub fn memory_band(&self, recorded: u64) -> u64 {
        ((recorded as f64 * self.memory_threshold) as u64).max(self.memory_floor_bytes)
    }
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            time_threshold: Self::DEFAULT_TIME_THRESHOLD,
            significance_z: Self::DEFAULT_SIGNIFICANCE_Z,
            memory_threshold: Self::DEFAULT_MEMORY_THRESHOLD,
            memory_floor_bytes: Self::DEFAULT_MEMORY_FLOOR_BYTES,
        }
    }
}

/// What changed at one setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    /// Nothing beyond the tolerances (or the same failure as recorded).
    Unchanged,
    /// A peak grew beyond the memory tolerance (a regression).
    MoreMemory {
        /// Which memory.
        memory: MemoryKind,
        /// Recorded peak bytes.
        recorded: u64,
        /// Peak bytes now.
        now: u64,
        /// `now / recorded − 1`.
        change: f64,
    },
    /// A peak shrank beyond the memory tolerance.
    LessMemory {
        /// Which memory.
        memory: MemoryKind,
        /// Recorded peak bytes.
        recorded: u64,
        /// Peak bytes now.
        now: u64,
        /// `now / recorded − 1`.
        change: f64,
    },
    /// The median step time grew beyond the noise band (a regression).
    Slower {
        /// Recorded median step time, seconds.
        recorded_s: f64,
        /// Median step time now, seconds.
        now_s: f64,
        /// `now / recorded − 1`.
        change: f64,
        /// The band it exceeded.
        band: f64,
    },
    /// The median step time fell beyond the noise band.
    Faster {
        /// Recorded median step time, seconds.
        recorded_s: f64,
        /// Median step time now, seconds.
        now_s: f64,
        /// `now / recorded − 1`.
        change: f64,
        /// The band it exceeded.
        band: f64,
    },
    /// It fitted when recorded and runs out of memory now (a regression).
    NewlyOom {
        /// Which memory ran out.
        memory: MemoryKind,
        /// Where in the trial.
        phase: Phase,
    },
    /// It ran out of memory (or crashed) when recorded and fits now.
    NoLongerOom {
        /// What it measures now.
        now: Measurement,
    },
    /// It crashed now and did not when recorded (a regression).
    Crashed {
        /// What was seen.
        reason: String,
    },
    /// It did not finish within its time limit now, and did when recorded (a regression).
    TimedOut {
        /// The limit it ran into, seconds.
        after_s: f64,
    },
    /// No fresh trial of this setting was given.
    Missing,
}

impl Verdict {
    /// Whether this verdict fails a check.
    pub fn is_regression(&self) -> bool {
        matches!(
            self,
            Verdict::MoreMemory { .. }
                | Verdict::Slower { .. }
                | Verdict::NewlyOom { .. }
                | Verdict::Crashed { .. }
                | Verdict::TimedOut { .. }
        )
    }

    /// Whether this verdict is a change for the better.
    pub fn is_improvement(&self) -> bool {
        matches!(
            self,
            Verdict::LessMemory { .. } | Verdict::Faster { .. } | Verdict::NoLongerOom { .. }
        )
    }
}

/// One recorded trial and what a fresh trial of it found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SettingCheck {
    /// The recorded request.
    pub request: TrialRequest,
    /// The recorded outcome.
    pub recorded: Outcome,
    /// The fresh outcome, if one was given.
    pub now: Option<Outcome>,
    /// Every change found, or a single [`Verdict::Unchanged`] or [`Verdict::Missing`].
    pub verdicts: Vec<Verdict>,
    /// Whether any verdict is a regression.
    pub regression: bool,
}

/// The result of a check, in the order of the profile's trials.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckReport {
    /// One entry per recorded trial.
    pub settings: Vec<SettingCheck>,
    /// Settings with at least one regression; the check fails when this is not zero.
    pub regressions: usize,
    /// Settings with an improvement and no regression.
    pub improvements: usize,
    /// Settings without a fresh trial.
    pub missing: usize,
    /// The tolerances applied.
    pub tolerance: Tolerance,
}

impl CheckReport {
    /// Whether the check passed: no regression, and at least one setting compared (a check
    /// that compared nothing found nothing, which is not a pass).
    pub fn passed(&self) -> bool {
        self.regressions == 0 && self.compared() > 0
    }

    /// Settings with a fresh trial to compare.
    pub fn compared(&self) -> usize {
        self.settings.len() - self.missing
    }
}

/// The fresh trials another recording holds for `profile`'s settings: only those it recorded
/// (the same request, or the same knobs), never a prediction, so that a setting it lacks is
/// [`Verdict::Missing`] and not a synthesised answer.
pub fn recorded_answers(profile: &Profile, other: &Profile) -> Vec<TrialResult> {
    let mut prober = super::replay::ReplayProber::new(other.clone());
    profile
        .trials
        .iter()
        .map(|recorded| prober.replay(&recorded.request))
        .filter(|r| {
            matches!(
                r.answer,
                super::replay::Answer::Recorded | super::replay::Answer::SameKnobs
            )
        })
        .map(|r| r.result)
        .collect()
}

/// Compares `fresh` trials with the profile's recorded ones, setting by setting.
///
/// Each recorded trial is paired with the first unused fresh trial of the same request (knobs
/// and trial lengths), else of the same knobs; without one it is [`Verdict::Missing`]. Fresh
/// trials that pair with nothing are ignored: the profile defines what is checked.
pub fn check(profile: &Profile, fresh: &[TrialResult], tolerance: Tolerance) -> CheckReport {
    let mut used = vec![false; fresh.len()];
    let mut settings = Vec::with_capacity(profile.trials.len());
    for recorded in &profile.trials {
        let unused = |same: &dyn Fn(&TrialRequest) -> bool, used: &[bool]| {
            (0..fresh.len()).find(|&i| !used[i] && same(&fresh[i].request))
        };
        let pair = unused(&|r| *r == recorded.request, &used)
            .or_else(|| unused(&|r| r.knobs == recorded.request.knobs, &used));
        let (now, verdicts) = match pair {
            Some(i) => {
                used[i] = true;
                let now = &fresh[i].outcome;
                (
                    Some(now.clone()),
                    compare(&recorded.outcome, now, &tolerance),
                )
            }
            None => (None, vec![Verdict::Missing]),
        };
        settings.push(SettingCheck {
            request: recorded.request,
            recorded: recorded.outcome.clone(),
            now,
            regression: verdicts.iter().any(Verdict::is_regression),
            verdicts,
        });
    }
    settle_regressions(profile, &mut settings, &tolerance);
    let count = |f: &dyn Fn(&SettingCheck) -> bool| settings.iter().filter(|s| f(s)).count();
    CheckReport {
        regressions: count(&|s| s.regression),
        improvements: count(&|s| !s.regression && s.verdicts.iter().any(Verdict::is_improvement)),
        missing: count(&|s| s.verdicts.contains(&Verdict::Missing)),
        settings,
        tolerance,
    }
}

/// Decides which verdicts fail the check, beyond the per-setting rule (see the module docs):
///
/// - **Slower** counts only when the regime as a whole slowed: the median step-time change over
///   its compute-bound settings (see [`COMPUTE_BOUND_FACTOR`]) that fit both times exceeds
///   `time_threshold` and its own noise (with at least [`MIN_SETTINGS_FOR_TIME`] of them; see
///   [`median_change_is_significant`]). Step times of one trial vary between runs by more than
///   their in-trial spread suggests (GPU clocks, launch-bound small batches); a real slowdown of
///   the engine or driver moves every batch size, noise does not.
/// - **NewlyOom** does not count for a setting whose recorded peak was already above the
///   budget's usable bytes: such a setting sits inside the headroom, where allocator
///   fragmentation decides between fitting and not, and no plan would have used it.
fn settle_regressions(profile: &Profile, settings: &mut [SettingCheck], tolerance: &Tolerance) {
    use std::collections::HashMap;
    let floor = launch_floor(profile);
    let mut changes: HashMap<crate::knobs::Regime, Vec<f64>> = HashMap::new();
    for s in settings.iter() {
        if let (Outcome::Fits(r), Some(Outcome::Fits(n))) = (&s.recorded, &s.now) {
            let regime = s.request.knobs.regime();
            let compute_bound = floor
                .get(&regime)
                .is_some_and(|&t1| r.step_time_median_s >= COMPUTE_BOUND_FACTOR * t1);
            if compute_bound && r.step_time_median_s > 0.0 && n.step_time_median_s.is_finite() {
                changes
                    .entry(s.request.knobs.regime())
                    .or_default()
                    .push(n.step_time_median_s / r.step_time_median_s - 1.0);
            }
        }
    }
    let regime_slowed = |regime| {
        changes
            .get(&regime)
            .is_some_and(|c| median_change_is_significant(c, tolerance))
    };
    for s in settings.iter_mut() {
        let slowed = regime_slowed(s.request.knobs.regime());
        let at_boundary = s
            .recorded
            .measurement()
            .is_some_and(|m| !profile.budget.fits(m));
        s.regression = s.verdicts.iter().any(|v| match v {
            Verdict::Slower { .. } => slowed,
            Verdict::NewlyOom { .. } => !at_boundary,
            other => other.is_regression(),
        });
    }
}

/// Whether a regime's step-time `changes` (one per compute-bound setting, relative) show it
/// slowed: at least [`MIN_SETTINGS_FOR_TIME`] of them, and their median above both the time
/// threshold and `z` standard errors of that median. The settings' scatter about their median
/// measures what varies between two runs of one build, which their own steps' spread does not
/// show: it is small on a quiet GPU, where the threshold decides, and large on a busy CPU. A
/// slower build moves every setting alike, so its median stands clear of the scatter.
fn median_change_is_significant(changes: &[f64], tolerance: &Tolerance) -> bool {
    if changes.len() < MIN_SETTINGS_FOR_TIME {
        return false;
    }
    let mut sorted = changes.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let n = sorted.len() as f64;
    let mean = sorted.iter().sum::<f64>() / n;
    let deviation = (sorted.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let error = MEDIAN_EFFICIENCY * deviation / n.sqrt();
    median
        > tolerance
            .time_threshold
            .max(tolerance.significance_z * error)
}

/// Fewest settings of a regime behind a step-time regression.
pub const MIN_SETTINGS_FOR_TIME: usize = 3;

/// A trial is compute-bound, and its step time evidence about the engine, when it takes at least
/// this many times the regime's fastest recorded step. Below that the step time has not grown
/// with the batch: it measures kernel-launch and host-scheduling overhead, which moved by up to
/// ±50 % between re-runs of one build on the H200 while compute-bound trials stayed within a
/// few percent.
pub const COMPUTE_BOUND_FACTOR: f64 = 1.5;

/// Per regime, the fastest recorded step time (the launch-overhead floor).
fn launch_floor(profile: &Profile) -> std::collections::HashMap<crate::knobs::Regime, f64> {
    let mut floor = std::collections::HashMap::new();
    for r in &profile.trials {
        if let Some(m) = r.outcome.measurement() {
            let t = floor
                .entry(r.request.knobs.regime())
                .or_insert(f64::INFINITY);
            *t = f64::min(*t, m.step_time_median_s);
        }
    }
    floor
}

/// The verdicts for one pair of outcomes (see the module docs).
fn compare(recorded: &Outcome, now: &Outcome, tolerance: &Tolerance) -> Vec<Verdict> {
    let verdicts = match (recorded, now) {
        (Outcome::Fits(r), Outcome::Fits(n)) => {
            let mut found = Vec::new();
            for (memory, r, n) in [
                (MemoryKind::Gpu, r.peak_gpu_bytes, n.peak_gpu_bytes),
                (MemoryKind::Host, r.peak_host_bytes, n.peak_host_bytes),
            ] {
                if r.abs_diff(n) > tolerance.memory_band(r) {
                    let change = n as f64 / r.max(1) as f64 - 1.0;
                    found.push(if n > r {
                        Verdict::MoreMemory {
                            memory,
                            recorded: r,
                            now: n,
                            change,
                        }
                    } else {
                        Verdict::LessMemory {
                            memory,
                            recorded: r,
                            now: n,
                            change,
                        }
                    });
                }
            }
            let (recorded_s, now_s) = (r.step_time_median_s, n.step_time_median_s);
            if recorded_s > 0.0 && now_s.is_finite() {
                let change = now_s / recorded_s - 1.0;
                let band = tolerance.time_band(r, n);
                if change > band {
                    found.push(Verdict::Slower {
                        recorded_s,
                        now_s,
                        change,
                        band,
                    });
                } else if change < -band {
                    found.push(Verdict::Faster {
                        recorded_s,
                        now_s,
                        change,
                        band,
                    });
                }
            }
            found
        }
        (Outcome::Fits(_), Outcome::OutOfMemory { memory, phase }) => vec![Verdict::NewlyOom {
            memory: *memory,
            phase: *phase,
        }],
        (Outcome::Crashed { .. }, Outcome::Crashed { .. })
        | (Outcome::TimedOut { .. }, Outcome::TimedOut { .. }) => Vec::new(),
        (_, Outcome::TimedOut { after_s }) => vec![Verdict::TimedOut { after_s: *after_s }],
        (_, Outcome::Crashed { reason }) => vec![Verdict::Crashed {
            reason: reason.clone(),
        }],
        (_, Outcome::Fits(n)) => vec![Verdict::NoLongerOom { now: *n }],
        // Still failing: out of memory (or a recorded crash that is an out-of-memory now).
        (_, Outcome::OutOfMemory { .. }) => Vec::new(),
    };
    if verdicts.is_empty() {
        vec![Verdict::Unchanged]
    } else {
        verdicts
    }
}

/// Re-runs every recorded trial (fits, out-of-memory and crashes alike) with `prober`, in the
/// recorded order, reporting each as a search would; returns the fresh results for [`check`].
///
/// Trials are reported as verifications by the search driver's rule (accumulating, or knobs
/// seen before), and as feasible when they fit within the profile's budget.
pub fn recheck(
    profile: &Profile,
    prober: &mut dyn Prober,
    reporter: &dyn Reporter,
) -> Result<Vec<TrialResult>> {
    let mut seen = std::collections::HashSet::new();
    let mut fresh = Vec::with_capacity(profile.trials.len());
    for (index, recorded) in profile.trials.iter().enumerate() {
        let request = recorded.request;
        let purpose = if request.knobs.grad_accum != 1 || !seen.insert(request.knobs) {
            Purpose::Verify
        } else {
            Purpose::Search
        };
        reporter.report(&Event::TrialStarted {
            index,
            request,
            purpose,
        });
        let result = prober.probe(&request)?;
        let feasible = result
            .outcome
            .measurement()
            .is_some_and(|m| profile.budget.fits(m));
        reporter.report(&Event::TrialFinished {
            index,
            result: result.clone(),
            purpose,
            feasible,
        });
        fresh.push(result);
    }
    Ok(fresh)
}
