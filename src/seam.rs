//! The seam: the small types that the layers meet at, below all of them. The plan asks for a
//! [`Precision`] and a [`StagingMode`]; a backend answers what it can do in [`Caps`] (where its
//! memory lives: [`MemorySpace`]) and what its devices did in [`DeviceStats`]; the stores
//! describe the blocks a device may check in a [`DeviceCheckSpec`]. The planner, the
//! backends, the pipeline, the stores and the reports all use these, so they live here,
//! importing nothing of the crate but [`crate::dtype`] and [`crate::error`]: no layer has to
//! import another sideways (or upwards) just to name them. The layers re-export them where
//! they were first defined (`plan::Precision`, `backend::Caps`, ...), so outside callers'
//! paths stay.

use crate::dtype::DType;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// The GEMM's arithmetic precision.
pub enum Precision {
    /// fp32 inputs and accumulation.
    Fp32,
    /// TF32 inputs, fp32 accumulation.
    Tf32,
    /// bf16 inputs, fp32 accumulation.
    Bf16,
    /// fp16 inputs, fp32 accumulation.
    Fp16,
    /// fp64 inputs and accumulation.
    Fp64,
    /// fp64 inputs and output, the product computed with exact integer GEMMs (Ozaki scheme
    /// II, `backend::ozaki`), within the accuracy contract of docs/PLAN.md, with this many
    /// moduli (`engine.emulation_moduli`).
    Fp64Emulated(EmulationModuli),
}

/// How many moduli `precision = "fp64_emulated"` uses (`engine.emulation_moduli`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EmulationModuli {
    /// The fewest that keep each block within the accuracy contract, chosen per block.
    #[default]
    Auto,
    /// This many (1 to 16), whether or not the contract's bound is met.
    Fixed(u8),
}

impl Precision {
    /// The precision named `s` in a plan (`fp32`, `tf32`, `bf16`, `fp16`, `fp64`,
    /// `fp64_emulated`, the last with its moduli chosen per block).
    pub fn parse(s: &str) -> Option<Precision> {
        [
            Precision::Fp32,
            Precision::Tf32,
            Precision::Bf16,
            Precision::Fp16,
            Precision::Fp64,
            Precision::Fp64Emulated(EmulationModuli::Auto),
        ]
        .into_iter()
        .find(|p| p.name() == s)
    }
    /// The name plans use (`fp32`, `tf32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp64 => "fp64",
            Precision::Fp64Emulated(_) => "fp64_emulated",
        }
    }
    /// Whether the inputs and the output are f64 (`fp64` and `fp64_emulated`).
    pub fn is_f64(self) -> bool {
        matches!(self, Precision::Fp64 | Precision::Fp64Emulated(_))
    }
    /// Host compute/output element type.
    pub fn host_dtype(self) -> DType {
        if self.is_f64() {
            DType::F64
        } else {
            DType::F32
        }
    }
    /// Relative unit roundoff of the inputs as the GEMM sees them (for error bounds).
    pub fn input_eps(self) -> f64 {
        match self {
            Precision::Fp64 | Precision::Fp64Emulated(_) => f64::EPSILON / 2.0,
            Precision::Fp32 => f32::EPSILON as f64 / 2.0,
            Precision::Tf32 => 2f64.powi(-11),
            Precision::Fp16 => 2f64.powi(-11),
            Precision::Bf16 => 2f64.powi(-8),
        }
    }
    /// Unit roundoff of the accumulation.
    pub fn acc_eps(self) -> f64 {
        if self.is_f64() {
            f64::EPSILON / 2.0
        } else {
            f32::EPSILON as f64 / 2.0
        }
    }
}

/// How input tiles reach a GPU (`engine.staging`, docs/PLAN.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StagingMode {
    /// Straight from the file's pages where they are in the page cache, else copied.
    #[default]
    Auto,
    /// Always copied into pinned buffers first.
    Copy,
    /// Straight from the file's pages wherever the format allows, reading them in if needed.
    Direct,
}

