"""mgmm_stream.dask on a dask.distributed LocalCluster (CPU backend, worker processes): the
result is the bytes one process writes, a worker killed mid-shard ends in the same bytes after
Dask retries the shard (resumed from its journal, not recomputed), and arrays that are not
file-backed are refused with a message saying how to save them. CI installs dask and sets
MGMM_REQUIRE_DASK=1, so these run there rather than skip."""

import os

import numpy as np
import pytest

import mgmm_stream as mg

if os.environ.get("MGMM_REQUIRE_DASK") != "1":
    pytest.importorskip("distributed")
import dask  # noqa: E402
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import mgmm_stream.dask as mgd  # noqa: E402

from conftest import close, rand, reference  # noqa: E402

SETTINGS = dict(backend="cpu", tile=64)


@pytest.fixture(scope="module")
def cluster_client():
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=40)
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture
def client(cluster_client):
    """The module's client, once both workers are up: a test that kills a worker (the injected
    faults) leaves its Nanny restarting it, and on a loaded machine the next test started while
    the cluster had no worker (`matmul` then refuses: "no workers yet"; seen on the loaded
    development box, 2026-12-06)."""
    cluster_client.wait_for_workers(2, timeout=120)
    return cluster_client


def one_process(tmp_path, a_path, b_path, expr="A @ B", **engine):
    """The same product as one `mgmm-stream run` (the CLI's code path), for its bytes."""
    out = str(tmp_path / "one.npy")
    plan = {"matrices": {"A": {"path": a_path}, "B": {"path": b_path}},
            "step": [{"output": out, "expr": expr}],
            "engine": {"backend": "cpu", "tile": 64, **engine}}
    mg.run(plan, progress=False)
    return out


def save(tmp_path, name, x):
    p = str(tmp_path / name)
    np.save(p, x)
    return p


def test_result_is_the_bytes_one_process_writes(client, tmp_path):
    a, b = rand((300, 200), seed=1), rand((200, 170), seed=2)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    A = mgd.from_npy(pa, chunks=(100, 200))
    B = mgd.from_npy(pb, chunks=(200, 85))
    out = str(tmp_path / "C.npy")
    C = mgd.matmul(A, B, out=out, shards=3, **SETTINGS)
    assert C.shape == (300, 170) and C.chunks == ((100, 100, 100), (85, 85))
    with open(out, "rb") as f, open(one_process(tmp_path, pa, pb), "rb") as g:
        assert f.read() == g.read(), "differs from one process's output"
    assert os.path.exists(out + ".crc32c")
    close(C.compute(), reference(a, b), np.float32)
    # A second call finds the output finished and computes nothing.
    rep = mgd.matmul(A, B, out=out, shards=3, report=True, **SETTINGS)
    assert sum(s["tiles_computed"] for r in rep["reports"] for s in r["steps"]) == 0


def test_transposes_paths_memmaps_alpha_and_float64(client, tmp_path):
    a, b = rand((130, 70), np.float64, seed=3), rand((90, 70), np.float64, seed=4)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    raw = str(tmp_path / "B.f64")
    b.tofile(raw)
    Braw = np.memmap(raw, dtype=np.float64, mode="r", shape=(90, 70))
    out = str(tmp_path / "C.npy")
    C = mgd.matmul(pa, mgd.from_npy(raw_npy := save(tmp_path, "B2.npy", b)).T, out=out,
                   alpha=0.5, **SETTINGS)
    close(C.compute(), reference(a, b, trans_b=True, alpha=0.5), np.float64)
    C2 = mgd.matmul(mgd.from_npy(pa), Braw, out=str(tmp_path / "C2.npy"), trans_b=True,
                    alpha=0.5, **SETTINGS)
    assert np.array_equal(C2.compute(), np.load(out)), raw_npy


def test_a_worker_killed_mid_shard_ends_in_the_same_bytes(client, tmp_path):
    a, b = rand((1024, 512), seed=5), rand((512, 1024), seed=6)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    out = str(tmp_path / "C.npy")
    marker = str(tmp_path / "killed-once")
    rep = mgd.matmul(pa, pb, out=out, shards=2, report=True, **SETTINGS,
                     _fault={"shard": 0, "after_tiles": 8, "marker": marker})
    assert os.path.exists(marker), "the fault was never armed"
    with open(out, "rb") as f, open(one_process(tmp_path, pa, pb), "rb") as g:
        assert f.read() == g.read(), "differs from one process's output after the retry"
    computed = sum(s["tiles_computed"] for r in rep["reports"] for s in r["steps"])
    total = 16 * 16
    assert computed < total, f"the retried shard recomputed everything ({computed} of {total})"
    close(np.load(out), reference(a, b), np.float32)


