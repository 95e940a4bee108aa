#!/usr/bin/env bash
# kernels/ozaki.cu's arithmetic and indexing checked on the CPU, no GPU needed: compiles
# tools/checks/ozaki_kernels_on_host.cpp (each CUDA thread a std::thread, __syncthreads a
# barrier) against the kernel source with its table of t filled as src/backend/cuda/emulate.rs
# fills it, runs the emulation pipeline on normal, uniform, row-scaled, subnormal, zero-column
# and NaN blocks with every transpose, and checks each element against a double-double
# reference and (K+2)·u·|A||B|. Needs g++ (C++20) and python3. Exit status 1 on a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work/ozaki_host_src.inc" <<'PY'
import sys
moduli = [256, 255, 253, 251, 247, 241, 239, 233, 229, 227, 223, 217, 211, 199, 197, 193]
def t_of(n):
    m = 1
    for x in moduli[:n]:
        m *= x
    return ((m.bit_length() - 1) - 2) // 2
src = open("kernels/ozaki.cu").read().replace("OZ_T_TABLE", ", ".join(str(t_of(max(n, 1))) for n in range(17)))
open(sys.argv[1], "w").write(src)
PY
g++ -std=c++20 -O1 -ffp-contract=off -pthread -I"$work" tools/checks/ozaki_kernels_on_host.cpp -o "$work/oz"
"$work/oz"
