"""mgmm_stream: multiply matrices too big for GPU memory or host RAM, from Python.

``matmul(a, b)`` takes numpy arrays, ``np.memmap``s, torch tensors (CPU or CUDA), CuPy arrays,
or paths to ``.npy`` / ``.mgt`` files, streams tiles through every GPU (or the CPU), and returns
a numpy array (or, from GPU inputs, a GPU array when the result fits there) — or writes a file
when you pass ``out=``. Arrays are read in place (never copied), memmaps are read
from their file, the GIL is released while the engine works, and Ctrl-C stops the job promptly
(a file output keeps a journal, so the same call resumes where it stopped).

>>> import numpy as np, mgmm_stream as mg
>>> a = np.ones((300, 200), np.float32); b = np.ones((200, 100), np.float32)
>>> c = mg.matmul(a, b, progress=False)
>>> float(c[0, 0]), c.shape
(200.0, (300, 100))

Plans written for the CLI run as they are: ``mg.run("plan.toml")`` returns the run report as a
dict; ``mg.plan(...)`` says what a run would do; ``mg.verify(...)`` checks finished outputs;
``mg.info(path)`` reads a ``.mgt`` header. See docs/PYTHON.md.
"""

from __future__ import annotations

import inspect
import json
import logging
import mmap
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._errors import (
    BadInputError,
    CancelledError,
    DeviceError,
    MgmmError,
    StorageError,
)

__version__: str = _native.__version__
__all__ = [
    "matmul",
    "run",
    "plan",
    "verify",
    "info",
    "result_memory_limit",
    "empty_cache",
    "MgmmError",
    "BadInputError",
    "DeviceError",
    "StorageError",
    "CancelledError",
    "__version__",
]

log = logging.getLogger("mgmm_stream")

PathLike = Union[str, "os.PathLike[str]"]
Progress = Union[bool, None, Callable[[Dict[str, Any]], Any]]

_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.float16): "f16"}


# ---------------------------------------------------------------- operands -----------------


def _as_array(x: Any, name: str) -> np.ndarray:
    """An ndarray view of ``x`` (ndarray, memmap, CPU torch tensor, array-interface object)."""
    if isinstance(x, np.ndarray):
        return x
    if _on_gpu(x):
        # Only the places that take GPU arrays (matmul's operands and out=) look for them
        # first; anywhere else one is a mistake to name, not numpy's TypeError.
        raise BadInputError(
            f"{name} is a {_kind(x)} in GPU memory, which is not taken here: pass "
            f"{name}.get() (CuPy) or {name}.cpu() (torch), or save it to a .npy and pass the path"
        )
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        dev = getattr(getattr(x, "device", None), "type", "cpu")
        if dev != "cpu":
            raise BadInputError(
                f"{name} is a torch tensor on {dev}; mgmm_stream reads host memory: pass "
                f"{name}.cpu() (or keep the data in a numpy array or file)"
            )
        try:
            return x.detach().numpy()
        except (TypeError, RuntimeError) as e:
            raise BadInputError(f"{name}: this torch tensor has no numpy view ({e}); "
                                f"convert it with .float()") from None
    if hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        return np.asarray(x)
    raise BadInputError(
        f"{name} must be a path (.npy, .mgt), a numpy array or memmap, or a CPU torch tensor; "
        f"got {type(x).__name__}"
    )


def _layout(x: np.ndarray, name: str) -> Tuple[np.ndarray, bool]:
    """``(view, transposed)``: a view whose rows are contiguous, and whether it is ``x.T``.

    Fortran-order data is read in place as the row-major transpose. Views with neither unit
    stride are refused (copying them silently could double memory use).
    """
    if x.ndim != 2:
        raise BadInputError(f"{name} must be 2-D; it has shape {x.shape}")
    if not x.dtype.isnative:
        raise BadInputError(f"{name} has non-native byte order ({x.dtype.str}); "
                            f"convert with {name}.astype({name}.dtype.newbyteorder('='))")
    if x.dtype not in _DTYPES:
        raise BadInputError(
            f"{name} is {x.dtype}; use float32, float64 or float16 "
            f"(convert with {name}.astype(np.float32))"
        )
    if x.size == 0:
        raise BadInputError(f"{name} is empty (shape {x.shape})")
    flipped = _row_order(x.shape, x.strides, x.itemsize, name, "np.ascontiguousarray")
    return (x.T, True) if flipped else (x, False)


