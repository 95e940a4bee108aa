"""``mgmm_stream.dask``: one product as Dask tasks on a ``dask.distributed`` cluster.

Dask users hold big arrays as ``dask.array``s over files and run on a cluster (``LocalCluster``,
``dask_cuda.LocalCUDACluster``, ``dask-jobqueue`` under SLURM). ``matmul(a, b, out="C.npy")``
runs ``alpha · op(a) · op(b)`` there through the engine's own split-step machinery — the one
``mgmm-stream prepare`` / ``run --shard K/S`` / ``finalize`` use (docs/CLUSTER.md) — as tasks:

* one ``prepare`` task creates the output once (a ``.npy`` whose header numpy refuses until
  the step is finished, or a ``.mgt``);
* one task per shard computes its band of output tiles, reading the inputs from their files
  and writing its tiles into the output with ``pwrite``, with a journal per shard; the worker's
  GPUs are those its environment shows (``CUDA_VISIBLE_DEVICES``, as dask-cuda sets), else its
  CPU cores;
* a ``finalize`` task checks every tile against its journal and writes the real header.

Dask's scheduler places the tasks, shows them in its dashboard and retries a shard whose worker
died: the retry resumes from the shard's journal (its claim, held by a dead process, is taken
over at once on the same host, or when it goes stale, ``claim_timeout``, on another). Nothing
is sent between workers but the tasks: every worker reads the inputs and writes the output
through the filesystem, which must be shared. Inputs must be file-backed; an array whose chunks
are computed or held in memory is refused with a message saying how to save it
(:func:`to_npy`) — never saved silently, since a silent copy of an out-of-core operand can fill
a disk.

>>> import mgmm_stream.dask as mgd                               # doctest: +SKIP
>>> from dask.distributed import Client
>>> client = Client(n_workers=4, threads_per_worker=1)          # doctest: +SKIP
>>> A = mgd.from_npy("A.npy"); B = mgd.from_npy("B.npy")        # doctest: +SKIP
>>> C = mgd.matmul(A, B, out="C.npy")                           # doctest: +SKIP
>>> C.sum().compute()                                           # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from . import _sets as _engine_sets
from ._errors import BadInputError

__all__ = ["matmul", "from_npy", "to_npy", "NpyFile"]

log = logging.getLogger("mgmm_stream")

_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.float16): "f16"}

# Two shard tasks in one worker process would drive the same GPUs (or cores) at once: a
# worker with several threads runs its shards one after another.
_WORKER_LOCK = threading.Lock()


def _dask() -> Any:
    try:
        import dask.array as da
    except ImportError:
        raise ImportError("mgmm_stream.dask needs dask: pip install 'dask[array]' distributed") from None
    return da


def _client(client: Any) -> Any:
    try:
        from distributed import get_client
    except ImportError:
        raise ImportError("mgmm_stream.dask needs dask.distributed: pip install distributed") from None
    if isinstance(client, str):
        from distributed import Client

        return Client(client)
    if client is not None:
        return client
    try:
        return get_client()
    except ValueError:
        raise BadInputError(
            "mgmm_stream.dask.matmul runs on a dask.distributed cluster and none is connected: "
            "pass client=Client(...) or create one first (Client(n_workers=4) for this machine; "
            "mgmm_stream.matmul needs no cluster)"
        ) from None


# ---------------------------------------------------------------- file-backed arrays --------


def _npy_header(path: str) -> Optional[Tuple[Tuple[int, ...], bool, np.dtype, int]]:
    """(shape, fortran order, dtype, data offset) of a .npy file; None if it is not one."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read is None:
                return None
            shape, fortran, dtype = read(f)
            return shape, fortran, dtype, f.tell()
    except (OSError, ValueError):
        return None


