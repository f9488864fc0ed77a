//! What `data` shows: a dataset's examples as training takes them, before they are cut and
//! shuffled, and what cutting and batching them does.

use std::sync::Arc;

use crate::data::cache::TokenCache;
use crate::data::dataset::{Cut, Dataset};
use crate::data::load::{LoadEvent, Loading};
use crate::data::table::ExampleTable;
use crate::data::tokenizer::Tokenizer;
use crate::settings::data::DataSettings;
use crate::Result;

/// A dataset's examples and their counts.
pub struct Inspection {
    /// Every example, in dataset order, before any cut.
    pub examples: Arc<ExampleTable>,
    /// What cutting them to the model's sequence does.
    pub cut: Cut,
    /// Of the positions of epoch 0's micro-batches, the share that is padding.
    pub padding: f64,
    /// The tokenizer, to show the examples as text.
    pub tokenizer: Tokenizer,
}

/// Reads and tokenizes the dataset `settings` describe (or maps it from the token cache),
/// telling `events` how loading goes.
pub fn inspect(settings: &DataSettings, events: &dyn Fn(LoadEvent)) -> Result<Inspection> {
    let tokenizer = settings.records.open_tokenizer()?;
    let loading = Loading {
        cache: Some(TokenCache::new(settings.cache_dir.clone())),
        events,
    };
    let examples = settings.records.table(&tokenizer, &loading)?;
    let pad = tokenizer.pad().or(tokenizer.eos()).map_or(0, |t| t.id);
    let all = 0..examples.len();
    let (dataset, cut) = Dataset::new(examples.clone(), all, settings.model.seq_len, pad)?;
    let padding = padding(&dataset, settings.micro_batch);
    Ok(Inspection {
        examples,
        cut,
        padding,
        tokenizer,
    })
}

/// The share of padding in epoch 0's micro-batches of `micro_batch` sequences.
fn padding(dataset: &Dataset, micro_batch: usize) -> f64 {
    let n = dataset.len();
    let (mut positions, mut padded) = (0usize, 0usize);
    for micro in 0..n.div_ceil(micro_batch) as u64 {
        let picks = dataset.picks(0, 0, micro, micro_batch);
        let lengths: Vec<usize> = picks.iter().map(|&i| dataset.get(i).0.len() - 1).collect();
        let width = lengths.iter().copied().max().unwrap_or(0);
        positions += width * lengths.len();
        padded += lengths.iter().map(|l| width - l).sum::<usize>();
    }
    padded as f64 / positions.max(1) as f64
}
