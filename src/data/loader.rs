//! The loader: while the device runs a step, the next step's micro-batches are assembled on
//! their own thread (the examples picked, read from a cache file where the table is one, padded
//! and masked), so that the step after waits only to move them to the device.
//!
//! Steps are asked for in order, so the loader guesses that the step after the one asked for
//! comes next, with the same micro-batches; a run that asks for another (a resume, an
//! evaluation) is served directly and the guess is dropped.

use std::ops::Range;
use std::sync::Mutex;
use std::thread::JoinHandle;

use super::dataset::{Dataset, HostBatch};
use crate::Result;

/// Which micro-batches one step takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepBatches {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step.
    pub step: u64,
    /// This rank's micro-batches of the step.
    pub micros: Range<u64>,
    /// Sequences a micro-batch.
    pub micro_batch: usize,
}

impl StepBatches {
    /// The same micro-batches of the next step.
    fn next(&self) -> Self {
        Self {
            step: self.step + 1,
            ..self.clone()
        }
    }
}

/// The batches of one step being assembled on another thread.
type Assembling = JoinHandle<Result<Vec<HostBatch>>>;

/// A dataset's step batches, assembled a step ahead.
pub struct Loader {
    dataset: Dataset,
    ahead: Mutex<Option<(StepBatches, Assembling)>>,
}

impl Loader {
    /// The loader of `dataset` (its walk's stride set).
    pub fn new(dataset: Dataset) -> Self {
        Self {
            dataset,
            ahead: Mutex::new(None),
        }
    }

    /// The micro-batches of `wanted`, in host memory; the next step's start assembling. A
    /// cache file cut short under the run is [`crate::Error::DataChanged`].
    pub fn step(&self, wanted: &StepBatches) -> Result<Vec<HostBatch>> {
        let mut ahead = self
            .ahead
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let ready = match ahead.take() {
            Some((key, handle)) if key == *wanted => handle.join().ok(),
            // A guess that missed finishes on its own; its result is not needed.
            _ => None,
        };
        let batches = ready.unwrap_or_else(|| assemble(&self.dataset, wanted));
        let next = wanted.next();
        let dataset = self.dataset.clone();
        let key = next.clone();
        let spawned = std::thread::Builder::new()
            .name("autotune-loader".into())
            .spawn(move || assemble(&dataset, &next));
        // Without a thread the next step is assembled when it is asked for.
        *ahead = spawned.ok().map(|handle| (key, handle));
        batches
    }
}

/// The micro-batches of `wanted`.
fn assemble(dataset: &Dataset, wanted: &StepBatches) -> Result<Vec<HostBatch>> {
    wanted
        .micros
        .clone()
        .map(|micro| {
            let rows =
                dataset.micro_batch_rows(wanted.seed, wanted.step, micro, wanted.micro_batch);
            dataset.host_batch_of_rows(&rows)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::Example;

    #[test]
    fn batches_ahead_or_not_are_the_batches_asked_for() {
        let examples: Vec<Example> = (0..11)
            .map(|i| Example {
                ids: (0..3 + i % 4).collect(),
                trained: vec![true; 3 + i as usize % 4],
            })
            .collect();
        let (mut dataset, _) = Dataset::of_examples(&examples, 16, 0).unwrap();
        dataset.set_micros_per_step(2);
        let loader = Loader::new(dataset.clone());
        let key = |step| StepBatches {
            seed: 3,
            step,
            micros: 0..2,
            micro_batch: 2,
        };
        for step in [0, 1, 2, 7, 8, 3] {
            assert_eq!(
                loader.step(&key(step)).unwrap(),
                assemble(&dataset, &key(step)).unwrap(),
                "{step}"
            );
        }
    }
}
