//! A fixed pool of host buffers, allocated once from the plan's byte budget.
//!
//! Stages lease a buffer (blocking when none is free — that is the backpressure) and the buffer
//! goes back to the pool when the lease is dropped, wherever that happens. The pool counts how
//! many buffers were ever out at once, so tests can assert that staged memory never exceeded
//! the budget.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{select, Receiver, Sender};

use super::control::Control;
use crate::backend::{HostAlloc, HostBuf};
use crate::error::{Error, Result};

struct Inner {
    name: &'static str,
    free_tx: Sender<HostBuf>,
    free_rx: Receiver<HostBuf>,
    buf_bytes: usize,
    count: usize,
    out: AtomicUsize,
    high_water: AtomicUsize,
}

#[derive(Clone)]
pub(crate) struct Pool(Arc<Inner>);

pub(crate) struct Lease {
    buf: Option<HostBuf>,
    pool: Arc<Inner>,
}

impl Pool {
    pub(crate) fn new(
        name: &'static str,
        alloc: &dyn HostAlloc,
        count: usize,
        buf_bytes: usize,
    ) -> Result<Pool> {
        let (free_tx, free_rx) = crossbeam_channel::bounded(count);
        let pool = Pool(Arc::new(Inner {
            name,
            free_tx,
            free_rx,
            buf_bytes,
            count,
            out: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
        }));
        // Several at once: populating fresh pages is per-thread work in the kernel.
        use rayon::prelude::*;
        let bufs = (0..count)
            .into_par_iter()
            .map(|_| alloc.alloc_host(buf_bytes))
            .collect::<Result<Vec<HostBuf>>>()?;
        for b in bufs {
            pool.0
                .free_tx
                .send(b)
                .expect("pool channel has room for every buffer");
        }
        Ok(pool)
    }

    fn wrap(&self, b: HostBuf) -> Lease {
        let n = self.0.out.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.high_water.fetch_max(n, Ordering::SeqCst);
        Lease {
            buf: Some(b),
            pool: self.0.clone(),
        }
    }

    /// Take a free buffer, waiting for one; `Err(Cancelled)` if the run is cancelled.
    pub(crate) fn lease(&self, ctl: &Control) -> Result<Lease> {
        select! {
            recv(self.0.free_rx) -> b => Ok(self.wrap(b.expect("pool keeps a sender"))),
            recv(ctl.signal()) -> _ => Err(Error::Cancelled),
        }
    }

    /// Take a free buffer if one is available now.
    pub(crate) fn try_lease(&self) -> Option<Lease> {
        self.0.free_rx.try_recv().ok().map(|b| self.wrap(b))
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
}

impl Lease {
    pub(crate) fn buf(&self) -> &HostBuf {
        self.buf
            .as_ref()
            .expect("lease holds a buffer until dropped")
    }
    pub(crate) fn buf_mut(&mut self) -> &mut HostBuf {
        self.buf
            .as_mut()
            .expect("lease holds a buffer until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.out.fetch_sub(1, Ordering::SeqCst);
            // The pool's channel holds exactly `count` buffers, so this never blocks; if the
            // pool itself is gone the buffer is simply freed.
            let _ = self.pool.free_tx.try_send(b);
        }
    }
}
