//! The `.npy` header: parsed strictly ([`read_header`]) and written ([`header_bytes`]).
//!
//! Supports C-order 2-D arrays of little-endian f32 (`<f4`) or f64 (`<f8`), format versions
//! 1.0, 2.0 and 3.0. The header is parsed strictly as the Python literal numpy writes (a dict of
//! exactly `descr`, `fortran_order` and `shape`), not by searching for substrings, so a malformed
//! or unexpected header is refused instead of half-read. Anything else — big-endian data,
//! Fortran order, other dtypes, structured or object arrays, other ranks — is refused with a
//! message that says what was found and what to do.
//!
//! A small parser here rather than the `npyz` crate: the engine needs only the header (the data
//! is moved in large blocks by its own streaming code), the error messages must name the file
//! and say how to fix the array, and the parser is a hundred lines with no dependency.
//!
//! Its own file, below every `.npy` reader and writer ([`super::npy_source`],
//! [`super::npy_sink`], import and export in [`super::npy`], which re-exports its public names).

use std::io::Read;
use std::path::Path;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Refuse headers longer than this (numpy's own limit is far smaller for sane arrays).
const MAX_HEADER: usize = 1 << 20;

/// The parts of a `.npy` header the engine uses.
pub struct NpyHeader {
    /// Element type.
    pub dtype: DType,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// Stored column by column (`fortran_order`): the bytes are the row-major transpose.
    pub fortran: bool,
    /// Byte offset of the first element.
    pub data_offset: u64,
    /// An output the engine has not finished ([`UNFINISHED`]): its header is one numpy
    /// refuses, so only the engine itself reads it (to resume it, `info`, `export
    /// --allow-partial`).
    pub unfinished: bool,
}

/// How the header of a `.npy` output the engine is still writing starts. The header is then a
/// Python tuple, this sentence then the dict of the finished array —
/// `'UNFINISHED mgmm-stream output: …', {'descr': '<f4', 'fortran_order': False, 'shape': (R, C), }`
/// — which numpy refuses (`ValueError: Header is not a dictionary: ('UNFINISHED …', {…})`),
/// so an output cut short by a kill cannot be loaded as an array with zeros where tiles are
/// missing. The real header is written over it once the last tile is durable
/// (docs/FORMAT.md).
pub(crate) const UNFINISHED: &str = "UNFINISHED mgmm-stream output: not every tile is written yet, so this is not an array to load; run the plan that writes it again to finish it (mgmm-stream info FILE says how far it is)";

/// A value in the header dict: the subset of Python literals numpy writes there.
#[derive(Clone, Debug, PartialEq)]
enum Literal {
    Str(String),
    Bool(bool),
    Int(u64),
    Tuple(Vec<Literal>),
    List(Vec<Literal>),
}

impl std::fmt::Display for Literal {
    /// As Python would print it, for error messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let join = |v: &[Literal]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Literal::Str(s) => write!(f, "'{s}'"),
            Literal::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Literal::Int(n) => write!(f, "{n}"),
            Literal::Tuple(v) if v.len() == 1 => write!(f, "({},)", v[0]),
            Literal::Tuple(v) => write!(f, "({})", join(v)),
            Literal::List(v) => write!(f, "[{}]", join(v)),
        }
    }
}

