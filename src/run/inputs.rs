//! The plan's inputs that it generates itself (`[matrices.X] generate = …`): those missing are
//! written once, before the first step, with a progress bar.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::progress::Progress;
use crate::store::gen;
use crate::units::fmt_bytes;

/// The declared inputs that are missing and have a `generate` spec, with their folders created.
pub(crate) fn to_generate(
    plan: &Plan,
) -> Result<Vec<(&crate::plan::MatrixDecl, &crate::store::gen::GenSpec)>> {
    let mut out = Vec::new();
    for d in &plan.matrices {
        let Some(spec) = &d.generate else { continue };
        if d.path.exists() {
            continue;
        }
        if let Some(dir) = d.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(dir, "cannot create directory", e))?;
        }
        out.push((d, spec));
    }
    Ok(out)
}

/// Generate every declared input that is missing and has a `generate` spec.
pub fn generate_missing(
    plan: &Plan,
    progress: &Progress,
    cancel: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (d, spec) in to_generate(plan)? {
        let t = Instant::now();
        let h = spec.header();
        let done = std::sync::atomic::AtomicU64::new(0);
        let label = format!("generating {}", d.path.display());
        let bytes = progress.job(&label, h.data_end() - h.data_offset, &done, || {
            gen::generate_counted(&d.path, spec, &done, cancel)
        })?;
        progress.note(&format!(
            "generated {} ({}×{} {}, {:?}, seed {}): {} in {:.2} s",
            d.path.display(),
            spec.rows,
            spec.cols,
            spec.dtype,
            spec.dist,
            spec.seed,
            fmt_bytes(bytes),
            t.elapsed().as_secs_f64()
        ));
        out.push(d.path.display().to_string());
    }
    Ok(out)
}
