//! The text `mgmm-stream plan` prints: the resolved plan, each step's tiles, memory, traffic
//! model and a lower bound on its time, before anything runs; every line within 80 columns.

use crate::backend::{self, describe_precision, Backend, MemorySpace};
use crate::error::Result;
use crate::plan::layout::Layout;
use crate::plan::schedule::{traffic, Traffic};
use crate::plan::{Plan, Precision};
use crate::progress::count;
use crate::units::fmt_bytes;

/// Disk read rate assumed for the cold-cache bound (documented in docs/PLAN.md).
const DISK_READ: f64 = 1.6e9;

/// The text `mgmm-stream plan` prints.
pub fn describe(plan: &Plan) -> Result<String> {
    let sel = backend::select(&plan.engine)?;
    let caps = sel.caps();
    let device = caps.memory == MemorySpace::Device;
    let e = &plan.engine;
    let mut s = format!("plan {}\n", plan.path.display());
    if let Some(n) = sel.note() {
        s += &format!("note: {n}\n");
    }
    let name = sel.name();
    s += &format!(
        "engine: backend {} | precision {}{} | host_memory {}{}\n",
        name,
        describe_precision(e.precision),
        // The CPU backend's name already says how many threads it computes with.
        if name.contains("thread") {
            String::new()
        } else {
            format!(" | threads {}", sel.threads())
        },
        fmt_bytes(e.host_memory),
        if device {
            format!(
                " | device budget {} per device",
                fmt_bytes(caps.device_memory)
            )
        } else {
            String::new()
        }
    );
    if let Some(w) = e.threads_note() {
        s += &format!("warning: {w}\n");
    }
    if let (crate::plan::Precision::Fp64, "cuda", Some(step)) =
        (e.precision, caps.kind, plan.steps.first())
    {
        // A GPU whose fp64 is a small fraction of its int8 rate: say that the emulation exists.
        let first = name.split(" + ").next().unwrap_or("");
        let gpu = first.split_once(' ').map_or(first, |(_, n)| n);
        let tk = crate::run::layout_for(&plan.path, step, e, caps, false)?.tk;
        let n = backend::ozaki::expected_moduli(crate::plan::EmulationModuli::Auto, tk);
        if let Some(h) = backend::rates::emulation_hint(gpu, n) {
            s += &format!("note: {h}\n");
        }
    }
    s += "matrices:\n";
    for d in &plan.matrices {
        s += &format!(
            "  {:<6} {}×{} {}  {}{}\n",
            d.name,
            d.rows,
            d.cols,
            d.dtype,
            d.path.display(),
            if d.generate.is_some() {
                "  (missing: will be generated)"
            } else {
                ""
            }
        );
    }
    let layouts = (plan.steps.iter())
        .map(|st| crate::run::layout_for(&plan.path, st, e, caps, false))
        .collect::<Result<Vec<_>>>()?;
    for (step, l) in plan.steps.iter().zip(&layouts) {
        s += &describe_step(plan, step, l, sel.as_ref())?;
    }
    // What `run` checks before any work (space, writable folders), said here too: a new user
    // learnt only from `run` that a 100000² plan needed 112 GiB more than the disk had.
    if let Err(why) = crate::run::space::check_space(plan, &layouts, true) {
        s += &format!("warning: `run` will refuse to start: {why}\n");
    }
    Ok(crate::progress::wrap(&s))
}