/// A strict recursive-descent parser for `{'key': literal, ...}`.
struct LiteralParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl LiteralParser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }
    fn expect(&mut self, c: u8) -> std::result::Result<(), String> {
        match self.peek() {
            Some(x) if x == c => {
                self.i += 1;
                Ok(())
            }
            Some(x) => Err(format!(
                "expected '{}' at byte {} but found '{}'",
                c as char, self.i, x as char
            )),
            None => Err(format!("expected '{}' but the header ended", c as char)),
        }
    }
    fn string(&mut self) -> std::result::Result<String, String> {
        let q = self.peek().filter(|&q| q == b'\'' || q == b'"');
        let q = q.ok_or_else(|| format!("expected a quoted string at byte {}", self.i))?;
        let start = self.i + 1;
        let len = self.s[start..]
            .iter()
            .position(|&c| c == q || c == b'\\')
            .ok_or("unterminated string")?;
        if self.s[start + len] == b'\\' {
            return Err("escape sequences in header strings are not supported".into());
        }
        self.i = start + len + 1;
        String::from_utf8(self.s[start..start + len].to_vec())
            .map_err(|_| "header string is not valid text".into())
    }
    /// Items up to `close`, comma separated, an optional trailing comma.
    fn items(&mut self, close: u8) -> std::result::Result<Vec<Literal>, String> {
        let mut v = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.i += 1;
                return Ok(v);
            }
            v.push(self.value()?);
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(c) if c == close => {}
                _ => {
                    return Err(format!(
                        "expected ',' or '{}' at byte {}",
                        close as char, self.i
                    ))
                }
            }
        }
    }
    fn value(&mut self) -> std::result::Result<Literal, String> {
        match self.peek() {
            Some(b'\'') | Some(b'"') => Ok(Literal::Str(self.string()?)),
            Some(b'(') => {
                self.i += 1;
                Ok(Literal::Tuple(self.items(b')')?))
            }
            Some(b'[') => {
                self.i += 1;
                Ok(Literal::List(self.items(b']')?))
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).expect("ASCII digits");
                t.parse()
                    .map(Literal::Int)
                    .map_err(|_| format!("integer {t} is too large"))
            }
            _ => {
                for (word, v) in [("True", true), ("False", false)] {
                    if self.s[self.i..].starts_with(word.as_bytes()) {
                        self.i += word.len();
                        return Ok(Literal::Bool(v));
                    }
                }
                Err(format!("unexpected value at byte {}", self.i))
            }
        }
    }
    /// The whole header: one dict, then only whitespace.
    fn dict(&mut self) -> std::result::Result<Vec<(String, Literal)>, String> {
        self.expect(b'{')?;
        let mut out: Vec<(String, Literal)> = Vec::new();
        loop {
            if self.peek() == Some(b'}') {
                self.i += 1;
                break;
            }
            let k = self.string()?;
            self.expect(b':')?;
            let v = self.value()?;
            if out.iter().any(|(o, _)| *o == k) {
                return Err(format!("key '{k}' appears twice"));
            }
            out.push((k, v));
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {}
                _ => return Err(format!("expected ',' or '}}' at byte {}", self.i)),
            }
        }
        if self.peek().is_some() {
            return Err(format!("unexpected text after the dict at byte {}", self.i));
        }
        Ok(out)
    }
}

/// The element type for a `descr` string, or a message saying why it cannot be read and how to
/// convert the array.
fn parse_descr(descr: &str) -> std::result::Result<DType, String> {
    let (order, code) = descr.split_at(descr.len().min(1));
    let convert = "convert it with a.astype('<f4') (or '<f8') and save again";
    let kind = match code.as_bytes().first() {
        Some(b'f') => match code {
            "f2" => Some(DType::F16),
            "f4" => Some(DType::F32),
            "f8" => Some(DType::F64),
            _ => None,
        },
        Some(b'i' | b'u' | b'b') => {
            return Err(format!(
                "dtype '{descr}' is an integer (or boolean) array; only float16, float32 and float64 can be read: {convert}"
            ))
        }
        Some(b'c') => {
            return Err(format!(
                "dtype '{descr}' is complex; only real float16, float32 and float64 can be read: multiply the real and imaginary parts separately (a.real.astype('<f4'), a.imag.astype('<f4'))"
            ))
        }
        Some(b'O') => {
            return Err(format!(
                "dtype '{descr}' is an object array (Python objects, not numbers in the file); {convert}"
            ))
        }
        Some(b'V') if code == "V2" => {
            return Err(format!(
                "dtype '{descr}' is a raw 2-byte type, most likely bfloat16 from ml_dtypes (numpy has no standard bf16 dtype); either save a.astype(np.float32), or write the bits with a.tofile('x.bin') and declare it as format = \"raw\", dtype = \"bf16\" (docs/PLAN.md)"
            ))
        }
        _ => None,
    };
    let dtype = kind.ok_or_else(|| {
        format!("dtype '{descr}' is not supported (float16, float32 and float64 are); {convert}")
    })?;
    match order {
        "<" | "=" => Ok(dtype),
        ">" => Err(format!(
            "dtype '{descr}' is big-endian; only little-endian data can be read: convert it with a.astype('<{code}') and save again"
        )),
        _ => Err(format!(
            "dtype '{descr}' is not supported (float16, float32 and float64 are); {convert}"
        )),
    }
}

