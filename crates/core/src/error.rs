//! The core's error type: input that cannot be used, and files that cannot be read or written.
//!
//! Expected outcomes (an out-of-memory trial, no feasible plan) are values elsewhere; this type
//! is for failures. The runtime wraps it in its own error, beside backend and data errors.

use std::path::PathBuf;

/// Everything that can go wrong in the core.
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

    /// A command-line flag's value cannot be used: the flag as the user types it, and why.
    #[error("invalid `{flag}`: {problem}")]
    InvalidFlag {
        /// The flag, as on the command line (`--micro-batch`).
        flag: String,
        /// What is wrong with its value and, where possible, how to fix it.
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
        /// What kind of name ("model preset", "device spec", ...).
        what: &'static str,
        /// The name given.
        name: String,
        /// The accepted names, comma separated.
        known: String,
    },

    /// A prober could not run a trial at all (its process would not start, the backend
    /// failed): the prober's own error. Expected outcomes such as out-of-memory are results.
    #[error(transparent)]
    Trial(Box<dyn std::error::Error + Send + Sync>),
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

    /// Shorthand for [`Error::Trial`].
    pub fn trial(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Trial(source.into())
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

/// The core's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
