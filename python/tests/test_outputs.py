"""Where results go: a new array, a given array, .npy and .mgt files; plans and info."""

import os

import numpy as np
import pytest

import mgmm_stream as mg
from conftest import CPU, close, rand, reference

M, K, N = 100, 70, 90



def _generated(m, k, n, step):
    """A plan dict whose A (m×k) and B (k×n) are generated (seeds 1, 2), with one `step`, on the
    CPU in 32² tiles."""
    return {
        "matrices": {
            "A": {"path": "A.mgt", "generate": {"rows": m, "cols": k, "seed": 1}},
            "B": {"path": "B.mgt", "generate": {"rows": k, "cols": n, "seed": 2}},
        },
        "step": [step],
        "engine": {"backend": "cpu", "tile": 32},
    }

def test_out_array_is_filled_in_place():
    a, b = rand((M, K), np.float64, 1), rand((K, N), np.float64, 2)
    out = np.full((M, N), np.nan)
    assert mg.matmul(a, b, out=out, **CPU) is out
    close(out, reference(a, b), np.float64)


def test_out_memmap(tmp_path):
    a, b = rand((M, K), np.float32, 1), rand((K, N), np.float32, 2)
    out = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.float32, shape=(M, N))
    mg.matmul(a, b, out=out, **CPU)
    out.flush()
    close(np.load(tmp_path / "c.npy"), reference(a, b), np.float32)


def test_out_npy_file(tmp_path):
    a, b = rand((M, K), np.float32, 3), rand((K, N), np.float32, 4)
    c = mg.matmul(a, b, out=tmp_path / "c.npy", **CPU)
    assert isinstance(c, np.memmap) and not c.flags.writeable
    close(c, reference(a, b), np.float32)
    assert (tmp_path / "c.npy.journal").exists()


def test_out_mgt_file_and_info(tmp_path):
    a, b = rand((M, K), np.float64, 5), rand((K, N), np.float64, 6)
    p = mg.matmul(a, b, out=str(tmp_path / "c.mgt"), **CPU)
    assert p == str(tmp_path / "c.mgt")
    h = mg.info(p, check=True)
    assert (h["rows"], h["cols"], h["dtype"], h["checked"]) == (M, N, "f64", True)
    back = mg.matmul(p, np.eye(N), **CPU)
    close(back, reference(a, b), np.float64)
    # A .npy is told where its description is, not sent to `import` (new-user trial).
    np.save(tmp_path / "c.npy", a)
    with pytest.raises(mg.BadInputError, match=r"is a \.npy array: info\(\) reads \.mgt"):
        mg.info(str(tmp_path / "c.npy"))


def test_second_call_on_complete_output_is_a_no_op(tmp_path):
    a, b = rand((M, K), np.float32, 7), rand((K, N), np.float32, 8)
    notes = []
    mg.matmul(a, b, out=str(tmp_path / "c.mgt"), **CPU)
    kw = dict(CPU, progress=lambda u: None)
    import logging
    handler = logging.Handler()
    handler.emit = lambda rec: notes.append(rec.getMessage())
    logging.getLogger("mgmm_stream").addHandler(handler)
    logging.getLogger("mgmm_stream").setLevel(logging.INFO)
    try:
        mg.matmul(a, b, out=str(tmp_path / "c.mgt"), **kw)
    finally:
        logging.getLogger("mgmm_stream").removeHandler(handler)
    assert any("already complete" in n for n in notes), notes


def test_changed_input_is_not_resumed(tmp_path):
    a, b = rand((M, K), np.float32, 9), rand((K, N), np.float32, 10)
    mg.matmul(a, b, out=str(tmp_path / "c.mgt"), **CPU)
    a[0, 0] += 1
    with pytest.raises(mg.BadInputError, match="restart=True"):
        mg.matmul(a, b, out=str(tmp_path / "c.mgt"), **CPU)
    mg.matmul(a, b, out=str(tmp_path / "c.mgt"), restart=True, **CPU)
    close(mg.matmul(str(tmp_path / "c.mgt"), np.eye(N, dtype=np.float32), **CPU),
          reference(a, b), np.float32)