/// `plan`'s lines for one step: shapes, tiles, pools, traffic model and bounds.
fn describe_step(
    plan: &Plan,
    step: &crate::plan::Step,
    l: &Layout,
    sel: &dyn Backend,
) -> Result<String> {
    let caps = sel.caps();
    let device = caps.memory == MemorySpace::Device;
    let e = &plan.engine;
    let t = traffic(step, l);
    let mut s = describe_shape(step, l, &t);
    if let Some(w) = l.small_tile_note(step, &plan.engine) {
        s += &format!("  warning: {w}\n");
    }
    // A step resumed from its journal keeps the compute tile it records (`run::layout_for`)
    // where `tile = "auto"` would now pick another: said, or `plan` after a run showed a tile
    // no setting explains (a new user's trial).
    if let Ok(now) = Layout::new(&plan.path, step, e, caps) {
        if (now.tm, now.tn, now.tk) != (l.tm, l.tn, l.tk) {
            let finished = crate::durable::journal::peek(&step.output)
                .is_ok_and(|j| j.is_some_and(|j| j.complete));
            s += &format!(
                "  (the compute tile the journal of {} records: `run` keeps it {}; `tile = \"auto\"` would pick {}×{}×{} now, which `run --restart` takes)\n",
                step.output.display(),
                if finished {
                    "for the finished step, which it skips"
                } else {
                    "to resume the tiles it finished"
                },
                now.tm,
                now.tn,
                now.tk
            );
        }
    }
    s += &describe_emulation(e.precision, l.tk, t.gemms);
    s += &describe_memory(l, e, device);
    s += describe_order(step, l);
    s += &format!(
        "  traffic: read {} from {} (minimum {}; {} tile loads), {} {}, {} {}, write {}\n",
        fmt_bytes(t.read_bytes),
        step.inputs_from(),
        fmt_bytes(t.min_read_bytes),
        t.tile_loads,
        caps.link_names.0,
        fmt_bytes(t.h2d_bytes),
        caps.link_names.1,
        fmt_bytes(t.d2h_bytes),
        fmt_bytes(t.write_bytes)
    );
    if !step.output_in_memory() {
        s += &describe_write(step, l, e);
    }
    s += &describe_staging(
        plan,
        step,
        l,
        caps,
        caps.staging(e.staging),
        caps.memory == MemorySpace::Device,
    );
    s += &describe_bounds(step, l, &t, sel, e);
    s += &describe_status(plan, step, l, caps.kind, e.precision)?;
    Ok(s)
}

/// The step's first lines: what it computes (and its chain), its shapes, the compute tile and
/// grid, and the row tile when the lanes' rows were evened out.
fn describe_shape(step: &crate::plan::Step, l: &Layout, t: &Traffic) -> String {
    let mut s = String::new();
    let (gm, gn, gk) = l.grid(step);
    s += &match &step.chain {
        // "step 1 (line 9), part 1/2 of (A2 @ A.T @ A).T: T1 (held in memory) = A.T @ A": the
        // part's own product, not the whole expression under the intermediate's name.
        Some(c) => {
            let whole = (step.expr.rsplit_once(" [part ")).map_or(step.expr.as_str(), |(w, _)| w);
            let sub = (c.text.strip_prefix(c.result_name()))
                .and_then(|r| r.strip_prefix(" = "))
                .unwrap_or(&c.text);
            format!(
                "{}, part {}/{} of {whole}: {} = {sub}\n",
                step.at(),
                c.part,
                c.parts,
                step.output_label()
            )
        }
        None => format!(
            "{}: {} = {}\n",
            step.at(),
            step.output_label(),
            crate::plan::readable_expr(&step.expr)
        ),
    };
    if let Some(c) = &step.chain {
        let h = crate::pipeline::output_header(step, l);
        let mem_bytes = step.m * step.n * step.out_dtype.size() as u64;
        let file_bytes = crate::store::output_file_len(&step.output, &h);
        s += &c.describe(&step.output, mem_bytes, file_bytes);
    }
    // The operands by their own names (`op(A)`, `op(B)`, `C` collided with a plan's own A, B
    // and C); what the step computes is named as the chain's text names it (`T1`), else by
    // its output file.
    let (m, n, k) = (step.m, step.n, step.k);
    let out = match &step.chain {
        Some(c) if c.part < c.parts => c.result_name().to_string(),
        _ => step.output.display().to_string(),
    };
    s += &format!(
        "  shapes: {} {m}×{k} @ {} {k}×{n}{} → {out} {m}×{n}  alpha {} beta {}\n",
        step.a.label(),
        step.b.label(),
        step.c0
            .as_ref()
            .map(|c| format!(" + {} {m}×{n}", c.label()))
            .unwrap_or_default(),
        step.alpha,
        step.beta
    );
    s += &format!(
        "  compute tile {}×{}×{}: {} ({}×{}), {} each, {}; output storage tile {}×{}\n",
        l.tm,
        l.tn,
        l.tk,
        count(gm * gn, "output tile", "output tiles"),
        gm,
        gn,
        count(gk, "k-step", "k-steps"),
        count(t.gemms, "GEMM call", "GEMM calls"),
        l.out_tile.0,
        l.out_tile.1
    );
    if let Some(t) = l.rows_evened {
        let lanes = l.lanes as u64;
        let ((lo, hi), (lo0, hi0)) = (
            crate::plan::layout::lane_rows(step.m, l.tm, lanes),
            crate::plan::layout::lane_rows(step.m, t, lanes),
        );
        s += &format!(
            "  row tile {} instead of {t}: lanes take tile rows in turn, so each gets {lo}–{hi} of the {} rows instead of {lo0}–{hi0}\n",
            l.tm, step.m
        );
    }
    s
}