def _row_order(shape: Tuple[int, int], strides: Tuple[int, int], it: int, name: str,
               contiguous: str) -> bool:
    """Whether a 2-D array of ``shape`` and byte ``strides`` is read as the row-major
    transpose (Fortran order) rather than as it is; BadInputError for layouts that cannot be
    read in place (``contiguous`` names the call that makes a copy that can)."""
    rows, cols = shape
    s0, s1 = strides

    def row_major(s0: int, s1: int, rows: int, cols: int) -> bool:
        inner = cols == 1 or s1 == it
        outer = rows == 1 or (s0 > 0 and s0 % it == 0 and s0 >= cols * it)
        return inner and outer

    if row_major(s0, s1, rows, cols):
        return False
    if row_major(s1, s0, cols, rows):
        return True
    if (rows > 1 and s0 < 0) or (cols > 1 and s1 < 0):
        raise BadInputError(
            f"{name} has a negative stride (a reversed view such as x[::-1]; shape {shape}, "
            f"strides {strides}), which cannot be read in place; pass "
            f"{contiguous}({name}) (a copy) or reverse the result instead"
        )
    raise BadInputError(
        f"{name} is a strided view (shape {shape}, strides {strides}) whose rows and "
        f"columns are both non-contiguous, so it cannot be read in place; pass "
        f"{contiguous}({name}) (a copy) or the array it is a view of"
    )


def _ld(x: np.ndarray) -> int:
    rows, cols = x.shape
    return cols if rows == 1 else x.strides[0] // x.itemsize


def _mmap_region(x: np.ndarray) -> Optional[Tuple[str, int]]:
    """(file, byte offset of x[0, 0]) when ``x`` is a view of a file-backed, non-private map."""
    if not isinstance(x, np.memmap):
        return None
    mm = getattr(x, "_mmap", None)
    fname = getattr(x, "filename", None)
    if mm is None or fname is None or getattr(x, "mode", "r") == "c":
        return None  # an array computed from a memmap, or copy-on-write: read memory
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    if not _maps_file(base, os.fspath(fname)):
        return None  # the file was replaced or removed since it was mapped: read the map
    start = x.offset - x.offset % mmap.ALLOCATIONGRANULARITY
    return os.fspath(fname), start + (x.ctypes.data - base)


def _mapping_at(addr: int) -> Optional[Tuple[int, int, int, int, str]]:
    """The /proc/self/maps line of the mapping holding ``addr``: (start, end, file offset,
    inode, path); None where there is none or /proc cannot tell."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.rstrip("\n").split(maxsplit=5)
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                if lo <= addr < hi:
                    path = parts[5] if len(parts) > 5 else ""
                    return lo, hi, int(parts[2], 16), int(parts[4]), path
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maps_file(addr: int, fname: str) -> bool:
    """Whether the mapping at ``addr`` is of the file now at ``fname`` (the same inode; the
    device is not compared, since overlay file systems report another one in /proc than in
    ``stat``). A file replaced after it was mapped (``os.replace``, a new file under the old
    name) or removed is not: its data is then read from the map, which still holds what was
    mapped. True where /proc cannot tell."""
    try:
        st = os.stat(fname)
    except OSError:
        return False
    m = _mapping_at(addr)
    if m is None:
        return True
    return not m[4].endswith(" (deleted)") and m[3] == st.st_ino


def _backing_file(x: np.ndarray) -> Optional[Tuple[str, int]]:
    """(file, byte offset of x's first element) when x's memory is a map of a file, whatever
    the array's class or mode (a memmap, a view of one, a copy-on-write map)."""
    addr = x.__array_interface__["data"][0]
    m = _mapping_at(addr)
    if m is None or m[3] == 0 or not m[4].startswith("/") or m[4].endswith(" (deleted)"):
        return None
    return m[4], m[2] + (addr - m[0])


# ---------------------------------------------------------------- GPU arrays ---------------

_TYPESTRS = {"<f4": "f32", "<f8": "f64", "<f2": "f16"}


def _on_gpu(x: Any) -> bool:
    """Whether ``x`` lives in GPU memory (``__cuda_array_interface__``: CuPy, numba, a CUDA
    torch tensor)."""
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return getattr(getattr(x, "device", None), "type", "cpu") == "cuda"
    return hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__")


def _kind(x: Any) -> str:
    return f"{(type(x).__module__ or '').split('.')[0]}.{type(x).__name__}"


class _Gpu:
    """An array in GPU memory read or written in place, seen through its
    ``__cuda_array_interface__``: where it is, its layout, and the stream to wait for."""

    def __init__(self, x: Any, name: str):
        self.obj = x
        self.framework = (type(x).__module__ or "").split(".")[0]
        src = x.detach() if self.framework == "torch" else x
        try:
            cai = src.__cuda_array_interface__
        except (AttributeError, RuntimeError, TypeError, KeyError) as e:
            raise BadInputError(f"{name} is a {_kind(x)} in GPU memory whose "
                                f"__cuda_array_interface__ cannot be read ({e})") from None
        shape = tuple(int(v) for v in cai["shape"])
        if len(shape) != 2:
            raise BadInputError(f"{name} must be 2-D; it has shape {shape}")
        typestr = str(cai["typestr"]).replace("=", "<").replace("|", "<")
        if typestr not in _TYPESTRS:
            raise BadInputError(f"{name} is a GPU array of {cai['typestr']}; use float32, "
                                f"float64 or float16 (e.g. {name}.float())")
        self.dtype = _TYPESTRS[typestr]
        self.itemsize = _ITEMSIZE[self.dtype]
        if shape[0] * shape[1] == 0:
            raise BadInputError(f"{name} is empty (shape {shape})")
        self.addr, self.readonly = int(cai["data"][0]), bool(cai["data"][1])
        strides = cai.get("strides")
        if strides is None:
            strides = (shape[1] * self.itemsize, self.itemsize)
        contiguous = "x.contiguous" if self.framework == "torch" else "cupy.ascontiguousarray"
        self.flipped = _row_order(shape, tuple(strides), self.itemsize, name, contiguous)
        self.rows, self.cols = shape[::-1] if self.flipped else shape
        s_row = strides[1] if self.flipped else strides[0]
        self.ld = self.cols if self.rows == 1 else s_row // self.itemsize
        try:
            # The framework knows its array's GPU; asking the driver is for the others.
            if self.framework == "torch":
                self.device = int(x.device.index)
            elif self.framework == "cupy":
                self.device = int(x.device.id)
            else:
                self.device = int(_native.gpu_of(self.addr))
        except DeviceError as e:
            raise DeviceError(f"{name} is a {_kind(x)} in GPU memory, which needs the CUDA "
                              f"driver to be read ({e}); to compute from host memory pass "
                              f"{name}.cpu() (torch) or {name}.get() (CuPy)") from None
        self.nbytes = ((self.rows - 1) * self.ld + self.cols) * self.itemsize
        # The stream the data is ready on: the framework's current stream; else what the
        # interface says (v3: None means nothing to wait for); else the whole GPU.
        self.sync: Optional[Tuple[Optional[int]]] = (None,)
        if self.framework == "torch":
            import torch  # type: ignore

            self.sync = (int(torch.cuda.current_stream(x.device).cuda_stream),)
        elif self.framework == "cupy":
            import cupy  # type: ignore

            with cupy.cuda.Device(self.device):
                self.sync = (int(cupy.cuda.get_current_stream().ptr),)
        elif "stream" in cai:
            self.sync = None if cai["stream"] is None else (int(cai["stream"]),)

    def descriptor(self) -> Dict[str, Any]:
        return {"kind": "device", "addr": self.addr, "rows": self.rows, "cols": self.cols,
                "ld": self.ld, "dtype": self.dtype, "device": self.device}

    def wait(self) -> None:
        """Wait for the work that produces this array (the caller's stream)."""
        if self.sync is not None:
            _native.gpu_wait(self.device, self.sync[0])

    def overlaps(self, other: "_Gpu") -> bool:
        return self.addr < other.addr + other.nbytes and other.addr < self.addr + self.nbytes

    def empty(self, m: int, n: int, dtype: np.dtype) -> Any:
        """A new m×n array on this array's GPU, of its framework (None: not one we make)."""
        if self.framework == "torch":
            import torch  # type: ignore

            tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                   np.dtype(np.float16): torch.float16}[dtype]
            return torch.empty((m, n), dtype=tdt, device=self.obj.device)
        if self.framework == "cupy":
            import cupy  # type: ignore

            with cupy.cuda.Device(self.device):
                return cupy.empty((m, n), dtype=dtype)
        return None