def _ab_plan(**engine):
    """A 150×80 @ 80×120 plan generating its inputs, on the CPU in 64-tiles (plus `engine`)."""
    return {
        "matrices": {
            "A": {"path": "A.mgt", "generate": {"rows": 150, "cols": 80, "seed": 1}},
            "B": {"path": "B.mgt", "generate": {"rows": 80, "cols": 120, "seed": 2}},
        },
        "step": [{"output": "C.mgt", "expr": "A @ B"}],
        "engine": {"backend": "cpu", "tile": 64, **engine},
    }


def test_run_plan_dict_plan_and_verify(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _ab_plan()
    desc = mg.plan(p)
    assert "step 1" in desc["text"] and desc["steps"][0]["m"] == 150
    assert desc["steps"][0]["tile"] == [64, 64, 64]
    rep = mg.run(p, progress=False)
    assert rep["steps"][0]["tiles_computed"] == rep["steps"][0]["tiles_total"] == 6
    assert rep["plan"] == "<plan dict>" and desc["plan"] == "<plan dict>", (rep["plan"], desc["plan"])
    assert sorted(rep["generated"]) == sorted([str(tmp_path / "A.mgt"), str(tmp_path / "B.mgt")]) \
        or len(rep["generated"]) == 2
    (r,) = mg.verify(p)
    assert r["pass"] is True and r["checked"] is True
    c = mg.matmul("C.mgt", np.eye(120, dtype=np.float32), **CPU)
    a = mg.matmul("A.mgt", np.eye(80, dtype=np.float32), **CPU)
    b = mg.matmul("B.mgt", np.eye(120, dtype=np.float32), **CPU)
    close(c, reference(a, b), np.float32)


def test_verify_of_an_overflowed_output_is_no_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _generated(100, 50, 70, {"output": "C.mgt", "expr": "A @ B", "alpha": 3e38})
    with pytest.warns(RuntimeWarning, match="are NaN/Inf; the inputs are all finite: the product overflowed"):
        rep = mg.run(p, progress=False)
    assert rep["steps"][0]["nonfinite_outputs"] > 0
    (r,) = mg.verify(p)
    assert r["checked"] is False and r["pass"] is False
    assert "nothing checked" in r["reason"]


def test_run_plan_file_with_set(tmp_path):
    plan = tmp_path / "p.toml"
    plan.write_text('[matrices.A]\npath = "A.mgt"\ngenerate = { rows = 64, cols = 64 }\n'
                    '[[step]]\noutput = "C.mgt"\nexpr = "A @ A.T"\n')
    rep = mg.run(plan, set={"backend": "cpu", "host_memory": "64MiB"}, progress=False)
    assert rep["backend"].startswith("cpu") and rep["steps"][0]["host_budget_bytes"] == 64 << 20
    # The CLI's `--set` strings are not what Python takes: said, not an AttributeError.
    with pytest.raises(mg.BadInputError, match="set= is a dict"):
        mg.verify(plan, set=["engine.backend=cpu"])
    # Keys written as on the command line, `engine.` first, are taken as they are meant (the
    # error read `--set engine.engine.host_memory=…`).
    d = mg.plan(plan, set={"engine.backend": "cpu", "engine.host_memory": "32MiB"})
    assert "host_memory 32.00 MiB" in d["text"] and "engine.engine" not in d["text"]
    # An unknown key is named in Python's words, not the command line's `--set engine.…`.
    a = np.ones((4, 4), np.float32)
    for call in (lambda: mg.plan(plan, set={"bogus": 1}),
                 lambda: mg.plan(a, a, engine={"bogus": 1})):
        with pytest.raises(mg.BadInputError) as e:
            call()
        assert "engine setting bogus=1: unknown field" in str(e.value) and "--set" not in str(e.value)


def test_keywords_and_engine_dict_must_agree():
    """A keyword given and the same key in ``engine=`` that disagree are refused, as
    ``precision`` is (``host_memory="2GiB", engine={"host_memory": "1GiB"}`` ran with 1 GiB: a
    new user's trial); agreeing, or only one of them given, is taken."""
    a = rand((M, K), np.float32, 1)
    b = rand((K, N), np.float32, 2)
    for kw, eng in [({"host_memory": "32MiB"}, {"host_memory": "16MiB"}),
                    ({"tile": 32}, {"tile": 64}),
                    ({"threads": 2}, {"threads": 1})]:
        with pytest.raises(mg.BadInputError, match="disagree; give one of them"):
            mg.plan(a, b, backend="cpu", engine=eng, **kw)
    d = mg.plan(a, b, backend="cpu", host_memory="16MiB", engine={"host_memory": "16MiB"})
    assert d["host_memory"] == 16 << 20
    d = mg.plan(a, b, backend="cpu", engine={"host_memory": "16MiB", "tile": 32})
    assert d["host_memory"] == 16 << 20 and d["steps"][0]["tile"] == [32, 32, 32]


def test_plan_of_a_matmul():
    a, b = rand((M, K), np.float32, 1), rand((K, N), np.float32, 2)
    d = mg.plan(a, b, backend="cpu", tile=32, host_memory="16MiB")
    s = d["steps"][0]
    assert (s["m"], s["n"], s["k"], s["tile"]) == (M, N, K, [32, 32, 32])
    assert d["host_memory"] == 16 << 20 and "host ceiling" in d["text"]


def test_plan_of_arrays_describes_memory_not_files(tmp_path):
    """`plan(a, b)` of arrays says they are read from memory, with no output file, no page-cache
    staging and no disk term in its lower bound (it described file reads: a new user's trial);
    with a file input and `out=` a path it describes both files."""
    a, b = rand((M, K), np.float32, 1), rand((K, N), np.float32, 2)
    text = " ".join(mg.plan(a, b, backend="cpu", tile=32)["text"].split())
    assert "from memory (minimum" in text and "reads" in text and "from files" not in text, text
    assert "(in the caller's memory)" in text and "files' pages" not in text, text
    assert "output written with" not in text and "cold disk" not in text, text
    np.save(tmp_path / "a.npy", a)
    text = " ".join(mg.plan(str(tmp_path / "a.npy"), b, backend="cpu", tile=32,
                            out=str(tmp_path / "c.npy"))["text"].split())
    assert "from files and memory (minimum" in text and "output written with" in text, text
    assert "cold disk" in text and "a straight from the files' pages" in text, text


def test_version():
    assert isinstance(mg.__version__, str) and mg.__version__.count(".") == 2


def test_npy_sidecar_is_checked_and_a_rewrite_by_the_package_replaces_it(tmp_path, monkeypatch):
    """A `.npy` written by a plan carries a checksum sidecar, which the package checks when it
    reads the array; a `matmul` that rewrites that array writes it afresh (the package writes
    `.npy` outputs as `run` does), and an array changed by hand is reported with what to do."""
    monkeypatch.chdir(tmp_path)
    a, b = rand((M, K), np.float32, 11), rand((K, N), np.float32, 12)
    np.save("a.npy", a)
    np.save("b.npy", b)
    mg.run({"matrices": {"A": {"path": "a.npy"}, "B": {"path": "b.npy"}},
            "step": [{"output": "C.npy", "expr": "A @ B"}],
            "engine": {"backend": "cpu", "tile": 64}}, progress=False)
    assert (tmp_path / "C.npy.crc32c").exists()
    eye = np.eye(N, dtype=np.float32)
    close(mg.matmul("C.npy", eye, **CPU), reference(a, b), np.float32)
    c = np.load("C.npy", mmap_mode="r+")
    c[0, 0] += 1.0
    c.flush()
    del c
    with pytest.raises(mg.StorageError, match="delete the sidecar"):
        mg.matmul("C.npy", eye, **CPU)
    side = (tmp_path / "C.npy.crc32c").read_bytes()
    mg.matmul(b.T.copy(), a.T.copy(), out="C.npy", restart=True, **CPU)
    assert (tmp_path / "C.npy.crc32c").read_bytes() != side
    close(mg.matmul("C.npy", np.eye(M, dtype=np.float32), **CPU), reference(b.T, a.T),
          np.float32)


def test_restart_keeps_a_finished_output_when_an_input_is_now_corrupt(tmp_path):
    """matmul(out=..., restart=True) over a finished output whose .mgt input was corrupted in
    place since (its identity unchanged) raises StorageError naming the tile and leaves the
    output as it was, as `run --restart` does; once the input is put back, nothing is computed."""
    mg.run({"matrices": {"A": {"path": str(tmp_path / "A.mgt"), "generate": {"rows": 130, "cols": 70}},
                         "B": {"path": str(tmp_path / "B.mgt"), "generate": {"rows": 70, "cols": 90}}},
            "step": [{"output": str(tmp_path / "X.mgt"), "expr": "A @ B"}],
            "engine": {"backend": "cpu", "tile": 64}}, progress=False)
    a, b, d = str(tmp_path / "A.mgt"), str(tmp_path / "B.mgt"), str(tmp_path / "D.mgt")
    mg.matmul(a, b, out=d, **CPU)
    kept = open(d, "rb").read()
    info = mg.info(b)
    off = info["data_offset"] + 8
    with open(b, "r+b") as f:
        f.seek(off)
        x = f.read(1)
        f.seek(off)
        f.write(bytes([x[0] ^ 1]))
    with pytest.raises(mg.StorageError, match=r"checksum mismatch in tile \(0, 0\).*the restart stopped before touching"):
        mg.matmul(a, b, out=d, restart=True, **CPU)
    assert open(d, "rb").read() == kept
    with open(b, "r+b") as f:
        f.seek(off)
        f.write(x)
    mg.matmul(a, b, out=d, restart=True, **CPU)
    assert open(d, "rb").read() == kept


def test_a_quick_call_prints_one_progress_line(monkeypatch, capfd):
    """Plain progress lines (no tqdm): a call of milliseconds prints its finished line only,
    not a 0 % line right before it (a new user saw two lines for a 5 ms call)."""
    import sys
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    a, b = rand((70, 50)), rand((50, 90), seed=1)
    mg.matmul(a, b, backend="cpu", tile=64, progress=True)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if " tiles (" in ln]
    assert len(lines) == 1, lines
    assert lines[0].split(": ")[1].startswith("4/4 tiles (100.0%)"), lines


