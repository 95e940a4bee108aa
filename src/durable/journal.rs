//! The resume journal: which output tiles are durably finished, beside the output file.
//!
//! `C.mgt.journal` starts with one text line — a magic word and a JSON fingerprint of everything
//! that determines the output's bytes (output header, expression, alpha/beta, precision,
//! backend kind, compute tile, and the identity of every input: size, header block, checksum
//! table) — followed by fixed 16-byte binary records, one per finished output tile:
//! `[u32 "JREC"][u32 tile seq][u32 CRC-32C of the tile's data][u32 CRC-32C of the first 12 bytes]`.
//! A record is appended only after the tile's data has been written (and, with `durable`,
//! flushed to disk), so a torn or missing record only ever costs redoing that tile. A record
//! with seq `u32::MAX` marks the step complete.
//!
//! The journal file is locked (`flock`, exclusive, non-blocking) for the whole step, so a second
//! run on the same output fails at once instead of interleaving writes.
//!
//! A step split across processes ([`crate::cluster`]) keeps one journal per shard in the same
//! format ([`Journal::open_shard`]); those are not locked (`flock` may be node-local or missing
//! on cluster filesystems; the shard's claim file keeps writers apart), and `finalize` merges
//! them into the step's journal ([`write_complete`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::store::atomic::TempOutput;
use crate::store::fsutil;

const MAGIC: &str = "MGMJRNL1";
const REC: u32 = u32::from_le_bytes(*b"JREC");
pub(crate) const COMPLETE: u32 = u32::MAX;

/// What determines an output's bytes, as named fields (so a mismatch can say what changed).
pub(crate) type Fingerprint = BTreeMap<String, String>;

/// What a journal says about an existing output.
#[derive(Debug)]
pub(crate) enum State {
    /// Nothing usable: compute every tile.
    Fresh,
    /// These tiles (seq, data CRC) are finished; so many records were damaged and skipped.
    Partial(Vec<(u32, u32)>, usize),
    /// The step finished earlier.
    Complete,
}

pub(crate) struct Journal {
    path: PathBuf,
    file: Mutex<File>,
    durable: bool,
}

/// The journal file of `output`: `OUTPUT.journal` beside it.
pub fn journal_path(output: &Path) -> PathBuf {
    let mut s = output.as_os_str().to_owned();
    s.push(".journal");
    PathBuf::from(s)
}

/// How long a journal lock held by someone else is waited for before the run gives up: a lock
/// can outlive its holder for a moment. A `flock` belongs to the open file, and a process
/// forked between another run's open and its exec (a test harness running the command line
/// beside the library) holds that file until it execs (`O_CLOEXEC`); one CI run met that
/// (`tests/it/progress.rs`, a resume right after a failed run in the same process).
const LOCK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

fn lock(file: &File, path: &Path) -> Result<()> {
    match wait_for(file, crate::store::fsutil::try_lock_exclusive) {
        Ok(true) => Ok(()),
        Ok(false) => {
            let (who, doing) = holder_of(file);
            Err(Error::Usage(format!(
                "{}: another mgmm-stream {who} is {doing} this output (its journal is locked); wait for it to finish or stop it first",
                path.display(),
            )))
        }
        Err(e) => Err(Error::io(path, "cannot lock journal", e)),
    }
}

/// `try` (a non-blocking `flock`) until it succeeds or [`LOCK_GRACE`] has passed.
fn wait_for(file: &File, r#try: fn(&File) -> std::io::Result<bool>) -> std::io::Result<bool> {
    let t = std::time::Instant::now();
    let mut got = r#try(file);
    while matches!(got, Ok(false)) && t.elapsed() < LOCK_GRACE {
        std::thread::sleep(std::time::Duration::from_millis(10));
        got = r#try(file);
    }
    got
}

/// A reader's hold on the journal of an output (`verify`): a shared lock, so that no run starts
/// writing the output while it is read. `None` inside when there is no journal (nothing locks
/// such an output).
pub(crate) struct ReadLock(#[allow(dead_code)] Option<File>);

/// Take a shared lock on the journal of `output` for reading the output, waiting at most
/// [`LOCK_GRACE`]. While a run holds it (it is writing the output: a `run`, a `run --restart`,
/// the run of a `verify --repair`) the output is neither right nor wrong yet, so that is
/// [`Error::Busy`], naming the run's pid where the system says it.
pub(crate) fn read_lock(output: &Path) -> Result<ReadLock> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = journal_path(output);
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ReadLock(None)),
        // A link or a file that cannot be read: what reads the journal next says why.
        Err(_) => return Ok(ReadLock(None)),
    };
    match wait_for(&file, crate::store::fsutil::try_lock_shared) {
        Ok(true) => Ok(ReadLock(Some(file))),
        Ok(false) => {
            let by = match crate::store::fsutil::flock_holder(&file) {
                Some((pid, _)) => format!("a run (pid {pid})"),
                None => "a run".into(),
            };
            Err(Error::Busy {
                path: output.to_path_buf(),
                msg: format!(
                    "is being written by {by} right now (its journal {} is locked), so it is neither finished nor checkable; verify it once that run has ended",
                    path.display()
                ),
            })
        }
        Err(e) => Err(Error::io(&path, "cannot lock journal", e)),
    }
}

/// The journal at `path` as it stands (`None`: not there), refused when it is a symlink or
/// another kind of file — first, before anything reads it, so every command says what is wrong
/// with it rather than what it would find through the link.
fn refuse_odd_journal(path: &Path) -> Result<Option<std::fs::Metadata>> {
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return Ok(None);
    };
    if m.file_type().is_symlink() || !m.is_file() {
        let what = if m.file_type().is_symlink() {
            "a symbolic link"
        } else {
            "not a regular file"
        };
        return Err(Error::Usage(format!(
            "{p}: is {what}; a journal is written in place, so mgmm-stream will not write through it — replace it with a copy of what it points at (`cp --remove-destination \"$(readlink -f {p})\" {p}`) to keep its progress, or remove it",
            p = path.display()
        )));
    }
    Ok(Some(m))
}

