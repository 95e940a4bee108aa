//! One error type for the whole engine.
//!
//! Every error a user can meet names what it is about — a file, a plan key, a step, a tile — and
//! says what to do. The binary prints the chain; nothing here panics on bad input. Library code
//! returns `Result<T>`; `anyhow` is used only at the binary edge.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error while touching a file.
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// A matrix file whose header or size does not make sense.
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },

    /// A plan that cannot be run as written (key, step, shapes...).
    #[error("{path}: {msg}")]
    Plan { path: PathBuf, msg: String },

    /// Bad command-line or other user input that is not a file or a plan.
    #[error("{0}")]
    Usage(String),

    /// A failure in a compute backend (CPU or CUDA).
    #[error("backend {backend}: {msg}")]
    Backend { backend: String, msg: String },

    /// A stored checksum does not match the data.
    #[error("{path}: checksum mismatch in tile ({ti}, {tj}): stored {stored:#010x}, computed {computed:#010x}; the file is corrupt — regenerate or re-import it")]
    Checksum {
        path: PathBuf,
        ti: u64,
        tj: u64,
        stored: u32,
        computed: u32,
    },

    /// The run was cancelled because another stage failed (never the reported error).
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, what: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            what,
            source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn plan(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Plan {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn backend(backend: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Backend {
            backend: backend.into(),
            msg: msg.into(),
        }
    }
}
