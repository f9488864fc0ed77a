//! The dataset a plan was tuned on: which one (its fingerprint), how its batches are made
//! (packed or padded, at what sequence length), and the lengths of its examples. A plan tuned
//! on one dataset says nothing about another's longest example, so training with a plan checks
//! that its data is the plan's ([`DataProfile::check`]).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How a dataset's examples become a micro-batch's sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// As many examples a sequence as fit its length, each attending only to itself.
    Packed,
    /// One example a sequence, padded to the longest of its micro-batch.
    Padded,
}

impl Batching {
    /// The word people read.
    pub fn as_str(self) -> &'static str {
        match self {
            Batching::Packed => "packed",
            Batching::Padded => "padded",
        }
    }
}

/// What happens to an example longer than the sequence length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// Keep its first tokens.
    #[default]
    Cut,
    /// Leave it out of training.
    Drop,
}

impl Truncation {
    /// The word people read (and `--truncate` takes).
    pub fn as_str(self) -> &'static str {
        match self {
            Truncation::Cut => "cut",
            Truncation::Drop => "drop",
        }
    }
}

impl std::str::FromStr for Truncation {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "cut" => Ok(Truncation::Cut),
            "drop" => Ok(Truncation::Drop),
            _ => Err(format!("unknown truncation `{s}`; expected cut or drop")),
        }
    }
}

/// How many examples have a length within one bucket: longer than the previous bucket's
/// `up_to`, at most this one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthBucket {
    /// The bucket's longest length, in tokens.
    pub up_to: usize,
    /// Examples in it.
    pub examples: usize,
}

/// The lengths of examples in buckets that double (up to 16, 32, 64, …), the last one holding
/// the longest example; empty buckets are left out.
pub fn length_histogram(lengths: impl IntoIterator<Item = usize>) -> Vec<LengthBucket> {
    let mut counts: std::collections::BTreeMap<usize, usize> = Default::default();
    for length in lengths {
        let up_to = length.max(16).next_power_of_two();
        *counts.entry(up_to).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(up_to, examples)| LengthBucket { up_to, examples })
        .collect()
}

/// The dataset a plan was tuned on, as its trials saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataProfile {
    /// A hash of the data files' bytes, the tokenizer's files and how records become examples
    /// (schema, columns, what the loss trains on): the same files read the same way have the
    /// same fingerprint.
    pub fingerprint: String,
    /// The data as it was given.
    pub files: Vec<String>,
    /// How the examples become sequences.
    pub batching: Batching,
    /// What happened to examples longer than the sequence length.
    pub truncation: Truncation,
    /// The positions of one sequence the trials ran: packed, the length examples are packed
    /// into; padded, the longest example's (the widest micro-batch there is).
    pub sequence_tokens: usize,
    /// Examples trained on.
    pub examples: usize,
    /// Tokens of those examples, and of those, the ones the loss counts.
    pub tokens: usize,
    /// Of `tokens`, the ones the loss counts.
    pub trained_tokens: usize,
    /// Examples cut to the sequence length.
    pub truncated: usize,
    /// Examples left out: longer than the sequence length (with `truncation` `drop`), or with
    /// no token to train on.
    pub dropped: usize,
    /// The longest example kept, in tokens.
    pub longest: usize,
    /// The lengths of every example before any cut, those dropped included: where the
    /// sequence length falls among them.
    pub lengths: Vec<LengthBucket>,
    /// Of the positions of an epoch's micro-batches at the plan's micro-batch, the share that
    /// holds an example's token rather than padding.
    pub fill: f64,
}

const WHAT: &str = "plan";

impl DataProfile {
    /// Checks the profile's own consistency.
    pub fn validate(&self) -> Result<()> {
        let field = |name: &str| format!("data.{name}");
        if !(self.fill.is_finite() && self.fill > 0.0 && self.fill <= 1.0) {
            return Err(Error::invalid(
                WHAT,
                field("fill"),
                format!("({}) must be a share above 0 and at most 1", self.fill),
            ));
        }
        if self.trained_tokens > self.tokens || self.longest > self.tokens {
            return Err(Error::invalid(
                WHAT,
                field("trained_tokens"),
                "must be at most data.tokens, as must data.longest",
            ));
        }
        let bucketed: usize = self.lengths.iter().map(|b| b.examples).sum();
        if bucketed != self.examples + self.dropped {
            return Err(Error::invalid(
                WHAT,
                field("lengths"),
                format!(
                    "count {bucketed} examples, but data.examples and data.dropped are {} and {}",
                    self.examples, self.dropped
                ),
            ));
        }
        Ok(())
    }

