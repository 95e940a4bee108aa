//! The schedule: which output tiles exist, in what order they are handed out, which input
//! blocks each k-step needs, and a deterministic model of each lane's tile cache.
//!
//! Output tile (i, j) always accumulates k-blocks 0, 1, … in order; that fixed order is what
//! makes two runs bitwise identical. The cache model ([`TileCache`]) is run by each lane's
//! planner to decide, before any byte moves, whether an input tile must be loaded and into
//! which slot — so data flows one way (planner → prefetch → staging → lane) and the lane never
//! has to ask for anything. `plan` runs the same model to report the bytes every link carries.

use std::collections::HashMap;

use super::layout::Layout;
use super::Step;
use crate::store::Block;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Src {
    A,
    B,
    C0,
}

/// One output tile: its index in the schedule order and its block of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutTile {
    pub seq: u32,
    pub ti: u64,
    pub tj: u64,
    pub block: Block,
}

#[derive(Clone, Debug)]
pub struct Schedule {
    pub tiles: Vec<OutTile>,
    pub gm: u64,
    pub gn: u64,
    pub gk: u64,
    pub tm: u64,
    pub tn: u64,
    pub tk: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a_trans: bool,
    pub b_trans: bool,
}

impl Schedule {
    pub fn new(step: &Step, l: &Layout) -> Schedule {
        let (gm, gn, gk) = l.grid(step);
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
            gm,
            gn,
            gk,
            tm: l.tm,
            tn: l.tn,
            tk: l.tk,
            m: step.m,
            n: step.n,
            k: step.k,
            a_trans: step.a.trans,
            b_trans: step.b.trans,
        }
    }

    /// Depth of k-block `kk`.
    pub fn kdepth(&self, kk: u64) -> u64 {
        self.tk.min(self.k - kk * self.tk)
    }

    /// The stored block of A holding op(A)[i-block, k-block].
    pub fn a_block(&self, t: &OutTile, kk: u64) -> Block {
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

    /// The stored block of B holding op(B)[k-block, j-block].
    pub fn b_block(&self, t: &OutTile, kk: u64) -> Block {
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
pub struct TileCache {
    owner: Vec<Option<(Src, u64, u64)>>,
    stamp: Vec<u64>,
    map: HashMap<(Src, u64, u64), usize>,
    clock: u64,
}

impl TileCache {
    pub fn new(slots: usize) -> TileCache {
        assert!(
            slots >= 2,
            "need two slots: one A and one B tile per k-step"
        );
        TileCache {
            owner: vec![None; slots],
            stamp: vec![0; slots],
            map: HashMap::new(),
            clock: 0,
        }
    }
    /// Slot for `key`, and whether it must be loaded.
    pub fn get(&mut self, key: (Src, u64, u64)) -> (usize, bool) {
        self.clock += 1;
        if let Some(&s) = self.map.get(&key) {
            self.stamp[s] = self.clock;
            return (s, false);
        }
        let s = (0..self.owner.len())
            .min_by_key(|&s| (self.owner[s].is_some(), self.stamp[s]))
            .unwrap();
        if let Some(old) = self.owner[s].take() {
            self.map.remove(&old);
        }
        self.owner[s] = Some(key);
        self.stamp[s] = self.clock;
        self.map.insert(key, s);
        (s, true)
    }
}

/// Bytes each link carries for a step, from the cache model.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub tile_loads: u64,
    pub read_bytes: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub write_bytes: u64,
    pub gemms: u64,
    /// Bytes that must move at least: each input read once, the output written once.
    pub min_read_bytes: u64,
}

/// The tile grid and cache size the traffic model needs (everything else is bytes per element).
#[derive(Clone, Copy, Debug)]
pub struct Grid {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub tm: u64,
    pub tn: u64,
    pub tk: u64,
    pub lanes: usize,
    pub slots: usize,
}

/// Input tiles loaded into lanes' caches over a whole step, and their elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InputLoads {
    pub loads: u64,
    pub elems: u128,
}