def test_arrays_not_backed_by_files_are_refused(client, tmp_path):
    pa = save(tmp_path, "A.npy", rand((64, 64)))
    out = str(tmp_path / "C.npy")
    computed = da.random.random((64, 64), chunks=32).astype(np.float32)
    with pytest.raises(mg.BadInputError, match=r"not read from one file.*to_npy\(b"):
        mgd.matmul(pa, computed, out=out, **SETTINGS)
    with pytest.raises(mg.BadInputError, match=r"a numpy array in memory.*np.save"):
        mgd.matmul(np.ones((64, 64), np.float32), pa, out=out, **SETTINGS)
    with pytest.raises(mg.BadInputError, match=r"'getitem'.*to_npy\(a"):
        mgd.matmul(mgd.from_npy(pa)[:32], pa, out=out, **SETTINGS)
    # dask.array.from_array copies a memmap into memory (dask 2026.8 does): said, with the
    # way that reads the file; a dask that keeps the map has it read from its file.
    mapped = da.from_array(np.load(pa, mmap_mode="r"), chunks=32)
    orig = next(iter(dict(next(v for k, v in mapped.dask.layers.items()
                               if k.startswith("original-"))).values()))
    if getattr(orig, "_mmap", None) is None:
        with pytest.raises(mg.BadInputError, match=r"in-memory copy of a memmap.*from_npy"):
            mgd.matmul(mapped, pa, out=out, **SETTINGS)
    else:
        close(mgd.matmul(mapped, pa, out=out, **SETTINGS).compute(),
              reference(np.load(pa), np.load(pa)), np.float32)
        os.remove(out)
    with pytest.raises(mg.BadInputError, match=r"\.npy or \.mgt"):
        mgd.matmul(pa, pa, out=str(tmp_path / "C.bin"), **SETTINGS)
    # Shapes that do not chain are said with the operands as written (a new user's try named
    # b "A" and showed two equal shapes).
    wide = save(tmp_path, "W.npy", rand((64, 40)))
    with pytest.raises(mg.BadInputError, match=r"a is 64×40 but b is 64×40 \(inner dimensions 40 ≠ 64\)"):
        mgd.matmul(wide, wide, out=out, **SETTINGS)
    with pytest.raises(mg.BadInputError, match=r"a\.T is 40×64 but b\.T is 40×64"):
        mgd.matmul(mgd.from_npy(wide, chunks=32), wide, out=out, trans_a=True, trans_b=True, **SETTINGS)
    assert not os.path.exists(out)
    # What the message says to do works: to_npy from the workers, then the product.
    saved = mgd.to_npy(computed, str(tmp_path / "B.npy"))
    C = mgd.matmul(pa, saved, out=out, **SETTINGS)
    close(C.compute(), reference(np.load(pa), computed.compute()), np.float32)


def test_transposed_operands_chunk_the_result_by_op_rows_and_columns(client, tmp_path):
    y = rand((700, 900), seed=7)
    py = save(tmp_path, "Y.npy", y)
    Y = mgd.from_npy(py, chunks=(300, 400))
    C = mgd.matmul(Y, Y.T, out=str(tmp_path / "YY.npy"), **SETTINGS)
    assert C.shape == (700, 700) and C.chunks == ((300, 300, 100), (300, 300, 100))
    close(C.compute(), reference(y, y, trans_b=True), np.float32)
    # A whole-file memmap's .T is that file read transposed, as from_npy(p).T is.
    m = np.load(py, mmap_mode="r")
    D = mgd.matmul(m.T, m, out=str(tmp_path / "D.npy"), **SETTINGS)
    assert D.shape == (900, 900)
    close(D.compute(), reference(y, y, trans_a=True), np.float32)


