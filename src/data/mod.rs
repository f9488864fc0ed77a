//! Training data as the user has it: what a `--data` file is ([`mod@format`]), and which formats
//! autotune reads, so that nothing is ever trained on as raw bytes by accident; chat
//! conversations as a model reads them ([`template`]).

pub mod format;
pub mod template;
