//! Running engine work from Python: the work runs on its own thread with the GIL released,
//! while the calling thread wakes every 50 ms to deliver progress to Python, check for Ctrl-C
//! (`PyErr_CheckSignals`) and the caller's cancel event. Either sets the engine's cancel flag;
//! the pipeline stops within a few tens of milliseconds, leaving its journal resumable, and the
//! call raises `KeyboardInterrupt` (or `CancelledError`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mgmm_stream::progress::{Progress, ProgressListener, Update};
use pyo3::prelude::*;

/// What the engine reported, queued for the Python thread.
enum Event {
    Note(String),
    Update(Update),
}

/// Collects progress from the engine's reporter thread (never calls Python itself).
#[derive(Default)]
pub struct Queue(Mutex<Vec<Event>>);

impl ProgressListener for Queue {
    fn note(&self, msg: &str) {
        self.0.lock().unwrap().push(Event::Note(msg.to_string()));
    }
    fn update(&self, u: &Update) {
        self.0.lock().unwrap().push(Event::Update(u.clone()));
    }
}

/// How a call reports progress and can be cancelled.
pub struct Watch<'py> {
    /// `on_event(kind, data)`: kind "note" (data: str) or "update" (data: dict); None = quiet.
    pub on_event: Option<Bound<'py, PyAny>>,
    /// A `threading.Event`-like object (`is_set()`), or None.
    pub cancel_event: Option<Bound<'py, PyAny>>,
    /// Seconds between updates.
    pub every: f64,
}

impl Watch<'_> {
    /// A `Progress` for the engine, feeding `queue` and watching `flag`.
    pub fn progress(&self, queue: &Arc<Queue>, flag: &Arc<AtomicBool>) -> Progress {
        let p = match &self.on_event {
            None => Progress::quiet(),
            Some(_) => Progress::with_listener(
                queue.clone() as Arc<dyn ProgressListener>,
                Duration::from_secs_f64(self.every.max(0.05)),
            ),
        };
        p.with_cancel(flag.clone())
    }

    fn deliver(&self, py: Python<'_>, queue: &Queue) -> PyResult<()> {
        let events = std::mem::take(&mut *queue.0.lock().unwrap());
        let Some(f) = &self.on_event else {
            return Ok(());
        };
        for e in events {
            match e {
                // In a Python caller's words, as its errors are (`restart=True`).
                Event::Note(s) => f.call1(("note", crate::errors::python_words(&s)))?,
                Event::Update(u) => {
                    let json = serde_json::to_string(&u).expect("update serializes");
                    f.call1(("update", crate::json_to_py(py, &json)?))?
                }
            };
        }
        Ok(())
    }

    /// Run `work` on a thread of its own with the GIL released; see the module doc. The
    /// returned error is Python's (`KeyboardInterrupt`, or what a progress callback raised)
    /// when the call was interrupted, else `work`'s own result is returned (a cancel event
    /// shows there as the engine's `Cancelled` error).
    pub fn run<T: Send>(
        &self,
        py: Python<'_>,
        queue: &Arc<Queue>,
        flag: &Arc<AtomicBool>,
        work: impl FnOnce() -> T + Send,
    ) -> PyResult<T> {
        // `MGMM_TRACE`: the call's timeline, as the command line records it (written below).
        mgmm_stream::trace::library_begin().map_err(|e| crate::errors::to_py(py, e))?;
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        let mut interrupt: Option<PyErr> = None;
        let out = std::thread::scope(|s| {
            let h = s.spawn(move || {
                let r = work();
                drop(tx);
                r
            });
            loop {
                let done = py.detach(|| {
                    matches!(
                        rx.recv_timeout(Duration::from_millis(50)),
                        Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Disconnected)
                    )
                });
                if let Err(e) = self.deliver(py, queue) {
                    interrupt.get_or_insert(e);
                    flag.store(true, Ordering::SeqCst);
                }
                if done {
                    break;
                }
                if interrupt.is_none() {
                    if let Err(e) = py.check_signals() {
                        interrupt = Some(e);
                        flag.store(true, Ordering::SeqCst);
                    }
                }
                if let Some(ev) = &self.cancel_event {
                    // An `is_set` that raises stops the job like a raising progress callback
                    // (returning at once would leave the engine running to the end).
                    match ev.call_method0("is_set").and_then(|v| v.is_truthy()) {
                        Ok(true) => flag.store(true, Ordering::SeqCst),
                        Ok(false) => {}
                        Err(e) => {
                            interrupt.get_or_insert(e);
                            flag.store(true, Ordering::SeqCst);
                        }
                    }
                }
            }
            let r = py.detach(|| h.join());
            self.deliver(py, queue)?;
            Ok::<_, PyErr>(r)
        })?;
        if let Err(e) = mgmm_stream::trace::library_write() {
            crate::errors::warn(py, &format!("{e}"));
        }
        if let Some(e) = interrupt {
            return Err(e);
        }
        out.map_err(|_| {
            crate::errors::internal(
                py,
                "the engine thread panicked (this is a bug; please report it)",
            )
        })
    }
}
