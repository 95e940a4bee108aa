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
//! budget comes from it). A run that failed, or that lost a device, does not leave its backend.
//! [`release`] drops the kept one (`mgmm_stream.empty_cache()`).

use std::sync::Mutex;

use super::{select_with, Backend, BackendOptions};
use crate::error::Result;
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

/// The kept backend and its key.
static KEPT: Mutex<Option<(Key, Box<dyn Backend>)>> = Mutex::new(None);

fn slot() -> std::sync::MutexGuard<'static, Option<(Key, Box<dyn Backend>)>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// How a run got its backend, and whether it leaves it for the next call ([`Lease::finish`]).
pub(crate) struct Lease {
    /// `Some` when the backend is to be kept after the run.
    key: Option<Key>,
    /// The backend's lanes at the start: a run that ends with fewer lost a device.
    lanes: usize,
    /// The backend was kept from an earlier call.
    pub(crate) reused: bool,
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
    if !keep {
        let b = select_with(engine, opts)?;
        let lanes = b.caps().lanes;
        return Ok((
            b,
            Lease {
                key: None,
                lanes,
                reused: false,
            },
        ));
    }
    let key = Key::of(engine, opts.pinned_alloc);
    let held = slot().take();
    if let Some((k, mut b)) = held {
        if k == key && b.refresh().is_ok() {
            let lanes = b.caps().lanes;
            return Ok((
                b,
                Lease {
                    key: Some(key),
                    lanes,
                    reused: true,
                },
            ));
        }
        // Other settings, or not usable again: freed before a new one page-locks its pools.
        drop(b);
    }
    let b = select_with(engine, opts)?;
    let lanes = b.caps().lanes;
    Ok((
        b,
        Lease {
            key: Some(key),
            lanes,
            reused: false,
        },
    ))
}

impl Lease {
    /// The run is over (`ok`: it succeeded): keep `backend` for the next call when this lease
    /// asked for it and it still has every lane it started with, else drop it.
    pub(crate) fn finish(self, mut backend: Box<dyn Backend>, ok: bool) {
        match self.key {
            Some(key) if ok && backend.caps().lanes == self.lanes => {
                backend.idle();
                let old = slot().replace((key, backend));
                drop(old);
            }
            _ => drop(backend),
        }
    }
}

/// Drop the kept backend (its contexts, libraries and page-locked memory); `true` if there was
/// one.
pub fn release() -> bool {
    let old = slot().take();
    old.is_some()
}

/// The name of the kept backend, if one is kept.
pub fn kept_name() -> Option<String> {
    slot().as_ref().map(|(_, b)| b.name())
}
