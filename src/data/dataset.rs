//! Tokenized examples as training takes them: each example's token ids and which of them the
//! loss trains on, walked epoch after epoch in a seeded order, cut into micro-batches with the
//! padding and the untrained tokens masked out of the loss. A micro-batch's sequences hold one
//! example each, padded to the longest of them, or, packed ([`super::pack`]), as many examples
//! as fit the sequence length, each with its own positions.
//!
//! The micro-batch at `(step, micro)` is a pure function of the seed and its coordinates (the
//! `p`-th example of the walk is example `order(epoch)[p mod n]`, epoch `p div n`; packed, the
//! `p`-th sequence of the epochs' packings), so a resumed run continues at the same example of
//! the same epoch, and data-parallel ranks take disjoint micro-batches of each step as they do
//! of synthetic data.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::pack::{pack_rows, PackedEpochs};
use super::table::{ExampleTable, ExampleTokens};
use crate::model::batch::{Batch, LossMask};
use crate::model::dropout::Dropout;
use crate::plan::Truncation;
use crate::{Error, Result};

/// One tokenized example: its ids, and for each whether the model is trained to predict it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Token ids, BOS first where the tokenizer has one, EOS (or the end of turn) last.
    pub ids: Vec<u32>,
    /// Whether `ids[i]` is a target the loss counts (the first id never is: nothing predicts
    /// it).
    pub trained: Vec<bool>,
}

/// What cutting examples to the sequence length did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Cut {
    /// Examples kept.
    pub kept: usize,
    /// Of those, the examples cut to the sequence length (their first tokens kept).
    pub truncated: usize,
    /// Examples left without a trained token (after a cut, or before): dropped.
    pub dropped: usize,
    /// Examples longer than the sequence length, left out (`--truncate drop`).
    pub too_long: usize,
    /// Tokens kept, and of those trained on.
    pub tokens: usize,
    /// Of the kept tokens, the ones the loss counts.
    pub trained_tokens: usize,
}

/// Examples ready to batch: at most `seq_len + 1` tokens each (a sequence's inputs and its
/// targets one further), each with a trained token. They are a selection of a table's
/// examples, cut by length, never a copy: a dataset and its held-out part share one table.
#[derive(Debug, Clone)]
pub struct Dataset {
    table: Arc<ExampleTable>,
    /// The examples kept: each one's index in the table and how many of its tokens are kept.
    kept: Arc<Vec<(usize, usize)>>,
    /// Every example chosen, kept or not, by its index in the table.
    chosen: Arc<Vec<usize>>,
    pad_id: u32,
    /// Micro-batches per optimizer step over all ranks: the walk's stride.
    micros_per_step: u64,
    /// The last epoch order drawn, by seed and epoch: every micro-batch of an epoch walks the
    /// same order, drawn once.
    last_order: Arc<Mutex<Option<EpochOrder>>>,
    /// Packed micro-batches: the walk over the epochs' packings and the sequence length;
    /// `None`: one example a sequence, padded.
    packing: Option<(Arc<PackedEpochs>, usize)>,
}

/// An epoch's order of the examples, by the run's seed and the epoch.
#[derive(Debug)]
struct EpochOrder {
    seed: u64,
    epoch: u64,
    order: Arc<Vec<usize>>,
}

