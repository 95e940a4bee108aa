//! Pipeline behaviour beyond single products: out-of-core streaming within a memory budget,
//! bitwise reproducibility, and prompt, clear failure when a stage errors.

use crate::common::*;

use std::sync::mpsc;
use std::time::Duration;

use mgmm_stream::dtype::DType;
use mgmm_stream::store::gen::Dist;
use mgmm_stream::store::{Block, TiledFile};

/// 1 GiB of inputs through a 64 MiB host budget: the product is right (checked on sampled
/// elements against an f64 reference) and the pools never held more than the budget.
fn out_of_core(backend: &str) {
    let d = tmp();
    let dir = d.path();
    let (m, n, k) = (256u64, 256u64, 1u64 << 19);
    gen(
        &dir.join("A.mgt"),
        m,
        k,
        DType::F32,
        (256, 1024),
        Dist::Uniform,
        7,
    );
    gen(
        &dir.join("B.mgt"),
        k,
        n,
        DType::F32,
        (1024, 256),
        Dist::Uniform,
        8,
    );
    let budget = 64u64 << 20;
    let text = format!(
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"{backend}\"\nhost_memory = \"64MiB\"\n"
    );
    let rep = run_text(dir, &text).expect("run");
    let s = &rep.steps[0];
    let input_bytes = (m * k + k * n) * 4;
    assert!(
        input_bytes >= 16 * budget,
        "inputs must be many times the budget"
    );
    assert!(s.read_bytes >= input_bytes, "every input byte was staged");
    assert!(
        s.host_pool_bytes <= budget,
        "pools allocated {} > budget {budget}",
        s.host_pool_bytes
    );
    assert!(
        s.host_peak_bytes <= budget,
        "peak {} > budget {budget}",
        s.host_peak_bytes
    );
    for p in &s.pools {
        assert!(
            p.high_water <= p.buffers,
            "pool {} high water {} > {}",
            p.name,
            p.high_water,
            p.buffers
        );
        assert!(p.high_water >= 1, "pool {} was used", p.name);
    }
    // Sampled check against f64.
    let a = TiledFile::open(&dir.join("A.mgt")).unwrap();
    let b = TiledFile::open(&dir.join("B.mgt")).unwrap();
    let c = Mat::load(&dir.join("C.mgt"));
    let row = |f: &TiledFile, blk: Block| -> Vec<f64> {
        let mut buf = vec![0u8; blk.elems() * 8];
        f.read_block(&blk, DType::F64, &mut buf).unwrap();
        buf.chunks(8)
            .map(|x| f64::from_le_bytes(x.try_into().unwrap()))
            .collect()
    };
    for &(i, j) in &[(0u64, 0u64), (255, 255), (17, 200), (128, 3), (64, 129)] {
        let ar = row(
            &a,
            Block {
                r0: i,
                c0: 0,
                rows: 1,
                cols: k,
            },
        );
        let bc = row(
            &b,
            Block {
                r0: 0,
                c0: j,
                rows: k,
                cols: 1,
            },
        );
        let (mut r, mut mag) = (0.0, 0.0);
        for p in 0..k as usize {
            r += ar[p] * bc[p];
            mag += (ar[p] * bc[p]).abs();
        }
        let got = c.v[(i * n + j) as usize];
        let allowed = (k as f64 + 2.0) * f32::EPSILON as f64 / 2.0 * mag;
        assert!(
            (got - r).abs() <= allowed,
            "C[{i},{j}] = {got}, reference {r}, allowed {allowed:e}"
        );
    }
}

/// Two runs of one plan produce bitwise identical output.
fn reproducible(backend: &str) {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        300,
        517,
        DType::F32,
        (64, 64),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        517,
        211,
        DType::F32,
        (100, 50),
        Dist::Normal,
        2,
    );
    let plan = |out: &str| {
        format!(
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"{out}\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"{backend}\"\ntile = [128, 96, 64]\nhost_memory = \"16MiB\"\n"
        )
    };
    run_text(dir, &plan("C1.mgt")).unwrap();
    run_text(dir, &plan("C2.mgt")).unwrap();
    let c1 = std::fs::read(dir.join("C1.mgt")).unwrap();
    let c2 = std::fs::read(dir.join("C2.mgt")).unwrap();
    assert!(c1 == c2, "two runs of one plan differ");
}

