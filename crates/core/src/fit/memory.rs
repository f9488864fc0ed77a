//! Peak memory against micro-batch: `peak(b) = fixed + per_sample · b`, by least squares.
//!
//! Why affine: for a fixed regime and sequence length, weights, gradients and optimizer state do
//! not depend on the batch, and activation bytes are proportional to it (Korthikanti et al.,
//! "Reducing Activation Recomputation in Large Transformer Models": `s·b·h·(34 + 5·a·s/h)` per
//! layer). Allocator rounding and workspaces bend the line a little; the search therefore treats
//! a prediction as a guess to probe, never as an answer.

use serde::{Deserialize, Serialize};

use super::leave_one_out;
use crate::spec::budget::Budget;
use crate::trial::{Measurement, MemoryKind};

/// An affine byte law `fixed + per_sample · b`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AffineBytes {
    /// Bytes at micro-batch zero: weights, gradients, optimizer state, workspaces.
    pub fixed_bytes: f64,
    /// Bytes added by each sequence of the micro-batch: activations.
    pub per_sample_bytes: f64,
}

/// The largest micro-batch a byte law allows within a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Capacity {
    /// Micro-batches up to and including this one fit; `UpTo(0)` means not even one sequence.
    UpTo(usize),
    /// The law does not grow with the batch (a flat or noisy fit), so it sets no bound.
    Unbounded,
}

impl Capacity {
    /// The tighter of two capacities.
    pub fn min(self, other: Capacity) -> Capacity {
        match (self, other) {
            (Capacity::UpTo(a), Capacity::UpTo(b)) => Capacity::UpTo(a.min(b)),
            (Capacity::UpTo(a), Capacity::Unbounded) | (Capacity::Unbounded, Capacity::UpTo(a)) => {
                Capacity::UpTo(a)
            }
            (Capacity::Unbounded, Capacity::Unbounded) => Capacity::Unbounded,
        }
    }
}

impl AffineBytes {
    /// Ordinary least squares through `(micro_batch, bytes)` points; `None` unless at least two
    /// distinct micro-batches are present (one point does not determine a slope).
    pub fn fit(points: &[(usize, u64)]) -> Option<Self> {
        let n = points.len() as f64;
        let first = points.first()?.0;
        if points.iter().all(|(b, _)| *b == first) {
            return None;
        }
        // Centred sums: the byte counts are ~1e10, so raw sums of squares would lose digits.
        let mean_b = points.iter().map(|(b, _)| *b as f64).sum::<f64>() / n;
        let mean_y = points.iter().map(|(_, y)| *y as f64).sum::<f64>() / n;
        let (mut sxx, mut sxy) = (0.0, 0.0);
        for (b, y) in points {
            let (db, dy) = (*b as f64 - mean_b, *y as f64 - mean_y);
            sxx += db * db;
            sxy += db * dy;
        }
        let per_sample_bytes = sxy / sxx;
        Some(Self {
            fixed_bytes: mean_y - per_sample_bytes * mean_b,
            per_sample_bytes,
        })
    }

    /// Predicted peak bytes at `micro_batch`.
    pub fn predict(&self, micro_batch: usize) -> f64 {
        self.fixed_bytes + self.per_sample_bytes * micro_batch as f64
    }

    /// The largest micro-batch whose predicted peak is at most `bytes`.
    pub fn max_micro_batch_within(&self, bytes: u64) -> Capacity {
        let room = bytes as f64 - self.fixed_bytes;
        if self.per_sample_bytes <= 0.0 {
            return if room >= 0.0 {
                Capacity::Unbounded
            } else {
                Capacity::UpTo(0)
            };
        }
        // The small epsilon keeps an exact integer quotient (a law that lands on the limit)
        // from rounding down through floating-point error.
        let batches = (room / self.per_sample_bytes + 1e-6).floor();
        if batches <= 0.0 {
            Capacity::UpTo(0)
        } else if batches >= usize::MAX as f64 {
            Capacity::Unbounded
        } else {
            Capacity::UpTo(batches as usize)
        }
    }

    /// Worst leave-one-out relative error of this kind of fit on `points`: each point is
    /// predicted by a fit to the others, and the largest `|predicted − actual| / actual` is
    /// returned. The worst case, not the mean, because a plan lives at its boundary. `None`
    /// below three points.
    pub fn loo_rel_error(points: &[(usize, u64)]) -> Option<f64> {
        leave_one_out(points, 1.0, |rest, (b, y)| {
            Some((Self::fit(rest)?.predict(b), y as f64))
        })
    }
}

