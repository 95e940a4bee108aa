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
pub(crate) struct RawPlan {
    #[serde(default)]
    pub(crate) matrices: BTreeMap<String, RawMatrix>,
    #[serde(default)]
    pub(crate) step: Vec<RawStep>,
    #[serde(default)]
    pub(crate) engine: RawEngine,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMatrix {
    pub(crate) path: Spanned<String>,
    pub(crate) generate: Option<Spanned<RawGenerate>>,
    /// `"raw"` for a headerless binary file (then `rows`, `cols`, `dtype` are required).
    pub(crate) format: Option<Spanned<String>>,
    pub(crate) rows: Option<u64>,
    pub(crate) cols: Option<u64>,
    pub(crate) dtype: Option<String>,
    /// `"C"` (row-major, default) or `"F"` (column-major).
    pub(crate) order: Option<String>,
    /// Bytes before the first element (default 0).
    pub(crate) offset: Option<u64>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawGenerate {
    pub(crate) rows: u64,
    pub(crate) cols: u64,
    pub(crate) dist: Option<String>,
    pub(crate) seed: Option<u64>,
    pub(crate) dtype: Option<String>,
    pub(crate) tile: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawStep {
    pub(crate) output: Spanned<String>,
    pub(crate) expr: Spanned<String>,
    /// Name under which later steps can use this step's output.
    pub(crate) name: Option<Spanned<String>>,
    pub(crate) alpha: Option<Spanned<f64>>,
    pub(crate) beta: Option<Spanned<f64>>,
    pub(crate) accumulate: Option<Spanned<String>>,
    /// Storage tile of the output file (default: the compute tile).
    pub(crate) tile: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawTile {
    Word(String),
    Square(u64),
    Three([u64; 3]),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawDevices {
    Word(String),
    List(Vec<u32>),
}

/// `engine.emulation_moduli`: `"auto"` or a count.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawModuli {
    Word(String),
    Count(i64),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawEngine {
    pub(crate) backend: Option<Spanned<String>>,
    pub(crate) precision: Option<Spanned<String>>,
    pub(crate) threads: Option<Spanned<usize>>,
    pub(crate) host_memory: Option<Spanned<String>>,
    pub(crate) device_memory: Option<Spanned<String>>,
    pub(crate) tile: Option<Spanned<RawTile>>,
    pub(crate) devices: Option<Spanned<RawDevices>>,
    /// fsync the output at the end (default true).
    pub(crate) durable: Option<Spanned<bool>>,
    /// Verify input tile checksums while reading.
    pub(crate) verify_inputs: Option<Spanned<bool>>,
    /// How output blocks reach the file: "mmap" (default) | "pwrite".
    pub(crate) write: Option<Spanned<String>>,
    /// How often a long output tile saves its partial accumulator: "5min" (default) | "off".
    pub(crate) checkpoint_every: Option<Spanned<String>>,
    /// How input tiles reach a GPU: "auto" (default) | "copy" | "direct".
    pub(crate) staging: Option<Spanned<String>>,
    /// Moduli of `precision = "fp64_emulated"`: "auto" (default) | 1..=16.
    pub(crate) emulation_moduli: Option<Spanned<RawModuli>>,
}

impl RawEngine {
    /// Replace every key `over` sets (a `--set` applied over the plan file's `[engine]`).
    pub(crate) fn overlay(&mut self, over: RawEngine) {
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
            checkpoint_every,
            staging,
            emulation_moduli,
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
        self.checkpoint_every = checkpoint_every.or(self.checkpoint_every.take());
        self.staging = staging.or(self.staging.take());
        self.emulation_moduli = emulation_moduli.or(self.emulation_moduli.take());
    }
}

/// 1-based line of byte offset `byte` in `src`.
pub(crate) fn line_of(src: &str, byte: usize) -> usize {
    src[..byte.min(src.len())].matches('\n').count() + 1
}

/// Parse plan text into its mirror. Syntax, unknown keys and wrong types are reported with the
/// line, the column and the line's text.
pub(crate) fn parse(src: &str) -> Result<RawPlan, String> {
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
        let key = e.span().and_then(|sp| key_before(src, sp.start));
        format!("invalid plan{at}: {}", plain_for(e.message().trim(), key))
    })
}

/// The key whose value starts at byte `at` of `src` (`rows` in `generate = { rows = -1 }`),
/// if the text before it on its line ends with one and an `=`.
fn key_before(src: &str, at: usize) -> Option<&str> {
    let at = at.min(src.len());
    let line = &src[src[..at].rfind('\n').map_or(0, |i| i + 1)..at];
    let head = line.trim_end().strip_suffix('=')?.trim_end();
    let from = head
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    Some(&head[from..]).filter(|k| !k.is_empty())
}

/// serde's message for a value of none of an untagged enum's shapes names the Rust type; say
/// instead what the key accepts. Integers where a size string belongs get the string form, and
/// the Rust types in "expected usize" are said in words (`threads = -1` answered "invalid
/// value: integer `-1`, expected usize").
pub(crate) fn plain(msg: &str) -> String {
    plain_for(msg, None)
}

/// [`plain`] for the value of `key`, where the plan's text names it: a whole number is asked
/// for from 1 unless the key takes 0 (`threads`, `offset`, `seed`), so that `rows = -1` is not
/// answered "0 or more" only for `rows = 0` to be refused next (a new-user trial).
fn plain_for(msg: &str, key: Option<&str>) -> String {
    let from_zero = key.is_none_or(|k| matches!(k, "threads" | "offset" | "seed"));
    let whole = match from_zero {
        true => "a whole number, 0 or more",
        false => "a whole number, 1 or more",
    };
    if msg.contains("untagged enum RawTile") {
        return "tile takes \"auto\", one edge (tile = 4096) or three (tile = [4096, 4096, 2048]), positive integers".into();
    }
    if msg.contains("untagged enum RawModuli") {
        return "emulation_moduli takes \"auto\" or a number of moduli from 1 to 16 (emulation_moduli = 15)".into();
    }
    if msg.contains("untagged enum RawDevices") {
        return "devices takes \"all\" or a list of GPU numbers (devices = [0, 1])".into();
    }
    if msg.starts_with("invalid type: integer") && msg.ends_with("expected a string") {
        return format!("{msg}; sizes are strings with a unit (\"64GiB\", \"512MiB\")");
    }
    let words: [(&str, &str); 6] = [
        ("usize", whole),
        ("u64", whole),
        ("u32", whole),
        ("i64", "a whole number"),
        ("f64", "a number"),
        ("a boolean", "true or false"),
    ];
    for (rust, words) in words {
        if let Some(head) = msg.strip_suffix(&format!("expected {rust}")) {
            let head = (head.strip_prefix("invalid value: "))
                .or_else(|| head.strip_prefix("invalid type: "))
                .unwrap_or(head);
            return format!("got {head}expected {words}");
        }
    }
    msg.to_string()
}
