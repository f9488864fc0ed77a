//! A training run's curves, from its per-step metrics log: the training loss (each step, and
//! smoothed) with the held-out loss where the run evaluated, the learning rate, and the tokens
//! per second, against the step. The same self-contained page as a search's report: inline
//! SVG, no script.

use std::fmt::Write;

use super::html::STYLE;
use super::svg::{escape, Axis, Chart, Layer, Scale, Shape, Unit};

/// One step of the log, as the charts read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    /// Optimizer steps completed.
    pub step: u64,
    /// The step's training loss; `None` where it was not finite.
    pub loss: Option<f64>,
    /// The held-out loss after the step, on the steps that evaluated.
    pub eval_loss: Option<f64>,
    /// The learning rate of the step.
    pub lr: f64,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
}

/// The curves of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingCurves {
    /// What the page is titled by (the log's file name).
    pub name: String,
    /// Every step, in order.
    pub points: Vec<CurvePoint>,
}

/// Steps the smoothed loss averages over, as a share of the run.
const SMOOTHING_SHARE: f64 = 0.05;

impl TrainingCurves {
    /// The page.
    pub fn to_html(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>autotune training: {}</title>\n<style>{STYLE}{CURVE_STYLE}</style>\n</head>\n<body>\n<h1>Training: {}</h1>\n<p class=\"summary\">{}</p>\n<div class=\"charts\">\n",
            escape(&self.name),
            escape(&self.name),
            escape(&self.summary())
        );
        for chart in [self.loss_chart(), self.lr_chart(), self.speed_chart()] {
            s.push_str(&chart.to_svg());
            s.push('\n');
        }
        let _ = write!(
            s,
            "</div>\n<footer>Made by autotune {} from a metrics log. Thin line: each step's training loss; bold: its moving mean over {:.0}% of the run; dots: the held-out loss.</footer>\n</body>\n</html>\n",
            escape(env!("CARGO_PKG_VERSION")),
            SMOOTHING_SHARE * 100.0
        );
        s
    }

    /// The run in one sentence: its steps, its losses first and last, the best held-out loss.
    pub fn summary(&self) -> String {
        let losses: Vec<f64> = self.points.iter().filter_map(|p| p.loss).collect();
        let mut parts = vec![format!("{} steps", self.points.len())];
        if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
            parts.push(format!(
                "training loss {first:.4} at the start, {last:.4} at the end"
            ));
        }
        let best = self
            .points
            .iter()
            .filter_map(|p| p.eval_loss.map(|l| (p.step, l)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((step, loss)) = best {
            parts.push(format!(
                "best held-out loss {loss:.4} (perplexity {:.2}) at step {step}",
                loss.exp()
            ));
        }
        let rates: Vec<f64> = self.points.iter().map(|p| p.tokens_per_s).collect();
        if !rates.is_empty() {
            let mean = rates.iter().sum::<f64>() / rates.len() as f64;
            parts.push(format!("{mean:.0} tokens/s on average"));
        }
        parts.join("; ")
    }

    fn steps_axis(&self) -> Axis {
        let last = self.points.last().map_or(1, |p| p.step);
        let first = self.points.first().map_or(0, |p| p.step);
        Axis {
            label: "step".into(),
            min: first.saturating_sub(1) as f64,
            max: last.max(first + 1) as f64,
            scale: Scale::Linear,
            unit: Unit::Count,
        }
    }

    fn loss_chart(&self) -> Chart {
        let train: Vec<(f64, f64)> = self
            .points
            .iter()
            .filter_map(|p| p.loss.map(|l| (p.step as f64, l)))
            .collect();
        let eval: Vec<(f64, f64, String)> = self
            .points
            .iter()
            .filter_map(|p| {
                let loss = p.eval_loss?;
                Some((
                    p.step as f64,
                    loss,
                    format!("step {}: held-out loss {loss:.4}", p.step),
                ))
            })
            .collect();
        let y = value_axis(
            "loss",
            train.iter().map(|p| p.1).chain(eval.iter().map(|p| p.1)),
        );
        let mut layers = vec![
            Layer::Line {
                class: "loss raw".into(),
                points: train.clone(),
            },
            Layer::Line {
                class: "loss smooth".into(),
                points: smoothed(&train, self.window()),
            },
        ];
        if !eval.is_empty() {
            layers.push(Layer::Line {
                class: "eval".into(),
                points: eval.iter().map(|(x, y, _)| (*x, *y)).collect(),
            });
            layers.push(Layer::Points {
                class: "eval".into(),
                shape: Shape::Circle,
                points: eval,
            });
        }
        Chart {
            class: "loss".into(),
            title: "Loss".into(),
            note: None,
            x: self.steps_axis(),
            y,
            layers,
        }
    }

    fn lr_chart(&self) -> Chart {
        let points: Vec<(f64, f64)> = self.points.iter().map(|p| (p.step as f64, p.lr)).collect();
        let mut y = value_axis("learning rate", points.iter().map(|p| p.1));
        y.min = 0.0;
        Chart {
            class: "lr".into(),
            title: "Learning rate".into(),
            note: None,
            x: self.steps_axis(),
            y,
            layers: vec![Layer::Line {
                class: "lr".into(),
                points,
            }],
        }
    }

    fn speed_chart(&self) -> Chart {
        let points: Vec<(f64, f64)> = self
            .points
            .iter()
            .map(|p| (p.step as f64, p.tokens_per_s))
            .collect();
        let mut y = value_axis("tokens/s", points.iter().map(|p| p.1));
        y.min = 0.0;
        Chart {
            class: "speed".into(),
            title: "Tokens per second".into(),
            note: None,
            x: self.steps_axis(),
            y,
            layers: vec![Layer::Line {
                class: "rate".into(),
                points,
            }],
        }
    }

    /// Steps the smoothed loss averages over.
    fn window(&self) -> usize {
        ((self.points.len() as f64 * SMOOTHING_SHARE).round() as usize).max(1)
    }
}

