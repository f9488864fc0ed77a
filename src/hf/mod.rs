//! Hugging Face checkpoints: a model's weights in the tensor names and layout `transformers`
//! uses for its family, read from single or sharded safetensors files (`train --init-from`) and
//! written as a folder `transformers` loads (`export-weights`), with the tokenizer the data was
//! read with ([`tokenizer_files`]).
//!
//! [`layout`] says which of `transformers`' tensors make up each parameter of ours (our q/k/v
//! and gate/up projections are one product each, theirs separate; GPT-2 stores its projections
//! transposed); [`safetensors`] reads one tensor at a time from the files and writes them
//! streaming, so neither direction holds a second copy of the model.

mod checkpoint_files;
pub mod layout;
pub mod safetensors;
pub mod tokenizer_files;
mod transfer;

pub use transfer::{export_weights, import_weights, ExportDtype};
