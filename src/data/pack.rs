//! Packing: examples laid end to end in sequences of a fixed length, so that a micro-batch
//! spends its compute on real tokens instead of padding.
//!
//! An epoch's examples, in that epoch's seeded order, go one by one to the open sequence they
//! fill best: the one with the least room left that still takes the example, else a new one
//! (online best fit, which keeps the order's randomness and leaves little room unused). The
//! sequences of an epoch follow one another in the order they were opened, and the walk over
//! them, epoch after epoch, is a pure function of the seed: a resumed run packs the same
//! sequences and continues at the same one.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::model::Engine;
use crate::spec::model::{ModelSpec, Positions};
use crate::{Error, Result};

/// Whether a dataset of records is packed (`--pack`, `--no-pack`, or neither).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PackChoice {
    /// Packed wherever the model and engine can keep examples apart.
    #[default]
    Auto,
    /// Packed, or an error saying why not.
    Pack,
    /// One example a sequence, padded.
    Pad,
}

impl PackChoice {
    /// What a run recorded before packing existed did: it padded.
    pub fn padded() -> Self {
        PackChoice::Pad
    }

    /// Whether `model` trains packed on `engine`: packing needs attention that keeps examples
    /// apart (the explicit engines) and positions by example (rotary, or none), not a table of
    /// learned positions looked up by index.
    pub fn packs(self, model: &ModelSpec, engine: Engine) -> Result<bool> {
        let why_not = if engine.explicit_attention().is_none() {
            Some(format!(
                "the {engine:?} engine attends across a whole sequence"
            ))
        } else if model.positions == Positions::Learned {
            Some(format!(
                "model `{}` learns a position table, looked up by index in the sequence",
                model.name
            ))
        } else {
            None
        };
        match (self, why_not) {
            (PackChoice::Pad, _) => Ok(false),
            (PackChoice::Auto, why_not) => Ok(why_not.is_none()),
            (PackChoice::Pack, None) => Ok(true),
            (PackChoice::Pack, Some(why)) => Err(Error::Usage(format!(
                "--pack: {why}, so packed examples would see each other; pass --no-pack"
            ))),
        }
    }
}

/// Sequences of `capacity` positions holding the examples of `order`, example `i` taking
/// `need(i)` positions (at most `capacity`). Each sequence lists its examples in the order they
/// came; the sequences are in the order they were opened.
pub fn pack_rows(
    order: &[usize],
    need: impl Fn(usize) -> usize,
    capacity: usize,
) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // (room left, sequence) of every sequence with room: the first at or above a need is the
    // best fit, the earliest opened among equals.
    let mut open: BTreeSet<(usize, usize)> = BTreeSet::new();
    for &i in order {
        let n = need(i).clamp(1, capacity.max(1));
        let fit = open.range((n, 0)..).next().copied();
        let (room, row) = match fit {
            Some(found) => {
                open.remove(&found);
                found
            }
            None => {
                rows.push(Vec::new());
                (capacity, rows.len() - 1)
            }
        };
        rows[row].push(i);
        if room > n {
            open.insert((room - n, row));
        }
    }
    rows
}

/// The packed sequences of one epoch, by seed.
type EpochRows = Arc<Vec<Vec<usize>>>;

/// The walk over packed epochs: which sequence is the `p`-th of a run, epoch after epoch.
#[derive(Debug)]
pub struct PackedEpochs {
    memo: Mutex<Walked>,
}

/// What the walk has worked out so far for one seed: how many sequences each epoch packs
/// into, and the last epoch's sequences.
#[derive(Debug, Default)]
struct Walked {
    seed: u64,
    /// `rows_before[e]`: sequences in the epochs before `e`; one entry more than epochs known.
    rows_before: Vec<u64>,
    last: Option<(u64, EpochRows)>,
}

impl Default for PackedEpochs {
    fn default() -> Self {
        Self::new()
    }
}

impl PackedEpochs {
    /// A walk that has packed nothing yet.
    pub fn new() -> Self {
        Self {
            memo: Mutex::new(Walked {
                rows_before: vec![0],
                ..Walked::default()
            }),
        }
    }