/// What the header dict says: element type, shape as numpy reports it, and the order.
struct Interpreted {
    dtype: DType,
    rows: u64,
    cols: u64,
    fortran: bool,
}

/// Interpret the parsed dict: exactly `descr`, `fortran_order` and `shape`.
fn interpret(dict: Vec<(String, Literal)>) -> std::result::Result<Interpreted, String> {
    let mut descr = None;
    let mut fortran = None;
    let mut shape = None;
    for (k, v) in dict {
        match k.as_str() {
            "descr" => descr = Some(v),
            "fortran_order" => fortran = Some(v),
            "shape" => shape = Some(v),
            _ => return Err(format!("unexpected key '{k}' in the .npy header")),
        }
    }
    let dtype = match descr.ok_or("header has no 'descr'")? {
        Literal::Str(d) => parse_descr(&d)?,
        Literal::List(_) => {
            return Err(
                "structured dtypes (record arrays) are not supported; save one plain float field, e.g. np.save('x.npy', a['field'].astype('<f4'))".into(),
            )
        }
        other => return Err(format!("header 'descr' is {other}, not a dtype string")),
    };
    let fortran = match fortran.ok_or("header has no 'fortran_order'")? {
        Literal::Bool(b) => b,
        other => {
            return Err(format!(
                "header 'fortran_order' is {other}, not True or False"
            ))
        }
    };
    let shape = shape.ok_or("header has no 'shape'")?;
    let shown = shape.to_string();
    let dims: Vec<u64> = match shape {
        Literal::Tuple(items) => items
            .into_iter()
            .map(|d| match d {
                Literal::Int(n) => Ok(n),
                other => Err(format!("shape entry {other} is not an integer")),
            })
            .collect::<std::result::Result<_, _>>()?,
        other => return Err(format!("header 'shape' is {other}, not a tuple")),
    };
    let hint = match dims.len() {
        0 => Some("it is a 0-d scalar; save a matrix, e.g. a.reshape(1, 1)"),
        1 => Some("it is 1-D; save it as a row a.reshape(1, -1) or a column a.reshape(-1, 1)"),
        2 => None,
        _ => Some("save it as 2-D, e.g. a.reshape(-1, a.shape[-1])"),
    };
    if let Some(h) = hint {
        return Err(format!(
            "array has shape {shown}; only 2-D arrays (matrices) are supported: {h}"
        ));
    }
    if dims[0] == 0 || dims[1] == 0 {
        return Err(format!(
            "array has shape {shown}; empty matrices are not supported"
        ));
    }
    Ok(Interpreted {
        dtype,
        rows: dims[0],
        cols: dims[1],
        fortran,
    })
}