def test_a_shard_that_raises_is_retried_at_once(client, tmp_path):
    """The failed attempt gives its shard's claim back (the worker lives on), so Dask's retry
    does not wait the claim timeout (120 s) for it to go stale."""
    import time

    a, b = rand((512, 256), seed=8), rand((256, 512), seed=9)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    out = str(tmp_path / "C.npy")
    marker = str(tmp_path / "raised-once")
    t0 = time.monotonic()
    rep = mgd.matmul(pa, pb, out=out, shards=2, report=True, **SETTINGS,
                     _fault={"shard": 0, "after_tiles": 4, "marker": marker, "raise": True})
    took = time.monotonic() - t0
    assert os.path.exists(marker), "the fault was never armed"
    assert took < 60, f"the retry waited for the claim to go stale ({took:.0f} s)"
    with open(out, "rb") as f, open(one_process(tmp_path, pa, pb), "rb") as g:
        assert f.read() == g.read()
    assert sum(s["tiles_computed"] for r in rep["reports"] for s in r["steps"]) < 64


def test_a_finished_output_that_is_gone_or_replaced_is_computed_again(client, tmp_path):
    a, b = rand((200, 100), seed=10), rand((100, 150), seed=11)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    out = str(tmp_path / "C.npy")
    mgd.matmul(pa, pb, out=out, **SETTINGS)
    clean = open(out, "rb").read()
    os.remove(out)
    mgd.matmul(pa, pb, out=out, **SETTINGS)
    assert open(out, "rb").read() == clean
    np.save(out, np.zeros((200, 150), np.float32))  # another array under the same name
    C = mgd.matmul(pa, pb, out=out, **SETTINGS)
    assert open(out, "rb").read() == clean
    close(C.compute(), reference(a, b), np.float32)


def test_from_npy_names_each_chunking_apart_and_to_npy_keeps_its_input(client, tmp_path):
    a = rand((512, 256), seed=12)
    pa = save(tmp_path, "A.npy", a)
    A1, A2 = mgd.from_npy(pa, chunks=(512, 256)), mgd.from_npy(pa, chunks=(256, 256))
    assert A1.name != A2.name
    s1, s2 = dask.compute(A1.sum(), A2.sum())
    assert np.isclose(s1, a.sum(dtype=np.float64), rtol=1e-4)
    assert np.isclose(s2, a.sum(dtype=np.float64), rtol=1e-4)
    with pytest.raises(mg.BadInputError, match="would overwrite"):
        mgd.to_npy(A1 * 2, pa)
    assert np.array_equal(np.load(pa), a), "the input was changed"
    with pytest.raises(mg.BadInputError, match="np.save"):
        mgd.matmul(np.load(pa, mmap_mode="r")[:100], pa, out=str(tmp_path / "X.npy"), **SETTINGS)


def test_host_memory_defaults_to_a_quarter_of_the_workers_memory_limit(client, tmp_path):
    a, b = rand((130, 70), seed=5), rand((70, 90), seed=6)
    pa, pb = save(tmp_path, "A.npy", a), save(tmp_path, "B.npy", b)
    limits = [w["memory_limit"] for w in client.scheduler_info()["workers"].values()]
    want = max(64 << 20, min(limits) // 4)
    rep = mgd.matmul(pa, pb, out=str(tmp_path / "C.npy"), report=True, **SETTINGS)
    budgets = {s["host_budget_bytes"] for r in rep["reports"] for s in r["steps"]}
    assert budgets == {want}, (budgets, limits)
    # Given, it is what the caller said.
    rep = mgd.matmul(pa, pb, out=str(tmp_path / "D.npy"), report=True, host_memory="1GiB",
                     **SETTINGS)
    assert {s["host_budget_bytes"] for r in rep["reports"] for s in r["steps"]} == {1 << 30}


def test_the_default_host_memory_is_a_quarter_of_the_smallest_limit_and_none_without_one():
    from mgmm_stream.dask import _worker_host_memory

    gib = 1 << 30
    workers = {f"w{i}": {"memory_limit": (40 + i) * gib} for i in range(7)}
    assert _worker_host_memory(workers) == 10 * gib
    workers["small"] = {"memory_limit": 300 << 20}
    assert _worker_host_memory(workers) == 75 << 20
    workers["tiny"] = {"memory_limit": 1 << 20}
    assert _worker_host_memory(workers) == 64 << 20
    workers["unlimited"] = {"memory_limit": 0}
    assert _worker_host_memory(workers) is None
    assert _worker_host_memory({}) is None