    /// Sequences `first .. first + count` of the walk seeded with `seed`, each the examples it
    /// holds; `pack(epoch)` packs an epoch (the same sequences every time it is asked).
    pub fn rows(
        &self,
        seed: u64,
        first: u64,
        count: usize,
        pack: impl Fn(u64) -> Vec<Vec<usize>>,
    ) -> Vec<Vec<usize>> {
        let mut walked = self
            .memo
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if walked.seed != seed {
            *walked = Walked {
                seed,
                rows_before: vec![0],
                last: None,
            };
        }
        (first..first + count as u64)
            .map(|p| {
                let (epoch, start) = walked.epoch_of(p, &pack);
                let rows = walked.epoch_rows(epoch, &pack);
                rows[(p - start) as usize].clone()
            })
            .collect()
    }

    /// Sequences in the first `epochs` epochs, as `pack` packs them.
    pub fn rows_in_epochs(epochs: u64, pack: impl Fn(u64) -> Vec<Vec<usize>>) -> u64 {
        (0..epochs).map(|e| pack(e).len() as u64).sum()
    }
}

impl Walked {
    /// The epoch of the walk's `p`-th sequence and the index its first sequence has.
    fn epoch_of(&mut self, p: u64, pack: &impl Fn(u64) -> Vec<Vec<usize>>) -> (u64, u64) {
        loop {
            // The first epoch whose end lies beyond p, if known.
            if let Some(e) = self.rows_before.iter().skip(1).position(|&end| end > p) {
                return (e as u64, self.rows_before[e]);
            }
            let epoch = (self.rows_before.len() - 1) as u64;
            let len = self.epoch_rows(epoch, pack).len().max(1) as u64;
            let end = self.rows_before[epoch as usize] + len;
            self.rows_before.push(end);
        }
    }

    /// Epoch `epoch`'s sequences, packed once while the walk stays in it.
    fn epoch_rows(&mut self, epoch: u64, pack: &impl Fn(u64) -> Vec<Vec<usize>>) -> EpochRows {
        match &self.last {
            Some((e, rows)) if *e == epoch => rows.clone(),
            _ => {
                let rows = Arc::new(pack(epoch));
                self.last = Some((epoch, rows.clone()));
                rows
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_fills_the_fullest_sequence_that_still_takes_an_example() {
        // (needs in order, capacity, sequences)
        type Case<'a> = (&'a [usize], usize, &'a [&'a [usize]]);
        let cases: [Case; 5] = [
            // Everything fits one sequence.
            (&[3, 4, 1], 8, &[&[0, 1, 2]]),
            // 5 opens a second; 2 goes to the first (room 2), 3 to the second (room 3).
            (&[6, 5, 2, 3], 8, &[&[0, 2], &[1, 3]]),
            // The best fit, not the first: 2 goes where room is 2, not 5.
            (&[3, 6, 2], 8, &[&[0], &[1, 2]]),
            // An example of exactly the capacity fills a sequence of its own.
            (&[8, 1, 8], 8, &[&[0], &[1], &[2]]),
            // Equal rooms: the earliest opened.
            (&[5, 5, 3], 8, &[&[0, 2], &[1]]),
        ];
        for (needs, capacity, want) in cases {
            let order: Vec<usize> = (0..needs.len()).collect();
            let rows = pack_rows(&order, |i| needs[i], capacity);
            let want: Vec<Vec<usize>> = want.iter().map(|r| r.to_vec()).collect();
            assert_eq!(rows, want, "{needs:?} in {capacity}");
            for row in &rows {
                assert!(row.iter().map(|&i| needs[i]).sum::<usize>() <= capacity);
            }
        }
    }

    #[test]
    fn the_walk_crosses_epochs_and_gives_the_same_sequences_from_anywhere() {
        // Epoch e packs into 2 + e sequences, each naming its epoch and index.
        let pack = |e: u64| -> Vec<Vec<usize>> {
            (0..2 + e as usize).map(|i| vec![e as usize, i]).collect()
        };
        let walk = PackedEpochs::new();
        let all = walk.rows(7, 0, 12, pack);
        let want: Vec<Vec<usize>> = [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (1, 2),
            (2, 0),
            (2, 1),
            (2, 2),
            (2, 3),
            (3, 0),
            (3, 1),
            (3, 2),
        ]
        .iter()
        .map(|&(e, i)| vec![e, i])
        .collect();
        assert_eq!(all, want);
        // A fresh walk asked from the middle (a resumed run), and asked backwards.
        for first in [0u64, 4, 9, 3, 11] {
            let fresh = PackedEpochs::new();
            assert_eq!(fresh.rows(7, first, 1, pack)[0], want[first as usize]);
            assert_eq!(walk.rows(7, first, 1, pack)[0], want[first as usize]);
        }
        assert_eq!(PackedEpochs::rows_in_epochs(3, pack), 2 + 3 + 4);
    }
}
