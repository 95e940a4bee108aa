//! A fixed pool of host buffers, allocated once from the plan's byte budget.
//!
//! Stages lease a buffer (blocking when none is free — that is the backpressure) and the buffer
//! goes back to the pool when the lease is dropped, wherever that happens. The pool counts how
//! many buffers were ever out at once, so tests can assert that staged memory never exceeded
//! the budget.
//!
//! A lazy pool ([`Pool::lazy`]) hands out the same number of leases, but a lease gets memory
//! only when its holder asks ([`Lease::materialize`]), and keeps it for the next holder. The
//! staging pool is lazy when every input block is expected to go straight from the files'
//! pages ([`super::direct`]): its leases are then only tokens that bound the blocks in flight,
//! and the 1.5 GiB of page-locked buffers a 32768² step would allocate (and free: a process
//! holding 2.25 GiB of registered memory took 0.15–0.18 s longer to end on the H200,
//! docs/measurements/2026-12-02c-h200-1-*.log) are not made unless a block is copied after all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{select, Receiver, Sender};

use super::control::Control;
use crate::backend::{HostAlloc, HostBuf};
use crate::error::{Error, Result};

struct Inner {
    name: &'static str,
    /// Free leases with a buffer.
    free_tx: Sender<HostBuf>,
    free_rx: Receiver<HostBuf>,
    /// Free leases of a lazy pool without one yet: kept apart, so that a copy takes a lease
    /// with memory first and a token one without (else tokens would cycle the buffers made and
    /// every copy would make another).
    empty_tx: Sender<()>,
    empty_rx: Receiver<()>,
    buf_bytes: usize,
    count: usize,
    out: AtomicUsize,
    high_water: AtomicUsize,
    /// Where a lazy pool's buffers come from; `None` for a pool allocated up front.
    lazy: Option<Arc<dyn HostAlloc>>,
    /// Buffers allocated so far.
    allocated: AtomicUsize,
}

#[derive(Clone)]
pub(crate) struct Pool(Arc<Inner>);

pub(crate) struct Lease {
    /// The lease's buffer (`None`: a lazy pool's lease not yet given memory).
    buf: Option<HostBuf>,
    /// Still out (false once given back in `drop`).
    held: bool,
    pool: Arc<Inner>,
}

impl Pool {
    pub(crate) fn new(
        name: &'static str,
        alloc: &dyn HostAlloc,
        count: usize,
        buf_bytes: usize,
    ) -> Result<Pool> {
        let pool = Self::empty(name, count, buf_bytes, None);
        // Several at once: populating fresh pages is per-thread work in the kernel.
        use rayon::prelude::*;
        let bufs = (0..count)
            .into_par_iter()
            .map(|_| alloc.alloc_host(buf_bytes))
            .collect::<Result<Vec<HostBuf>>>()?;
        pool.0.allocated.store(count, Ordering::SeqCst);
        for b in bufs {
            pool.0
                .free_tx
                .send(b)
                .expect("pool channel has room for every buffer");
        }
        Ok(pool)
    }

    /// `count` leases of `buf_bytes` whose buffers are allocated from `alloc` only when a
    /// holder asks for one ([`Lease::materialize`]); see the module doc.
    pub(crate) fn lazy(
        name: &'static str,
        alloc: Arc<dyn HostAlloc>,
        count: usize,
        buf_bytes: usize,
    ) -> Pool {
        let pool = Self::empty(name, count, buf_bytes, Some(alloc));
        for _ in 0..count {
            pool.0
                .empty_tx
                .send(())
                .expect("pool channel has room for every lease");
        }
        pool
    }

    fn empty(
        name: &'static str,
        count: usize,
        buf_bytes: usize,
        lazy: Option<Arc<dyn HostAlloc>>,
    ) -> Pool {
        let (free_tx, free_rx) = crossbeam_channel::bounded(count);
        let (empty_tx, empty_rx) = crossbeam_channel::bounded(count);
        Pool(Arc::new(Inner {
            name,
            free_tx,
            free_rx,
            empty_tx,
            empty_rx,
            buf_bytes,
            count,
            out: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
            lazy,
            allocated: AtomicUsize::new(0),
        }))
    }

    fn wrap(&self, b: Option<HostBuf>) -> Lease {
        let n = self.0.out.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.high_water.fetch_max(n, Ordering::SeqCst);
        Lease {
            buf: b,
            held: true,
            pool: self.0.clone(),
        }
    }

    /// Take a free lease, waiting for one; `Err(Cancelled)` if the run is cancelled. A lease
    /// with a buffer comes first, unless `token` (the holder needs no memory).
    pub(crate) fn lease_as(&self, ctl: &Control, token: bool) -> Result<Lease> {
        if let Some(l) = self.try_lease_as(token) {
            return Ok(l);
        }
        select! {
            recv(self.0.free_rx) -> b => Ok(self.wrap(Some(b.expect("pool keeps a sender")))),
            recv(self.0.empty_rx) -> e => {
                e.expect("pool keeps a sender");
                Ok(self.wrap(None))
            }
            recv(ctl.signal()) -> _ => Err(Error::Cancelled),
        }
    }