/// Under `precision = "fp64_emulated"`: the moduli setting and the predicted cost, N + 1
/// integer GEMMs per block (N residue products and one for the accuracy bound), with N the
/// forced count or what `auto` is expected to pick for normal data at the tile's depth.
fn describe_emulation(p: crate::plan::Precision, tk: u64, gemms: u64) -> String {
    use crate::plan::{EmulationModuli, Precision};
    let Precision::Fp64Emulated(m) = p else {
        return String::new();
    };
    let n = backend::ozaki::expected_moduli(m, tk) as u64;
    let (setting, rule) = match m {
        EmulationModuli::Auto => (
            format!("auto (the fewest within the accuracy bound, chosen per block from its data; about {n} for normal data at k = {tk})"),
            "blocks no count up to 16 keeps within the bound, and blocks with NaN/Inf, run as native fp64 and are counted (emulation.fallback_tiles)",
        ),
        EmulationModuli::Fixed(_) => (
            format!("{n} (forced)"),
            "blocks that count leaves outside the accuracy bound are computed with it and counted; blocks with NaN/Inf run as native fp64",
        ),
    };
    format!(
        "  emulation: moduli {setting}; {} integer GEMMs per block, about {} in all; {rule}\n",
        n + 1,
        (n + 1).saturating_mul(gemms)
    )
}

/// The host pools and the host ceiling, and on a GPU the device memory per lane.
fn describe_memory(l: &Layout, e: &crate::plan::Engine, device: bool) -> String {
    let mut s = String::new();
    s += &format!(
        "  host pools: staging {}×{} per lane, output {}×{} per lane{}  => host ceiling {} of {}\n",
        l.staging_bufs,
        fmt_bytes(l.staging_buf_bytes),
        l.out_bufs,
        fmt_bytes(l.out_buf_bytes),
        if device {
            String::new()
        } else {
            format!(
                ", tile cache {}×{}, accumulators {}×{}",
                l.slots,
                fmt_bytes(l.slot_bytes),
                l.accs,
                fmt_bytes(l.acc_bytes)
            )
        },
        fmt_bytes(l.host_bytes),
        fmt_bytes(e.host_memory)
    );
    if device {
        s += &format!(
            "  device per lane: tile cache {}×{} ({}), accumulators {}×{}{} => {}\n",
            l.slots,
            fmt_bytes(l.slot_bytes),
            l.dev_dt,
            l.accs,
            fmt_bytes(l.acc_bytes),
            if l.landing > 0 {
                format!(", landing {}×{}", l.landing, fmt_bytes(l.landing_bytes))
            } else {
                String::new()
            },
            fmt_bytes(l.device_bytes)
        );
    }
    s
}

/// The order each lane computes its output tiles in.
fn describe_order(step: &crate::plan::Step, l: &Layout) -> &'static str {
    // Every backend: the CPU's lanes have no device tile cache, so they walk row bands. The
    // schedule is built only when the tile cache holds the inputs, which bounds its tile count
    // (a million² plan on the CPU has 2.4·10⁸ tiles: building them took `plan` 110 s).
    let fit = l.squares_fit(step, l.lanes);
    let grows = fit && {
        let sched = crate::plan::schedule::Schedule::new(step, l);
        let all = (0..sched.tiles.len() as u32).collect();
        crate::pipeline::stages::TileQueue::new(&sched, all, l.lanes, fit).grows()
    };
    if grows {
        "  order: each lane in growing squares (its inputs fit its tile cache)\n"
    } else {
        "  order: each lane in serpentine row bands\n"
    }
}