/// [`refuse_odd_journal`] for the journal of `output`: among `run`'s up-front checks
/// ([`crate::run::space`]), so that a linked journal is refused before any step runs or is
/// restarted, and `plan` warns of it.
pub(crate) fn refuse_odd(output: &Path) -> Result<()> {
    refuse_odd_journal(&journal_path(output)).map(drop)
}

/// Make the journal at `path` safe to write in place. A symlink or another kind of file is
/// refused: the journal is truncated on `--restart` and appended to on every run, so through a
/// link it would overwrite whatever it points at (an input, say). A regular file with other hard
/// links (a `cp -al` or rsnapshot backup) gets a copy of its own, renamed over it, so the other
/// names keep their bytes and the progress it records is kept.
fn own_journal_file(path: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Some(m) = refuse_odd_journal(path)? else {
        return Ok(());
    };
    if m.nlink() > 1 {
        let tmp = TempOutput::new(path, m.len())?;
        let mut to = tmp.file();
        File::open(path)
            .and_then(|mut from| std::io::copy(&mut from, &mut to))
            .and_then(|_| to.sync_all())
            .map_err(|e| {
                Error::io(
                    path,
                    "has other hard links and a copy of its own could not be made",
                    e,
                )
            })?;
        tmp.commit()?;
    }
    Ok(())
}

/// Make a journal being resumed end at its last good record, so new records follow it: a torn
/// tail is cut off.
fn settle(file: &File, path: &Path, good_end: usize) -> Result<()> {
    file.set_len(good_end as u64)
        .map_err(|e| Error::io(path, "cannot trim journal", e))
}

/// Whether the journal `bytes` is a first line torn before its newline: no newline at all, and
/// the beginning of a header line (or the zeros a crash can leave where it was being written).
/// Records follow the header only once it is written whole and synced, so such a journal
/// records nothing, and is written again whole (docs/RESILIENCE.md).
fn torn_header(bytes: &[u8]) -> bool {
    let magic = format!("{MAGIC} ");
    let magic = magic.as_bytes();
    !bytes.is_empty()
        && !bytes.contains(&b'\n')
        && (bytes.starts_with(magic) || magic.starts_with(bytes) || bytes.iter().all(|&b| b == 0))
}

/// Whether the journal of `output` is a first line torn before its newline ([`torn_header`]):
/// `run` writes it again and computes the step; readers ([`peek`]) see no journal.
pub(crate) fn torn(output: &Path) -> bool {
    std::fs::read(journal_path(output)).is_ok_and(|b| torn_header(&b))
}

impl Journal {
    /// Open (creating if needed) and lock the journal of `output`, and read its state against
    /// `fp`. `restart` discards whatever it held. A journal without its output file is
    /// meaningless (the state is then `Fresh`).
    pub(crate) fn open(
        output: &Path,
        fp: &Fingerprint,
        restart: bool,
        durable: bool,
    ) -> Result<(Journal, State)> {
        let path = journal_path(output);
        let existed = path.exists();
        own_journal_file(&path)?;
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| Error::io(&path, "cannot open journal", e))?;
        lock(&file, &path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| Error::io(&path, "cannot read journal", e))?;
        let state = match read_state(output, &path, fp, restart, &bytes) {
            Ok(s) => s,
            Err(e) => {
                // A refused run leaves nothing behind: not even the empty journal it created.
                if !existed {
                    let _ = std::fs::remove_file(&path);
                }
                return Err(e);
            }
        };
        if matches!(state, State::Fresh) {
            file.set_len(0)
                .map_err(|e| Error::io(&path, "cannot reset journal", e))?;
            use std::os::unix::fs::FileExt;
            file.write_all_at(header_line(fp).as_bytes(), 0)
                .map_err(|e| Error::io(&path, "cannot write journal", e))?;
            fsutil::sync_file(&file, &path)?;
        }
        if !existed {
            // Its name, too: a journal lost from the directory would leave an output that
            // cannot be resumed.
            fsutil::sync_parent(&path)?;
        } else if let State::Partial(..) = &state {
            let (_, peek) = parse(&path, &bytes)?;
            settle(&file, &path, peek.good_end)?;
        }
        use std::io::Seek;
        file.seek(std::io::SeekFrom::End(0))
            .map_err(|e| Error::io(&path, "cannot seek journal", e))?;
        Ok((
            Journal {
                path,
                file: Mutex::new(file),
                durable,
            },
            state,
        ))
    }

    /// Append a record (after the tile's data is written and, if durable, flushed).
    pub(crate) fn record(&self, seq: u32, data_crc: u32) -> Result<()> {
        let rec = encode(seq, data_crc);
        let mut f = self.file.lock().unwrap();
        f.write_all(&rec)
            .map_err(|e| Error::io(&self.path, "cannot append to journal", e))?;
        if self.durable {
            f.sync_data()
                .map_err(|e| Error::io(&self.path, "cannot sync journal", e))?;
        }
        fsutil::log_sync("record", &self.path);
        Ok(())
    }

    pub(crate) fn complete(&self) -> Result<()> {
        self.record(COMPLETE, 0)?;
        self.file
            .lock()
            .unwrap()
            .sync_all()
            .map_err(|e| Error::io(&self.path, "cannot sync journal", e))
    }
}

