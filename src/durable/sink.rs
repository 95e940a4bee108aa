//! Where a written output tile is reported: the pipeline's writeback calls a [`TileSink`] once
//! a tile's bytes are written, and the layer that owns the step's durability (the journal of a
//! run, a chain's record of an intermediate in memory, the Python caller's record, a fault
//! injected like a full disk) decides what that tile now counts as. The trait lives here, with
//! the journal, rather than in the pipeline, so that those implementations (and the
//! fault-injecting wrapper of `backend::fault`) need not import the pipeline to name it.

use crate::error::Result;
use crate::plan::schedule::OutTile;

/// Called by writeback after a tile's data is written (and flushed, when durable) — the resume
/// journal hooks in here. `data_crc` is the CRC-32C of the tile's bytes in the output dtype.
pub(crate) trait TileSink: Sync {
    fn tile_written(&self, tile: &OutTile, data_crc: u32) -> Result<()>;
}