/// A corrupt input tile stops the run promptly with an error naming the file and the tile; no
/// thread hangs, and the run does not report success.
fn corrupt_input_fails_fast(backend: &str) {
    let d = tmp();
    let dir = d.path().to_path_buf();
    gen(
        &dir.join("A.mgt"),
        200,
        200,
        DType::F32,
        (50, 50),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        200,
        200,
        DType::F32,
        (50, 50),
        Dist::Normal,
        2,
    );
    // Flip one byte inside B's storage tile (2, 3).
    let f = TiledFile::open(&dir.join("B.mgt")).unwrap();
    let off = f.hdr.tile_offset(2, 3) + 100;
    drop(f);
    let mut bytes = std::fs::read(dir.join("B.mgt")).unwrap();
    bytes[off as usize] ^= 0x40;
    std::fs::write(dir.join("B.mgt"), &bytes).unwrap();
    let text = format!(
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"{backend}\"\ntile = 64\n"
    );
    let (tx, rx) = mpsc::channel();
    let dir2 = dir.clone();
    std::thread::spawn(move || {
        let r = run_text(&dir2, &text).map(|_| ());
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("run must not hang");
    let e = r.expect_err("a corrupt input must fail the run");
    assert!(
        e.contains("B.mgt") && e.contains("tile (2, 3)") && e.contains("checksum"),
        "{e}"
    );
    assert_eq!(
        digest(&dir.join("B.mgt")),
        crc32c::crc32c(&bytes),
        "input unchanged"
    );
}

/// A tiny device budget (GPU) or host budget (CPU) forces small compute tiles and a tile cache
/// much smaller than the inputs, so tiles are evicted and reloaded: the product stays right.
fn small_memory_forces_many_tiles(backend: &str) {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        900,
        700,
        DType::F32,
        (128, 128),
        Dist::Normal,
        1,
    );
    gen(
        &dir.join("B.mgt"),
        700,
        800,
        DType::F32,
        (128, 128),
        Dist::Normal,
        2,
    );
    let text = format!(
        "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
         [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
         [engine]\nbackend = \"{backend}\"\nhost_memory = \"4MiB\"\n{}",
        if backend != "cpu" {
            "device_memory = \"2MiB\"\n"
        } else {
            ""
        }
    );
    let rep = run_text(dir, &text).expect("run");
    let s = &rep.steps[0];
    assert!(
        s.tile[0] < 900 && s.tiles_total >= 4,
        "budget must force several tiles: {:?}",
        s.tile
    );
    // One lane with a small cache must re-read tiles; several lanes in phase may serve each
    // other's re-reads through the shared reader, so the count is checked on the CPU only.
    if backend == "cpu" {
        assert!(
            s.read_bytes > (900 * 700 + 700 * 800) * 4,
            "a small cache re-reads tiles"
        );
    }
    let a = Mat::load(&dir.join("A.mgt"));
    let b = Mat::load(&dir.join("B.mgt"));
    let c = Mat::load(&dir.join("C.mgt"));
    let (r, mag) = reference(&a, false, &b, false, None, 1.0, 0.0, 900, 800, 700);
    for i in 0..r.len() {
        assert!(
            (c.v[i] - r[i]).abs() <= 702.0 * f32::EPSILON as f64 / 2.0 * mag[i],
            "element {i}"
        );
    }
}

/// `engine.staging`: the lanes copy input blocks straight from the files' pages (`direct`,
/// and `auto` with the pages in memory, as after `gen`) or from staging buffers (`copy`), on
/// blocks that straddle storage tiles unevenly; the products are identical bit for bit, the
/// report says which bytes went which way (the simulated lanes copy from the pages later, on
/// their own thread as DMA does, and fail if a page is no longer registered then), and a
/// corrupted storage tile fails the run in every mode (copied, it is caught before its
/// upload; direct, beside it, before any tile computed from it is written).
fn staging_modes(backend: &str) {
    let d = tmp();
    let dir = d.path();
    gen(
        &dir.join("A.mgt"),
        97,
        131,
        DType::F32,
        (16, 33),
        Dist::Normal,
        11,
    );
    gen(
        &dir.join("B.mgt"),
        131,
        61,
        DType::F32,
        (40, 7),
        Dist::Normal,
        12,
    );
    // A fresh output for every run (a finished one would be skipped).
    let plan = |mode: &str, out: &str| {
        format!(
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"{out}_{mode}.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"{backend}\"\ntile = [32, 33, 31]\nstaging = \"{mode}\"\n"
        )
    };
    let mut outs = Vec::new();
    for mode in ["copy", "direct", "auto"] {
        let rep = run_text(dir, &plan(mode, "C")).unwrap_or_else(|e| panic!("{mode}: {e}"));
        let s = &rep.steps[0];
        assert!(
            s.read_bytes >= (97 * 131 + 131 * 61) * 4,
            "{mode}: {}",
            s.read_bytes
        );
        let want = if mode == "copy" { 0 } else { s.read_bytes };
        assert_eq!(s.direct_bytes, want, "{mode}: direct bytes");
        assert_eq!(s.direct_cold_blocks, 0, "{mode}");
        assert!(s.direct_failed.is_none(), "{mode}: {:?}", s.direct_failed);
        // Blocks all going direct, the staging pool's leases got no memory.
        let st = s.pools.iter().find(|p| p.name == "staging").unwrap();
        match want {
            0 => assert!(!st.lazy && st.allocated == st.buffers, "{mode}: {st:?}"),
            _ => assert!(st.lazy && st.allocated == 0, "{mode}: {st:?}"),
        }
        outs.push(load(&dir.join(format!("C_{mode}.mgt"))));
    }
    // An added matrix is always copied: the staging pool is made up front for it.
    gen(
        &dir.join("C0.mgt"),
        97,
        61,
        DType::F32,
        (16, 16),
        Dist::Normal,
        13,
    );
    let with_c0 = |mode: &str| {
        plan(mode, "E")
            .replace("[[step]]", "[matrices.C0]\npath = \"C0.mgt\"\n[[step]]")
            .replace("A @ B", "A @ B + 0.5 * C0")
    };
    let mut c0_outs = Vec::new();
    for mode in ["copy", "auto"] {
        let rep = run_text(dir, &with_c0(mode)).unwrap_or_else(|e| panic!("{mode}: {e}"));
        let st = rep.steps[0]
            .pools
            .iter()
            .find(|p| p.name == "staging")
            .unwrap();
        assert!(!st.lazy && st.allocated == st.buffers, "{mode}: {st:?}");
        c0_outs.push(load(&dir.join(format!("E_{mode}.mgt"))));
    }
    assert!(
        c0_outs[0] == c0_outs[1],
        "with C0: the modes' outputs differ"
    );
    let c0 = Mat::load(&dir.join("C0.mgt"));
    let (a, b) = (Mat::load(&dir.join("A.mgt")), Mat::load(&dir.join("B.mgt")));
    let (r, mag) = reference(&a, false, &b, false, Some(&c0), 1.0, 0.5, 97, 61, 131);
    for (i, &x) in c0_outs[1].2.iter().enumerate() {
        assert!(
            (x - r[i]).abs() <= 1e-5 * mag[i] + 1e-30,
            "C0 element {i}: {x} vs {}",
            r[i]
        );
    }
    assert!(
        outs.windows(2).all(|w| w[0] == w[1]),
        "the modes' outputs differ"
    );
    let (a, b) = (Mat::load(&dir.join("A.mgt")), Mat::load(&dir.join("B.mgt")));
    let (r, mag) = reference(&a, false, &b, false, None, 1.0, 0.0, 97, 61, 131);
    for (i, &x) in outs[0].2.iter().enumerate() {
        assert!(
            (x - r[i]).abs() <= 1e-5 * mag[i] + 1e-30,
            "element {i}: {x} vs {}",
            r[i]
        );
    }
    // Flip one byte of A's storage tile (2, 1): every mode fails the run, naming the tile.
    let f = TiledFile::open(&dir.join("A.mgt")).unwrap();
    let at = f.hdr.tile_offset(2, 1) as usize + 100;
    drop(f);
    let mut bytes = std::fs::read(dir.join("A.mgt")).unwrap();
    bytes[at] ^= 0x40;
    std::fs::write(dir.join("A.mgt"), bytes).unwrap();
    for mode in ["copy", "direct", "auto"] {
        let e = run_text(dir, &plan(mode, "D")).expect_err(mode).to_string();
        assert!(
            e.contains("A.mgt") && e.contains("checksum") && e.contains("(2, 1)"),
            "{mode}: {e}"
        );
    }
}

/// `.npy` inputs larger than one page-locked range (32 MiB of bands of rows), read direct in
/// blocks that span several bands and ranges, rows crossing range boundaries (a 128-byte
/// header, a pitch that is no divisor of a page): the output equals the copied one bit for bit.
/// On a GPU a copy spanning two registrations is refused by the driver (`invalid argument`):
/// the runs are cut at range boundaries (`pipeline::direct::split_at_ranges`).
fn npy_inputs_over_several_registrations(backend: &str) {
    let d = tmp();
    let dir = d.path();
    let (m, k, n) = (3100usize, 2900usize, 70usize);
    let mut g = mgmm_stream::store::gen::Rng::new(5, 1);
    let a: Vec<f64> = (0..m * k)
        .map(|_| (g.next_u64() >> 40) as f64 / 16777216.0 - 0.5)
        .collect();
    let b: Vec<f64> = (0..k * n)
        .map(|_| (g.next_u64() >> 40) as f64 / 16777216.0 - 0.5)
        .collect();
    write_npy(&dir.join("A.npy"), m, k, &a, DType::F32);
    write_npy(&dir.join("B.npy"), k, n, &b, DType::F32);
    let plan = |mode: &str| {
        format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C_{mode}.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"{backend}\"\ntile = [1600, 70, 2900]\nstaging = \"{mode}\"\n\
             durable = false\n"
        )
    };
    let mut outs = Vec::new();
    for mode in ["copy", "direct"] {
        let rep = run_text(dir, &plan(mode)).unwrap_or_else(|e| panic!("{mode}: {e}"));
        let s = &rep.steps[0];
        assert!(s.direct_failed.is_none(), "{mode}: {:?}", s.direct_failed);
        if mode == "direct" {
            assert!(
                s.direct_bytes >= (m * k * 4) as u64,
                "{mode}: {}",
                s.direct_bytes
            );
        }
        outs.push(load(&dir.join(format!("C_{mode}.mgt"))));
    }
    assert!(outs[0] == outs[1], "direct and copied outputs differ");
}

/// An f32 array in memory as a caller's `out=` (the Python package's `BufferSink`): rows `ld`
/// elements apart (wider than the matrix, as a slice of a larger array is), which offers its
/// blocks to the lanes ([`MatrixSink::direct_rect`]) as page-locked or not, and counts how
/// blocks arrived: copied in by writeback, or written by a lane itself.
struct ArrayOut {
    rows: u64,
    cols: u64,
    ld: u64,
    data: std::sync::Mutex<Vec<f32>>,
    /// The vector's buffer (never reallocated: only written through this address).
    addr: usize,
    page_locked: bool,
    /// Milliseconds each tile's write or announcement takes (a slow consumer).
    slow_ms: u64,
    copied: std::sync::atomic::AtomicU64,
    in_place: std::sync::atomic::AtomicU64,
}

struct ArraySink(std::sync::Arc<ArrayOut>, std::path::PathBuf);

impl mgmm_stream::store::MatrixSink for ArraySink {
    fn path(&self) -> &std::path::Path {
        &self.1
    }
    fn shape(&self) -> (u64, u64) {
        (self.0.rows, self.0.cols)
    }
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn storage_tile(&self) -> (u64, u64) {
        (self.0.rows, self.0.cols)
    }
    fn write_block(&self, b: &Block, host: DType, src: &[u8]) -> mgmm_stream::Result<u32> {
        assert_eq!(host, DType::F32);
        for (i, row) in src.chunks(b.cols as usize * 4).enumerate() {
            let at = self.0.addr + (((b.r0 + i as u64) * self.0.ld + b.c0) * 4) as usize;
            // SAFETY: inside the vector (the block is inside the matrix); blocks are disjoint.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), at as *mut u8, row.len()) };
        }
        std::thread::sleep(std::time::Duration::from_millis(self.0.slow_ms));
        self.0
            .copied
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(0)
    }
    fn direct_rect(&self, b: &Block, host: DType) -> Option<mgmm_stream::store::OutRect> {
        let inside =
            host == DType::F32 && b.r0 + b.rows <= self.0.rows && b.c0 + b.cols <= self.0.cols;
        // SAFETY: the block lies inside the vector, which outlives the step and is written by
        // nothing else meanwhile; "page-locked" is a claim only the simulated lanes rely on
        // (they copy on the host), and the CUDA twin's driver copies pageable memory too.
        inside.then(|| unsafe {
            mgmm_stream::store::OutRect::new(
                (self.0.addr + ((b.r0 * self.0.ld + b.c0) * 4) as usize) as u64,
                self.0.ld as usize * 4,
                b.cols as usize * 4,
                b.rows as usize,
                self.0.page_locked,
                None,
            )
        })
    }
    fn wrote_in_place(&self, b: &Block) -> mgmm_stream::Result<u32> {
        // Announced only once the lane's copy has landed: no element of the block still holds
        // the sentinel the array was filled with.
        for i in b.r0..b.r0 + b.rows {
            for j in b.c0..b.c0 + b.cols {
                let at = self.0.addr + ((i * self.0.ld + j) * 4) as usize;
                // SAFETY: inside the vector; the lane's copy into this block is done.
                let v = unsafe { std::ptr::read_volatile(at as *const f32) };
                assert!(v != 7777.0, "({i}, {j}) announced before it was written");
            }
        }
        // A slow consumer: ended tiles then wait for output leases in the lanes.
        std::thread::sleep(std::time::Duration::from_millis(self.0.slow_ms));
        self.0
            .in_place
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(0)
    }
    fn prefault(&self, _b: &Block) -> u64 {
        0
    }
    fn flush_block(&self, _b: &Block) -> mgmm_stream::Result<()> {
        Ok(())
    }
    fn forget_checksums(&self) {}
    fn finish(self: Box<Self>, _durable: bool) -> mgmm_stream::Result<()> {
        Ok(())
    }
}

/// A product into an array in memory that offers its blocks: the CPU's lanes write every tile
/// into it themselves, a GPU's (simulated) lanes when it says it is page-locked, else writeback
/// copies them in; either way every element matches an f64 reference, nothing beside the
/// matrix (the row pitch's padding) is touched, a NaN in A is counted in the output as it is
/// when tiles are copied, tiles written in place take no output buffer and are announced only
/// once they have landed — also when the output is slow to take them, so that ended tiles
/// wait for room in the lanes while later GEMMs go on.
fn output_array_written_in_place(backend: &str) {
    use mgmm_stream::api::{self, Output, StepJob, StepSources};
    use std::sync::atomic::Ordering::SeqCst;
    let d = tmp();
    let dir = d.path();
    let (m, k, n) = (37usize, 23usize, 29usize);
    let mut g = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        g ^= g << 13;
        g ^= g >> 7;
        g ^= g << 17;
        (g >> 40) as f64 / 16777216.0 - 0.5
    };
    let mut a: Vec<f64> = (0..m * k).map(|_| next()).collect();
    let b: Vec<f64> = (0..k * n).map(|_| next()).collect();
    a[3 * k + 5] = f64::NAN; // row 3 of the product is NaN
    write_npy(&dir.join("A.npy"), m, k, &a, DType::F32);
    write_npy(&dir.join("B.npy"), k, n, &b, DType::F32);
    std::fs::write(
        dir.join("plan.toml"),
        format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C.npy\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"{backend}\"\ntile = 8\ndurable = false\n"
        ),
    )
    .unwrap();
    let plan = mgmm_stream::plan::Plan::load(&dir.join("plan.toml")).unwrap();
    // The inputs as stored (f32), in f64.
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32 as f64).collect::<Vec<f64>>();
    let am = Mat {
        rows: m,
        cols: k,
        v: f32s(&a),
    };
    let bm = Mat {
        rows: k,
        cols: n,
        v: f32s(&b),
    };
    let (want, mag) = reference(&am, false, &bm, false, None, 1.0, 0.0, m, n, k);
    for (page_locked, slow_ms) in [(false, 0), (true, 0), (true, 5), (false, 5)] {
        let ld = n as u64 + 3;
        let mut v = vec![7777.0f32; m * ld as usize];
        let addr = v.as_mut_ptr() as usize;
        let out = std::sync::Arc::new(ArrayOut {
            rows: m as u64,
            cols: n as u64,
            ld,
            data: std::sync::Mutex::new(v),
            addr,
            page_locked,
            slow_ms,
            copied: Default::default(),
            in_place: Default::default(),
        });
        let sink = out.clone();
        let open = |p: &str| mgmm_stream::store::open_source(&dir.join(p)).unwrap();
        let rep = api::run_step(StepJob {
            origin: std::path::Path::new("test"),
            engine: &plan.engine,
            step: &plan.steps[0],
            sources: StepSources {
                a: open("A.npy"),
                b: open("B.npy"),
                c0: None,
            },
            output: Output::Memory(Box::new(move || {
                Ok(Box::new(ArraySink(sink.clone(), "out (array)".into())))
            })),
            restart: false,
            keep_backend: false,
            progress: &mgmm_stream::progress::Progress::quiet(),
        })
        .unwrap()
        .expect("computed");
        let tiles = (m.div_ceil(8) * n.div_ceil(8)) as u64;
        let direct = backend == "cpu" || page_locked;
        let (copied, in_place) = (out.copied.load(SeqCst), out.in_place.load(SeqCst));
        assert_eq!(
            (copied, in_place),
            if direct { (0, tiles) } else { (tiles, 0) },
            "{backend}, page_locked {page_locked}: tiles copied / written in place"
        );
        let pool = rep.pools.iter().find(|p| p.name == "output").unwrap();
        assert_eq!(
            pool.allocated == 0,
            direct,
            "{backend}, page_locked {page_locked}: {pool:?}"
        );
        assert_eq!(rep.nonfinite_outputs, n as u64, "row 3 is NaN");
        assert_eq!(rep.first_nonfinite_tile, Some([0, 0]));
        let v = out.data.lock().unwrap();
        for i in 0..m {
            for j in 0..ld as usize {
                let got = v[i * ld as usize + j] as f64;
                if j >= n {
                    assert_eq!(got, 7777.0, "padding at ({i}, {j}) was written");
                } else if i == 3 {
                    assert!(got.is_nan(), "C[3, {j}] = {got}, want NaN");
                } else {
                    let (r, g) = (want[i * n + j], mag[i * n + j]);
                    let allowed = (k as f64 + 2.0) * f32::EPSILON as f64 / 2.0 * g;
                    assert!(
                        (got - r).abs() <= allowed,
                        "{backend}, page_locked {page_locked}: C[{i}, {j}] = {got}, reference {r}"
                    );
                }
            }
        }
    }
}

