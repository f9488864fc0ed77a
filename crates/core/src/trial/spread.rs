//! How precisely a trial measured its step time, and several trials of one setting pooled.
//!
//! A trial records its median step time, the spread `(p90 − p10) / median` of its timed steps
//! and how many there were. From those, [`Measurement::relative_error`] is the standard error
//! of the median relative to it: `spread / 2.5631` is the relative standard deviation (p90 −
//! p10 spans 2.5631 σ of a normal distribution), and `1.2533 σ / √n` the standard error of a
//! median of `n` steps. Throughput is tokens over the median step, so it carries the same
//! relative error. The search compares settings, and `check` compares runs, with it.

use super::Measurement;

/// z of a two-sided 95 % interval.
pub const Z_95: f64 = 1.96;

/// The standard error of a median of `n` samples over that of their mean.
pub const MEDIAN_EFFICIENCY: f64 = 1.2533;

/// The width of the p10–p90 range of a normal distribution, in standard deviations.
const P10_P90_SIGMAS: f64 = 2.5631;

impl Measurement {
    /// The standard error of the median step time relative to it (and so of tokens/s); 0 for
    /// a measurement without a usable spread.
    pub fn relative_error(&self) -> f64 {
        let spread = if self.step_time_spread.is_finite() {
            self.step_time_spread.max(0.0)
        } else {
            0.0
        };
        let n = self.timed_steps.max(1) as f64;
        MEDIAN_EFFICIENCY * (spread / P10_P90_SIGMAS) / n.sqrt()
    }

    /// The 95 % interval of tokens/s, low then high.
    pub fn tokens_per_s_interval(&self) -> (f64, f64) {
        let half = Z_95 * self.relative_error() * self.tokens_per_s;
        (
            (self.tokens_per_s - half).max(0.0),
            self.tokens_per_s + half,
        )
    }

    /// The 95 % interval as people read it beside tokens/s: ` ±x.x %`, or nothing when the
    /// steps did not scatter (a simulated or predicted trial).
    pub fn interval_text(&self) -> String {
        let half = Z_95 * self.relative_error();
        if half > 0.0 {
            format!(" ±{:.1} %", 100.0 * half)
        } else {
            String::new()
        }
    }

    /// Several measurements of one setting as one: the median step time is the mean of theirs
    /// weighted by their timed steps, the peaks are the largest seen (a later run that peaked
    /// higher is what the setting can cost), and the spread is set so that
    /// [`Self::relative_error`] gives the larger of two errors:
    ///
    /// - within: the runs' own errors, combined as for a weighted mean;
    /// - between: the standard error of the runs' medians about their mean, which catches
    ///   what changes from one run to the next (another process, clocks, temperature) and
    ///   each run's own steps miss.
    ///
    /// `None` for no measurements.
    pub fn pooled(runs: &[Measurement]) -> Option<Measurement> {
        let (first, rest) = runs.split_first()?;
        if rest.is_empty() {
            return Some(*first);
        }
        let total: usize = runs.iter().map(|m| m.timed_steps.max(1)).sum();
        let weight = |m: &Measurement| m.timed_steps.max(1) as f64 / total as f64;
        let median: f64 = runs.iter().map(|m| weight(m) * m.step_time_median_s).sum();
        if median.is_nan() || median <= 0.0 {
            return Some(*first);
        }
        let within = runs
            .iter()
            .map(|m| (weight(m) * m.relative_error() * m.step_time_median_s).powi(2))
            .sum::<f64>()
            .sqrt()
            / median;
        let k = runs.len() as f64;
        let variance = runs
            .iter()
            .map(|m| (m.step_time_median_s - median).powi(2))
            .sum::<f64>()
            / (k - 1.0);
        let between = (variance / k).sqrt() / median;
        let error = within.max(between);
        let tokens_per_step = first.tokens_per_s * first.step_time_median_s;
        Some(Measurement {
            peak_gpu_bytes: runs.iter().map(|m| m.peak_gpu_bytes).max().unwrap_or(0),
            peak_host_bytes: runs.iter().map(|m| m.peak_host_bytes).max().unwrap_or(0),
            step_time_median_s: median,
            step_time_spread: error * (total as f64).sqrt() * P10_P90_SIGMAS / MEDIAN_EFFICIENCY,
            timed_steps: total,
            tokens_per_s: tokens_per_step / median,
            host_link: first.host_link,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(median: f64, spread: f64, n: usize) -> Measurement {
        Measurement {
            peak_gpu_bytes: 100,
            peak_host_bytes: 10,
            step_time_median_s: median,
            step_time_spread: spread,
            timed_steps: n,
            tokens_per_s: 1000.0 / median,
            host_link: None,
        }
    }

    #[test]
    fn the_error_of_a_median_shrinks_with_the_square_root_of_the_steps() {
        let few = run(0.1, 0.2, 4).relative_error();
        let many = run(0.1, 0.2, 16).relative_error();
        assert!((few / many - 2.0).abs() < 1e-12, "{few} {many}");
        // A normal spread of 2.5631 σ over one step is one σ, times the median's efficiency.
        assert!((run(1.0, P10_P90_SIGMAS, 1).relative_error() - MEDIAN_EFFICIENCY).abs() < 1e-12);
        assert_eq!(run(0.1, f64::NAN, 4).relative_error(), 0.0);
        let (low, high) = run(0.1, 0.2, 4).tokens_per_s_interval();
        assert!(low < 10_000.0 && high > 10_000.0);
        assert!(((10_000.0 - low) - (high - 10_000.0)).abs() < 1e-6);
    }

    #[test]
    fn pooled_runs_weigh_their_steps_and_keep_the_larger_error() {
        assert_eq!(Measurement::pooled(&[]), None);
        let one = run(0.1, 0.3, 3);
        assert_eq!(Measurement::pooled(&[one]), Some(one));

        // Two quiet runs that disagree: the error is the one between them.
        let (a, b) = (run(0.10, 0.0, 3), run(0.12, 0.0, 9));
        let pooled = Measurement::pooled(&[a, b]).unwrap();
        assert_eq!(pooled.timed_steps, 12);
        assert!((pooled.step_time_median_s - 0.115).abs() < 1e-12);
        assert!((pooled.tokens_per_s - 1000.0 / 0.115).abs() < 1e-6);
        let between =
            (((0.10f64 - 0.115).powi(2) + (0.12f64 - 0.115).powi(2)) / 2.0).sqrt() / 0.115;
        assert!((pooled.relative_error() - between).abs() < 1e-12);

        // Two noisy runs that agree: the error is their own, smaller than either's.
        let (c, d) = (run(0.1, 0.4, 3), run(0.1, 0.4, 3));
        let pooled = Measurement::pooled(&[c, d]).unwrap();
        assert!(pooled.relative_error() < c.relative_error());
        assert!((pooled.relative_error() - c.relative_error() / 2f64.sqrt()).abs() < 1e-12);

        // The larger peak stands.
        let mut e = run(0.1, 0.0, 3);
        e.peak_gpu_bytes = 500;
        assert_eq!(Measurement::pooled(&[a, e]).unwrap().peak_gpu_bytes, 500);
    }
}
