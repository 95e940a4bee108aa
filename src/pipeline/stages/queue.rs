//! The output tiles still to compute, dealt to the lanes: each lane's planner pops its next tile
//! here ([`TileQueue::pop`]) and steals from another lane's run when its own is empty. Not a
//! stage: a queue behind a mutex, shared by the planners, held by the pipeline.

use crate::plan::schedule::Schedule;

/// Output tiles still to compute, dealt so that lanes run *in phase*.
///
/// Lane `l` gets the output rows `ti ≡ l (mod lanes)`, walked band by band (band `b` = rows
/// `b·lanes .. b·lanes + lanes`) in serpentine column order, the direction alternating by band.
/// So at any moment every lane works in the same tile column and needs the same B tiles at the
/// same time: the shared reader ([`SharedReads`]) reads each of them from the file once for all
/// lanes. Within a lane, consecutive tiles share their A row (kept in the device tile cache) and
/// the serpentine turn reuses the B tiles used last. With one lane this is the schedule's own
/// serpentine order. A lane whose run is empty steals from the back of the longest other run, so
/// a slower or busier device simply ends up with fewer tiles.
///
/// When a lane's device tile cache holds every input tile the lane needs
/// ([`crate::plan::layout::Layout::squares_fit`]) and every lane has as many bands to do (more
/// than one), each lane walks its bands (ranked from 0 among those it has to do) and columns in
/// growing squares instead: (0,0); (0,1), (1,0), (1,1); (0,2), (1,2), (2,0), (2,1), (2,2); … —
/// a new B column or A row every few tiles rather than a new B column for every tile of the
/// first row. Each input tile is still loaded once, but the loads spread over the step instead
/// of crowding its first row, where they outran the page-locking of the inputs (45000² fp64 on
/// one H200: the GPU idle 0.5 s in the step's first 1.2 s; 0.27 s and the step 2–4 % shorter in
/// squares, docs/decisions/0012-growing-squares.md). With as many bands each, the lanes walk the same sequence of
/// ranked (band, column) cells and stay in phase. Stealing takes the back of a run, which in
/// squares is a column of tiles in different A rows (each costing the thief `gk` A loads; in
/// serpentine order they share one); neither order's stealing is in the traffic model.
///
/// [`SharedReads`]: crate::pipeline::shared::SharedReads
pub(crate) struct TileQueue {
    order: Vec<u32>,
    grow: bool,
    runs: std::sync::Mutex<Vec<std::collections::VecDeque<u32>>>,
}