impl StagingMode {
    /// `self` on a backend with `lanes` lanes that copies under `auto` from `copies_from` lanes
    /// on ([`Caps::staging`], which says why).
    pub(crate) fn on_lanes(self, lanes: usize, copies_from: usize) -> StagingMode {
        if self == StagingMode::Auto && lanes >= copies_from {
            StagingMode::Copy
        } else {
            self
        }
    }

    /// The mode a plan writes as `text`.
    pub fn parse(text: &str) -> Option<StagingMode> {
        match text.trim() {
            "auto" => Some(StagingMode::Auto),
            "copy" => Some(StagingMode::Copy),
            "direct" => Some(StagingMode::Direct),
            _ => None,
        }
    }
    /// The plan's spelling.
    pub fn name(self) -> &'static str {
        match self {
            StagingMode::Auto => "auto",
            StagingMode::Copy => "copy",
            StagingMode::Direct => "direct",
        }
    }
}

/// Where a lane's input-tile slots and accumulators live, which decides whose budget they count
/// against in the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MemorySpace {
    /// In host memory (the CPU backend): counted in `engine.host_memory`.
    Host,
    /// On a device with its own memory: counted in the per-device budget.
    Device,
}

/// What the planner and `plan` need to know about a backend; everything backend-specific above
/// the [`Lane`](crate::backend::Lane) seam is read from here, never from the backend's name.
#[derive(Clone, Debug)]
pub struct Caps {
    /// Short kind for the journal's fingerprint ("cpu", "cuda", "sim"): a step never mixes
    /// results of two kinds.
    pub(crate) kind: &'static str,
    pub(crate) memory: MemorySpace,
    /// Square tile edges tried by `tile = "auto"`, largest first.
    pub(crate) tile_ladder: &'static [u64],
    /// Most staging buffers per lane worth having.
    pub(crate) staging_depth: usize,
    /// Whether an extra output buffer (download overlapping writeback) is worth budget.
    pub(crate) extra_out_buf: bool,
    /// `staging = "auto"` copies inputs into the staging buffers, instead of uploading them
    /// from the files' pages, when the backend drives at least this many lanes
    /// ([`Caps::staging`]; `usize::MAX`: never).
    pub(crate) auto_copies_from: usize,
    /// Lanes (devices) the backend drives.
    pub(crate) lanes: usize,
    /// Per-lane device memory budget (0 for [`MemorySpace::Host`]).
    pub(crate) device_memory: u64,
    /// Whether the lane converts bf16/fp16 inputs on the device (needs landing buffers and
    /// slots in the narrow type).
    pub(crate) narrow_slots: bool,
    /// Names of the copy engines in reports ("H2D"/"D2H", or "staged"/"collected" on the CPU).
    pub(crate) link_names: (&'static str, &'static str),
    /// Host↔device link rate per lane for `plan`'s lower bound (None: no link).
    pub(crate) link_rate: Option<f64>,
    /// Peak FLOP rate per lane by precision for `plan`'s lower bound, and where that rate
    /// comes from, by precision too (`plan` once called the CPU's f64 rate "faer's f32 rate").
    pub(crate) peak_flops: fn(Precision, usize, u64) -> f64,
    pub(crate) peak_source: fn(Precision) -> &'static str,
}

impl Caps {
    /// How this backend stages inputs when the plan asks for `asked` (docs/PLAN.md `staging`):
    /// as asked, except that `auto` copies on [`Caps::auto_copies_from`] lanes or more. On the
    /// GPUs that is two: with a second GPU's context alive the driver page-locks the files'
    /// pages at 21–31 GB/s instead of 40, one registration at a time whichever thread asks
    /// (`tools/probes/page_lock_two_gpus.py`), and two H200s ran every job faster copying into
    /// pinned buffers than uploading from the files' pages — 32768² bf16 0.511 s against
    /// 0.681, fp32 0.750 against 0.837, 60000² fp64 4.40 against 5.45 (docs/decisions/0007-copy-staging-on-several-gpus.md) —
    /// while one H200 ran level (tf32 0.565 against 0.557).
    pub(crate) fn staging(&self, asked: StagingMode) -> StagingMode {
        asked.on_lanes(self.lanes, self.auto_copies_from)
    }

