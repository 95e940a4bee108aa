//! Settings read from the process environment, in one place: the engine itself never reads
//! the environment (hot paths get their settings as values), so every variable a run obeys is
//! listed here or in the cluster module's `identity.rs` (the launcher's variables for split runs).
//!
//! Today that is the fault injection of the tests and the GPU resilience scripts
//! (`MGMM_FAULT_*`, cargo feature `fault-injection`; `MGMM_FAULT_SYNC_LOG=PATH` logs every
//! sync of a created file or directory there), and `MGMM_VERIFY_TIMES`, which makes
//! `verify` print each pass's time and input rate on stderr (for the benchmark scripts), and
//! `MGMM_PINNED_ALLOC`, which makes the CUDA backend pin its host buffers with
//! `cuMemHostAlloc` instead of registering memory it mapped (to compare the two on a GPU
//! machine, tools/bench/gpu_table.sh); `MGMM_READ_PREAD`, which makes the readers copy every
//! block with `pread`s, never out of the file's map (to compare the two: benches/staging.rs,
//! tools/bench/roofline.sh); `MGMM_OUTPREP_THREADS=N`, the threads that populate the output's
//! pages (to measure their competition with staging); `MGMM_START_GROUP=N`, the output tiles
//! a lane's first group computes k-chunk by k-chunk (to measure one group against another);
//! `MGMM_WARMUP_INLINE=1`, the warm-up GEMM before the backend is handed over with every
//! precision (to measure it against running beside the step's start); `MGMM_AUTO_COPIES=b`,
//! B's blocks copied and A's page-locked under `staging = "auto"` on a GPU (to measure the
//! two working at once); `MGMM_GEMM_STREAMS=1|2`, the GEMM streams of a GPU lane (to measure
//! one against two); `MGMM_TRACE=PATH`,
//! which records a timeline of the run into PATH ([`crate::trace`]). `MGMM_VERIFY_TIMES` and
//! `MGMM_TRACE` are read once into a [`Settings`] where a command starts.

use std::path::PathBuf;

#[cfg(feature = "fault-injection")]
use crate::seam::FaultConfig;

/// The settings a command takes from the environment, read once where it starts (the command
/// line's `execute`, a library entry point) by [`Settings::from_env`] and passed down as
/// values: nothing below reads the environment for them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Settings {
    /// `MGMM_VERIFY_TIMES` is set: `verify` reports each pass's time and input rate on stderr.
    pub(crate) verify_times: bool,
    /// `MGMM_TRACE`: where to write the run's timeline ([`crate::trace`]); `None` when unset
    /// or empty.
    pub(crate) trace: Option<PathBuf>,
}

impl Settings {
    /// Read `MGMM_VERIFY_TIMES` and `MGMM_TRACE`.
    pub(crate) fn from_env() -> Self {
        Settings {
            verify_times: std::env::var_os("MGMM_VERIFY_TIMES").is_some(),
            trace: std::env::var_os("MGMM_TRACE")
                .filter(|v| !v.is_empty())
                .map(Into::into),
        }
    }
}

/// Read `MGMM_FAULT_LANE`, `MGMM_FAULT_GEMM_AFTER`, `MGMM_FAULT_WRITE_AFTER` and
/// `MGMM_FAULT_WRITE_DELAY_MS` (every output tile's record takes that much longer: a slow disk,
/// which keeps a step running for as long as a test needs without using the CPU); `None` when
/// none is set. Called once by the command line, never by the engine.
#[cfg(feature = "fault-injection")]
pub(crate) fn fault_config() -> Option<FaultConfig> {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let c = FaultConfig {
        lane: var("MGMM_FAULT_LANE").map(|v| v as usize),
        gemm_after: var("MGMM_FAULT_GEMM_AFTER"),
        write_after: var("MGMM_FAULT_WRITE_AFTER"),
        write_delay_ms: var("MGMM_FAULT_WRITE_DELAY_MS").unwrap_or(0),
    };
    (c.gemm_after.is_some() || c.write_after.is_some() || c.write_delay_ms > 0).then_some(c)
}

/// `MGMM_FAULT_SYNC_LOG`: the file the test hook of `store::fsutil` logs every sync and
/// journal record to; `None` when unset. Called once by the command line.
#[cfg(feature = "fault-injection")]
pub(crate) fn sync_log() -> Option<PathBuf> {
    std::env::var_os("MGMM_FAULT_SYNC_LOG")
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

/// Whether `MGMM_PINNED_ALLOC` is set: the CUDA backend then allocates its pinned host buffers
/// with `cuMemHostAlloc` rather than mapping and registering them. Read once per process.
pub(crate) fn pinned_alloc() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MGMM_PINNED_ALLOC").is_some())
}

