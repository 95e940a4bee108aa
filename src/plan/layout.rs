//! Tile sizes and memory budgets for one step on one target, decided before the first tile
//! moves.
//!
//! Every buffer the pipeline will ever hold is counted here: staging buffers (host, pinned on a
//! GPU), output buffers (host), input-tile slots and accumulators (device memory on a GPU, host
//! memory on the CPU backend). The `host_bytes` figure is the job's staging ceiling, and the
//! pool sizes are what the pipeline allocates — it never allocates more. A plan that cannot fit
//! is rejected here with the numbers, before any work.

use super::{Engine, Precision, Step, TileSpec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::seam::{Caps, MemorySpace};
use crate::units::fmt_bytes;

#[derive(Clone, Debug)]
/// Tile sizes and every pool's buffer count and size for one step on one backend, fixed before anything runs.
pub struct Layout {
    /// Compute tile rows (output).
    pub tm: u64,
    /// Compute tile columns (output).
    pub tn: u64,
    /// Compute tile depth (k).
    pub tk: u64,
    /// Element type of staged inputs and of outputs on the host.
    pub host_dt: DType,
    /// Element type of input tiles in device slots.
    pub dev_dt: DType,
    /// Host staging buffers per lane.
    pub staging_bufs: usize,
    /// Bytes of one staging buffer.
    pub staging_buf_bytes: u64,
    /// Host output buffers.
    pub out_bufs: usize,
    /// Bytes of one output buffer.
    pub out_buf_bytes: u64,
    /// Input-tile slots per lane (the device tile cache).
    pub slots: usize,
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Accumulators per lane.
    pub accs: usize,
    /// Output tiles that each lane's first group computes k-chunk by k-chunk (1: none): its
    /// first square in growing squares (3×3 under fp64: [`Layout::try_square_group`]), or of its
    /// first row. See [`Layout::choose_start_group`].
    pub start_group: usize,
    /// The start group where the lane walks serpentine rows after all (the queue does not grow:
    /// lanes with unequal bands left, a resumed step's last band): tiles of one row, at most
    /// [`START_GROUP_MAX`]; ≤ `start_group`.
    pub row_group: usize,
    /// Bytes of one accumulator.
    pub acc_bytes: u64,
    /// Device landing buffers for on-device conversion (bf16/fp16), per lane.
    pub landing: usize,
    /// Bytes of one landing buffer.
    pub landing_bytes: u64,
    /// Device scratch per lane of `precision = "fp64_emulated"` on a GPU ([`emulation_scratch`]);
    /// 0 otherwise.
    pub scratch_bytes: u64,
    /// Host bytes held by all pools together (the staging ceiling).
    pub host_bytes: u64,
    /// Device bytes per lane (0 on the CPU).
    pub device_bytes: u64,
    /// Storage tile of the output file.
    pub out_tile: (u64, u64),
    /// Lanes (devices) the step runs on.
    pub lanes: usize,
    /// The ladder's row tile when `tm` was made smaller to deal the rows evenly to the lanes
    /// ([`balanced_rows`]).
    pub rows_evened: Option<u64>,
    /// Built by [`Layout::recorded`] for a finished step, past the budgets: fit for the
    /// fingerprint that lets the step be skipped, not for computing with. A run that must
    /// compute with it (mending a finished output) refuses instead.
    pub over_budget: bool,
}

/// The depth of a compute tile as the emulation's int8 GEMMs see it: padded with zeros to a
/// multiple of 16, which cuBLAS's int8 tensor-core kernels want for their leading dimensions.
pub(crate) fn emulation_depth(tk: u64) -> u64 {
    tk.div_ceil(16) * 16
}

/// Device scratch of one GPU lane computing `precision = "fp64_emulated"` blocks of tm×tn×tk
/// (src/backend/cuda/emulate.rs): the int8 residues of op(A) and op(B) in the TN layout, one
/// plane per modulus (16), the int32 product, 16 residue planes of the output (u8), and
/// per-vector figures. 3.25 GiB for 8192³ tiles.
pub(crate) fn emulation_scratch(tm: u64, tn: u64, tk: u64) -> u64 {
    // The int8 GEMM's n (our columns) is padded to 16 as well (b8 and the int32 product).
    let (kp, tnp) = (emulation_depth(tk), emulation_depth(tn));
    16 * (tm + tnp) * kp + tm * tnp * 4 + 16 * tm * tn + (tm + tn) * (4 + 8 + 4) + 64
}

/// The most output tiles of one row a lane's first group computes together
/// ([`Layout::start_group`]).
const START_GROUP_MAX: u64 = 4;

/// The side of the first square a lane computes as its start group in growing squares, by
/// precision: 3 (nine tiles) for `fp64`, whose blocks take longer to stage than a GEMM takes;
/// otherwise none beyond [`Layout::choose_start_group`]'s (the 2×2 square where the grid is 4
/// or more wide). `fp64_emulated`'s GEMMs are slower: not measured, it keeps the default
/// ([`Layout::try_square_group`]).
fn start_square(p: Precision) -> u64 {
    match p {
        Precision::Fp64 => 3,
        _ => 0,
    }
}

/// (the most tiles in the start group, the side of the square [`Layout::try_square_group`]
/// makes it in growing squares, 0: none): [`START_GROUP_MAX`] and [`start_square`] of `p`;
/// `MGMM_START_GROUP=N` makes them N and ⌊√N⌋ (at most N tiles of a row, or in growing
/// squares the square of side ⌊√N⌋ where that is more), to measure one group against another
/// (tools/bench/roofline.sh's `NAME_sgN`).
fn start_group_limits(p: Precision) -> (u64, u64) {
    match crate::config::start_group() {
        Some(n) => (n as u64, (n as f64).sqrt().floor() as u64),
        None => (START_GROUP_MAX, start_square(p)),
    }
}

/// Row tiles chosen to deal rows evenly are a multiple of this (or all of `m`).
const ROW_ALIGN: u64 = 128;

/// The row tile, at most `tm`, that deals `m` rows most evenly to `lanes`. Lanes take tile rows
/// in turn (`TileQueue`: lane `l` the rows `ti ≡ l mod lanes`), so when the tile rows do not
/// divide among the lanes, or the last one is short, one lane gets up to a whole tile row more
/// than another and the others wait at the end (stealing takes whole tiles, and only once a
/// lane's own run is empty): 60000² on two GPUs with 8192-row tiles gave one GPU 32768 rows and
/// the other 27232, and the second GPU's GEMMs were busy 62–64 % of the step against 71–74 %
/// (docs/decisions/0013-auto-tile-rows-evened.md). Shrinking the tile to `m / (bands · lanes)`, rounded up to
/// [`ROW_ALIGN`], gives 7552-row tiles there: 30208 and 29792 rows. Kept only when it is more
/// even; one lane, or a tile that holds all of `m`, is left as it is.
pub(crate) fn balanced_rows(m: u64, tm: u64, lanes: u64) -> u64 {
    if lanes <= 1 || tm >= m || tm < ROW_ALIGN {
        return tm;
    }
    let bands = m.div_ceil(tm).div_ceil(lanes);
    let t = m
        .div_ceil(bands * lanes)
        .next_multiple_of(ROW_ALIGN)
        .min(tm);
    if lane_rows_spread(m, t, lanes) < lane_rows_spread(m, tm, lanes) {
        t
    } else {
        tm
    }
}

/// Rows each lane gets when lanes take `tm`-row tile rows in turn, fewest and most.
pub(crate) fn lane_rows(m: u64, tm: u64, lanes: u64) -> (u64, u64) {
    let mut rows = vec![0u64; lanes.max(1) as usize];
    for ti in 0..m.div_ceil(tm) {
        rows[(ti % lanes.max(1)) as usize] += tm.min(m - ti * tm);
    }
    (*rows.iter().min().unwrap(), *rows.iter().max().unwrap())
}

/// Most minus fewest rows a lane gets ([`lane_rows`]).
fn lane_rows_spread(m: u64, tm: u64, lanes: u64) -> u64 {
    let (lo, hi) = lane_rows(m, tm, lanes);
    hi - lo
}

impl Layout {
    /// The layout of `step` under `engine`'s budgets on a backend with `caps`; errors name `origin`.
    pub fn new(
        plan: &std::path::Path,
        step: &Step,
        engine: &Engine,
        caps: &Caps,
    ) -> Result<Layout> {
        let candidates: Vec<(u64, u64, u64)> = match engine.tile {
            TileSpec::Fixed { m, n, k } => vec![(m, n, k)],
            TileSpec::Auto => caps.tile_ladder.iter().map(|&t| (t, t, t)).collect(),
        };
        let mut last = None;
        for (m, n, k) in candidates {
            let tm = m.min(step.m);
            let even = match engine.tile {
                TileSpec::Auto if engine.even_rows => balanced_rows(step.m, tm, caps.lanes as u64),
                TileSpec::Auto => tm,
                TileSpec::Fixed { .. } => tm,
            };
            let mut l = Self::with_tiles(step, engine, caps, even, n.min(step.n), k.min(step.k));
            l.rows_evened = (even != tm).then_some(tm);
            if l.fits(engine, caps) {
                return Ok(l.grow(step, engine, caps));
            }
            last = Some(l);
        }
        let l = last.expect("at least one candidate");
        let what = if matches!(engine.tile, TileSpec::Fixed { .. }) {
            "the requested tile"
        } else {
            "even the smallest tile"
        };
        let mut msg = format!(
            "{}: {what} ({}×{}×{}) does not fit: it needs {} of host memory",
            step.at(),
            l.tm,
            l.tn,
            l.tk,
            fmt_bytes(l.host_bytes)
        );
        if caps.memory == MemorySpace::Device {
            msg += &format!(
                " and {} of device memory per GPU",
                fmt_bytes(l.device_bytes)
            );
        }
        msg += &format!(
            ", but engine.host_memory is {}{}; raise the budget or lower engine.tile",
            fmt_bytes(engine.host_memory),
            if caps.memory == MemorySpace::Device {
                format!(
                    " and the device budget is {}",
                    fmt_bytes(caps.device_memory)
                )
            } else {
                String::new()
            }
        );
        Err(Error::plan(plan, msg))
    }

    /// The layout of a finished step with the compute tile its journal records, which no
    /// longer fits `engine`'s budgets: its fingerprint (which names the tile) matches the
    /// journal's, so the step is skipped ([`crate::run::layout_for`]); marked
    /// [`Layout::over_budget`], so nothing computes with it.
    pub fn recorded(
        step: &Step,
        engine: &Engine,
        caps: &Caps,
        (m, n, k): (u64, u64, u64),
    ) -> Layout {
        let mut l = Self::with_tiles(
            step,
            engine,
            caps,
            m.min(step.m),
            n.min(step.n),
            k.min(step.k),
        );
        l.over_budget = !l.fits(engine, caps);
        l
    }

    fn with_tiles(step: &Step, engine: &Engine, caps: &Caps, tm: u64, tn: u64, tk: u64) -> Layout {
        let host_dt = engine.precision.host_dtype();
        let hs = host_dt.size() as u64;
        let dev_dt = match (caps.narrow_slots, engine.precision) {
            (true, Precision::Bf16) => DType::BF16,
            (true, Precision::Fp16) => DType::F16,
            _ => host_dt,
        };
        let in_elems = (tm * tk)
            .max(tk * tn)
            .max(if step.c0.is_some() { tm * tn } else { 0 });
        let acc_bytes = tm * tn * hs;
        let (landing, landing_bytes) = if dev_dt != host_dt {
            (2, in_elems * hs)
        } else {
            (0, 0)
        };
        let mut l = Layout {
            tm,
            tn,
            tk,
            host_dt,
            dev_dt,
            staging_bufs: 2,
            staging_buf_bytes: in_elems * hs,
            out_bufs: 2,
            out_buf_bytes: tm * tn * hs,
            slots: 2,
            slot_bytes: (tm * tk).max(tk * tn) * dev_dt.size() as u64,
            accs: 2,
            start_group: 1,
            row_group: 1,
            acc_bytes,
            landing,
            landing_bytes,
            scratch_bytes: match (caps.memory, engine.precision) {
                (MemorySpace::Device, Precision::Fp64Emulated(_)) => emulation_scratch(tm, tn, tk),
                _ => 0,
            },
            host_bytes: 0,
            device_bytes: 0,
            out_tile: (0, 0),
            lanes: caps.lanes,
            rows_evened: None,
            over_budget: false,
        };
        let ot = step.out_tile.unwrap_or(0);
        l.out_tile = if ot > 0 {
            (ot.min(step.m), ot.min(step.n))
        } else {
            (tm, tn)
        };
        l.recount(caps);
        l
    }

    fn recount(&mut self, caps: &Caps) {
        let lanes = self.lanes as u64;
        let dev = self.slots as u64 * self.slot_bytes
            + self.accs as u64 * self.acc_bytes
            + self.landing as u64 * self.landing_bytes
            + self.scratch_bytes;
        let staging = lanes * (self.staging_bufs as u64 * self.staging_buf_bytes)
            + lanes * self.out_bufs as u64 * self.out_buf_bytes;
        if caps.memory == MemorySpace::Device {
            self.device_bytes = dev;
            self.host_bytes = staging;
        } else {
            self.device_bytes = 0;
            self.host_bytes = staging + dev;
        }
    }

    fn fits(&self, engine: &Engine, caps: &Caps) -> bool {
        self.host_bytes <= engine.host_memory
            && (caps.memory == MemorySpace::Host || self.device_bytes <= caps.device_memory)
    }

    /// Spend the remaining budget on deeper staging and a larger tile cache.
    fn grow(mut self, step: &Step, engine: &Engine, caps: &Caps) -> Layout {
        // Distinct input tiles: growing the cache beyond this buys nothing.
        let gm = step.m.div_ceil(self.tm);
        let gn = step.n.div_ceil(self.tn);
        let gk = step.k.div_ceil(self.tk);
        let distinct = (gm * gk + gk * gn) as usize;
        let stage_max = caps.staging_depth;
        while self.staging_bufs < stage_max {
            self.staging_bufs += 1;
            self.recount(caps);
            if !self.fits(engine, caps) {
                self.staging_bufs -= 1;
                self.recount(caps);
                break;
            }
        }
        if caps.extra_out_buf {
            // An extra output buffer lets downloads overlap writeback.
            self.out_bufs += 1;
            self.recount(caps);
            if !self.fits(engine, caps) {
                self.out_bufs -= 1;
                self.recount(caps);
            }
        }
        if caps.memory == MemorySpace::Device && gn > 1 {
            // Accumulators for the start group, and one more for the tile after it.
            let want = gn.min(start_group_limits(engine.precision).0) as usize + 1;
            if want > self.accs {
                let old = self.accs;
                self.accs = want;
                self.recount(caps);
                if !self.fits(engine, caps) {
                    self.accs = old;
                    self.recount(caps);
                }
            }
        }
        self.fill_slots(engine, caps, distinct);
        self.start_group = self.choose_start_group(gn, gk, engine.precision);
        self.row_group = self.start_group;
        self.try_square_group(step, engine, caps);
        // Accumulators the group does not use go back to the tile cache.
        let need = if self.start_group > 1 {
            self.start_group + 1
        } else {
            2
        };
        if self.accs > need {
            self.accs = need;
            self.recount(caps);
            self.fill_slots(engine, caps, distinct);
        }
        self
    }

    /// Give the tile cache every slot the budget (device or host memory) has room for, up to
    /// `distinct` (the input tiles there are).
    fn fill_slots(&mut self, engine: &Engine, caps: &Caps, distinct: usize) {
        let spare = if caps.memory == MemorySpace::Device {
            caps.device_memory.saturating_sub(self.device_bytes)
        } else {
            engine.host_memory.saturating_sub(self.host_bytes)
        };
        let extra = (spare / self.slot_bytes.max(1)) as usize;
        self.slots = (self.slots + extra).min(distinct.max(2));
        self.recount(caps);
    }

    /// How many output tiles each lane's first group computes k-chunk by k-chunk: k-chunk 0
    /// of every tile of the group, then k-chunk 1 of each, and so on.
    ///
    /// At the start the device tile cache is empty, so a lane's first output tile needs two
    /// new input tiles per GEMM (its A row and its B column), while every later tile of the row
    /// needs one (the A row is cached). Where reading and uploading a tile takes about as long
    /// as one GEMM, the device waits for the first tile's inputs: 38 ms of idle GPU in the
    /// first 0.2 s of 32768² fp32 on one H200 (`MGMM_TRACE` timeline, docs/decisions/0011-polling-lane-and-start-group.md). Across
    /// a group of `w` tiles of one row, k-chunk `kk` needs one A tile and `w` B tiles for `w`
    /// GEMMs, so the device is fed from the first GEMM on. The tiles' sums are unchanged (each
    /// adds its k-chunks in order), so the output's bytes do not depend on it.
    ///
    /// Only on a device (its accumulators are device memory: one per tile of the group, plus
    /// one; when there is no group they go back to the tile cache), and only when the tile
    /// cache holds all of B and two A rows (`slots ≥ gk·(gn + 2)`): then no tile of the first
    /// rows is evicted, and the reads are exactly what
    /// [`crate::plan::schedule::input_loads`] predicts for the plain order.
    pub(crate) fn choose_start_group(&self, gn: u64, gk: u64, p: Precision) -> usize {
        if self.device_bytes == 0 || (self.slots as u64) < gk * (gn + 2) {
            return 1;
        }
        (self.accs - 1)
            .min(gn as usize)
            .min(start_group_limits(p).0 as usize)
            .max(1)
    }

    /// Where the lanes walk growing squares ([`Layout::squares_fit`]), make the start group
    /// the lane's first square of side [`start_group_limits`]'s second figure when its
    /// accumulators fit beside a tile cache that still holds every block (else leave the
    /// group as [`Layout::choose_start_group`] chose it).
    ///
    /// Why: at the start the cache is empty and every GEMM needs new blocks; when staging
    /// a block takes longer than a GEMM (fp64 from `.npy` on one H100: 27–34 ms a 512 MiB
    /// block against a 21 ms 8192³ DGEMM), the GPU waits until the loads have run far enough
    /// ahead. A group of `q²` tiles computed k-chunk by k-chunk needs `2q` blocks for `q²`
    /// GEMMs per k-chunk. Measured at 32768² fp64 from `.npy` on one H100: 1.406–1.408 s
    /// (0.96 × torch's in-core DGEMM) against 1.460–1.510 s with the 2×2 square
    /// (docs/decisions/0024-a-first-square-of-nine-for-fp64.md). Where loads are quick against
    /// a GEMM (fp32) or the GEMMs far quicker than the output's pages (tf32, bf16), nine were
    /// slower: the group's tiles all end in its last k-chunk and hold the first writebacks back.
    fn try_square_group(&mut self, step: &Step, engine: &Engine, caps: &Caps) {
        let (gm, gn, _) = self.grid(step);
        let side = start_group_limits(engine.precision).1;
        let rows = gm.div_ceil(self.lanes.max(1) as u64);
        let q = side.min(gn).min(rows);
        let want = (q * q) as usize;
        if caps.memory != MemorySpace::Device || q < 2 || want <= self.start_group {
            return;
        }
        // More accumulators leave less room (the slots were already given all there was):
        // the square only where every block still fits beside them.
        let before = self.clone();
        self.accs = self.accs.max(want + 1);
        self.recount(caps);
        if self.fits(engine, caps) && self.squares_fit(step, self.lanes) {
            self.start_group = want;
            return;
        }
        *self = before;
    }

    /// Whether `lanes` lanes may walk their output tiles in growing squares
    /// ([`crate::pipeline::stages::TileQueue`], which decides from the tiles left to do): on a
    /// device, when its tile cache holds every input tile a lane needs (the A rows of a lane with
    /// the most rows and all of B), so that no tile is loaded twice in either order and the
    /// squares only spread the loads over the step.
    pub(crate) fn squares_fit(&self, step: &Step, lanes: usize) -> bool {
        let (gm, gn, gk) = self.grid(step);
        let rows = gm.div_ceil(lanes.max(1) as u64);
        self.device_bytes > 0 && self.slots as u64 >= gk * (rows + gn)
    }

    /// Compute tiles of `step` along m, n and k.
    pub fn grid(&self, step: &Step) -> (u64, u64, u64) {
        (
            step.m.div_ceil(self.tm),
            step.n.div_ceil(self.tn),
            step.k.div_ceil(self.tk),
        )
    }

    /// A warning for a compute tile set so small that the step's time goes to the calls, not
    /// the arithmetic: an edge under 64 where the matrix is larger, over more than 10,000 GEMM
    /// calls (`tile = 7` was accepted without a word: a new user's trial). `None` otherwise,
    /// and for `tile = "auto"`, which never picks such a tile.
    /// With a `.mgt` output whose storage tiles are mostly padding (each starts on a 4 KiB
    /// page), the note says what the file will take on disk and which key sets its tile
    /// (`tile = 7` made a 117 KiB output a 2.5 MiB file, 21× its values: a new user's trial).
    pub fn small_tile_note(&self, step: &Step, engine: &Engine) -> Option<String> {
        let (calls, pad) = (self.calls_note(step, engine), self.padding_note(step));
        match (calls, pad) {
            (Some(c), Some(p)) => Some(format!("{c}; and {p}")),
            (None, Some(p)) => Some(format!("{}: {p}", step.at())),
            (c, None) => c,
        }
    }

    /// The padding half of [`Self::small_tile_note`]: a `.mgt` output (in a file) over 1 MiB
    /// much larger than its values ([`crate::store::header::Header::padding_cost`]), and what
    /// to set.
    fn padding_note(&self, step: &Step) -> Option<String> {
        let mgt = step.output.extension().is_some_and(|e| e == "mgt");
        let (rt, ct) = self.out_tile;
        if !mgt || step.in_memory(&step.output) || rt == 0 || ct == 0 {
            return None;
        }
        let (rt, ct) = (rt.min(step.m.max(1)), ct.min(step.n.max(1)));
        let header =
            crate::store::header::Header::new(step.out_dtype, step.m, step.n, rt, ct, true);
        use crate::store::header::Padding;
        // A run warns about sizable waste only (`gen` and `import` note any: their --tile was
        // the user's choice just now); small test-sized outputs pad their edges harmlessly.
        if header.file_len() <= 1 << 20 {
            return None;
        }
        let pad = header.padding_cost(&step.output.display().to_string())?;
        let set = "the step's `tile` (the output's storage tile";
        Some(match (pad, step.out_tile) {
            // The step sets it: only a larger one helps (engine.tile does not change it).
            (Padding::Pages(p), Some(_)) => format!("{p}; raise {set}, now {rt}), e.g. to 1024"),
            (Padding::Pages(p), None) => {
                format!("{p}; set {set}, e.g. 1024) or a larger engine.tile")
            }
            // Said only for a tile the step sets: the compute tile's edges are the layout's
            // choice (8192² tiles of a 10000² output store 16384²), not a mistake to warn of.
            (Padding::Edges(p), Some(_)) => {
                format!("{p}; {set}) dividing the shape, or larger than it, pads less")
            }
            (Padding::Edges(_), None) => return None,
        })
    }

    /// The GEMM-call half of [`Self::small_tile_note`].
    fn calls_note(&self, step: &Step, engine: &Engine) -> Option<String> {
        let TileSpec::Fixed { .. } = engine.tile else {
            return None;
        };
        let small = [(self.tm, step.m), (self.tn, step.n), (self.tk, step.k)]
            .iter()
            .any(|&(t, d)| t < 64 && t < d);
        let (gm, gn, gk) = self.grid(step);
        let calls = gm.saturating_mul(gn).saturating_mul(gk);
        (small && calls > 10_000).then(|| {
            format!(
                "{}: engine.tile makes {calls} GEMM calls of {}×{}×{}, far below the size a call runs efficiently at (hundreds to thousands of elements on each side): the calls' overhead, not the arithmetic, will take the time; leave engine.tile out (\"auto\" picks from the memory budgets) or set 1024 or more on a GPU, 128 or more on the CPU",
                step.at(),
                self.tm,
                self.tn,
                self.tk
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{balanced_rows, lane_rows_spread};

    #[test]
    fn row_tiles_deal_rows_evenly_to_lanes() {
        // 60000² on two GPUs: 32768 against 27232 rows with 8192-row tiles.
        assert_eq!(lane_rows_spread(60000, 8192, 2), 5536);
        assert_eq!(balanced_rows(60000, 8192, 2), 7552);
        assert_eq!(lane_rows_spread(60000, 7552, 2), 416);
        // Already even, one lane, or one tile holding all rows: unchanged.
        assert_eq!(balanced_rows(32768, 8192, 2), 8192);
        assert_eq!(balanced_rows(60000, 8192, 1), 8192);
        assert_eq!(balanced_rows(5000, 8192, 2), 8192);
        // Fewer tile rows than lanes: every lane gets a row.
        assert_eq!(balanced_rows(10000, 8192, 2), 5120);
        // Never larger, always a multiple of the alignment, never less even; over many shapes.
        for lanes in 2..=5u64 {
            for m in (1000..200_000).step_by(997) {
                for tm in [8192u64, 4096, 1024, 256] {
                    let t = balanced_rows(m, tm, lanes);
                    assert!(t <= tm, "m {m} tm {tm} lanes {lanes}: {t}");
                    assert!(t == tm || t.is_multiple_of(128), "m {m} tm {tm}: {t}");
                    assert!(lane_rows_spread(m, t, lanes) <= lane_rows_spread(m, tm, lanes));
                }
            }
        }
    }
}
