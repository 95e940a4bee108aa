//! The `[engine]` table: `--set engine.KEY=VALUE` overrides applied to the raw table, then one
//! resolution into an [`Engine`] with the same checks and messages for both sources.
//!
//! An override is parsed as the TOML value it spells (`tile=[512,512,256]`, `durable=false`),
//! falling back to a string (`host_memory=4GiB`), and deserialised into the same serde mirror as
//! the plan file, so an unknown key or a wrong type is refused exactly as in the file. Every
//! value error names where the value came from: the plan line, or the `--set` argument.

use std::collections::BTreeMap;
use std::path::Path;

use toml::Spanned;

use super::raw::{line_of, RawDevices, RawEngine, RawModuli, RawTile};
use super::{BackendKind, Devices, Engine, Precision, TileSpec};
use crate::error::{Error, Result};

/// One `--set engine.KEY=VALUE` argument, checked and parsed into the engine mirror.
#[derive(Debug)]
pub(crate) struct EngineSet {
    /// The key under `[engine]`.
    pub(crate) key: String,
    /// The argument as the user wrote it (for messages).
    pub(crate) text: String,
    raw: RawEngine,
}

fn quote(v: &str) -> String {
    format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
}

impl EngineSet {
    /// Parse `engine.KEY=VALUE`. Errors are usage errors naming the argument.
    pub(crate) fn parse(arg: &str) -> Result<EngineSet> {
        let text = format!("--set {arg}");
        let usage = |m: &str| Error::Usage(format!("{text}: {m}"));
        let (lhs, value) = arg.split_once('=').ok_or_else(|| {
            usage("write --set engine.KEY=VALUE, e.g. --set engine.host_memory=8GiB")
        })?;
        let key = lhs.trim().strip_prefix("engine.").ok_or_else(|| {
            usage(
                "only [engine] keys can be set from the command line; write --set engine.KEY=VALUE",
            )
        })?;
        let ok_key = !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok_key {
            return Err(usage("the key must be one [engine] key, e.g. engine.tile"));
        }
        let value = value.trim();
        // As the TOML value it spells; if that does not parse or has the wrong type, as a string.
        let literal = toml::from_str::<RawEngine>(&format!("{key} = {value}"));
        let raw =
            match literal {
                Ok(r) => r,
                Err(_) => toml::from_str::<RawEngine>(&format!("{key} = {}", quote(value)))
                    .map_err(|e| match takes(key) {
                        Some(what) => usage(&format!("engine.{key} takes {what}, not {value}")),
                        None => usage(&super::raw::plain(e.message().trim())),
                    })?,
            };
        Ok(EngineSet {
            key: key.to_string(),
            text,
            raw,
        })
    }
}

/// What an `[engine]` key whose value serde checks (a number, a bool) takes, in words, for a
/// `--set` that gives something else (`--set engine.threads=-1` answered "invalid type: string
/// \"-1\", expected usize"). The string keys say what they take where they are resolved.
fn takes(key: &str) -> Option<&'static str> {
    Some(match key {
        "threads" => "a whole number of worker threads, 0 or more (0: every core)",
        "durable" | "verify_inputs" => "true or false",
        "emulation_moduli" => "\"auto\" or a number of moduli from 1 to 16",
        _ => return None,
    })
}

/// Where each `[engine]` value came from, for messages.
pub(crate) struct EngineSource<'a> {
    plan: &'a Path,
    src: &'a str,
    /// key → the `--set` argument that set it last.
    sets: BTreeMap<String, String>,
}

impl<'a> EngineSource<'a> {
    /// Apply `sets` over `raw` in order (a later `--set` of the same key wins).
    pub(crate) fn apply(
        plan: &'a Path,
        src: &'a str,
        raw: &mut RawEngine,
        sets: Vec<EngineSet>,
    ) -> EngineSource<'a> {
        let mut origin = BTreeMap::new();
        for s in sets {
            raw.overlay(s.raw);
            origin.insert(s.key, s.text);
        }
        EngineSource {
            plan,
            src,
            sets: origin,
        }
    }

    /// "engine.KEY (line N)" or "--set engine.KEY=VALUE".
    pub(crate) fn at<T>(&self, key: &str, v: &Spanned<T>) -> String {
        match self.sets.get(key) {
            Some(t) => t.clone(),
            None => format!("engine.{key} (line {})", line_of(self.src, v.span().start)),
        }
    }

    /// A value error about `key`: a usage error for a `--set`, a plan error otherwise.
    pub(crate) fn err(&self, key: &str, msg: String) -> Error {
        if self.sets.contains_key(key) {
            Error::Usage(msg)
        } else {
            Error::plan(self.plan, msg)
        }
    }
}

