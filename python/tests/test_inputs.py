"""Results against numpy in f64 for every input kind, dtype and transpose."""

import numpy as np
import pytest

import mgmm_stream as mg
from conftest import CPU, close, rand, reference, to_mgt

# Shapes straddle the 64-element test tile: m = 130, k = 67, n = 129.
M, K, N = 130, 67, 129


def make(kind, x, tmp_path, name):
    """x as the given input kind."""
    if kind == "ndarray":
        return x
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "row_view":  # rows strided, columns contiguous: read in place
        big = np.zeros((x.shape[0] * 2, x.shape[1] + 3), x.dtype)
        big[::2, 1:-2] = x
        return big[::2, 1:-2]
    if kind in ("memmap_c", "memmap_f"):
        order = "C" if kind == "memmap_c" else "F"
        path = tmp_path / f"{name}.{order}.raw"
        m = np.memmap(path, dtype=x.dtype, mode="w+", shape=x.shape, order=order, offset=0)
        m[:] = x
        m.flush()
        return np.memmap(path, dtype=x.dtype, mode="r", shape=x.shape, order=order)
    if kind == "memmap_offset":  # a region after a header, as in a .npy file
        path = tmp_path / f"{name}.npy"
        np.save(path, x)
        return np.load(path, mmap_mode="r")
    if kind in ("npy_path", "npy_path_f", "memmap_npy_f"):
        path = tmp_path / f"{name}.npy"
        np.save(path, x if kind == "npy_path" else np.asfortranarray(x))
        return str(path) if kind != "memmap_npy_f" else np.load(path, mmap_mode="r")
    if kind == "mgt_path":
        return to_mgt(x, tmp_path / f"{name}.mgt")
    raise AssertionError(kind)


