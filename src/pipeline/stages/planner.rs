//! The planner stage: output tile numbers from the [`TileQueue`] → [`PlanOp`]s (loads into
//! device slots, Begin, GEMM per k-chunk, End), and each tile's output block as a hint to
//! outprep. One thread per lane. It runs the lane's tile-cache model ([`TileCache`]) to decide
//! which input blocks to load and into which slot; it blocks only on its output channel to
//! prefetch (and on the queue's mutex).

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use super::messages::PlanOp;
use super::queue::TileQueue;
use crate::backend::GemmDesc;
use crate::durable::checkpoint::Checkpoints;
use crate::error::{Error, Result};
use crate::metrics::StageMetrics;
use crate::pipeline::control::Control;
use crate::plan::schedule::{OutTile, Schedule, Src, TileCache};
use crate::store::Block;

pub(crate) struct Planner<'a> {
    pub(crate) lane: usize,
    /// Output blocks about to be computed, for the output prefault stage (a hint: dropped
    /// rather than waited for when that stage is behind).
    pub(crate) outprep: Sender<Block>,
    pub(crate) sched: &'a Schedule,
    pub(crate) queue: &'a TileQueue,
    pub(crate) slots: usize,
    pub(crate) accs: usize,
    /// Output tiles the lane's first group computes k-chunk by k-chunk where the queue walks
    /// growing squares ([`crate::plan::layout::Layout::start_group`]; 1: none), and where it
    /// walks rows ([`crate::plan::layout::Layout::row_group`]).
    pub(crate) start_group: usize,
    pub(crate) row_group: usize,
    pub(crate) alpha: f64,
    pub(crate) beta: f64,
    pub(crate) has_c0: bool,
    /// Saved partial accumulators: tiles found there start at their next k-chunk.
    pub(crate) ckpt: Option<&'a Checkpoints>,
    pub(crate) out: Sender<PlanOp>,
    pub(crate) m: Arc<StageMetrics>,
}

