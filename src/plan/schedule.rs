//! The schedule: which output tiles exist, in what order they are handed out, which input
//! blocks each k-step needs, and a deterministic model of each lane's tile cache.
//!
//! Output tile (i, j) always accumulates k-blocks 0, 1, … in order; that fixed order is what
//! makes two runs bitwise identical. The cache model ([`TileCache`]) is run by each lane's
//! planner to decide, before any byte moves, whether an input tile must be loaded and into
//! which slot — so data flows one way (planner → prefetch → staging → lane) and the lane never
//! has to ask for anything. `plan` runs the same model to report the bytes every link carries.

use std::collections::{BTreeMap, HashMap};

use super::layout::Layout;
use super::Step;
use crate::store::Block;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Src {
    A,
    B,
    C0,
}

/// One output tile: its index in the schedule order and its block of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OutTile {
    pub(crate) seq: u32,
    pub(crate) ti: u64,
    pub(crate) tj: u64,
    pub(crate) block: Block,
}

#[derive(Clone, Debug)]
pub(crate) struct Schedule {
    pub(crate) tiles: Vec<OutTile>,
    pub(crate) gn: u64,
    pub(crate) gk: u64,
    pub(crate) tk: u64,
    pub(crate) k: u64,
    pub(crate) a_trans: bool,
    pub(crate) b_trans: bool,
}

impl Schedule {
    pub(crate) fn new(step: &Step, l: &Layout) -> Schedule {
        let (gm, gn, _) = l.grid(step);
        let mut tiles = Vec::with_capacity((gm * gn) as usize);
        for ti in 0..gm {
            // Serpentine order: the next row starts where this one ended, so the B tiles used
            // last are used again first.
            let js: Vec<u64> = if ti % 2 == 0 {
                (0..gn).collect()
            } else {
                (0..gn).rev().collect()
            };
            for tj in js {
                let r0 = ti * l.tm;
                let c0 = tj * l.tn;
                tiles.push(OutTile {
                    seq: tiles.len() as u32,
                    ti,
                    tj,
                    block: Block {
                        r0,
                        c0,
                        rows: l.tm.min(step.m - r0),
                        cols: l.tn.min(step.n - c0),
                    },
                });
            }
        }
        Schedule {
            tiles,
            ..Self::without_tiles(step, l)
        }
    }

    /// The schedule of `step` laid out as `l`, its tiles left out.
    fn without_tiles(step: &Step, l: &Layout) -> Schedule {
        let (_, gn, gk) = l.grid(step);
        Schedule {
            tiles: Vec::new(),
            gn,
            gk,
            tk: l.tk,
            k: step.k,
            a_trans: step.a.trans,
            b_trans: step.b.trans,
        }
    }

    /// Depth of k-block `kk`.
    pub(crate) fn kdepth(&self, kk: u64) -> u64 {
        self.tk.min(self.k - kk * self.tk)
    }

    /// The stored block of A holding op(A)[i-block, k-block].
    pub(crate) fn a_block(&self, t: &OutTile, kk: u64) -> Block {
        let (r0, rows) = (t.block.r0, t.block.rows);
        let (k0, kd) = (kk * self.tk, self.kdepth(kk));
        if self.a_trans {
            Block {
                r0: k0,
                c0: r0,
                rows: kd,
                cols: rows,
            }
        } else {
            Block {
                r0,
                c0: k0,
                rows,
                cols: kd,
            }
        }
    }

    /// The stored blocks of A and B that the first output tile's first k-block reads
    /// ([`Block::FIRST`] each for an empty output), without laying out the step's tiles
    /// (`plan` of a 10⁶² product in 64² tiles would make 2.4·10⁸ of them).
    pub(crate) fn first_blocks(step: &Step, l: &Layout) -> (Block, Block) {
        if step.m == 0 || step.n == 0 {
            return (Block::FIRST, Block::FIRST);
        }
        let first = Self::without_tiles(step, l);
        let t = OutTile {
            seq: 0,
            ti: 0,
            tj: 0,
            block: Block {
                r0: 0,
                c0: 0,
                rows: l.tm.min(step.m),
                cols: l.tn.min(step.n),
            },
        };
        (first.a_block(&t, 0), first.b_block(&t, 0))
    }