class NpyFile:
    """A 2-D ``.npy`` file as an array-like that Dask chunks (``dask.array.from_array``): it
    pickles as its path, and each chunk task opens the file in the worker that runs it — a
    ``np.memmap`` would be pickled whole, data and all, into every task. Read-only unless
    ``writable`` (then :func:`to_npy` stores chunks into it)."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], writable: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        h = _npy_header(self.path)
        if h is None:
            raise BadInputError(f"{self.path} is not a .npy file numpy can open "
                                f"(np.load(path, mmap_mode='r') fails too)")
        shape, fortran, dtype, _ = h
        if len(shape) != 2:
            raise BadInputError(f"{self.path} holds a {len(shape)}-D array; matrices are 2-D")
        self.shape: Tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self.fortran = bool(fortran)
        self.writable = writable
        self.ndim = 2

    def __getitem__(self, index: Any) -> np.ndarray:
        m = np.load(self.path, mmap_mode="r")
        return np.array(m[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        """Write a block with ``pwrite``, a row segment at a time: writes through a shared map
        go out a page at a time, and on NFS two hosts writing neighbouring chunks (which
        share pages in every row) could overwrite each other's bytes; ``write`` is tracked
        by byte range."""
        if not self.writable:
            raise BadInputError(f"{self.path} was opened read-only")
        rows, cols = (index + (slice(None),) * 2)[:2] if isinstance(index, tuple) else (index, slice(None))
        if self.fortran or not isinstance(rows, slice) or not isinstance(cols, slice):
            m = np.load(self.path, mmap_mode="r+")
            m[index] = value
            m.flush()
            return
        r0, r1, rs = rows.indices(self.shape[0])
        c0, c1, cs = cols.indices(self.shape[1])
        if rs != 1 or cs != 1:
            m = np.load(self.path, mmap_mode="r+")
            m[index] = value
            m.flush()
            return
        block = np.ascontiguousarray(np.broadcast_to(np.asarray(value, self.dtype),
                                                     (r1 - r0, c1 - c0)))
        off = _npy_header(self.path)[3]
        item = self.dtype.itemsize
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for r in range(r1 - r0):
                at = off + ((r0 + r) * self.shape[1] + c0) * item
                data = memoryview(block[r]).cast("B")
                while len(data):
                    n = os.pwrite(fd, data, at)
                    data, at = data[n:], at + n
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"NpyFile({self.path!r}, shape={self.shape}, dtype={self.dtype})"


def from_npy(path: Union[str, "os.PathLike[str]"], chunks: Any = "auto") -> Any:
    """A dask array over a ``.npy`` file, read chunk by chunk in the workers (never pickled
    whole), and recognised by :func:`matmul` as that file."""
    da = _dask()
    from dask.base import tokenize

    f = NpyFile(path)
    # The name is the array's identity to Dask: the file as it is now, and the chunking (two
    # chunkings of one file under one name would mix their blocks).
    norm = da.core.normalize_chunks(chunks, f.shape, dtype=f.dtype)
    st = os.stat(f.path)
    name = "npy-" + tokenize(f.path, st.st_ino, st.st_size, st.st_mtime_ns, norm, str(f.dtype))
    return da.from_array(f, chunks=norm, name=name, meta=np.empty((0, 0), f.dtype))


def to_npy(x: Any, path: Union[str, "os.PathLike[str]"], *, compute: bool = True) -> Any:
    """Store a 2-D dask array in one ``.npy`` file, each chunk written by the worker that
    computes it (the file must be on a filesystem the workers share; the file is created, at
    full size, by this call). Returns ``from_npy(path, x.chunks)``, or with ``compute=False``
    what ``dask.array.store(..., compute=False)`` returns (compute it to write the data)."""
    da = _dask()
    if not hasattr(x, "__dask_graph__"):
        raise BadInputError(f"to_npy stores dask arrays; for a numpy array or memmap use "
                            f"np.save(path, np.ascontiguousarray(x))")
    if getattr(x, "ndim", None) != 2:
        raise BadInputError(f"to_npy stores 2-D arrays; this one has shape {getattr(x, 'shape', '?')}")
    if any(np.isnan(c) for cs in x.chunks for c in cs):
        raise BadInputError("to_npy needs the array's chunk sizes (this one has unknown ones, "
                            "as after boolean indexing): call x.compute_chunk_sizes() first")
    p = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(p)):
        raise BadInputError(f"to_npy: the directory of {p} does not exist; create it first")
    for k, v in dict(x.__dask_graph__()).items():
        if isinstance(v, NpyFile) and os.path.exists(p) and os.path.samefile(v.path, p):
            raise BadInputError(f"to_npy would overwrite {p}, which the array itself reads "
                                f"(it is computed from from_npy of that file): write to another "
                                f"path, then rename it over the old one")
    np.lib.format.open_memmap(p, mode="w+", dtype=x.dtype, shape=tuple(int(s) for s in x.shape))
    store = da.store(x, NpyFile(p, writable=True), lock=False, compute=compute)
    return from_npy(p, chunks=x.chunks) if compute else store


def _memmap_source(m: np.ndarray, name: str) -> Tuple[Dict[str, Any], bool]:
    """The plan matrix entry for an array that maps a whole file (a .npy, or a raw file): a
    ``np.memmap``, or the view of one that ``da.from_array`` keeps. The file and offset come
    from the process's own map of it (/proc/self/maps), as ``mgmm_stream.matmul`` finds them."""
    from . import _backing_file

    back = _backing_file(m) if getattr(m, "mode", "r") != "c" else None
    if back is None:
        raise _refuse(name, "holds an array in memory (or a copy-on-write map), not a map of "
                            "a file", memory=True)
    path, offset = back
    if m.ndim != 2 or m.dtype not in _DTYPES:
        raise BadInputError(f"{name}: {path} holds a {m.dtype} array of shape {m.shape}; "
                            f"matrices are 2-D float32, float64 or float16")
    if not (m.flags.c_contiguous or m.flags.f_contiguous):
        raise _refuse(name, f"is a strided view of {path}", memory=True)
    order = "F" if (m.flags.f_contiguous and not m.flags.c_contiguous) else "C"
    h = _npy_header(path)
    if h is not None:
        shape, fortran, dtype, off = h
        if np.dtype(dtype) == m.dtype and off == offset and len(shape) == 2:
            if tuple(shape) == m.shape and bool(fortran) == (order == "F"):
                return {"path": path}, False
            # x.T of a whole-file map: the file, read transposed.
            if tuple(shape[::-1]) == m.shape and bool(fortran) == (order == "C"):
                return {"path": path}, True
        raise _refuse(name, f"maps part of {path} (shape {m.shape} at byte {offset}; the "
                            f"file holds {tuple(shape)})", memory=True)
    size = os.path.getsize(path)
    if offset + m.nbytes != size:
        raise _refuse(name, f"maps part of the raw file {path} ({m.nbytes} bytes at offset "
                            f"{offset} of {size})", memory=True)
    return {"path": path, "format": "raw", "rows": int(m.shape[0]), "cols": int(m.shape[1]),
            "dtype": _DTYPES[m.dtype], "order": order, "offset": int(offset)}, False


