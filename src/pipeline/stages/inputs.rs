//! The input matrices of a step as the stages see them, with the counters they add to while
//! reading: shared by every lane's prefetch, staging and check stage.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::nonfinite::Nonfinite;
use crate::plan::schedule::Src;
use crate::store::{Block, MatrixSource};

/// The input matrices of a step.
pub(crate) struct Inputs {
    pub(crate) a: Arc<dyn MatrixSource>,
    pub(crate) b: Arc<dyn MatrixSource>,
    pub(crate) c0: Option<Arc<dyn MatrixSource>>,
    pub(crate) verify: bool,
    /// NaN/Inf values seen reading each input (A, B, C0), and the first block holding one.
    nonfinite: [Nonfinite; 3],
    /// Bytes staged from sources held in memory (a chain's intermediate), not from files.
    pub(crate) memory_bytes: AtomicU64,
    /// Bytes of directly uploaded blocks checked on the device that copied them.
    pub(crate) device_checked: AtomicU64,
}

impl Inputs {
    pub(crate) fn new(
        a: Arc<dyn MatrixSource>,
        b: Arc<dyn MatrixSource>,
        c0: Option<Arc<dyn MatrixSource>>,
        verify: bool,
    ) -> Inputs {
        Inputs {
            a,
            b,
            c0,
            verify,
            nonfinite: Default::default(),
            memory_bytes: AtomicU64::new(0),
            device_checked: AtomicU64::new(0),
        }
    }
    /// Where the inputs come from, as the summary says it: "files" (a chain's intermediate
    /// held in memory counts as one: its bytes are told apart on their own), "arrays" (handed
    /// in by the caller) or "files and arrays".
    pub(crate) fn origin(&self) -> &'static str {
        let all = [Some(&self.a), Some(&self.b), self.c0.as_ref()];
        let arrays = all.iter().flatten().filter(|s| !s.is_file()).count();
        match arrays {
            0 => "files",
            n if n == all.iter().flatten().count() => "arrays",
            _ => "files and arrays",
        }
    }
    /// The NaN/Inf tally of input `s`.
    pub(crate) fn nonfinite(&self, s: Src) -> &Nonfinite {
        &self.nonfinite[s as usize]
    }
    /// Each input's NaN/Inf tally: (input, values, first block holding one), inputs with
    /// none left out. The block is in the matrix's own rows and columns — as numpy indexes a
    /// Fortran-order `.npy`, whose source's blocks are of the stored transpose.
    pub(crate) fn nonfinite_seen(&self) -> Vec<NonfiniteSeen> {
        [Src::A, Src::B, Src::C0]
            .into_iter()
            .map(|s| (s, self.nonfinite(s).get()))
            .filter(|(_, (n, _))| *n > 0)
            .map(|(s, (n, b))| {
                let f = self.file(s);
                let at = b.and_then(|b| first_nonfinite(f, &b));
                let (b, at) = match f.transposed() {
                    false => (b, at),
                    true => (
                        b.map(|b| Block {
                            r0: b.c0,
                            c0: b.r0,
                            rows: b.cols,
                            cols: b.rows,
                        }),
                        at.map(|(r, c)| (c, r)),
                    ),
                };
                NonfiniteSeen {
                    src: s,
                    values: n,
                    block: b,
                    at,
                }
            })
            .collect()
    }
    pub(crate) fn file(&self, s: Src) -> &dyn MatrixSource {
        match s {
            Src::A => &*self.a,
            Src::B => &*self.b,
            Src::C0 => &**self
                .c0
                .as_ref()
                .expect("C0 is only requested when the step has one"),
        }
    }
}

/// What a step saw of one input's NaN/Inf: how many, the first block holding one, and where in
/// it the first is (in the matrix's own rows and columns; `None` where only the conversion to
/// the computed type made one, as a value past fp16's range).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NonfiniteSeen {
    pub(crate) src: Src,
    pub(crate) values: u64,
    pub(crate) block: Option<Block>,
    pub(crate) at: Option<(u64, u64)>,
}

/// The first NaN/Inf of block `b` of `f` in row-major order (stored rows and columns), read a
/// row at a time once the step is over, so that the note names the element and not a block of
/// the whole matrix (a new user's trial: "the first in rows 0–699, columns 0–299").
fn first_nonfinite(f: &dyn MatrixSource, b: &Block) -> Option<(u64, u64)> {
    let dt = f.dtype().compute();
    let mut row = vec![0u8; b.cols as usize * dt.size()];
    for r in b.r0..b.r0 + b.rows {
        let one = Block {
            r0: r,
            rows: 1,
            ..*b
        };
        f.read_block(&one, dt, &mut row).ok()?;
        if crate::dtype::count_nonfinite(dt, &row) == 0 {
            continue;
        }
        let j = row
            .chunks_exact(dt.size())
            .position(|e| crate::dtype::count_nonfinite(dt, e) > 0)?;
        return Some((r, b.c0 + j as u64));
    }
    None
}