/// What `run` would do with what is already on disk for `step`: skip it (complete), resume it,
/// start it afresh, or refuse (an output without a journal, a journal of another plan, other
/// inputs or another backend, or one it cannot read), or that a split run is writing it. Read
/// without locking or changing anything; empty when nothing is there yet, or when the inputs
/// are not there to compare with (they are to be generated).
fn describe_status(
    plan: &Plan,
    step: &crate::plan::Step,
    l: &Layout,
    kind: &str,
    p: Precision,
) -> Result<String> {
    use crate::durable::journal;
    if step.output_in_memory() {
        return Ok(String::new());
    }
    let out = step.output.display();
    let line = |s: String| Ok(format!("  status: {s}\n"));
    let shards = crate::durable::split::state_dir(&step.output);
    let plan_path = plan.path.display();
    if crate::store::fsutil::refuse_link(&step.output).is_err() {
        return line(format!("{out} is a symbolic link: `run` refuses it, with or without `--restart` (the warning below says what to do)"));
    }
    let ckpt = crate::durable::checkpoint::partial_dir(&step.output);
    if crate::durable::checkpoint::refuse_unusable_dir(&ckpt).is_err() {
        let what = odd_kind(&ckpt, "not a folder");
        return line(format!("{}, the step's checkpoint folder, is {what}: `run` refuses the step, with or without `--restart`, before touching it (the warning below says what to do)", ckpt.display()));
    }
    if journal::refuse_odd(&step.output).is_err() {
        let jp = journal::journal_path(&step.output);
        let what = odd_kind(&jp, "not a regular file");
        return line(format!("the journal {} is {what}: `run` refuses it, with or without `--restart`, before touching it (the warning below says what to do)", jp.display()));
    }
    let j = match journal::peek(&step.output) {
        Ok(Some(j)) => j,
        // A split run writes the output before any journal of the step exists (finalize
        // merges the shards' into it).
        Ok(None) if crate::durable::split::split_state(&step.output).is_some() => {
            return line(format!(
                "a split run is writing {out} ({} holds its state): `mgmm-stream status {plan_path}` shows its progress, `run {plan_path} --shard I/N` goes on with it, `finalize {plan_path}` completes it; a plain `run` refuses the output",
                shards.display()
            ));
        }
        Ok(None) if journal::torn(&step.output) => {
            return line(format!("the journal of {out} was torn while it was first written (a crash) and records no tile: `run` writes it again and computes the step"));
        }
        Ok(None) if step.output.exists() => {
            return line(format!("{out} exists but no journal says this plan wrote it: `run` refuses it; `run --restart` overwrites it"));
        }
        // Checkpoints left without their output and journal (both deleted) are still resumed
        // from where they match the step (`durable::checkpoint`).
        Ok(None) => {
            return match resumed_without_output(&step.output) {
                Some(c) => line(format!("no output or journal yet; {c}")),
                None => Ok(String::new()),
            }
        }
        Err(e) => return line(format!("{e} (`run` refuses it too)")),
    };
    // Whatever plan wrote the journal, it has nothing to resume without its output
    // (`journal::read_state`) but the partial tiles its checkpoints hold.
    if !step.output.exists() {
        return line(match resumed_without_output(&step.output) {
            Some(c) => {
                format!("the journal is there but {out} is not: `run` starts the step again; {c}")
            }
            None => format!("the journal is there but {out} is not: `run` starts the step afresh"),
        });
    }
    let Ok(ids) = crate::run::input_ids(step) else {
        return Ok(String::new());
    };
    let fp = crate::run::fingerprint_with(step, l, kind, p, &ids);
    if !journal::same_fingerprint(&j.fingerprint, &fp) {
        if let Some((_, e)) = crate::run::damaged_input(step, &j.fingerprint) {
            return line(format!("{e}"));
        }
        return line(format!(
            "the journal of {out} is from a different plan, other inputs or another backend ({}): `run` here refuses it; `run --restart` starts the step over",
            journal::fingerprint_changes(&j.fingerprint, &fp)
        ));
    }
    let (gm, gn, _) = l.grid(step);
    let total = gm * gn;
    let recorded = j.tiles_done();
    let ckpts = crate::durable::checkpoint::peek(&step.output, &recorded);
    let want =
        crate::store::output_main_len(&step.output, &crate::pipeline::output_header(step, l));
    let have = std::fs::metadata(&step.output).map_or(0, |m| m.len());
    let done: std::collections::BTreeSet<u32> = (recorded.iter().copied())
        .filter(|&seq| u64::from(seq) < total)
        .collect();
    let rewritten = match crate::store::OutputFormat::of(&step.output) {
        crate::store::OutputFormat::Npy => crate::store::npy_sink::not_as_written_at(
            &step.output,
            (step.out_dtype, step.m, step.n),
        ),
        crate::store::OutputFormat::Mgt => None,
    };
    line(if let Some(why) = rewritten {
        format!(
            "{}{out}: {why}, so `run` cannot resume it; `run --restart` computes it again",
            if j.complete {
                "complete by its journal, but "
            } else {
                ""
            }
        )
    } else if j.complete && have < want {
        format!("complete by its journal, but {out} is {have} bytes, shorter than the {want} its header needs (truncated?): `run` skips it; `verify` checks it, `run --restart` computes it again")
    } else if let (true, Some(why)) = (j.complete, damaged_output(&step.output)) {
        format!("complete by its journal, but {why}: `run` checks every recorded tile against the journal and writes that again (as `verify --repair` does)")
    } else if j.complete {
        "complete: `run` skips this step (`run --restart` computes it again)".into()
    } else if done.is_empty() && !ckpts.is_empty() {
        format!(
            "started, no output tile finished yet; {}: {}",
            checkpointed(&ckpts),
            resumes(&ckpts)
        )
    } else if done.is_empty() {
        "started, no output tile recorded yet: `run` starts the step afresh".into()
    } else if have < want {
        format!("{out} is {have} bytes, shorter than the {want} its header needs (truncated?): `run` refuses it; `run --restart` starts the step over")
    } else {
        format!(
            "{} of {total} output tiles done{}: `run` resumes (each done tile's checksum is checked first){}",
            done.len(),
            if ckpts.is_empty() {
                String::new()
            } else {
                format!("; {}", checkpointed(&ckpts))
            },
            match j.damaged {
                0 => String::new(),
                n => format!(
                    "; {} in the journal damaged and skipped: {} computed again",
                    count(n as u64, "record", "records"),
                    if n == 1 { "its tile is" } else { "their tiles are" }
                ),
            }
        )
    })
}

