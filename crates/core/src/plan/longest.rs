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
    /// Why no trial measured the edge, when none did, or why the trials stopped before they
    /// found it.
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
        let note = self.note.as_deref();
        let measured = match self.measured_tokens {
            Some(fit) => {
                let over = self
                    .exceeded_tokens
                    .map(|over| format!("{over} did not fit"));
                let said: Vec<String> = over.into_iter().chain(note.map(str::to_string)).collect();
                if said.is_empty() {
                    format!(", {fit} measured")
                } else {
                    format!(", {fit} measured ({})", said.join("; "))
                }
            }
            None => note.map_or(String::new(), |note| format!(" ({note})")),
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
/// one granule apart, the trials are spent, or (with a time limit) the next trial would end
/// past it. A pure decision: its caller runs the trials and says how long each took.
#[derive(Debug, Clone)]
pub struct EdgeSearch {
    /// A length known to fit (the plan's own sequence: it fitted a micro-batch of at least one).
    known_fit: usize,
    predicted: usize,
    max_trials: usize,
    trials: Vec<EdgeTrial>,
    /// Seconds the trials may take together; `None` for no limit.
    time_limit_s: Option<f64>,
    /// Seconds each trial took, in order.
    trial_s: Vec<f64>,
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
            time_limit_s: None,
            trial_s: Vec::new(),
        }
    }

    /// The same search, whose trials may take `seconds` together: a trial after the first
    /// starts only if the time spent plus the slowest trial so far stays within it. The first
    /// always runs, since it checks the prediction.
    pub fn within(self, seconds: f64) -> Self {
        Self {
            time_limit_s: Some(seconds),
            ..self
        }
    }

    /// Records a trial's outcome and how many seconds it took.
    pub fn record(&mut self, tokens: usize, fits: bool, seconds: f64) {
        self.trials.push(EdgeTrial { tokens, fits });
        self.trial_s.push(seconds);
    }

    /// Seconds the trials took so far.
    fn spent_s(&self) -> f64 {
        self.trial_s.iter().sum()
    }

    /// Whether the next trial would end past the time limit.
    fn out_of_time(&self) -> bool {
        let Some(limit) = self.time_limit_s else {
            return false;
        };
        let spent = self.spent_s();
        let slowest = self.trial_s.iter().copied().fold(0.0, f64::max);
        !self.trial_s.is_empty() && spent + slowest > limit
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

    /// The next length to try, or `None` when the edge is found (or the trials or the time
    /// are spent).
    pub fn next(&self) -> Option<usize> {
        if self.out_of_time() {
            return None;
        }
        self.next_length()
    }

    /// The next length the bisection would try, whatever the time.
    fn next_length(&self) -> Option<usize> {
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

    /// What the search found, beside `predicted`; a note when the time limit stopped it short
    /// of the edge.
    pub fn finish(self, predicted: Option<usize>) -> LongestSequence {
        let longest = self.longest_fit();
        let measured = (longest > 0).then_some(longest);
        let note = (self.out_of_time() && self.next_length().is_some()).then(|| {
            format!(
                "the edge trials stopped after {} trials and {:.0} s, their time limit",
                self.trials.len(),
                self.spent_s()
            )
        });
        LongestSequence {
            predicted_tokens: predicted,
            measured_tokens: measured,
            exceeded_tokens: self.shortest_failure(),
            trials: self.trials,
            note,
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
            search.record(tokens, tokens <= capacity, 1.0);
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
        search.record(4096, false, 1.0);
        search.record(2560, true, 1.0);
        search.record(3328, false, 1.0);
        search.record(2944, true, 1.0);
        search.record(3136, true, 1.0);
        search.record(3200, true, 1.0);
        assert_eq!(search.longest_fit(), 3200);
        assert_eq!(search.next(), Some(3264));
        search.record(3264, true, 1.0);
        assert_eq!(search.next(), None, "3264 fits and 3328 does not");
    }

    /// With a time limit, a trial after the first starts only where the time spent plus the
    /// slowest trial so far stays within it; a search stopped short of the edge says so.
    #[test]
    fn a_time_limit_stops_the_bisection_and_the_result_says_why() {
        // (limit, seconds of each trial): the trials run, then whether a note is left. The
        // prediction (24,000) fails and the edge (15,000) takes four trials to bracket.
        let cases: [(f64, [f64; 4], usize, bool); 5] = [
            (1000.0, [10.0; 4], 4, false),
            (25.0, [10.0; 4], 2, true),
            (19.0, [10.0; 4], 1, true),
            (5.0, [10.0; 4], 1, true),
            (60.0, [30.0, 5.0, 5.0, 5.0], 2, true),
        ];
        for (limit, seconds, expected, noted) in cases {
            let mut search = EdgeSearch::new(2048, 24_000, 4).within(limit);
            let mut tried = 0;
            while let Some(tokens) = search.next() {
                search.record(tokens, tokens <= 15_000, seconds[tried]);
                tried += 1;
            }
            assert_eq!(tried, expected, "limit {limit}, trials {seconds:?}");
            let found = search.finish(Some(24_000));
            assert_eq!(found.note.is_some(), noted, "limit {limit}: {found:?}");
            if noted {
                assert!(found.describe().contains("their time limit"), "{found:?}");
            }
        }
        // A search that found its edge within the time leaves no note, even if the limit is
        // spent by then.
        let mut search = EdgeSearch::new(2048, 20_000, 4).within(10.0);
        let tokens = search.next().unwrap();
        search.record(tokens, true, 50.0);
        assert_eq!(search.next(), None);
        let found = search.finish(Some(20_000));
        assert_eq!(found.note, None);
        assert_eq!(found.describe(), "20000 tokens predicted, 19968 measured");
    }
}