/// `[engine]` from `(key, value)` pairs (value as it would follow `--set engine.KEY=`), with the
/// same checks and messages as a plan's table; unset keys keep their defaults. `origin` names
/// the caller in messages. What [`crate::api::engine_with`] offers the library's callers.
pub(crate) fn with_settings(origin: &std::path::Path, settings: &[(&str, &str)]) -> Result<Engine> {
    let sets = settings
        .iter()
        .map(|(k, v)| EngineSet::parse(&format!("engine.{k}={v}")))
        .collect::<Result<Vec<_>>>()?;
    let mut raw = RawEngine::default();
    let from = EngineSource::apply(origin, "", &mut raw, sets);
    resolve_engine(&raw, &from)
}

/// Resolve the (overlaid) `[engine]` table.
pub(crate) fn resolve_engine(e: &RawEngine, from: &EngineSource) -> Result<Engine> {
    let bad = |key: &str, at: String, msg: String| from.err(key, format!("{at}: {msg}"));
    let backend = match &e.backend {
        None => BackendKind::Auto,
        Some(v) => match v.get_ref().as_str() {
            "auto" => BackendKind::Auto,
            "cpu" => BackendKind::Cpu,
            "cuda" => BackendKind::Cuda,
            "sim" => BackendKind::Sim,
            o => {
                return Err(bad(
                    "backend",
                    from.at("backend", v),
                    format!("\"{o}\" is unknown; use \"auto\", \"cpu\" or \"cuda\""),
                ))
            }
        },
    };
    let precision = match &e.precision {
        None => Precision::Fp32,
        Some(v) => Precision::parse(v.get_ref()).ok_or_else(|| {
            bad(
                "precision",
                from.at("precision", v),
                format!(
                    "\"{}\" is unknown; use fp32, tf32, bf16, fp16, fp64 or fp64_emulated",
                    v.get_ref()
                ),
            )
        })?,
    };
    let precision = resolve_moduli(e, from, precision)?;
    let host_memory = match &e.host_memory {
        None => 2 << 30,
        Some(v) => {
            let b = crate::units::parse_size(v.get_ref()).ok_or_else(|| {
                bad(
                    "host_memory",
                    from.at("host_memory", v),
                    format!(
                        "\"{}\" is not a size; write e.g. \"2GiB\" or \"512MiB\"",
                        v.get_ref()
                    ),
                )
            })?;
            if b < 1 << 20 {
                return Err(bad(
                    "host_memory",
                    from.at("host_memory", v),
                    format!("{b} bytes is too small; give at least 1MiB"),
                ));
            }
            b
        }
    };
    let device_memory = match &e.device_memory {
        None => None,
        Some(v) if v.get_ref() == "auto" => None,
        Some(v) => Some(crate::units::parse_size(v.get_ref()).ok_or_else(|| {
            bad(
                "device_memory",
                from.at("device_memory", v),
                format!(
                    "\"{}\" is not a size; write \"auto\" or e.g. \"40GiB\"",
                    v.get_ref()
                ),
            )
        })?),
    };
    let threads = e.threads.as_ref().map_or(0, |v| *v.get_ref());
    if threads > crate::seam::MAX_THREADS {
        let v = e.threads.as_ref().expect("threads > 0 was given");
        return Err(bad(
            "threads",
            from.at("threads", v),
            format!(
                "{threads} threads is more than {}; leave it out (or 0) to use every core",
                crate::seam::MAX_THREADS
            ),
        ));
    }
    Ok(Engine {
        backend,
        precision,
        threads,
        host_memory,
        device_memory,
        tile: resolve_tile(e, from)?,
        even_rows: true,
        devices: resolve_devices(e, from)?,
        durable: e.durable.as_ref().is_none_or(|v| *v.get_ref()),
        verify_inputs: e.verify_inputs.as_ref().is_none_or(|v| *v.get_ref()),
        write: resolve_write(e, from)?,
        checkpoint_every: resolve_checkpoint_every(e, from)?,
        staging: resolve_staging(e, from)?,
    })
}