/// What is at `p`, which `run` refuses: "a symbolic link", else `other` (the kind of file it
/// is not).
fn odd_kind(p: &std::path::Path, other: &'static str) -> &'static str {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => "a symbolic link",
        _ => other,
    }
}

/// "N partial tiles checkpointed (…): `run` resumes them …" for the checkpoints an output that
/// is gone left behind (`run` resumes those that match the step); `None` without any.
fn resumed_without_output(output: &std::path::Path) -> Option<String> {
    let c = crate::durable::checkpoint::peek(output, &Default::default());
    (!c.is_empty()).then(|| format!("{}: {}", checkpointed(&c), resumes(&c)))
}

/// What `run` does with the checkpointed partial tiles `c` ([`checkpointed`]).
fn resumes(c: &[(u32, u32, u32)]) -> String {
    format!(
        "`run` resumes {}",
        if c.len() == 1 {
            "it from its checkpoint (if it still matches the step)"
        } else {
            "them from their checkpoints (if they still match the step)"
        }
    )
}

/// "2 partial tiles checkpointed (31 % of their K done)", "1 partial tile checkpointed (31 % of
/// its K done)".
fn checkpointed(c: &[(u32, u32, u32)]) -> String {
    let (done, all) = c.iter().fold((0u64, 0u64), |(d, a), &(_, kd, kc)| {
        (d + kd as u64, a + kc as u64)
    });
    format!(
        "{} checkpointed ({:.0} % of {} K done)",
        count(c.len() as u64, "partial tile", "partial tiles"),
        100.0 * done as f64 / all.max(1) as f64,
        if c.len() == 1 { "its" } else { "their" }
    )
}