def _backing_file_of(x: np.ndarray) -> Optional[Tuple[str, int]]:
    from . import _backing_file

    return _backing_file(x)


def _op_shape(x: Any, entry: Dict[str, Any], trans: bool) -> Optional[Tuple[int, int]]:
    """The shape of op(x) as matmul's caller wrote it (an array's own shape, a path's file's),
    or None where it is not known here (the plan's check then says it)."""
    if hasattr(x, "shape") and len(x.shape) == 2:
        s: Optional[Tuple[int, ...]] = tuple(int(v) for v in x.shape)
    elif entry.get("path", "").endswith(".npy"):
        h = _npy_header(entry["path"])
        s = tuple(h[0]) if h is not None and len(h[0]) == 2 else None
    elif entry.get("path", "").endswith(".mgt"):
        i = _native.info(entry["path"], False)
        s = (int(i["rows"]), int(i["cols"]))
    else:
        s = None
    if s is None:
        return None
    return (s[1], s[0]) if trans else (s[0], s[1])


def _refuse(name: str, why: str, memory: bool = False) -> BadInputError:
    save = (f"np.save(\"{name.upper()}.npy\", np.ascontiguousarray({name})) writes it" if memory
            else f"mgmm_stream.dask.to_npy({name}, \"{name.upper()}.npy\") writes one .npy from "
                 f"the workers")
    return BadInputError(
        f"{name} {why}; mgmm_stream.dask reads its inputs from files every worker can read. "
        f"Save it first — {save} — and pass the path or from_npy(path)"
    )