/// What [`TileCache`] will load over the schedule's order, with the order cut into one
/// contiguous run per lane (as [`TileQueue`](crate::pipeline::stages::TileQueue) cuts it before
/// any stealing). Closed form, exact, and O(lanes + row bands): no tile is simulated.
///
/// Why it is exact: an LRU cache of `slots` entries hits a request iff fewer than `slots`
/// distinct other keys were requested since the same key's previous request (its stack
/// distance). In the serpentine order every distance is a formula of the grid:
/// * `A(i, kk)` was last used by the previous tile of the same row band: `2·gk − 1` keys apart.
///   So every A tile is loaded once per band when `slots ≥ 2·gk`, else once per output tile.
/// * `B(kk, j)` was last used one band earlier, if that band's tile in column `j` ran on this
///   lane. At position `q` of the band (columns counted from where the band starts, the turn
///   of the serpentine) the distance is `2·gk − 1` for `q = 0` and `(q + 3)·gk − 1` beyond.
///   So the first `min(H, …)` positions of a band hit, with `H = 0` if `slots < 2·gk`, else
///   `max(1, slots/gk − 2)`.
pub fn input_loads(g: &Grid) -> InputLoads {
    let (gm, gn, gk) = (g.m.div_ceil(g.tm), g.n.div_ceil(g.tn), g.k.div_ceil(g.tk));
    let total = gm * gn;
    if total == 0 || gk == 0 {
        return InputLoads::default();
    }
    let lanes = g.lanes.max(1) as u64;
    let per = total.div_ceil(lanes).max(1);
    let slots = g.slots as u64;
    let a_band_reuse = slots >= 2 * gk;
    // Band positions 0..h hit in B when the previous band covered them.
    let h = if !a_band_reuse {
        0
    } else {
        (slots / gk).saturating_sub(2).max(1)
    };
    let last_w = g.n - (gn - 1) * g.tn;
    // Elements of B columns at band positions [x, y) of band `r` (one k-panel: × k later).
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
    let mut out = InputLoads::default();
    let mut start = 0;
    while start < total {
        let end = (start + per).min(total);
        let (r0, r1) = (start / gn, (end - 1) / gn);
        let mut prev_p0 = None;
        for r in r0..=r1 {
            let p0 = if r == r0 { start - r * gn } else { 0 };
            let p1 = if r == r1 { end - r * gn } else { gn };
            let cnt = p1 - p0;
            let rows = g.tm.min(g.m - r * g.tm) as u128;
            let a_tiles = if a_band_reuse { 1 } else { cnt };
            out.loads += a_tiles * gk;
            out.elems += a_tiles as u128 * rows * g.k as u128;
            // B: positions [0, hits) were loaded one band earlier on this lane and are still
            // cached; the rest of [p0, p1) are loads.
            let hits = match prev_p0 {
                Some(pp0) => h.min(p1).min(gn - pp0),
                None => 0,
            };
            let from = p0.max(hits);
            out.loads += (p1 - from) * gk;
            out.elems += b_width(r, from, p1) * g.k as u128;
            prev_p0 = Some(p0);
        }
        start = end;
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
        read_bytes: sat((loads.elems + c0) * ins),
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
        let order: Vec<(u64, u64)> = (0..gm)
            .flat_map(|ti| {
                let js: Vec<u64> = if ti % 2 == 0 {
                    (0..gn).collect()
                } else {
                    (0..gn).rev().collect()
                };
                js.into_iter().map(move |tj| (ti, tj))
            })
            .collect();
        let per = order.len().div_ceil(g.lanes).max(1);
        let mut caches: Vec<TileCache> = (0..g.lanes).map(|_| TileCache::new(g.slots)).collect();
        let mut out = InputLoads::default();
        for (i, &(ti, tj)) in order.iter().enumerate() {
            let cache = &mut caches[(i / per).min(g.lanes - 1)];
            let rows = g.tm.min(g.m - ti * g.tm) as u128;
            let cols = g.tn.min(g.n - tj * g.tn) as u128;
            for kk in 0..gk {
                let depth = g.tk.min(g.k - kk * g.tk) as u128;
                if cache.get((Src::A, ti, kk)).1 {
                    out.loads += 1;
                    out.elems += rows * depth;
                }
                if cache.get((Src::B, kk, tj)).1 {
                    out.loads += 1;
                    out.elems += depth * cols;
                }
            }
        }
        out
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

    #[test]
    fn traffic_matches_the_cache_over_the_real_schedule() {
        use crate::backend::{cpu::CpuBackend, Backend};
        use crate::plan::{MatrixInfo, Plan};
        let headers = |p: &std::path::Path| {
            let (rows, cols) = if p.ends_with("A.mgt") {
                (70, 45)
            } else {
                (45, 33)
            };
            Ok(Some(MatrixInfo {
                rows,
                cols,
                dtype: crate::dtype::DType::F32,
                transposed: false,
            }))
        };
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
                for slots in [2, 6, 13, l.slots] {
                    l.slots = slots;
                    let sched = Schedule::new(step, &l);
                    let per = sched.tiles.len().div_ceil(lanes);
                    let mut caches: Vec<TileCache> =
                        (0..lanes).map(|_| TileCache::new(slots)).collect();
                    let (mut loads, mut bytes) = (0, 0);
                    for (i, t) in sched.tiles.iter().enumerate() {
                        let cache = &mut caches[i / per];
                        for kk in 0..sched.gk {
                            for (key, b) in [
                                ((Src::A, t.ti, kk), sched.a_block(t, kk)),
                                ((Src::B, kk, t.tj), sched.b_block(t, kk)),
                            ] {
                                if cache.get(key).1 {
                                    loads += 1;
                                    bytes += b.elems() as u64 * 4;
                                }
                            }
                        }
                    }
                    let t = traffic(step, &l);
                    assert_eq!(
                        (t.tile_loads, t.read_bytes),
                        (loads, bytes),
                        "{tile} {lanes} {slots}"
                    );
                    assert_eq!(t.min_read_bytes, (70 * 45 + 45 * 33) * 4);
                }
            }
        }
    }
}