/// How the step's inputs reach the lanes (docs/PLAN.md, `staging`): which operands can be copied
/// straight from their files' pages (`.mgt`, `.npy` and raw files stored in the dtype the lanes
/// take), and why the others cannot.
fn describe_staging(
    plan: &Plan,
    step: &crate::plan::Step,
    l: &Layout,
    caps: &crate::backend::Caps,
    mode: crate::plan::StagingMode,
    device: bool,
) -> String {
    use crate::plan::StagingMode;
    let e = &plan.engine;
    if mode == StagingMode::Copy {
        if e.staging == StagingMode::Auto {
            return format!(
                "  inputs copied into the staging buffers (staging = auto on {} devices: page-locking the files' pages is slower with several devices' contexts, docs/PLAN.md)\n",
                l.lanes
            );
        }
        return "  inputs copied into the staging buffers (staging = copy)\n".into();
    }
    let ops = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
    let (mut direct, mut copied) = (Vec::new(), Vec::new());
    // What may be held at once (`direct::limits`), and the largest range a block of a file
    // read in place holds.
    let pin = crate::pipeline::direct::Pinning::new(
        crate::pipeline::direct::limits(None, e.host_memory, l.host_bytes),
        device,
        e.precision,
    );
    let mut held_range = 0u64;
    let mut in_place: Vec<&crate::plan::Operand> = Vec::new();
    // Some input is copied because the budget is short of its ranges: `plan` names a budget.
    let mut oversize = false;
    // `auto` on a GPU copies every block of some files (`pipeline::direct::copied_files`):
    // under fp64 all of them, under fp32 those stored in whole rows whose blocks are narrow —
    // the rule `run` applies, judged from the files where they exist, else (an earlier step's
    // output) from the name a `.npy` is written under.
    let (a0, b0) = crate::plan::schedule::Schedule::first_blocks(step, l);
    fn role<'o>(
        op: &'o crate::plan::Operand,
        first: crate::store::Block,
        l: &Layout,
    ) -> crate::pipeline::direct::Role<'o> {
        let opened = op.open().ok();
        let (r, c, d) = (opened.as_ref()).map_or((op.rows, op.cols, op.dtype), |f| {
            (f.shape().0, f.shape().1, f.dtype())
        });
        crate::pipeline::direct::Role {
            path: &op.path,
            whole_rows: match &opened {
                Some(f) => f
                    .mapped_block(&first, l.host_dt)
                    .is_some_and(|mb| mb.whole_rows),
                None => op.raw.is_some() || op.path.extension().is_some_and(|x| x == "npy"),
            },
            cols: c,
            first,
            lockable: opened.as_ref().is_some_and(|f| {
                f.mapped_block(&first, l.host_dt).is_some()
                    && f.device_block(&first, l.host_dt).is_none()
            }),
            bytes: match &opened {
                Some(f) => crate::pipeline::direct::Role::bytes_of(f.as_ref()),
                None => r.saturating_mul(c).saturating_mul(d.size() as u64),
            },
        }
    }
    let roles = [role(&step.a, a0, l), role(&step.b, b0, l)];
    let rule = pin.rule_for(mode, &roles);
    let auto_copied = crate::pipeline::direct::copied_files(rule, &roles);
    for (i, op) in ops.into_iter().enumerate() {
        let Some(op) = op else { continue };
        // A chain's intermediate held in memory, or the caller's array: no file to map.
        let added = step.c0.as_ref().is_some_and(|c0| std::ptr::eq(c0, op));
        let why = if added {
            // Staging reads it with `fill`, once per output tile: never from the map.
            Some("the added matrix, always".to_string())
        } else if step.held.contains(&op.path) {
            Some("in the caller's memory".to_string())
        } else if step.in_memory(&op.path) {
            Some("held in memory".to_string())
        } else if op.dtype != l.host_dt {
            Some(format!("{} stored, {} computed", op.dtype, l.host_dt))
        } else if i < 2 && auto_copied.contains(&op.path) {
            Some(rule.why().to_string())
        } else {
            // What `run` finds as its blocks come (`direct_oversize_blocks`): the range a block
            // holds does not fit in what host_memory leaves beside the pools.
            let first = if i == 0 { a0 } else { b0 };
            op.open().ok().and_then(|f| {
                let mb = f.mapped_block(&first, l.host_dt)?;
                held_range = held_range.max(crate::pipeline::direct::largest_range(pin.chunk, &mb));
                if !in_place.iter().any(|o| o.path == op.path) {
                    in_place.push(op);
                }
                // A block is held registered in all of its ranges at once (several where it
                // spans them): a budget smaller than that stages it by copy
                // (`direct_full_blocks`: every block at 24 MiB of 2048² `.npy` inputs on the
                // CPU, where `plan` said they went straight, "if any" were copied: a trial).
                let need = crate::pipeline::direct::block_range_bytes(pin.chunk, &mb);
                let held = if device { "page-locked" } else { "mapped" };
                oversize |= !pin.holds(&mb) || need > pin.budget;
                if !pin.holds(&mb) {
                    Some(format!(
                        "a range of its file, {}, is larger than the {} that host_memory leaves beside the pools to keep {held}",
                        fmt_bytes(crate::pipeline::direct::largest_range(pin.chunk, &mb)),
                        fmt_bytes(pin.budget),
                    ))
                } else if need > pin.budget {
                    Some(format!(
                        "a block of it holds {} of its file at once, more than the {} that host_memory leaves beside the pools to keep {held}",
                        fmt_bytes(need),
                        fmt_bytes(pin.budget),
                    ))
                } else {
                    None
                }
            })
        };
        // `R @ R.T` reads one matrix twice: name it once.
        match why {
            None if !direct.contains(&op.name) => direct.push(op.name.clone()),
            None => {}
            Some(w) => {
                let c = format!("{} ({w})", op.name);
                if !copied.contains(&c) {
                    copied.push(c);
                }
            }
        }
    }
    let mut parts = Vec::new();
    if !direct.is_empty() {
        let who = if device {
            "the devices copy"
        } else {
            "the lanes copy"
        };
        let when = match mode {
            StagingMode::Auto => " where their pages are in the page cache, else staged by copy",
            _ => "",
        };
        parts.push(format!(
            "{who} {} straight from the files' pages{when}",
            direct.join(", ")
        ));
        // The lanes hold several blocks: a budget of a few ranges leaves blocks that find it
        // full, staged by copy (at 64 MiB `plan` said every block went straight and `run`
        // copied most: a new user's trial).
        if held_range > 0 && pin.budget < 8 * held_range {
            parts.push(format!(
                "the {} that host_memory leaves beside the pools to keep them {} holds only {} of their ranges ({} each) at once: blocks that find it full, if any, are staged by copy ({})",
                fmt_bytes(pin.budget),
                if device { "page-locked" } else { "mapped" },
                pin.budget / held_range,
                fmt_bytes(held_range),
                raise_to(
                    least_host_memory(plan, step, caps, device, &in_place, &|_, largest| 8 * largest),
                    "it holds 8 at once"
                )
            ));
        }
    }
    if !copied.is_empty() {
        // A range, or a block's ranges, larger than the budget: the host_memory that has room.
        let advice = if oversize {
            format!(
                "; {}",
                raise_to(
                    least_host_memory(plan, step, caps, device, &in_place, &|need, _| need),
                    "they are read in place"
                )
            )
        } else {
            String::new()
        };
        parts.push(format!("{} staged by copy{advice}", copied.join(", ")));
    } else {
        // What `Engines::make` decides with the files open (`pipeline::direct::expected`).
        let when = match mode {
            StagingMode::Auto => ", if the files are in the page cache as the step starts",
            _ => "",
        };
        parts.push(format!(
            "the staging buffers are made only for blocks staged by copy{when}"
        ));
    }
    format!(
        "  inputs: {} (staging = {})\n",
        parts.join("; "),
        e.staging.name()
    )
}