    /// Whether this backend's lanes download finished tiles straight into `r`
    /// ([`Lane::download_into`](crate::backend::Lane::download_into)) rather than into an
    /// output buffer that writeback then copies from: the CPU's lanes write any host memory;
    /// a device's only page-locked memory, which its copy engine writes at the link's rate
    /// (pageable memory the driver would stage through a buffer of its own, one copy at a time
    /// on the lane's stream — slower than the pipeline's own staging, which writeback threads
    /// copy out of in parallel) and GPU memory, device to device (the pipeline gives a GPU
    /// rectangle only to lanes on that GPU).
    pub(crate) fn writes_directly(&self, r: &OutRect) -> bool {
        match self.memory {
            MemorySpace::Host => r.gpu.is_none(),
            // (A simulated device's lanes copy on the host: no GPU memory.)
            MemorySpace::Device => r.page_locked || (r.gpu.is_some() && self.kind == "cuda"),
        }
    }
}

/// A block of an output that a lane may write straight into
/// ([`MatrixSink::direct_rect`](crate::store::MatrixSink::direct_rect), [`Caps::writes_directly`]):
/// `rows` rows of `row_len` bytes, `pitch` bytes apart, from `addr`, in host memory or (`gpu`)
/// a GPU's. An array the caller handed in as `out=` (a numpy array, a pinned torch tensor, a
/// CUDA tensor), which is written in place anyway, so the output buffer and writeback's copy out
/// of it are one copy too many (and for a GPU array, the trip through the host two):
/// docs/decisions/0021-downloads-into-the-caller-s-array.md.
///
/// A lane writes it without further question, so it is made only with [`OutRect::new`], whose
/// caller vouches for the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutRect {
    /// Address of the block's first element.
    pub(crate) addr: u64,
    /// Bytes from one row's start to the next's.
    pub(crate) pitch: usize,
    /// Bytes of one row of the block.
    pub(crate) row_len: usize,
    /// Rows of the block.
    pub(crate) rows: usize,
    /// Whether the host memory is page-locked (registered with or allocated by the CUDA driver).
    pub(crate) page_locked: bool,
    /// The GPU whose memory holds it (`addr` a unified address); `None`: host memory.
    pub(crate) gpu: Option<usize>,
}

impl OutRect {
    /// `rows` rows of `row_len` bytes, `pitch` bytes apart, from `addr`: in host memory
    /// (`gpu` `None`; `page_locked` as the CUDA driver knows it) or in GPU `gpu`'s memory.
    ///
    /// # Safety
    /// The whole rectangle must be writable memory of that kind, alive and written by no one
    /// else for as long as the step that is given it runs (a sink hands it out for a block it
    /// would otherwise write itself), with `pitch ≥ row_len`; `page_locked` must be true only
    /// for memory the driver has page-locked.
    pub unsafe fn new(
        addr: u64,
        pitch: usize,
        row_len: usize,
        rows: usize,
        page_locked: bool,
        gpu: Option<usize>,
    ) -> OutRect {
        OutRect {
            addr,
            pitch,
            row_len,
            rows,
            page_locked,
            gpu,
        }
    }

    /// The block's rows, as slices of the memory.
    ///
    /// # Safety
    /// The rectangle must be in host memory (`gpu` is `None`) that is alive, and not written by
    /// anyone else, for as long as the slices are used (the sink that gave it guarantees both
    /// for the step; the lane's copy into it must be known to be done).
    pub unsafe fn rows(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.rows).map(move |i| {
            // SAFETY: as the caller promised.
            unsafe {
                std::slice::from_raw_parts(
                    (self.addr as usize + i * self.pitch) as *const u8,
                    self.row_len,
                )
            }
        })
    }
}

/// Device-side time and traffic, as the device measured it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DeviceStats {
    /// Seconds spent in GEMMs.
    pub gemm_s: f64,
    /// Seconds spent copying host to device.
    pub h2d_s: f64,
    /// Seconds spent copying device to host.
    pub d2h_s: f64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// GEMMs run.
    pub gemms: u64,
    /// What `precision = "fp64_emulated"` did (all zero under the other precisions).
    pub emulation: EmulationStats,
}