per_backend! {
    npy_inputs_over_several_registrations_go_direct => super::npy_inputs_over_several_registrations;
    staging_modes_agree_and_check_inputs => super::staging_modes;
    out_of_core_one_gib_through_64_mib => super::out_of_core;
    two_runs_are_bitwise_identical => super::reproducible;
    corrupt_input_stops_the_run => super::corrupt_input_fails_fast;
    small_memory_budget_forces_many_tiles => super::small_memory_forces_many_tiles;
    output_array_written_in_place_or_copied => super::output_array_written_in_place;
}

/// The `host_memory` that `plan` names when the budget leaves no room to read `.npy` inputs in
/// place, under `tile = "auto"` (whose pools grow with the budget, so "raise host_memory" said
/// nothing useful: from 64 to 96 MiB nothing changed, a new user's trial): at that budget `plan`
/// says they go straight from the pages and the run copies none.
#[test]
fn the_host_memory_plan_names_reads_the_inputs_in_place() {
    // 2048² at 24 MiB: each range fits, a block's seven do not (`plan` said they went straight,
    // and named a budget that fit one range: a new user's trial).
    for (n, low_hm) in [(1024usize, "16MiB"), (2048, "24MiB")] {
        let d = tmp();
        let dir = d.path();
        let v = (0..n * n).map(|i| (i % 7) as f64 - 3.0).collect::<Vec<_>>();
        write_npy(&dir.join("A.npy"), n, n, &v, DType::F32);
        write_npy(&dir.join("B.npy"), n, n, &v, DType::F32);
        let text = |hm: &str| {
            format!(
                "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
                 [[step]]\noutput = \"C{hm}.mgt\"\nexpr = \"A @ B\"\n\
                 [engine]\nbackend = \"cpu\"\nstaging = \"direct\"\nhost_memory = \"{hm}\"\n"
            )
        };
        let said = |hm: &str| {
            std::fs::write(dir.join("plan.toml"), text(hm)).unwrap();
            mgmm_stream::run::describe(
                &mgmm_stream::plan::Plan::load(&dir.join("plan.toml")).unwrap(),
            )
            .unwrap()
            .replace("\n      ", " ")
        };
        let low = said(low_hm);
        let rep = run_text(dir, &text(low_hm)).unwrap();
        let s = &rep.steps[0];
        assert!(
            s.direct_oversize_blocks + s.direct_full_blocks > 0 && low.contains("staged by copy"),
            "{n}: {low}"
        );
        assert!(
            !low.contains("straight from the files' pages"),
            "{n}: {low}"
        );
        let hm = low
            .split("with host_memory = \"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_else(|| panic!("no host_memory named: {low}"))
            .to_string();
        assert!(
            low.contains(&format!(
                "with host_memory = \"{hm}\" they are read in place"
            )),
            "{low}"
        );
        let at = said(&hm);
        assert!(
            at.contains("the lanes copy A, B straight from the files' pages")
                && !at.contains("a range of its file")
                && !at.contains("a block of it holds"),
            "{n}, {hm}: {at}"
        );
        let rep = run_text(dir, &text(&hm)).unwrap();
        let s = &rep.steps[0];
        assert!(
            s.direct_oversize_blocks == 0 && s.direct_full_blocks == 0 && s.direct_bytes > 0,
            "{n}, {hm}: {s:?}"
        );
    }
}

/// `staging = "direct"` on the CPU with less `host_memory` beside the pools than one range of a
/// `.npy` input: `plan` says those inputs are staged by copy, why, and what to raise (it said
/// they went straight from the files' pages, and the run's summary then spoke of "the 0 B"),
/// and the run copies exactly then; with room for the ranges, both say straight from the pages.
#[test]
fn plan_says_when_host_memory_leaves_no_room_to_read_inputs_in_place() {
    let d = tmp();
    let dir = d.path();
    let (m, k, n) = (300, 520, 260);
    let v = |len: usize| (0..len).map(|i| (i % 7) as f64 - 3.0).collect::<Vec<_>>();
    write_npy(&dir.join("A.npy"), m, k, &v(m * k), DType::F32);
    write_npy(&dir.join("B.npy"), k, n, &v(k * n), DType::F32);
    for (hm, room) in [("2MiB", false), ("4MiB", true)] {
        let text = format!(
            "[matrices.A]\npath = \"A.npy\"\n[matrices.B]\npath = \"B.npy\"\n\
             [[step]]\noutput = \"C{hm}.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"cpu\"\nstaging = \"direct\"\nhost_memory = \"{hm}\"\n\
             tile = [128, 128, 128]\n"
        );
        std::fs::write(dir.join("plan.toml"), &text).unwrap();
        let said = mgmm_stream::run::describe(
            &mgmm_stream::plan::Plan::load(&dir.join("plan.toml")).unwrap(),
        )
        .unwrap()
        .replace("\n      ", " ");
        let rep = run_text(dir, &text).unwrap();
        let s = &rep.steps[0];
        match room {
            true => {
                assert!(
                    said.contains("the lanes copy A, B straight from the files' pages")
                        && said.contains("holds only 2 of their ranges"),
                    "{hm}: {said}"
                );
                assert_eq!(s.direct_oversize_blocks, 0, "{hm}");
                assert!(s.direct_bytes > 0, "{hm}");
            }
            false => {
                assert!(
                    said.contains("A (a range of its file")
                        && said.contains("they are read in place")
                        && said.contains("staged by copy")
                        && !said.contains("straight from the files' pages"),
                    "{hm}: {said}"
                );
                assert!(s.direct_oversize_blocks > 0 && s.direct_bytes == 0, "{hm}");
            }
        }
    }
}