/// Whether `MGMM_READ_PREAD` is set (to anything but empty or `0`): the readers then read
/// every block with `pread`s and copy
/// nothing out of a file's map (`store::blockio::ReadFrom`). Read once per process.
pub(crate) fn read_with_pread() -> bool {
    static ON: Once<bool> = Once::new();
    flag(&ON, "MGMM_READ_PREAD")
}

/// `MGMM_OUTPREP_THREADS`: how many threads populate the output's pages, instead of the
/// engine's choice (an eighth of `engine.threads`, 2 to 8): for measuring how that kernel work
/// competes with staging's copies on the host's cores (tools/bench/roofline.sh's `NAME_opN`
/// jobs). `None` when unset, empty or not a number from 1 to 64. Read once per process.
pub(crate) fn outprep_threads() -> Option<usize> {
    static N: Once<Option<usize>> = Once::new();
    count(&N, "MGMM_OUTPREP_THREADS")
}

/// `MGMM_START_GROUP`: how many output tiles a lane's first group computes k-chunk by
/// k-chunk — at most N tiles of its first row (no more than the grid is wide), or in growing
/// squares the first square of side ⌊√N⌋ where that is more — instead of the layout's choice
/// (`plan::layout::start_square`): for
/// measuring one group against another (tools/bench/roofline.sh's `NAME_sgN` jobs). `None`
/// when unset, empty or not a number from 1 to 64. Read once per process.
pub(crate) fn start_group() -> Option<usize> {
    static N: Once<Option<usize>> = Once::new();
    count(&N, "MGMM_START_GROUP")
}

/// `MGMM_WARMUP_INLINE`: the CUDA backend runs its warm-up GEMM (which loads cuBLAS's kernel)
/// before it is handed over with every precision, as it does with fp32 and fp64, instead of on
/// a thread of its own beside the step's start with tf32, bf16 and fp16 (`backend::cuda::early`):
/// to measure one against the other (tools/bench/roofline.sh's `NAME_wi` jobs). Read once per
/// process.
pub(crate) fn warm_up_inline() -> bool {
    static ON: Once<bool> = Once::new();
    flag(&ON, "MGMM_WARMUP_INLINE")
}

/// `MGMM_AUTO_COPIES=b`: `staging = "auto"` on a GPU copies every block of B's file and
/// page-locks A's, whatever the precision (`pipeline::direct::AutoCopies::B`): to measure
/// staging's copies and the driver's page-locking working at once (tools/bench/roofline.sh's
/// `NAME_cb` jobs). Read once per process.
pub(crate) fn auto_copies_b() -> bool {
    static ON: Once<bool> = Once::new();
    *ON.get_or_init(|| std::env::var("MGMM_AUTO_COPIES").is_ok_and(|v| v == "b"))
}

/// `MGMM_GEMM_STREAMS=N`: a CUDA lane issues its tiles' GEMMs on one stream, or (N ≥ 2) on
/// two, tile by tile in turn, instead of the precision's choice
/// (`backend::cuda::lane::gemm_streams`): to measure one against the other
/// (tools/bench/roofline.sh's `NAME_gsN` jobs). `None` when unset. Read once per process.
pub(crate) fn gemm_streams() -> Option<usize> {
    static N: Once<Option<usize>> = Once::new();
    count(&N, "MGMM_GEMM_STREAMS")
}

type Once<T> = std::sync::OnceLock<T>;

/// Whether the variable `name` is set to anything but empty or `0`, read once into `cell`.
fn flag(cell: &'static Once<bool>, name: &str) -> bool {
    *cell.get_or_init(|| std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0"))
}

/// The variable `name` as a number from 1 to 64, read once into `cell`; `None` when unset,
/// empty or anything else.
fn count(cell: &'static Once<Option<usize>>, name: &str) -> Option<usize> {
    *cell.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=64).contains(n))
    })
}

/// `CUDA_VISIBLE_DEVICES`: the GPUs CUDA will let the process see, for the run's guess of
/// them before the driver is up (`run::prefill`); `None` when unset.
pub(crate) fn cuda_visible_devices() -> Option<String> {
    std::env::var("CUDA_VISIBLE_DEVICES").ok()
}