    /// The stored block of B holding op(B)[k-block, j-block].
    pub(crate) fn b_block(&self, t: &OutTile, kk: u64) -> Block {
        let (c0, cols) = (t.block.c0, t.block.cols);
        let (k0, kd) = (kk * self.tk, self.kdepth(kk));
        if self.b_trans {
            Block {
                r0: c0,
                c0: k0,
                rows: cols,
                cols: kd,
            }
        } else {
            Block {
                r0: k0,
                c0,
                rows: kd,
                cols,
            }
        }
    }
}

/// LRU model of a lane's input-tile slots. Deterministic: the same sequence of requests gives
/// the same hits, misses and slot numbers.
pub(crate) struct TileCache {
    owner: Vec<Option<(Src, u64, u64)>>,
    stamp: Vec<u64>,
    map: HashMap<(Src, u64, u64), usize>,
    /// Occupied slots by last use (least recent first): eviction in O(log slots). A linear
    /// scan here made one output tile with many k-steps plan in time quadratic in them
    /// (25 000 k-steps: 34 s before the first GEMM).
    lru: BTreeMap<u64, usize>,
    /// Slots never used yet, lowest first.
    free: Vec<usize>,
    clock: u64,
}

impl TileCache {
    pub(crate) fn new(slots: usize) -> TileCache {
        assert!(
            slots >= 2,
            "need two slots: one A and one B tile per k-step"
        );
        TileCache {
            owner: vec![None; slots],
            stamp: vec![0; slots],
            map: HashMap::new(),
            lru: BTreeMap::new(),
            free: (0..slots).rev().collect(),
            clock: 0,
        }
    }
    /// Slot for `key`, and whether it must be loaded: a slot never used, else the least
    /// recently used one.
    pub(crate) fn get(&mut self, key: (Src, u64, u64)) -> (usize, bool) {
        self.clock += 1;
        if let Some(&s) = self.map.get(&key) {
            self.lru.remove(&self.stamp[s]);
            self.stamp[s] = self.clock;
            self.lru.insert(self.clock, s);
            return (s, false);
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                let (_, s) = self.lru.pop_first().expect("every slot is in use");
                s
            }
        };
        if let Some(old) = self.owner[s].take() {
            self.map.remove(&old);
        }
        self.owner[s] = Some(key);
        self.stamp[s] = self.clock;
        self.lru.insert(self.clock, s);
        self.map.insert(key, s);
        (s, true)
    }
}

/// Bytes each link carries for a step, from the cache model.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    /// Input tiles loaded onto devices.
    pub tile_loads: u64,
    /// Bytes read from the input files.
    pub read_bytes: u64,
    /// Bytes copied host to device.
    pub h2d_bytes: u64,
    /// Bytes copied device to host.
    pub d2h_bytes: u64,
    /// Bytes written to the output.
    pub write_bytes: u64,
    /// GEMMs run.
    pub gemms: u64,
    /// Bytes that must move at least: each input read once, the output written once.
    pub min_read_bytes: u64,
}

/// The tile grid and cache size the traffic model needs (everything else is bytes per element).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub(crate) m: u64,
    pub(crate) n: u64,
    pub(crate) k: u64,
    pub(crate) tm: u64,
    pub(crate) tn: u64,
    pub(crate) tk: u64,
    pub(crate) lanes: usize,
    pub(crate) slots: usize,
}

/// Input tiles loaded into lanes' caches over a whole step, and their elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct InputLoads {
    /// Tile loads into device caches, all lanes together.
    pub(crate) loads: u64,
    /// Elements those loads carry (host to device).
    pub(crate) elems: u128,
    /// Elements read from the files: the same, less the B tiles that lanes running in phase
    /// share through the shared reader (one read serves every lane that needs the block).
    pub(crate) file_elems: u128,
}

