//! Charts as inline SVG, built by hand: axes with ticks, point series, polylines and
//! horizontal reference lines. Nothing but text comes out, so a report needs no script, font
//! or network, and a test can read what was drawn.

use std::fmt::Write;

/// How an axis maps values to positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Evenly spaced values.
    Linear,
    /// Evenly spaced powers of two (micro-batches double).
    Log2,
}

/// How tick labels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes, in GiB.
    Gib,
    /// Bytes, in MiB.
    Mib,
    /// Plain numbers.
    Count,
}

/// One axis: its range, scale and label.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    /// Shown beside the axis.
    pub label: String,
    /// The smallest value shown.
    pub min: f64,
    /// The largest value shown.
    pub max: f64,
    /// How values map to positions.
    pub scale: Scale,
    /// How ticks read.
    pub unit: Unit,
}

impl Axis {
    /// The fraction of the axis' length at which `value` lies (clamped to the axis).
    pub fn fraction(&self, value: f64) -> f64 {
        let (lo, hi, v) = match self.scale {
            Scale::Linear => (self.min, self.max, value),
            Scale::Log2 => (
                self.min.max(f64::MIN_POSITIVE).log2(),
                self.max.max(f64::MIN_POSITIVE).log2(),
                value.max(f64::MIN_POSITIVE).log2(),
            ),
        };
        if hi <= lo {
            return 0.5;
        }
        ((v - lo) / (hi - lo)).clamp(0.0, 1.0)
    }

    /// Tick values: powers of two on a log axis, round steps (1, 2 or 5 × 10^k of the unit) on
    /// a linear one; at most about eight.
    pub fn ticks(&self) -> Vec<f64> {
        match self.scale {
            Scale::Log2 => {
                let (lo, hi) = (
                    self.min.max(1.0).log2().ceil(),
                    self.max.max(1.0).log2().floor(),
                );
                let count = (hi - lo + 1.0).max(1.0);
                let every = (count / 8.0).ceil().max(1.0);
                let mut ticks = Vec::new();
                let mut e = lo;
                while e <= hi {
                    ticks.push(e.exp2());
                    e += every;
                }
                ticks
            }
            Scale::Linear => {
                let unit = self.unit_size();
                let span = (self.max - self.min) / unit;
                if span.is_nan() || span <= 0.0 {
                    return vec![self.min];
                }
                let raw = span / 6.0;
                let magnitude = 10f64.powf(raw.log10().floor());
                let step = [1.0, 2.0, 5.0, 10.0]
                    .into_iter()
                    .map(|m| m * magnitude)
                    .find(|s| *s >= raw)
                    .unwrap_or(10.0 * magnitude)
                    * unit;
                let mut ticks = Vec::new();
                let mut t = (self.min / step).ceil() * step;
                while t <= self.max + step * 1e-9 {
                    ticks.push(t);
                    t += step;
                }
                ticks
            }
        }
    }

    fn unit_size(&self) -> f64 {
        match self.unit {
            Unit::Gib => 1024.0 * 1024.0 * 1024.0,
            Unit::Mib => 1024.0 * 1024.0,
            Unit::Count => 1.0,
        }
    }

    /// A tick's label.
    pub fn label_of(&self, value: f64) -> String {
        let v = value / self.unit_size();
        let text = if v == v.round() || v.abs() >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        };
        match self.unit {
            Unit::Gib => format!("{text} GiB"),
            Unit::Mib => format!("{text} MiB"),
            Unit::Count if v.abs() >= 1e6 => format!("{:.1}M", v / 1e6),
            Unit::Count if v.abs() >= 1e4 => format!("{:.0}k", v / 1e3),
            Unit::Count => text,
        }
    }
}

/// A marker's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A filled circle: a measured value.
    Circle,
    /// A cross: a setting that ran out of memory.
    Cross,
    /// A hollow square: a setting that crashed or timed out.
    Square,
    /// A larger ring: the chosen setting.
    Ring,
}

/// What a chart draws, back to front.
#[derive(Debug, Clone, PartialEq)]
pub enum Layer {
    /// A horizontal line across the chart, labelled at its right end.
    HLine {
        /// CSS class (its colour and dash come from the page's style).
        class: String,
        /// Where.
        y: f64,
        /// Its label.
        label: String,
        /// Whether the label goes below the line (else above).
        below: bool,
    },
    /// A polyline through points in order.
    Line {
        /// CSS class.
        class: String,
        /// `(x, y)` values.
        points: Vec<(f64, f64)>,
    },
    /// Markers, each with a tooltip.
    Points {
        /// CSS class.
        class: String,
        /// Their shape.
        shape: Shape,
        /// `(x, y, tooltip)`.
        points: Vec<(f64, f64, String)>,
    },
}

