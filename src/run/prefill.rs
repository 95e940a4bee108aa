//! What a run's first CUDA pipeline will allocate, worked out before the backend exists, so
//! that the CUDA backend can prepare it while the driver starts: populating the pinned pools'
//! memory, and each GPU's first GEMM of the step's tile shape.
//!
//! This is the run's guess, not the backend's: it needs the whole plan (the step with the
//! largest pools), its inputs opened (whether the staging pools will be leases without memory,
//! as the pipeline decides: [`direct::expected`]) and the environment (`CUDA_VISIBLE_DEVICES`,
//! `MGMM_PINNED_ALLOC`, read by [`crate::config`]). The backend gets only the numbers, an
//! [`EarlySpec`], in its [`BackendOptions`].

use crate::backend::cuda::{cuda_caps, pinned_len, AUTO_COPIES_FROM};
use crate::backend::{resolve_threads, BackendOptions, EarlySpec};
use crate::pipeline::direct;
use crate::plan::layout::Layout;
use crate::plan::{BackendKind, Devices, Engine, Operand, Plan, Step};
use crate::store::MatrixSource;
use std::path::Path;

/// The options of the backend that runs `plan`: the settings of the environment, and what a
/// CUDA backend can prepare before its driver is up ([`early_spec`]).
pub(crate) fn backend_options(plan: &Plan) -> BackendOptions {
    options(early_spec(
        plan,
        crate::config::cuda_visible_devices().as_deref(),
    ))
}

/// The options of the backend that runs one step over operands its caller opened
/// ([`crate::api::run_step`], the Python package): the same early start as `run` gives a
/// one-step plan ([`early_spec_for_step`]), so a library call does not wait for the driver,
/// the pinned pools and cuBLAS's first kernel one after the other. `out`: the output's first
/// block as the output offers it to be written in place ([`crate::store::MatrixSink::direct_rect`]):
/// where a GPU's lanes will write it so, no output buffers are prepared.
pub(crate) fn backend_options_for_step(
    origin: &Path,
    engine: &Engine,
    step: &Step,
    inputs: [&dyn MatrixSource; 2],
    out: Option<crate::seam::OutRect>,
) -> BackendOptions {
    let visible = crate::config::cuda_visible_devices();
    options(early_spec_for_step(
        origin,
        engine,
        step,
        inputs,
        gpus(engine, visible.as_deref()),
        out,
    ))
}

fn options(early: Option<EarlySpec>) -> BackendOptions {
    BackendOptions {
        pinned_alloc: crate::config::pinned_alloc(),
        early,
    }
}

/// The GPUs a CUDA backend for `engine` may find (0: none, or a backend that cannot be CUDA).
fn gpus(engine: &Engine, visible: Option<&str>) -> usize {
    match engine.backend {
        BackendKind::Cuda | BackendKind::Auto => guess_gpu_count(engine, visible),
        _ => 0,
    }
}

/// What a CUDA backend for `plan` can prepare before the driver is up, on GPUs that
/// `CUDA_VISIBLE_DEVICES` = `visible` lets through: `None` when the plan's backend cannot be
/// CUDA, no GPU is in sight or no layout can be made.
fn early_spec(plan: &Plan, visible: Option<&str>) -> Option<EarlySpec> {
    early_spec_with(plan, gpus(&plan.engine, visible))
}

/// [`early_spec`] on `lanes` GPUs.
fn early_spec_with(plan: &Plan, lanes: usize) -> Option<EarlySpec> {
    let (order, l) = guess_layout(plan, lanes)?;
    let step = plan.steps.iter().find(|s| s.order() == order)?;
    let open = |op: &Operand| (!op.temp).then(|| op.open().ok()).flatten();
    let lazy = match (open(&step.a), open(&step.b)) {
        (Some(a), Some(b)) => staging_lazy(&plan.engine, step, &l, [&*a, &*b]),
        _ => false,
    };
    Some(spec(&plan.engine, order, &l, lanes, lazy, false))
}