KINDS = ["ndarray", "fortran", "row_view", "memmap_c", "memmap_f", "memmap_offset",
         "npy_path", "npy_path_f", "memmap_npy_f", "mgt_path"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_kind_against_numpy(kind, dtype, tmp_path):
    a, b = rand((M, K), dtype, 1), rand((K, N), dtype, 2)
    c = mg.matmul(make(kind, a, tmp_path, "a"), make(kind, b, tmp_path, "b"), **CPU)
    assert c.shape == (M, N) and c.dtype == dtype
    close(c, reference(a, b), dtype)


@pytest.mark.parametrize("ta,tb", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("kind", ["ndarray", "fortran", "memmap_f", "npy_path_f", "mgt_path"])
def test_transposes(kind, ta, tb, tmp_path):
    a = rand((K, M) if ta else (M, K), np.float64, 3)
    b = rand((N, K) if tb else (K, N), np.float64, 4)
    c = mg.matmul(make(kind, a, tmp_path, "a"), make(kind, b, tmp_path, "b"),
                  trans_a=ta, trans_b=tb, alpha=-0.5, **CPU)
    close(c, reference(a, b, ta, tb, -0.5), np.float64)


def test_float16_inputs_give_float32():
    a, b = rand((M, K), np.float16, 5), rand((K, N), np.float16, 6)
    c = mg.matmul(a, b, **CPU)
    assert c.dtype == np.float32
    close(c, reference(a, b), np.float16)


def test_mixed_kinds(tmp_path):
    a, b = rand((M, K), np.float32, 7), rand((K, N), np.float32, 8)
    c = mg.matmul(make("memmap_f", a, tmp_path, "a"), make("mgt_path", b, tmp_path, "b"), **CPU)
    close(c, reference(a, b), np.float32)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    a, b = rand((M, K), np.float32, 9), rand((K, N), np.float32, 10)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b).t().contiguous().t()
    ta.requires_grad_(True)
    c = mg.matmul(ta, tb, **CPU)
    close(c, reference(a, b), np.float32)
    out = torch.empty((M, N), dtype=torch.float32)
    assert mg.matmul(ta, tb, out=out, **CPU) is out
    close(out.numpy(), reference(a, b), np.float32)


def test_default_settings_run():
    """No engine keywords at all: backend auto (CPU here), default tile and memory."""
    a, b = rand((50, 40), np.float64, 11), rand((40, 30), np.float64, 12)
    close(mg.matmul(a, b, progress=False), reference(a, b), np.float64)


@pytest.mark.parametrize("kind", ["npy_path", "npy_path_f", "memmap_c", "memmap_f",
                                  "memmap_offset", "memmap_npy_f", "mgt_path"])
def test_file_inputs_skip_the_staging_copy(kind, tmp_path):
    """Files given as paths or memmaps reach the lanes straight from their pages (on the CPU
    the lanes copy from the map themselves), like a plan's inputs; with staging = "copy"
    nothing goes that way. The report is the step report `matmul` does not return."""
    a, b = rand((M, K), np.float32, 5), rand((K, N), np.float32, 6)
    x, y = make(kind, a, tmp_path, "a"), make(kind, b, tmp_path, "b")
    for staging, direct in (("auto", True), ("copy", False)):
        settings = mg._settings("cpu", "all", None, None, 0, [64, 64, 64], {"staging": staging})
        job, keep = mg._prepare(x, y, 1.0, False, False, None, settings)
        desc, c = mg._output(job, None, None)
        rep = job.run(desc, False, None, None, 1.0)
        close(c, reference(a, b), np.float32)
        # Every element of both inputs goes through at least once.
        assert (rep["direct_bytes"] >= (M * K + K * N) * 4) == direct, (staging, rep["direct_bytes"])
        assert direct or rep["direct_bytes"] == 0


def test_memmap_of_a_replaced_or_removed_file_reads_what_it_maps(tmp_path):
    """A memmap keeps the data it mapped when its file is replaced (a re-save, os.replace) or
    removed; the engine must not reopen the path and read the new file instead."""
    import os
    a, b = rand((M, K), np.float32, 7), rand((K, N), np.float32, 8)
    p = tmp_path / "r.npy"
    np.save(p, a)
    mm = np.load(p, mmap_mode="r")
    np.save(tmp_path / "new.npy", np.ones_like(a))
    os.replace(tmp_path / "new.npy", p)
    close(mg.matmul(mm, b, **CPU), reference(a, b), np.float32)
    os.remove(p)
    close(mg.matmul(mm, b, **CPU), reference(a, b), np.float32)


@pytest.mark.parametrize("alpha, words", [(float("nan"), "alpha = NaN; use a finite number"),
                                          (float("inf"), "alpha = inf; use a finite number"),
                                          (1e39, "outside f32's normal range"),
                                          (1e-50, "outside f32's normal range")])
def test_alpha_that_is_not_finite_or_out_of_f32s_range_is_refused(alpha, words):
    # As the CLI refuses such a coefficient in a plan; it used to give NaN/Inf results with a
    # warning that blamed overflow (new-user trial).
    a = np.ones((4, 4), np.float32)
    with pytest.raises(mg.BadInputError, match=words):
        mg.matmul(a, a, alpha=alpha, **CPU)
    # f64 inputs take any finite alpha.
    c = mg.matmul(a.astype(np.float64), a.astype(np.float64), alpha=1e-50, **CPU)
    assert c[0, 0] == pytest.approx(4e-50)


def test_alpha_zero_gives_zeros_as_blas_does_even_with_nan_in_an_input():
    # BLAS's rule (docs/PLAN.md): alpha = 0 does not use the product, so NaN in `a` does not
    # reach the output (numpy's 0 * (a @ b) would carry it).
    a, b = rand((64, 48), seed=1), rand((48, 32), seed=2)
    a[3, 5] = np.nan
    c = mg.matmul(a, b, alpha=0.0, **CPU)
    assert c.shape == (64, 32) and (c == 0).all()