/// A chart: a title, two axes and its layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// CSS class of the `<svg>` element (what the chart shows).
    pub class: String,
    /// Shown above the plot.
    pub title: String,
    /// A remark shown at the top right (what the chart leaves out).
    pub note: Option<String>,
    /// Horizontal axis.
    pub x: Axis,
    /// Vertical axis.
    pub y: Axis,
    /// Drawn in order.
    pub layers: Vec<Layer>,
}

/// Plot size and margins, in SVG user units.
const WIDTH: f64 = 410.0;
const HEIGHT: f64 = 280.0;
const LEFT: f64 = 74.0;
const RIGHT: f64 = 96.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 45.0;

impl Chart {
    /// The position of `(x, y)` in the SVG.
    fn at(&self, x: f64, y: f64) -> (f64, f64) {
        let w = WIDTH - LEFT - RIGHT;
        let h = HEIGHT - TOP - BOTTOM;
        (
            LEFT + self.x.fraction(x) * w,
            TOP + (1.0 - self.y.fraction(y)) * h,
        )
    }

    /// The chart as one `<svg>` element.
    pub fn to_svg(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg class="chart {}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{}">"#,
            escape(&self.class),
            escape(&self.title)
        );
        let _ = write!(
            s,
            r#"<text class="title" x="{LEFT}" y="18">{}</text>"#,
            escape(&self.title)
        );
        if let Some(note) = &self.note {
            let _ = write!(
                s,
                r#"<text class="chart-note" x="{}" y="18" text-anchor="end">{}</text>"#,
                WIDTH - 6.0,
                escape(note)
            );
        }
        self.axes(&mut s);
        for layer in &self.layers {
            self.layer(&mut s, layer);
        }
        s.push_str("</svg>");
        s
    }

    fn axes(&self, s: &mut String) {
        let (x0, y0) = (LEFT, HEIGHT - BOTTOM);
        let (x1, y1) = (WIDTH - RIGHT, TOP);
        let _ = write!(
            s,
            r#"<path class="axis" d="M{x0},{y1} L{x0},{y0} L{x1},{y0}"/>"#
        );
        for t in self.x.ticks() {
            let (x, _) = self.at(t, self.y.min);
            let _ = write!(
                s,
                r#"<line class="tick" x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}"/><text class="tick-label" x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                y0 + 4.0,
                y0 + 16.0,
                escape(&self.x.label_of(t))
            );
        }
        for t in self.y.ticks() {
            let (_, y) = self.at(self.x.min, t);
            let _ = write!(
                s,
                r#"<line class="grid" x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}"/><text class="tick-label" x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                x0 - 6.0,
                y + 4.0,
                escape(&self.y.label_of(t))
            );
        }
        let _ = write!(
            s,
            r#"<text class="axis-label" x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            (x0 + x1) / 2.0,
            HEIGHT - 8.0,
            escape(&self.x.label)
        );
        let _ = write!(
            s,
            r#"<text class="axis-label" transform="translate(14,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            (y0 + y1) / 2.0,
            escape(&self.y.label)
        );
    }

    fn layer(&self, s: &mut String, layer: &Layer) {
        match layer {
            Layer::HLine {
                class,
                y,
                label,
                below,
            } => {
                let (_, py) = self.at(self.x.min, *y);
                // Two lines close together (a limit and its usable part) label apart.
                let label_y = if *below { py + 12.0 } else { py - 3.0 };
                let _ = write!(
                    s,
                    r#"<line class="{}" x1="{LEFT}" y1="{py:.1}" x2="{}" y2="{py:.1}"/><text class="line-label {}" x="{}" y="{label_y:.1}">{}</text>"#,
                    escape(class),
                    WIDTH - RIGHT,
                    escape(class),
                    WIDTH - RIGHT + 4.0,
                    escape(label)
                );
            }
            Layer::Line { class, points } => {
                if points.len() < 2 {
                    return;
                }
                let path: Vec<String> = points
                    .iter()
                    .map(|(x, y)| {
                        let (px, py) = self.at(*x, *y);
                        format!("{px:.1},{py:.1}")
                    })
                    .collect();
                let _ = write!(
                    s,
                    r#"<polyline class="{}" points="{}"/>"#,
                    escape(class),
                    path.join(" ")
                );
            }
            Layer::Points {
                class,
                shape,
                points,
            } => {
                for (x, y, tip) in points {
                    let (px, py) = self.at(*x, *y);
                    let title = format!("<title>{}</title>", escape(tip));
                    let _ = match shape {
                        Shape::Circle => write!(
                            s,
                            r#"<circle class="{}" cx="{px:.1}" cy="{py:.1}" r="4">{title}</circle>"#,
                            escape(class)
                        ),
                        Shape::Ring => write!(
                            s,
                            r#"<circle class="{}" cx="{px:.1}" cy="{py:.1}" r="8">{title}</circle>"#,
                            escape(class)
                        ),
                        Shape::Square => write!(
                            s,
                            r#"<rect class="{}" x="{:.1}" y="{:.1}" width="8" height="8">{title}</rect>"#,
                            escape(class),
                            px - 4.0,
                            py - 4.0
                        ),
                        Shape::Cross => write!(
                            s,
                            r#"<path class="{}" d="M{:.1},{:.1} l10,10 M{:.1},{:.1} l-10,10">{title}</path>"#,
                            escape(class),
                            px - 5.0,
                            py - 5.0,
                            px + 5.0,
                            py - 5.0
                        ),
                    };
                }
            }
        }
    }
}

