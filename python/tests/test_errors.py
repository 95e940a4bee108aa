"""Bad inputs raise clear errors of the right class; nothing is computed."""

import numpy as np
import pytest

import mgmm_stream as mg
from conftest import CPU, rand


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
    with pytest.raises(mg.BadInputError, match="C-contiguous"):
        mg.matmul(a, b, out=np.empty((4, 10), np.float32).T, **CPU)
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
