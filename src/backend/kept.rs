//! A backend kept between the library calls of one process.
//!
//! The Python package runs each `matmul` (and each Dask task's shard) as a run of its own, so
//! without this every call starts its backend again — on a GPU the contexts, cuBLAS's first
//! handle and kernel, and page-locking the pools (2.8–5 GiB/s on the H200 host: the 2.25 GiB of
//! a 32768² fp32 run take about half a second) — and frees it all at its end (0.46 s for
//! 4.5 GiB, `tools/probes/cuda_startup_costs.py`). The command line runs one plan per process
//! and keeps nothing.
//!
//! One backend is kept, for the settings it was made with ([`Key`]): a call with the same
//! settings takes it, a call with others drops it first (so the page-locked memory held never
//! passes one run's pools) and leaves its own. Between calls the backend is idle
//! ([`Backend::idle`]: the GPUs' memory pools trimmed and given back as they were, so torch or
//! CuPy in the same process get that memory); it keeps its contexts, libraries and page-locked
//! buffers. Before its next run it measures the GPUs' free memory again
//! ([`Backend::refresh`]: the caller may have allocated some meanwhile, and the `auto` device
//! budget comes from it). A run that failed on a device (or the backend's start), or that lost
//! a device, does not leave its backend; other errors (bad input, a cancel) do. Neither does
//! `backend = "auto"` fallen back to the CPU: the next call tries the GPUs again.
//! [`release`] drops the kept one (`mgmm_stream.empty_cache()`); a call running meanwhile keeps
//! nothing. Kept backends are dropped on a thread of their own, so that the caller's current
//! CUDA context (torch's, CuPy's) is never changed; a process forked with one in the slot
//! forgets it (its driver handles are the parent's).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::{select_with, Backend, BackendOptions};
use crate::error::{Error, Result};
use crate::plan::{BackendKind, Devices, Engine};

/// The settings a backend is made from: a kept backend serves a run whose key is equal.
#[derive(Clone, Debug, PartialEq)]
struct Key {
    backend: BackendKind,
    devices: Devices,
    threads: usize,
    device_memory: Option<u64>,
    pinned_alloc: bool,
}

impl Key {
    fn of(engine: &Engine, pinned_alloc: bool) -> Key {
        Key {
            backend: engine.backend,
            devices: engine.devices.clone(),
            threads: engine.threads,
            device_memory: engine.device_memory,
            pinned_alloc,
        }
    }
}

/// A backend in the slot: its key, and the process that made it.
struct Kept {
    key: Key,
    pid: u32,
    backend: Box<dyn Backend>,
}

/// The kept backend.
static KEPT: Mutex<Option<Kept>> = Mutex::new(None);

/// How many times [`release`] was called: a run that started before the last one keeps nothing.
static RELEASES: AtomicU64 = AtomicU64::new(0);

fn slot() -> std::sync::MutexGuard<'static, Option<Kept>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drop `kept`'s backend on a thread of its own: dropping contexts and page-locked memory makes
/// their context current on the dropping thread, and the caller's thread has a context of its
/// own to keep (torch's, CuPy's). A backend of another process (a fork's copy) is forgotten.
fn drop_apart(kept: Option<Kept>) {
    let Some(k) = kept else { return };
    if k.pid != std::process::id() {
        std::mem::forget(k.backend);
        return;
    }
    std::thread::scope(|s| {
        s.spawn(move || drop(k.backend));
    });
}

/// How a run got its backend, and whether it leaves it for the next call ([`Lease::finish`]).
pub(crate) struct Lease {
    /// `Some` when the backend is to be kept after the run.
    key: Option<Key>,
    /// The backend's lanes at the start: a run that ends with fewer lost a device.
    lanes: usize,
    /// The backend was kept from an earlier call.
    pub(crate) reused: bool,
    /// [`RELEASES`] when the run started.
    releases: u64,
}

