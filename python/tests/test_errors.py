"""Bad inputs raise clear errors of the right class; nothing is computed."""

import os
import tempfile
import warnings

import numpy as np
import pytest

import mgmm_stream as mg
from conftest import CPU, close, rand, reference


def test_hierarchy():
    assert issubclass(mg.BadInputError, mg.MgmmError) and issubclass(mg.BadInputError, ValueError)
    assert issubclass(mg.DeviceError, RuntimeError) and issubclass(mg.StorageError, OSError)
    assert issubclass(mg.CancelledError, mg.MgmmError)


@pytest.mark.parametrize("a,b,match", [
    (rand((10, 5)), rand((6, 4)), "inner dimensions 5 ≠ 6"),
    (rand((10, 5)), rand((5, 4), np.float64), "same dtype"),
    (rand((10, 5)).astype(np.int32), rand((5, 4)), "int32; use float32"),
    (rand((2, 10, 5)), rand((5, 4)), "must be 2-D"),
    (rand((10, 5)), [[1.0]], "must be a path"),
    (rand((10, 10))[::2, ::2], rand((5, 4)), "np.ascontiguousarray"),
    (rand((10, 5)).astype(">f4"), rand((5, 4)), "byte order"),
    (np.zeros((0, 5), np.float32), rand((5, 4)), "empty"),
])
def test_bad_operands(a, b, match):
    with pytest.raises(mg.BadInputError, match=match):
        mg.matmul(a, b, **CPU)


def test_bad_settings():
    a, b = rand((10, 5)), rand((5, 4))
    with pytest.raises(mg.BadInputError, match="precision=\"fp33\" is unknown"):
        mg.matmul(a, b, precision="fp33", **CPU)
    with pytest.raises(mg.BadInputError, match="fp64.*float64 inputs"):
        mg.matmul(a, b, precision="fp64", **CPU)
    with pytest.raises(mg.BadInputError, match="host_memory"):
        mg.matmul(a, b, host_memory="lots", **CPU)
    with pytest.raises(mg.BadInputError, match="float64 but precision"):
        mg.matmul(a.astype(np.float64), b.astype(np.float64), precision="fp32", **CPU)


