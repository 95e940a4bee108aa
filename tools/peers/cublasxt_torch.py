#!/usr/bin/env python3
"""Peers for the GPU benchmarks, run on the GPU machine's python3 (torch, numpy):

  cuBLASXt (ctypes on libcublas, pinning on, block 8192 — its best configuration) and torch
  (.cuda(), @, .cpu()), on the same data mgmm-stream uses, exported to .npy.

Each is timed end to end like mgmm-stream's run: inputs read from files (page cache), product,
result written to a file (no fsync). Compute-only time is reported too. Prints one JSON line per
measurement.
"""
import argparse, ctypes, ctypes.util, glob, json, os, time
import numpy as np

def load(p):
    return np.load(p, mmap_mode="r")

def timed_inputs(a, b):
    # np.load without mmap reads the whole file into RAM (from the page cache here).
    t = time.perf_counter()
    A = np.load(a); B = np.load(b)
    return A, B, time.perf_counter() - t

def write(C, out):
    t = time.perf_counter()
    C.tofile(out)
    return time.perf_counter() - t

def cublasxt(a, b, out, ngpu, block):
    names = ["libcublas.so.13", "libcublas.so"] + glob.glob("/usr/local/cuda*/lib64/libcublas.so*")
    lib = None
    for n in names:
        try:
            lib = ctypes.CDLL(n); break
        except OSError:
            pass
    t0 = time.perf_counter()
    A, B, t_in = timed_inputs(a, b)
    m, k = A.shape; n = B.shape[1]
    C = np.empty((m, n), dtype=np.float32)
    h = ctypes.c_void_p()
    assert lib.cublasXtCreate(ctypes.byref(h)) == 0
    devs = (ctypes.c_int * ngpu)(*range(ngpu))
    assert lib.cublasXtDeviceSelect(h, ngpu, devs) == 0
    assert lib.cublasXtSetBlockDim(h, block) == 0
    assert lib.cublasXtSetPinningMemMode(h, 1) == 0
    al, be = ctypes.c_float(1.0), ctypes.c_float(0.0)
    sz = ctypes.c_size_t
    tc = time.perf_counter()
    # Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first.
    r = lib.cublasXtSgemm(h, 0, 0, sz(n), sz(m), sz(k), ctypes.byref(al),
                          B.ctypes.data_as(ctypes.c_void_p), sz(n),
                          A.ctypes.data_as(ctypes.c_void_p), sz(k), ctypes.byref(be),
                          C.ctypes.data_as(ctypes.c_void_p), sz(n))
    assert r == 0, r
    t_gemm = time.perf_counter() - tc
    t_out = write(C, out)
    total = time.perf_counter() - t0
    lib.cublasXtDestroy(h)
    return dict(peer=f"cublasxt_{ngpu}gpu_block{block}", total_s=total, read_s=t_in, gemm_s=t_gemm, write_s=t_out,
                tflops_end_to_end=2*m*n*k/total/1e12, tflops_gemm=2*m*n*k/t_gemm/1e12), C

def torch_run(a, b, out, tf32):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    t0 = time.perf_counter()
    A, B, t_in = timed_inputs(a, b)
    m, k = A.shape; n = B.shape[1]
    tc = time.perf_counter()
    Ct = torch.from_numpy(A).cuda() @ torch.from_numpy(B).cuda()
    C = Ct.cpu().numpy()
    t_gemm = time.perf_counter() - tc
    del Ct; torch.cuda.empty_cache()
    t_out = write(C, out)
    total = time.perf_counter() - t0
    return dict(peer="torch_tf32" if tf32 else "torch_fp32", total_s=total, read_s=t_in, gemm_s=t_gemm, write_s=t_out,
                tflops_end_to_end=2*m*n*k/total/1e12, tflops_gemm=2*m*n*k/t_gemm/1e12), C

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--a"); ap.add_argument("--b"); ap.add_argument("--out")
    ap.add_argument("--ngpu", type=int, default=1)
    ap.add_argument("--check", help="mgmm-stream result exported to .npy, compared with cuBLASXt's")
    ap.add_argument("--which", default="cublasxt,torch_fp32,torch_tf32")
    args = ap.parse_args()
    for w in args.which.split(","):
        if w == "cublasxt":
            r, C = cublasxt(args.a, args.b, args.out, args.ngpu, 8192)
            if args.check and os.path.exists(args.check):
                M = load(args.check)
                rows = slice(0, 2048)
                d = np.linalg.norm(np.asarray(M[rows], dtype=np.float64) - C[rows]) / np.linalg.norm(C[rows].astype(np.float64))
                r["rel_diff_vs_mgmm_first_2048_rows"] = float(d)
        elif w == "torch_fp32":
            r, C = torch_run(args.a, args.b, args.out, False)
        elif w == "torch_tf32":
            r, C = torch_run(args.a, args.b, args.out, True)
        del C
        os.remove(args.out)
        print(json.dumps(r), flush=True)
