//! The input matrices of a step as the stages see them, with the counters they add to while
//! reading: shared by every lane's prefetch, staging and check stage.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::nonfinite::Nonfinite;
use crate::plan::schedule::Src;
use crate::store::MatrixSource;

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
    pub(crate) fn nonfinite_seen(&self) -> Vec<(Src, u64, Option<crate::store::Block>)> {
        [Src::A, Src::B, Src::C0]
            .into_iter()
            .map(|s| (s, self.nonfinite(s).get()))
            .filter(|(_, (n, _))| *n > 0)
            .map(|(s, (n, b))| {
                let flip = self.file(s).transposed();
                let b = b.map(|b| match flip {
                    false => b,
                    true => crate::store::Block {
                        r0: b.c0,
                        c0: b.r0,
                        rows: b.cols,
                        cols: b.rows,
                    },
                });
                (s, n, b)
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