    /// Whether training on the data `used` (its fingerprint and batching; `None` for data
    /// that is no dataset of records, e.g. synthetic sequences) is training on this profile's
    /// data, as the plan's trials measured it.
    pub fn check(&self, used: Option<(&str, Batching)>) -> std::result::Result<(), DataMismatch> {
        match used {
            None => Err(DataMismatch::NoDataset),
            Some((fingerprint, _)) if fingerprint != self.fingerprint => {
                Err(DataMismatch::OtherDataset)
            }
            Some((_, batching)) if batching != self.batching => {
                Err(DataMismatch::OtherBatching(batching))
            }
            Some(_) => Ok(()),
        }
    }
}

/// How the data of a run differs from the data its plan was tuned on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataMismatch {
    /// The run trains on no dataset of records.
    NoDataset,
    /// Other files, another tokenizer, or records read another way.
    OtherDataset,
    /// The same examples, batched the other way.
    OtherBatching(Batching),
}

impl DataMismatch {
    /// What differs, in a sentence's words, for a plan tuned on `plan`.
    pub fn describe(self, plan: &DataProfile) -> String {
        let tuned = format!(
            "was tuned on {} ({} examples, {}, the longest {} tokens)",
            plan.files.join(", "),
            plan.examples,
            plan.batching.as_str(),
            plan.longest
        );
        match self {
            DataMismatch::NoDataset => format!("{tuned}, but this run trains on no dataset"),
            DataMismatch::OtherDataset => format!(
                "{tuned}, but this run's data differs: other files, another tokenizer, or \
                 records read another way (fingerprint {} there)",
                short(&plan.fingerprint)
            ),
            DataMismatch::OtherBatching(batching) => {
                format!("{tuned}, but this run's batches are {}", batching.as_str())
            }
        }
    }
}

fn short(fingerprint: &str) -> &str {
    fingerprint.get(..12).unwrap_or(fingerprint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> DataProfile {
        DataProfile {
            fingerprint: "ab".repeat(32),
            files: vec!["chat.jsonl".into()],
            batching: Batching::Packed,
            truncation: Truncation::Cut,
            sequence_tokens: 2048,
            examples: 3,
            tokens: 300,
            trained_tokens: 120,
            truncated: 0,
            dropped: 1,
            longest: 200,
            lengths: length_histogram([40, 60, 200, 9]),
            fill: 0.9,
        }
    }

    #[test]
    fn lengths_fall_in_doubling_buckets() {
        let buckets = length_histogram([1, 16, 17, 32, 33, 1000, 1024, 1025]);
        let pairs: Vec<(usize, usize)> = buckets.iter().map(|b| (b.up_to, b.examples)).collect();
        assert_eq!(pairs, [(16, 2), (32, 2), (64, 1), (1024, 2), (2048, 1)]);
        assert!(length_histogram([]).is_empty());
    }

    #[test]
    fn a_run_matches_only_its_plans_data_and_batching() {
        let plan = profile();
        let same = plan.fingerprint.clone();
        let table = [
            (None, Err(DataMismatch::NoDataset)),
            (
                Some(("cd", Batching::Packed)),
                Err(DataMismatch::OtherDataset),
            ),
            (
                Some((same.as_str(), Batching::Padded)),
                Err(DataMismatch::OtherBatching(Batching::Padded)),
            ),
            (Some((same.as_str(), Batching::Packed)), Ok(())),
        ];
        for (used, expected) in table {
            assert_eq!(plan.check(used), expected, "{used:?}");
        }
        let said = DataMismatch::OtherDataset.describe(&plan);
        assert!(
            said.contains("chat.jsonl") && said.contains("abababababab"),
            "{said}"
        );
    }

    #[test]
    fn an_inconsistent_profile_is_refused() {
        assert!(profile().validate().is_ok());
        let mut odd = profile();
        odd.fill = 1.5;
        assert!(odd
            .validate()
            .unwrap_err()
            .to_string()
            .contains("data.fill"));
        let mut odd = profile();
        odd.examples = 4;
        assert!(odd
            .validate()
            .unwrap_err()
            .to_string()
            .contains("data.lengths"));
        let mut odd = profile();
        odd.trained_tokens = 301;
        assert!(odd.validate().is_err());
    }
}