/// The backend for a run under `engine`: with `keep`, the kept one when its settings are the
/// same (made ready by [`Backend::refresh`]; one that cannot be is dropped), else a new one
/// ([`select_with`], after dropping a kept one of other settings). Without `keep`, always a new
/// one, and the kept one stays.
pub(crate) fn obtain(
    engine: &Engine,
    opts: BackendOptions,
    keep: bool,
) -> Result<(Box<dyn Backend>, Lease)> {
    let releases = RELEASES.load(Ordering::SeqCst);
    let lease = |key: Option<Key>, b: &dyn Backend, reused: bool| Lease {
        key,
        lanes: b.caps().lanes,
        reused,
        releases,
    };
    if !keep {
        let b = select_with(engine, opts)?;
        let l = lease(None, b.as_ref(), false);
        return Ok((b, l));
    }
    let key = Key::of(engine, opts.pinned_alloc);
    let held = slot().take();
    match held {
        Some(mut k) if k.key == key && k.pid == std::process::id() => {
            if k.backend.refresh().is_ok() {
                let l = lease(Some(key), k.backend.as_ref(), true);
                return Ok((k.backend, l));
            }
            drop_apart(Some(k));
        }
        // Other settings: freed before a new one page-locks its pools.
        other => drop_apart(other),
    }
    let b = select_with(engine, opts)?;
    // `auto` fallen back to the CPU is not kept: the next call looks for the GPUs again.
    let fallback = engine.backend == BackendKind::Auto && b.caps().kind != "cuda";
    let l = lease((!fallback).then_some(key), b.as_ref(), false);
    Ok((b, l))
}

impl Lease {
    /// The run is over (`failed`: its error, if any): keep `backend` for the next call when
    /// this lease asked for it, it still has every lane it started with, no [`release`] came
    /// meanwhile, and the run did not fail on a device or the backend; else drop it.
    pub(crate) fn finish(self, mut backend: Box<dyn Backend>, failed: Option<&Error>) {
        let device_failed = matches!(failed, Some(Error::Device { .. } | Error::Backend { .. }));
        match self.key {
            Some(key)
                if !device_failed
                    && backend.caps().lanes == self.lanes
                    && RELEASES.load(Ordering::SeqCst) == self.releases =>
            {
                backend.idle();
                let old = slot().replace(Kept {
                    key,
                    pid: std::process::id(),
                    backend,
                });
                drop_apart(old);
            }
            _ => drop(backend),
        }
    }
}

/// Drop the kept backend (its contexts, libraries and page-locked memory); `true` if there was
/// one.
pub fn release() -> bool {
    RELEASES.fetch_add(1, Ordering::SeqCst);
    let old = slot().take();
    let was = old.is_some();
    drop_apart(old);
    was
}

/// The name of the kept backend, if one is kept.
pub fn kept_name() -> Option<String> {
    slot().as_ref().map(|k| k.backend.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slot is the process's: these tests take turns.
    static TURN: Mutex<()> = Mutex::new(());

    fn engine(backend: &str) -> Engine {
        crate::plan::engine::with_settings(std::path::Path::new("test"), &[("backend", backend)])
            .unwrap()
    }

    fn obtain_kept(e: &Engine) -> (Box<dyn Backend>, Lease) {
        obtain(e, BackendOptions::default(), true).unwrap()
    }

    /// A run that failed on a device or the backend leaves nothing; one that failed otherwise
    /// (bad input, a cancel) leaves its backend, which the next call takes.
    #[test]
    fn only_a_device_failure_drops_the_backend() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        release();
        let e = engine("cpu");
        let (b, lease) = obtain_kept(&e);
        lease.finish(b, Some(&Error::Usage("a bad input".into())));
        assert!(kept_name().is_some(), "kept after an error of the input");
        let (b, lease) = obtain_kept(&e);
        assert!(lease.reused);
        lease.finish(b, Some(&Error::Cancelled));
        assert!(kept_name().is_some(), "kept after a cancel");
        let (b, lease) = obtain_kept(&e);
        assert!(lease.reused);
        lease.finish(b, Some(&Error::backend("cuda", "the context is lost")));
        assert!(kept_name().is_none(), "dropped after the backend failed");
        let (_, lease) = obtain_kept(&e);
        assert!(!lease.reused);
    }

    /// `release` while a run is on: the run's backend is not kept afterwards (the caller asked
    /// for the memory back).
    #[test]
    fn a_release_during_a_run_keeps_nothing_after_it() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        release();
        let (b, lease) = obtain_kept(&engine("cpu"));
        assert!(!release(), "nothing was in the slot: the run holds it");
        lease.finish(b, None);
        assert!(kept_name().is_none());
    }

    /// `backend = "auto"` fallen back to the CPU is not kept, so the next call looks for the
    /// GPUs again (a driver that failed once may work the next time).
    #[test]
    fn auto_fallen_back_to_the_cpu_is_not_kept() {
        let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        release();
        let (b, lease) = obtain_kept(&engine("auto"));
        let cpu = b.caps().kind == "cpu";
        lease.finish(b, None);
        assert_eq!(
            kept_name().is_none(),
            cpu,
            "kept exactly when the GPUs were found"
        );
        release();
    }
}
