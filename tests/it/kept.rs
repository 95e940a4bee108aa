//! A backend kept between library calls (src/backend/kept.rs): the Python package's calls take
//! the backend the previous call left when their settings are the same, and compute the same
//! bytes with it; other settings or `release` leave nothing behind to be taken (a device's
//! failure neither: src/backend/kept.rs's unit tests).
//! The kept backend is the process's, so these tests take turns (`TURN`); the other modules'
//! library calls do not ask to keep one.

use std::path::Path;
use std::sync::Mutex;

use mgmm_stream::api::{self, FileOutput, Output, StepJob, StepSources};
use mgmm_stream::backend::kept;
use mgmm_stream::plan::{Engine, Plan};
use mgmm_stream::progress::Progress;
use mgmm_stream::run::{run_plan, RunOptions, StepReport};

use crate::common::{digest, small_inputs, tmp};

static TURN: Mutex<()> = Mutex::new(());

/// One library call computing `A @ B` into `out` under `engine`.
fn call(plan: &Plan, engine: &Engine, out: &Path, keep: bool) -> mgmm_stream::Result<StepReport> {
    let dir = plan.path.parent().unwrap();
    let mut step = plan.steps[0].clone();
    step.output = out.to_path_buf();
    let open = |p: &Path| mgmm_stream::store::open_source(p).unwrap();
    let rep = api::run_step(StepJob {
        origin: Path::new("matmul()"),
        engine,
        step: &step,
        sources: StepSources {
            a: open(&dir.join("A.mgt")),
            b: open(&dir.join("B.mgt")),
            c0: None,
        },
        output: Output::File(Box::new(FileOutput(out.to_path_buf()))),
        restart: false,
        keep_backend: keep,
        progress: &Progress::quiet(),
    })?;
    Ok(rep.expect("a new output is computed"))
}

fn kept_backend_serves_calls_with_the_same_settings(backend: &str) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    kept::release();
    let d = tmp();
    let dir = d.path();
    small_inputs(dir);
    std::fs::write(
        dir.join("plan.toml"),
        format!(
            "[matrices.A]\npath = \"A.mgt\"\n[matrices.B]\npath = \"B.mgt\"\n\
             [[step]]\noutput = \"C.mgt\"\nexpr = \"A @ B\"\n\
             [engine]\nbackend = \"{backend}\"\ntile = 8\ndurable = false\n"
        ),
    )
    .unwrap();
    let plan = Plan::load(&dir.join("plan.toml")).unwrap();
    let e = plan.engine.clone();

    let r1 = call(&plan, &e, &dir.join("C1.mgt"), true).unwrap();
    assert!(!r1.backend_reused, "nothing was kept before the first call");
    assert!(
        kept::kept_name().is_some(),
        "the first call leaves its backend"
    );
    assert_eq!(r1.setup_s[0].0, "backend", "{:?}", r1.setup_s);
    let r2 = call(&plan, &e, &dir.join("C2.mgt"), true).unwrap();
    assert!(r2.backend_reused, "the same settings take the kept backend");
    assert_eq!(r2.backend, r1.backend);
    assert_eq!(
        digest(&dir.join("C1.mgt")),
        digest(&dir.join("C2.mgt")),
        "the kept backend computes the same bytes"
    );

    // Another thread count is another backend: made anew, and it replaces the kept one.
    let other = Engine {
        threads: 1,
        ..e.clone()
    };
    let r3 = call(&plan, &other, &dir.join("C3.mgt"), true).unwrap();
    assert!(!r3.backend_reused);
    let r4 = call(&plan, &other, &dir.join("C4.mgt"), true).unwrap();
    assert!(r4.backend_reused);
    let r5 = call(&plan, &e, &dir.join("C5.mgt"), true).unwrap();
    assert!(!r5.backend_reused, "the first settings' backend was let go");
    assert_eq!(digest(&dir.join("C1.mgt")), digest(&dir.join("C5.mgt")));

    // A call that does not ask to keep one neither takes nor replaces the kept backend.
    let r6 = call(&plan, &other, &dir.join("C6.mgt"), false).unwrap();
    assert!(!r6.backend_reused);
    assert!(
        call(&plan, &e, &dir.join("C7.mgt"), true)
            .unwrap()
            .backend_reused
    );

    // A run that fails for its input or output (here an output folder that is a file) keeps
    // the backend: the next call takes it (a device failure drops it: backend::kept's tests).
    let bad = dir.join("no such folder").join("C.mgt");
    std::fs::write(dir.join("no such folder"), b"a file, not a folder").unwrap();
    assert!(call(&plan, &e, &bad, true).is_err());
    assert!(kept::kept_name().is_some(), "kept after an output's error");
    assert!(
        call(&plan, &e, &dir.join("C8.mgt"), true)
            .unwrap()
            .backend_reused
    );

    // `run` through the library keeps one the same way (Dask tasks run plans).
    let opts = RunOptions {
        keep_backend: true,
        ..Default::default()
    };
    let r = run_plan(&plan, &opts, &Progress::quiet()).unwrap();
    assert!(
        r.steps[0].backend_reused,
        "the plan has the calls' settings"
    );
    assert_eq!(digest(&dir.join("C.mgt")), digest(&dir.join("C1.mgt")));

    assert!(kept::release(), "one was kept");
    assert!(!kept::release(), "and is gone");
    assert!(kept::kept_name().is_none());
}

per_backend! {
    same_settings => super::kept_backend_serves_calls_with_the_same_settings;
}