/// Text made safe inside XML and HTML elements and attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn axis(min: f64, max: f64, scale: Scale, unit: Unit) -> Axis {
        Axis {
            label: "x".into(),
            min,
            max,
            scale,
            unit,
        }
    }

    #[test]
    fn axes_map_values_to_fractions_and_pick_round_ticks() {
        let log = axis(1.0, 1024.0, Scale::Log2, Unit::Count);
        assert_eq!(log.fraction(1.0), 0.0);
        assert_eq!(log.fraction(32.0), 0.5);
        assert_eq!(log.fraction(4096.0), 1.0, "clamped");
        assert_eq!(
            log.ticks(),
            vec![1.0, 4.0, 16.0, 64.0, 256.0, 1024.0],
            "every second power of two past eight of them"
        );
        let gib = 1024.0 * 1024.0 * 1024.0;
        let bytes = axis(0.0, 24.0 * gib, Scale::Linear, Unit::Gib);
        assert_eq!(bytes.fraction(6.0 * gib), 0.25);
        let ticks: Vec<f64> = bytes.ticks().iter().map(|t| t / gib).collect();
        assert_eq!(ticks, vec![0.0, 5.0, 10.0, 15.0, 20.0]);
        assert_eq!(bytes.label_of(5.0 * gib), "5 GiB");
        assert_eq!(bytes.label_of(0.5 * gib), "0.5 GiB");
        let rate = axis(0.0, 400_000.0, Scale::Linear, Unit::Count);
        assert_eq!(rate.label_of(350_000.0), "350k");
        assert_eq!(rate.label_of(1_500_000.0), "1.5M");
    }

    #[test]
    fn a_chart_draws_every_layer_where_its_values_are() {
        let chart = Chart {
            class: "memory gpu".into(),
            title: "GPU <peak>".into(),
            note: None,
            x: axis(1.0, 16.0, Scale::Log2, Unit::Count),
            y: axis(0.0, 100.0, Scale::Linear, Unit::Count),
            layers: vec![
                Layer::HLine {
                    class: "budget".into(),
                    y: 100.0,
                    label: "budget".into(),
                    below: false,
                },
                Layer::Line {
                    class: "fit".into(),
                    points: vec![(1.0, 0.0), (16.0, 100.0)],
                },
                Layer::Points {
                    class: "measured".into(),
                    shape: Shape::Circle,
                    points: vec![(4.0, 50.0, "mb=4 & more".into())],
                },
                Layer::Points {
                    class: "oom".into(),
                    shape: Shape::Cross,
                    points: vec![(16.0, 100.0, "out of memory".into())],
                },
            ],
        };
        let svg = chart.to_svg();
        assert!(svg.starts_with(r#"<svg class="chart memory gpu""#));
        assert!(svg.ends_with("</svg>"));
        assert!(svg.contains("GPU &lt;peak&gt;"), "titles are escaped");
        assert!(svg.contains("<title>mb=4 &amp; more</title>"));
        // The plot spans x 74..314 and y 30..235: micro-batch 4 is half way along a log axis
        // from 1 to 16, and 50 half way up.
        assert!(
            svg.contains(r#"<circle class="measured" cx="194.0" cy="132.5" r="4">"#),
            "{svg}"
        );
        assert!(svg.contains(r#"<polyline class="fit" points="74.0,235.0 314.0,30.0"/>"#));
        assert!(svg.contains(r#"<line class="budget" x1="74" y1="30.0" x2="314" y2="30.0"/>"#));
        assert!(svg.contains(r#"<text class="line-label budget" x="318" y="27.0">budget</text>"#));
        assert!(svg.contains(r#"<path class="oom" d="M309.0,25.0 l10,10"#));
    }
}