def test_the_summary_says_arrays_were_read_not_files(caplog):
    """Arrays handed in are not files: the summary's inputs line says so."""
    import logging
    a, b = rand((70, 50)), rand((50, 90), seed=1)
    with caplog.at_level(logging.INFO, logger="mgmm_stream"):
        mg.matmul(a, b, **CPU)
    text = " ".join(caplog.text.split())
    assert "from arrays" in text and "from files" not in text, text


def test_the_summary_of_an_array_output_names_no_factor_of_one_and_no_flush(caplog):
    """An array output's summary reads `out (array) = a @ b` (the factor written only when it
    is not 1), or `result (new array) = …` for the array the call allocates (`out=None`), and
    has no flush time (flush is said of files); a plan dict's report names it `<plan dict>`,
    not a file in the current directory (new users' trials)."""
    import logging
    a, b = rand((70, 50)), rand((50, 90), seed=1)
    for alpha, out, head in ((1.0, None, "result (new array) = a @ b"),
                             (2.0, np.empty((70, 90), np.float32), "out (array) = 2 * a @ b")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mgmm_stream"):
            mg.matmul(a, b, out=out, alpha=alpha, **CPU)
        text = caplog.text
        assert head in text, text
        wall = [ln for ln in text.splitlines() if " wall " in ln]
        assert wall and "(memory)" in wall[0] and "flush" not in wall[0], wall


def test_mgmm_trace_writes_the_calls_timeline(tmp_path):
    """MGMM_TRACE=PATH records a call's timeline as the command line does (stages, start-up),
    written when the call returns; in a process of its own (the timeline is the process's)."""
    import json
    import os
    import subprocess
    import sys
    trace = tmp_path / "t.json"
    code = ("import numpy as np, mgmm_stream as mg\n"
            "a = np.ones((300, 200), np.float32); b = np.ones((200, 100), np.float32)\n"
            "c = mg.matmul(a, b, backend='cpu', tile=64, progress=False)\n"
            "assert float(c[0, 0]) == 200.0\n")
    env = dict(os.environ, MGMM_TRACE=str(trace))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans and "planner" in tracks, sorted(tracks)


def test_the_last_progress_update_of_a_quick_call_has_its_rate():
    """A call too short for the windowed rate still ends with the step's average rate (it
    reported 0.0 GFLOP/s)."""
    seen = []
    a, b = rand((70, 50)), rand((50, 90), seed=1)
    mg.matmul(a, b, backend="cpu", tile=64, progress=seen.append)
    last = seen[-1]
    assert last["finished"] and last["tiles_done"] == last["tiles_total"], last
    assert last["gflops_per_s"] > 0.0, last


def test_calls_with_the_same_settings_reuse_the_backend_until_empty_cache(tmp_path, monkeypatch):
    """The backend one call leaves (on GPUs: contexts, cuBLAS, page-locked pools) serves the
    next call with the same backend settings; the report says so, and the bytes are the same.
    Other settings start their own; empty_cache() lets it go."""
    monkeypatch.chdir(tmp_path)
    p = _ab_plan(durable=False)
    mg.empty_cache()
    assert mg.empty_cache() is False, "nothing kept after empty_cache()"
    first = mg.run(p, progress=False)["steps"][0]
    assert first["backend_reused"] is False
    again = mg.run(p, restart=True, progress=False)["steps"][0]
    assert again["backend_reused"] is True
    c1 = mg.matmul("A.mgt", "B.mgt", **CPU)
    c2 = mg.matmul("A.mgt", "B.mgt", **CPU)
    assert np.array_equal(c1, c2)
    other = mg.run(p, restart=True, set={"threads": 1}, progress=False)["steps"][0]
    assert other["backend_reused"] is False, "other settings, another backend"
    assert mg.empty_cache() is True
    after = mg.run(p, restart=True, set={"threads": 1}, progress=False)["steps"][0]
    assert after["backend_reused"] is False
    mg.empty_cache()


def test_nan_in_an_input_warns_naming_the_input():
    """NaN/Inf reaching the result is a RuntimeWarning (as numpy's invalid values are), naming
    the input that held them; the counts are the values' (each block once); a product of
    finite arrays warns nothing (new-user trial: at logging's WARNING level a NaN product
    returned without a word)."""
    a, b = rand((70, 50), seed=3), rand((50, 90), seed=4)
    a[12, 7] = np.nan
    with pytest.warns(RuntimeWarning, match=r"90 of the 6300 elements of result \(new array\) "
                                            r"are NaN/Inf; the inputs hold NaN/Inf \(1 in a\)"):
        c = mg.matmul(a, b, **CPU)
    assert np.isnan(c[12]).all() and np.isfinite(np.delete(c, 12, axis=0)).all()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mg.matmul(rand((70, 50), seed=3), b, **CPU)


def test_a_matmul_file_output_verifies_against_the_plan_a_user_writes(tmp_path, monkeypatch):
    """`matmul(…, out="C.npy")` journals its product as `2 * a.T @ b`; a plan naming the same
    files `A` and `B` with `expr = "A.T @ B"` and `alpha = 2.0` verifies it (the scale is the
    alpha entry's and the names are the plan's: `1 * a @ b` against `A @ B` failed, new-user
    trials), and one with another alpha does not."""
    monkeypatch.chdir(tmp_path)
    np.save("A.npy", rand((200, 70), seed=5))
    np.save("B.npy", rand((200, 90), seed=6))
    mg.matmul("A.npy", "B.npy", out="C.npy", alpha=2.0, trans_a=True, **CPU)
    plan = {"matrices": {"A": {"path": "A.npy"}, "B": {"path": "B.npy"}},
            "step": [{"output": "C.npy", "expr": "A.T @ B", "alpha": 2.0}],
            "engine": {"backend": "cpu"}}
    (r,) = mg.verify(plan)
    assert r["pass"] and r["reason"] is None, r
    plan["step"][0]["alpha"] = 3.0
    (r,) = mg.verify(plan)
    assert not r["pass"] and "alpha" in r["reason"], r


def test_verify_reason_of_a_changed_plan_says_restart_true(tmp_path, monkeypatch):
    # A verify dict's reason is worded for Python (`restart=True`), as its errors are, not with
    # the command line's `run --restart` (new-user trial).
    monkeypatch.chdir(tmp_path)
    p = {
        "matrices": {
            "A": {"path": "A.mgt", "generate": {"rows": 40, "cols": 30, "seed": 1}},
            "B": {"path": "B.mgt", "generate": {"rows": 30, "cols": 20, "seed": 2}},
        },
        "step": [{"output": "C.mgt", "expr": "A @ B", "alpha": 2.0}],
        "engine": {"backend": "cpu", "tile": 16},
    }
    mg.run(p, progress=False)
    p["step"][0]["alpha"] = 3.0
    (r,) = mg.verify(p)
    assert r["pass"] is False
    text = str(r)
    assert "restart=True" in text and "run --restart" not in text, text


def test_trace_never_replaces_the_calls_own_files(tmp_path, monkeypatch):
    # MGMM_TRACE naming the output (or an input) replaced the result with the timeline, and the
    # journal still said the step was complete (new-user trial): refused before any work.
    monkeypatch.chdir(tmp_path)
    a, b = rand((40, 30), seed=1), rand((30, 20), seed=2)
    np.save("A.npy", a)
    np.save("B.npy", b)
    for trace, role in (("D.npy", "the output of step 1"), ("A.npy", "the matrix `a`")):
        monkeypatch.setenv("MGMM_TRACE", trace)
        with pytest.raises(mg.BadInputError, match=f"MGMM_TRACE={trace}: that is {role}"):
            mg.matmul("A.npy", "B.npy", out="D.npy", **CPU)
    assert not os.path.exists("D.npy")
    close(np.load("A.npy"), a, np.float32)
    monkeypatch.setenv("MGMM_TRACE", "E.npy")
    plan = {"matrices": {"A": {"path": "A.npy"}, "B": {"path": "B.npy"}},
            "step": [{"output": "E.npy", "expr": "A @ B"}], "engine": {"backend": "cpu"}}
    with pytest.raises(mg.BadInputError, match="that is the output of step 1"):
        mg.run(plan, progress=False)
    monkeypatch.setenv("MGMM_TRACE", "t.json")
    mg.matmul("A.npy", "B.npy", out="D.npy", **CPU)
    close(np.load("D.npy"), reference(a, b), np.float32)
    assert os.path.getsize("t.json") > 0


def test_verify_of_an_output_changed_after_it_was_written_names_the_checksums(tmp_path, monkeypatch):
    # A changed .npy output fails by its stored checksums: its dict's reason was None, then
    # spoke of residuals with a ratio of 0 (trials). A 0-d array is a number in a plan dict.
    monkeypatch.chdir(tmp_path)
    p = _generated(64, 48, 64, {"output": "C.npy", "expr": "A @ B", "alpha": np.array(2.0)})
    mg.run(p, progress=False)
    c = np.memmap("C.npy", dtype=np.float32, mode="r+", offset=4096, shape=(64, 64))
    c[40, 50] += 1.0
    c.flush()
    del c
    (r,) = mg.verify(p)
    assert r["pass"] is False and r["corrupt_tiles"] >= 1, r
    assert "no longer match the checksums" in r["reason"] and "restart=True" in r["reason"], r


def test_a_fortran_npy_paths_output_is_the_plans_and_verifies(tmp_path, monkeypatch):
    # matmul with a Fortran-order .npy path journaled `2 * a @ b.T` where a plan over the same
    # files says `A @ BF`: each refused the other's finished output and verify with the plan
    # failed (new-user trial). The plan now finds the step complete, and it verifies.
    monkeypatch.chdir(tmp_path)
    a, b = rand((60, 40), seed=1), rand((40, 50), seed=2)
    np.save("A.npy", a)
    np.save("BF.npy", np.asfortranarray(b))
    mg.matmul("A.npy", "BF.npy", out="C.npy", alpha=2.0, **CPU)
    close(np.load("C.npy"), 2.0 * reference(a, b), np.float32)
    plan = {"matrices": {"A": {"path": "A.npy"}, "BF": {"path": "BF.npy"}},
            "step": [{"output": "C.npy", "expr": "A @ BF", "alpha": 2.0}],
            "engine": {"backend": "cpu"}}
    (r,) = mg.verify(plan)
    assert r["pass"] is True, r
    before = os.stat("C.npy").st_mtime_ns
    rep = mg.run(plan, progress=False)
    assert rep["steps"] == [] and os.stat("C.npy").st_mtime_ns == before, rep
    # And the other way: the plan's output, asked for again from Python, is found complete.
    np.save("AF.npy", np.asfortranarray(a))
    plan["matrices"]["A"]["path"] = "AF.npy"
    plan["step"][0]["output"] = "D.npy"
    mg.run(plan, progress=False)
    before = os.stat("D.npy").st_mtime_ns
    mg.matmul("AF.npy", "BF.npy", out="D.npy", alpha=2.0, **CPU)
    assert os.stat("D.npy").st_mtime_ns == before, "computed again"
    close(np.load("D.npy"), 2.0 * reference(a, b), np.float32)


def test_a_fortran_npy_as_path_or_memmap_journals_what_was_asked(tmp_path, monkeypatch):
    # The same product from a Fortran-order .npy as a path and as a memmap of the whole file
    # shares one journal (the second call finds it complete); a memmap passed with trans_a=True
    # is another product, refused over the first's output, never handed it (cold review).
    monkeypatch.chdir(tmp_path)
    x, b = rand((48, 48), seed=1), rand((48, 40), seed=2)
    np.save("AF.npy", np.asfortranarray(x))
    np.save("B.npy", b)
    mg.matmul("AF.npy", "B.npy", out="C.npy", **CPU)
    close(np.load("C.npy"), reference(x, b), np.float32)
    before = os.stat("C.npy").st_mtime_ns
    m = np.load("AF.npy", mmap_mode="r")
    mg.matmul(m, "B.npy", out="C.npy", **CPU)
    assert os.stat("C.npy").st_mtime_ns == before, "the same product was computed again"
    with pytest.raises(mg.BadInputError, match="expr"):
        mg.matmul(m, "B.npy", out="C.npy", trans_a=True, **CPU)
    close(np.load("C.npy"), reference(x, b), np.float32)
    mg.matmul(m, "B.npy", out="D.npy", trans_a=True, **CPU)
    close(np.load("D.npy"), reference(x.T.copy(), b), np.float32)
