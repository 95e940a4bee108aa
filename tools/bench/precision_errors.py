#!/usr/bin/env python3
"""Relative error of each precision mode's product against an f64 reference (docs/GPU.md).
Usage: precision_errors.py A.npy B.npy C_fp32.npy C_tf32.npy ...   (f32 inputs)
The reference is A·B in float64, computed by torch on the GPU (cuBLAS DGEMM) when available,
else numpy. Prints ‖C − R‖_F / ‖R‖_F and max |C − R| / max |R| for each file."""
import json, sys
import numpy as np
A = np.load(sys.argv[1]).astype(np.float64); B = np.load(sys.argv[2]).astype(np.float64)
try:
    import torch
    R = (torch.from_numpy(A).cuda() @ torch.from_numpy(B).cuda()).cpu().numpy(); how = "torch f64 on GPU"
except Exception:
    R = A @ B; how = "numpy f64"
nr = np.linalg.norm(R); mr = np.abs(R).max()
for p in sys.argv[3:]:
    C = np.load(p).astype(np.float64)
    print(json.dumps(dict(file=p, reference=how, n=A.shape[0], rel_fro=float(np.linalg.norm(C - R) / nr),
                          rel_max=float(np.abs(C - R).max() / mr))), flush=True)