impl Dataset {
    /// The examples `chosen` of `table`, those longer than `seq_len` cut to it or left out as
    /// `truncation` says, without those with nothing to train on; padding takes `pad_id`. An
    /// empty result (every label masked) is an error, not a silent zero loss.
    pub fn new(
        table: Arc<ExampleTable>,
        chosen: impl IntoIterator<Item = usize>,
        seq_len: usize,
        pad_id: u32,
        truncation: Truncation,
    ) -> Result<(Self, Cut)> {
        let mut cut = Cut::default();
        let mut kept = Vec::new();
        let chosen: Vec<usize> = chosen.into_iter().collect();
        for &i in &chosen {
            let length = table.length(i);
            if truncation == Truncation::Drop && length > seq_len + 1 {
                cut.too_long += 1;
                continue;
            }
            let len = length.min(seq_len + 1);
            let trained = table.trained(i)?;
            let counted = trained[..len].iter().skip(1).filter(|&&t| t != 0).count();
            if counted == 0 || len < 2 {
                cut.dropped += 1;
                continue;
            }
            cut.kept += 1;
            cut.truncated += usize::from(length > len);
            cut.tokens += len;
            cut.trained_tokens += counted;
            kept.push((i, len));
        }
        if kept.is_empty() && cut.too_long > 0 {
            return Err(Error::Usage(format!(
                "every example is longer than the sequence length of {seq_len} tokens, and \
                 --truncate drop leaves them out ({} of them); cut them instead (--truncate cut) \
                 or give longer sequences (--seq-len)",
                cut.too_long
            )));
        }
        if kept.is_empty() {
            return Err(Error::Usage(format!(
                "no example has a token to train on ({} dropped, every label masked or cut off \
                 at {seq_len} tokens); train on more of each example (--train-on all) or give \
                 longer sequences",
                cut.dropped
            )));
        }
        let dataset = Self {
            table,
            kept: Arc::new(kept),
            chosen: Arc::new(chosen),
            pad_id,
            micros_per_step: 1,
            last_order: Arc::default(),
            packing: None,
        };
        Ok((dataset, cut))
    }

    /// Every one of `examples`, held in a table of their own.
    pub fn of_examples(examples: &[Example], seq_len: usize, pad_id: u32) -> Result<(Self, Cut)> {
        let table = Arc::new(ExampleTable::new(examples));
        Self::new(table, 0..examples.len(), seq_len, pad_id, Truncation::Cut)
    }