def _source(x: Any, name: str) -> Tuple[Dict[str, Any], bool, Any]:
    """(plan matrix entry, transposed, row chunks or None) for an operand."""
    if isinstance(x, (str, os.PathLike)):
        p = os.path.abspath(os.fspath(x))
        if not os.path.exists(p):
            raise BadInputError(f"{name}: {p} does not exist")
        return {"path": p}, False, None
    if isinstance(x, np.memmap):
        entry, t = _memmap_source(x, name)
        return entry, t, None
    if isinstance(x, np.ndarray):
        raise BadInputError(f"{name} is a numpy array in memory; save it (np.save(\"{name.upper()}.npy\", "
                            f"{name})) and pass the path, or use mgmm_stream.matmul, which reads "
                            f"arrays in memory")
    if type(x).__module__.split(".")[0] != "dask" or not hasattr(x, "__dask_graph__"):
        raise BadInputError(f"{name} must be a dask array over a file, a path (.npy, .mgt) or "
                            f"a whole-file np.memmap; got {type(x).__name__}")
    graph = x.__dask_graph__()
    layers = dict(getattr(graph, "layers", {}))
    # da.from_array(x, chunks) makes two layers: "original-NAME" holding x, and "NAME" with a
    # getter per chunk; x.T adds one "transpose-…" layer. Anything else computes the chunks.
    originals = [k for k in layers if str(k).startswith("original-")]
    rest = [k for k in layers if not str(k).startswith("original-")]
    kinds = [str(k).rsplit("-", 1)[0] if "-" in str(k) else str(k) for k in rest]
    if len(originals) != 1:
        what = ", ".join(sorted({k.split("-")[0] for k in kinds})) or "none"
        raise _refuse(name, f"is a dask array whose chunks are not read from one file (its "
                            f"graph's layers: {what})")
    orig_layer = layers[originals[0]]
    orig = next(iter(dict(orig_layer).values()))
    transposed = False
    for k in rest:
        key = str(k)
        if key == originals[0].replace("original-", "", 1):
            continue
        if key.startswith("transpose-") and not transposed:
            transposed = True
            continue
        raise _refuse(name, f"is computed from a file-backed array (its graph has the layer "
                            f"{key.rsplit('-', 1)[0]!r}: a slice, an operation or a rechunk)")
    if isinstance(orig, NpyFile):
        entry: Dict[str, Any] = {"path": orig.path}
        shape = orig.shape
    elif isinstance(orig, np.memmap) and getattr(orig, "_mmap", None) is None \
            and _backing_file_of(orig) is None:
        raise BadInputError(
            f"{name} is a dask array over an in-memory copy of a memmap — dask.array.from_array "
            f"copies the array it is given (x.copy()), so the file is read whole into this "
            f"process and then pickled into the tasks — not over its file; make it with "
            f"mgmm_stream.dask.from_npy(path, chunks), which reads each chunk from the file in "
            f"the worker, or pass the path")
    elif isinstance(orig, np.ndarray):
        entry, flipped = _memmap_source(orig, name)
        transposed = transposed != flipped
        shape = orig.shape[::-1] if flipped else orig.shape
    else:
        kind = f"{type(orig).__module__.split('.')[0]}.{type(orig).__name__}"
        raise _refuse(name, f"is a dask array over a {kind}, not over a .npy or raw matrix "
                            f"file (zarr chunks, HDF5 datasets and arrays in memory are not)")
    want = (shape[1], shape[0]) if transposed else tuple(shape)
    if tuple(x.shape) != want:
        raise _refuse(name, f"covers part of {entry['path']} (shape {x.shape} of {shape})")
    return entry, transposed, x.chunks


# ---------------------------------------------------------------- tasks ---------------------
#
# Every task gets the plan as TOML text and the engine settings as `--set` strings: a few
# hundred bytes, all that crosses the network. What depends on the worker is settled in the
# task (`_here`): with `devices=None`, the worker's GPU — the first it sees when
# CUDA_VISIBLE_DEVICES lists several, as dask-cuda's rotated lists (`3,4,…,0,1,2` for worker 3)
# put each worker's own first — else every GPU it sees; and on the CPU, as many engine
# threads as the worker was given (a LocalCluster's threads_per_worker), not every core.


