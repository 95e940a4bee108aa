//! The serde mirror of `plan.toml`: exactly what a user may write, nothing derived.
//!
//! `deny_unknown_fields` everywhere, so a typo is an error that names the key and the line
//! instead of a silently ignored setting. Validation and derivation happen in `resolve`.

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
    pub path: String,
    pub generate: Option<RawGenerate>,
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
    pub output: String,
    pub expr: Spanned<String>,
    /// Name under which later steps can use this step's output.
    pub name: Option<String>,
    pub alpha: Option<f64>,
    pub beta: Option<f64>,
    pub accumulate: Option<String>,
    /// Storage tile of the output file (default: the compute tile).
    pub tile: Option<u64>,
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
    pub backend: Option<String>,
    pub precision: Option<String>,
    pub threads: Option<usize>,
    pub host_memory: Option<String>,
    pub device_memory: Option<String>,
    pub tile: Option<RawTile>,
    pub devices: Option<RawDevices>,
    /// fsync the output at the end (default true).
    pub durable: Option<bool>,
    /// Verify input tile checksums while reading: "auto" | true | false.
    pub verify_inputs: Option<bool>,
    /// How output blocks reach the file: "mmap" (default) | "pwrite".
    pub write: Option<String>,
}