    /// How many examples the dataset holds.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether the dataset holds no example (never, once made).
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Example `i` as cut: its ids and trained flags.
    pub fn get(&self, i: usize) -> Result<ExampleTokens<'_>> {
        let (at, len) = self.kept[i];
        let tokens = self.table.get(at)?;
        Ok(ExampleTokens {
            ids: cut_to(tokens.ids, len),
            trained: cut_to(tokens.trained, len),
        })
    }

    /// Example `i` as cut, copied out.
    pub fn example(&self, i: usize) -> Result<Example> {
        Ok(self.get(i)?.to_example())
    }

    /// Sets the micro-batches one optimizer step takes over all ranks (accumulation × ranks),
    /// the stride of the walk.
    pub fn set_micros_per_step(&mut self, micros: usize) {
        self.micros_per_step = micros.max(1) as u64;
    }

    /// Packs micro-batches into sequences of `seq_len` positions (`None`: pads each example).
    pub fn set_packing(&mut self, seq_len: Option<usize>) {
        self.packing = seq_len.map(|len| (Arc::new(PackedEpochs::new()), len.max(1)));
    }

    /// Whether micro-batches are packed.
    pub fn is_packed(&self) -> bool {
        self.packing.is_some()
    }

    /// Optimizer steps `epochs` epochs take at `micro_batch` sequences a micro-batch.
    pub fn steps_for_epochs(&self, seed: u64, epochs: u64, micro_batch: usize) -> u64 {
        let per_step = self.micros_per_step * micro_batch.max(1) as u64;
        match &self.packing {
            None => epochs.saturating_mul((self.len() as u64).div_ceil(per_step)),
            Some((_, seq_len)) => {
                let rows = PackedEpochs::rows_in_epochs(epochs, |e| self.pack(seed, e, *seq_len));
                rows.div_ceil(per_step)
            }
        }
    }

    /// The length of every example chosen, kept or not, before any cut, in tokens.
    pub fn lengths_before_cut(&self) -> impl Iterator<Item = usize> + '_ {
        self.chosen.iter().map(|&i| self.table.length(i))
    }

    /// The length of every example kept, in tokens, in dataset order.
    pub fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.kept.iter().map(|&(_, len)| len)
    }

    /// Of the positions of the first epoch's micro-batches of `micro_batch` sequences (in a
    /// run seeded with `seed`), the share that holds an example's token rather than padding.
    pub fn fill(&self, seed: u64, micro_batch: usize) -> f64 {
        // An example of n tokens fills n − 1 positions: its inputs.
        let real: usize = self.lengths().map(|len| len - 1).sum();
        let positions = match &self.packing {
            Some((_, seq_len)) => self.pack(seed, 0, *seq_len).len() * seq_len,
            None => self
                .order(seed, 0)
                .chunks(micro_batch.max(1))
                .map(|picks| {
                    let widest = picks.iter().map(|&i| self.kept[i].1 - 1).max();
                    widest.unwrap_or(0) * picks.len()
                })
                .sum(),
        };
        real as f64 / positions.max(1) as f64
    }

    /// Epoch `epoch`'s examples packed into sequences of `seq_len` positions.
    fn pack(&self, seed: u64, epoch: u64, seq_len: usize) -> Vec<Vec<usize>> {
        let order = self.order(seed, epoch);
        // An example of n tokens takes n − 1 positions: its inputs, each predicting the next.
        pack_rows(&order, |i| self.kept[i].1 - 1, seq_len)
    }

    /// The sequences of micro-batch `micro` of step `step`, in a run seeded with `seed`: each
    /// the examples it holds (one, unpacked).
    pub fn micro_batch_rows(
        &self,
        seed: u64,
        step: u64,
        micro: u64,
        micro_batch: usize,
    ) -> Vec<Vec<usize>> {
        match &self.packing {
            None => self
                .picks(seed, step, micro, micro_batch)
                .into_iter()
                .map(|i| vec![i])
                .collect(),
            Some((walk, seq_len)) => {
                let first = (step * self.micros_per_step + micro) * micro_batch as u64;
                walk.rows(seed, first, micro_batch, |e| self.pack(seed, e, *seq_len))
            }
        }
    }

    /// The examples of micro-batch `micro` of step `step`, in a run seeded with `seed`.
    pub fn picks(&self, seed: u64, step: u64, micro: u64, micro_batch: usize) -> Vec<usize> {
        let n = self.len() as u64;
        let first = (step * self.micros_per_step + micro) * micro_batch as u64;
        let mut order: Option<(u64, Arc<Vec<usize>>)> = None;
        (first..first + micro_batch as u64)
            .map(|p| {
                let epoch = p / n;
                if order.as_ref().map(|(e, _)| *e) != Some(epoch) {
                    order = Some((epoch, self.order(seed, epoch)));
                }
                order.as_ref().map_or(0, |(_, o)| o[(p % n) as usize])
            })
            .collect()
    }

    /// The examples of the held-out batch: the first `micro_batch` of an order no training
    /// epoch takes.
    pub fn eval_picks(&self, seed: u64, micro_batch: usize) -> Vec<usize> {
        let order = self.order(seed ^ 0x0E7A_1000, u64::MAX);
        order.iter().copied().cycle().take(micro_batch).collect()
    }

    /// Epoch `epoch`'s order of the examples: a shuffle seeded by the run and the epoch.
    fn order(&self, seed: u64, epoch: u64) -> Arc<Vec<usize>> {
        let mut last = self
            .last_order
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(last) = last.as_ref().filter(|l| (l.seed, l.epoch) == (seed, epoch)) {
            return last.order.clone();
        }
        let mut order: Vec<usize> = (0..self.len()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(Dropout::key(seed ^ 0xE90C, epoch, 0));
        order.shuffle(&mut rng);
        let order = Arc::new(order);
        *last = Some(EpochOrder {
            seed,
            epoch,
            order: order.clone(),
        });
        order
    }

    /// The micro-batch of sequences `rows` (each the examples it holds) in host memory: packed
    /// sequences with their position ids, padded to the longest, or one example a sequence
    /// padded to the longest.
    pub fn host_batch_of_rows(&self, rows: &[Vec<usize>]) -> Result<HostBatch> {
        if self.packing.is_none() {
            let picks: Vec<usize> = rows.iter().flatten().copied().collect();
            return self.host_batch(&picks);
        }
        let used = |row: &Vec<usize>| row.iter().map(|&i| self.kept[i].1 - 1).sum::<usize>();
        let width = rows.iter().map(used).max().unwrap_or(1).max(1);
        let cells = rows.len() * width;
        let mut batch = HostBatch {
            inputs: Vec::with_capacity(cells),
            targets: Vec::with_capacity(cells),
            weights: Vec::with_capacity(cells),
            sequences: rows.len(),
            width,
            positions: Some(Vec::with_capacity(cells)),
            real_tokens: 0,
        };
        for row in rows {
            for &i in row {
                let tokens = self.get(i)?;
                batch.push_example(&tokens.ids, &tokens.trained);
            }
            batch.pad_to(self.pad_id, width);
        }
        Ok(batch)
    }

    /// The micro-batch of examples `picks` in host memory, padded to the longest of them.
    pub fn host_batch(&self, picks: &[usize]) -> Result<HostBatch> {
        let width = picks.iter().map(|&i| self.kept[i].1 - 1).max().unwrap_or(1);
        let rows = picks.len() * width;
        let mut batch = HostBatch {
            inputs: Vec::with_capacity(rows),
            targets: Vec::with_capacity(rows),
            weights: Vec::with_capacity(rows),
            sequences: picks.len(),
            width,
            positions: None,
            real_tokens: 0,
        };
        for &i in picks {
            let tokens = self.get(i)?;
            batch.push_example(&tokens.ids, &tokens.trained);
            // Padding on the right: causal attention keeps the example's positions from
            // seeing it, and its targets weigh nothing.
            batch.pad_to(self.pad_id, width);
        }
        Ok(batch)
    }

    /// The micro-batch of examples `picks`, padded to the longest of them: inputs, targets one
    /// further, and a mask counting the trained targets.
    pub fn batch_of(&self, picks: &[usize], device: &Device) -> Result<Batch> {
        self.host_batch(picks)?.to_device(device)
    }

    /// The micro-batch at `(step, micro)` of a run seeded with `seed`.
    pub fn batch(
        &self,
        seed: u64,
        step: u64,
        micro: u64,
        micro_batch: usize,
        device: &Device,
    ) -> Result<Batch> {
        let rows = self.micro_batch_rows(seed, step, micro, micro_batch);
        self.host_batch_of_rows(&rows)?.to_device(device)
    }
}

