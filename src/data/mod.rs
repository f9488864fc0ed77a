//! Training data as the user has it: what a `--data` file is ([`mod@format`]), and which formats
//! autotune reads, so that nothing is ever trained on as raw bytes by accident; and the model's
//! own tokenizer ([`mod@tokenizer`]), which turns text into the ids the model was trained on.

pub mod format;
pub mod tokenizer;
