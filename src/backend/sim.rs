//! A simulated multi-device backend, so the concurrency core runs on CI machines without a GPU
//! (cargo feature `fault-injection`; plan key `backend = "sim"`).
//!
//! Each [`SimLane`] behaves like a GPU lane where it matters to the pipeline: its work is
//! asynchronous. `upload`, `gemm` and `download` only queue an operation and return; a helper
//! thread per lane executes the queue in order after a random delay (seeded, so runs repeat),
//! reading and writing the caller's host buffers *later* — exactly what DMA does — and tickets
//! complete when it gets there. A pipeline that released a host buffer before its ticket was done
//! would read or compute garbage here, and the tests would see it. The arithmetic is the CPU
//! lane's (faer, one thread per lane, so every lane computes a tile the same way and any split of
//! tiles between lanes gives identical bytes). Its slots and accumulators stand for device
//! memory: the layout counts them against the per-device budget, not `host_memory`.
//!
//! Its devices also copy input blocks straight from the files' maps, as the GPUs do
//! ([`crate::pipeline::direct`]), from ranges "page-locked" with a [`SimPinner`]: each such copy
//! checks, when the device gets to it, that every byte it reads is still registered — so a
//! range released while a copy from it was queued (too early) fails the run here.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::cpu::CpuLane;
use super::{Backend, Dst, GemmDesc, HostAlloc, HostBuf, HostRun, InputPinner, Lane, Ticket};
use crate::error::{Error, Result};
use crate::plan::layout::Layout;
use crate::plan::{Devices, Engine};
use crate::seam::{Caps, DeviceCheckSpec, DeviceStats, MemorySpace, OutRect, Precision};

const SIM_TILES: &[u64] = &[512, 256, 128, 64, 32, 16, 8, 4, 2, 1];

/// Default number of simulated devices when `engine.devices = "all"`.
pub(crate) const DEFAULT_LANES: usize = 4;

/// A simulated backend of several lanes whose transfers complete later, on a helper thread.
pub struct SimBackend {
    /// Device ids still in the run (ids survive failover, like GPU ordinals).
    ids: Vec<usize>,
    /// Largest random delay before each operation, per device id (a slow device has a larger one).
    max_delay_us: Vec<u64>,
    caps: Caps,
    pinner: Arc<SimPinner>,
    log: Arc<OpLog>,
}

/// The order in which the simulated lanes were asked to do things: per op, the lane's index,
/// what (`'G'` a GEMM, `'D'` a download, `'A'` an upload into an accumulator) and the
/// accumulator — for tests of the order the pipeline issues them in
/// (docs/decisions/0022-ended-tiles-wait-without-holding-up-the-lane.md).
#[derive(Default)]
pub struct OpLog(Mutex<Vec<(usize, char, usize)>>);

impl OpLog {
    /// Everything logged so far, in the order it was issued.
    pub fn ops(&self) -> Vec<(usize, char, usize)> {
        self.0.lock().unwrap().clone()
    }
}

/// The simulated devices' page-locking: the ranges registered now, which every copy straight
/// from a file map must lie in when the device executes it. A copy that finds a byte of its
/// rectangles unregistered is counted ([`SimPinner::violations`]: a pipeline bug, released
/// too early) and fails its lane.
#[derive(Default)]
pub struct SimPinner {
    held: Mutex<Vec<(usize, usize)>>,
    limits: Option<(u64, u64)>,
    violations: std::sync::atomic::AtomicU64,
    /// The most bytes registered at once (counted here, apart from the engine's own count).
    peak: std::sync::atomic::AtomicU64,
}