def _devices_for(a: Any, b: Any, devices: Any, backend: str, out: Any = None) -> Any:
    """``devices`` as asked, except that with the default ``"all"`` and every GPU operand (and
    a GPU ``out``) on one GPU the product runs on that GPU alone: a lane on another GPU would
    read those operands, and write the result, through host memory, block by block, slower
    than the one GPU computing it all."""
    if not (isinstance(devices, str) and devices == "all") or backend == "cpu":
        return devices
    on = {_Gpu(x, n).device for x, n in ((a, "a"), (b, "b"), (out, "out"))
          if x is not None and not isinstance(x, (str, os.PathLike)) and _on_gpu(x)}
    return [on.pop()] if len(on) == 1 else devices


def _result_on_gpu(first: "_Gpu", inputs: List["_Gpu"], need: int,
                   device_memory: Any) -> bool:
    """Whether ``matmul(out=None)`` keeps the result on the first GPU input's GPU: when it
    takes at most half that GPU's free memory (the rest is the engine's tiles); with
    ``device_memory`` given (the card size planned for), when it fits in it beside the inputs
    on that GPU, and the engine's ``device_memory`` still fits beside it in what is free."""
    free, _total = _native.gpu_memory(first.device)
    if need > free // 2:
        return False
    if device_memory is None or str(device_memory) == "auto":
        return True
    budget = _native.parse_size(_size(device_memory))
    if budget is None:
        return False  # the engine will say what is wrong with it
    beside = sum(g.nbytes for g in inputs if g.device == first.device)
    return need + beside <= budget and need + budget + (2 << 30) <= free


