//! A step's fingerprint: everything that determines its output bytes, as the journal records
//! it. One function computes it ([`fingerprint_with`]); [`fingerprint`] is the same for a plan's
//! step whose operands are opened from their files. A journal, a shard's manifest and a
//! checkpoint written under another fingerprint are refused, naming what changed.

use crate::durable::journal::Fingerprint;
use crate::error::Result;
use crate::pipeline;
use crate::pipeline::StepSources;
use crate::plan::layout::Layout;
use crate::plan::{Precision, Step};

/// Everything that determines a step's output bytes, for the journal.
pub(crate) fn fingerprint(
    step: &Step,
    layout: &Layout,
    kind: &str,
    p: Precision,
) -> Result<Fingerprint> {
    Ok(fingerprint_with(step, layout, kind, p, &input_ids(step)?))
}

/// [`fingerprint`] with the inputs' entries given as (key, identity) pairs, for callers that
/// opened the inputs themselves ([`crate::api`]).
pub(crate) fn fingerprint_with(
    step: &Step,
    layout: &Layout,
    kind: &str,
    p: Precision,
    ids: &[(String, String)],
) -> Fingerprint {
    let mut fp = Fingerprint::new();
    let h = pipeline::output_header(step, layout);
    fp.insert(
        "output".into(),
        format!(
            "{}×{} {} in {}×{} tiles",
            h.rows, h.cols, h.dtype, h.tile_rows, h.tile_cols
        ),
    );
    fp.insert("expr".into(), step.expr.clone());
    fp.insert("alpha".into(), format!("{:?}", step.alpha));
    fp.insert("beta".into(), format!("{:?}", step.beta));
    fp.insert("precision".into(), p.name().into());
    if let Precision::Fp64Emulated(crate::seam::EmulationModuli::Fixed(n)) = p {
        // `auto` picks per block from the data, so it needs no entry; a forced count does.
        fp.insert("emulation moduli".into(), n.to_string());
    }
    fp.insert("backend".into(), kind.into());
    fp.insert(
        "compute tile".into(),
        format!("{}×{}×{}", layout.tm, layout.tn, layout.tk),
    );
    for (key, id) in ids {
        fp.insert(key.clone(), id.clone());
    }
    fp
}

/// The journal fingerprint's entries for a step's inputs: each input's identity, an
/// intermediate of a chain by its path (it is determined by the chain's inputs, listed too, and
/// is gone once the chain completes).
pub fn input_ids(step: &Step) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let ops = [Some(&step.a), Some(&step.b), step.c0.as_ref()];
    for op in ops.into_iter().flatten() {
        let id = if op.temp {
            format!(
                "intermediate {}",
                crate::store::fsutil::identity_path(&op.path).display()
            )
        } else {
            input_identity(op)?
        };
        out.push((input_key(op), id));
    }
    if let Some(c) = &step.chain {
        for op in &c.leaves {
            out.push((format!("chain input {}", op.name), input_identity(op)?));
        }
    }
    Ok(out)
}

/// An input's identity as the journal records it (the source's own fingerprint: for .mgt the
/// path, size, header and checksum table); `verify` compares it to find inputs changed since
/// the output was computed.
pub fn input_identity(op: &crate::plan::Operand) -> Result<String> {
    Ok(op.open()?.identity())
}

/// [`input_ids`] for operands the caller opened ([`crate::api`]): (operand name, source
/// identity) of every operand.
pub(crate) fn source_ids(step: &Step, s: &StepSources) -> Vec<(String, String)> {
    let mut ids = vec![
        (input_key(&step.a), s.a.identity()),
        (input_key(&step.b), s.b.identity()),
    ];
    if let (Some(op), Some(c0)) = (&step.c0, &s.c0) {
        ids.push((input_key(op), c0.identity()));
    }
    ids
}

/// The fingerprint's key of an operand's identity.
fn input_key(op: &crate::plan::Operand) -> String {
    format!("input {}", op.name)
}
