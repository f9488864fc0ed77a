//! The page's section on what the plan was tuned on and how long a sequence it takes: the
//! dataset's length histogram with the plan's sequence length and its longest single sequence
//! marked, the share of positions that are padding, and what was cut or dropped.

use std::fmt::Write as _;

use super::svg::escape;
use super::Report;
use crate::plan::{DataProfile, LongestSequence};

/// The widest bar of the histogram, in pixels.
const BAR_PX: f64 = 360.0;

/// The data and longest-sequence section, when the report holds either.
pub(super) fn data_section(s: &mut String, report: &Report) {
    let longest = report
        .choice
        .as_ref()
        .and_then(|c| c.longest_sequence.as_ref());
    if report.data.is_none() && longest.is_none() {
        return;
    }
    s.push_str("<section id=\"data\">\n<h2>Data and sequence length</h2>\n");
    if let Some(data) = &report.data {
        summary(s, data);
        histogram(s, data, longest);
    }
    if let Some(longest) = longest {
        let _ = writeln!(
            s,
            "<p class=\"fit\" id=\"longest\">{}</p>",
            escape(&longest_sentence(longest))
        );
    }
    s.push_str("</section>\n");
}

fn summary(s: &mut String, data: &DataProfile) {
    let _ = writeln!(
        s,
        "<p class=\"summary\">Tuned on {}: {} examples, {} tokens ({} trained on), {} into \
         sequences of {} tokens; {:.1}% of the positions of an epoch's micro-batches are \
         padding. {} cut to the sequence, {} dropped (truncation: {}). Fingerprint {}.</p>",
        escape(&data.files.join(", ")),
        data.examples,
        data.tokens,
        data.trained_tokens,
        data.batching.as_str(),
        data.sequence_tokens,
        100.0 * (1.0 - data.fill),
        data.truncated,
        data.dropped,
        data.truncation.as_str(),
        escape(data.fingerprint.get(..12).unwrap_or(&data.fingerprint)),
    );
}

/// One row a bucket: its range, its count as a bar, and whether the plan's sequence and its
/// longest single sequence hold it.
fn histogram(s: &mut String, data: &DataProfile, longest: Option<&LongestSequence>) {
    let most = data
        .lengths
        .iter()
        .map(|b| b.examples)
        .max()
        .unwrap_or(1)
        .max(1);
    let measured = longest.and_then(|l| l.measured_tokens);
    s.push_str("<table class=\"lengths\">\n<tr><th>length (tokens)</th><th class=\"num\">examples</th><th></th><th>the plan</th></tr>\n");
    let mut from = 0;
    for bucket in &data.lengths {
        let width = BAR_PX * bucket.examples as f64 / most as f64;
        let verdict = if bucket.up_to <= data.sequence_tokens + 1 {
            "within its sequence".to_string()
        } else if measured.is_some_and(|m| bucket.up_to <= m + 1) {
            "cut or dropped, though one sequence of this length fits".to_string()
        } else {
            "cut or dropped: beyond its sequence".to_string()
        };
        let _ = writeln!(
            s,
            "<tr><td>{}–{}</td><td class=\"num\">{}</td><td><svg width=\"{BAR_PX}\" height=\"12\"><rect class=\"bar\" width=\"{width:.1}\" height=\"12\"/></svg></td><td>{verdict}</td></tr>",
            from + 1,
            bucket.up_to,
            bucket.examples,
        );
        from = bucket.up_to;
    }
    s.push_str("</table>\n");
    let _ = writeln!(
        s,
        "<p class=\"fit\">The longest example kept: {} tokens; the plan's sequence: {} tokens.</p>",
        data.longest, data.sequence_tokens
    );
}

/// The longest single sequence in a sentence: the prediction, and what the trials measured.
fn longest_sentence(longest: &LongestSequence) -> String {
    format!(
        "The longest single sequence at the plan's knobs, one a micro-batch: {}.",
        longest.describe()
    )
}
