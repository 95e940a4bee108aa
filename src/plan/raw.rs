//! The serde mirror of `plan.toml`: exactly what a user may write, nothing derived.
//!
//! `deny_unknown_fields` everywhere, so a typo is an error that names the key and the line
//! instead of a silently ignored setting. Values a later check can reject are `Spanned`, so that
//! every value error names its line. Validation and derivation happen in `resolve` and `engine`.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlan {
    #[serde(default)]
    pub matrices: BTreeMap<String, RawMatrix>,
    #[serde(default)]
    pub step: Vec<RawStep>,
    #[serde(default)]
    pub engine: RawEngine,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatrix {
    pub path: Spanned<String>,
    pub generate: Option<Spanned<RawGenerate>>,
    /// `"raw"` for a headerless binary file (then `rows`, `cols`, `dtype` are required).
    pub format: Option<Spanned<String>>,
    pub rows: Option<u64>,
    pub cols: Option<u64>,
    pub dtype: Option<String>,
    /// `"C"` (row-major, default) or `"F"` (column-major).
    pub order: Option<String>,
    /// Bytes before the first element (default 0).
    pub offset: Option<u64>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawGenerate {
    pub rows: u64,
    pub cols: u64,
    pub dist: Option<String>,
    pub seed: Option<u64>,
    pub dtype: Option<String>,
    pub tile: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStep {
    pub output: Spanned<String>,
    pub expr: Spanned<String>,
    /// Name under which later steps can use this step's output.
    pub name: Option<Spanned<String>>,
    pub alpha: Option<Spanned<f64>>,
    pub beta: Option<Spanned<f64>>,
    pub accumulate: Option<Spanned<String>>,
    /// Storage tile of the output file (default: the compute tile).
    pub tile: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawTile {
    Word(String),
    Square(u64),
    Three([u64; 3]),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawDevices {
    Word(String),
    List(Vec<u32>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    pub backend: Option<Spanned<String>>,
    pub precision: Option<Spanned<String>>,
    pub threads: Option<Spanned<usize>>,
    pub host_memory: Option<Spanned<String>>,
    pub device_memory: Option<Spanned<String>>,
    pub tile: Option<Spanned<RawTile>>,
    pub devices: Option<Spanned<RawDevices>>,
    /// fsync the output at the end (default true).
    pub durable: Option<Spanned<bool>>,
    /// Verify input tile checksums while reading.
    pub verify_inputs: Option<Spanned<bool>>,
    /// How output blocks reach the file: "mmap" (default) | "pwrite".
    pub write: Option<Spanned<String>>,
}

impl RawEngine {
    /// Replace every key `over` sets (a `--set` applied over the plan file's `[engine]`).
    pub fn overlay(&mut self, over: RawEngine) {
        let RawEngine {
            backend,
            precision,
            threads,
            host_memory,
            device_memory,
            tile,
            devices,
            durable,
            verify_inputs,
            write,
        } = over;
        self.backend = backend.or(self.backend.take());
        self.precision = precision.or(self.precision.take());
        self.threads = threads.or(self.threads.take());
        self.host_memory = host_memory.or(self.host_memory.take());
        self.device_memory = device_memory.or(self.device_memory.take());
        self.tile = tile.or(self.tile.take());
        self.devices = devices.or(self.devices.take());
        self.durable = durable.or(self.durable.take());
        self.verify_inputs = verify_inputs.or(self.verify_inputs.take());
        self.write = write.or(self.write.take());
    }
}

/// 1-based line of byte offset `byte` in `src`.
pub fn line_of(src: &str, byte: usize) -> usize {
    src[..byte.min(src.len())].matches('\n').count() + 1
}

/// Parse plan text into its mirror. Syntax, unknown keys and wrong types are reported with the
/// line, the column and the line's text.
pub fn parse(src: &str) -> Result<RawPlan, String> {
    toml::from_str(src).map_err(|e| {
        let at = e
            .span()
            .map(|sp| {
                let line = line_of(src, sp.start);
                let start = sp.start.min(src.len());
                let col = start - src[..start].rfind('\n').map_or(0, |i| i + 1) + 1;
                let text = src.lines().nth(line - 1).unwrap_or("").trim();
                format!(" at line {line}, column {col} (`{text}`)")
            })
            .unwrap_or_default();
        format!("invalid plan{at}: {}", e.message().trim())
    })
}