/// `engine.emulation_moduli` into `precision`: only `fp64_emulated` has moduli.
fn resolve_moduli(e: &RawEngine, from: &EngineSource, p: Precision) -> Result<Precision> {
    use crate::seam::EmulationModuli;
    let Some(v) = &e.emulation_moduli else {
        return Ok(p);
    };
    let at = from.at("emulation_moduli", v);
    let moduli = match v.get_ref() {
        RawModuli::Word(w) if w == "auto" => EmulationModuli::Auto,
        RawModuli::Count(n) if (1..=16).contains(n) => EmulationModuli::Fixed(*n as u8),
        RawModuli::Word(w) => {
            return Err(from.err(
                "emulation_moduli",
                format!("{at}: \"{w}\" is unknown; use \"auto\" or a number of moduli from 1 to 16"),
            ))
        }
        RawModuli::Count(n) => {
            return Err(from.err(
                "emulation_moduli",
                format!("{at}: {n} moduli: use 1 to 16 (16 keep the reconstruction exact in 128-bit integers), or \"auto\""),
            ))
        }
    };
    match p {
        Precision::Fp64Emulated(_) => Ok(Precision::Fp64Emulated(moduli)),
        other => Err(from.err(
            "emulation_moduli",
            format!(
                "{at}: moduli belong to precision = \"fp64_emulated\", but the precision is {}; set engine.precision = \"fp64_emulated\" or leave emulation_moduli out",
                if e.precision.is_some() { format!("\"{}\"", other.name()) } else { "not set (fp32, or fp64 for f64 inputs)".to_string() }
            ),
        )),
    }
}

fn resolve_staging(e: &RawEngine, from: &EngineSource) -> Result<super::StagingMode> {
    let Some(v) = &e.staging else {
        return Ok(super::StagingMode::default());
    };
    super::StagingMode::parse(v.get_ref()).ok_or_else(|| {
        from.err(
            "staging",
            format!(
                "{}: \"{}\" is unknown; use \"auto\" (the default), \"copy\" or \"direct\" (docs/PLAN.md, staging)",
                from.at("staging", v),
                v.get_ref()
            ),
        )
    })
}

/// Default of `engine.checkpoint_every`: a kill loses at most about this much of a tile's work.
pub(crate) const DEFAULT_CHECKPOINT_EVERY: std::time::Duration =
    std::time::Duration::from_secs(300);

fn resolve_checkpoint_every(
    e: &RawEngine,
    from: &EngineSource,
) -> Result<Option<std::time::Duration>> {
    let Some(v) = &e.checkpoint_every else {
        return Ok(Some(DEFAULT_CHECKPOINT_EVERY));
    };
    let text = v.get_ref().trim();
    if text == "off" {
        return Ok(None);
    }
    parse_duration(text).map(Some).ok_or_else(|| {
        from.err(
            "checkpoint_every",
            format!(
                "{}: \"{}\" is not a duration; write e.g. \"5min\", \"30s\", \"250ms\", \"2h\", or \"off\"",
                from.at("checkpoint_every", v),
                v.get_ref()
            ),
        )
    })
}

/// A duration written as a number and a unit: `ms`, `s`, `min`, `h` (`"5min"`, `"1.5h"`,
/// `"0s"`); `None` for anything else (no unit, a negative or non-finite number).
pub(crate) fn parse_duration(text: &str) -> Option<std::time::Duration> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let x: f64 = num.parse().ok()?;
    let secs = match unit {
        "ms" => x / 1e3,
        "s" | "sec" => x,
        "min" => x * 60.0,
        "h" => x * 3600.0,
        _ => return None,
    };
    std::time::Duration::try_from_secs_f64(secs).ok()
}

