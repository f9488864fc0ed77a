//! The longest single sequence a plan's setting can take: what the memory estimate predicts
//! (calibrated by the plan's measured peak), and what trials at that edge measured. Users find
//! this length by trial and error, and run out of memory late, when a long example first
//! appears; a plan says it up front.

use serde::{Deserialize, Serialize};

/// The longest single sequence (one a micro-batch, at the plan's other knobs) the plan's
/// budget holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongestSequence {
    /// The longest length, in tokens, the memory estimate puts within the budget, scaled by the
    /// plan's measured peak over its estimate; `None` when not even one token's estimate fits.
    pub predicted_tokens: Option<usize>,
    /// The longest length a trial fitted within the budget: at the edge, or the plan's own
    /// length when no longer one was tried; `None` when no trial measured any.
    pub measured_tokens: Option<usize>,
    /// The shortest length a trial ran out of memory at (or peaked above the budget), when
    /// one did.
    pub exceeded_tokens: Option<usize>,
    /// Each trial at the edge, in order: the length and whether it fitted.
    pub trials: Vec<EdgeTrial>,
    /// Why no trial measured the edge, when none did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl LongestSequence {
    /// The prediction and what the trials measured, in words: "8445 tokens predicted, 5184
    /// measured (5952 did not fit)".
    pub fn describe(&self) -> String {
        let predicted = match self.predicted_tokens {
            Some(tokens) => format!("{tokens} tokens predicted"),
            None => "none predicted to fit".into(),
        };
        let measured = match (self.measured_tokens, self.exceeded_tokens) {
            (Some(fit), Some(over)) => format!(", {fit} measured ({over} did not fit)"),
            (Some(fit), None) => format!(", {fit} measured"),
            (None, _) => self
                .note
                .as_ref()
                .map_or(String::new(), |note| format!(" ({note})")),
        };
        format!("{predicted}{measured}")
    }
}

/// One trial at the edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeTrial {
    /// The sequence's length, in tokens.
    pub tokens: usize,
    /// Whether it fitted within the budget.
    pub fits: bool,
}

/// The lengths edge trials are rounded down to: a multiple of this many tokens.
pub const EDGE_GRANULARITY: usize = 64;

/// Where to look for the edge: the first trial at the predicted length, then, when that does
/// not fit, bisections between the longest known fit and the shortest failure, until they are
/// one granule apart or the trials are spent. A pure decision: its caller runs the trials.
#[derive(Debug, Clone)]
pub struct EdgeSearch {
    /// A length known to fit (the plan's own sequence: it fitted a micro-batch of at least one).
    known_fit: usize,
    predicted: usize,
    max_trials: usize,
    trials: Vec<EdgeTrial>,
}

impl EdgeSearch {
    /// A search from `known_fit` tokens (which fit) towards `predicted`, in at most
    /// `max_trials` trials.
    pub fn new(known_fit: usize, predicted: usize, max_trials: usize) -> Self {
        Self {
            known_fit,
            predicted,
            max_trials,
            trials: Vec::new(),
        }
    }

    /// Records a trial's outcome.
    pub fn record(&mut self, tokens: usize, fits: bool) {
        self.trials.push(EdgeTrial { tokens, fits });
    }

    /// The longest length known to fit.
    pub fn longest_fit(&self) -> usize {
        let fitted = self.trials.iter().filter(|t| t.fits).map(|t| t.tokens);
        fitted.fold(self.known_fit, usize::max)
    }

    /// The shortest length that did not fit, if any.
    pub fn shortest_failure(&self) -> Option<usize> {
        self.trials
            .iter()
            .filter(|t| !t.fits)
            .map(|t| t.tokens)
            .min()
    }

