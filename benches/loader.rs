//! `loader tokens/s from cache`: how fast the loader turns a mapped token cache into training
//! micro-batches (each epoch's order, the picked examples' pages, padding and masks), as the
//! trainer asks for them step after step.
//!
//! `cargo bench --bench loader` writes one JSON line: examples and tokens cached, the loader's
//! tokens per second (real tokens, padding not counted) and positions per second (padding
//! counted). The examples are seeded, of 64 to 2,048 tokens (as chat data is), cut at a
//! sequence of 2,048; a step is 4 micro-batches of 8 sequences. `LOADER_TOKENS` sets the
//! tokens cached (default 64 M, a 320 MB file). The file is read from the page cache, as it is
//! on a machine with the memory to hold it.

// A benchmark's report is its stdout.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use autotune::data::cache::{Lookup, TokenCache};
use autotune::data::dataset::{Dataset, Example};
use autotune::data::loader::{Loader, StepBatches};
use autotune::data::table::ExampleTable;

fn main() {
    let tokens: usize = std::env::var("LOADER_TOKENS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(64 << 20);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut examples = Vec::new();
    let mut total = 0;
    while total < tokens {
        let len = rng.random_range(64..=2048);
        let prompt = rng.random_range(1..len / 2);
        examples.push(Example {
            ids: (0..len).map(|_| rng.random_range(0..128_000)).collect(),
            trained: (0..len).map(|i| i >= prompt).collect(),
        });
        total += len;
    }
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cache = TokenCache::new(dir.path().to_path_buf());
    let key = "0".repeat(64);
    cache
        .store(&key, &ExampleTable::new(&examples))
        .expect("the cache is written");
    drop(examples);
    let Ok(Lookup::Hit(table)) = cache.lookup(&key) else {
        panic!("the cache maps back")
    };
    let table = Arc::new(table);
    let (micro_batch, micros, seq_len) = (8usize, 4u64, 2048usize);
    // Padding takes an id no example holds, to count the real tokens by.
    let pad = 200_000;
    let (mut dataset, _) = Dataset::new(
        table.clone(),
        0..table.len(),
        seq_len,
        pad,
        Default::default(),
    )
    .expect("examples");
    dataset.set_micros_per_step(micros as usize);
    let loader = Loader::new(dataset);
    let steps = 2 * table.len() as u64 / (micro_batch as u64 * micros);
    let (mut real, mut positions) = (0usize, 0usize);
    let started = Instant::now();
    for step in 0..steps {
        let batches = loader
            .step(&StepBatches {
                seed: 1,
                step,
                micros: 0..micros,
                micro_batch,
            })
            .expect("the cache reads back");
        for batch in batches {
            positions += batch.inputs.len();
            real += batch.inputs.iter().filter(|&&id| id != pad).count();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "metric": "loader tokens/s from cache",
            "examples": table.len(),
            "tokens_cached": total,
            "cache_mb": (total * 5) as f64 / 1e6,
            "steps": steps,
            "epochs": 2,
            "seconds": seconds,
            "tokens_per_s": real as f64 / seconds,
            "positions_per_s": positions as f64 / seconds,
            "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    );
}
