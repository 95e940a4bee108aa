//! Fault injection as wrappers, for tests and the GPU resilience scripts (cargo feature
//! `fault-injection`; never in release builds).
//!
//! [`FaultyBackend`] wraps any backend and makes its lanes fail the way a dying device does: a
//! lane's GEMM returns [`Error::Device`] after a set number of calls. [`FaultySink`] wraps the
//! per-tile sink and fails like a full disk (ENOSPC) after a set number of output tiles. Nothing
//! in the engine's hot paths reads the environment: the settings arrive in a [`FaultConfig`]
//! that the command line builds from the environment ([`crate::config`], read only there).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Backend, Dst, GemmDesc, HostAlloc, HostBuf, Lane, Ticket};
use crate::durable::sink::TileSink;
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::schedule::OutTile;
pub use crate::seam::FaultConfig;
use crate::seam::{Caps, DeviceStats, Precision};

impl FaultConfig {
    /// The settings the environment asks for ([`crate::config::fault_config`], where the
    /// `MGMM_FAULT_*` variables are read); `None` when it asks for no fault.
    pub(crate) fn from_env() -> Option<FaultConfig> {
        crate::config::fault_config()
    }
}

/// A backend whose lanes fail as configured.
pub struct FaultyBackend {
    inner: Box<dyn Backend>,
    cfg: FaultConfig,
}

impl FaultyBackend {
    /// Wrap `inner` so that its lanes fail as `cfg` says.
    pub fn new(inner: Box<dyn Backend>, cfg: FaultConfig) -> FaultyBackend {
        FaultyBackend { inner, cfg }
    }
}

impl HostAlloc for FaultyBackend {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        self.inner.alloc_host(bytes)
    }
    fn pools_made(&self, step: (usize, usize)) {
        self.inner.pools_made(step)
    }
    fn shared(&self) -> Option<std::sync::Arc<dyn HostAlloc>> {
        self.inner.shared()
    }
}

impl Backend for FaultyBackend {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn caps(&self) -> &Caps {
        self.inner.caps()
    }
    fn threads(&self) -> usize {
        self.inner.threads()
    }
    fn note(&self) -> Option<String> {
        self.inner.note()
    }
    fn lanes(&self, layout: &Layout, p: Precision) -> Result<Vec<Box<dyn Lane>>> {
        let lanes = self.inner.lanes(layout, p)?;
        Ok(lanes
            .into_iter()
            .enumerate()
            .map(|(i, l)| match self.cfg.gemm_after {
                Some(n) if self.cfg.lane.is_none_or(|f| f == i) => Box::new(FaultyLane {
                    inner: l,
                    index: i,
                    gemm_after: n,
                    gemms: 0,
                })
                    as Box<dyn Lane>,
                _ => l,
            })
            .collect())
    }
    fn without(&self, lane: usize) -> Option<Result<Box<dyn Backend>>> {
        let rest = self.inner.without(lane)?;
        // The failed lane is gone; a fault aimed at one lane goes with it, and lane numbers
        // above it shift down by one.
        let mut cfg = self.cfg.clone();
        match cfg.lane {
            Some(f) if f == lane => cfg.gemm_after = None,
            Some(f) if f > lane => cfg.lane = Some(f - 1),
            _ => {}
        }
        Some(rest.map(|b| Box::new(FaultyBackend::new(b, cfg)) as Box<dyn Backend>))
    }
    fn refresh(&mut self) -> Result<()> {
        self.inner.refresh()
    }
    fn idle(&mut self) {
        self.inner.idle()
    }
}

/// A lane whose GEMM fails after a number of calls, as a device that falls off the bus.
struct FaultyLane {
    inner: Box<dyn Lane>,
    index: usize,
    gemm_after: u64,
    gemms: u64,
}

impl Lane for FaultyLane {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn bind_thread(&mut self) -> Result<()> {
        self.inner.bind_thread()
    }
    fn upload(&mut self, src: &HostBuf, elems: usize, dst: Dst) -> Result<Ticket> {
        self.inner.upload(src, elems, dst)
    }
    fn begin_tile(&mut self, acc: usize) {
        self.inner.begin_tile(acc)
    }
    fn gemm(&mut self, g: &GemmDesc, a: usize, b: usize, acc: usize) -> Result<()> {
        if self.gemms >= self.gemm_after {
            let name = self.inner.name();
            let device = name.split(' ').next().unwrap_or("lane").to_string();
            return Err(Error::device(
                self.index,
                device,
                "GEMM",
                "injected fault (MGMM_FAULT_GEMM_AFTER)",
            ));
        }
        self.gemms += 1;
        self.inner.gemm(g, a, b, acc)
    }
    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket> {
        self.inner.download(acc, elems, dst)
    }
    fn download_into(&mut self, acc: usize, r: &crate::seam::OutRect) -> Result<Ticket> {
        self.inner.download_into(acc, r)
    }
    fn done(&mut self, t: Ticket) -> Result<bool> {
        self.inner.done(t)
    }
    fn wait(&mut self, t: Ticket) -> Result<()> {
        self.inner.wait(t)
    }
    fn stats(&mut self) -> DeviceStats {
        self.inner.stats()
    }
    fn live_stats(&mut self) -> DeviceStats {
        self.inner.live_stats()
    }
    fn release(&mut self) {
        self.inner.release()
    }
    fn in_flight(&mut self) -> usize {
        self.inner.in_flight()
    }
    fn wait_in_flight_below(&mut self, n: usize) -> Result<()> {
        self.inner.wait_in_flight_below(n)
    }
}

/// A tile sink that fails like a full disk after `write_after` tiles: the tile's journal record
/// is never written, exactly as when the data write itself fails.
pub(crate) struct FaultySink<'a> {
    pub(crate) inner: &'a dyn TileSink,
    pub(crate) write_after: u64,
    pub(crate) write_delay_ms: u64,
    pub(crate) path: Arc<std::path::PathBuf>,
    /// Tiles written through this sink so far.
    pub(crate) written: AtomicU64,
}

impl TileSink for FaultySink<'_> {
    fn tile_written(&self, tile: &OutTile, crc: u32) -> Result<()> {
        std::thread::sleep(std::time::Duration::from_millis(self.write_delay_ms));
        if self.written.fetch_add(1, Ordering::Relaxed) >= self.write_after {
            return Err(Error::io(
                self.path.as_path(),
                "cannot write output tile (injected fault)",
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ));
        }
        self.inner.tile_written(tile, crc)
    }
}