fn resolve_write(e: &RawEngine, from: &EngineSource) -> Result<crate::store::WriteMode> {
    let Some(v) = &e.write else {
        return Ok(crate::store::WriteMode::default());
    };
    crate::store::WriteMode::parse(v.get_ref()).ok_or_else(|| {
        from.err(
            "write",
            format!(
                "{}: \"{}\" is unknown; use \"auto\" (the default), \"mmap\" or \"pwrite\" (docs/PLAN.md, write)",
                from.at("write", v),
                v.get_ref()
            ),
        )
    })
}

fn resolve_tile(e: &RawEngine, from: &EngineSource) -> Result<TileSpec> {
    let Some(v) = &e.tile else {
        return Ok(TileSpec::Auto);
    };
    let at = from.at("tile", v);
    let tile = match v.get_ref() {
        RawTile::Word(w) if w == "auto" => TileSpec::Auto,
        RawTile::Word(w) => {
            return Err(from.err(
                "tile",
                format!("{at}: \"{w}\" is not a tile; use \"auto\", a number, or [m, n, k]"),
            ))
        }
        RawTile::Square(t) => TileSpec::Fixed {
            m: *t,
            n: *t,
            k: *t,
        },
        RawTile::Three([m, n, k]) => TileSpec::Fixed {
            m: *m,
            n: *n,
            k: *k,
        },
    };
    if let TileSpec::Fixed { m, n, k } = tile {
        if [m, n, k].iter().any(|&t| t == 0 || t > 1 << 16) {
            // As written: one edge (`tile = 0`, a trial saw it echoed as [0, 0, 0]) or three.
            let written = match v.get_ref() {
                RawTile::Square(t) => format!("{t}"),
                _ => format!("[{m}, {n}, {k}]"),
            };
            return Err(from.err(
                "tile",
                format!("{at}: {written} is not a tile: each edge must be between 1 and 65536 (or leave engine.tile out for \"auto\")"),
            ));
        }
    }
    Ok(tile)
}