/// The first `len` values of `values`, borrowed or owned as they came.
fn cut_to<T: Clone>(values: Cow<'_, [T]>, len: usize) -> Cow<'_, [T]> {
    match values {
        Cow::Borrowed(values) => Cow::Borrowed(&values[..len]),
        Cow::Owned(mut values) => {
            values.truncate(len);
            Cow::Owned(values)
        }
    }
}

/// A micro-batch assembled in host memory, to be moved to the device.
#[derive(Debug, Clone, PartialEq)]
pub struct HostBatch {
    /// `sequences × width` input ids, row by row.
    pub inputs: Vec<u32>,
    /// The target of each input.
    pub targets: Vec<u32>,
    /// 1 where the loss counts the target, 0 for padding and untrained tokens.
    pub weights: Vec<f32>,
    /// Rows.
    pub sequences: usize,
    /// Positions a row.
    pub width: usize,
    /// Packed sequences: each input's position within its own example; `None` unpacked.
    pub positions: Option<Vec<u32>>,
    /// Inputs that are tokens of an example, not padding.
    pub real_tokens: usize,
}

impl HostBatch {
    /// Appends one example of a packed sequence: its inputs, targets one further, weights and
    /// positions from 0.
    fn push_example(&mut self, ids: &[u32], trained: &[u8]) {
        let n = ids.len() - 1;
        self.inputs.extend_from_slice(&ids[..n]);
        self.targets.extend_from_slice(&ids[1..]);
        self.weights
            .extend(trained[1..].iter().map(|&t| f32::from(t)));
        self.real_tokens += n;
        if let Some(positions) = &mut self.positions {
            positions.extend(0..n as u32);
        }
    }

    /// Pads the sequence being written to `width` positions: padding is an example of its own
    /// (positions from 0, nothing trained), so no real token sees it and it sees none.
    fn pad_to(&mut self, pad_id: u32, width: usize) {
        let written = self.inputs.len() % width;
        let pad = if written == 0 && !self.inputs.is_empty() {
            0
        } else {
            width - written
        };
        self.inputs.extend(std::iter::repeat_n(pad_id, pad));
        self.targets.extend(std::iter::repeat_n(0, pad));
        self.weights.extend(std::iter::repeat_n(0.0, pad));
        if let Some(positions) = &mut self.positions {
            positions.extend(0..pad as u32);
        }
    }

    /// The batch on `device`, with its loss mask.
    pub fn to_device(self, device: &Device) -> Result<Batch> {
        let counted = self.weights.iter().filter(|&&w| w > 0.0).count();
        let rows = self.inputs.len();
        let mut batch = Batch::new(
            Tensor::from_vec(self.inputs, (self.sequences, self.width), device)?,
            Tensor::from_vec(self.targets, rows, device)?,
        );
        batch.mask = Some(LossMask {
            weights: Tensor::from_vec(self.weights, rows, device)?,
            counted,
        });
        if let Some(positions) = self.positions {
            batch.positions = Some(Tensor::from_vec(positions, rows, device)?);
        }
        batch.real_tokens = Some(self.real_tokens);
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(len: usize, trained_from: usize) -> Example {
        Example {
            ids: (0..len as u32).map(|i| 10 + i).collect(),
            trained: (0..len).map(|i| i >= trained_from).collect(),
        }
    }

    #[test]
    fn examples_are_cut_to_the_sequence_and_untrained_ones_dropped() {
        let examples = vec![example(5, 1), example(12, 2), example(9, 9), example(4, 6)];
        let (set, cut) = Dataset::of_examples(&examples, 8, 0).unwrap();
        assert_eq!(set.len(), 2);
        assert_eq!(
            set.get(1).unwrap().ids.len(),
            9,
            "8 inputs and the target one further"
        );
        assert_eq!((cut.kept, cut.truncated, cut.dropped), (2, 1, 2));
        assert_eq!(cut.trained_tokens, 4 + 7);
        let none = Dataset::of_examples(&[example(4, 4)], 8, 0)
            .unwrap_err()
            .to_string();
        assert!(
            none.contains("no example has a token to train on"),
            "{none}"
        );
    }

    #[test]
    fn truncation_drop_leaves_over_long_examples_out_and_counts_them() {
        let examples = vec![example(5, 1), example(12, 2), example(9, 1)];
        let table = Arc::new(ExampleTable::new(&examples));
        let (set, cut) = Dataset::new(table.clone(), 0..3, 8, 0, Truncation::Drop).unwrap();
        assert_eq!(
            set.len(),
            2,
            "9 tokens are 8 inputs and their last target: kept"
        );
        assert_eq!((cut.kept, cut.truncated, cut.too_long), (2, 0, 1));
        assert_eq!(set.get(1).unwrap().ids.len(), 9);
        let (_, cut) = Dataset::new(table.clone(), 0..3, 8, 0, Truncation::Cut).unwrap();
        assert_eq!((cut.kept, cut.truncated, cut.too_long), (3, 1, 0));
        let all_long = Dataset::new(table, [1], 4, 0, Truncation::Drop)
            .unwrap_err()
            .to_string();
        assert!(all_long.contains("--truncate cut"), "{all_long}");
    }

    #[test]
    fn batches_pad_to_the_longest_and_mask_padding_and_untrained_targets() {
        let (set, _) = Dataset::of_examples(&[example(3, 1), example(5, 3)], 16, 7).unwrap();
        let batch = set.batch_of(&[0, 1], &Device::Cpu).unwrap();
        assert_eq!(batch.inputs.dims(), &[2, 4]);
        let inputs = batch
            .inputs
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap();
        assert_eq!(inputs, vec![10, 11, 7, 7, 10, 11, 12, 13]);
        let targets = batch.targets.to_vec1::<u32>().unwrap();
        assert_eq!(targets, vec![11, 12, 0, 0, 11, 12, 13, 14]);
        let mask = batch.mask.unwrap();
        let weights = mask.weights.to_vec1::<f32>().unwrap();
        assert_eq!(weights, vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
        assert_eq!(mask.counted, 4);
    }

    #[test]
    fn packed_batches_lay_examples_end_to_end_with_positions_from_each_start() {
        // Needs of 2, 4 and 3 positions in sequences of 6: best fit in order puts 0 and 1
        // together (6 full) and 2 alone.
        let (mut set, _) =
            Dataset::of_examples(&[example(3, 1), example(5, 3), example(4, 0)], 6, 7).unwrap();
        set.set_packing(Some(6));
        let batch = set.host_batch_of_rows(&[vec![0, 1], vec![2]]).unwrap();
        assert_eq!((batch.sequences, batch.width), (2, 6));
        assert_eq!(
            batch.inputs,
            vec![10, 11, 10, 11, 12, 13, 10, 11, 12, 7, 7, 7]
        );
        assert_eq!(
            batch.targets,
            vec![11, 12, 11, 12, 13, 14, 11, 12, 13, 0, 0, 0]
        );
        let weights = [1., 1., 0., 0., 1., 1., 1., 1., 1., 0., 0., 0.];
        assert_eq!(batch.weights, weights);
        // The padding is an example of its own: positions restart there too.
        let positions = vec![0, 1, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2];
        assert_eq!(batch.positions, Some(positions));
    }

    #[test]
    fn the_packed_walk_takes_each_example_once_an_epoch_and_resumes_exactly() {
        let examples: Vec<Example> = (0..40).map(|i| example(2 + (i * 7) % 9, 1)).collect();
        let (mut set, _) = Dataset::of_examples(&examples, 12, 0).unwrap();
        set.set_packing(Some(12));
        set.set_micros_per_step(2);
        let rows_per_epoch = |seed, epoch| set.pack(seed, epoch, 12).len() as u64;
        let epoch_rows = rows_per_epoch(5, 0);
        assert!(epoch_rows < 40, "several examples a sequence: {epoch_rows}");
        let steps = set.steps_for_epochs(5, 3, 2);
        let total = (0..3).map(|e| rows_per_epoch(5, e)).sum::<u64>();
        assert_eq!(steps, total.div_ceil(4));
        let walk = |set: &Dataset, from: u64| -> Vec<Vec<usize>> {
            (from..steps)
                .flat_map(|step| (0..2).flat_map(move |m| set.micro_batch_rows(5, step, m, 2)))
                .collect()
        };
        let whole = walk(&set, 0);
        // The first epoch's sequences hold every example once.
        let mut first: Vec<usize> = whole[..epoch_rows as usize].concat();
        first.sort_unstable();
        assert_eq!(first, (0..40).collect::<Vec<_>>());
        // A fresh dataset resumed at step 7 continues with the same sequences.
        let (mut resumed, _) = Dataset::of_examples(&examples, 12, 0).unwrap();
        resumed.set_packing(Some(12));
        resumed.set_micros_per_step(2);
        assert_eq!(walk(&resumed, 7), whole[7 * 4..].to_vec());
        // Another seed packs other sequences.
        assert_ne!(set.micro_batch_rows(6, 0, 0, 2), whole[..2].to_vec());
    }

    #[test]
    fn the_walk_covers_each_epoch_once_in_a_seeded_order_and_resumes_exactly() {
        let examples: Vec<Example> = (0..10).map(|i| example(3 + i % 3, 1)).collect();
        let (mut set, _) = Dataset::of_examples(&examples, 16, 0).unwrap();
        set.set_micros_per_step(2);
        assert_eq!(
            set.steps_for_epochs(0, 1, 2),
            3,
            "ten examples at four a step"
        );
        let walk = |seed| -> Vec<usize> {
            (0..5)
                .flat_map(|step| (0..2).map(move |m| (step, m)))
                .flat_map(|(step, m)| set.picks(seed, step, m, 2))
                .collect()
        };
        let run = walk(1);
        for epoch in run.chunks(10) {
            let mut seen = epoch.to_vec();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..10).collect::<Vec<_>>(),
                "each example once an epoch"
            );
        }
        assert_ne!(run[..10], run[10..], "each epoch its own order");
        assert_eq!(
            run,
            walk(1),
            "a pure function of the seed and the coordinates"
        );
        assert_ne!(run, walk(2));
        assert_eq!(
            set.picks(1, 3, 1, 2),
            run[14..16].to_vec(),
            "a resumed step's examples"
        );
    }
}
