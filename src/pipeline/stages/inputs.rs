//! The input matrices of a step as the stages see them, with the counters they add to while
//! reading: shared by every lane's prefetch, staging and check stage.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::plan::schedule::Src;
use crate::store::MatrixSource;

/// The input matrices of a step.
pub(crate) struct Inputs {
    pub(crate) a: Arc<dyn MatrixSource>,
    pub(crate) b: Arc<dyn MatrixSource>,
    pub(crate) c0: Option<Arc<dyn MatrixSource>>,
    pub(crate) verify: bool,
    pub(crate) nonfinite: AtomicU64,
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
            nonfinite: AtomicU64::new(0),
            memory_bytes: AtomicU64::new(0),
            device_checked: AtomicU64::new(0),
        }
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
