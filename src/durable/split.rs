//! Where a split run keeps its state on disk, by path alone: `C.mgt.shards/` beside the output,
//! and its `manifest.json` while the step is split. The cluster module writes these files;
//! `plan`, `verify` and `info` only need to know whether they are there, so the paths live here,
//! below both, rather than in the cluster module that the others would have to import.

use std::path::{Path, PathBuf};

/// Where a step's shard files live: `C.mgt.shards/`.
pub fn state_dir(output: &Path) -> PathBuf {
    let mut s = output.as_os_str().to_owned();
    s.push(".shards");
    PathBuf::from(s)
}

/// The manifest of a split step: written once by the preparer.
pub(crate) fn manifest_path(output: &Path) -> PathBuf {
    state_dir(output).join("manifest.json")
}

/// The state folder of a split run writing `output`, while its manifest is there: such a run
/// has no journal of the step until `finalize` merges the shards' into one.
pub(crate) fn split_state(output: &Path) -> Option<PathBuf> {
    manifest_path(output).exists().then(|| state_dir(output))
}