fn resolve_devices(e: &RawEngine, from: &EngineSource) -> Result<Devices> {
    let Some(v) = &e.devices else {
        return Ok(Devices::All);
    };
    let at = from.at("devices", v);
    match v.get_ref() {
        RawDevices::Word(w) if w == "all" => Ok(Devices::All),
        RawDevices::Word(w) => Err(from.err(
            "devices",
            format!("{at}: \"{w}\" is not a device list; use \"all\" or a list like [0, 1]"),
        )),
        RawDevices::List(l) if l.is_empty() => Err(from.err(
            "devices",
            format!("{at}: []: list at least one GPU, or use \"all\""),
        )),
        RawDevices::List(l) => Ok(Devices::List(l.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(src: &str, sets: &[&str]) -> Result<Engine> {
        let mut raw: RawEngine = toml::from_str(src).unwrap();
        let sets = sets
            .iter()
            .map(|s| EngineSet::parse(s))
            .collect::<Result<Vec<_>>>()?;
        let from = EngineSource::apply(Path::new("p.toml"), src, &mut raw, sets);
        resolve_engine(&raw, &from)
    }

    #[test]
    fn set_overrides_the_file_and_parses_values_as_toml() {
        let e = engine(
            "host_memory = \"1GiB\"\ntile = 512\n",
            &[
                "engine.host_memory=4GiB",
                "engine.tile=[256, 128, 64]",
                "engine.durable=false",
                "engine.backend=cpu",
                "engine.devices=[0,1]",
                "engine.threads=3",
                "engine.device_memory=4096",
            ],
        )
        .unwrap();
        assert_eq!(e.host_memory, 4 << 30);
        assert_eq!(
            e.tile,
            TileSpec::Fixed {
                m: 256,
                n: 128,
                k: 64
            }
        );
        assert!(!e.durable);
        assert_eq!(e.backend, BackendKind::Cpu);
        assert_eq!(e.devices, Devices::List(vec![0, 1]));
        assert_eq!(e.threads, 3);
        assert_eq!(e.device_memory, Some(4096));
        // The last --set of a key wins.
        let e = engine("", &["engine.tile=64", "engine.tile=auto"]).unwrap();
        assert_eq!(e.tile, TileSpec::Auto);
    }

    #[test]
    fn set_errors_name_the_argument() {
        let msg = |src: &str, sets: &[&str]| engine(src, sets).unwrap_err().to_string();
        let m = msg("host_memory = \"1GiB\"\n", &["engine.host_memory=abc"]);
        assert!(
            m.starts_with("--set engine.host_memory=abc: \"abc\" is not a size"),
            "{m}"
        );
        let m = msg("", &["engine.threads=many"]);
        assert!(m.starts_with("--set engine.threads=many: "), "{m}");
        // In words, not serde's "expected usize".
        assert!(
            m.contains("engine.threads takes a whole number") && m.contains("not many"),
            "{m}"
        );
        assert!(!m.contains("usize"), "{m}");
        let m = msg("", &["engine.bogus=1"]);
        assert!(
            m.contains("--set engine.bogus=1") && m.contains("bogus"),
            "{m}"
        );
        let m = msg("", &["matrices.A.path=x"]);
        assert!(m.contains("only [engine] keys"), "{m}");
        let m = msg("", &["engine.tile"]);
        assert!(m.contains("engine.KEY=VALUE"), "{m}");
        let m = msg("", &["engine.tile=[0, 1, 1]"]);
        assert!(m.starts_with("--set engine.tile=[0, 1, 1]: "), "{m}");
        let m = msg("", &["engine.checkpoint_every=soon"]);
        assert!(
            m.starts_with("--set engine.checkpoint_every=soon: \"soon\" is not a duration"),
            "{m}"
        );
        let m = msg("", &["engine.durable=maybe"]);
        assert!(m.starts_with("--set engine.durable=maybe: "), "{m}");
    }

    #[test]
    fn checkpoint_every_reads_durations_and_off() {
        use std::time::Duration;
        let every = |sets: &[&str]| engine("", sets).unwrap().checkpoint_every;
        assert_eq!(every(&[]), Some(Duration::from_secs(300)));
        assert_eq!(
            every(&["engine.checkpoint_every=30s"]),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            every(&["engine.checkpoint_every=1.5h"]),
            Some(Duration::from_secs(5400))
        );
        assert_eq!(
            every(&["engine.checkpoint_every=250ms"]),
            Some(Duration::from_millis(250))
        );
        assert_eq!(every(&["engine.checkpoint_every=0s"]), Some(Duration::ZERO));
        assert_eq!(every(&["engine.checkpoint_every=off"]), None);
        let e = engine("checkpoint_every = \"2min\"\n", &[]).unwrap();
        assert_eq!(e.checkpoint_every, Some(Duration::from_secs(120)));
        for bad in ["5", "min", "-1s", "5 days", "1e3s", ""] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn file_errors_name_their_line() {
        let src = "backend = \"cpu\"\n\nhost_memory = \"lots\"\n";
        let m = engine(src, &[]).unwrap_err().to_string();
        assert!(
            m.contains("engine.host_memory (line 3)") && m.contains("lots"),
            "{m}"
        );
        for (src, key, line) in [
            ("backend = \"tpu\"\n", "engine.backend", 1),
            ("\nprecision = \"fp8\"\n", "engine.precision", 2),
            ("\n\nhost_memory = \"512\"\n", "engine.host_memory", 3),
            ("device_memory = \"x\"\n", "engine.device_memory", 1),
            ("\ntile = \"big\"\n", "engine.tile", 2),
            ("tile = [0, 1, 1]\n", "engine.tile", 1),
            ("\ndevices = []\n", "engine.devices", 2),
            ("devices = \"some\"\n", "engine.devices", 1),
            ("\ncheckpoint_every = \"5\"\n", "engine.checkpoint_every", 2),
        ] {
            let m = engine(src, &[]).unwrap_err().to_string();
            let want = format!("{key} (line {line})");
            assert!(m.contains(&want), "{src:?}: {m} lacks {want}");
        }
        // The values offered are the real ones, the default named as such.
        let m = engine("write = \"fast\"\n", &[]).unwrap_err().to_string();
        assert!(
            m.contains("engine.write (line 1)") && m.contains("\"auto\" (the default)"),
            "{m}"
        );
        let m = engine("staging = \"dma\"\n", &[]).unwrap_err().to_string();
        assert!(
            m.contains("engine.staging (line 1)") && m.contains("\"copy\" or \"direct\""),
            "{m}"
        );
        for (text, want) in [
            ("", super::super::StagingMode::Auto),
            ("staging = \"copy\"\n", super::super::StagingMode::Copy),
            ("staging = \"direct\"\n", super::super::StagingMode::Direct),
        ] {
            assert_eq!(engine(text, &[]).unwrap().staging, want, "{text:?}");
        }
    }

    /// `precision = "fp64_emulated"` with `emulation_moduli = "auto" | 1..=16`; moduli without
    /// that precision, or out of range, are errors naming the key.
    #[test]
    fn emulation_moduli_belong_to_fp64_emulated() {
        use crate::seam::EmulationModuli::{Auto, Fixed};
        let p = |src: &str, sets: &[&str]| engine(src, sets).map(|e| e.precision);
        assert_eq!(
            p("precision = \"fp64_emulated\"\n", &[]).unwrap(),
            Precision::Fp64Emulated(Auto)
        );
        assert_eq!(
            p(
                "precision = \"fp64_emulated\"\nemulation_moduli = 14\n",
                &[]
            )
            .unwrap(),
            Precision::Fp64Emulated(Fixed(14))
        );
        assert_eq!(
            p(
                "precision = \"fp64_emulated\"\n",
                &["engine.emulation_moduli=9"]
            )
            .unwrap(),
            Precision::Fp64Emulated(Fixed(9))
        );
        assert_eq!(
            p(
                "precision = \"fp64_emulated\"\nemulation_moduli = 9\n",
                &["engine.emulation_moduli=auto"]
            )
            .unwrap(),
            Precision::Fp64Emulated(Auto)
        );
        let msg = |src: &str, sets: &[&str]| p(src, sets).unwrap_err().to_string();
        let m = msg("precision = \"fp64\"\nemulation_moduli = 9\n", &[]);
        assert!(
            m.contains("engine.emulation_moduli (line 2)")
                && m.contains("set engine.precision = \"fp64_emulated\""),
            "{m}"
        );
        let m = msg("emulation_moduli = 9\n", &[]);
        assert!(m.contains("the precision is not set"), "{m}");
        let m = msg(
            "precision = \"fp64_emulated\"\nemulation_moduli = 17\n",
            &[],
        );
        assert!(m.contains("17 moduli: use 1 to 16"), "{m}");
        let m = msg(
            "precision = \"fp64_emulated\"\nemulation_moduli = \"many\"\n",
            &[],
        );
        assert!(m.contains("\"many\" is unknown"), "{m}");
        let m = msg(
            "precision = \"fp64_emulated\"\n",
            &["engine.emulation_moduli=1.5"],
        );
        assert!(
            m.starts_with("--set engine.emulation_moduli=1.5: ") && m.contains("1 to 16"),
            "{m}"
        );
        let m = msg("precision = \"fp65\"\n", &[]);
        assert!(m.contains("fp64 or fp64_emulated"), "{m}");
    }

    /// `auto` copies from the backend's threshold of lanes on (two GPUs); a mode asked for
    /// outright is kept, and backends that never copy under `auto` (CPU, sim) keep it.
    #[test]
    fn auto_staging_copies_on_several_gpus_only() {
        use super::super::StagingMode::{Auto, Copy, Direct};
        assert_eq!(Auto.on_lanes(1, 2), Auto);
        assert_eq!(Auto.on_lanes(2, 2), Copy);
        assert_eq!(Auto.on_lanes(8, 2), Copy);
        assert_eq!(Direct.on_lanes(2, 2), Direct);
        assert_eq!(Copy.on_lanes(1, 2), Copy);
        assert_eq!(Auto.on_lanes(4, usize::MAX), Auto);
    }
}
