//! Where `verify`'s dense pass runs: a device opened once per command
//! ([`crate::backend::fold`]), on a thread of its own so that the driver's start (0.3–0.5 s of
//! `cuInit` on the H200 machines, docs/GPU.md) overlaps the first scatter pass, which needs
//! no device.
//!
//! A device that fails — an error while it is prepared or computes, or sums of its first or
//! last band that are not the CPU's — is let go and the passes run on the CPU from then on;
//! [`Device::used`] names what computed them and why the device stopped, for the report. It
//! also keeps the page-locked host buffers made for the next dense pass ([`Staging`]).

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::backend::fold::{self, FoldDevice};
use crate::plan::Engine;

type Opened = crate::error::Result<Option<Box<dyn FoldDevice>>>;

/// How long a check waits for its GPU to open before it goes on without it (`cuInit` and a
/// context take 0.3–0.7 s on the H200 machines; a driver that hangs would hang `verify`).
const OPEN_WAIT: Duration = Duration::from_secs(60);

enum Slot {
    /// No device: the CPU computes.
    Cpu,
    /// Being opened, on a thread of its own.
    Opening(Receiver<Opened>),
    Ready(Box<dyn FoldDevice>),
    /// In use by a pass.
    Busy,
}

/// The two host buffers a dense pass on a device reads its bands into, made and page-locked
/// by [`crate::verify::pass::prepare`] while the pass over op(B) runs (two 128 MiB buffers
/// took 170–192 ms to make and lock at the start of the dense pass on one H100,
/// docs/measurements/2026-12-06f-h100-2-verify-sampled-checks.log), handed to the pass that
/// follows. Locked by the device they are kept with, which lets go of them (`unpin`) before
/// they are freed.
pub(crate) struct Staging {
    pub(crate) bufs: [crate::backend::HostBuf; 2],
    /// f32 elements of each.
    pub(crate) elems: usize,
}

/// The device of one `verify` command (every step, every pass).
pub(crate) struct Device {
    /// (Dropped before `staging`: a device lets go of what it locked as it is dropped, and the
    /// buffers may be freed only then.)
    slot: Mutex<Slot>,
    /// Host buffers made ready for the next dense pass, if any.
    staging: Mutex<Option<Staging>>,
    /// Devices that computed a pass, and why a device stopped being used.
    used: Mutex<(Vec<String>, Option<String>)>,
}

impl Device {
    /// No device: every pass on the CPU.
    pub(crate) fn cpu() -> Device {
        Device {
            slot: Mutex::new(Slot::Cpu),
            staging: Mutex::new(None),
            used: Mutex::new((Vec::new(), None)),
        }
    }

    /// The device `engine.backend` names, opening in the background: nothing for `cpu`, nor
    /// for f64 precisions, whose checks sum f64 data in double-double on the CPU.
    pub(crate) fn open(engine: &Engine) -> Device {
        let d = Device::cpu();
        if engine.backend != crate::plan::BackendKind::Cpu && !engine.precision.is_f64() {
            let engine = engine.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            let h = std::thread::Builder::new()
                .name("mgmm-verify-device".into())
                .spawn(move || {
                    let t = std::time::Instant::now();
                    let d = fold::open(&engine);
                    crate::trace::span("verify", "open the GPU", t, std::time::Instant::now());
                    let _ = tx.send(d);
                });
            match h {
                Ok(_) => *lock(&d.slot) = Slot::Opening(rx),
                Err(e) => d.note(format!("no thread to open a GPU ({e}); checked on the CPU")),
            }
        }
        d
    }

    /// Whether a device may compute the passes (one is open, or opening and not yet known to
    /// have failed), without waiting: no host buffers are made for a device on a machine
    /// where none opened.
    pub(crate) fn may_have_device(&self) -> bool {
        let mut s = lock(&self.slot);
        if let Slot::Opening(rx) = &*s {
            if let Ok(r) = rx.try_recv() {
                self.settle(&mut s, r);
            }
        }
        !matches!(&*s, Slot::Cpu)
    }