def _operand(x: Any, name: str) -> Tuple[Dict[str, Any], bool, Any]:
    """(descriptor for the engine, transposed, object to keep alive during the call)."""
    if isinstance(x, (str, os.PathLike)):
        return {"kind": "path", "path": os.fspath(x)}, False, None
    if _on_gpu(x):
        g = _Gpu(x, name)
        return g.descriptor(), g.flipped, g
    arr, flipped = _layout(_as_array(x, name), name)
    rows, cols = arr.shape
    d: Dict[str, Any] = {"rows": rows, "cols": cols, "ld": _ld(arr), "dtype": _DTYPES[arr.dtype]}
    region = _mmap_region(arr)
    if region is not None:
        d.update(kind="raw", path=region[0], offset=region[1])
    else:
        d.update(kind="buffer", addr=arr.__array_interface__["data"][0])
    return d, flipped, arr


# ---------------------------------------------------------------- progress -----------------


class _Display:
    """Turns engine events into a tqdm bar, plain lines, a callback, or nothing."""

    def __init__(self, progress: Progress):
        self.callback = progress if callable(progress) else None
        self.bar = None
        self.tqdm = None
        self.every = 0.2
        # Plain lines: the first one `every` seconds in (a call of a few milliseconds prints
        # only its finished line, not a 0 % line right before it).
        self.last_line = time.monotonic()
        if progress is True:
            try:
                from tqdm.auto import tqdm  # type: ignore

                self.tqdm = tqdm
            except ImportError:
                self.every = 5.0
        self.enabled = bool(progress)

    def __call__(self, kind: str, data: Any) -> None:
        if kind == "note":
            # GPUs named (matmul's devices=[...], a plan's engine.devices) under backend "auto"
            # and none usable: the engine's note says so and how to make it an error.
            if str(data).startswith("backend auto: using the CPU") and "devices = [" in str(data):
                warnings.warn(str(data), RuntimeWarning, stacklevel=_caller_level())
            if self.callback is not None or not self.enabled:
                log.info("%s", data)
            elif self.tqdm is not None:
                self.tqdm.write(str(data), file=sys.stderr)
            else:
                print(data, file=sys.stderr, flush=True)
            return
        if self.callback is not None:
            self.callback(data)
        elif self.tqdm is not None:
            self._bar(data)
        elif self.enabled:
            now = time.monotonic()
            if data["finished"] or now - self.last_line >= self.every:
                self.last_line = now
                pct = 100.0 * data["flops_done"] / max(data["flops_total"], 1)
                print(f"{data['label']}: {data['tiles_done']}/{data['tiles_total']} tiles "
                      f"({pct:.1f}%), {data['gflops_per_s']:.1f} GFLOP/s, "
                      f"elapsed {data['elapsed_s']:.0f}s", file=sys.stderr, flush=True)

    def _bar(self, u: Dict[str, Any]) -> None:
        if self.bar is None:
            self.bar = self.tqdm(total=u["tiles_total"], unit="tile", desc=u["label"])
        self.bar.n = u["tiles_done"]
        self.bar.set_postfix_str(f"{u['gflops_per_s']:.1f} GFLOP/s", refresh=False)
        self.bar.refresh()
        if u["finished"]:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _check_cancel(cancel: Any) -> None:
    """A cancel event must have ``is_set()``; one already set stops the call before it starts."""
    if cancel is None:
        return
    if not callable(getattr(cancel, "is_set", None)):
        raise BadInputError(f"cancel must be a threading.Event (or have is_set()); "
                            f"got {type(cancel).__name__}")
    if cancel.is_set():
        raise CancelledError("the cancel event was already set; nothing was computed")


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this package: a warning names the user's
    line that called it, not the package's."""
    here = os.path.dirname(os.path.abspath(__file__))
    f, level = sys._getframe(1), 1
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) == here:
        f, level = f.f_back, level + 1
    return level


def _run_with(display: _Display, fn: Callable[..., Any], *args: Any) -> Any:
    # Always listen: with progress=False the notes (resuming, summary) still reach `logging`.
    every = display.every if (display.enabled or display.callback) else 1.0
    try:
        rep = fn(*args, display, every)
    finally:
        display.close()
    _warn_nonfinite(rep)
    return rep


def _warn_nonfinite(rep: Any) -> None:
    """A RuntimeWarning, as numpy gives for invalid values, when a step wrote NaN/Inf: the
    summary's note says so at INFO level only, and with progress=False and logging at WARNING a
    product full of NaN returned without a word (new-user trial)."""
    if not isinstance(rep, dict):
        return
    for s in rep.get("steps", [rep]):
        n = s.get("nonfinite_outputs", 0) if isinstance(s, dict) else 0
        if not n:
            continue
        ins = [f"{i['values']} in {i['input']}" + (f" ({i['path']})" if i.get("path") else "")
               for i in s.get("nonfinite_input_blocks", [])]
        why = (f"the inputs hold NaN/Inf ({', '.join(ins)})" if ins else
               "the inputs are all finite: the product overflowed the output's precision "
               "(scale alpha or the inputs down, or compute in fp64)")
        warnings.warn(f"{n} of the {s['m'] * s['n']} elements of {s['output']} are NaN/Inf; "
                      f"{why}", RuntimeWarning, stacklevel=_caller_level())