/// One 16-byte record: magic, tile seq, data CRC, CRC of the first 12 bytes.
fn encode(seq: u32, data_crc: u32) -> [u8; 16] {
    let mut rec = [0u8; 16];
    rec[0..4].copy_from_slice(&REC.to_le_bytes());
    rec[4..8].copy_from_slice(&seq.to_le_bytes());
    rec[8..12].copy_from_slice(&data_crc.to_le_bytes());
    let c = crc32c::crc32c(&rec[..12]);
    rec[12..16].copy_from_slice(&c.to_le_bytes());
    rec
}

fn header_line(fp: &Fingerprint) -> String {
    format!(
        "{MAGIC} {}\n",
        serde_json::to_string(fp).expect("fingerprint serializes")
    )
}

/// The state the journal `bytes` (read from `path`, the journal of `output`) records against
/// `fp`. An empty journal beside an existing output, an unreadable header and a fingerprint
/// other than `fp` are errors saying what to do.
fn read_state(
    output: &Path,
    path: &Path,
    fp: &Fingerprint,
    restart: bool,
    bytes: &[u8],
) -> Result<State> {
    let output_exists = output.exists();
    if restart || bytes.is_empty() {
        if output_exists && !restart && bytes.is_empty() {
            if let Some(state) = super::split::split_state(output) {
                return Err(Error::Usage(format!(
                    "{}: a split run is writing this output (its shards' state is in {}): go on with `mgmm-stream run PLAN --shard K/S` for the shards left, or `--shards S` to run them all here (`mgmm-stream status PLAN` names them); --restart would throw the split run's tiles away",
                    output.display(),
                    state.display()
                )));
            }
            return Err(Error::Usage(format!(
                "{}: the output exists but was not written by this plan (no journal); rerun with --restart to overwrite it, or choose another output path",
                output.display()
            )));
        }
        return Ok(State::Fresh);
    }
    if torn_header(bytes) {
        // Torn while first written: it records nothing (whatever the output holds is from
        // before, or half created), so the step starts afresh and the line is written whole.
        return Ok(State::Fresh);
    }
    if !output_exists {
        // Its output is gone: the journal has nothing to resume, whatever plan wrote it (one
        // recording another tile was refused, with advice to resume what no longer exists).
        return Ok(State::Fresh);
    }
    let (_, peek) = parse(path, bytes)?;
    if !same_fingerprint(&peek.fingerprint, fp) {
        return Err(foreign(path, &peek.fingerprint, fp));
    }
    Ok(if peek.complete {
        State::Complete
    } else {
        State::Partial(peek.done, peek.damaged)
    })
}

/// The error for the journal at `path`, written under fingerprint `old`, met by a run whose
/// fingerprint is `new`: what differs, and what to do.
pub(crate) fn foreign(path: &Path, old: &Fingerprint, new: &Fingerprint) -> Error {
    // A tile that changed alone is the budget's doing (`tile = "auto"` picks the largest that
    // fits; a resume keeps the recorded one only while it still fits, `run::layout_for`).
    let only_tile = old.iter().all(|(k, v)| {
        k == "compute tile" || k == "output" || new.get(k).is_some_and(|w| same_value(v, w))
    });
    let hint = match old.get("compute tile") {
        Some(t) if only_tile && new.get("compute tile") != Some(t) => format!(
            "; only the compute tile changed (engine.tile set otherwise, or, with tile = \"auto\", other memory budgets): set engine.tile = [{}] to resume (with tile = \"auto\", giving the run the engine.host_memory and device memory it had does too)",
            t.replace('×', ", ")
        ),
        _ => mtime_hint(old, new),
    };
    Error::Usage(format!(
        "{}: the journal is from a different plan or different inputs ({}){hint}; rerun with --restart to start this step over (the output is overwritten), or restore the plan and inputs to resume",
        path.display(),
        fingerprint_changes(old, new)
    ))
}

/// An input identity (`PATH (N bytes, mtime T ns, …)`, `.npy` and raw files) without its
/// modification time, and that time in nanoseconds; `None` for a value without one.
fn without_mtime(v: &str) -> Option<(String, i128)> {
    let at = v.find(", mtime ")?;
    let rest = &v[at + ", mtime ".len()..];
    let (ns, tail) = rest.split_once(" ns")?;
    Some((format!("{}{tail}", &v[..at]), ns.parse().ok()?))
}

/// The hint for fingerprints that differ only in inputs' modification times (same size and
/// sampled contents): a file restored with `cp` or touched looks changed (new-user trial), and
/// the way back is its old time, not `--restart`. Empty otherwise.
fn mtime_hint(old: &Fingerprint, new: &Fingerprint) -> String {
    let mut touched = Vec::new();
    for (k, v) in old {
        let Some(w) = new.get(k) else {
            return String::new();
        };
        if same_value(v, w) {
            continue;
        }
        match (without_mtime(v), without_mtime(w)) {
            (Some((a, t)), Some((b, _))) if same_value(&a, &b) => {
                let path = v.split(" (").next().unwrap_or(v);
                let (s, ns) = (t.div_euclid(1_000_000_000), t.rem_euclid(1_000_000_000));
                touched.push(format!("touch -d @{s}.{ns:09} {path}"));
            }
            _ => return String::new(),
        }
    }
    if touched.is_empty() || old.len() != new.len() {
        return String::new();
    }
    format!(
        "; only the modification time of its inputs changed (same size and sampled contents): if their bytes are the ones the journal saw (a copy restored without `cp -p`, a touch), give them back their time ({}) to resume",
        touched.join("; ")
    )
}

