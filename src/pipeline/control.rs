//! Cancellation and the first error, shared by every stage of a run.
//!
//! The first stage to fail records its error and cancels; every blocking operation in the
//! pipeline (channel send/receive, pool lease) also waits on the cancel channel, so no thread
//! stays blocked once a run is failing. Later errors (usually "cancelled" or a disconnected
//! channel, consequences of the first) are dropped: the first one is the one reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crossbeam_channel::{select, Receiver, Sender};

use crate::error::{Error, Result};

pub(crate) struct Control {
    cancelled: AtomicBool,
    tx: Mutex<Option<Sender<()>>>,
    rx: Receiver<()>,
    first: Mutex<Option<Error>>,
}

impl Default for Control {
    fn default() -> Self {
        Self::new()
    }
}

impl Control {
    pub(crate) fn new() -> Control {
        let (tx, rx) = crossbeam_channel::bounded(0);
        Control {
            cancelled: AtomicBool::new(false),
            tx: Mutex::new(Some(tx)),
            rx,
            first: Mutex::new(None),
        }
    }

    /// Record `e` if it is the first real error, then cancel everything.
    pub(crate) fn fail(&self, e: Error) {
        if !matches!(e, Error::Cancelled) {
            let mut f = self.first.lock().unwrap();
            if f.is_none() {
                *f = Some(e);
            }
        }
        self.cancel();
    }

    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.tx.lock().unwrap().take();
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// A receiver that becomes ready (disconnected) when the run is cancelled.
    pub(crate) fn signal(&self) -> &Receiver<()> {
        &self.rx
    }

    pub(crate) fn take_error(&self) -> Option<Error> {
        self.first.lock().unwrap().take()
    }

    /// Run a stage body; on error record it and cancel.
    pub(crate) fn guard(&self, body: impl FnOnce() -> Result<()>) {
        if let Err(e) = body() {
            self.fail(e);
        }
    }

    /// Blocking send that gives up on cancellation or a closed receiver.
    pub(crate) fn send<T>(&self, tx: &Sender<T>, msg: T) -> Result<()> {
        select! {
            send(tx, msg) -> r => r.map_err(|_| Error::Cancelled),
            recv(self.rx) -> _ => Err(Error::Cancelled),
        }
    }

    /// `recv`, counting the time blocked as the stage's wait for input.
    pub(crate) fn recv_timed<T>(
        &self,
        rx: &Receiver<T>,
        m: &crate::metrics::StageMetrics,
    ) -> Option<T> {
        let t = std::time::Instant::now();
        let r = self.recv(rx);
        m.add_wait_in(t.elapsed());
        r
    }

    /// `send`, counting the time blocked as the stage's wait for room downstream.
    pub(crate) fn send_timed<T>(
        &self,
        tx: &Sender<T>,
        msg: T,
        m: &crate::metrics::StageMetrics,
    ) -> Result<()> {
        let t = std::time::Instant::now();
        let r = self.send(tx, msg);
        m.add_wait_out(t.elapsed());
        r
    }

    /// `recv` for at most `d`: `Ok(None)` when nothing came in that time, `Err(())` when
    /// upstream is finished or the run is cancelled.
    pub(crate) fn recv_within<T>(
        &self,
        rx: &Receiver<T>,
        d: std::time::Duration,
    ) -> std::result::Result<Option<T>, ()> {
        if self.is_cancelled() {
            return Err(());
        }
        select! {
            recv(rx) -> r => r.map(Some).map_err(|_| ()),
            recv(self.rx) -> _ => Err(()),
            default(d) => Ok(None),
        }
    }

    /// Blocking receive: `None` when upstream is finished or the run is cancelled.
    pub(crate) fn recv<T>(&self, rx: &Receiver<T>) -> Option<T> {
        if self.is_cancelled() {
            return None;
        }
        select! {
            recv(rx) -> r => r.ok(),
            recv(self.rx) -> _ => None,
        }
    }
}