impl SimPinner {
    /// The most bytes of the input files that were registered ("page-locked") at once.
    pub fn peak_locked(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies that found part of what they read no longer registered.
    pub fn violations(&self) -> u64 {
        self.violations.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Run `copy` if every row of `runs` lies inside one registered range, holding the ranges
    /// meanwhile (none can be released during the copy); else count a violation.
    fn copy_registered(&self, runs: &[HostRun], copy: impl FnOnce() -> Result<()>) -> Result<()> {
        let h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let covers =
            |ptr: usize, len: usize| h.iter().any(|&(p, l)| ptr >= p && ptr + len <= p + l);
        let unlocked = runs
            .iter()
            .find(|r| (0..r.rows).any(|i| !covers(r.host as usize + i * r.host_pitch, r.row_len)));
        if let Some(r) = unlocked {
            self.violations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Error::Usage(format!(
                "a copy from a file map at {:#x} found it no longer page-locked (released before the copy was done: a bug)",
                r.host as usize
            )));
        }
        copy()
    }
}

impl InputPinner for SimPinner {
    fn register(&self, ptr: *const u8, len: usize) -> std::result::Result<(), String> {
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let p = ptr as usize;
        if h.iter().any(|&(q, l)| p < q + l && q < p + len) {
            return Err(format!(
                "{len} bytes at {p:#x} overlap a range registered already (simulated device)"
            ));
        }
        h.push((p, len));
        let now: usize = h.iter().map(|&(_, l)| l).sum();
        self.peak
            .fetch_max(now as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn unregister(&self, ptr: *const u8) {
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = h.iter().position(|&(p, _)| p == ptr as usize) {
            h.swap_remove(i);
        }
    }
    fn limits(&self) -> Option<(u64, u64)> {
        self.limits
    }
}

fn sim_peak(_p: Precision, lanes: usize, _depth: u64) -> f64 {
    1e9 * lanes as f64
}

impl SimBackend {
    pub(crate) fn new(engine: &Engine) -> SimBackend {
        let ids: Vec<usize> = match &engine.devices {
            Devices::All => (0..DEFAULT_LANES).collect(),
            Devices::List(l) => l.iter().map(|&d| d as usize).collect(),
        };
        let delays = vec![300; ids.iter().max().map_or(0, |m| m + 1)];
        Self::with_ids(ids, engine.device_memory.unwrap_or(1 << 30), delays)
    }

    /// `delays_us.len()` devices, device `i` waiting up to `delays_us[i]` µs before each
    /// operation, each with `device_memory` bytes.
    pub fn with_delays(delays_us: Vec<u64>, device_memory: u64) -> SimBackend {
        Self::with_ids((0..delays_us.len()).collect(), device_memory, delays_us)
    }

    fn with_ids(ids: Vec<usize>, device_memory: u64, max_delay_us: Vec<u64>) -> SimBackend {
        SimBackend {
            caps: Caps {
                kind: "sim",
                memory: MemorySpace::Device,
                tile_ladder: SIM_TILES,
                staging_depth: 4,
                extra_out_buf: true,
                auto_copies_from: usize::MAX,
                lanes: ids.len(),
                device_memory,
                narrow_slots: false,
                link_names: ("H2D", "D2H"),
                link_rate: None,
                peak_flops: sim_peak,
                peak_source: |_| "simulated devices (tests only)",
            },
            ids,
            max_delay_us,
            pinner: Arc::default(),
            log: Arc::default(),
        }
    }

    /// The same devices, logging into `log` (the backend a failover leaves keeps the log).
    fn with_log(mut self, log: Arc<OpLog>) -> SimBackend {
        self.log = log;
        self
    }

    /// The log of the ops this backend's lanes are asked for ([`OpLog`]).
    pub fn op_log(&self) -> Arc<OpLog> {
        self.log.clone()
    }

    /// The same devices, registering at most `budget` bytes of the input files at once, in
    /// ranges of about `chunk` bytes (the GPUs: half the memory the host can spare, 32 MiB), so
    /// that a test's small inputs are released and registered again within a step.
    pub fn with_pin_limits(mut self, budget: u64, chunk: u64) -> SimBackend {
        self.pinner = Arc::new(SimPinner {
            limits: Some((budget, chunk)),
            ..SimPinner::default()
        });
        self
    }

    /// What the devices' copies found of the registrations ([`SimPinner::violations`]).
    pub fn pinner(&self) -> Arc<SimPinner> {
        self.pinner.clone()
    }
}

impl HostAlloc for SimBackend {
    fn alloc_host(&self, bytes: usize) -> Result<HostBuf> {
        HostBuf::heap(bytes)
    }
    fn shared(&self) -> Option<std::sync::Arc<dyn HostAlloc>> {
        Some(std::sync::Arc::new(super::HeapAlloc))
    }
    fn input_pinner(&self) -> Option<Arc<dyn InputPinner>> {
        Some(self.pinner.clone())
    }
}

impl Backend for SimBackend {
    fn name(&self) -> String {
        let ids: Vec<String> = self.ids.iter().map(|i| format!("sim:{i}")).collect();
        ids.join(" + ")
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn threads(&self) -> usize {
        1
    }
    fn lanes(&self, layout: &Layout, p: Precision) -> Result<Vec<Box<dyn Lane>>> {
        self.ids
            .iter()
            .enumerate()
            .map(|(index, &id)| {
                Ok(Box::new(SimLane::new(self, index, id, layout, p)?) as Box<dyn Lane>)
            })
            .collect()
    }
    fn without(&self, lane: usize) -> Option<Result<Box<dyn Backend>>> {
        if self.ids.len() <= 1 || lane >= self.ids.len() {
            return None;
        }
        let mut ids = self.ids.clone();
        ids.remove(lane);
        Some(Ok(Box::new(
            Self::with_ids(ids, self.caps.device_memory, self.max_delay_us.clone())
                .with_log(self.log.clone()),
        )))
    }
}

/// A raw view of a caller's host buffer, read or written later by the lane's thread.
#[derive(Clone, Copy)]
struct RawBuf(*mut u8, usize);
// SAFETY: the pipeline keeps the buffer alive and untouched until the op's ticket is done (the
// lane contract); the worker thread is the only one accessing it until then.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// # Safety
    /// The buffer must be alive and not accessed by anyone else until the returned HostBuf is
    /// dropped (guaranteed by the lane contract while the op's ticket is pending).
    unsafe fn host_buf(self) -> HostBuf {
        let ptr = std::ptr::NonNull::new(self.0).expect("host buffers are non-null");
        // SAFETY: see the function contract; the owner is a unit, so dropping the HostBuf frees
        // nothing.
        unsafe { HostBuf::from_raw(ptr, self.1, Box::new(())) }
    }
}

enum Op {
    Upload(RawBuf, usize, Dst),
    /// A copy straight from page-locked file maps into an input slot.
    UploadRuns(Vec<HostRun>, usize, usize),
    Gemm(GemmDesc, usize, usize, usize),
    Download(usize, usize, RawBuf),
    /// A download straight into the output's (page-locked) memory.
    DownloadInto(usize, OutRect),
    /// The check of the block an `UploadRuns` copied ([`super::check`]): the kernel's
    /// arithmetic ([`super::check::mirror`]) on the bytes that copy wrote, before any
    /// rounding, sent to the check stage.
    Check(
        Vec<HostRun>,
        usize,
        DeviceCheckSpec,
        crossbeam_channel::Sender<Vec<[u32; 2]>>,
    ),
}

/// A simulated device's check of a block, computed on its thread.
struct SimCheck(crossbeam_channel::Receiver<Vec<[u32; 2]>>);

impl super::check::DeviceCheck for SimCheck {
    fn wait(self: Box<Self>) -> std::result::Result<Vec<[u32; 2]>, String> {
        self.0
            .recv()
            .map_err(|_| "the simulated device stopped before checking the block".into())
    }
}

struct Shared {
    queue: VecDeque<(u64, Op)>,
    /// Every op with a sequence number below this has executed.
    done_below: u64,
    error: Option<String>,
    stop: bool,
    stats: DeviceStats,
}

pub(crate) struct SimLane {
    /// Index in the backend's lane list (for [`Error::Device`]).
    index: usize,
    id: usize,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    next: u64,
    worker: Option<std::thread::JoinHandle<()>>,
    /// The last `upload_runs`, for its check ([`Lane::check_upload`]).
    last_runs: Option<(Vec<HostRun>, usize)>,
    /// Where the ops asked for are logged ([`OpLog`]).
    log: Arc<OpLog>,
}

impl SimLane {
    /// Lane `index` of `backend`, simulating its device `id` (its delays, seeded by the id;
    /// the backend's page-locking and op log).
    fn new(
        backend: &SimBackend,
        index: usize,
        id: usize,
        layout: &Layout,
        p: Precision,
    ) -> Result<SimLane> {
        let (max_delay_us, seed) = (backend.max_delay_us[id], id as u64 + 1);
        let (pinner, log) = (backend.pinner.clone(), backend.log.clone());
        let shared = Arc::new((
            Mutex::new(Shared {
                queue: VecDeque::new(),
                done_below: 0,
                error: None,
                stop: false,
                stats: DeviceStats::default(),
            }),
            Condvar::new(),
        ));
        let cpu = CpuLane::new(layout, p, 1)?;
        let sh = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("sim:{id}"))
            .spawn(move || worker(cpu, sh, max_delay_us, seed, pinner))
            .expect("spawn simulated device thread");
        Ok(SimLane {
            index,
            id,
            shared,
            next: 0,
            worker: Some(worker),
            last_runs: None,
            log,
        })
    }

    fn push(&mut self, op: Op) -> Result<Ticket> {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        if let Some(e) = &s.error {
            return Err(Error::device(
                self.index,
                self.device(),
                "simulated device",
                e.clone(),
            ));
        }
        let t = self.next;
        self.next += 1;
        let logged = match &op {
            Op::Gemm(_, _, _, acc) => Some(('G', *acc)),
            Op::Download(acc, _, _) | Op::DownloadInto(acc, _) => Some(('D', *acc)),
            Op::Upload(_, _, Dst::Acc(acc)) => Some(('A', *acc)),
            _ => None,
        };
        if let Some((what, acc)) = logged {
            self.log.0.lock().unwrap().push((self.index, what, acc));
        }
        s.queue.push_back((t, op));
        cv.notify_all();
        Ok(Ticket(t))
    }

    fn device(&self) -> String {
        format!("sim:{}", self.id)
    }
}

/// xorshift64*: a tiny deterministic generator for the delays.
fn next_rand(x: &mut u64) -> u64 {
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn worker(
    mut cpu: CpuLane,
    sh: Arc<(Mutex<Shared>, Condvar)>,
    max_delay_us: u64,
    seed: u64,
    pinner: Arc<SimPinner>,
) {
    let (m, cv) = &*sh;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    loop {
        let (t, op, failed) = {
            let mut s = m.lock().unwrap();
            while s.queue.is_empty() && !s.stop {
                s = cv.wait(s).unwrap();
            }
            match s.queue.pop_front() {
                Some((t, op)) => (t, op, s.error.is_some()),
                None => return,
            }
        };
        // After a failure nothing queued runs (as on a GPU whose context died): the host
        // buffers of those ops may already be back in their pools.
        if failed {
            let mut s = m.lock().unwrap();
            s.done_below = t + 1;
            cv.notify_all();
            continue;
        }
        if max_delay_us > 0 {
            std::thread::sleep(Duration::from_micros(next_rand(&mut rng) % max_delay_us));
        }
        // SAFETY (`Upload`, `Download`): the op's host buffer stays alive and untouched until
        // this op's ticket is done, which happens only after `done_below` passes it below.
        // (`UploadRuns` reads file maps that the step's registry of direct uploads keeps
        // mapped until the lanes, and with them this thread, have ended.)
        let r = match op {
            Op::Upload(b, elems, dst) => cpu.upload(&unsafe { b.host_buf() }, elems, dst).map(drop),
            // What a GPU's copy engine needs: every byte still page-locked when it copies.
            Op::UploadRuns(runs, elems, slot) => {
                pinner.copy_registered(&runs, || cpu.upload_runs(&runs, elems, slot).map(drop))
            }
            Op::Check(runs, elems, spec, tx) => {
                let mut dense = vec![0u8; elems * spec.elem as usize];
                for r in &runs {
                    for i in 0..r.rows {
                        let at = r.dst_off + i * r.dst_pitch;
                        // SAFETY: as for `UploadRuns` (above): the maps stay mapped.
                        let row = unsafe {
                            std::slice::from_raw_parts(r.host.add(i * r.host_pitch), r.row_len)
                        };
                        dense[at..at + r.row_len].copy_from_slice(row);
                    }
                }
                let _ = tx.send(super::check::mirror(&dense, &spec));
                Ok(())
            }
            Op::Gemm(g, a, b, acc) => cpu.gemm(&g, a, b, acc),
            Op::Download(acc, elems, b) => cpu
                .download(acc, elems, &mut unsafe { b.host_buf() })
                .map(drop),
            Op::DownloadInto(acc, r) => cpu.download_into(acc, &r).map(drop),
        };
        let mut s = m.lock().unwrap();
        if let Err(e) = r {
            s.error.get_or_insert(e.to_string());
        }
        s.done_below = t + 1;
        s.stats = cpu.stats();
        cv.notify_all();
    }
}

impl Lane for SimLane {
    fn name(&self) -> String {
        format!("{} (simulated)", self.device())
    }
    fn upload(&mut self, src: &HostBuf, elems: usize, dst: Dst) -> Result<Ticket> {
        self.push(Op::Upload(
            RawBuf(src.as_ptr() as *mut u8, src.len()),
            elems,
            dst,
        ))
    }
    fn uploads_runs(&self) -> bool {
        true
    }
    fn upload_runs(&mut self, runs: &[HostRun], elems: usize, slot: usize) -> Result<Ticket> {
        // Staging gives runs in GPU memory only to a GPU's lane (`Lane::gpu`).
        if runs.iter().any(|r| r.device) {
            return Err(Error::Usage(
                "a simulated lane was given a block in GPU memory (a bug)".into(),
            ));
        }
        self.last_runs = Some((runs.to_vec(), elems));
        self.push(Op::UploadRuns(runs.to_vec(), elems, slot))
    }
    /// Even-numbered simulated devices check on the device, odd ones leave it to the host, so
    /// that a run with two of them has both kinds of check.
    fn checks_uploads(&self) -> bool {
        self.id.is_multiple_of(2)
    }
    fn check_upload(
        &mut self,
        spec: &DeviceCheckSpec,
    ) -> Option<Box<dyn super::check::DeviceCheck>> {
        if !self.checks_uploads() {
            return None;
        }
        let (runs, elems) = self.last_runs.take()?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.push(Op::Check(runs, elems, *spec, tx)).ok()?;
        Some(Box::new(SimCheck(rx)))
    }
    fn gemm(&mut self, g: &GemmDesc, a: usize, b: usize, acc: usize) -> Result<()> {
        self.push(Op::Gemm(*g, a, b, acc)).map(drop)
    }
    fn download(&mut self, acc: usize, elems: usize, dst: &mut HostBuf) -> Result<Ticket> {
        self.push(Op::Download(
            acc,
            elems,
            RawBuf(dst.as_ptr() as *mut u8, dst.len()),
        ))
    }
    fn download_into(&mut self, acc: usize, r: &OutRect) -> Result<Ticket> {
        self.push(Op::DownloadInto(acc, *r))
    }
    fn in_flight(&mut self) -> usize {
        let s = self.shared.0.lock().unwrap();
        if s.error.is_some() {
            return 0; // a failed device: nothing to wait for (the next op reports it)
        }
        (self.next - s.done_below.min(self.next)) as usize
    }
    fn wait_in_flight_below(&mut self, n: usize) -> Result<()> {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        while self.next - s.done_below.min(self.next) >= n.max(1) as u64 && s.error.is_none() {
            s = cv.wait(s).unwrap();
        }
        Ok(())
    }
    fn done(&mut self, t: Ticket) -> Result<bool> {
        let s = self.shared.0.lock().unwrap();
        if let Some(e) = &s.error {
            return Err(Error::device(
                self.index,
                self.device(),
                "simulated device",
                e.clone(),
            ));
        }
        Ok(s.done_below > t.0)
    }
    fn wait(&mut self, t: Ticket) -> Result<()> {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        while s.done_below <= t.0 && s.error.is_none() {
            s = cv.wait(s).unwrap();
        }
        match &s.error {
            Some(e) => Err(Error::device(
                self.index,
                self.device(),
                "simulated device",
                e.clone(),
            )),
            None => Ok(()),
        }
    }
    fn stats(&mut self) -> DeviceStats {
        let (m, cv) = &*self.shared;
        let mut s = m.lock().unwrap();
        while s.done_below < self.next && s.error.is_none() {
            s = cv.wait(s).unwrap();
        }
        s.stats.clone()
    }
    fn live_stats(&mut self) -> DeviceStats {
        self.shared.0.lock().unwrap().stats.clone()
    }
}

impl Drop for SimLane {
    fn drop(&mut self) {
        {
            let (m, cv) = &*self.shared;
            let mut s = m.lock().unwrap();
            // Finish what is queued (host buffers it references are still leased by the
            // pipeline only while their tickets are pending; dropping the lane means the
            // pipeline is done or cancelled, and a cancelled pipeline has waited — see
            // DeviceLane), then stop.
            s.stop = true;
            cv.notify_all();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