/// The least `host_memory` — of the plan's times 1¼, 1½, 2, 3, 4, 6, 8, … 64 — at which the
/// step, laid out as `run` would lay it out with it (`run::layout_for`: a resumed step keeps
/// its journal's tile), leaves room beside its pools for `want(need, largest)` bytes: `need`
/// the most a first block of `ops` (those `plan` found readable in place at the plan's budget,
/// or too large for it) holds registered at once, `largest` the largest range of those. With
/// `tile = "auto"` the pools grow with the budget, so what "raise host_memory" needs is not the
/// shortfall: from 64 to 96 MiB it changed nothing (a new user's trial). `None`: none of those
/// does.
fn least_host_memory(
    plan: &Plan,
    step: &crate::plan::Step,
    caps: &crate::backend::Caps,
    device: bool,
    ops: &[&crate::plan::Operand],
    want: &dyn Fn(u64, u64) -> u64,
) -> Option<u64> {
    let e = &plan.engine;
    let steps = [5u64, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256];
    steps.iter().find_map(|&q| {
        let hm = (e.host_memory / 4 * q).next_multiple_of(1 << 20);
        let e2 = crate::plan::Engine {
            host_memory: hm,
            ..e.clone()
        };
        let l = crate::run::layout_for(&plan.path, step, &e2, caps, false).ok()?;
        let pin = crate::pipeline::direct::Pinning::new(
            crate::pipeline::direct::limits(None, hm, l.host_bytes),
            device,
            e.precision,
        );
        let (a0, b0) = crate::plan::schedule::Schedule::first_blocks(step, &l);
        let (mut need, mut largest, mut seen) = (0, 0, Vec::new());
        for (op, first) in [(&step.a, a0), (&step.b, b0)] {
            if !ops.iter().any(|o| o.path == op.path) || seen.contains(&&op.path) {
                continue;
            }
            seen.push(&op.path);
            let f = op.open().ok()?;
            let mb = f.mapped_block(&first, l.host_dt)?;
            need = need.max(crate::pipeline::direct::block_range_bytes(pin.chunk, &mb));
            largest = largest.max(crate::pipeline::direct::largest_range(pin.chunk, &mb));
        }
        (need > 0 && pin.budget >= want(need, largest)).then_some(hm)
    })
}

/// Advice from [`least_host_memory`], as the setting to write: with `tile = "auto"` a larger
/// budget may pick a larger tile and leave less room again, so it names the one it checked
/// (on the CPU, 1024² `.npy` inputs had room at 20 MiB, none at 32 and again at 48).
fn raise_to(hm: Option<u64>, then: &str) -> String {
    match hm {
        Some(hm) => format!("with host_memory = \"{}MiB\" {then}", hm >> 20),
        None => "no host_memory up to 64 times this one leaves the room: with tile = \"auto\" the pools grow with it, and at most half the memory the host can spare is kept locked; a smaller tile needs less".into(),
    }
}

