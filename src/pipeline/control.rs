//! Cancellation, stopping and the first error, shared by every stage of a run.
//!
//! The first stage to fail records its error and cancels; every blocking operation in the
//! pipeline (channel send/receive, pool lease) also waits on the cancel channel, so no thread
//! stays blocked once a run is failing. Later errors (usually "cancelled" or a disconnected
//! channel, consequences of the first) are dropped: the first one is the one reported.
//!
//! A stop asked from outside (Ctrl-C, SIGTERM, a library caller's flag) is gentler: [`stop`]
//! tells the lanes, which hand on the tiles they finished, send the accumulators of the tiles
//! they are in the middle of to be saved as checkpoints, let go of their channel to writeback
//! and from then on only discard what upstream still sends them (so no stage upstream fails on
//! a closed channel). Writeback and sync, not cancelled, write and record all of it and end
//! once every lane has let go ([`Control::output_done`]); then (or once a grace period is over)
//! the run is cancelled as before.
//!
//! [`stop`]: Control::stop

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crossbeam_channel::{select, Receiver, Sender};

use crate::error::{Error, Result};

pub(crate) struct Control {
    cancelled: AtomicBool,
    tx: Mutex<Option<Sender<()>>>,
    rx: Receiver<()>,
    first: Mutex<Option<Error>>,
    stopping: AtomicBool,
    /// Disconnected when a stop is asked: wakes a lane waiting for its next op.
    stop_tx: Mutex<Option<Sender<()>>>,
    stop_rx: Receiver<()>,
    /// Set when the last output stage (sync) has ended.
    output_done: AtomicBool,
}

impl Default for Control {
    fn default() -> Self {
        Self::new()
    }
}

impl Control {
    pub(crate) fn new() -> Control {
        let (tx, rx) = crossbeam_channel::bounded(0);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        Control {
            cancelled: AtomicBool::new(false),
            tx: Mutex::new(Some(tx)),
            rx,
            first: Mutex::new(None),
            stopping: AtomicBool::new(false),
            stop_tx: Mutex::new(Some(stop_tx)),
            stop_rx,
            output_done: AtomicBool::new(false),
        }
    }

    /// Ask the run to stop: the lanes save what they hold and end, then the run is cancelled.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.stop_tx.lock().unwrap().take();
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The last output stage (sync) has ended: everything the lanes sent is written and
    /// recorded.
    pub(crate) fn output_done(&self) {
        self.output_done.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_output_done(&self) -> bool {
        self.output_done.load(Ordering::SeqCst)
    }

    /// A lane's wait for its next op: `Ok(Some(op))`, `Ok(None)` when nothing came within `d`
    /// (`None`: wait as long as it takes), `Err(())` when upstream is finished, the run is
    /// cancelled or a stop is asked.
    pub(crate) fn recv_lane<T>(
        &self,
        rx: &Receiver<T>,
        d: Option<std::time::Duration>,
    ) -> std::result::Result<Option<T>, ()> {
        if self.is_cancelled() || self.is_stopping() {
            return Err(());
        }
        let timeout = match d {
            Some(d) => crossbeam_channel::after(d),
            None => crossbeam_channel::never(),
        };
        select! {
            recv(rx) -> r => r.map(Some).map_err(|_| ()),
            recv(self.rx) -> _ => Err(()),
            recv(self.stop_rx) -> _ => Err(()),
            recv(timeout) -> _ => Ok(None),
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
