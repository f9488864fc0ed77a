//! A dataset as a plan is tuned on it: the sequence length its micro-batches take (packed, the
//! length examples are packed into; padded, the longest example's, the widest micro-batch
//! there is), and the profile the plan records ([`DataProfile`]).

use super::dataset::{Cut, Dataset};
use super::load::RecordsSpec;
use crate::plan::{length_histogram, Batching, DataProfile, Truncation};

/// A loaded dataset, shaped for the trials of a search.
#[derive(Debug, Clone)]
pub struct DataShape {
    dataset: Dataset,
    cut: Cut,
    files: Vec<String>,
    /// The records' examples key: the same files read the same way.
    fingerprint: String,
    truncation: Truncation,
    batching: Batching,
    sequence_tokens: usize,
}

impl DataShape {
    /// The examples of `dataset` (cut as `cut` says, from the records `records` describe,
    /// given as `files`), batched as `batching` says into sequences at most `seq_len` long.
    pub fn new(
        mut dataset: Dataset,
        cut: Cut,
        records: &RecordsSpec,
        files: &[String],
        batching: Batching,
        seq_len: usize,
    ) -> Self {
        let sequence_tokens = match batching {
            Batching::Packed => seq_len,
            // An example of n tokens is n − 1 inputs, each predicting the next.
            Batching::Padded => dataset.lengths().max().map_or(seq_len, |n| n - 1),
        };
        if batching == Batching::Packed {
            dataset.set_packing(Some(sequence_tokens));
        }
        Self {
            dataset,
            cut,
            files: files.to_vec(),
            fingerprint: records.examples_key.clone(),
            truncation: records.truncation,
            batching,
            sequence_tokens,
        }
    }

    /// The positions of one sequence of a micro-batch at its widest: what the trials run.
    pub fn sequence_tokens(&self) -> usize {
        self.sequence_tokens
    }

    /// How the examples become sequences.
    pub fn batching(&self) -> Batching {
        self.batching
    }

    /// What cutting the examples to the sequence length did.
    pub fn cut(&self) -> Cut {
        self.cut
    }

    /// The profile a plan at `micro_batch` sequences a micro-batch records.
    pub fn profile(&self, micro_batch: usize) -> DataProfile {
        let cut = self.cut;
        DataProfile {
            fingerprint: self.fingerprint.clone(),
            files: self.files.clone(),
            batching: self.batching,
            truncation: self.truncation,
            sequence_tokens: self.sequence_tokens,
            examples: cut.kept,
            tokens: cut.tokens,
            trained_tokens: cut.trained_tokens,
            truncated: cut.truncated,
            dropped: cut.dropped + cut.too_long,
            longest: self.dataset.lengths().max().unwrap_or(0),
            lengths: length_histogram(self.dataset.lengths_before_cut()),
            fill: self.dataset.fill(0, micro_batch),
        }
    }
}

/// The fingerprint and batching of a run's data, to check against its plan's
/// ([`DataProfile::check`]): `None` when the run trains on no dataset of records.
pub fn run_data(records: Option<&RecordsSpec>, packs: bool) -> Option<(&str, Batching)> {
    let batching = if packs {
        Batching::Packed
    } else {
        Batching::Padded
    };
    records.map(|r| (r.examples_key.as_str(), batching))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::Example;

    fn example(len: usize) -> Example {
        Example {
            ids: (0..len as u32).collect(),
            trained: (0..len).map(|i| i > 0).collect(),
        }
    }

    fn records() -> RecordsSpec {
        serde_json::from_value(serde_json::json!({
            "files": ["chat.jsonl"],
            "tokenizer": "tokenizer.json",
            "train_on": null,
            "columns": {},
            "format": null,
            "held_out": "none",
            "fingerprint": "f",
            "examples_key": "k",
        }))
        .unwrap()
    }

    #[test]
    fn padded_trials_run_the_longest_example_and_packed_ones_the_whole_sequence() {
        let examples: Vec<Example> = [5, 9, 17, 3].map(example).to_vec();
        let (set, cut) = Dataset::of_examples(&examples, 64, 0).unwrap();
        let files = ["chat.jsonl".to_string()];
        let padded = DataShape::new(set.clone(), cut, &records(), &files, Batching::Padded, 64);
        assert_eq!(padded.sequence_tokens(), 16, "17 tokens: 16 inputs");
        let profile = padded.profile(4);
        assert_eq!(
            (profile.examples, profile.longest, profile.tokens),
            (4, 17, 34)
        );
        // One micro-batch of four, each 16 wide: 4 + 8 + 16 + 2 inputs of 64 positions.
        assert!(
            (profile.fill - 30.0 / 64.0).abs() < 1e-12,
            "{}",
            profile.fill
        );
        assert_eq!(profile.fingerprint, "k");
        let packed = DataShape::new(set, cut, &records(), &files, Batching::Packed, 64);
        assert_eq!(packed.sequence_tokens(), 64);
        let profile = packed.profile(4);
        assert!(
            (profile.fill - 30.0 / 64.0).abs() < 1e-12,
            "one sequence holds all four"
        );
        assert!(profile.validate().is_ok());
        // Cut at 8 tokens, the histogram still shows every example's own length.
        let (short, cut) = Dataset::of_examples(&examples, 8, 0).unwrap();
        let shape = DataShape::new(short, cut, &records(), &files, Batching::Packed, 8);
        let profile = shape.profile(4);
        assert_eq!((profile.truncated, profile.longest), (1, 9));
        let buckets: Vec<(usize, usize)> = profile
            .lengths
            .iter()
            .map(|b| (b.up_to, b.examples))
            .collect();
        assert_eq!(buckets, [(16, 3), (32, 1)]);
    }
}