    /// `s` as the opening's result `r` leaves it: the device, or the CPU (and why, for an error).
    fn settle(&self, s: &mut Slot, r: Opened) {
        *s = match r {
            Ok(Some(d)) => Slot::Ready(d),
            Ok(None) => Slot::Cpu,
            Err(e) => {
                self.note(format!("no GPU for the check ({e}); checked on the CPU"));
                Slot::Cpu
            }
        };
    }

    /// Whether a device computes the passes (waiting for it to open).
    pub(crate) fn present(&self) -> bool {
        let mut s = lock(&self.slot);
        self.opened(&mut s);
        matches!(&*s, Slot::Ready(_) | Slot::Busy)
    }

    /// The device for a pass (waiting for it to open), to be handed back with
    /// [`Device::give_back`] or let go with [`Device::fail`]; `None` when passes run on the CPU.
    pub(crate) fn take(&self) -> Option<Box<dyn FoldDevice>> {
        let mut s = lock(&self.slot);
        self.opened(&mut s);
        match std::mem::replace(&mut *s, Slot::Busy) {
            Slot::Ready(d) => Some(d),
            other => {
                *s = other;
                None
            }
        }
    }

    /// Wait for a device being opened (at most [`OPEN_WAIT`]), then `s` says what there is.
    fn opened(&self, s: &mut Slot) {
        if let Slot::Opening(_) = &*s {
            let Slot::Opening(rx) = std::mem::replace(s, Slot::Cpu) else {
                unreachable!()
            };
            match rx.recv_timeout(OPEN_WAIT) {
                Ok(r) => self.settle(s, r),
                Err(RecvTimeoutError::Disconnected) => {
                    self.note("opening the GPU panicked; checked on the CPU".into())
                }
                // A driver that hangs: the check does not wait for it (its thread is left).
                Err(RecvTimeoutError::Timeout) => self.note(format!(
                    "the GPU did not open within {} s; checked on the CPU",
                    OPEN_WAIT.as_secs()
                )),
            }
        }
    }

    /// A device back after a pass it computed (`computed`: the pass is its, and the step's
    /// report names it).
    pub(crate) fn give_back(&self, d: Box<dyn FoldDevice>, computed: bool) {
        if computed {
            let mut u = lock(&self.used);
            let name = d.name();
            if !u.0.contains(&name) {
                u.0.push(name);
            }
        }
        *lock(&self.slot) = Slot::Ready(d);
    }

    /// Keep `s` (locked by the device) for the next dense pass.
    pub(crate) fn keep_staging(&self, s: Staging) {
        *lock(&self.staging) = Some(s);
    }

    /// [`Device::keep_staging`], or nothing for `None`.
    pub(crate) fn keep_staging_opt(&self, s: Option<Staging>) {
        if let Some(s) = s {
            self.keep_staging(s);
        }
    }

    /// The buffers [`Device::keep_staging`] kept, if any.
    pub(crate) fn take_staging(&self) -> Option<Staging> {
        lock(&self.staging).take()
    }

    /// Device `name` failed (`why`): passes run on the CPU from now on.
    pub(crate) fn fail(&self, name: &str, why: String) {
        *lock(&self.slot) = Slot::Cpu;
        let mut u = lock(&self.used);
        u.1 = Some(format!(
            "{name} was not used after an error ({why}); the check ran on the CPU"
        ));
    }

    fn note(&self, why: String) {
        lock(&self.used).1.get_or_insert(why);
    }

    /// What computed the dense passes so far ("cpu" when no device did), and why a device
    /// was not used, if one was asked for and failed.
    pub(crate) fn used(&self) -> (String, Option<String>) {
        let u = lock(&self.used);
        let on = match u.0.is_empty() {
            true => "cpu".to_string(),
            false => u.0.join(", "),
        };
        (on, u.1.clone())
    }

    /// Start counting what computes the passes afresh (a new step).
    pub(crate) fn new_step(&self) {
        lock(&self.used).0.clear();
    }

    /// A device given directly (tests: a device that fails on purpose).
    #[cfg(test)]
    pub(crate) fn with(d: Box<dyn FoldDevice>) -> Device {
        let dev = Device::cpu();
        *lock(&dev.slot) = Slot::Ready(d);
        dev
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
