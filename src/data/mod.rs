//! Training data: what a `--data` file is ([`mod@format`]) and which formats autotune reads, so
//! that nothing is ever trained on as raw bytes by accident; the sources training draws
//! batches from ([`source`]: synthetic sequences, token files read a window at a time, tokenized
//! examples); a dataset's records as the user wrote them ([`records`]); and tokenized examples
//! walked in epochs and cut into padded or packed ([`pack`]), masked micro-batches
//! ([`dataset`]); the model's
//! tokenizer ([`tokenizer`]) and chat template ([`template`]); examples stored flat
//! ([`table`]) and cached once tokenized ([`cache`]); the loader, a step ahead of the device
//! ([`loader`]); and a dataset as a plan is tuned on it ([`profile`]).

pub mod cache;
pub mod columnar;
pub mod dataset;
pub mod examples;
pub mod format;
pub mod load;
pub mod loader;
pub mod pack;
pub mod profile;
pub mod records;
pub mod source;
pub mod table;
pub mod template;
pub mod token_file;
pub mod tokenizer;