impl Planner<'_> {
    /// The k-chunk `seq` starts at: its checkpoint's next chunk when it resumes from one.
    fn k0(&self, seq: u32) -> u64 {
        self.ckpt
            .and_then(|c| c.resumed().get(&seq))
            .map_or(0, |&d| d as u64)
    }

    /// The loads and the GEMM of k-chunk `kk` of `tile` into `acc`.
    fn gemm_ops(
        &self,
        cache: &mut TileCache,
        tile: OutTile,
        kk: u64,
        acc: usize,
        ops: &mut Vec<PlanOp>,
    ) {
        let s = self.sched;
        let (a_slot, load_a) = cache.get((Src::A, tile.ti, kk));
        if load_a {
            ops.push(PlanOp::Load {
                slot: a_slot,
                src: Src::A,
                block: s.a_block(&tile, kk),
            });
        }
        let (b_slot, load_b) = cache.get((Src::B, kk, tile.tj));
        if load_b {
            ops.push(PlanOp::Load {
                slot: b_slot,
                src: Src::B,
                block: s.b_block(&tile, kk),
            });
        }
        let beta = if kk > 0 {
            1.0
        } else if self.has_c0 {
            self.beta
        } else {
            0.0
        };
        let desc = GemmDesc {
            m: tile.block.rows as usize,
            n: tile.block.cols as usize,
            k: s.kdepth(kk) as usize,
            a_trans: s.a_trans,
            b_trans: s.b_trans,
            alpha: self.alpha,
            beta,
        };
        ops.push(PlanOp::Gemm {
            desc,
            a_slot,
            b_slot,
            acc,
            tile,
            kk,
        });
    }

    /// The lane's first output tiles, up to [`Layout::start_group`] of them in growing squares
    /// ([`TileQueue`]) and [`Layout::row_group`] in serpentine rows, that start from k-chunk 0:
    /// computed k-chunk by k-chunk across the group (see there). In serpentine order they are
    /// tiles of the lane's first row; in growing squares the next tiles of its run, which on a
    /// fresh step are its first square: with four tiles (0,0), (0,1), (1,0), (1,1), whose
    /// k-chunk `kk` needs two A and two B tiles for four GEMMs; with nine (fp64) the 3×3 one,
    /// three and three for nine.
    ///
    /// [`Layout::start_group`]: crate::plan::layout::Layout::start_group
    fn first_group(&self, seq: u32) -> Vec<u32> {
        let mut group = vec![seq];
        let grows = self.queue.grows();
        let size = if grows {
            self.start_group
        } else {
            self.row_group
        };
        if size < 2 || self.k0(seq) > 0 {
            return group;
        }
        let ti = self.sched.tiles[seq as usize].ti;
        while group.len() < size {
            let next = self.queue.pop_if(self.lane, |q| {
                (grows || self.sched.tiles[q as usize].ti == ti) && self.k0(q) == 0
            });
            match next {
                Some(q) => group.push(q),
                None => break,
            }
        }
        group
    }

    pub(crate) fn run(self, ctl: &Control) -> Result<()> {
        let mut cache = TileCache::new(self.slots);
        let mut count = 0usize;
        let s = self.sched;
        while let Some(seq) = self.queue.pop(self.lane) {
            if ctl.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let t0 = Instant::now();
            let group = if count == 0 {
                self.first_group(seq)
            } else {
                vec![seq]
            };
            // Every tile of a group holds an accumulator of its own until it ends.
            debug_assert!(
                group.len() < self.accs.max(2),
                "{} tiles, {} accumulators",
                group.len(),
                self.accs
            );
            let mut ops = Vec::new();
            let mut tiles = Vec::with_capacity(group.len());
            for &q in &group {
                let tile = s.tiles[q as usize];
                let _ = self.outprep.try_send(tile.block);
                let acc = count % self.accs;
                count += 1;
                // A tile resumed from its checkpoint continues at its next k-chunk; alpha,
                // beta and C0 entered in k-chunk 0 and are in the saved accumulator.
                let k0 = self.k0(q);
                ops.push(PlanOp::Begin {
                    acc,
                    c0: (self.has_c0 && k0 == 0).then_some(tile.block),
                    resume: (k0 > 0).then_some(tile),
                });
                tiles.push((tile, acc, k0));
            }
            // One tile: its k-chunks in order. A group: k-chunk by k-chunk across the tiles,
            // each tile's download as soon as its last GEMM is queued. Either way each tile
            // sums its k-chunks in the same order, so the bytes do not depend on grouping.
            let k_first = tiles.iter().map(|t| t.2).min().unwrap_or(0);
            let mut ended = vec![false; tiles.len()];
            for kk in k_first..s.gk {
                for (i, &(tile, acc, k0)) in tiles.iter().enumerate() {
                    if kk < k0 {
                        continue;
                    }
                    self.gemm_ops(&mut cache, tile, kk, acc, &mut ops);
                    if kk + 1 == s.gk {
                        ops.push(PlanOp::End { tile, acc });
                        ended[i] = true;
                    }
                }
            }
            for (i, &(tile, acc, _)) in tiles.iter().enumerate() {
                if !ended[i] {
                    ops.push(PlanOp::End { tile, acc });
                }
            }
            self.m.add_busy(t0.elapsed());
            for _ in &tiles {
                self.m.add_item(0);
            }
            for op in ops {
                ctl.send_timed(&self.out, op, &self.m)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backend::{Caps, MemorySpace};
    use crate::metrics::StageKind;
    use crate::plan::layout::Layout;

    /// A 300×190 · 190×520 step in 64² tiles (5 × 9 output tiles, 3 k-chunks) on a device
    /// with 1 GiB, and the planner's ops for it with the layout's start group or `group`, in
    /// serpentine order or (`grow`) growing squares.
    pub(crate) fn planner_ops(group: Option<usize>, grow: bool) -> (Schedule, Layout, Vec<PlanOp>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.toml");
        std::fs::write(
            &path,
            "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 300, cols = 190 }\n\
             [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 190, cols = 520 }\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n[engine]\ntile = 64\n",
        )
        .unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let caps = Caps {
            kind: "test",
            memory: MemorySpace::Device,
            tile_ladder: &[64],
            staging_depth: 4,
            extra_out_buf: true,
            auto_copies_from: usize::MAX,
            lanes: 1,
            device_memory: 1 << 30,
            narrow_slots: false,
            link_names: ("H2D", "D2H"),
            link_rate: None,
            peak_flops: |_, _, _| 1e12,
            peak_source: |_| "test",
        };
        let step = &plan.steps[0];
        let l = Layout::new(&plan.path, step, &plan.engine, &caps).unwrap();
        let sched = Schedule::new(step, &l);
        assert!(l.squares_fit(step, 1), "the fixture fits the device");
        let queue = TileQueue::new(&sched, (0..sched.tiles.len() as u32).collect(), 1, grow);
        let (tx, rx) = crossbeam_channel::unbounded();
        let (prep_tx, _prep_rx) = crossbeam_channel::unbounded();
        Planner {
            lane: 0,
            outprep: prep_tx,
            sched: &sched,
            queue: &queue,
            slots: l.slots,
            accs: l.accs.max(group.unwrap_or(0) + 1),
            start_group: group.unwrap_or(l.start_group),
            row_group: group.unwrap_or(l.row_group),
            alpha: 1.0,
            beta: 0.0,
            has_c0: false,
            ckpt: None,
            out: tx,
            m: StageMetrics::new(StageKind::Planner, 0, 1),
        }
        .run(&Control::new())
        .unwrap();
        let ops = rx.try_iter().collect();
        (sched, l, ops)
    }

    /// (tile seq, k-chunk) of every GEMM, in order.
    type Gemms = Vec<(u32, u64)>;

    /// Every GEMM's (tile seq, k-chunk), in order, and each End's position and tile.
    fn gemms_and_ends(ops: &[PlanOp]) -> (Gemms, Vec<(usize, u32)>) {
        let (mut g, mut e) = (Vec::new(), Vec::new());
        for (i, op) in ops.iter().enumerate() {
            match op {
                PlanOp::Gemm { tile, kk, .. } => g.push((tile.seq, *kk)),
                PlanOp::End { tile, .. } => e.push((i, tile.seq)),
                _ => {}
            }
        }
        (g, e)
    }

    /// The lane's first four tiles of row 0 go k-chunk by k-chunk (k-chunk 0 of all four, then
    /// 1, then 2), each tile's End right after its last GEMM, on four accumulators; every later
    /// tile runs its k-chunks in order on its own. Each tile's k-chunks are in order either way.
    #[test]
    fn a_start_group_runs_k_chunk_by_k_chunk() {
        let (sched, l, ops) = planner_ops(None, false);
        assert_eq!((l.start_group, l.accs), (4, 5), "{l:?}");
        let gk = sched.gk;
        assert_eq!(gk, 3);
        let begins: Vec<usize> = ops
            .iter()
            .take_while(|op| matches!(op, PlanOp::Begin { .. }))
            .map(|op| match op {
                PlanOp::Begin { acc, .. } => *acc,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(begins, vec![0, 1, 2, 3]);
        let (g, ends) = gemms_and_ends(&ops);
        assert_eq!(g.len() as u64, sched.tiles.len() as u64 * gk);
        let group: Vec<u32> = g[..4].iter().map(|x| x.0).collect();
        // Four distinct tiles of one row.
        let ti = sched.tiles[group[0] as usize].ti;
        let mut tj: Vec<u64> = group.iter().map(|&q| sched.tiles[q as usize].tj).collect();
        tj.sort_unstable();
        tj.dedup();
        assert!(group.iter().all(|&q| sched.tiles[q as usize].ti == ti) && tj.len() == 4);
        for kk in 0..gk {
            let chunk: Vec<(u32, u64)> = group.iter().map(|&q| (q, kk)).collect();
            assert_eq!(&g[4 * kk as usize..4 * (kk as usize + 1)], &chunk[..]);
        }
        // The group's Ends come after each tile's last GEMM and before the next tile's Begin.
        let pos = |want: &dyn Fn(&PlanOp) -> bool| ops.iter().position(want).unwrap();
        for &q in &group {
            let last = pos(
                &|op| matches!(op, PlanOp::Gemm { tile, kk, .. } if tile.seq == q && *kk == gk - 1),
            );
            let end = ends.iter().find(|e| e.1 == q).unwrap().0;
            assert_eq!(end, last + 1, "tile {q}");
        }
        // After the group: one tile at a time, its k-chunks in order.
        for w in g[4 * gk as usize..].chunks(gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
            assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        }
        // With the group off, the same tiles in the same order, each on its own.
        let (_, _, plain) = planner_ops(Some(1), false);
        let (pg, _) = gemms_and_ends(&plain);
        for w in pg.chunks(gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
        }
        let order = |g: &[(u32, u64)]| {
            let mut v: Vec<u32> = g.iter().map(|x| x.0).collect();
            v.dedup();
            v
        };
        assert_eq!(
            order(&pg),
            group
                .iter()
                .copied()
                .chain(order(&g[12..]))
                .collect::<Vec<_>>()
        );
    }

    /// In growing squares the start group is the first square: k-chunk 0 of (0,0), (0,1),
    /// (1,0), (1,1), then k-chunk 1 of them, …; every tile's k-chunks in order, every tile once.
    #[test]
    fn the_start_group_of_growing_squares_is_the_first_square() {
        let (sched, l, ops) = planner_ops(None, true);
        assert_eq!(l.start_group, 4);
        let (g, _) = gemms_and_ends(&ops);
        assert_eq!(g.len(), sched.tiles.len() * sched.gk as usize);
        let cell = |q: u32| (sched.tiles[q as usize].ti, sched.tiles[q as usize].tj);
        for kk in 0..sched.gk as usize {
            let chunk: Vec<((u64, u64), u64)> = g[4 * kk..4 * kk + 4]
                .iter()
                .map(|x| (cell(x.0), x.1))
                .collect();
            assert_eq!(
                chunk,
                [(0, 0), (0, 1), (1, 0), (1, 1)].map(|c| (c, kk as u64)),
            );
        }
        for w in g[12..].chunks(sched.gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
            assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        }
        let loads = ops
            .iter()
            .filter(|op| matches!(op, PlanOp::Load { .. }))
            .count() as u64;
        assert_eq!(loads, sched.gk * (5 + sched.gn));
    }

    /// A start group of nine in growing squares (fp64's, `Layout::try_square_group`) is the
    /// first 3×3 square in the squares' order, k-chunk by k-chunk; each k-chunk loads three A
    /// and three B tiles, after it every tile runs alone, and every tile is computed once with
    /// its k-chunks in order and every input tile loaded once.
    #[test]
    fn a_start_group_of_nine_is_the_first_three_by_three_square() {
        let (sched, _, ops) = planner_ops(Some(9), true);
        // Nine accumulators of their own, one per tile of the group.
        let accs: Vec<usize> = ops
            .iter()
            .filter_map(|op| match op {
                PlanOp::Begin { acc, .. } => Some(*acc),
                _ => None,
            })
            .take(9)
            .collect();
        let mut distinct = accs.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 9, "{accs:?}");
        let (g, ends) = gemms_and_ends(&ops);
        assert_eq!(g.len(), sched.tiles.len() * sched.gk as usize);
        let cell = |q: u32| (sched.tiles[q as usize].ti, sched.tiles[q as usize].tj);
        let square = [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (0, 2),
            (1, 2),
            (2, 0),
            (2, 1),
            (2, 2),
        ];
        for kk in 0..sched.gk as usize {
            let chunk: Vec<((u64, u64), u64)> = g[9 * kk..9 * kk + 9]
                .iter()
                .map(|x| (cell(x.0), x.1))
                .collect();
            assert_eq!(chunk, square.map(|c| (c, kk as u64)));
        }
        let group_gemms = 9 * sched.gk as usize;
        for w in g[group_gemms..].chunks(sched.gk as usize) {
            assert!(w.iter().all(|x| x.0 == w[0].0), "{w:?}");
            assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        }
        let mut seen: Vec<u32> = ends.iter().map(|e| e.1).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..sched.tiles.len() as u32).collect::<Vec<_>>());
        // The first k-chunk's loads: the three A and three B tiles of the square, nothing more.
        let first_gemm = ops
            .iter()
            .position(|op| matches!(op, PlanOp::Gemm { .. }))
            .unwrap();
        let nine_gemms = ops
            .iter()
            .enumerate()
            .filter(|(_, op)| matches!(op, PlanOp::Gemm { .. }))
            .nth(8)
            .unwrap()
            .0;
        let loads_in = |r: std::ops::Range<usize>| {
            ops[r]
                .iter()
                .filter(|op| matches!(op, PlanOp::Load { .. }))
                .count()
        };
        assert_eq!(
            loads_in(0..first_gemm),
            2,
            "A(0,0) and B(0,0) before the first GEMM"
        );
        assert_eq!(loads_in(0..nine_gemms), 6);
        let loads = loads_in(0..ops.len()) as u64;
        assert_eq!(loads, sched.gk * (5 + sched.gn));
    }
}