/// What [`TileCache`] will load over the order lanes run the tiles in, before any stealing
/// ([`TileQueue`](crate::pipeline::stages::TileQueue)): lane `l` takes the output rows
/// `ti ≡ l (mod lanes)` and walks them in serpentine order, the direction alternating with the
/// lane's own row count, so all lanes are in the same tile column at the same step. Closed form
/// and exact, O(row bands): no tile is simulated.
///
/// Why it is exact: an LRU cache of `slots` entries hits a request iff fewer than `slots`
/// distinct other keys were requested since the same key's previous request (its stack
/// distance). In a lane's serpentine order every distance is a formula of the grid:
/// * `A(i, kk)` was last used by the previous tile of the same row: `2·gk − 1` keys apart. So
///   every A tile is loaded once per row when `slots ≥ 2·gk`, else once per output tile.
/// * `B(kk, j)` was last used by the lane's previous row. At position `q` of the row (counted
///   from the turn of the serpentine) the distance is `2·gk − 1` for `q = 0` and
///   `(q + 3)·gk − 1` beyond. So the first `min(H, gn)` positions of every row but the first
///   hit, with `H = 0` if `slots < 2·gk`, else `max(1, slots/gk − 2)`.
///
/// Where the lanes walk growing squares instead (`Layout::squares_fit`), the cache holds every
/// tile a lane needs, so nothing is evicted and the loads are these same counts (each tile once,
/// `h ≥ gn`); only their timing differs.
///
/// Lanes in phase need the same B blocks at the same step, so the file reads of B are those of
/// the lane with the most rows (lane 0); the A rows are disjoint between lanes.
pub(crate) fn input_loads(g: &Grid) -> InputLoads {
    let (gm, gn, gk) = (g.m.div_ceil(g.tm), g.n.div_ceil(g.tn), g.k.div_ceil(g.tk));
    if gm * gn == 0 || gk == 0 {
        return InputLoads::default();
    }
    let lanes = (g.lanes.max(1) as u64).min(gm);
    let slots = g.slots as u64;
    let a_row_reuse = slots >= 2 * gk;
    let h = if !a_row_reuse {
        0
    } else {
        (slots / gk).saturating_sub(2).max(1)
    };
    let last_w = g.n - (gn - 1) * g.tn;
    // Elements of B columns at row positions [x, y) of the lane's row `r` (× k later).
    let b_width = |r: u64, x: u64, y: u64| -> u128 {
        if x >= y {
            return 0;
        }
        let last_pos = if r.is_multiple_of(2) { gn - 1 } else { 0 };
        let short = if (x..y).contains(&last_pos) {
            g.tn - last_w
        } else {
            0
        };
        ((y - x) * g.tn - short) as u128
    };
    let k = g.k as u128;
    let mut out = InputLoads::default();
    for lane in 0..lanes {
        let rows = (gm - lane).div_ceil(lanes);
        let (mut a_elems, mut b_elems) = (0u128, 0u128);
        for r in 0..rows {
            let ti = lane + r * lanes;
            let height = g.tm.min(g.m - ti * g.tm) as u128;
            let a_tiles = if a_row_reuse { 1 } else { gn };
            out.loads += a_tiles * gk;
            a_elems += a_tiles as u128 * height * k;
            let from = if r == 0 { 0 } else { h.min(gn) };
            out.loads += (gn - from) * gk;
            b_elems += b_width(r, from, gn) * k;
        }
        out.elems += a_elems + b_elems;
        out.file_elems += a_elems + if lane == 0 { b_elems } else { 0 };
    }
    out
}

