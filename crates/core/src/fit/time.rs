//! Step time against micro-batch: `t(b) = fixed + per_sample · b`, fitted robustly with argmin.
//!
//! Throughput `b / t(b)` then has the saturating form `(1/c) · b / (t0/c + b)`, so it can be
//! predicted at micro-batches that were never probed. The fit minimises a Huber loss of the
//! *relative* residuals with Nelder–Mead (argmin, `Vec<f64>` backend):
//!
//! - relative, because step times span three orders of magnitude across micro-batches and a
//!   plain least-squares fit would only listen to the largest;
//! - Huber, because one trial disturbed by another process or a clock-frequency change should
//!   not bend the line: residuals beyond [`HUBER_DELTA`] count linearly, not quadratically;
//! - non-negative coefficients, because a negative fixed time (superlinear data) would predict
//!   unbounded throughput at small batches.
//!
//! That objective has no closed form, hence the iterative solver. It starts from the closed-form
//! weighted least-squares solution, so on clean data it returns that solution unchanged.

use argmin::core::{CostFunction, Executor, State};
use argmin::solver::neldermead::NelderMead;
use serde::{Deserialize, Serialize};

use super::leave_one_out;

/// Relative residual at which the Huber loss turns from quadratic to linear: 5 %, about the
/// step-to-step spread of a quiet GPU; larger residuals are treated as disturbances.
pub const HUBER_DELTA: f64 = 0.05;

/// Nelder–Mead iteration cap; two parameters converge in well under a hundred.
const MAX_ITERS: u64 = 500;

/// How a [`StepTimeModel`] was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "method")]
pub enum TimeFitMethod {
    /// Nelder–Mead on the robust relative loss, from the weighted least-squares start.
    NelderMead {
        /// Iterations run.
        iterations: u64,
    },
    /// The weighted least-squares start, kept because the solver failed.
    ClosedForm,
    /// A single micro-batch was measured: time is taken as proportional to the batch
    /// (constant throughput), the cautious extrapolation to larger batches.
    Proportional,
}

/// Step time of one micro-batch (forward, backward, optimizer) of one regime.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepTimeModel {
    /// Seconds at micro-batch zero: kernel launches, optimizer update, synchronisation.
    pub fixed_s: f64,
    /// Seconds added by each sequence of the micro-batch.
    pub per_sample_s: f64,
    /// Data points behind the fit.
    pub points: usize,
    /// Worst leave-one-out relative error; `None` below three points.
    pub loo_rel_error: Option<f64>,
    /// How the coefficients were obtained.
    pub method: TimeFitMethod,
}

impl StepTimeModel {
    /// Fits `(micro_batch, seconds per step)` points (non-positive or non-finite times are
    /// ignored); `None` when no point remains.
    pub fn fit(points: &[(usize, f64)]) -> Option<Self> {
        let points: Vec<(usize, f64)> = points
            .iter()
            .copied()
            .filter(|(b, t)| *b > 0 && *t > 0.0 && t.is_finite())
            .collect();
        let (fixed_s, per_sample_s, method) = fit_coefficients(&points)?;
        let loo_rel_error = leave_one_out(&points, 1e-12, |rest, (b, t)| {
            let (fixed, per_sample, method) = fit_coefficients(rest)?;
            // A proportional fold is not the affine model being assessed.
            (method != TimeFitMethod::Proportional).then_some((fixed + per_sample * b as f64, t))
        });
        Some(Self {
            fixed_s,
            per_sample_s,
            points: points.len(),
            loo_rel_error,
            method,
        })
    }

    /// Predicted seconds of one micro-batch step.
    pub fn step_time_s(&self, micro_batch: usize) -> f64 {
        self.fixed_s + self.per_sample_s * micro_batch as f64
    }

    /// Predicted sequences per second.
    pub fn samples_per_s(&self, micro_batch: usize) -> f64 {
        micro_batch as f64 / self.step_time_s(micro_batch)
    }

    /// Predicted tokens per second for sequences of `tokens_per_sample` tokens.
    pub fn tokens_per_s(&self, micro_batch: usize, tokens_per_sample: usize) -> f64 {
        self.samples_per_s(micro_batch) * tokens_per_sample as f64
    }
}