def _sees_gpu() -> bool:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return vis.strip() not in ("", "-1", "NoDevFiles")
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) > 0
    except OSError:
        return False


def _here(sets: List[str], auto_threads: bool, auto_devices: bool = False) -> List[str]:
    out = list(sets)
    gpu = _sees_gpu() and not any(x == "engine.backend=cpu" for x in sets)
    if auto_devices:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        out.append("engine.devices=[0]" if gpu and "," in vis else "engine.devices=all")
    if auto_threads and not gpu:
        try:
            from distributed import get_worker

            w = get_worker()
            n = int(getattr(getattr(w, "state", w), "nthreads", 0) or 0)
        except (ImportError, ValueError):
            n = 0
        out += [f"engine.threads={n}"] if n > 0 else []
    return out


def _prepare_task(text: str, sets: List[str], auto: Tuple[bool, bool],
                  restart: bool) -> List[Dict[str, Any]]:
    return _native.prepare_plan(None, text, _here(sets, *auto), restart)


def _shard_task(text: str, sets: List[str], auto: Tuple[bool, bool], k: int, s: int,
                claim_timeout: float, wait_timeout: float,
                fault: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    on_event = None
    if fault and fault.get("shard") == k and not os.path.exists(fault["marker"]):
        # Tests only: this attempt dies (SIGKILL) once it has finished some tiles, as a worker
        # lost mid-shard would — or raises, as a shard that fails does; the marker makes the
        # retry run normally.
        open(fault["marker"], "w").close()

        def on_event(kind: str, data: Any) -> None:
            if kind == "update" and data["tiles_done"] >= fault["after_tiles"]:
                if fault.get("raise"):
                    raise RuntimeError("injected failure of a shard (tests)")
                os.kill(os.getpid(), signal.SIGKILL)

    with _WORKER_LOCK:
        return _native.run_plan(None, text, _here(sets, *auto), False, on_event, None,
                                0.05, (k, s), float(claim_timeout), float(wait_timeout), True)


def _finalize_task(text: str, sets: List[str], auto: Tuple[bool, bool], *reports: Any) -> List[Any]:
    for line in _native.finalize_plan(None, text, _here(sets, *auto)):
        log.info("%s", line)
    return list(reports)


# ---------------------------------------------------------------- matmul --------------------


def matmul(a: Any, b: Any, out: Union[str, "os.PathLike[str]"], *, client: Any = None,
           alpha: float = 1.0, trans_a: bool = False, trans_b: bool = False,
           precision: Optional[str] = None, devices: Union[str, Sequence[int], None] = None,
           host_memory: Union[int, str, None] = None,
           device_memory: Union[int, str, None] = None, backend: str = "auto",
           threads: Optional[int] = None, tile: Any = None,
           engine: Optional[Dict[str, Any]] = None, shards: Optional[int] = None,
           restart: bool = False, claim_timeout: float = 120.0, wait_timeout: float = 3600.0,
           retries: int = 2, chunks: Any = None, report: bool = False,
           _fault: Optional[Dict[str, Any]] = None) -> Any:
    """Compute ``alpha · op(a) · op(b)`` into the file ``out`` as Dask tasks on ``client``'s
    workers (default: the connected client), one task per shard of the engine's split step.

    a, b: dask arrays over files (:func:`from_npy`, and its ``.T``), paths (``.npy``, ``.mgt``)
        or whole-file ``np.memmap``s (a ``.npy`` or a raw file, or their ``.T``). Every worker,
        and this process, must see the same paths. (``da.from_array`` over a memmap is
        accepted only where dask keeps the map; dask 2026.8 copies it, and it is refused.)
    out: ``"C.npy"`` (returns a dask array over it, chunked like a's rows and b's columns or
        ``chunks``) or ``"C.mgt"`` (returns the report).
    shards: how many shard tasks (default: the workers times the engine's shards per process,
        docs/CLUSTER.md). host_memory: default a quarter of the smallest worker memory limit
        (Dask's ``memory_limit``); the engine's 2 GiB where a worker has no limit. threads:
        engine threads per task (default: the worker's threads on the CPU, every core with a
        GPU). devices: GPU ordinals as the worker sees them
        (default: its first GPU when CUDA_VISIBLE_DEVICES lists several, as under dask-cuda,
        else every GPU it sees).
    retries: Dask's retries of a shard task that raised (a worker that dies is retried by
        the scheduler anyway, up to ``distributed.scheduler.allowed-failures``).
    claim_timeout: seconds after which a dead worker's shard on another host is taken over.
    report: return ``{"output", "shards", "reports"}`` (one run report per shard task) instead.
    Other keywords as ``mgmm_stream.matmul``; ``restart=True`` recomputes the output.
    """
    from . import _precision as _merge_precision
    from . import _settings

    _dask()
    if shards is not None and int(shards) < 1:
        raise BadInputError(f"shards={shards}: give at least 1 (or None for the default)")
    ea, ta, ca = _source(a, "a")
    eb, tb, cb = _source(b, "b")
    sa, sb = _op_shape(a, ea, bool(trans_a)), _op_shape(b, eb, bool(trans_b))
    if sa is not None and sb is not None and sa[1] != sb[0]:
        t = (".T" if trans_a else "", ".T" if trans_b else "")
        raise BadInputError(f"shape mismatch: a{t[0]} is {sa[0]}×{sa[1]} but b{t[1]} is "
                            f"{sb[0]}×{sb[1]} (inner dimensions {sa[1]} ≠ {sb[0]})")
    c = _client(client)
    # The result's chunks follow the operands as given (a dask `.T` already has its chunks).
    out_chunks = chunks if chunks is not None else _out_chunks(ca, bool(trans_a), cb, bool(trans_b))
    ta, tb = ta != bool(trans_a), tb != bool(trans_b)
    o = os.path.abspath(os.fspath(out))
    if not (o.endswith(".npy") or o.endswith(".mgt")):
        raise BadInputError(f"out={o}: name a .npy or .mgt file on a filesystem every worker shares")
    if not os.path.isdir(os.path.dirname(o)):
        raise BadInputError(f"out={o}: its directory does not exist; create it first")
    mats: Dict[str, Dict[str, Any]] = {"A": ea}
    nb = "A" if eb == ea else "B"
    mats[nb] = eb
    expr = f"A{'.T' if ta else ''} @ {nb}{'.T' if tb else ''}"
    step: Dict[str, Any] = {"output": o, "expr": expr}
    if float(alpha) != 1.0:
        step["alpha"] = float(alpha)
    plan = {"matrices": mats, "step": [step]}
    from . import _plan_json  # the package's own conversion (imported here: no import cycle)

    text = _native.json_to_toml(_plan_json(plan))
    precision, engine = _merge_precision(precision, engine)
    nthreads = 0 if threads is None else int(threads)
    workers = _workers(c)
    if host_memory is None and "host_memory" not in (engine or {}):
        host_memory = _worker_host_memory(workers)
    settings = _settings(backend, "all" if devices is None else devices, host_memory,
                         device_memory, nthreads, tile, engine)
    if precision is not None:
        settings.append(("precision", precision))
    elif _dtype_of(ea) == "f64":
        settings.append(("precision", "fp64"))
    sets = _engine_sets(dict(settings))
    if threads is None:
        sets = [s for s in sets if not s.startswith("engine.threads=")]
    if devices is None:
        sets = [s for s in sets if not s.startswith("engine.devices=")]
    # Plan errors (shapes, dtypes, settings) now, in the caller, not in a worker's traceback;
    # in the words of this function's keywords, not of the plan it writes.
    try:
        _native.describe_plan(None, text, sets)
    except BadInputError as e:
        raise BadInputError(_pythonic(str(e), ea, eb)) from None

    if not workers:
        raise BadInputError("the Dask cluster has no workers yet; wait for them "
                            "(client.wait_for_workers(n)) and call again")
    token = uuid.uuid4().hex[:12]
    auto = (threads is None, devices is None)
    prep = c.submit(_prepare_task, text, sets, auto, bool(restart), key=f"mgmm-prepare-{token}",
                    pure=False)
    ready = prep.result()
    per = max(1, int(ready[0].get("per_process", 1)))
    s = int(shards) if shards is not None else len(workers) * per
    s = min(s, int(ready[0]["tiles"]))
    # The prepare task is done (its result was read): the shards do not depend on it in the
    # graph, so no worker fetches its result from another before it starts (0.4–0.6 s each
    # on a LocalCluster).
    futs = [c.submit(_shard_task, text, sets, auto, k, s, claim_timeout, wait_timeout, _fault,
                     key=f"mgmm-shard-{k}-of-{s}-{token}", pure=False, retries=int(retries))
            for k in range(s)]
    fin = c.submit(_finalize_task, text, sets, auto, *futs, key=f"mgmm-finalize-{token}", pure=False)
    try:
        reports = fin.result()
    except BaseException:
        # A failed shard (or Ctrl-C here) leaves no tasks of this call running on the workers:
        # the journals keep what was done, and the same call resumes.
        c.cancel(futs + [fin])
        raise
    if report or o.endswith(".mgt"):
        return {"output": o, "shards": s, "reports": reports}
    return from_npy(o, chunks=out_chunks)


def _workers(c: Any) -> Dict[str, Any]:
    """Every worker the scheduler knows (``scheduler_info`` lists only five by default in some
    versions of distributed; the count sets the default number of shards and the smallest
    memory limit the default ``host_memory``)."""
    try:
        info = c.scheduler_info(n_workers=-1)
    except TypeError:  # a distributed without the argument lists every worker
        info = c.scheduler_info()
    return info.get("workers", {})


def _worker_host_memory(workers: Dict[str, Any]) -> Optional[int]:
    """``host_memory`` for the shard tasks when the caller gave none: a quarter of the smallest
    worker memory limit Dask knows (its ``memory_limit``; at least 64 MiB) — below the engine's
    2 GiB default for workers of less than 8 GiB, which that default would take past their limit
    (a 300 MiB worker was restarted four times and the call failed with KilledWorker); ``None``
    (the engine's default) when a worker has no limit. One value for every task,
    so that ``prepare`` and every shard lay the step out alike.

    The engine's default is sized for a process that shares its host; a Dask worker has been
    given its memory. It matters most for the output: one that fits ``host_memory`` is written
    through a shared map that several threads fill (``engine.write = "auto"``), a larger one with
    ``pwrite``, which serialises on the file's lock (3.3–3.6 GB/s): on one H100 a 32768² f32
    shard took 2.3–2.4 s that way against 1.6 s through the map. Dask's nanny ends a worker whose
    memory passes 95 % of its limit; a quarter leaves room for the mapped output's pages and the
    page-locked inputs that ``host_memory`` also bounds."""
    limits = [int(w.get("memory_limit") or 0) for w in workers.values()]
    if not limits or min(limits) <= 0:
        return None
    return max(64 << 20, min(limits) // 4)


def _pythonic(msg: str, ea: Dict[str, Any], eb: Dict[str, Any]) -> str:
    """An engine message about the plan this module wrote, in the words of its caller."""
    import re

    msg = re.sub(r"^\S*<plan dict>: step 1 \(line \d+\): ", "", msg)
    msg = re.sub(r"--set engine\.(\w+)=", r"\1=", msg)
    return msg.replace("A is ", f"a ({ea['path']}) is ", 1).replace("but B is ", f"but b ({eb['path']}) is ", 1)


def _dtype_of(entry: Dict[str, Any]) -> str:
    if "dtype" in entry:
        return entry["dtype"]
    p = entry["path"]
    h = _npy_header(p)
    if h is not None:
        return _DTYPES.get(np.dtype(h[2]), "?")
    try:
        return str(_native.info(p, False).get("dtype", "?"))
    except Exception:  # noqa: BLE001 - the plan check below names the real problem
        return "?"


def _out_chunks(ca: Any, ta: bool, cb: Any, tb: bool) -> Any:
    """The result's chunks: op(a)'s row chunks by op(b)'s column chunks where known."""
    rows = None if ca is None else ca[1 if ta else 0]
    cols = None if cb is None else cb[0 if tb else 1]
    if rows is None or cols is None:
        return "auto"
    return (rows, cols)