/// The points whose micro-batch is at least 1/[`UPPER_RANGE_DIVISOR`] of the largest one, or the
/// three largest micro-batches' points if fewer qualify (all points when there are fewer).
pub fn upper_range(samples: &[(usize, Measurement)]) -> Vec<(usize, Measurement)> {
    let Some(largest) = samples.iter().map(|(b, _)| *b).max() else {
        return Vec::new();
    };
    let upper: Vec<_> = samples
        .iter()
        .filter(|(b, _)| b * UPPER_RANGE_DIVISOR >= largest)
        .copied()
        .collect();
    if upper.len() >= 3 {
        return upper;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by_key(|(b, _)| std::cmp::Reverse(*b));
    sorted.truncate(3.max(upper.len()));
    sorted
}

/// See [`upper_range`]: an eighth of the largest micro-batch keeps three doublings of data.
pub const UPPER_RANGE_DIVISOR: usize = 8;

/// Predicted peaks at one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakPrediction {
    /// Device bytes.
    pub gpu_bytes: f64,
    /// Host bytes.
    pub host_bytes: f64,
}

/// One measured trial's peaks, a floor under every prediction at a micro-batch at least as large.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredPeak {
    /// The trial's micro-batch.
    pub micro_batch: usize,
    /// Its device bytes.
    pub gpu_bytes: u64,
    /// Its host bytes.
    pub host_bytes: u64,
}

/// Device and host memory laws of one regime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryModel {
    /// Device memory law (all zero on a CPU, which measures no device bytes).
    pub gpu: AffineBytes,
    /// Host memory law.
    pub host: AffineBytes,
    /// Every fitted trial's peaks, by micro-batch. Memory never shrinks as the batch grows, so
    /// a prediction is never below a measured peak at a micro-batch at most as large. This
    /// matters below the fitted range, where fixed-size workspaces and the pool's smallest
    /// reservations lift the measured peaks above the line (the seed model's peaks stay at
    /// 1.08 GiB from micro-batch 1 to 4, 4.5 % above the line).
    #[serde(default)]
    pub measured: Vec<MeasuredPeak>,
    /// Data points behind the fit.
    pub points: usize,
    /// Worst leave-one-out relative error of the device law; `None` below three points.
    pub gpu_loo_rel_error: Option<f64>,
    /// Worst leave-one-out relative error of the host law; `None` below three points.
    pub host_loo_rel_error: Option<f64>,
}

impl MemoryModel {
    /// Fits both laws to `(micro_batch, measurement)` points; `None` unless at least two
    /// distinct micro-batches are present.
    ///
    /// Only the upper range of micro-batches enters the fit (see [`upper_range`]): the model is
    /// used near the memory boundary, and at very small batches fixed-size workspaces (thread
    /// pool buffers on a CPU, cuBLAS workspace choices on a GPU) switch on and off, which bends
    /// the law there without saying anything about large batches.
    pub fn fit(samples: &[(usize, Measurement)]) -> Option<Self> {
        let mut measured: Vec<MeasuredPeak> = samples
            .iter()
            .map(|(b, m)| MeasuredPeak {
                micro_batch: *b,
                gpu_bytes: m.peak_gpu_bytes,
                host_bytes: m.peak_host_bytes,
            })
            .collect();
        measured.sort_by_key(|p| p.micro_batch);
        let samples = upper_range(samples);
        let samples = samples.as_slice();
        let gpu: Vec<(usize, u64)> = samples
            .iter()
            .map(|(b, m)| (*b, m.peak_gpu_bytes))
            .collect();
        let host: Vec<(usize, u64)> = samples
            .iter()
            .map(|(b, m)| (*b, m.peak_host_bytes))
            .collect();
        Some(Self {
            gpu: AffineBytes::fit(&gpu)?,
            host: AffineBytes::fit(&host)?,
            points: samples.len(),
            gpu_loo_rel_error: AffineBytes::loo_rel_error(&gpu),
            host_loo_rel_error: AffineBytes::loo_rel_error(&host),
            measured,
        })
    }

    /// The largest measured peaks at a micro-batch at most `micro_batch`: `(device, host)`.
    fn floor(&self, micro_batch: usize) -> (u64, u64) {
        self.measured
            .iter()
            .take_while(|p| p.micro_batch <= micro_batch)
            .fold((0, 0), |(g, h), p| {
                (g.max(p.gpu_bytes), h.max(p.host_bytes))
            })
    }