    /// Take a free lease if one is available now (with a buffer first, unless `token`).
    pub(crate) fn try_lease_as(&self, token: bool) -> Option<Lease> {
        let full = || self.0.free_rx.try_recv().ok().map(|b| self.wrap(Some(b)));
        let empty = || self.0.empty_rx.try_recv().ok().map(|()| self.wrap(None));
        match token {
            false => full().or_else(empty),
            true => empty().or_else(full),
        }
    }

    /// [`Self::try_lease_as`] for a holder that needs the memory.
    #[cfg(test)]
    pub(crate) fn try_lease(&self) -> Option<Lease> {
        self.try_lease_as(false)
    }

    pub(crate) fn name(&self) -> &'static str {
        self.0.name
    }
    pub(crate) fn buf_bytes(&self) -> usize {
        self.0.buf_bytes
    }
    pub(crate) fn count(&self) -> usize {
        self.0.count
    }
    /// Most buffers ever leased at once.
    pub(crate) fn high_water(&self) -> usize {
        self.0.high_water.load(Ordering::SeqCst)
    }
    /// Buffers given memory so far (all of them, unless the pool is lazy).
    pub(crate) fn allocated(&self) -> usize {
        self.0.allocated.load(Ordering::SeqCst)
    }
    /// Whether leases get memory only when asked ([`Pool::lazy`]).
    pub(crate) fn is_lazy(&self) -> bool {
        self.0.lazy.is_some()
    }
}

impl Lease {
    /// The buffer; a lease of a lazy pool has one only after [`Self::materialize`].
    pub(crate) fn buf(&self) -> &HostBuf {
        self.buf
            .as_ref()
            .expect("a lease holds a buffer once materialized")
    }
    pub(crate) fn buf_mut(&mut self) -> &mut HostBuf {
        self.buf
            .as_mut()
            .expect("a lease holds a buffer once materialized")
    }
    /// The buffer, allocating it first if this lease (of a lazy pool) has none yet; it stays
    /// with the lease's slot for later holders.
    pub(crate) fn materialize(&mut self) -> Result<&mut HostBuf> {
        if self.buf.is_none() {
            let alloc = (self.pool.lazy.as_ref())
                .expect("only a lazy pool hands out leases without a buffer");
            self.buf = Some(alloc.alloc_host(self.pool.buf_bytes)?);
            self.pool.allocated.fetch_add(1, Ordering::SeqCst);
        }
        Ok(self.buf_mut())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if std::mem::take(&mut self.held) {
            self.pool.out.fetch_sub(1, Ordering::SeqCst);
            // The pool's channels hold exactly `count` leases, so this never blocks; if the
            // pool itself is gone the buffer is simply freed.
            let _ = match self.buf.take() {
                Some(b) => self.pool.free_tx.try_send(b).map_err(|_| ()),
                None => self.pool.empty_tx.try_send(()).map_err(|_| ()),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeapAlloc;

    /// A lazy pool hands out as many leases as an eager one, gives a lease memory only when
    /// asked, and keeps that memory with the slot for later holders.
    #[test]
    fn a_lazy_pool_allocates_only_what_is_asked_for_and_keeps_it() {
        let p = Pool::lazy("staging", Arc::new(HeapAlloc), 3, 4096);
        assert!(p.is_lazy() && p.allocated() == 0);
        let mut a = p.try_lease().unwrap();
        let b = p.try_lease().unwrap();
        let c = p.try_lease().unwrap();
        assert!(
            p.try_lease().is_none(),
            "three leases, as many as an eager pool's buffers"
        );
        assert_eq!((p.high_water(), p.allocated()), (3, 0));
        a.materialize().unwrap().bytes_mut()[..4].copy_from_slice(b"tile");
        assert_eq!(p.allocated(), 1);
        assert_eq!(
            a.materialize().unwrap().bytes().len(),
            4096,
            "the same buffer again"
        );
        assert_eq!(p.allocated(), 1);
        drop((a, b, c));
        // The slot that got memory comes back with it: a token takes a lease without memory,
        // a holder that needs memory the one with it, so copies reuse buffers already made.
        let t = p.try_lease_as(true).unwrap();
        assert!(t.buf.is_none());
        let mut m = p.try_lease().unwrap();
        assert!(m.buf.is_some());
        m.materialize().unwrap();
        assert_eq!(p.allocated(), 1, "reused, not made again");
        drop((t, m));
        let mut again: Vec<Lease> = (0..3).map(|_| p.try_lease().unwrap()).collect();
        assert_eq!(again.iter().filter(|l| l.buf.is_some()).count(), 1);
        for l in &mut again {
            l.materialize().unwrap();
        }
        assert_eq!(p.allocated(), 3);
        assert_eq!(p.high_water(), 3);
        let eager = Pool::new("output", &HeapAlloc, 2, 64).unwrap();
        assert!(!eager.is_lazy() && eager.allocated() == 2);
        assert_eq!(eager.try_lease().unwrap().buf().bytes().len(), 64);
    }
}