/// `(fixed, per_sample, method)` for valid points; `None` when there are none.
fn fit_coefficients(points: &[(usize, f64)]) -> Option<(f64, f64, TimeFitMethod)> {
    let first = points.first()?.0;
    if points.iter().all(|(b, _)| *b == first) {
        let mean = points.iter().map(|(_, t)| t).sum::<f64>() / points.len() as f64;
        return Some((0.0, mean / first as f64, TimeFitMethod::Proportional));
    }
    let b: Vec<f64> = points.iter().map(|(b, _)| *b as f64).collect();
    let t: Vec<f64> = points.iter().map(|(_, t)| *t).collect();
    let (fixed, per_sample) = weighted_least_squares(&b, &t);
    Some(match nelder_mead(&b, &t, fixed, per_sample) {
        Some((fixed, per_sample, iterations)) => {
            (fixed, per_sample, TimeFitMethod::NelderMead { iterations })
        }
        None => (fixed, per_sample, TimeFitMethod::ClosedForm),
    })
}

/// Minimises `Σ ((t0 + c·bᵢ − tᵢ) / tᵢ)²` over `t0, c ≥ 0` in closed form (weights `1/tᵢ²`).
///
/// The objective is a convex quadratic, so the constrained optimum is the unconstrained one when
/// that is non-negative, else the best point on the boundary `t0 = 0` or `c = 0`.
fn weighted_least_squares(b: &[f64], t: &[f64]) -> (f64, f64) {
    let w: Vec<f64> = t.iter().map(|t| 1.0 / (t * t)).collect();
    let sum = |f: &dyn Fn(usize) -> f64| (0..b.len()).map(f).sum::<f64>();
    let (sw, swb, swbb) = (
        sum(&|i| w[i]),
        sum(&|i| w[i] * b[i]),
        sum(&|i| w[i] * b[i] * b[i]),
    );
    let (swt, swbt) = (sum(&|i| w[i] * t[i]), sum(&|i| w[i] * b[i] * t[i]));
    let det = sw * swbb - swb * swb;
    let fixed = (swbb * swt - swb * swbt) / det;
    let per_sample = (sw * swbt - swb * swt) / det;
    if fixed >= 0.0 && per_sample >= 0.0 {
        return (fixed, per_sample);
    }
    let proportional = (0.0, swbt / swbb);
    let constant = (swt / sw, 0.0);
    let cost = |(f, c): (f64, f64)| sum(&|i| w[i] * (f + c * b[i] - t[i]).powi(2));
    if cost(proportional) <= cost(constant) {
        proportional
    } else {
        constant
    }
}

/// The robust relative loss, over parameters scaled to order one.
struct RobustRelativeLoss<'a> {
    b: &'a [f64],
    t: &'a [f64],
    /// Seconds per unit of the first parameter (fixed time) and of the second (per sample).
    scale: (f64, f64),
}

impl RobustRelativeLoss<'_> {
    /// Parameters to coefficients; `abs` keeps both non-negative without a constrained solver.
    fn coefficients(&self, x: &[f64]) -> (f64, f64) {
        (x[0].abs() * self.scale.0, x[1].abs() * self.scale.1)
    }
}

impl CostFunction for RobustRelativeLoss<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, x: &Self::Param) -> Result<f64, argmin::core::Error> {
        let (fixed, per_sample) = self.coefficients(x);
        Ok(self
            .b
            .iter()
            .zip(self.t)
            .map(|(b, t)| {
                let r = ((fixed + per_sample * b - t) / t).abs();
                if r <= HUBER_DELTA {
                    0.5 * r * r
                } else {
                    HUBER_DELTA * (r - 0.5 * HUBER_DELTA)
                }
            })
            .sum())
    }
}

