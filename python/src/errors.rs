//! Engine errors as Python exceptions. The classes live in `mgmm_stream/_errors.py` (so they
//! can inherit from both `MgmmError` and a builtin: `ValueError`, `RuntimeError`, `OSError`);
//! the message is the engine's, word for word the CLI's.

use mgmm_stream::error::Error;
use pyo3::prelude::*;

fn raise(py: Python<'_>, class: &str, msg: String) -> PyErr {
    let made = py
        .import("mgmm_stream._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((msg.clone(),)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

/// The exception for an engine error: bad input (plan, file format, usage), device, storage
/// (I/O, checksum), or cancelled.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let class = match &e {
        Error::Plan { .. } | Error::Format { .. } | Error::Usage(_) => "BadInputError",
        Error::Backend { .. } | Error::Device { .. } => "DeviceError",
        Error::Io { .. }
        | Error::Checksum { .. }
        | Error::KeptOutput { .. }
        | Error::Busy { .. } => "StorageError",
        Error::Cancelled => "CancelledError",
        Error::Unverified(_) => "MgmmError",
    };
    let mut msg = python_words(&e.to_string());
    if matches!(e, Error::Cancelled) {
        msg += " (a file output keeps its finished tiles: the same call again resumes it; an array result is not kept)";
    }
    raise(py, class, msg)
}

/// A bad argument detected by the bindings themselves.
pub fn bad_input(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    raise(py, "BadInputError", msg.into())
}

/// A failure that is a bug in the bindings.
pub fn internal(py: Python<'_>, msg: &str) -> PyErr {
    raise(py, "MgmmError", msg.to_string())
}

/// A `RuntimeWarning` with `msg` (what does not stop a call: a timeline that could not be
/// written).
pub fn warn(py: Python<'_>, msg: &str) {
    let _ = PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(),
        &std::ffi::CString::new(msg.replace('\0', " ")).unwrap_or_default(),
        1,
    );
}

/// The command line's words for starting a step over, and a Python caller's, in the order they
/// are replaced (a longer phrase before the words inside it).
const RESTART_WORDS: &[(&str, &str)] = &[
    // A split step's (mgmm_stream.dask: its `restart=True` prepares again).
    (
        "run `mgmm-stream prepare PLAN --restart`",
        "rerun with `restart=True`",
    ),
    ("rerun with --restart", "rerun with `restart=True`"),
    ("then `run --restart`", "then rerun with `restart=True`"),
    ("and `run --restart`", "and rerun with `restart=True`"),
    ("`run --restart`", "`restart=True`"),
    ("run --restart", "rerun with `restart=True`"),
    ("Use --restart", "Pass `restart=True`"),
    ("`--restart`", "`restart=True`"),
    ("--restart", "`restart=True`"),
];

/// A message of the engine as a Python caller should read it: a plan dict by its name
/// ([`plain_dict_text`]), `restart=True` in place of the command line's words for it
/// ([`RESTART_WORDS`]: `rerun with --restart`, `run --restart`, …), and an engine setting
/// given as `set=`, `engine=` or a keyword as one (the command line's `--set engine.KEY=VALUE`
/// read `--set engine.bogus=1: unknown field` for `set={"bogus": 1}`: a new user's trial). A
/// message used to keep the command line's words and end with "(from Python: pass
/// restart=True)".
pub fn python_words(msg: &str) -> String {
    // The setting a message is about leads it as `--set engine.KEY=VALUE: …`; advice inside a
    // message (`raise it with --set engine.host_memory=…`) names the keyword alone.
    let mut out = plain_dict_text(msg);
    if let Some(rest) = out.strip_prefix("--set engine.") {
        out = format!("engine setting {rest}");
    }
    out = out.replace("--set engine.", "");
    for (cli, python) in RESTART_WORDS {
        if out.contains(cli) {
            out = out.replace(cli, python);
        }
    }
    out
}

/// [`python_words`] applied to every string in `v` (a report dict's reasons and notes).
pub fn python_words_in(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => *s = python_words(s),
        serde_json::Value::Array(a) => a.iter_mut().for_each(python_words_in),
        serde_json::Value::Object(o) => o.values_mut().for_each(python_words_in),
        _ => {}
    }
}

/// A message or text about a plan given as a dict, as its caller can read it: the plan's name
/// `<plan dict>` instead of the current directory joined to it (no such file exists), and no
/// line numbers, which are those of the TOML the dict was written as (a new user's trial found
/// `/tmp/t/<plan dict>: matrices.B (line 15): …` and `at line 2, column 1`). Other texts are
/// returned as they are.
pub fn plain_dict_text(msg: &str) -> String {
    if !msg.contains(crate::DICT) {
        return msg.to_string();
    }
    let mut out = msg.to_string();
    if let Ok(cwd) = std::env::current_dir() {
        out = out.replace(&cwd.join(crate::DICT).display().to_string(), crate::DICT);
    }
    for (open, close) in [(" (line ", ")"), (" at line ", "")] {
        while let Some(i) = out.find(open) {
            let rest = &out[i + open.len()..];
            let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
            if digits == 0 {
                break;
            }
            let mut end = i + open.len() + digits;
            if close.is_empty() {
                // `at line N, column M`
                let tail = &out[end..];
                if let Some(t) = tail.strip_prefix(", column ") {
                    end += ", column ".len() + t.chars().take_while(|c| c.is_ascii_digit()).count();
                }
            } else if out[end..].starts_with(close) {
                end += close.len();
            } else {
                break;
            }
            out.replace_range(i..end, "");
        }
    }
    out
}