/// What differs between two fingerprints: `key: was X, now Y` for each key, joined by `; `.
/// Whether the fingerprints `a` and `b` describe the same output bytes. Inputs identified by
/// their content ("PATH (N bytes, …)": size, header and tile checksums for `.mgt`; size, mtime
/// and sampled CRCs for `.npy` and raw) match whatever their path, and a chain's intermediates
/// by file name: a job folder that was moved or copied whole resumes and verifies where it lies
/// now.
pub(crate) fn same_fingerprint(a: &Fingerprint, b: &Fingerprint) -> bool {
    let a = renamed(a, b);
    a.len() == b.len()
        && a.iter()
            .all(|(k, v)| b.get(k).is_some_and(|w| same_entry(k, v, w)))
}

/// One entry of two fingerprints, by [`same_fingerprint`]'s rule: the expression without its
/// scale and its matrices' names ([`same_expr`]), the rest by [`same_value`].
fn same_entry(key: &str, a: &str, b: &str) -> bool {
    match key {
        "expr" => same_expr(a, b),
        _ => same_value(a, b),
    }
}

/// An expression's text with its matrices' names taken out, and the names in order:
/// `2 * A.T @ B` → (`_.T @ _`, [A, B]). The scale in front is dropped (it is `alpha`'s
/// entry); `.T` and numbers stay text, a `.T.T` (no transpose) taken out.
fn expr_shape(e: &str) -> (String, Vec<String>) {
    let e = e.trim();
    let e = match e.split_once(" * ") {
        Some((k, rest)) if k.trim().parse::<f64>().is_ok() => rest.trim(),
        _ => e,
    };
    let (mut shape, mut names) = (String::new(), Vec::new());
    let mut chars = e.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c.is_alphabetic() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if !(d.is_alphanumeric() || d == '_') {
                    break;
                }
                end = j + d.len_utf8();
                chars.next();
            }
            // `X.T`'s `T` is not a name.
            match shape.ends_with('.') {
                true => shape.push_str(&e[i..end]),
                false => {
                    shape.push('_');
                    names.push(e[i..end].to_string());
                }
            }
        } else {
            shape.push(c);
        }
    }
    while shape.contains(".T.T") {
        shape = shape.replace(".T.T", "");
    }
    (shape, names)
}

/// How the matrices of expression `a` are named in `b` when both are the same product under
/// other names (`1 * a @ b` as the Python package journals it, `A @ B` in a plan): the same
/// shape, and names that correspond one to one. `None` otherwise.
fn name_map(a: &str, b: &str) -> Option<BTreeMap<String, String>> {
    let ((sa, na), (sb, nb)) = (expr_shape(a), expr_shape(b));
    if sa != sb || na.len() != nb.len() {
        return None;
    }
    let (mut fwd, mut back) = (BTreeMap::new(), BTreeMap::new());
    for (x, y) in na.into_iter().zip(nb) {
        if fwd.get(&x).is_some_and(|v| v != &y) || back.get(&y).is_some_and(|v| v != &x) {
            return None;
        }
        back.insert(y.clone(), x.clone());
        fwd.insert(x, y);
    }
    Some(fwd)
}

/// Fingerprint `a` with its inputs' keys (`input A`, `chain input A`) under the names `b`'s
/// expression gives the same matrices, so that a plan that only renamed its matrices (or the
/// plan a user writes for a Python `matmul`'s output) is the same job; `a` as it is when the
/// expressions differ in shape.
pub(crate) fn renamed(a: &Fingerprint, b: &Fingerprint) -> Fingerprint {
    let map = match (a.get("expr"), b.get("expr")) {
        (Some(x), Some(y)) => name_map(x, y),
        _ => None,
    };
    let Some(map) = map.filter(|m| m.iter().any(|(x, y)| x != y)) else {
        return a.clone();
    };
    let key = |k: &str| -> String {
        for prefix in ["chain input ", "input "] {
            if let Some(name) = k.strip_prefix(prefix) {
                if let Some(to) = map.get(name) {
                    return format!("{prefix}{to}");
                }
            }
        }
        k.to_string()
    };
    a.iter().map(|(k, v)| (key(k), v.clone())).collect()
}

/// Whether two expressions are one product: equal once a leading scale (`2 * a @ b`, how the
/// Python package writes its products) is taken off — the scale is the fingerprint's `alpha`
/// entry, compared on its own. A `matmul(…, out="C.npy")` output failed `verify` against the
/// plan `expr = "a @ b"` for the text `1 * a @ b` (new-user trial).
pub(crate) fn same_expr(a: &str, b: &str) -> bool {
    a == b || name_map(a, b).is_some()
}

/// One fingerprint entry against another, by [`same_fingerprint`]'s rule.
pub(crate) fn same_value(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    if let (Some(x), Some(y)) = (content_part(a), content_part(b)) {
        return x == y;
    }
    match (
        a.strip_prefix("intermediate "),
        b.strip_prefix("intermediate "),
    ) {
        (Some(x), Some(y)) => Path::new(x).file_name() == Path::new(y).file_name(),
        _ => false,
    }
}

/// The part of an input identity after its path: from the first " (" that is followed by
/// "N bytes, ".
fn content_part(v: &str) -> Option<&str> {
    v.match_indices(" (").map(|(i, _)| &v[i..]).find(|rest| {
        let digits = rest[2..].bytes().take_while(u8::is_ascii_digit).count();
        digits > 0 && rest[2 + digits..].starts_with(" bytes, ")
    })
}

pub(crate) fn fingerprint_changes(old: &Fingerprint, new: &Fingerprint) -> String {
    let old = &renamed(old, new);
    let mut changes = Vec::new();
    for k in old
        .keys()
        .chain(new.keys())
        .collect::<std::collections::BTreeSet<_>>()
    {
        let (a, b) = (old.get(k), new.get(k));
        if !matches!((a, b), (Some(x), Some(y)) if same_entry(k, x, y)) {
            changes.push(format!(
                "{k}: was {}, now {}{}",
                a.map(|v| readable_mtime(v)).as_deref().unwrap_or("(none)"),
                b.map(|v| readable_mtime(v)).as_deref().unwrap_or("(none)"),
                match (a, b) {
                    (Some(x), Some(y)) if only_sample_differs(x, y) => " (the same size and modification time: its contents were changed in place)",
                    _ => "",
                }
            ));
        }
    }
    changes.join("; ")
}