    /// Predicted peaks at `micro_batch`: the laws, raised to the measured floor.
    pub fn predict(&self, micro_batch: usize) -> PeakPrediction {
        let (gpu, host) = self.floor(micro_batch);
        PeakPrediction {
            gpu_bytes: self.gpu.predict(micro_batch).max(gpu as f64),
            host_bytes: self.host.predict(micro_batch).max(host as f64),
        }
    }

    /// The largest micro-batch predicted to stay within the budget's usable bytes of both
    /// memories (the device law is ignored when the budget has no device).
    pub fn max_micro_batch_within(&self, budget: &Budget) -> Capacity {
        let usable_gpu = budget.usable_gpu_bytes();
        let host = self.host.max_micro_batch_within(budget.usable_host_bytes());
        let laws = match usable_gpu {
            Some(gpu) => self.gpu.max_micro_batch_within(gpu).min(host),
            None => host,
        };
        // A measured peak over the budget caps every micro-batch from its own on.
        let over = self.measured.iter().find(|p| {
            p.host_bytes > budget.usable_host_bytes()
                || usable_gpu.is_some_and(|limit| p.gpu_bytes > limit)
        });
        match over {
            Some(p) => laws.min(Capacity::UpTo(p.micro_batch.saturating_sub(1))),
            None => laws,
        }
    }

    /// The worse of the two laws' leave-one-out errors (only the host law's on a CPU budget).
    pub fn loo_rel_error(&self, budget: &Budget) -> Option<f64> {
        let host = self.host_loo_rel_error;
        match (budget.gpu_bytes, self.gpu_loo_rel_error, host) {
            (Some(_), Some(g), Some(h)) => Some(g.max(h)),
            (Some(_), Some(g), None) => Some(g),
            _ => host,
        }
    }