/// [`early_spec`] for one step over opened operands, on `lanes` GPUs.
fn early_spec_for_step(
    origin: &Path,
    engine: &Engine,
    step: &Step,
    inputs: [&dyn MatrixSource; 2],
    lanes: usize,
    out: Option<crate::seam::OutRect>,
) -> Option<EarlySpec> {
    if lanes == 0 {
        return None;
    }
    let caps = cuda_caps(lanes, engine.device_memory.unwrap_or(64 << 30));
    let l = Layout::new(origin, step, engine, &caps).ok()?;
    let lazy = staging_lazy(engine, step, &l, inputs);
    let in_place = out.is_some_and(|r| caps.writes_directly(&r));
    Some(spec(engine, step.order(), &l, lanes, lazy, in_place))
}

/// The early start of plan step `order` laid out as `l` on `lanes` GPUs; `lazy`: its staging
/// pools will be leases without memory ([`staging_lazy`]); `in_place`: its tiles go straight
/// into the output (decision 0021), whose pool will be leases without memory too. Only the
/// pools that will have memory are prefilled.
fn spec(
    e: &Engine,
    order: (usize, usize),
    l: &Layout,
    lanes: usize,
    lazy: bool,
    in_place: bool,
) -> EarlySpec {
    let mut lens = pool_lens(l, lanes);
    if in_place {
        lens.truncate(l.staging_bufs * lanes);
    }
    if lazy {
        lens.drain(..l.staging_bufs * lanes);
    }
    EarlySpec {
        pool_lens: lens,
        step: order,
        threads: resolve_threads(e.threads),
        tile: (l.tm as usize, l.tn as usize, l.tk as usize),
        precision: e.precision,
        devices: match &e.devices {
            Devices::List(l) => Some(l.iter().map(|&d| d as usize).collect()),
            _ => None,
        },
    }
}

/// How many GPUs `CUDA_VISIBLE_DEVICES` lets CUDA see, read as CUDA reads it: indices or
/// `GPU-`/`MIG-` UUIDs up to the first entry that is neither (`"0,1,-1,2"`: two; `"-1"`,
/// `""`: none).
fn visible_count(v: &str) -> usize {
    v.split(',')
        .map(str::trim)
        .take_while(|x| x.parse::<u32>().is_ok() || x.starts_with("GPU-") || x.starts_with("MIG-"))
        .count()
}

/// The GPUs a run of `engine` would use, guessed without starting the driver: the listed
/// ones, or those `CUDA_VISIBLE_DEVICES` (`visible`, when set) lets through, at most as many
/// as the driver lists under `/proc/driver/nvidia/gpus`. 0 when there is no sign of a GPU.
fn guess_gpu_count(engine: &Engine, visible: Option<&str>) -> usize {
    let present = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    let n = match (&engine.devices, visible) {
        (Devices::List(l), _) => l.len(),
        (_, Some(v)) => visible_count(v),
        _ => present,
    };
    n.min(present)
}

/// The [`Step::order`](crate::plan::Step::order) and layout of `plan`'s step with the largest pinned pools on `lanes` GPUs (the largest: a
/// chain's first part is often tiny, and the pools of one step are reused by the next when
/// the sizes match). `None` when there is no GPU or no layout can be made. Device memory is
/// taken as 64 GiB (or `engine.device_memory`): it changes the layout only through the tile
/// size, which on GPUs with less memory may come out smaller — then the guess goes unused:
/// the prefilled buffers are freed once the first pools are made, and the lanes warm up
/// their own tile shape.
fn guess_layout(plan: &Plan, lanes: usize) -> Option<((usize, usize), Layout)> {
    let e = &plan.engine;
    if lanes == 0 {
        return None;
    }
    let caps = cuda_caps(lanes, e.device_memory.unwrap_or(64 << 30));
    (plan.steps.iter())
        .filter_map(|step| Some((step.order(), Layout::new(&plan.path, step, e, &caps).ok()?)))
        .max_by_key(|(_, l)| pool_lens(l, lanes).iter().sum::<usize>())
}