/// The bytes every link carries for `step` under layout `l`, from [`input_loads`].
pub fn traffic(step: &Step, l: &Layout) -> Traffic {
    let hs = l.host_dt.size() as u128;
    let ins = step.a.dtype.size() as u128;
    let loads = input_loads(&Grid {
        m: step.m,
        n: step.n,
        k: step.k,
        tm: l.tm,
        tn: l.tn,
        tk: l.tk,
        lanes: l.lanes,
        slots: l.slots,
    });
    let sat = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
    let (gm, gn, gk) = l.grid(step);
    let out = step.m as u128 * step.n as u128;
    let c0 = if step.c0.is_some() { out } else { 0 };
    let inputs = step.m as u128 * step.k as u128 + step.k as u128 * step.n as u128 + c0;
    Traffic {
        tile_loads: loads.loads,
        read_bytes: sat((loads.file_elems + c0) * ins),
        h2d_bytes: sat((loads.elems + c0) * hs),
        d2h_bytes: sat(out * hs),
        write_bytes: sat(out * step.out_dtype.size() as u128),
        gemms: gm.saturating_mul(gn).saturating_mul(gk),
        min_read_bytes: sat(inputs * ins),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache model run request by request over the serpentine order, as the planners do.
    fn simulate(g: &Grid) -> InputLoads {
        let (gm, gn, gk) = (g.m.div_ceil(g.tm), g.n.div_ceil(g.tn), g.k.div_ceil(g.tk));
        let lanes = (g.lanes as u64).min(gm);
        let mut out = InputLoads::default();
        // Which B keys some lane read from the file at each step (lanes in phase share them).
        let mut b_read: std::collections::HashSet<(u64, u64, u64)> = Default::default();
        for lane in 0..lanes {
            let mut cache = TileCache::new(g.slots);
            let rows: Vec<u64> = (0..gm).filter(|ti| ti % lanes == lane).collect();
            let mut step = 0u64;
            for (r, &ti) in rows.iter().enumerate() {
                let js: Vec<u64> = if r % 2 == 0 {
                    (0..gn).collect()
                } else {
                    (0..gn).rev().collect()
                };
                for tj in js {
                    let rows_h = g.tm.min(g.m - ti * g.tm) as u128;
                    let cols = g.tn.min(g.n - tj * g.tn) as u128;
                    for kk in 0..gk {
                        let depth = g.tk.min(g.k - kk * g.tk) as u128;
                        if cache.get((Src::A, ti, kk)).1 {
                            out.loads += 1;
                            out.elems += rows_h * depth;
                            out.file_elems += rows_h * depth;
                        }
                        if cache.get((Src::B, kk, tj)).1 {
                            out.loads += 1;
                            out.elems += depth * cols;
                            if b_read.insert((step, kk, tj)) {
                                out.file_elems += depth * cols;
                            }
                        }
                    }
                    step += 1;
                }
            }
        }
        out
    }

    /// The cache chooses exactly the slots of the plain least-recently-used scan it replaced
    /// (a slot never used first, lowest index first; else the least recently used).
    #[test]
    fn tile_cache_is_the_plain_lru() {
        let mut g = crate::store::gen::Rng::new(5, 0);
        for slots in [2, 3, 7, 16] {
            let mut c = TileCache::new(slots);
            let (mut owner, mut stamp) = (vec![None; slots], vec![0u64; slots]);
            for clock in 1..2000u64 {
                let key = (Src::A, g.next_u64() % 3, g.next_u64() % (slots as u64 + 4));
                let want = match (0..slots).find(|&s| owner[s] == Some(key)) {
                    Some(s) => (s, false),
                    None => {
                        let s = (0..slots)
                            .min_by_key(|&s| (owner[s].is_some(), stamp[s]))
                            .unwrap();
                        owner[s] = Some(key);
                        (s, true)
                    }
                };
                stamp[want.0] = clock;
                assert_eq!(c.get(key), want, "slots {slots}, step {clock}");
            }
        }
    }

    #[test]
    fn closed_form_equals_the_simulation() {
        let mut checked = 0;
        for (m, n, k) in [
            (7, 9, 5),
            (16, 16, 16),
            (20, 3, 11),
            (3, 20, 1),
            (13, 17, 19),
        ] {
            for (tm, tn, tk) in [(1, 1, 1), (2, 3, 2), (4, 4, 4), (3, 2, 5), (64, 64, 64)] {
                for lanes in [1, 2, 3, 5] {
                    for slots in [2, 3, 4, 5, 7, 9, 12, 20, 33, 64, 500] {
                        let g = Grid {
                            m,
                            n,
                            k,
                            tm,
                            tn,
                            tk,
                            lanes,
                            slots,
                        };
                        assert_eq!(input_loads(&g), simulate(&g), "{g:?}");
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 5 * 5 * 4 * 11);
    }

    #[test]
    fn huge_grids_are_instant() {
        // 1 000 000² with 64-wide tiles: 2.4e8 output tiles, 3.8e12 cache requests if simulated.
        let t = std::time::Instant::now();
        let g = Grid {
            m: 1_000_000,
            n: 1_000_000,
            k: 1_000_000,
            tm: 64,
            tn: 64,
            tk: 64,
            lanes: 8,
            slots: 1 << 20,
        };
        let l = input_loads(&g);
        assert!(t.elapsed().as_secs_f64() < 0.5, "{:?}", t.elapsed());
        // Every input is read at least once.
        assert!(l.elems >= 2 * 1_000_000u128 * 1_000_000);
        // A is read once per band (the cache holds a band's A row), B once per lane and band
        // except where the serpentine turn reuses it.
        let gk = 1_000_000u64.div_ceil(64);
        assert!(l.loads > 15625 * gk && l.loads <= 2 * 15625 * 15625 * gk);
    }

    /// The headers of the tests' plans: A 70×45, B 45×33, f32.
    fn headers(p: &std::path::Path) -> crate::error::Result<Option<crate::plan::MatrixInfo>> {
        let (rows, cols) = if p.ends_with("A.mgt") {
            (70, 45)
        } else {
            (45, 33)
        };
        Ok(Some(crate::plan::MatrixInfo {
            rows,
            cols,
            dtype: crate::dtype::DType::F32,
            transposed: false,
        }))
    }

    /// The first blocks found without laying out the tiles are the schedule's first tile's,
    /// transposed operands and tiles past the matrix's edge included.
    #[test]
    fn first_blocks_are_the_first_tiles_blocks() {
        use crate::backend::{cpu::CpuBackend, Backend};
        use crate::plan::Plan;
        for (expr, tile) in [
            ("A @ B", "8"),
            ("A @ B", "[16, 40, 64]"),
            ("B.T @ A.T", "[16, 8, 4]"),
            ("A @ A.T", "[128, 8, 4]"),
        ] {
            let text = format!(
                "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[[step]]\n\
                 output = \"C.mgt\"\nexpr = \"{expr}\"\n[engine]\nbackend = \"cpu\"\ntile = {tile}\n"
            );
            let plan = Plan::resolve(std::path::Path::new("p.toml"), &text, &[], &headers).unwrap();
            let step = &plan.steps[0];
            let caps = CpuBackend::new(1, None).caps().clone();
            let l = Layout::new(&plan.path, step, &plan.engine, &caps).unwrap();
            let s = Schedule::new(step, &l);
            let t = &s.tiles[0];
            assert_eq!(
                Schedule::first_blocks(step, &l),
                (s.a_block(t, 0), s.b_block(t, 0)),
                "{expr} {tile}"
            );
        }
    }

    #[test]
    fn traffic_matches_the_cache_over_the_real_schedule() {
        use crate::backend::{cpu::CpuBackend, Backend};
        use crate::plan::Plan;
        let mut grew = 0;
        for tile in ["8", "[16, 8, 4]", "[32, 32, 8]"] {
            let text = format!(
                "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n[[step]]\n\
                 output = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\nbackend = \"cpu\"\ntile = {tile}\n"
            );
            let plan = Plan::resolve(std::path::Path::new("p.toml"), &text, &[], &headers).unwrap();
            let step = &plan.steps[0];
            for lanes in [1, 3] {
                let mut caps = CpuBackend::new(1, None).caps().clone();
                caps.lanes = lanes;
                let mut l = Layout::new(&plan.path, step, &plan.engine, &caps).unwrap();
                for (slots, may_grow) in [2, 6, 13, l.slots]
                    .into_iter()
                    .flat_map(|s| [(s, false), (s, true)])
                {
                    l.slots = slots;
                    let sched = Schedule::new(step, &l);
                    let all: Vec<u32> = (0..sched.tiles.len() as u32).collect();
                    // Growing squares only where the cache holds a lane's every tile, as
                    // `Layout::squares_fit` asks (the CPU's layout is not a device's).
                    let rows = (sched.tiles.iter().map(|t| t.ti).max().unwrap() + 1)
                        .div_ceil(lanes as u64);
                    let fits = slots as u64 >= sched.gk * (rows + sched.gn);
                    let queue = crate::pipeline::stages::TileQueue::new(
                        &sched,
                        all,
                        lanes,
                        may_grow && fits,
                    );
                    let (mut loads, mut h2d, mut read) = (0, 0, 0);
                    let mut shared = std::collections::HashSet::new();
                    for lane in 0..lanes {
                        let mut cache = TileCache::new(slots);
                        for (step_no, &seq) in queue.run(lane).iter().enumerate() {
                            let t = &sched.tiles[seq as usize];
                            for kk in 0..sched.gk {
                                for (key, b) in [
                                    ((Src::A, t.ti, kk), sched.a_block(t, kk)),
                                    ((Src::B, kk, t.tj), sched.b_block(t, kk)),
                                ] {
                                    if cache.get(key).1 {
                                        loads += 1;
                                        h2d += b.elems() as u64 * 4;
                                        if key.0 == Src::A || shared.insert((step_no, key)) {
                                            read += b.elems() as u64 * 4;
                                        }
                                    }
                                }
                            }
                        }
                    }
                    grew += queue.grows() as usize;
                    let t = traffic(step, &l);
                    assert_eq!(
                        (t.tile_loads, t.h2d_bytes, t.read_bytes),
                        (loads, h2d, read),
                        "{tile} {lanes} {slots} {}",
                        queue.grows()
                    );
                    assert_eq!(t.min_read_bytes, (70 * 45 + 45 * 33) * 4);
                }
            }
        }
        assert!(grew > 0, "some cases walk growing squares");
    }
}
