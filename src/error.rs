//! The runtime's error type.
//!
//! Expected outcomes (an out-of-memory trial, no feasible plan) are values elsewhere in the
//! library; this type is for failures: bad input and I/O (the core's [`autotune_core::Error`]),
//! data, checkpoints, ranks, and backend errors we cannot act on.

use std::path::PathBuf;

/// Everything that can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input or a file that cannot be used: the core's error.
    #[error(transparent)]
    Core(#[from] autotune_core::Error),

    /// A checkpoint does not match the model or run it is resumed into.
    #[error("checkpoint `{path}` does not match this run: {problem}")]
    CheckpointMismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        problem: String,
    },

    /// A checkpoint's files do not match its manifest (flipped bytes, a truncated copy, a file
    /// from elsewhere), or it has no readable manifest.
    #[error("checkpoint `{path}` is damaged: {problem}; {}", intact_advice(path, newest_intact.as_deref()))]
    CheckpointDamaged {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is damaged.
        problem: String,
        /// The newest checkpoint beside it that verifies, if any.
        newest_intact: Option<PathBuf>,
    },

    /// Weights or a loss stopped being finite numbers: the run diverged, or a checkpoint held
    /// them. Nothing non-finite is saved.
    #[error("{what} is not finite at step {step}; nothing non-finite is saved")]
    NonFinite {
        /// The step at which it was found.
        step: u64,
        /// What is not finite ("parameter `blocks.0.attn.w_qkv`", "the loss").
        what: String,
    },

    /// The training data cannot feed the requested model.
    #[error("data `{source_name}`: {problem}")]
    Data {
        /// The file name or "synthetic".
        source_name: String,
        /// What is wrong.
        problem: String,
    },

    /// A data file changed under the run (cut short, replaced by a shorter one): the batches
    /// it held when the run started are gone. The run saves a checkpoint before it stops.
    #[error("training data `{path}` changed while the run read it: {problem}; {}", resume_advice(checkpoint.as_deref()))]
    DataChanged {
        /// The data file.
        path: PathBuf,
        /// What changed.
        problem: String,
        /// The checkpoint saved before stopping, if any was.
        checkpoint: Option<PathBuf>,
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

    /// Weights (a Hugging Face folder, a safetensors file of a checkpoint) that cannot be read
    /// or do not fit the model: a header, a missing or extra tensor, a shape, a config that
    /// describes another model.
    #[error("weights `{path}`: {problem}")]
    Weights {
        /// The checkpoint folder or file.
        path: PathBuf,
        /// What does not fit, naming the tensor or config field.
        problem: String,
    },

    /// A run that cannot start as asked: a directory that holds another run, nothing to resume,
    /// a resume that asks for other settings than its checkpoint's. The message says what to
    /// pass instead.
    #[error("{0}")]
    Usage(String),

    /// An error from the tensor backend that is not an expected outcome such as out-of-memory.
    #[error(transparent)]
    Backend(#[from] candle_core::Error),
}

impl Error {
    /// Shorthand for the core's [`autotune_core::Error::InvalidSpec`].
    pub fn invalid(
        what: &'static str,
        field: impl Into<String>,
        problem: impl Into<String>,
    ) -> Self {
        autotune_core::Error::invalid(what, field, problem).into()
    }

    /// An internal inconsistency (a bug, never data), reported as a backend error.
    pub fn internal(message: impl Into<String>) -> Self {
        candle_core::Error::Msg(message.into()).into()
    }

    /// Shorthand for the core's [`autotune_core::Error::File`].
    pub fn file(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        autotune_core::Error::file(action, path, source).into()
    }
}

/// What to do after the data changed under a run: put it back and resume.
fn resume_advice(checkpoint: Option<&std::path::Path>) -> String {
    match checkpoint {
        Some(path) => format!(
            "the run saved checkpoint `{}`: restore the file and resume with --resume",
            path.display()
        ),
        None => "no checkpoint was saved (give --checkpoint-dir to keep one); restore the file \
                 and start again"
            .into(),
    }
}

/// What to do about a damaged checkpoint: resume from the newest intact one, or start over.
fn intact_advice(damaged: &std::path::Path, newest_intact: Option<&std::path::Path>) -> String {
    let dir = damaged.parent().unwrap_or(std::path::Path::new("."));
    match newest_intact.and_then(|p| p.file_name()) {
        Some(name) => format!(
            "the newest intact checkpoint is `{}`: to resume from it, write `{}` into `{}`",
            dir.join(name).display(),
            name.to_string_lossy(),
            dir.join("latest").display()
        ),
        None => format!(
            "no intact checkpoint remains in `{}`; start afresh with --overwrite",
            dir.display()
        ),
    }
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A runtime error leaving through the core (a prober's failure ending a search): the core's
/// own errors come back out as they went in, anything else is the trial's error.
impl From<Error> for autotune_core::Error {
    fn from(error: Error) -> Self {
        match error {
            Error::Core(core) => core,
            other => autotune_core::Error::trial(other),
        }
    }
}
