//! One error type for the whole engine.
//!
//! Every error a user can meet names what it is about — a file, a plan key, a step, a tile — and
//! says what to do. The binary prints the chain; nothing here panics on bad input. Library code
//! returns `Result<T>`, and so does the command line: one type to the edge, no `anyhow`.

use std::path::PathBuf;

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
/// Every error the engine reports; each names the file, plan key, device or tile it is about.
pub enum Error {
    /// An operating-system error while touching a file.
    #[error("{path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// A matrix file whose header or size does not make sense.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        msg: String,
    },

    /// A plan that cannot be run as written (key, step, shapes...).
    #[error("{path}: {msg}")]
    Plan {
        /// The plan file.
        path: PathBuf,
        /// What is wrong and what to do.
        msg: String,
    },

    /// Bad command-line or other user input that is not a file or a plan.
    #[error("{0}")]
    Usage(String),

    /// A failure in a compute backend (CPU or CUDA).
    #[error("backend {backend}: {msg}")]
    Backend {
        /// The backend.
        backend: String,
        /// What failed.
        msg: String,
    },

    /// A device (one lane of a backend) failed: the run may go on without it.
    #[error("{device}: {what}: {source}")]
    Device {
        /// Index of the lane in the backend's lane list (what [`crate::backend::Backend::without`] takes).
        lane: usize,
        /// Human name of the device ("cuda:1", "sim:3").
        device: String,
        /// What the lane was doing.
        what: String,
        /// The driver's error.
        #[source]
        source: DeviceError,
    },

    /// A stored checksum does not match the data.
    #[error("{path}: checksum mismatch in tile ({ti}, {tj}): stored {stored:#010x}, computed {computed:#010x}; {}", checksum_advice(.sidecar.as_deref()))]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Tile row.
        ti: u64,
        /// Tile column.
        tj: u64,
        /// CRC-32C in the file's table.
        stored: u32,
        /// CRC-32C of the tile's bytes now.
        computed: u32,
        /// Where the stored checksums are kept when not in the file itself (a `.npy`'s sidecar).
        sidecar: Option<PathBuf>,
    },

    /// An input found unreadable or corrupt before a finished output was overwritten (`run --restart`, a
    /// restarted file output of the Python API, `prepare --restart`): the output was kept.
    #[error("{source}; the restart stopped before touching {}, which its journal says is complete, and left it as it was", kept.display())]
    KeptOutput {
        /// The checksum mismatch found.
        source: Box<Error>,
        /// The finished output left untouched.
        kept: PathBuf,
    },

    /// `verify` found nothing wrong but could check nothing of an output (every part of it
    /// NaN/Inf, or past the range the test can judge): not a pass. The binary exits with
    /// [`Error::exit_status`] 3 for it.
    #[error("{0}")]
    Unverified(String),

    /// An output that another process is writing right now (its journal is locked): not an
    /// error in it, a moment to wait. The binary exits with [`Error::BUSY_STATUS`].
    #[error("{path}: {msg}")]
    Busy {
        /// The output.
        path: PathBuf,
        /// Who writes it, and what to do.
        msg: String,
    },

    /// The run was cancelled because another stage failed (never the reported error).
    #[error("cancelled")]
    Cancelled,
}

/// What to do about a checksum mismatch: a `.mgt` file is corrupt; a `.npy` file may also
/// have been changed on purpose after its sidecar was written.
fn checksum_advice(sidecar: Option<&std::path::Path>) -> String {
    match sidecar {
        None => "the file is corrupt — regenerate or re-import it".into(),
        Some(s) => format!(
            "the array is corrupt, or was changed after its checksum sidecar {} was written — if it was changed on purpose, delete the sidecar",
            s.display()
        ),
    }
}

/// What went wrong on a device, typed where the driver library gives a type.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA driver error.
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS error.
    #[error(transparent)]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// An NVRTC kernel compilation error.
    #[error(transparent)]
    Nvrtc(#[from] cudarc::nvrtc::CompileError),
    /// A failure the lane itself detected (or an injected fault in tests).
    #[error("{0}")]
    Other(String),
}

impl From<&str> for DeviceError {
    fn from(s: &str) -> Self {
        DeviceError::Other(s.to_string())
    }
}
impl From<String> for DeviceError {
    fn from(s: String) -> Self {
        DeviceError::Other(s)
    }
}

impl Error {
    /// The exit status of [`Error::Busy`]: 75, `EX_TEMPFAIL` of sysexits.h ("try again later").
    pub const BUSY_STATUS: i32 = 75;

    /// The binary's exit status for this error (README, "Exit status"): 3 when `verify` could
    /// check nothing ([`Error::Unverified`]), [`Error::BUSY_STATUS`] for an output being
    /// written by another process, 1 for every other error.
    pub fn exit_status(&self) -> i32 {
        match self {
            Error::Unverified(_) => 3,
            Error::Busy { .. } => Self::BUSY_STATUS,
            _ => 1,
        }
    }

    pub(crate) fn device(
        lane: usize,
        device: impl Into<String>,
        what: impl Into<String>,
        source: impl Into<DeviceError>,
    ) -> Self {
        Error::Device {
            lane,
            device: device.into(),
            what: what.into(),
            source: source.into(),
        }
    }
    /// An I/O error on `path` while doing `what`.
    pub fn io(path: impl Into<PathBuf>, what: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            what,
            source,
        }
    }
    /// A malformed matrix file at `path`.
    pub fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub(crate) fn plan(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Plan {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub(crate) fn backend(backend: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Backend {
            backend: backend.into(),
            msg: msg.into(),
        }
    }
}