    /// The out-of-memory micro-batches at which this model is contradicted.
    ///
    /// An OOM at `b` is a censored observation: it says only that `peak(b)` exceeded the limit
    /// the prober enforced (the budget's full bytes, not the usable ones). It cannot enter a
    /// least-squares fit as a value, but a model that predicts `peak(b)` within that limit is
    /// optimistic there. The search never trusts a prediction beyond its smallest known OOM in
    /// any case; this check lets a caller report the disagreement.
    pub fn optimistic_at(&self, ooms: &[(usize, MemoryKind)], budget: &Budget) -> Vec<usize> {
        ooms.iter()
            .filter(|(b, kind)| match kind {
                MemoryKind::Gpu => budget
                    .gpu_bytes
                    .is_some_and(|limit| self.predict(*b).gpu_bytes <= limit as f64),
                MemoryKind::Host => self.predict(*b).host_bytes <= budget.host_bytes as f64,
            })
            .map(|(b, _)| *b)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn law(fixed: u64, per: u64, batches: &[usize]) -> Vec<(usize, u64)> {
        batches
            .iter()
            .map(|&b| (b, fixed + per * b as u64))
            .collect()
    }

    fn sample(b: usize, gpu: u64, host: u64) -> (usize, Measurement) {
        let m = Measurement {
            peak_gpu_bytes: gpu,
            peak_host_bytes: host,
            step_time_median_s: 1.0,
            step_time_spread: 0.0,
            timed_steps: 3,
            tokens_per_s: 1.0,
            host_link: None,
        };
        (b, m)
    }

    #[test]
    fn recovers_an_exact_law() {
        let points = law(GIB, 37 * MIB, &[1, 2, 4, 8, 16, 32, 64, 128]);
        let fit = AffineBytes::fit(&points).unwrap();
        assert!((fit.fixed_bytes - GIB as f64).abs() < 1.0, "{fit:?}");
        assert!(
            (fit.per_sample_bytes - (37 * MIB) as f64).abs() < 1e-3,
            "{fit:?}"
        );
        // (9.5 GiB − 1 GiB) / 37 MiB = 235.2…
        assert_eq!(fit.max_micro_batch_within(9728 * MIB), Capacity::UpTo(235));
        // A limit that the law meets exactly still counts as fitting.
        assert_eq!(
            fit.max_micro_batch_within(GIB + 200 * 37 * MIB),
            Capacity::UpTo(200)
        );
        assert_eq!(fit.max_micro_batch_within(GIB - 1), Capacity::UpTo(0));
        assert!(AffineBytes::loo_rel_error(&points).unwrap() < 1e-9);
    }

    #[test]
    fn degenerate_inputs_are_values() {
        assert_eq!(AffineBytes::fit(&[]), None);
        assert_eq!(AffineBytes::fit(&[(4, 100)]), None);
        assert_eq!(AffineBytes::fit(&[(4, 100), (4, 120)]), None);
        assert_eq!(AffineBytes::loo_rel_error(&law(1, 1, &[1, 2])), None);
        let flat = AffineBytes {
            fixed_bytes: 100.0,
            per_sample_bytes: -1.0,
        };
        assert_eq!(flat.max_micro_batch_within(200), Capacity::Unbounded);
        assert_eq!(flat.max_micro_batch_within(50), Capacity::UpTo(0));
        assert_eq!(MemoryModel::fit(&[sample(1, 10, 10)]), None);
    }

    #[test]
    fn predictions_never_fall_below_a_measured_peak_at_a_smaller_batch() {
        // Flat at 1 GiB + 150 MiB up to 8, then 1 GiB + 14 MiB·b (the seed model's shape): the
        // law is fitted to 16..128, which puts 1 to 8 below their measured peaks.
        let line = |b: usize| GIB + 14 * MIB * b as u64;
        let flat = GIB + 150 * MIB;
        let samples: Vec<_> = [1, 2, 4, 8, 16, 32, 64, 128]
            .iter()
            .map(|&b| {
                let gpu = line(b).max(flat);
                sample(b, gpu, gpu / 2)
            })
            .collect();
        let model = MemoryModel::fit(&samples).unwrap();
        // (micro-batch, expected device bytes)
        let table = [
            (1, flat), // measured there
            (3, flat), // nothing measured: the peak at 2 is a floor
            (6, flat), // 1 GiB + 84 MiB on the line
            (16, line(16)),
            (100, line(100)),
            (256, line(256)),
        ];
        for (b, expected) in table {
            let got = model.predict(b);
            assert!(
                (got.gpu_bytes - expected as f64).abs() < 1.0,
                "mb {b}: {got:?}"
            );
            assert!(
                got.host_bytes >= (expected / 2) as f64 - 1.0,
                "mb {b}: {got:?}"
            );
        }
        // A measured peak over the usable bytes caps the capacity below it, whatever the law.
        let mut over = samples.clone();
        over.push(sample(48, 20 * GIB, GIB));
        let model = MemoryModel::fit(&over).unwrap();
        let budget = Budget {
            gpu_bytes: Some(10 * GIB),
            host_bytes: 1 << 40,
            headroom: 0.0,
        };
        assert_eq!(model.max_micro_batch_within(&budget), Capacity::UpTo(47));
    }

    #[test]
    fn loo_error_flags_a_bent_law() {
        let mut points = law(GIB, 37 * MIB, &[1, 2, 4, 8, 16, 32]);
        points.push((64, GIB + 64 * 37 * MIB + GIB)); // one point 1 GiB above the line
        assert!(AffineBytes::loo_rel_error(&points).unwrap() > 0.2);
    }

    #[test]
    fn model_takes_the_tighter_memory_and_checks_ooms() {
        // Device: 1 GiB + 37 MiB·b; host: 2 GiB + 100 MiB·b.
        let samples: Vec<_> = [1, 2, 4, 8]
            .iter()
            .map(|&b| sample(b, GIB + 37 * MIB * b as u64, 2 * GIB + 100 * MIB * b as u64))
            .collect();
        let model = MemoryModel::fit(&samples).unwrap();
        let roomy_host = Budget {
            gpu_bytes: Some(10 * GIB),
            host_bytes: 1 << 40,
            headroom: 0.05,
        };
        assert_eq!(
            model.max_micro_batch_within(&roomy_host),
            Capacity::UpTo(235)
        );
        // Host: (0.95·16 GiB − 2 GiB) / 100 MiB = 135.1…
        let tight_host = Budget {
            host_bytes: 16 * GIB,
            ..roomy_host
        };
        assert_eq!(
            model.max_micro_batch_within(&tight_host),
            Capacity::UpTo(135)
        );
        let cpu = Budget {
            gpu_bytes: None,
            ..tight_host
        };
        assert_eq!(model.max_micro_batch_within(&cpu), Capacity::UpTo(135));
        assert!(model.loo_rel_error(&roomy_host).unwrap() < 1e-9);
        // An OOM at 256 agrees with the model; one at 200 (predicted 8.2 GiB) contradicts it.
        let ooms = [(256, MemoryKind::Gpu), (200, MemoryKind::Gpu)];
        assert_eq!(model.optimistic_at(&ooms, &roomy_host), vec![200]);
    }
}