/// Whether two identities of a `.npy` or raw input ("… (N bytes, mtime T ns, …, sample crc
/// X)") differ only in their sampled CRC: the file's bytes changed where the size and time did
/// not (a numpy memmap written and its time put back, a tool that keeps times).
fn only_sample_differs(a: &str, b: &str) -> bool {
    let cut = |v: &str| v.rfind(", sample crc ").map(|i| v[..i].to_string());
    let (Some(x), Some(y)) = (content_part(a), content_part(b)) else {
        return false;
    };
    matches!((cut(x), cut(y)), (Some(p), Some(q)) if p == q)
}

/// An identity's `mtime N ns` (how the journal stores it) as a UTC date a reader can compare:
/// `modified 2026-12-04 11:22:33.123456789 UTC`. Only for messages; the journal keeps the
/// nanoseconds.
fn readable_mtime(v: &str) -> String {
    let Some(i) = v.find("mtime ") else {
        return v.to_string();
    };
    let rest = &v[i + 6..];
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (Ok(ns), true) = (
        rest[..digits].parse::<u64>(),
        rest[digits..].starts_with(" ns"),
    ) else {
        return v.to_string();
    };
    let (secs, frac) = (ns / 1_000_000_000, ns % 1_000_000_000);
    let (days, tod) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{}modified {y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{frac:09} UTC{}",
        &v[..i],
        tod / 3600,
        tod % 3600 / 60,
        tod % 60,
        &rest[digits + 3..]
    )
}

impl Journal {
    /// Open (creating if needed) the journal of one shard of a split step at `path`, without
    /// locking it: the shard's claim keeps other writers away. Returns the finished tiles it
    /// records (seq, data CRC); a torn tail is cut off so new records follow the last good one.
    /// A journal written for another fingerprint is an error naming what changed.
    pub(crate) fn open_shard(
        path: &Path,
        fp: &Fingerprint,
        durable: bool,
    ) -> Result<(Journal, Vec<(u32, u32)>)> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        own_journal_file(path)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| Error::io(path, "cannot open shard journal", e))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, "cannot read shard journal", e))?;
        let done = if bytes.is_empty() || torn_header(&bytes) {
            file.set_len(0)
                .and_then(|_| file.write_all_at(header_line(fp).as_bytes(), 0))
                .and_then(|_| file.sync_all())
                .map_err(|e| Error::io(path, "cannot write shard journal", e))?;
            fsutil::sync_file(&file, path)?;
            fsutil::sync_parent(path)?;
            Vec::new()
        } else {
            let (_, peek) = parse(path, &bytes)?;
            if !same_fingerprint(&peek.fingerprint, fp) {
                return Err(Error::Usage(format!(
                    "{}: this shard journal is from a different plan, inputs or backend; run `mgmm-stream prepare PLAN --restart` to start the step over",
                    path.display()
                )));
            }
            settle(&file, path, peek.good_end)?;
            peek.done
        };
        use std::io::Seek;
        file.seek(std::io::SeekFrom::End(0))
            .map_err(|e| Error::io(path, "cannot seek shard journal", e))?;
        let j = Journal {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            durable,
        };
        Ok((j, done))
    }
}

/// Write the complete journal of `output` in one piece — every finished tile and the
/// completion mark — through a temporary file renamed over the old one (`finalize` of a split
/// step, so that `run` sees the step complete and `verify` finds its fingerprint). With `sync`
/// the file and its folder are synced (`durable`, or an output not on a local disk); without,
/// only renamed: an `fsync` there waited for the disk's queue behind the output's writeback.
pub(crate) fn write_complete(
    output: &Path,
    fp: &Fingerprint,
    done: &[(u32, u32)],
    sync: bool,
) -> Result<()> {
    let path = journal_path(output);
    let mut bytes = header_line(fp).into_bytes();
    for &(seq, crc) in done {
        bytes.extend_from_slice(&encode(seq, crc));
    }
    bytes.extend_from_slice(&encode(COMPLETE, 0));
    let tmp = TempOutput::new(&path, bytes.len() as u64)?;
    let mut f = tmp.file();
    (f.write_all(&bytes)).map_err(|e| Error::io(&path, "cannot write the merged journal", e))?;
    tmp.commit_with(sync)
}

/// Read the journal at `path` (any journal file, e.g. a shard's) without locking it; `None`
/// when there is none, it is empty, or its first line was torn ([`torn_header`]: it records
/// nothing).
pub fn peek_file(path: &Path) -> Result<Option<Peek>> {
    refuse_odd_journal(path)?;
    match std::fs::read(path) {
        Ok(b) if b.is_empty() || torn_header(&b) => Ok(None),
        Ok(b) => Ok(Some(parse(path, &b)?.1)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, "cannot read journal", e)),
    }
}

/// What a journal holds, read without locking or changing it (for `verify`).
pub struct Peek {
    /// What determined the output's bytes when it was written.
    pub fingerprint: Fingerprint,
    /// Finished tiles (seq, data CRC), in record order.
    pub done: Vec<(u32, u32)>,
    /// Whether the step was recorded complete.
    pub complete: bool,
    /// Records that fail their check (magic, CRC) but have good records after them: damaged
    /// in place, not torn by a crash at the end. They are skipped, so their tiles are computed
    /// again; the records after them still count.
    pub damaged: usize,
    /// Where the last good record ends (the header's end when there is none): new records
    /// follow it, and a torn tail after it is cut off.
    pub(crate) good_end: usize,
}