/// What the fp64 emulation did on a device, per GEMM block (`backend::ozaki`): how many
/// moduli the emulated blocks used and which blocks were computed with native fp64, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EmulationStats {
    /// Blocks computed with integer GEMMs.
    pub blocks: u64,
    /// Fewest and most moduli an emulated block used (0, 0 when none needed any).
    pub moduli_min: u32,
    pub moduli_max: u32,
    /// Integer GEMMs run: N + 1 per emulated block (N residue products, one for the bound).
    pub int_gemms: u64,
    /// Blocks computed with native fp64 instead: the sum of the three below.
    pub fallback_tiles: u64,
    /// ... because they hold NaN or Inf (propagated as DGEMM propagates them).
    pub fallback_nonfinite: u64,
    /// ... because no count of moduli up to 16 keeps them within the bound.
    pub fallback_bound: u64,
    /// ... because they are one element deep.
    pub fallback_short: u64,
    /// Emulated blocks whose bound a forced `engine.emulation_moduli` did not meet.
    pub bound_unmet: u64,
}

impl EmulationStats {
    /// One emulated block with `moduli` moduli (0: all zero, no GEMM needed).
    pub(crate) fn emulated(&mut self, moduli: u32, bound_met: bool) {
        self.blocks += 1;
        if moduli > 0 {
            self.int_gemms += moduli as u64 + 1;
            self.moduli_min = if self.moduli_min == 0 {
                moduli
            } else {
                self.moduli_min.min(moduli)
            };
            self.moduli_max = self.moduli_max.max(moduli);
        }
        self.bound_unmet += u64::from(!bound_met);
    }
    /// Add another device's figures.
    pub(crate) fn add(&mut self, o: &EmulationStats) {
        self.blocks += o.blocks;
        self.int_gemms += o.int_gemms;
        if o.moduli_max > 0 {
            self.moduli_min = if self.moduli_min == 0 {
                o.moduli_min
            } else {
                self.moduli_min.min(o.moduli_min)
            };
            self.moduli_max = self.moduli_max.max(o.moduli_max);
        }
        self.fallback_tiles += o.fallback_tiles;
        self.fallback_nonfinite += o.fallback_nonfinite;
        self.fallback_bound += o.fallback_bound;
        self.fallback_short += o.fallback_short;
        self.bound_unmet += o.bound_unmet;
    }
}

/// The most worker threads a plan or command may ask for: far above any machine's cores, low
/// enough that a typo (`threads = 100000`) is an error rather than a process spawning threads
/// until the machine stalls.
pub const MAX_THREADS: usize = 1024;

/// Where a block's storage tiles lie, for kernels/check.cu's `check_tiles`: the block is
/// `brows × bcols` elements of `elem` bytes, dense row-major, its element (0, 0) the matrix's
/// (`br0`, `bc0`); it touches storage tiles `ti0..ti0 + nti` × `tj0..tj0 + ntj` of
/// `tile_rows × tile_cols`, one result each, in row-major order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCheckSpec {
    pub brows: u64,
    pub bcols: u64,
    pub br0: u64,
    pub bc0: u64,
    pub tile_rows: u64,
    pub tile_cols: u64,
    pub ti0: u64,
    pub tj0: u64,
    pub nti: u64,
    pub ntj: u64,
    /// 4 (f32) or 8 (f64).
    pub elem: u32,
}

impl DeviceCheckSpec {
    /// Results the check gives: one per storage tile touched.
    pub fn tiles(&self) -> usize {
        (self.nti * self.ntj) as usize
    }
}

/// Which faults to inject (the fault-injecting wrappers of `backend::fault`; the settings
/// [`crate::config`] reads from the environment).
#[cfg(feature = "fault-injection")]
#[derive(Clone, Debug, Default)]
pub struct FaultConfig {
    /// Only this lane (index in the backend's lane list) fails; `None`: every lane.
    pub lane: Option<usize>,
    /// A failing lane's GEMM fails once this many GEMMs have run on it.
    pub gemm_after: Option<u64>,
    /// Writing the output fails (ENOSPC) once this many tiles were written by this process.
    pub write_after: Option<u64>,
    /// Every output tile's write takes this much longer (a slow disk), in milliseconds.
    pub write_delay_ms: u64,
}