/// Read and validate the header of a `.npy` stream positioned at its start.
pub fn read_header(path: &Path, r: &mut impl Read) -> Result<NpyHeader> {
    let bad = |m: String| Error::format(path, m);
    let mut pre = [0u8; 8];
    r.read_exact(&mut pre)
        .map_err(|_| bad("too short to be a .npy file".into()))?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file (missing \\x93NUMPY magic)".into()));
    }
    let (major, minor) = (pre[6], pre[7]);
    let len_bytes = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => {
            return Err(bad(format!(
                ".npy format version {major}.{minor} is not supported (1.0, 2.0 and 3.0 are)"
            )))
        }
    };
    let mut b = [0u8; 4];
    r.read_exact(&mut b[..len_bytes])
        .map_err(|_| bad("truncated .npy header".into()))?;
    let hlen = u32::from_le_bytes(b) as usize;
    if hlen > MAX_HEADER {
        return Err(bad(format!(".npy header claims {hlen} bytes; refusing")));
    }
    let mut h = vec![0u8; hlen];
    r.read_exact(&mut h)
        .map_err(|_| bad("truncated .npy header".into()))?;
    // An output the engine is still writing: the sentence, a comma, then the dict.
    let mark = format!("'{UNFINISHED}',");
    let unfinished = h.starts_with(mark.as_bytes());
    let from = if unfinished { mark.len() } else { 0 };
    // Versions 1 and 2 are latin-1 and version 3 UTF-8; every header numpy writes for the
    // arrays accepted here is ASCII, so anything else is refused by the parser's string rules.
    let dict = LiteralParser { s: &h, i: from }
        .dict()
        .map_err(|m| bad(format!("malformed .npy header: {m}")))?;
    let it = interpret(dict).map_err(bad)?;
    Ok(NpyHeader {
        dtype: it.dtype,
        rows: it.rows,
        cols: it.cols,
        fortran: it.fortran,
        data_offset: (6 + 2 + len_bytes + hlen) as u64,
        unfinished,
    })
}

/// The bytes of a .npy header for a C-order 2-D array.
pub fn header_bytes(dtype: DType, rows: u64, cols: u64) -> Result<Vec<u8>> {
    header_bytes_order(dtype, rows, cols, false)
}