impl TileQueue {
    /// `todo`: schedule sequence numbers still to compute; `may_grow`: the lanes' tile caches
    /// hold all they need ([`crate::plan::layout::Layout::squares_fit`]), so growing squares
    /// (see above) are used when the lanes also have as many bands to do, more than one.
    pub(crate) fn new(sched: &Schedule, todo: Vec<u32>, lanes: usize, may_grow: bool) -> TileQueue {
        let lanes = lanes.max(1);
        // Each lane's bands among the tiles to do, ranked from 0.
        let mut bands = vec![std::collections::BTreeMap::<u64, u64>::new(); lanes];
        for &seq in &todo {
            let t = &sched.tiles[seq as usize];
            bands[(t.ti % lanes as u64) as usize].insert(t.ti / lanes as u64, 0);
        }
        for b in &mut bands {
            for (rank, v) in b.values_mut().enumerate() {
                *v = rank as u64;
            }
        }
        let grow = may_grow
            && sched.gn > 1
            && bands[0].len() > 1
            && bands.iter().all(|b| b.len() == bands[0].len());
        let mut keyed: Vec<(usize, u64, u64, u32)> = todo
            .iter()
            .map(|&seq| {
                let t = &sched.tiles[seq as usize];
                let lane = (t.ti % lanes as u64) as usize;
                let band = t.ti / lanes as u64;
                if grow {
                    // Square `s` = max(rank, column): its column part top-down, then its row
                    // part left to right.
                    let r = bands[lane][&band];
                    let s = r.max(t.tj);
                    let pos = if t.tj == s && r < s { r } else { s + t.tj };
                    return (lane, s, pos, seq);
                }
                let col = if band.is_multiple_of(2) {
                    t.tj
                } else {
                    sched.gn - 1 - t.tj
                };
                (lane, band, col, seq)
            })
            .collect();
        keyed.sort_unstable();
        let mut runs: Vec<std::collections::VecDeque<u32>> = vec![Default::default(); lanes];
        for &(lane, _, _, seq) in &keyed {
            runs[lane].push_back(seq);
        }
        TileQueue {
            order: todo,
            grow,
            runs: std::sync::Mutex::new(runs),
        }
    }
    pub(crate) fn pop(&self, lane: usize) -> Option<u32> {
        let mut runs = self.runs.lock().unwrap();
        if let Some(t) = runs[lane].pop_front() {
            return Some(t);
        }
        let victim = (0..runs.len()).max_by_key(|&i| runs[i].len())?;
        runs[victim].pop_back()
    }
    /// The lane's next tile if `pred` accepts it (never stolen from another lane).
    pub(crate) fn pop_if(&self, lane: usize, pred: impl Fn(u32) -> bool) -> Option<u32> {
        let mut runs = self.runs.lock().unwrap();
        let next = *runs[lane].front()?;
        pred(next).then(|| runs[lane].pop_front()).flatten()
    }
    /// Lane `lane`'s run as dealt (before any tile was taken or stolen).
    #[cfg(test)]
    pub(crate) fn run(&self, lane: usize) -> Vec<u32> {
        self.runs.lock().unwrap()[lane].iter().copied().collect()
    }
    /// Whether lanes walk their tiles in growing squares.
    pub(crate) fn grows(&self) -> bool {
        self.grow
    }
    /// The tiles to compute, in schedule order.
    pub(crate) fn order(&self) -> &[u32] {
        &self.order
    }
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::stages::planner::tests::planner_ops;
    use crate::plan::schedule::{OutTile, Src, TileCache};

    /// (band, column) of a lane's run.
    fn cells(sched: &Schedule, run: &[u32], lanes: u64) -> Vec<(u64, u64)> {
        run.iter()
            .map(|&q| {
                let t = &sched.tiles[q as usize];
                (t.ti / lanes, t.tj)
            })
            .collect()
    }

