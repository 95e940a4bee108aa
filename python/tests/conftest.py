"""Shared helpers: seeded inputs, the f64 reference, and engine settings that make small
shapes cross several tiles (tile 64) on the CPU backend."""

import numpy as np
import pytest

import mgmm_stream as mg

CPU = dict(backend="cpu", tile=64, progress=False)


def rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reference(a, b, trans_a=False, trans_b=False, alpha=1.0):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b))


def close(c, ref, dtype):
    """Within the rounding a product of this input dtype has (k ≤ a few hundred here)."""
    tol = {np.float64: 1e-10, np.float32: 2e-4, np.float16: 2e-2}[np.dtype(dtype).type]
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(np.asarray(c, dtype=np.float64) - ref).max())
    assert err <= tol * scale, f"max error {err} > {tol * scale}"


def to_mgt(x, path):
    """Write x (f32/f64) as a .mgt file through the API: x @ I is exact."""
    eye = np.eye(x.shape[1], dtype=x.dtype)
    mg.matmul(x, eye, out=str(path), **CPU)
    return str(path)


@pytest.fixture
def cpu():
    return dict(CPU)