/// Runs Nelder–Mead from `(fixed, per_sample)`; `None` if argmin reports an error.
fn nelder_mead(b: &[f64], t: &[f64], fixed: f64, per_sample: f64) -> Option<(f64, f64, u64)> {
    let t_mid = t.iter().sum::<f64>() / t.len() as f64;
    let b_mid = b.iter().sum::<f64>() / b.len() as f64;
    let problem = RobustRelativeLoss {
        b,
        t,
        scale: (t_mid, t_mid / b_mid),
    };
    let start = vec![fixed / problem.scale.0, per_sample / problem.scale.1];
    // Simplex edges of a tenth of each parameter, or 0.05 when the start sits on a boundary.
    let step = |v: f64| 0.1 * v.abs().max(0.5);
    let simplex = vec![
        start.clone(),
        vec![start[0] + step(start[0]), start[1]],
        vec![start[0], start[1] + step(start[1])],
    ];
    let solver = NelderMead::new(simplex).with_sd_tolerance(1e-15).ok()?;
    let result = Executor::new(problem, solver)
        .configure(|state| state.max_iters(MAX_ITERS))
        .timer(false)
        .run()
        .ok()?;
    let state = result.state();
    let best = state.get_best_param()?;
    let (fixed, per_sample) = result.problem.problem.as_ref()?.coefficients(best);
    (fixed.is_finite() && per_sample.is_finite()).then_some((fixed, per_sample, state.get_iter()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-12)
    }

    fn law(t0: f64, c: f64, batches: &[usize]) -> Vec<(usize, f64)> {
        batches.iter().map(|&b| (b, t0 + c * b as f64)).collect()
    }

    #[test]
    fn recovers_a_clean_law() {
        let model =
            StepTimeModel::fit(&law(0.012, 0.0031, &[1, 2, 4, 8, 16, 32, 64, 128])).unwrap();
        assert!(close(model.fixed_s, 0.012, 1e-6), "{model:?}");
        assert!(close(model.per_sample_s, 0.0031, 1e-6), "{model:?}");
        assert!(matches!(model.method, TimeFitMethod::NelderMead { .. }));
        assert!(model.loo_rel_error.unwrap() < 1e-6);
        // Throughput at an untested batch, 1024-token sequences.
        let expected = 235.0 * 1024.0 / (0.012 + 0.0031 * 235.0);
        assert!(close(model.tokens_per_s(235, 1024), expected, 1e-6));
    }

    #[test]
    fn one_slow_trial_does_not_bend_the_line() {
        let mut points = law(0.05, 0.01, &[1, 2, 4, 8, 16, 32, 64]);
        points[3].1 *= 1.6; // b = 8 disturbed by 60 %
        let model = StepTimeModel::fit(&points).unwrap();
        assert!(close(model.per_sample_s, 0.01, 0.02), "{model:?}");
        assert!(close(model.fixed_s, 0.05, 0.05), "{model:?}");
        // The held-out error points at the disturbed trial.
        assert!(model.loo_rel_error.unwrap() > 0.3, "{model:?}");
    }

    #[test]
    fn noisy_law_fits_closely() {
        let noise = [1.02, 0.99, 1.01, 0.98, 1.0, 1.015, 0.995];
        let points: Vec<_> = law(0.2, 0.004, &[1, 2, 4, 8, 16, 32, 64])
            .into_iter()
            .zip(noise)
            .map(|((b, t), n)| (b, t * n))
            .collect();
        let model = StepTimeModel::fit(&points).unwrap();
        assert!(close(model.per_sample_s, 0.004, 0.05), "{model:?}");
        assert!(close(model.fixed_s, 0.2, 0.05), "{model:?}");
        assert!(model.loo_rel_error.unwrap() < 0.05);
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Superlinear data would give a negative intercept in plain least squares.
        let points: Vec<_> = [1usize, 2, 4, 8]
            .iter()
            .map(|&b| (b, 0.001 * (b * b) as f64))
            .collect();
        let model = StepTimeModel::fit(&points).unwrap();
        assert!(
            model.fixed_s >= 0.0 && model.per_sample_s > 0.0,
            "{model:?}"
        );
        assert!(model.samples_per_s(1).is_finite());
    }

    #[test]
    fn degenerate_inputs_are_values() {
        assert_eq!(StepTimeModel::fit(&[]), None);
        assert_eq!(StepTimeModel::fit(&[(4, 0.0), (8, f64::NAN)]), None);
        let one = StepTimeModel::fit(&[(4, 0.2)]).unwrap();
        assert_eq!(one.method, TimeFitMethod::Proportional);
        assert!(close(one.step_time_s(8), 0.4, 1e-12));
        assert_eq!(one.loo_rel_error, None);
        let two = StepTimeModel::fit(&[(1, 0.1), (2, 0.15)]).unwrap();
        assert!(
            close(two.per_sample_s, 0.05, 1e-6) && two.loo_rel_error.is_none(),
            "{two:?}"
        );
    }
}