/// How the output file will be written (docs/PLAN.md, `write`), and why when `auto` chose.
fn describe_write(step: &crate::plan::Step, l: &Layout, e: &crate::plan::Engine) -> String {
    let header = crate::pipeline::output_header(step, l);
    let plan = super::resolve_write(&step.output, &header, e.durable, e.write, e.host_memory);
    let (len, dirty) = (plan.file_len, plan.dirty_limit);
    let name = plan.mode.name();
    let why = match (e.write, dirty) {
        (crate::store::WriteMode::Auto, Some(d)) => format!(
            " (write = auto: a {} file, host_memory {}, the kernel's dirty limit about {})",
            fmt_bytes(len),
            fmt_bytes(e.host_memory),
            fmt_bytes(d)
        ),
        (crate::store::WriteMode::Auto, None) => format!(
            " (write = auto: a {} file, host_memory {})",
            fmt_bytes(len),
            fmt_bytes(e.host_memory)
        ),
        _ => String::new(),
    };
    let released = if plan.drop_written {
        ", each tile dropped from the map once written"
    } else {
        ""
    };
    format!("  output written with {name}{why}{released}\n")
}

/// The communication lower bound and the time lower bound of one step.
fn describe_bounds(
    step: &crate::plan::Step,
    l: &Layout,
    t: &crate::plan::schedule::Traffic,
    sel: &dyn Backend,
    e: &crate::plan::Engine,
) -> String {
    let caps = sel.caps();
    let device = caps.memory == MemorySpace::Device;
    let mut s = String::new();
    // Hong–Kung / Irony–Toledo–Tiskin: a fast memory of M words must exchange at least
    // ~2·m·n·k/√M words with slow memory for the product; here M is one lane's tile cache
    // plus accumulators, and the slow memory is the host (then the files).
    let words =
        (l.slots as u64 * l.slot_bytes + l.accs as u64 * l.acc_bytes) / l.dev_dt.size() as u64;
    let bound_words =
        2.0 * step.m as f64 * step.n as f64 * step.k as f64 / (words.max(1) as f64).sqrt();
    let hs = l.host_dt.size() as f64;
    s += &format!(
        "  communication bound: a cache of {} ({} elements) per lane moves at least {} in and out (2·m·n·k/√M); this schedule moves {} in and {} out ({} in all) and reads {} from {}\n",
        fmt_bytes(words * l.dev_dt.size() as u64),
        words,
        fmt_bytes((bound_words * hs) as u64),
        fmt_bytes(t.h2d_bytes),
        fmt_bytes(t.d2h_bytes),
        fmt_bytes(t.h2d_bytes + t.d2h_bytes),
        fmt_bytes(t.read_bytes),
        step.inputs_from()
    );
    let lanes = if device { caps.lanes } else { sel.threads() };
    let rate = (caps.peak_flops)(e.precision, lanes, l.tk.min(step.k));
    let why = (caps.peak_source)(e.precision);
    let tc = step.flops() / rate;
    // The disk's part: the inputs read once and the output written once (`min_read_bytes`'s
    // count), of those that are files (arrays and intermediates held in memory take none).
    let disk_read: u64 = [&step.a, &step.b]
        .into_iter()
        .filter(|o| !step.in_memory(&o.path))
        .map(|o| o.rows * o.cols * o.dtype.size() as u64)
        .sum();
    let disk_write = match step.output_in_memory() {
        true => 0,
        false => t.write_bytes,
    };
    let td = (disk_read + disk_write) as f64 / DISK_READ;
    let disk = match disk_read + disk_write {
        0 => String::new(),
        _ => format!("; cold disk at {:.1} GB/s = {td:.3} s", DISK_READ / 1e9),
    };
    let link = caps.link_rate;
    let tp = link
        .map(|r| t.h2d_bytes.max(t.d2h_bytes) as f64 / r / caps.lanes as f64)
        .unwrap_or(0.0);
    s += &format!(
        "  lower bound: {:.3e} FLOP at {} ({why}) = {:.3} s{disk}{} => at least {:.3} s\n",
        step.flops(),
        crate::progress::fmt_flops(Some(rate)),
        tc,
        link.map(|r| format!("; PCIe at {:.0} GB/s = {tp:.3} s", r / 1e9))
            .unwrap_or_default(),
        tc.max(tp).max(td)
    );
    s
}

/// What `run` would mend in a finished `output` before skipping it (read only, unlike
/// [`crate::store::mend_finished`]): a header that does not open, a `.npy` without its sidecar.
pub(crate) fn damaged_output(output: &std::path::Path) -> Option<String> {
    match crate::store::open_source(output) {
        Err(e) => Some(format!("its header is damaged ({e})")),
        Ok(s)
            if crate::store::OutputFormat::of(output) == crate::store::OutputFormat::Npy
                && s.checksum_tile().is_none() =>
        {
            Some("its checksum sidecar is missing or damaged".into())
        }
        Ok(_) => None,
    }
}
