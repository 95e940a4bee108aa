//! Matrix storage: the `.mgt` tiled file format, memory-mapped block I/O, synthetic data
//! generation and `.npy` interchange. Everything that touches matrix bytes on disk lives here.

pub mod gen;
pub mod header;
pub mod npy;
pub mod tiled;

pub use header::Header;
pub use tiled::{Block, TiledFile, TiledWriter};