def test_bad_outputs(tmp_path):
    a, b = rand((10, 5)), rand((5, 4))
    with pytest.raises(mg.BadInputError, match="out is"):
        mg.matmul(a, b, out=np.empty((4, 10), np.float32), **CPU)
    with pytest.raises(mg.BadInputError, match="out is not C-contiguous"):
        mg.matmul(a, b, out=np.empty((4, 10), np.float32).T, **CPU)
    ro = np.empty((10, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(mg.BadInputError, match="out is read-only"):
        mg.matmul(a, b, out=ro, **CPU)
    with pytest.raises(mg.BadInputError, match="out=.*mgt"):
        mg.matmul(a, b, out=tmp_path / "c.txt", **CPU)
    with pytest.raises(mg.BadInputError, match="pass out="):
        mg.matmul(a, b, result_memory=100, **CPU)
    np.save(tmp_path / "a.npy", a)
    with pytest.raises(mg.BadInputError, match="also the input"):
        mg.matmul(str(tmp_path / "a.npy"), np.eye(5, dtype=np.float32),
                  out=tmp_path / "a.npy", **CPU)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(mg.StorageError, match="nope.mgt"):
        mg.matmul(str(tmp_path / "nope.mgt"), rand((5, 4)), **CPU)
    bad = tmp_path / "bad.mgt"
    bad.write_bytes(b"not a matrix" * 100)
    with pytest.raises(mg.MgmmError, match="bad.mgt"):
        mg.info(bad)
    truncated = tmp_path / "t.raw"
    truncated.write_bytes(b"\0" * 100)
    m = np.memmap(truncated, dtype=np.float32, mode="r", shape=(5, 5))
    (tmp_path / "t.raw").write_bytes(b"\0" * 40)  # shrink under the map
    with pytest.raises(mg.BadInputError, match="truncated"):
        mg.matmul(m, rand((5, 4)), **CPU)


def test_bad_plan_message_is_the_clis(tmp_path):
    plan = tmp_path / "p.toml"
    plan.write_text('[[step]]\noutput = "C.mgt"\nexpr = "A @ B"\n')
    with pytest.raises(mg.BadInputError, match=r"p.toml: step 1 \(line 3\).*unknown matrix `A`"):
        mg.run(plan, progress=False)
    with pytest.raises(mg.BadInputError, match="path to a .toml file or a dict"):
        mg.run(42)


def test_out_overlapping_an_input_is_refused(tmp_path):
    """The engine writes tiles while it still reads the inputs (out of core it reads them
    again), so an `out` that is an input, a view of one, or a memmap of an input's file bytes
    would compute the result from parts of itself: refused, and the input is left as it was."""
    a, b = rand((67, 67)), rand((67, 67))
    keep = b.copy()
    with pytest.raises(mg.BadInputError, match="shares memory with input b"):
        mg.matmul(a, b, out=b, **CPU)
    big = rand((134, 67))
    with pytest.raises(mg.BadInputError, match="shares memory with input a"):
        mg.matmul(big[:67], b, out=big[33:100], **CPU)
    assert np.array_equal(b, keep)
    # Rows of the same array that the input does not use are not the input: allowed.
    c = mg.matmul(big[:67], b, out=big[67:], **CPU)
    assert np.allclose(c, big[:67].astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    np.save(tmp_path / "b.npy", b)
    for src in (str(tmp_path / "b.npy"), np.load(tmp_path / "b.npy", mmap_mode="r")):
        with pytest.raises(mg.BadInputError, match="whose bytes input b reads"):
            mg.matmul(rand((67, 67)), src, out=np.load(tmp_path / "b.npy", mmap_mode="r+"), **CPU)
    assert np.array_equal(np.load(tmp_path / "b.npy"), keep)
    # Another region of the same file is not the input: allowed.
    m = np.memmap(tmp_path / "two.bin", np.float32, "w+", shape=(2 * 67, 67))
    m[:67] = b
    m.flush()
    c = mg.matmul(a, m[:67], out=m[67:], **CPU)
    assert np.allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    # A copy-on-write memmap input (read from memory) over the bytes an `out` memmap writes,
    # and an `out` that is a plain view of a memmap: the file behind each is found all the same.
    cow = np.memmap(tmp_path / "two.bin", np.float32, "c", shape=(2 * 67, 67))
    with pytest.raises(mg.BadInputError, match="whose bytes input b reads"):
        mg.matmul(a, cow[67:], out=m[67:], **CPU)
    view = np.asarray(np.memmap(tmp_path / "two.bin", np.float32, "r+", shape=(2 * 67, 67)))
    with pytest.raises(mg.BadInputError, match="whose bytes input b reads"):
        mg.matmul(a, np.load(tmp_path / "b.npy", mmap_mode="r"),
                  out=np.asarray(np.load(tmp_path / "b.npy", mmap_mode="r+")), **CPU)
    # float16 inputs give a float32 result: an f16 input just before `out` does not overlap it.
    n16 = 67 * 67
    h = np.memmap(tmp_path / "mixed.bin", np.uint8, "w+", shape=(n16 * 2 + n16 * 4,))
    a16 = np.ndarray((67, 67), np.float16, buffer=h, offset=0)
    a16[:] = a.astype(np.float16)
    out32 = np.ndarray((67, 67), np.float32, buffer=h, offset=n16 * 2)
    h.flush()
    a16m = np.memmap(tmp_path / "mixed.bin", np.float16, "r", shape=(67, 67))
    c = mg.matmul(a16m, a16m, out=out32, **CPU)
    assert c is out32
    del view


def test_other_bad_calls():
    a, b = rand((10, 5)), rand((5, 4))
    with pytest.raises(mg.BadInputError, match="negative stride"):
        mg.matmul(a[::-1], b, **CPU)
    with pytest.raises(mg.BadInputError, match=r"= 160 B, more than the 100 B"):
        mg.matmul(a, b, result_memory=100, **CPU)
    # A size as host_memory takes it; the refusal names the ways out, an array among them.
    with pytest.raises(mg.BadInputError, match=r"more than the 100 B .*an array to write into"):
        mg.matmul(a, b, result_memory="100B", **CPU)
    assert mg.matmul(a, b, result_memory="1KiB", **CPU).shape == (10, 4)
    with pytest.raises(mg.BadInputError, match=r"result_memory='lots' is not a size"):
        mg.matmul(a, b, result_memory="lots", **CPU)
    with pytest.raises(mg.BadInputError, match="directory .*nodir does not exist"):
        mg.matmul(a, b, out="nodir/C.npy", **CPU)
    with pytest.raises(mg.BadInputError, match="disagree"):
        mg.matmul(a, b, precision="fp32", engine={"precision": "bf16"}, **CPU)
    with pytest.raises(TypeError, match="unexpected keyword argument 'trans_B'"):
        mg.plan(a, b, trans_B=True, backend="cpu")
    with pytest.raises(mg.BadInputError, match="threading.Event"):
        mg.matmul(a, b, cancel=object(), **CPU)
    import threading
    ev = threading.Event()
    ev.set()
    with pytest.raises(mg.CancelledError, match="already set"):
        mg.matmul(a, b, cancel=ev, **CPU)


def test_engine_precision_is_honoured():
    a, b = rand((64, 300), seed=3), rand((300, 64), seed=4)
    exact = a.astype(np.float64) @ b
    c = mg.matmul(a, b, engine={"precision": "bf16"}, **CPU)
    assert np.abs(c - exact).max() > 1e-3, "bf16 rounds its inputs: not an fp32 result"
    assert mg.plan(a, b, engine={"precision": "bf16"}, backend="cpu")["precision"] == "bf16"


def test_devices_as_an_int():
    a, b = rand((10, 5)), rand((5, 4))
    c = mg.matmul(a, b, devices=0, backend="cpu", progress=False)
    assert np.allclose(c, a.astype(np.float64) @ b, rtol=1e-5)


def test_gpus_asked_for_without_a_usable_gpu_warn():
    """devices=[0, 1] under backend="auto" on a machine without a GPU: computed on the CPU,
    with a RuntimeWarning saying so (with progress=False a note alone would only reach logging)."""
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("a GPU is present: nothing falls back")
    a, b = rand((20, 30)), rand((30, 10), seed=1)
    with pytest.warns(RuntimeWarning, match=r"using the CPU.*devices = \[0, 1\] asked for GPUs") as rec:
        c = mg.matmul(a, b, devices=[0, 1], tile=64, progress=False)
    # The warning names the caller's line, not the package's.
    assert rec[0].filename == __file__, rec[0].filename
    close(c, reference(a, b), np.float32)
    # A plan's engine.devices through run(): the same warning (it only reached logging before).
    with tempfile.TemporaryDirectory() as d:
        plan = {"matrices": {"A": {"path": os.path.join(d, "A.mgt"),
                                   "generate": {"rows": 20, "cols": 30}},
                             "B": {"path": os.path.join(d, "B.mgt"),
                                   "generate": {"rows": 30, "cols": 10}}},
                "step": [{"output": os.path.join(d, "C.mgt"), "expr": "A @ B"}],
                "engine": {"devices": [1], "tile": 64}}
        with pytest.warns(RuntimeWarning, match=r"using the CPU.*devices = \[1\] asked for GPUs"):
            rep = mg.run(plan, progress=False)
        assert rep["steps"][0]["tiles_computed"] == 1
    # Not with "all" (the default): auto means "a GPU if there is one".
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mg.matmul(a, b, tile=64, progress=False)


class _DeviceArray:
    """What CuPy arrays (and numba's, and CUDA torch tensors) show: device memory only."""

    def __init__(self, shape=(4, 4), typestr="<f4", strides=None, addr=1 << 40):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (addr, False), "strides": strides,
                                         "version": 3, "stream": None}


def test_device_arrays_get_clear_errors_where_they_cannot_be_read(tmp_path):
    """GPU arrays are read in place on a GPU machine (tests/test_gpu_arrays.py); what can be
    told without one is told before the driver is asked, and without a driver the error
    names the array and what is missing. Places that take no GPU arrays name the way on."""
    host = np.ones((4, 4), np.float32)
    with pytest.raises(mg.BadInputError, match=r"a must be 2-D"):
        mg.matmul(_DeviceArray(shape=(4, 4, 4)), host, progress=False)
    with pytest.raises(mg.BadInputError, match=r"GPU array of <i4; use float32"):
        mg.matmul(_DeviceArray(typestr="<i4"), host, progress=False)
    with pytest.raises(mg.BadInputError, match=r"b is a strided view .* cupy.ascontiguousarray"):
        mg.matmul(host, _DeviceArray(shape=(4, 4), strides=(32, 8)), progress=False)
    with pytest.raises(mg.BadInputError, match=r"b is empty"):
        mg.matmul(host, _DeviceArray(shape=(4, 0)), progress=False)
    if not os.path.exists("/dev/nvidiactl"):
        with pytest.raises(mg.DeviceError, match=r"a is a .*_DeviceArray in GPU memory, which needs the CUDA driver.*\.cpu\(\)"):
            mg.matmul(_DeviceArray(), host, progress=False, backend="cpu")
        with pytest.raises(mg.DeviceError, match=r"out is a .*_DeviceArray in GPU memory, which needs"):
            mg.matmul(host, host, out=_DeviceArray(), progress=False, backend="cpu")
    # Where GPU arrays are not taken (an operand of a dask product), the way on is named.
    with pytest.raises(mg.BadInputError, match=r"in GPU memory, which is not taken here.*\.get\(\)"):
        mg._as_array(_DeviceArray(), "a")


def test_a_plan_dict_is_named_as_given_without_line_numbers(tmp_path, monkeypatch):
    """A plan given as a dict has no file and no lines of its own: its errors and `plan()`'s
    text name it `<plan dict>` (not the current directory joined to it) and carry no line
    numbers of the TOML it was written as; an operand on both sides of @ is said plainly (a new
    user's trial)."""
    monkeypatch.chdir(tmp_path)
    a = {"path": "A.mgt", "generate": {"rows": 100, "cols": 50, "seed": 1}}
    missing = {"matrices": {"A": a, "B": {"path": "nope/B.mgt"}},
               "step": [{"output": "C.mgt", "expr": "A @ B"}], "engine": {"backend": "cpu"}}
    typo = {"matrices": {"A": a}, "step": [{"output": "C.mgt", "expr": "A @ A.T"}],
            "engine": {"backend": "cpu", "host_memry": "1GiB"}}
    square = {"matrices": {"A": a}, "step": [{"output": "C.mgt", "expr": "A @ A"}],
              "engine": {"backend": "cpu"}}
    for plan, says in ((missing, "matrices.B"), (typo, "host_memry"), (square, "on both sides of @")):
        with pytest.raises(mg.BadInputError) as e:
            mg.run(plan, progress=False)
        msg = str(e.value)
        assert msg.startswith("<plan dict>: ") and says in msg, msg
        assert "(line" not in msg and "at line" not in msg and str(tmp_path) + "/<" not in msg, msg
    text = mg.plan({**square, "step": [{"output": "C.mgt", "expr": "A @ A.T"}]})["text"]
    assert text.startswith("plan <plan dict>\n") and "(line" not in text, text


def test_plan_dict_with_a_nan_or_a_numpy_scalar(tmp_path, monkeypatch):
    # A NaN in a plan dict failed as "cannot be written as TOML: expected value at line 1
    # column 147", a numpy scalar as "Object of type float32 is not JSON serializable" (trial).
    monkeypatch.chdir(tmp_path)
    np.save("A.npy", rand((20, 10), seed=1))
    np.save("B.npy", rand((10, 8), seed=2))
    plan = {"matrices": {"A": {"path": "A.npy"}, "B": {"path": "B.npy"}},
            "step": [{"output": "C.npy", "expr": "A @ B", "alpha": float("nan")}],
            "engine": {"backend": "cpu"}}
    with pytest.raises(mg.BadInputError, match=r"step\[0\]\.alpha = nan; use a finite number"):
        mg.run(plan, progress=False)
    plan["step"][0]["alpha"] = np.float32(2.5)
    mg.run(plan, progress=False)
    close(np.load("C.npy"), 2.5 * (np.load("A.npy") @ np.load("B.npy")), np.float32)


def test_messages_say_restart_true_in_place_of_the_command_lines_words(tmp_path, monkeypatch,
                                                                        caplog):
    """Where the command line says `rerun with --restart` (or `run --restart`, `Use --restart`),
    a Python caller reads `restart=True` in its place: errors, notes and `plan()`'s text. They
    kept the command line's words and ended with "(from Python: pass restart=True)"."""
    monkeypatch.chdir(tmp_path)
    a, b = rand((40, 30), np.float32, 1), rand((30, 20), np.float32, 2)
    mg.matmul(a, b, out="c.mgt", **CPU)
    a[0, 0] += 1
    with pytest.raises(mg.BadInputError) as e:
        mg.matmul(a, b, out="c.mgt", **CPU)
    changed = str(e.value)
    os.remove("c.mgt.journal")
    with pytest.raises(mg.BadInputError) as e:
        mg.matmul(a, b, out="c.mgt", **CPU)
    not_ours = str(e.value)
    p = {"matrices": {"A": {"path": "A.mgt", "generate": {"rows": 40, "cols": 30, "seed": 1}},
                      "B": {"path": "B.mgt", "generate": {"rows": 30, "cols": 20, "seed": 2}}},
         "step": [{"output": "D.mgt", "expr": "A @ B"}], "engine": {"backend": "cpu"}}
    mg.run(p, progress=False)
    with caplog.at_level("INFO", logger="mgmm_stream"):
        mg.run(p, progress=False)
    complete = " ".join(r.getMessage() for r in caplog.records if "already complete" in r.getMessage())
    text = mg.plan(p)["text"]
    assert "rerun with `restart=True` to start this step over" in changed, changed
    assert "rerun with `restart=True` to overwrite it" in not_ours, not_ours
    assert "Pass `restart=True` to recompute it" in complete, complete
    assert "(`restart=True` computes it again)" in text, text
    for msg in (changed, not_ours, complete, text):
        assert "--restart" not in msg and "from Python" not in msg, msg
