//! All integration tests, built as one test binary.

/// Shared helpers: running the binary, temporary directories, small models.
mod util;

/// The training step: accumulation, gradients, precisions, loss scaling, learning, resume.
mod training;

/// The command line: exit codes and messages for bad input.
mod cli;

/// Tuning on the CPU: exact boundaries, model error, plans that train, bad input.
mod tune;