/// The bytes of a .npy header for a 2-D array, C or Fortran (`fortran`) order.
pub(crate) fn header_bytes_order(
    dtype: DType,
    rows: u64,
    cols: u64,
    fortran: bool,
) -> Result<Vec<u8>> {
    let descr = match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        other => {
            return Err(Error::Usage(format!(
                "cannot export {other} data to .npy (f32 and f64 only)"
            )))
        }
    };
    let order = if fortran { "True" } else { "False" };
    let dict =
        format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': ({rows}, {cols}), }}");
    let mut v1 = true;
    let mut total = 10 + dict.len() + 1;
    if total.div_ceil(64) * 64 - 10 > u16::MAX as usize {
        v1 = false;
        total = 12 + dict.len() + 1;
    }
    let padded = total.div_ceil(64) * 64;
    let pre = if v1 { 10 } else { 12 };
    let hlen = padded - pre;
    let mut out = Vec::with_capacity(padded);
    out.extend_from_slice(b"\x93NUMPY");
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(hlen as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(hlen as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(padded - 1, b' ');
    out.push(b'\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete header of format `version` around `dict`, padded to 64 bytes like numpy.
    fn header(version: u8, dict: &str) -> Vec<u8> {
        let pre = if version == 1 { 10 } else { 12 };
        let total = (pre + dict.len() + 1).div_ceil(64) * 64;
        let mut h = vec![0x93, b'N', b'U', b'M', b'P', b'Y', version, 0];
        if version == 1 {
            h.extend_from_slice(&((total - pre) as u16).to_le_bytes());
        } else {
            h.extend_from_slice(&((total - pre) as u32).to_le_bytes());
        }
        h.extend_from_slice(dict.as_bytes());
        h.resize(total - 1, b' ');
        h.push(b'\n');
        h
    }

    fn parse(bytes: &[u8]) -> Result<NpyHeader> {
        read_header(Path::new("x.npy"), &mut &bytes[..])
    }

    fn err(bytes: &[u8]) -> String {
        match parse(bytes) {
            Ok(h) => panic!("parsed as {}×{} {}", h.rows, h.cols, h.dtype),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn versions_1_2_3() {
        let dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (3, 5), }";
        for v in [1, 2, 3] {
            let bytes = header(v, dict);
            let h = parse(&bytes).unwrap();
            assert_eq!((h.dtype, h.rows, h.cols), (DType::F64, 3, 5), "v{v}");
            assert_eq!(h.data_offset as usize, bytes.len(), "v{v}");
        }
        let e = err(&{
            let mut b = header(1, dict);
            b[6] = 4;
            b
        });
        assert!(e.contains("version 4.0"), "{e}");
    }

    #[test]
    fn our_own_header_round_trips_and_key_order_is_free() {
        for (dt, rows, cols) in [(DType::F32, 1, 1), (DType::F64, 70000, 3)] {
            let h = parse(&header_bytes(dt, rows, cols).unwrap()).unwrap();
            assert_eq!((h.dtype, h.rows, h.cols), (dt, rows, cols));
        }
        let d = "{\"shape\": (2,3), \"fortran_order\": False, \"descr\": \"<f4\"}";
        let h = parse(&header(1, d)).unwrap();
        assert_eq!((h.dtype, h.rows, h.cols), (DType::F32, 2, 3));
    }

    #[test]
    fn big_endian_fortran_and_bad_dtypes_are_refused() {
        let d = |descr: &str, fortran: &str, shape: &str| {
            header(
                1,
                &format!("{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}"),
            )
        };
        let e = err(&d("'>f4'", "False", "(2, 2)"));
        assert!(e.contains("big-endian") && e.contains("x.npy"), "{e}");
        let h = parse(&d("'<f4'", "True", "(2, 3)")).unwrap();
        assert!(h.fortran && (h.rows, h.cols) == (2, 3));
        let h = parse(&d("'<f2'", "False", "(2, 3)")).unwrap();
        assert_eq!(h.dtype, DType::F16);
        for (bad, want) in [
            ("'<i4'", "integer"),
            ("'|b1'", "integer (or boolean)"),
            ("'|O'", "object array"),
            ("'<c8'", "complex"),
            ("'f4'", "not supported"),
            ("'<f16'", "not supported"),
            ("'|V2'", "bfloat16 from ml_dtypes"),
        ] {
            let e = err(&d(bad, "False", "(2, 2)"));
            assert!(
                e.contains(want) && e.contains(&bad[1..bad.len() - 1]),
                "{e}"
            );
            assert!(e.contains("astype"), "{e}");
        }
        let e = err(&d("[('a', '<f4')]", "False", "(2, 2)"));
        assert!(e.contains("structured"), "{e}");
        for (shape, hint) in [
            ("(16,)", "reshape(1, -1)"),
            ("()", "0-d"),
            ("(2, 3, 4)", "reshape(-1"),
        ] {
            let e = err(&d("'<f4'", "False", shape));
            assert!(
                e.contains(shape) && e.contains("2-D") && e.contains(hint),
                "{e}"
            );
        }
        let e = err(&d("'<f4'", "False", "(0, 3)"));
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn malformed_headers_are_refused() {
        for (dict, needle) in [
            ("{'descr': '<f4', 'fortran_order': False}", "no 'shape'"),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), 'x': 1}",
                "'x'",
            ),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)}",
                "twice",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 2)}",
                "fortran_order",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)} junk",
                "after the dict",
            ),
            (
                "{'descr': '<f4' 'fortran_order': False, 'shape': (2, 2)}",
                "expected ','",
            ),
            (
                "{'descr': '<f4, 'fortran_order': False, 'shape': (2, 2)}",
                "malformed",
            ),
            ("'descr': '<f4'", "expected '{'"),
        ] {
            let e = err(&header(1, dict));
            assert!(e.contains(needle), "{dict}: {e}");
        }
        assert!(err(b"\x93NUMPY\x01").contains("too short"));
        assert!(err(b"PK\x03\x04....").contains("not a .npy file"));
        let mut t = header(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }",
        );
        t.truncate(30);
        assert!(err(&t).contains("truncated"));
    }
}
