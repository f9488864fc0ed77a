//! The library's error type.
//!
//! Expected outcomes (an out-of-memory probe, no feasible plan) are values elsewhere in the
//! library; this type is for failures: bad input, I/O, and backend errors we cannot act on.

use std::path::PathBuf;

/// Everything that can go wrong in the library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A specification (model, device, plan, run) is well-formed JSON but says something impossible.
    #[error("invalid {what}: field `{field}` {problem}")]
    InvalidSpec {
        /// What kind of document was being validated ("model spec", "plan", ...).
        what: &'static str,
        /// The offending field, as spelled in the JSON document or on the command line.
        field: String,
        /// What is wrong with it and, where possible, how to fix it.
        problem: String,
    },

    /// A file could not be read, parsed or written.
    #[error("{action} `{path}`")]
    File {
        /// What we were doing ("cannot read model spec", ...).
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// An unknown preset name.
    #[error("unknown {what} `{name}`; known: {known}")]
    UnknownName {
        /// What kind of name ("model preset", "device profile", ...).
        what: &'static str,
        /// The name given.
        name: String,
        /// The accepted names, comma separated.
        known: String,
    },

    /// A checkpoint does not match the model or run it is resumed into.
    #[error("checkpoint `{path}` does not match this run: {problem}")]
    CheckpointMismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        problem: String,
    },

    /// The training data cannot feed the requested model.
    #[error("data `{source_name}`: {problem}")]
    Data {
        /// The file name or "synthetic".
        source_name: String,
        /// What is wrong.
        problem: String,
    },

    /// A parameter got no gradient: an op in the graph has no backward pass (a bug, never data).
    #[error("parameter `{parameter}` received no gradient: an operation in the model has no backward pass")]
    MissingGradient {
        /// The parameter's name.
        parameter: String,
    },

    /// Data-parallel ranks could not meet or lost each other (a rank died, a port was taken).
    #[error("data parallel, rank {rank}: {problem}")]
    Collective {
        /// The rank that saw the failure.
        rank: usize,
        /// What happened, naming the peer where one is involved.
        problem: String,
    },

    /// An error from the tensor backend that is not an expected outcome such as out-of-memory.
    #[error(transparent)]
    Backend(#[from] candle_core::Error),
}

impl Error {
    /// Shorthand for [`Error::InvalidSpec`].
    pub fn invalid(
        what: &'static str,
        field: impl Into<String>,
        problem: impl Into<String>,
    ) -> Self {
        Self::InvalidSpec {
            what,
            field: field.into(),
            problem: problem.into(),
        }
    }

    /// An internal inconsistency (a bug, never data), reported as a backend error.
    pub fn internal(message: impl Into<String>) -> Self {
        candle_core::Error::Msg(message.into()).into()
    }

    /// Shorthand for [`Error::File`].
    pub fn file(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::File {
            action,
            path: path.into(),
            source: source.into(),
        }
    }
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