    /// The next length to try, or `None` when the edge is found (or the trials are spent).
    pub fn next(&self) -> Option<usize> {
        if self.trials.len() >= self.max_trials {
            return None;
        }
        let low = self.longest_fit();
        let high = match self.shortest_failure() {
            Some(failed) => failed,
            // Nothing failed yet: the prediction is the claim to check, once.
            None if self.trials.is_empty() => self.predicted.saturating_add(1),
            None => return None,
        };
        let candidate = match self.shortest_failure() {
            None => self.predicted,
            Some(_) => low + (high - low) / 2,
        };
        let rounded = round_down(candidate).max(low);
        (rounded > low && rounded < high && high - low > EDGE_GRANULARITY).then_some(rounded)
    }

    /// What the search found, beside `predicted`.
    pub fn finish(self, predicted: Option<usize>) -> LongestSequence {
        let longest = self.longest_fit();
        let measured = (longest > 0).then_some(longest);
        LongestSequence {
            predicted_tokens: predicted,
            measured_tokens: measured,
            exceeded_tokens: self.shortest_failure(),
            trials: self.trials,
            note: None,
        }
    }
}

/// `tokens` rounded down to the granule, never below one granule.
fn round_down(tokens: usize) -> usize {
    (tokens / EDGE_GRANULARITY * EDGE_GRANULARITY).max(EDGE_GRANULARITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a search whose trials fit up to `capacity` tokens, returning the lengths tried.
    fn run(known_fit: usize, predicted: usize, capacity: usize) -> (Vec<usize>, LongestSequence) {
        let mut search = EdgeSearch::new(known_fit, predicted, 4);
        let mut tried = Vec::new();
        while let Some(tokens) = search.next() {
            tried.push(tokens);
            search.record(tokens, tokens <= capacity);
        }
        (tried, search.finish(Some(predicted)))
    }

    #[test]
    fn one_trial_confirms_a_prediction_that_fits() {
        let (tried, found) = run(2048, 23_764, 30_000);
        assert_eq!(found.describe(), "23764 tokens predicted, 23744 measured");
        assert_eq!(tried, [23_744]);
        assert_eq!(found.measured_tokens, Some(23_744));
        assert_eq!(found.exceeded_tokens, None);
        assert_eq!(found.predicted_tokens, Some(23_764));
    }

    #[test]
    fn a_prediction_that_fails_is_bisected_down_within_the_trials() {
        let (tried, found) = run(2048, 24_000, 15_000);
        // 24,000 fails; halfway down to 2048 is 12,992 (fits); then 18,496 and 15,744 fail.
        assert_eq!(tried, [24_000, 12_992, 18_496, 15_744]);
        assert_eq!(found.measured_tokens, Some(12_992));
        assert_eq!(found.exceeded_tokens, Some(15_744));
        assert_eq!(found.trials.len(), 4);
    }

    #[test]
    fn nothing_is_tried_where_the_prediction_is_no_longer_than_what_fitted() {
        for predicted in [1000, 2048, 2100] {
            let (tried, found) = run(2048, predicted, 1 << 20);
            assert!(tried.is_empty(), "{predicted}: {tried:?}");
            assert_eq!(
                found.measured_tokens,
                Some(2048),
                "the plan's own length fitted"
            );
        }
        // Below one granule nothing is tried, and nothing is known to fit.
        let nothing_known = EdgeSearch::new(0, 50, 4);
        assert_eq!(nothing_known.next(), None);
        assert_eq!(nothing_known.finish(Some(50)).measured_tokens, None);
    }

    #[test]
    fn the_bisection_stops_one_granule_apart() {
        let mut search = EdgeSearch::new(1024, 4096, 16);
        search.record(4096, false);
        search.record(2560, true);
        search.record(3328, false);
        search.record(2944, true);
        search.record(3136, true);
        search.record(3200, true);
        assert_eq!(search.longest_fit(), 3200);
        assert_eq!(search.next(), Some(3264));
        search.record(3264, true);
        assert_eq!(search.next(), None, "3264 fits and 3328 does not");
    }
}
