//! `.npy` arrays read in place, with the per-tile CRC sidecar that `.npy` outputs carry.
//!
//! [`open`] parses the header strictly ([`super::npy_header::read_header`]: versions
//! 1.0–3.0, little-endian f16/f32/f64, C or Fortran order, clear refusals for everything else)
//! and hands the data region to [`RowMajorFile`]. A Fortran-order array is the row-major
//! transpose of its shape, so it is opened as that and flagged
//! [`MatrixSource::transposed`](super::MatrixSource).
//!
//! An output the engine has not finished carries a header numpy refuses
//! ([`super::npy_header::UNFINISHED`]), and the engine refuses it too as a matrix to read (an
//! input, `import`, `verify`): its missing tiles would read as zeros. Only what works on the
//! output itself opens it as it is — to resume or finalize it, `info`, `export --allow-partial`
//! — and it is described as unfinished.
//!
//! The sidecar `ARRAY.npy.crc32c` ([`super::sidecar`]) holds what a `.mgt` file keeps in its
//! checksum table: one CRC-32C per storage tile. It is only trusted when it describes exactly
//! this array (dtype, shape, data offset and file length); otherwise it is ignored and `info`
//! says why.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use super::npy_header::read_header;
use super::rowmajor::{RowMajorFile, RowMajorSpec};
use super::sidecar::{sidecar_path, Sidecar, TileCrcs};
use crate::error::{Error, Result};

/// The sidecar of `path` if it describes this array, or why it is ignored.
fn load_sidecar(path: &Path, spec: &RowMajorSpec, len: u64) -> (Option<TileCrcs>, Option<String>) {
    let sp = sidecar_path(path);
    let bytes = match std::fs::read(&sp) {
        Ok(b) => b,
        Err(_) => return (None, None),
    };
    // Not judged by modification times: a damaged copy or a crashed writer changes those too,
    // and a mismatch then says to delete the sidecar if the array was changed on purpose.
    let why = match Sidecar::decode(&bytes) {
        Err(m) => m,
        Ok(s) if spec.transposed => {
            let _ = s;
            "the array is in Fortran order, sidecars describe C-order arrays".into()
        }
        Ok(s)
            if (s.dtype, s.rows, s.cols, s.data_offset, s.file_len)
                == (spec.dtype, spec.rows, spec.cols, spec.data_offset, len) =>
        {
            return (Some(s.crcs), None)
        }
        Ok(_) => "it describes another array (shape, dtype or length differ)".into(),
    };
    (
        None,
        Some(format!("sidecar {} ignored: {why}", sp.display())),
    )
}

/// Open a `.npy` file for reading in place; an unfinished output of the engine only with
/// `unfinished_ok` (the output itself being resumed, finalized, described or exported as it is).
pub(crate) fn open(path: &Path, unfinished_ok: bool) -> Result<RowMajorFile> {
    let f = File::open(path).map_err(|e| Error::io(path, "cannot open .npy file", e))?;
    let len = f
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat .npy file", e))?
        .len();
    let mut r = BufReader::with_capacity(64 << 10, f);
    let h = read_header(path, &mut r)?;
    if h.unfinished && !unfinished_ok {
        return Err(Error::format(
            path,
            "is an output mgmm-stream has not finished (its header says UNFINISHED, so numpy refuses it too): its missing tiles would read as zeros, so it is not read as a matrix until its run finishes it — `mgmm-stream info FILE` says how far it is and what finishes it; `mgmm-stream export FILE OUT.npy --allow-partial` copies it as it is",
        ));
    }
    let version = {
        use std::os::unix::fs::FileExt;
        let mut v = [0u8; 8];
        let f = r.into_inner();
        f.read_exact_at(&mut v, 0)
            .map_err(|e| Error::io(path, "cannot read .npy header", e))?;
        v[6]
    };
    let spec = RowMajorSpec {
        rows: if h.fortran { h.cols } else { h.rows },
        cols: if h.fortran { h.rows } else { h.cols },
        dtype: h.dtype,
        data_offset: h.data_offset,
        transposed: h.fortran,
        kind: if h.unfinished {
            format!(".npy v{version}.0, UNFINISHED output (a header numpy refuses until its last tile is written)")
        } else {
            format!(".npy v{version}.0")
        },
        region: false,
    };
    // Why a sidecar there was ignored goes with the file (`info`, the checks), not into its
    // format's name, which is part of the journal's identity of the input: a damaged sidecar
    // beside unchanged data made a finished step's input "different" and its advice,
    // `--restart`, recompute the output (new-user trial).
    let (crcs, note) = load_sidecar(path, &spec, len);
    Ok(RowMajorFile::open(path, spec, crcs)?.with_checksum_note(note))
}