    /// Growing squares over a grid of `rows` × `cols` cells, written out square by square: the
    /// column part top-down, then the row part left to right.
    fn squares(rows: u64, cols: u64) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for s in 0..rows.max(cols) {
            v.extend((0..s).map(|b| (b, s)));
            v.extend((0..=s).map(|j| (s, j)));
        }
        v.retain(|&(b, j)| b < rows && j < cols);
        v
    }

    /// A schedule of `gm` × `gn` output tiles of 64² (the fixture's, with its tiles replaced).
    fn grid(sched: &Schedule, gm: u64, gn: u64) -> Schedule {
        let mut s = sched.clone();
        s.gn = gn;
        s.tiles = (0..gm)
            .flat_map(|ti| (0..gn).map(move |tj| (ti, tj)))
            .enumerate()
            .map(|(i, (ti, tj))| OutTile {
                seq: i as u32,
                ti,
                tj,
                block: crate::store::Block {
                    r0: ti * 64,
                    c0: tj * 64,
                    rows: 64,
                    cols: 64,
                },
            })
            .collect();
        s
    }

    /// In growing squares every tile comes once, in the order written out by [`squares`], and
    /// the loads are spread: with a cache that holds everything both orders load each input
    /// tile once, but the squares need fewer of them over the first row's worth of tiles.
    #[test]
    fn growing_squares_cover_every_tile_once_and_spread_the_loads() {
        let (sched, l, _) = planner_ops(None, false);
        let (gm, gn, gk) = (5u64, sched.gn, sched.gk);
        assert_eq!((gn, gk), (9, 3));
        let all: Vec<u32> = (0..sched.tiles.len() as u32).collect();
        let q = TileQueue::new(&sched, all.clone(), 1, true);
        assert!(q.grows());
        let sq = q.run(0);
        assert_eq!(cells(&sched, &sq, 1), squares(gm, gn));
        let loads = |run: &[u32], upto: usize| {
            let mut cache = TileCache::new(l.slots);
            let mut n = 0;
            for &q in &run[..upto] {
                let t = &sched.tiles[q as usize];
                for kk in 0..gk {
                    n += cache.get((Src::A, t.ti, kk)).1 as u64;
                    n += cache.get((Src::B, kk, t.tj)).1 as u64;
                }
            }
            n
        };
        let plain = TileQueue::new(&sched, all.clone(), 1, false);
        assert!(!plain.grows());
        let serp = plain.run(0);
        let n = all.len();
        assert_eq!(loads(&sq, n), gk * (gm + gn));
        assert_eq!(loads(&serp, n), gk * (gm + gn));
        // The first row's worth of tiles: the serpentine loads A's row and all of B, the
        // squares A's first three rows and B's first three columns.
        assert_eq!(loads(&serp, gn as usize), gk * (1 + gn));
        assert_eq!(loads(&sq, gn as usize), gk * (3 + 3));
        // One band, or one column: nothing to grow.
        let one_band: Vec<u32> = (0..gn as u32).collect();
        assert!(!TileQueue::new(&sched, one_band, 1, true).grows());
        let g1 = grid(&sched, 4, 1);
        assert!(!TileQueue::new(&g1, (0..4).collect(), 1, true).grows());
    }

    /// Lanes walk the same sequence of ranked (band, column) cells when they have as many bands
    /// to do — the whole grid, or a shard or resume that starts at any band — and keep the
    /// serpentine order when they have not.
    #[test]
    fn growing_squares_keep_lanes_in_phase_or_are_not_used() {
        let (sched, _, _) = planner_ops(None, false);
        let g = grid(&sched, 10, 7);
        let rows = |r: std::ops::Range<u64>| -> Vec<u32> {
            (r.start * 7..r.end * 7).map(|q| q as u32).collect()
        };
        // (tiles to do, lanes, squares expected, bands per lane)
        for (todo, lanes, grow, bands) in [
            (rows(0..10), 2, true, 5),
            (rows(2..10), 2, true, 4),
            (rows(3..7), 2, true, 2),
            (rows(0..5), 2, false, 0),
            (rows(0..9), 3, true, 3),
            (rows(1..10), 3, true, 3),
            (rows(0..10), 3, false, 0),
        ] {
            let n = todo.len();
            let q = TileQueue::new(&g, todo.clone(), lanes, true);
            assert_eq!(q.grows(), grow, "{todo:?} on {lanes} lanes");
            let runs: Vec<Vec<u32>> = (0..lanes).map(|l| q.run(l)).collect();
            assert_eq!(runs.iter().map(|r| r.len()).sum::<usize>(), n);
            let mut seen: Vec<u32> = runs.concat();
            seen.sort_unstable();
            assert_eq!(seen, todo);
            if grow {
                for (l, run) in runs.iter().enumerate() {
                    // Ranked bands: the lane's i-th band to do is rank i.
                    let ranked: Vec<(u64, u64)> = cells(&g, run, lanes as u64)
                        .into_iter()
                        .map(|(b, j)| {
                            let first = run.iter().map(|&q| g.tiles[q as usize].ti).min().unwrap();
                            (b - first / lanes as u64, j)
                        })
                        .collect();
                    assert_eq!(ranked, squares(bands, 7), "lane {l} of {lanes}");
                }
            }
        }
    }
}