/// Whether the staging pools of `step` (laid out as `l`, its operands `inputs` open) will be
/// lazy, as [`crate::pipeline::Engines::make`] will decide (a header read and a residency
/// check), assuming the GPUs can register read-only maps (if not, the pools are allocated up
/// front without the prefill's help).
fn staging_lazy(e: &Engine, step: &Step, l: &Layout, inputs: [&dyn MatrixSource; 2]) -> bool {
    let t = std::time::Instant::now();
    let limits = direct::limits(None, e.host_memory, l.host_bytes);
    let (a, b) = crate::plan::schedule::Schedule::first_blocks(step, l);
    let mode = (e.staging).on_lanes(l.lanes, AUTO_COPIES_FROM);
    let pinning = direct::Pinning::new(limits, true, e.precision);
    let firsts = [(inputs[0], a), (inputs[1], b)];
    let lazy = direct::expected(
        mode,
        Some(pinning),
        &firsts,
        &direct::copied_sources(mode, pinning, &firsts, l.host_dt).1,
        step.c0.is_some(),
        l.host_dt,
    );
    crate::trace::span("start-up", "inputs direct?", t, std::time::Instant::now());
    lazy
}

/// The byte lengths of the pinned buffers of `l`'s pools on `lanes` GPUs, as the CUDA
/// backend's allocator rounds them ([`pinned_len`]).
fn pool_lens(l: &Layout, lanes: usize) -> Vec<usize> {
    let mut lens = vec![pinned_len(l.staging_buf_bytes as usize); l.staging_bufs * lanes];
    lens.extend(std::iter::repeat_n(
        pinned_len(l.out_buf_bytes as usize),
        l.out_bufs * lanes,
    ));
    lens
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefill leaves out the staging buffers when the step's inputs will go straight from
    /// their pages (the pools then lease tokens); not with `staging = "copy"`, nor for inputs
    /// that cannot be opened yet.
    #[test]
    fn prefill_leaves_out_staging_buffers_when_the_inputs_go_direct() {
        let dir = tempfile::tempdir().unwrap();
        for (name, seed) in [("A.mgt", 1), ("B.mgt", 2)] {
            let spec = crate::store::gen::GenSpec {
                rows: 96,
                cols: 96,
                dtype: crate::dtype::DType::F32,
                tile: (32, 32),
                dist: crate::store::gen::Dist::Normal,
                seed,
            };
            crate::store::gen::generate(&dir.path().join(name), &spec).unwrap();
        }
        let plan_with = |staging: &str, b: &str| {
            let text = format!(
                "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"{b}\"\n\
                 [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
                 [engine]\nbackend = \"cuda\"\nstaging = \"{staging}\"\n"
            );
            let path = dir.path().join("p.toml");
            std::fs::write(&path, text).unwrap();
            crate::plan::Plan::load(&path).unwrap()
        };
        let caps = cuda_caps(1, 64 << 30);
        for (staging, want) in [("auto", true), ("direct", true), ("copy", false)] {
            let plan = plan_with(staging, "B.mgt");
            let l = Layout::new(&plan.path, &plan.steps[0], &plan.engine, &caps).unwrap();
            let (a, b) = (
                plan.steps[0].a.open().unwrap(),
                plan.steps[0].b.open().unwrap(),
            );
            let lazy = staging_lazy(&plan.engine, &plan.steps[0], &l, [&*a, &*b]);
            assert_eq!(lazy, want, "{staging}");
        }
        // One step over operands a library caller opened: the same early start as the plan.
        let plan = plan_with("auto", "B.mgt");
        let step = &plan.steps[0];
        let (a, b) = (step.a.open().unwrap(), step.b.open().unwrap());
        let one = early_spec_for_step(&plan.path, &plan.engine, step, [&*a, &*b], 1, None).unwrap();
        let (order, l) = guess_layout(&plan, 1).unwrap();
        let lazy = staging_lazy(&plan.engine, step, &l, [&*a, &*b]);
        assert_eq!(one, spec(&plan.engine, order, &l, 1, lazy, false));
        assert!(
            one.pool_lens.len() == l.out_bufs,
            "staging left out: {one:?}"
        );
        // An output the GPU writes in place (a pinned array, a GPU array): no output buffers;
        // a pageable one: the same as a file.
        // SAFETY: never written: only its kind is asked of.
        let rect = |page_locked, gpu| unsafe {
            crate::seam::OutRect::new(4096, 4, 4, 1, page_locked, gpu)
        };
        for (out, buffers) in [
            (rect(true, None), 0),
            (rect(false, Some(0)), 0),
            (rect(false, None), l.out_bufs),
        ] {
            let s = early_spec_for_step(&plan.path, &plan.engine, step, [&*a, &*b], 1, Some(out));
            assert_eq!(s.unwrap().pool_lens.len(), buffers, "{out:?}");
        }
        // An input not there yet (to be generated, say): the pools are made up front.
        let mut plan = plan_with("auto", "B.mgt");
        std::fs::remove_file(dir.path().join("B.mgt")).unwrap();
        plan.steps[0].b.path = dir.path().join("B.mgt");
        assert!(early_spec_with(&plan, 1)
            .is_some_and(|e| e.pool_lens.len() == l.staging_bufs + l.out_bufs));
    }

    /// The prefill's guess is the pools' own sizes: for 32768² fp32 on one GPU, six staging
    /// buffers and three output buffers of one 8192² f32 tile each, twice as many on two; the
    /// largest step of a chain, not its tiny first part; nothing without a GPU.
    #[test]
    fn prefill_guesses_the_pools_of_the_largest_step() {
        let dir = tempfile::tempdir().unwrap();
        let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 32768, cols = 32768 }\n\
                    [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 32768, cols = 32768 }\n\
                    [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
                    [engine]\nbackend = \"cuda\"\ndevices = [0]\nhost_memory = \"16GiB\"\n";
        let path = dir.path().join("p.toml");
        std::fs::write(&path, text).unwrap();
        let plan = crate::plan::Plan::load(&path).unwrap();
        let pool_lens_on = |plan: &crate::plan::Plan, lanes: usize| {
            (guess_layout(plan, lanes).map(|(_, l)| pool_lens(&l, lanes))).unwrap_or_default()
        };
        let tile = 8192 * 8192 * 4;
        assert_eq!(pool_lens_on(&plan, 1), vec![tile; 9]);
        assert_eq!(pool_lens_on(&plan, 2), vec![tile; 18]);
        assert!(pool_lens_on(&plan, 0).is_empty());
        let (_, l) = guess_layout(&plan, 1).unwrap();
        assert_eq!(
            (l.tm, l.tn, l.tk),
            (8192, 8192, 8192),
            "the early warm-up's shape"
        );
        let caps = cuda_caps(1, 64 << 30);
        let l = Layout::new(&plan.path, &plan.steps[0], &plan.engine, &caps).unwrap();
        assert_eq!((l.staging_bufs, l.out_bufs), (6, 3));
        // The 43 GB chain: two parts, the first 3000×100·100×100; the guess is the second's.
        let text = "[matrices.A]\npath = \"A.mgt\"\ngenerate = { rows = 3000, cols = 100 }\n\
                    [matrices.B]\npath = \"B.mgt\"\ngenerate = { rows = 100, cols = 100 }\n\
                    [matrices.C]\npath = \"C.mgt\"\ngenerate = { rows = 100, cols = 3600000 }\n\
                    [[step]]\noutput = \"D.mgt\"\nexpr = \"(A @ B @ C).T\"\n\
                    [engine]\nbackend = \"cuda\"\nhost_memory = \"16GiB\"\n";
        std::fs::write(&path, text).unwrap();
        let chain = crate::plan::Plan::load(&path).unwrap();
        assert_eq!(chain.steps.len(), 2);
        let big = Layout::new(&chain.path, &chain.steps[1], &chain.engine, &caps).unwrap();
        let lens = pool_lens_on(&chain, 1);
        assert_eq!(
            guess_layout(&chain, 1).unwrap().0,
            (0, 2),
            "made for the second part"
        );
        assert!(lens.contains(&pinned_len(big.out_buf_bytes as usize)));
        assert!(lens.iter().sum::<usize>() > 100 << 20, "{lens:?}");
    }

    /// `CUDA_VISIBLE_DEVICES` as CUDA reads it: up to the first entry that is not a GPU.
    #[test]
    fn visible_devices_stop_at_the_first_invalid_entry() {
        assert_eq!(visible_count("0,1"), 2);
        assert_eq!(visible_count("0,1,-1,2"), 2);
        assert_eq!(visible_count("-1"), 0);
        assert_eq!(visible_count(""), 0);
        assert_eq!(visible_count("GPU-8f2c,MIG-1a2b/1/0"), 2);
    }
}