impl Peek {
    /// The compute tile `(tm, tn, tk)` the fingerprint records (`"tm×tn×tk"`, every edge
    /// positive); `None` for a fingerprint without one.
    pub fn compute_tile(&self) -> Option<(u64, u64, u64)> {
        let v: Vec<u64> = (self.fingerprint.get("compute tile")?)
            .split('×')
            .map(|x| x.trim().parse().ok())
            .collect::<Option<_>>()?;
        match v[..] {
            [m, n, k] if m > 0 && n > 0 && k > 0 => Some((m, n, k)),
            _ => None,
        }
    }

    /// The distinct tiles recorded (a tile recorded twice, its first record damaged, counts
    /// once).
    pub fn tiles_done(&self) -> std::collections::BTreeSet<u32> {
        self.done.iter().map(|&(s, _)| s).collect()
    }

    /// How many output tiles the step has, for an output of `rows × cols`: output tiles are
    /// `tm × tn` of the [`Self::compute_tile`]. `None` for a fingerprint without one.
    pub fn tiles_total(&self, rows: u64, cols: u64) -> Option<u64> {
        let (m, n, _) = self.compute_tile()?;
        Some(rows.div_ceil(m) * cols.div_ceil(n))
    }

    /// "N of M tiles done, L left" for an output of `rows × cols`.
    pub fn progress(&self, rows: u64, cols: u64) -> String {
        let done = self.tiles_done();
        match self.tiles_total(rows, cols) {
            Some(m) => format!(
                "{} of {m} tiles done, {} left",
                done.len(),
                m.saturating_sub(done.len() as u64)
            ),
            None => format!("{} tiles done", done.len()),
        }
    }
}

/// Who holds the journal of `output` locked now, as a phrase ("a run (pid 12) is writing it",
/// "a `verify` (pid 12) is reading it"); `None` when nobody does, or the journal cannot be
/// opened. A lock taken to look is released at once: a `run` starting meanwhile waits for it
/// ([`LOCK_GRACE`]).
pub(crate) fn holder(output: &Path) -> Option<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = journal_path(output);
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .ok()?;
    if fsutil::try_lock_shared(&file).ok()? && fsutil::try_lock_exclusive(&file).ok()? {
        return None;
    }
    let (who, doing) = holder_of(&file);
    Some(format!("a {who} is {doing} it"))
}

/// Who holds the lock on the journal `file`, and what it does: ("run (pid P)", "writing") for
/// an exclusive lock, ("`verify` (pid P)", "reading") for a shared one, ("run", "writing") when
/// the kernel does not say ([`fsutil::flock_holder`]). One wording for [`lock`]'s refusal and
/// [`holder`].
fn holder_of(file: &File) -> (String, &'static str) {
    match fsutil::flock_holder(file) {
        Some((pid, true)) => (format!("run (pid {pid})"), "writing"),
        Some((pid, false)) => (format!("`verify` (pid {pid})"), "reading"),
        None => ("run".into(), "writing"),
    }
}

fn parse(path: &Path, bytes: &[u8]) -> Result<(usize, Peek)> {
    let nl = bytes
        .iter()
        .position(|&b| b == b'\n')
        .unwrap_or(bytes.len());
    let line = String::from_utf8_lossy(&bytes[..nl]).to_string();
    let fingerprint: Fingerprint = line
        .strip_prefix(&format!("{MAGIC} "))
        .and_then(|j| serde_json::from_str(j).ok())
        .ok_or_else(|| {
            Error::Usage(format!(
                "{}: not a journal this version understands; rerun with --restart to start the step over",
                path.display()
            ))
        })?;
    let start = (nl + 1).min(bytes.len());
    let mut peek = Peek {
        fingerprint,
        done: Vec::new(),
        complete: false,
        damaged: 0,
        good_end: start,
    };
    // Records are appended whole, so a crash leaves at most a torn tail; a bad record with good
    // ones after it was damaged in place, and only it is lost.
    let mut bad = 0;
    for (i, rec) in bytes[start..].chunks_exact(16).enumerate() {
        let w = |i: usize| u32::from_le_bytes(rec[4 * i..4 * i + 4].try_into().unwrap());
        if w(0) != REC || crc32c::crc32c(&rec[..12]) != w(3) {
            bad += 1;
            continue;
        }
        peek.damaged += bad;
        bad = 0;
        peek.good_end = start + 16 * (i + 1);
        if w(1) == COMPLETE {
            peek.complete = true;
        } else {
            peek.done.push((w(1), w(2)));
        }
    }
    Ok((nl + 1, peek))
}

/// Read the journal of `output` without locking it; `None` when there is none.
pub(crate) fn peek(output: &Path) -> Result<Option<Peek>> {
    peek_file(&journal_path(output))
}

/// Drop the records of tiles `seqs` and the completion mark, so that the next `run` resumes
/// and recomputes exactly those tiles (`verify --repair`). Returns how many records went.
pub fn forget(output: &Path, seqs: &std::collections::BTreeSet<u32>) -> Result<usize> {
    let path = journal_path(output);
    own_journal_file(&path)?;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| Error::io(&path, "cannot open journal", e))?;
    lock(&file, &path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(&path, "cannot read journal", e))?;
    let (head, peek) = parse(&path, &bytes)?;
    let mut out = bytes[..head.min(bytes.len())].to_vec();
    if out.last() != Some(&b'\n') {
        out.push(b'\n');
    }
    let mut dropped = 0;
    for (seq, crc) in peek.done {
        if seqs.contains(&seq) {
            dropped += 1;
            continue;
        }
        out.extend_from_slice(&encode(seq, crc));
    }
    use std::os::unix::fs::FileExt;
    file.set_len(0)
        .and_then(|_| file.write_all_at(&out, 0))
        .and_then(|_| file.sync_all())
        .map_err(|e| Error::io(&path, "cannot rewrite journal", e))?;
    Ok(dropped)
}