# ---------------------------------------------------------------- matmul -------------------


def empty_cache() -> bool:
    """Let go of what the package keeps between calls: the backend of the last ``matmul`` or
    ``run`` (on GPUs their contexts, cuBLAS, and the page-locked host buffers of its pools, at
    most what one call's ``host_memory`` allowed). A later call with the same ``backend``,
    ``devices``, ``threads`` and ``device_memory`` takes it instead of starting one (its
    summary names the backend "kept from an earlier call"; ``run``'s step reports say
    ``backend_reused``); the engine's GPU buffers are not held between calls (the
    CUDA contexts are). Returns whether something was kept. Like ``torch.cuda.empty_cache()``, only needed to give the memory back
    while the process goes on."""
    return bool(_native.release_backend())


def result_memory_limit() -> int:
    """Bytes ``matmul(out=None)`` may allocate for its result: half the memory available now
    (``MemAvailable`` in /proc/meminfo; half the physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _size(v: Union[int, str]) -> str:
    return str(int(v)) if isinstance(v, (int, np.integer)) else str(v)


def _settings(backend: str, devices: Union[str, Sequence[int]], host_memory: Any,
              device_memory: Any, threads: int, tile: Any,
              engine: Optional[Dict[str, Any]]) -> List[Tuple[str, str]]:
    s: List[Tuple[str, str]] = [("backend", backend), ("threads", str(int(threads)))]
    if isinstance(devices, str):
        s.append(("devices", devices))
    elif isinstance(devices, (int, np.integer)):
        s.append(("devices", json.dumps([int(devices)])))
    else:
        s.append(("devices", json.dumps([int(d) for d in devices])))
    if host_memory is not None:
        s.append(("host_memory", _size(host_memory)))
    if device_memory is not None:
        s.append(("device_memory", _size(device_memory)))
    if tile is not None:
        s.append(("tile", json.dumps(list(tile)) if isinstance(tile, (list, tuple)) else str(tile)))
    # A keyword given (not left at its default) and the same key in `engine=` must agree, as
    # `precision` must (`_precision`): `host_memory="2GiB", engine={"host_memory": "1GiB"}` ran
    # with 1 GiB and said nothing (a new user's trial).
    given = {"backend": backend != "auto", "devices": devices != "all",
             "threads": int(threads) != 0, "host_memory": host_memory is not None,
             "device_memory": device_memory is not None, "tile": tile is not None}
    for k, v in (engine or {}).items():
        text = json.dumps(v) if isinstance(v, (bool, list)) else str(v)
        mine = [(i, x) for i, (key, x) in enumerate(s) if key == k]
        if mine and given.get(k, False) and mine[0][1] != text:
            raise BadInputError(f"{k}={mine[0][1]!r} and engine={{{k!r}: {v!r}}} disagree; "
                                f"give one of them")
        s = [(key, x) for key, x in s if key != k]
        s.append((k, text))
    return s


def _precision(precision: Optional[str], engine: Optional[Dict[str, Any]]
               ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``precision=`` and ``engine={"precision": ...}`` as one setting (they must agree)."""
    if not engine or "precision" not in engine:
        return precision, engine
    rest = {k: v for k, v in engine.items() if k != "precision"}
    p = str(engine["precision"])
    if precision is not None and precision != p:
        raise BadInputError(f"precision={precision!r} and engine={{'precision': {p!r}}} "
                            f"disagree; give one of them")
    return p, rest


def _prepare(a: Any, b: Any, alpha: float, trans_a: bool, trans_b: bool,
             precision: Optional[str], settings: List[Tuple[str, str]]) -> Tuple[Any, list]:
    """(job, [(name, descriptor, array kept alive) per operand])."""
    da, fa, ka = _operand(a, "a")
    db, fb, kb = _operand(b, "b")
    job = _native.prepare(da, db, float(alpha), bool(trans_a) != fa, bool(trans_b) != fb,
                          precision, settings)
    return job, [("a", da, ka), ("b", db, kb)]


_ITEMSIZE = {"f16": 2, "f32": 4, "f64": 8}


def _extent(rows: int, cols: int, ld: int, itemsize: int, offset: int) -> Tuple[int, int]:
    return offset, offset + ((rows - 1) * ld + cols) * itemsize


def _file_extent(desc: Dict[str, Any], kept: Any) -> Optional[Tuple[str, int, int]]:
    """(file, first byte, end) an operand reads from a file: a path all of it, a memmap region
    its bytes, an array in memory that maps a file (a copy-on-write memmap, a view) those."""
    if desc["kind"] == "path":
        return desc["path"], 0, 1 << 62
    size = _ITEMSIZE[desc["dtype"]]
    if desc["kind"] == "raw":
        return (desc["path"],) + _extent(desc["rows"], desc["cols"], desc["ld"], size,
                                         desc["offset"])
    back = _backing_file(kept) if kept is not None else None
    if back is None:
        return None
    return (back[0],) + _extent(desc["rows"], desc["cols"], desc["ld"], size, back[1])


