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

pub fn traffic(step: &Step, l: &Layout, sched: &Schedule) -> Traffic {
    let mut t = Traffic::default();
    let hs = l.host_dt.size() as u64;
    let ins = step.a.dtype.size() as u64;
    let mut caches: Vec<TileCache> = (0..l.lanes).map(|_| TileCache::new(l.slots)).collect();
    let per = sched.tiles.len().div_ceil(l.lanes).max(1);
    for (i, ot) in sched.tiles.iter().enumerate() {
        // Lanes take contiguous runs of the schedule (see pipeline::stages::TileQueue).
        let cache = &mut caches[(i / per).min(l.lanes - 1)];
        for kk in 0..sched.gk {
            for (src, b) in [
                (Src::A, sched.a_block(ot, kk)),
                (Src::B, sched.b_block(ot, kk)),
            ] {
                let key = if src == Src::A {
                    (src, ot.ti, kk)
                } else {
                    (src, kk, ot.tj)
                };
                if cache.get(key).1 {
                    t.tile_loads += 1;
                    t.read_bytes += b.elems() as u64 * ins;
                    t.h2d_bytes += b.elems() as u64 * hs;
                }
            }
            t.gemms += 1;
        }
        let ob = ot.block.elems() as u64;
        if step.c0.is_some() {
            t.read_bytes += ob * ins;
            t.h2d_bytes += ob * hs;
        }
        t.d2h_bytes += ob * hs;
        t.write_bytes += ob * step.out_dtype.size() as u64;
    }
    t.min_read_bytes = (step.m * step.k
        + step.k * step.n
        + if step.c0.is_some() {
            step.m * step.n
        } else {
            0
        })
        * ins;
    t
}
