"""Arrays already on the GPU (issue 36 part 2): CUDA torch tensors and CuPy arrays read in
place (device to device), results written into GPU arrays or kept on the GPU when they fit,
the caller's stream waited for. These are the CUDA twins: they run where torch (or CuPy) sees a
GPU, and are skipped elsewhere; CI (no GPU) runs the refusals in test_errors.py. Every result
is judged element by element against an f64 product, within (k + 2)·u·(|A||B|)."""

import os

import numpy as np
import pytest

import mgmm_stream as mg

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)

# Small tiles so that every shape below straddles tile edges on the GPU as well.
GPU = dict(backend="cuda", devices=[0], tile=128, progress=False)
U = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def within_bound(c, a, b, dtype=torch.float32):
    """Every element of c within (k + 2)·u·(|A||B|)_ij of the f64 product (on the GPU)."""
    c = torch.as_tensor(np.asarray(c)) if not torch.is_tensor(c) else c
    a64, b64 = a.to("cuda", torch.float64), b.to("cuda", torch.float64)
    ref = a64 @ b64
    bound = (a.shape[1] + 2) * U[dtype] * (a64.abs() @ b64.abs())
    err = (c.to("cuda", torch.float64) - ref).abs()
    # NaN (an element never written: outputs below start as NaN) fails too.
    bad = int((~(err <= bound)).sum())
    assert bad == 0, f"{bad} elements outside (k+2)u|A||B|, worst ratio {float((err / bound).max())}"


def randn(m, n, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, n, device="cuda", dtype=dtype, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_times_cuda_stays_on_the_gpu(dtype):
    a, b = randn(301, 259, dtype, 1), randn(259, 177, dtype, 2)
    c = mg.matmul(a, b, **GPU)
    assert torch.is_tensor(c) and c.is_cuda and c.dtype == dtype and c.shape == (301, 177)
    within_bound(c, a, b, dtype)


def test_cuda_times_numpy_and_transposed_views():
    a = randn(259, 301, seed=3)  # read as a.T: Fortran order, in place
    b = np.random.default_rng(4).standard_normal((259, 177)).astype(np.float32)
    c = mg.matmul(a.T, b, **GPU)
    assert torch.is_tensor(c) and c.is_cuda
    within_bound(c, a.T, torch.from_numpy(b))
    c2 = mg.matmul(b.T, a, **GPU)  # numpy first: the result still lands on a's GPU
    within_bound(c2, torch.from_numpy(b).T, a)


def test_out_on_the_gpu_in_host_memory_and_pinned():
    a, b = randn(300, 200, seed=5), randn(200, 170, seed=6)
    out = torch.full((300, 170), float("nan"), device="cuda")
    assert mg.matmul(a, b, out=out, **GPU) is out
    within_bound(out, a, b)
    host = np.full((300, 170), np.nan, np.float32)
    assert mg.matmul(a, b, out=host, **GPU) is host
    within_bound(host, a, b)
    pinned = torch.empty((300, 170), pin_memory=True)
    mg.matmul(a, b, out=pinned, **GPU)
    within_bound(pinned, a, b)
    sq = randn(256, 256, seed=7)
    with pytest.raises(mg.BadInputError, match="shares GPU memory with an input"):
        mg.matmul(sq, sq, out=sq, **GPU)
    with pytest.raises(mg.BadInputError, match="result is 300×170"):
        mg.matmul(a, b, out=torch.empty((170, 300), device="cuda"), **GPU)


def test_the_callers_stream_is_waited_for():
    """An input still being written on the caller's current stream when matmul is called is
    read after that work is done: the stream sleeps ~1 s before it writes a, so a call that did
    not wait would read the zeros (or a half-written a)."""
    b = randn(2048, 1000, seed=9)
    src = randn(2048, 2048, seed=8)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # src and b are made on the default stream
    with torch.cuda.stream(s):
        a = torch.zeros(2048, 2048, device="cuda")
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles on s
        a.copy_(src)
        c = mg.matmul(a, b, **GPU)  # waits for s, the current stream
    torch.cuda.synchronize()
    within_bound(c, src, b)


def test_two_lanes_half_precision_arrays_and_bf16():
    """Two lanes on the GPU (as two GPUs would take them: each copies its blocks device to
    device); float16 arrays (read through the host, widened to f32); bf16 precision (the
    lane's landing buffer and conversion on the device)."""
    a, b = randn(301, 259, seed=20), randn(259, 177, seed=21)
    c = mg.matmul(a, b, **dict(GPU, devices=[0, 0]))
    within_bound(c, a, b)
    a16, b16 = a.half(), b.half()
    c16 = mg.matmul(a16, b16, **GPU)
    assert c16.dtype == torch.float32
    within_bound(c16, a16.float(), b16.float())
    cb = mg.matmul(a, b, precision="bf16", **GPU)
    ab, bb = a.bfloat16().float(), b.bfloat16().float()
    within_bound(cb, ab, bb)


def test_cpu_backend_reads_gpu_arrays_through_the_host():
    a, b = randn(130, 70, seed=10), randn(70, 90, seed=11)
    c = mg.matmul(a, b, backend="cpu", tile=64, progress=False)
    within_bound(c, a, b)


def test_file_output_from_gpu_inputs(tmp_path):
    a, b = randn(300, 200, seed=12), randn(200, 170, seed=13)
    c = mg.matmul(a, b, out=str(tmp_path / "C.npy"), **GPU)
    within_bound(torch.from_numpy(np.array(c)), a, b)
    a2 = randn(300, 200, seed=14)  # same shape, other data: computed afresh, not resumed
    c2 = mg.matmul(a2, b, out=str(tmp_path / "C.npy"), **GPU)
    within_bound(torch.from_numpy(np.array(c2)), a2, b)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    a = cupy.random.default_rng(15).standard_normal((301, 259), dtype=cupy.float64)
    b = cupy.random.default_rng(16).standard_normal((259, 177), dtype=cupy.float64)
    c = mg.matmul(a, b, **GPU)
    assert isinstance(c, cupy.ndarray) and c.dtype == cupy.float64
    within_bound(torch.as_tensor(c, device="cuda"), torch.as_tensor(a, device="cuda"),
                 torch.as_tensor(b, device="cuda"), torch.float64)


@pytest.mark.skipif(os.environ.get("MGMM_GPU_BIG") != "1", reason="MGMM_GPU_BIG=1 runs it")
def test_30000_squared_on_an_8_gib_card_comes_back_in_host_memory():
    """The first user's request: two 30000² f32 CUDA tensors on a card of 8 GiB
    (device_memory): the result cannot sit beside its inputs, so it comes back in host memory
    — in one call, no gather on the GPU."""
    n = 30000
    a, b = randn(n, n, seed=17), randn(n, n, seed=18)
    c = mg.matmul(a, b, device_memory="8GiB", devices=[0], progress=False)
    assert isinstance(c, np.ndarray) and c.shape == (n, n)
    rows = torch.arange(0, n, 997, device="cuda")  # 31 rows, every tile row band
    within_bound(torch.from_numpy(c[rows.cpu().numpy()]), a[rows], b)
