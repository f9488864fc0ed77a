//! What `data` shows: a dataset's examples as training takes them, before they are cut and
//! shuffled, and what cutting and batching them does; and a dataset shaped for the trials of
//! a search tuned on it ([`shape`]).

use std::path::Path;
use std::sync::Arc;

use crate::data::dataset::{Cut, Dataset};
use crate::data::load::{LoadEvent, Loading, RecordsSpec};
use crate::data::profile::DataShape;
use crate::data::table::ExampleTable;
use crate::data::tokenizer::Tokenizer;
use crate::model::Engine;
use crate::plan::{length_histogram, Batching, LengthBucket};
use crate::settings::data::DataSettings;
use crate::spec::model::ModelSpec;
use crate::Result;

/// A dataset's examples and their counts.
pub struct Inspection {
    /// Every example, in dataset order, before any cut.
    pub examples: Arc<ExampleTable>,
    /// What cutting them to the model's sequence does.
    pub cut: Cut,
    /// Of the positions of epoch 0's micro-batches, the share that is padding.
    pub padding: f64,
    /// The same share packed into sequences of the model's length.
    pub packing: f64,
    /// The lengths of the examples kept.
    pub lengths: Vec<LengthBucket>,
    /// The tokenizer, to show the examples as text.
    pub tokenizer: Tokenizer,
}

/// Reads and tokenizes the dataset `settings` describe (or maps it from the token cache),
/// telling `events` how loading goes.
pub fn inspect(settings: &DataSettings, events: &dyn Fn(LoadEvent)) -> Result<Inspection> {
    let tokenizer = settings.records.open_tokenizer()?;
    let loading = Loading::cached(&settings.cache_dir, events);
    let examples = settings.records.table(&tokenizer, &loading)?;
    let pad = tokenizer.pad().or(tokenizer.eos()).map_or(0, |t| t.id);
    let all = 0..examples.len();
    let seq_len = settings.model.seq_len;
    let truncation = settings.records.truncation;
    let (mut dataset, cut) = Dataset::new(examples.clone(), all, seq_len, pad, truncation)?;
    let padding = 1.0 - dataset.fill(0, settings.micro_batch);
    dataset.set_packing(Some(seq_len));
    let packing = 1.0 - dataset.fill(0, settings.micro_batch);
    let lengths = length_histogram(dataset.lengths());
    Ok(Inspection {
        examples,
        cut,
        padding,
        packing,
        lengths,
        tokenizer,
    })
}

/// Loads the dataset `records` (given as `files`) for `spec`, as training will, and shapes it
/// for a search's trials: batched as its packing choice allows for `spec` on autotune's
/// engine, into sequences at most `spec.seq_len` long.
pub fn shape(
    records: &RecordsSpec,
    files: &[String],
    spec: &ModelSpec,
    cache_dir: &Path,
    events: &dyn Fn(LoadEvent),
) -> Result<DataShape> {
    let loading = Loading::cached(cache_dir, events);
    let loaded = records.load(spec, &loading)?;
    let batching = if records.packing.packs(spec, Engine::default())? {
        Batching::Packed
    } else {
        Batching::Padded
    };
    Ok(DataShape::new(
        loaded.train,
        loaded.cut,
        records,
        files,
        batching,
        spec.seq_len,
    ))
}