def _check_no_overlap(out: Any, inputs: list) -> None:
    """Refuse an ``out`` array that shares memory or file bytes with an input: the engine
    writes finished tiles while it still reads the inputs (out of core it reads them again), so
    the result would be computed from parts of itself."""
    arr = _as_array(out, "out")
    region = _backing_file(arr)
    for name, desc, kept in inputs:
        if desc["kind"] == "device":
            continue  # GPU memory: never the same as a host array's
        if kept is not None and np.may_share_memory(arr, kept):
            raise BadInputError(f"out shares memory with input {name}; the engine reads the "
                                f"inputs while it writes the result: pass a new array (or none)")
        ext = _file_extent(desc, kept)
        if region is None or ext is None:
            continue
        try:
            same = os.path.samefile(region[0], ext[0])
        except OSError:
            continue
        lo, hi = region[1], region[1] + arr.size * arr.itemsize
        if same and lo < ext[2] and ext[1] < hi:
            raise BadInputError(f"out is a memmap of {region[0]}, whose bytes input {name} "
                                f"reads; the engine reads the inputs while it writes the "
                                f"result: write it to another file")


def _human(n: int) -> str:
    """Bytes as the engine prints sizes (B, KiB, MiB, GiB, TiB)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _output(job: Any, out: Any, result_memory: Union[int, str, None],
            gpus: Optional[List[_Gpu]] = None,
            device_memory: Any = None) -> Tuple[Dict[str, Any], Any]:
    """(descriptor, what matmul returns) for ``out``; ``gpus``: the operands in GPU memory
    (an ``out`` there is appended, so that the caller waits for its stream too)."""
    gpus = [] if gpus is None else gpus
    m, n = job.shape
    dt = np.dtype(job.dtype)
    # The summary heads a result the call allocates "result (new array)", not "out (array)".
    new = out is None
    if out is None and gpus and _result_on_gpu(gpus[0], gpus, m * n * dt.itemsize,
                                               device_memory):
        out = gpus[0].empty(m, n, dt)
    if out is not None and _on_gpu(out):
        g = _Gpu(out, "out")
        if (g.rows, g.cols) != (m, n) or g.flipped or _DTYPES.get(dt) != g.dtype:
            raise BadInputError(f"out is a {'Fortran-order ' if g.flipped else ''}"
                                f"{g.rows}×{g.cols} {g.dtype} GPU array but the result is "
                                f"{m}×{n} {dt.name}; pass a C-contiguous one of that shape")
        if g.readonly or g.ld != n:
            raise BadInputError("out must be a writable C-contiguous GPU array "
                                "(e.g. torch.empty((m, n), device='cuda'))")
        for i in gpus:
            if g.overlaps(i):
                raise BadInputError("out shares GPU memory with an input; the engine reads "
                                    "the inputs while it writes the result: pass a new array")
        gpus.append(g)
        return dict(g.descriptor(), new=new), out
    if out is None:
        need = m * n * dt.itemsize
        if result_memory is None:
            limit = result_memory_limit()
        else:
            # Bytes, or a size as host_memory takes it ("8GiB").
            parsed = _native.parse_size(_size(result_memory))
            if parsed is None:
                raise BadInputError(f"result_memory={result_memory!r} is not a size: give bytes "
                                    f"or a string such as '8GiB'")
            limit = parsed
        if need > limit:
            raise BadInputError(
                f"the result is {m}×{n} {dt.name} = {_human(need)}, more than the "
                f"{_human(limit)} allowed for returning an array "
                f"({'result_memory' if result_memory is not None else 'half the memory available now'}); "
                f"pass out='C.npy' (then np.load('C.npy', mmap_mode='r') reads it lazily), "
                f"out='C.mgt', or an array to write into (np.lib.format.open_memmap('C.npy', "
                f"'w+', ...) for one larger than RAM) — or a larger result_memory"
            )
        out = np.empty((m, n), dtype=dt)
    if isinstance(out, (str, os.PathLike)):
        p = os.fspath(out)
        d = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(d):
            raise BadInputError(f"out={p}: its directory {d} does not exist; create it first")
        return {"kind": "path", "path": p}, p
    arr = _as_array(out, "out")
    if arr.ndim != 2 or arr.shape != (m, n) or arr.dtype != dt:
        raise BadInputError(f"out is {arr.shape} {arr.dtype} but the result is ({m}, {n}) {dt.name}")
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        why = ("is read-only" if not arr.flags.writeable else
               "is not C-contiguous (Fortran order, or a strided view)")
        raise BadInputError(f"out {why}: it must be a writable C-contiguous array "
                            "(e.g. np.empty((m, n), dtype) or an np.memmap opened 'r+'/'w+')")
    d = {"kind": "buffer", "addr": arr.__array_interface__["data"][0], "rows": m, "cols": n,
         "ld": n, "dtype": _DTYPES[dt], "new": new}
    return d, out


def matmul(a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, trans_a: bool = False,
           trans_b: bool = False, precision: Optional[str] = None,
           devices: Union[str, Sequence[int]] = "all", host_memory: Union[int, str, None] = None,
           device_memory: Union[int, str, None] = None, progress: Progress = True,
           backend: str = "auto", threads: int = 0, tile: Any = None,
           engine: Optional[Dict[str, Any]] = None, result_memory: Union[int, str, None] = None,
           restart: bool = False, cancel: Any = None) -> Any:
    """Compute ``alpha · op(a) · op(b)`` out of core, where op(x) is x or x.T.

    a, b: paths (``.npy`` read in place, ``.mgt``), ``np.memmap``s (read from their file at
        their offset, C or Fortran order), numpy arrays in RAM (read from their buffer without a
        copy; rows or columns must be contiguous), CPU torch tensors, or arrays in GPU memory
        (CUDA torch tensors, CuPy arrays, anything with ``__cuda_array_interface__``: read in
        place, device to device by a lane on their GPU — through the host by any other — after
        the caller's current stream is waited for). float32, float64 or float16; both the same dtype.
    out: None → a new numpy array, if it fits ``result_memory`` (default: half the memory
        available; otherwise BadInputError asks for ``out=``) — or, when an input is on a GPU,
        a new array of its kind on its GPU if the result takes at most half of that GPU's free
        memory (and, with ``device_memory`` given, fits in it beside the inputs there), else
        the numpy array; a path ``.npy`` (returns a read-only memmap of it) or ``.mgt``
        (returns the path), written with a journal so an interrupted call resumes (computed
        afresh when an input is on a GPU); or a writable C-contiguous array / memmap / CPU
        tensor / CUDA tensor / CuPy array of the result's shape and dtype (returned).
    precision: "fp32", "tf32", "bf16", "fp16" or "fp64"; default fp64 for float64 inputs, else
        fp32. The result is float64 for fp64, float32 otherwise.
    devices: "all" or GPU ordinals ([0, 1]). host_memory / device_memory: byte counts or
        sizes like "8GiB" (staging pool ceiling; per-GPU budget). backend: "auto", "cpu" or
        "cuda". threads, tile, engine={key: value}: any other [engine] setting (docs/PLAN.md).
    progress: True (a tqdm bar if tqdm is installed, else a line every 5 s on stderr), False,
        or a function called with a dict (tiles_done, tiles_total, gflops_per_s, eta_s, ...).
    restart: discard the journal of a file output and recompute it.
    cancel: a ``threading.Event``; setting it stops the call with CancelledError.

    Ctrl-C raises KeyboardInterrupt within about 0.1 s; a file output keeps its journal, and
    the same call later resumes it.

    >>> import numpy as np, mgmm_stream as mg
    >>> a = np.arange(6, dtype=np.float64).reshape(2, 3)
    >>> mg.matmul(a, a, trans_b=True, progress=False)
    array([[ 5., 14.],
           [14., 50.]])
    """
    _check_cancel(cancel)
    precision, engine = _precision(precision, engine)
    devices = _devices_for(a, b, devices, backend, out)
    settings = _settings(backend, devices, host_memory, device_memory, threads, tile, engine)
    job, keep = _prepare(a, b, alpha, trans_a, trans_b, precision, settings)
    gpus = [k for _n, _d, k in keep if isinstance(k, _Gpu)]
    desc, result = _output(job, out, result_memory, gpus, device_memory)
    if desc["kind"] == "buffer" and out is not None:
        _check_no_overlap(out, keep)
    if gpus and desc["kind"] == "path":
        # A GPU array is not hashed for the journal (that would copy it through the host):
        # a file output computed from one is computed afresh, never resumed.
        restart = True
    for g in gpus:
        g.wait()
    display = _Display(progress)
    _run_with(display, lambda ev, every: job.run(desc, bool(restart), ev, cancel, every))
    del keep
    if isinstance(result, str) and result.endswith(".npy"):
        return np.load(result, mmap_mode="r")
    return result


# ---------------------------------------------------------------- plans --------------------


def _plan_json(plan_: Dict[str, Any]) -> str:
    """A plan dict as JSON text for the engine: numpy scalars as Python numbers, and a NaN or
    infinite number refused naming its key (JSON has none: it failed as "the plan dict cannot
    be written as TOML: expected value at line 1 column 147")."""
    def walk(v: Any, at: str) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, f"{at}.{k}" if at else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{at}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0):
            v = v.item()
        if isinstance(v, float) and not (v == v and abs(v) != float("inf")):
            raise BadInputError(f"<plan dict>: {at} = {v}; use a finite number")
        return v
    return json.dumps(walk(plan_, ""))


def _plan_source(plan_: Union[PathLike, Dict[str, Any]]) -> Tuple[Optional[str], Optional[str]]:
    if isinstance(plan_, dict):
        return None, _native.json_to_toml(_plan_json(plan_))
    if isinstance(plan_, (str, os.PathLike)):
        return os.fspath(plan_), None
    raise BadInputError(f"a plan is a path to a .toml file or a dict; got {type(plan_).__name__}")


def _sets(set: Optional[Dict[str, Any]]) -> List[str]:
    if set is not None and not isinstance(set, dict):
        # The CLI's `--set engine.KEY=VALUE` strings are not what Python takes.
        raise BadInputError(
            f"set= is a dict of [engine] keys, e.g. set={{'backend': 'cpu'}}; got {type(set).__name__} {set!r}")
    # `engine.` written out, as on the command line, is taken too (it read
    # `--set engine.engine.host_memory=…` in the error).
    return [f"engine.{k.removeprefix('engine.')}={json.dumps(v) if isinstance(v, (bool, list)) else v}"
            for k, v in (set or {}).items()]


def run(plan_path_or_dict: Union[PathLike, Dict[str, Any]], *, restart: bool = False,
        progress: Progress = True, set: Optional[Dict[str, Any]] = None,
        cancel: Any = None) -> Dict[str, Any]:
    """Run a plan (a ``plan.toml`` path, or the same structure as a dict) like
    ``mgmm-stream run``: generate missing inputs, compute every step, resume unfinished ones.
    Returns the run report (what ``run --report`` writes) as a dict. ``set`` overrides
    [engine] keys, like ``--set engine.KEY=VALUE``. Paths in a dict are relative to the
    current directory.

    >>> rep = mg.run({"matrices": {"A": {"path": "A.mgt", "generate": {"rows": 64, "cols": 64}}},
    ...               "step": [{"output": "C.mgt", "expr": "A @ A.T"}]}, progress=False)  # doctest: +SKIP
    >>> rep["steps"][0]["tiles_computed"]  # doctest: +SKIP
    1
    """
    _check_cancel(cancel)
    path, text = _plan_source(plan_path_or_dict)
    display = _Display(progress)
    return _run_with(display, lambda ev, every: _native.run_plan(
        path, text, _sets(set), bool(restart), ev, cancel, every))


def plan(plan_or_a: Any, b: Any = None, *, set: Optional[Dict[str, Any]] = None,
         **matmul_kwargs: Any) -> Dict[str, Any]:
    """What a run would do, without doing it: the text ``mgmm-stream plan`` prints (key
    ``text``) and, per step, the tile sizes, grid, host and device bytes and the traffic model.

    ``plan("plan.toml")`` / ``plan({...})`` describe a plan; ``plan(a, b, **kw)`` describes
    ``matmul(a, b, **kw)`` (same keywords).

    >>> p = mg.plan(np.ones((4096, 4096), np.float32), np.ones((4096, 4096), np.float32),
    ...             backend="cpu")  # doctest: +SKIP
    >>> p["steps"][0]["host_bytes"]  # doctest: +SKIP
    """
    if b is None:
        path, text = _plan_source(plan_or_a)
        return _native.describe_plan(path, text, _sets(set))
    kw = dict(matmul_kwargs)
    # (`set` is a parameter here, not the builtin.)
    known = [k for k in inspect.signature(matmul).parameters if k not in ("a", "b")]
    unknown = sorted(k for k in kw if k not in known)
    if unknown:
        raise TypeError(f"plan() got an unexpected keyword argument {unknown[0]!r} "
                        f"(it takes matmul's keywords)")
    precision, engine = _precision(kw.pop("precision", None), kw.pop("engine", None))
    settings = _settings(kw.pop("backend", "auto"), kw.pop("devices", "all"),
                         kw.pop("host_memory", None), kw.pop("device_memory", None),
                         kw.pop("threads", 0), kw.pop("tile", None), engine)
    job, _keep = _prepare(plan_or_a, b, kw.pop("alpha", 1.0), kw.pop("trans_a", False),
                          kw.pop("trans_b", False), precision, settings)
    out = kw.pop("out", None)
    return job.describe(os.fspath(out) if isinstance(out, (str, os.PathLike)) else None)


def verify(plan_path_or_dict: Union[PathLike, Dict[str, Any]], *, rounds: int = 2, seed: int = 1,
           set: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Freivalds' check of every output of a plan that has run (``mgmm-stream verify``):
    one report dict per step, with ``pass``, ``reason``, ``max_ratio`` and the failing tiles.
    Raises nothing for a failing product — look at ``report["pass"]``. An output whose every
    row holds NaN or Inf (an overflow) cannot be checked: ``checked`` and ``pass`` are False.

    >>> [r["pass"] for r in mg.verify("plan.toml")]  # doctest: +SKIP
    [True]
    """
    path, text = _plan_source(plan_path_or_dict)
    return _native.verify_plan(path, text, _sets(set), int(rounds), int(seed))


def info(path: PathLike, *, check: bool = False) -> Dict[str, Any]:
    """The header of a ``.mgt`` file as a dict (rows, cols, dtype, tile, grid, sizes);
    ``check=True`` also verifies every tile's CRC (StorageError on a mismatch).

    >>> mg.info("C.mgt")["rows"]  # doctest: +SKIP
    """
    return _native.info(os.fspath(path), bool(check))