const CURVE_STYLE: &str = "
svg .loss.raw { fill: none; stroke: #90cdf4; stroke-width: 1; }
svg .loss.smooth { fill: none; stroke: #2b6cb0; stroke-width: 2; }
svg .eval { fill: none; stroke: #c05621; stroke-width: 1.5; } svg circle.eval, svg .eval circle { fill: #c05621; }
svg .lr { fill: none; stroke: #2f855a; stroke-width: 1.5; }
svg .rate { fill: none; stroke: #6b46c1; stroke-width: 1.2; }
";

/// An axis spanning `values` with a little room, from 0 when they are all near it.
fn value_axis(label: &str, values: impl Iterator<Item = f64>) -> Axis {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-12);
    Axis {
        label: label.into(),
        min: (lo - pad).max(0.0).min(lo),
        max: hi + pad,
        scale: Scale::Linear,
        unit: Unit::Count,
    }
}

/// The moving mean of `points`' values over the `window` steps ending at each one.
fn smoothed(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(steps: u64) -> TrainingCurves {
        TrainingCurves {
            name: "metrics.jsonl".into(),
            points: (1..=steps)
                .map(|step| CurvePoint {
                    step,
                    loss: Some(5.0 / step as f64),
                    eval_loss: (step % 10 == 0).then(|| 6.0 / step as f64),
                    lr: 1e-3,
                    tokens_per_s: 1000.0,
                })
                .collect(),
        }
    }

    #[test]
    fn the_page_draws_every_step_the_smoothed_loss_and_the_held_out_points() {
        let curves = run(40);
        let html = curves.to_html();
        assert!(html.starts_with("<!DOCTYPE html>") && !html.contains("<script"));
        assert_eq!(
            html.matches("<svg").count(),
            3,
            "loss, learning rate, speed"
        );
        let held_out = html.matches("held-out loss ").count();
        assert_eq!(
            held_out,
            4 + 1,
            "a tooltip for each evaluation, and the summary"
        );
        let summary = curves.summary();
        assert!(summary.contains("40 steps"), "{summary}");
        assert!(summary.contains("best held-out loss 0.1500"), "{summary}");
        assert!(summary.contains("at step 40"), "{summary}");
    }

    #[test]
    fn the_moving_mean_averages_the_window_ending_at_each_step() {
        let points = [(1.0, 4.0), (2.0, 2.0), (3.0, 6.0), (4.0, 0.0)];
        let smooth: Vec<f64> = smoothed(&points, 2).into_iter().map(|p| p.1).collect();
        assert_eq!(smooth, [4.0, 3.0, 4.0, 3.0]);
        assert_eq!(smoothed(&points, 1), points.to_vec());
    }
}