#[cfg(test)]
mod tests {

    /// Links planted at the temporary names earlier versions used beside a journal
    /// (`JOURNAL.tmp<pid>` for a merged journal, `JOURNAL.<pid>.unlink` for a hard-linked one's
    /// own copy) are never followed: their target keeps its bytes, the journal is a regular file.
    #[test]
    fn temporaries_beside_a_journal_never_follow_links() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("C.mgt");
        let path = journal_path(&out);
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let pid = std::process::id();
        for name in [
            format!("C.mgt.journal.tmp{pid}"),
            format!("C.mgt.journal.{pid}.unlink"),
        ] {
            std::os::unix::fs::symlink(&victim, d.path().join(name)).unwrap();
        }
        let fp: Fingerprint = [("expr".to_string(), "A @ B".to_string())].into();
        write_complete(&out, &fp, &[(0, 7)], true).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
        let backup = d.path().join("backup");
        std::fs::hard_link(&path, &backup).unwrap();
        let kept = std::fs::read(&backup).unwrap();
        own_journal_file(&path).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::metadata(&path).unwrap().nlink(), 1);
        assert_eq!(std::fs::read(&path).unwrap(), kept);
        // `verify --repair` rewrites the journal in place: never through a link.
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let e = forget(&out, &[0].into()).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    /// A journal refused only because the auto tile changed with the budget says how to
    /// resume; one from another expression does not.
    #[test]
    fn a_tile_changed_by_the_budget_says_how_to_resume() {
        let fp = |expr: &str, tile: &str| -> Fingerprint {
            [("expr", expr), ("compute tile", tile), ("output", tile)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let p = Path::new("C.mgt.journal");
        let m = foreign(
            p,
            &fp("A @ B", "1024×1024×1024"),
            &fp("A @ B", "512×512×512"),
        )
        .to_string();
        assert!(
            m.contains("only the compute tile changed (engine.tile set otherwise, or")
                && m.contains("set engine.tile = [1024, 1024, 1024] to resume"),
            "{m}"
        );
        let m = foreign(
            p,
            &fp("A @ B", "1024×1024×1024"),
            &fp("A @ B.T", "512×512×512"),
        )
        .to_string();
        assert!(!m.contains("only the compute tile"), "{m}");
    }
    use super::*;

    /// A journal met by inputs that differ only in their modification time says how to give
    /// the time back; any other difference gives no such hint.
    #[test]
    fn only_a_touched_input_gets_the_touch_hint() {
        let id = |t: &str, crc: &str| {
            format!("./A.npy (4096 bytes, mtime {t} ns, npy, sample crc {crc})")
        };
        let fp = |v: String| -> Fingerprint { [("input A".to_string(), v)].into() };
        // The journal's input against one touched since, with the sampled CRC `now_crc`.
        let met = |now_crc: &str| {
            let (was, now) = (
                id("1700000000123456789", "1234abcd"),
                id("1700000099000000000", now_crc),
            );
            foreign(Path::new("C.npy.journal"), &fp(was), &fp(now)).to_string()
        };
        let e = met("1234abcd");
        assert!(
            e.contains("only the modification time of its inputs changed")
                && e.contains("touch -d @1700000000.123456789 ./A.npy"),
            "{e}"
        );
        let e = met("99999999");
        assert!(!e.contains("touch"), "{e}");
    }

    /// The plan's list of what the engine keeps beside a file is the list of these paths.
    #[test]
    fn the_plans_companion_suffixes_are_the_engines() {
        let p = Path::new("/d/C.npy");
        let made = [
            journal_path(p),
            crate::store::sidecar::sidecar_path(p),
            crate::durable::checkpoint::partial_dir(p),
            crate::durable::split::state_dir(p),
        ];
        for (c, suffix) in made.iter().zip(crate::plan::COMPANION_SUFFIXES) {
            assert_eq!(
                crate::plan::companion_of(c, p),
                Some(suffix),
                "{}",
                c.display()
            );
        }
        assert_eq!(crate::plan::companion_of(Path::new("/d/C.npy.x"), p), None);
    }

    #[test]
    fn inputs_match_by_content_wherever_they_lie() {
        let a = "/old/x (1) (4096 bytes, header 1a2b3c4d, tile checksums 0a0b0c0d)";
        let moved = "/new/y (4096 bytes, header 1a2b3c4d, tile checksums 0a0b0c0d)";
        let other = "/old/x (1) (4096 bytes, header 1a2b3c4d, tile checksums ffffffff)";
        assert!(same_value(a, moved));
        assert!(!same_value(a, other));
        assert!(same_value(
            "intermediate /a/C.mgt.part1",
            "intermediate /b/C.mgt.part1"
        ));
        assert!(!same_value(
            "intermediate /a/C.mgt.part1",
            "intermediate /a/D.mgt.part1"
        ));
        // Entries that are not identities compare as they are.
        assert!(!same_value("A @ B", "A @ B.T"));
        assert!(!same_value("/x (12 bytes, y)", "/z (13 bytes, y)"));
    }

    #[test]
    fn a_damaged_record_loses_its_tile_only_and_a_torn_tail_is_cut() {
        let p = Path::new("C.mgt.journal");
        let header = format!("{MAGIC} {{}}\n");
        let head = header.len();
        let mut bad = encode(2, 22);
        bad[9] ^= 1;
        let torn = [7u8; 5];
        let b = [
            header.as_bytes(),
            &encode(1, 11),
            &bad,
            &encode(3, 33),
            &torn,
        ]
        .concat();
        let (h, peek) = parse(p, &b).unwrap();
        assert_eq!(h, head);
        assert_eq!(peek.done, vec![(1, 11), (3, 33)]);
        assert_eq!(peek.damaged, 1);
        assert_eq!(peek.good_end, head + 48, "the torn 5 bytes are not kept");
        // Bad records at the end are a torn tail, not damage.
        let b = [header.as_bytes(), &encode(1, 11), &[0u8; 32]].concat();
        let (_, peek) = parse(p, &b).unwrap();
        assert_eq!(
            (peek.done.len(), peek.damaged, peek.good_end),
            (1, 0, head + 16)
        );
    }

    /// A changed `.npy` input's modification time reads as a date in the message, not as
    /// nanoseconds since 1970; the journal's text is unchanged.
    #[test]
    fn changed_mtimes_read_as_dates() {
        let v = "x.npy (128 bytes, mtime 1733311353123456789 ns, npy, sample crc 0000abcd)";
        assert_eq!(
            readable_mtime(v),
            "x.npy (128 bytes, modified 2024-12-04 11:22:33.123456789 UTC, npy, sample crc 0000abcd)"
        );
        assert_eq!(
            readable_mtime("mtime 0 ns"),
            "modified 1970-01-01 00:00:00.000000000 UTC"
        );
        assert_eq!(
            readable_mtime("C.mgt (64 bytes, crc 1)"),
            "C.mgt (64 bytes, crc 1)"
        );
        assert_eq!(readable_mtime("mtime x ns"), "mtime x ns");
    }

    /// A scale in front of the expression is the `alpha` entry's business: `1 * a @ b` is
    /// `a @ b`, `2 * a.T @ b` is `a.T @ b` (alpha compared apart); other texts still differ.
    #[test]
    fn an_expression_is_compared_without_its_scale() {
        assert!(same_expr("1 * a @ b", "a @ b") && same_expr("2 * a.T @ b", "0.5 * a.T @ b"));
        assert!(!same_expr("1 * a @ b", "a @ b.T") && !same_expr("A @ A.T", "A @ B.T"));
        assert!(!same_expr("x * a @ b", "a @ b"), "only a number is a scale");
        assert!(same_expr("A @ BF.T.T", "A @ BF") && same_expr("A.T.T.T @ B", "A.T @ B"));
        assert!(!same_expr("A @ BF.T.T.T", "A @ BF"));
        let fp = |e: &str, alpha: &str| -> Fingerprint {
            [("expr", e), ("alpha", alpha)]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into()
        };
        assert!(same_fingerprint(
            &fp("1 * a @ b", "1.0"),
            &fp("a @ b", "1.0")
        ));
        assert!(!same_fingerprint(
            &fp("2 * a @ b", "2.0"),
            &fp("a @ b", "1.0")
        ));
    }

    /// Matrices renamed (the Python package's `a`, `b`; a plan's `A`, `B`; `P` for `A`) are the
    /// same job when each name's input is the same; swapped inputs, another shape of the
    /// expression, or one name for two matrices are not.
    #[test]
    fn renamed_matrices_are_the_same_job() {
        let fp = |e: &str, ins: &[(&str, &str)]| -> Fingerprint {
            let mut f: Fingerprint = [("expr".to_string(), e.to_string())].into();
            for (n, id) in ins {
                f.insert(format!("input {n}"), format!("/d/{id} (8 bytes, crc {id})"));
            }
            f
        };
        let journal = fp("1 * a.T @ b", &[("a", "x"), ("b", "y")]);
        assert!(same_fingerprint(
            &journal,
            &fp("A.T @ B", &[("A", "x"), ("B", "y")])
        ));
        assert!(same_fingerprint(
            &journal,
            &fp("b.T @ a", &[("b", "x"), ("a", "y")])
        ));
        assert!(!same_fingerprint(
            &journal,
            &fp("A.T @ B", &[("A", "y"), ("B", "x")])
        ));
        assert!(!same_fingerprint(
            &journal,
            &fp("A @ B", &[("A", "x"), ("B", "y")])
        ));
        let said = fingerprint_changes(&journal, &fp("A.T @ B", &[("A", "x"), ("B", "z")]));
        assert_eq!(
            said,
            "input B: was /d/y (8 bytes, crc y), now /d/z (8 bytes, crc z)"
        );
        // One matrix used twice stays one: `X.T @ X` is not `A.T @ B`.
        let gram = fp("X.T @ X", &[("X", "x")]);
        assert!(!same_fingerprint(
            &gram,
            &fp("A.T @ B", &[("A", "x"), ("B", "x")])
        ));
        assert!(same_fingerprint(&gram, &fp("Y.T @ Y", &[("Y", "x")])));
    }

    /// An input whose bytes changed in place with its size and time kept is said to be so; one
    /// whose time or size changed too is not.
    #[test]
    fn a_change_in_place_is_named() {
        let id = |t: u64, crc: &str| -> Fingerprint {
            [(
                "input A".to_string(),
                format!("/d/x.npy (128 bytes, mtime {t} ns, npy, sample crc {crc})"),
            )]
            .into()
        };
        let said = fingerprint_changes(&id(5, "0000abcd"), &id(5, "1234abcd"));
        assert!(
            said.ends_with("its contents were changed in place)"),
            "{said}"
        );
        let said = fingerprint_changes(&id(5, "0000abcd"), &id(6, "1234abcd"));
        assert!(!said.contains("in place"), "{said}");
        assert!(!only_sample_differs(
            "C.mgt (64 bytes, crc 1)",
            "C.mgt (64 bytes, crc 2)"
        ));
    }
}
