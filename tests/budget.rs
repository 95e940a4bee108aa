//! Host memory is bounded by the plan, measured by counting real allocations.
//!
//! A counting global allocator records the peak of live heap bytes while a step runs on four
//! simulated lanes. Every buffer the pipeline holds must come from the pools the layout sized,
//! so the peak above the baseline must stay within `host_memory` plus the simulated devices'
//! memory (which lives on the heap here) plus a small allowance for bookkeeping — smaller than
//! one tile buffer, so a single unpooled tile-sized buffer anywhere in the pipeline fails this.
//! One test per file: the allocator counts the whole process, so this file is a test binary of
//! its own, outside the one that holds the other integration tests (tests/it).

#[path = "it/common/mod.rs"]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use mgmm_stream::backend::sim::SimBackend;
use mgmm_stream::dtype::DType;
use mgmm_stream::plan::Plan;
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan_on, RunOptions};
use mgmm_stream::store::gen::Dist;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Tile 512² f32: every staging/output buffer is 1 MiB; the allowance is half of that.
const ALLOWANCE: usize = 512 << 10;

/// Heap that the GEMM library (faer's x86 kernels) keeps per computing thread: a packing buffer
/// of twice the L3 size, allocated on a thread's first GEMM, mostly never touched. Measured here
/// on a fresh thread rather than assumed, since it depends on the machine's caches.
fn gemm_workspace_per_thread() -> usize {
    std::thread::spawn(|| {
        let a = faer::Mat::<f32>::ones(64, 64);
        let mut c = faer::Mat::<f32>::zeros(64, 64);
        let before = LIVE.load(Ordering::Relaxed);
        faer::linalg::matmul::matmul(
            c.as_mut(),
            faer::Accum::Replace,
            a.as_ref(),
            a.as_ref(),
            1.0,
            faer::Par::Seq,
        );
        LIVE.load(Ordering::Relaxed) - before
    })
    .join()
    .unwrap()
}

#[test]
fn peak_heap_stays_within_host_memory_plus_device_memory() {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        1500,
        1300,
        DType::F32,
        (512, 512),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        1300,
        1400,
        DType::F32,
        (512, 512),
        Dist::Normal,
        2,
    );
    std::fs::write(
        dir.join("plan.toml"),
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"sim\"\ntile = 512\nhost_memory = \"20MiB\"\ndevice_memory = \"8MiB\"\ndurable = false\nthreads = 1\n",
    )
    .unwrap();
    let plan = Plan::load(&dir.join("plan.toml")).unwrap();
    let workspace = gemm_workspace_per_thread();
    let backend = Box::new(SimBackend::with_delays(vec![200; 4], 8 << 20));
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = run_plan_on(&plan, backend, &RunOptions::default(), &Progress::quiet()).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    let s = &r.steps[0];
    // Each simulated device computes on one thread of its own, which holds a GEMM workspace
    // once it has run a GEMM.
    let computing = s.lanes.iter().filter(|l| l.stats.gemms > 0).count();
    let allowed = s.host_budget_bytes as usize
        + 4 * s.device_bytes_per_lane as usize
        + computing * workspace
        + ALLOWANCE;
    eprintln!(
        "peak heap above baseline {peak} B; pools {} B, devices 4 × {} B, GEMM workspace {computing} × {workspace} B, budget {} B, allowed {allowed} B",
        s.host_pool_bytes, s.device_bytes_per_lane, s.host_budget_bytes
    );
    assert!(s.host_pool_bytes <= s.host_budget_bytes);
    assert!(peak <= allowed, "peak heap {peak} B > allowed {allowed} B");
    // The pools and devices really are most of the heap: the count is not vacuous.
    assert!(peak >= s.host_pool_bytes as usize);
}
