#!/usr/bin/env python3
"""Compile every kernels/*.cu with NVRTC — no GPU needed — as the lanes do at run time, and
assemble the PTX for sm_90 when ptxas is there: catches what would otherwise first fail on the
GPU machine. NVRTC comes as a pip wheel:

    pip download --no-deps -d /tmp/nvrtc "nvidia-cuda-nvrtc>=13,<14"
    python3 -m zipfile -e /tmp/nvrtc/*.whl /tmp/nvrtc/x
    python3 tools/checks/kernels_compile.py /tmp/nvrtc/x/nvidia/cu13/lib/libnvrtc.so.13

With `PTXAS=/path/to/ptxas` (the `nvidia-cuda-nvcc` wheel has one, nvidia/cu13/bin/ptxas) the
PTX is also assembled for sm_90, as the driver does when it loads it, and the registers and
spills of every kernel are printed. With `PTX_DIR=DIR` each kernel file's PTX is also written
there (DIR/NAME.ptx), to read what the compiler made of a loop.

The ozaki kernels' OZ_T_TABLE is filled as src/backend/cuda/emulate.rs fills it (any numbers
compile). Exit status 1 when a kernel does not compile; the log is printed.
"""
import ctypes
import glob
import os
import subprocess
import sys
import tempfile


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1] if len(sys.argv) > 1 else "libnvrtc.so.13")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "kernels")
    bad = 0
    for path in sorted(glob.glob(os.path.join(root, "*.cu"))):
        src = open(path).read().replace("OZ_T_TABLE", ", ".join(["0"] * 17))
        prog = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), os.path.basename(path).encode(),
                                    0, None, None)
        assert rc == 0, rc
        # The options the lanes compile with (src/backend/cuda/kernels.rs, emulate.rs), plus an
        # architecture for ptxas.
        opts = [b"--gpu-architecture=compute_90"]
        if os.path.basename(path) == "ozaki.cu":
            opts += [b"--device-int128", b"--fmad=false"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        size = ctypes.c_size_t()
        if rc == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        print(f"{os.path.basename(path)}: {'ok' if rc == 0 else 'FAILED'}"
              f"{f' ({size.value} bytes of PTX)' if rc == 0 else ''}")
        if text:
            print(text)
        bad |= rc != 0
        ptxas = os.environ.get("PTXAS")
        ptx = ctypes.create_string_buffer(size.value)
        if rc == 0:
            lib.nvrtcGetPTX(prog, ptx)
        if rc == 0 and os.environ.get("PTX_DIR"):
            name = os.path.basename(path).replace(".cu", ".ptx")
            with open(os.path.join(os.environ["PTX_DIR"], name), "wb") as f:
                f.write(ptx.value)
        if rc == 0 and ptxas:
            with tempfile.NamedTemporaryFile("wb", suffix=".ptx") as f:
                f.write(ptx.value)
                f.flush()
                r = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", os.devnull],
                                   capture_output=True, text=True)
            lines = [ln for ln in (r.stdout + r.stderr).splitlines()
                     if "Compiling entry" in ln or "registers" in ln or "error" in ln.lower()
                     or "spill" in ln and "0 bytes spill" not in ln]
            print("  ptxas sm_90: " + ("ok" if r.returncode == 0 else "FAILED"))
            for ln in lines:
                print("   " + ln.strip())
            bad |= r.returncode != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
