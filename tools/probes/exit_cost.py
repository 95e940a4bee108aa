#!/usr/bin/env python3
"""What it costs a process to let go of page-locked memory and its CUDA context at exit:
orderly (cuMemHostUnregister of every range, the primary context released, then exit) against
leaving it all to the driver and the kernel (`os._exit` with everything still registered).

A child process starts CUDA (libcuda through ctypes, no torch), page-locks FILE_GIB of a file's
map (the inputs a run uploads directly) and ANON_GIB of anonymous memory (its staging pools),
prints the time, then lets go one way or the other; the parent times from that print to the
child's reaping, the part of a run's process wall a user waits for after the step. GPU machine.

  python3 tools/probes/exit_cost.py [--file-gib 8] [--anon-gib 2.25] [--reps 3] [--dir /tmp]
"""
import argparse, ctypes, os, subprocess, sys, time

def child(mode, path, file_gib, anon_gib):
    cu = ctypes.CDLL("libcuda.so.1")
    def ok(r, what):
        if r != 0:
            raise SystemExit(f"{what}: CUDA error {r}")
    ok(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set current")
    f = open(path, "rb")
    t = time.perf_counter()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flen, alen = int(file_gib * 2**30), int(anon_gib * 2**30)
    fa = libc.mmap(None, flen, 1, 1, f.fileno(), 0)            # PROT_READ, MAP_SHARED
    aa = libc.mmap(None, alen, 3, 0x22, -1, 0)                 # RW, MAP_PRIVATE|MAP_ANONYMOUS
    ctypes.memset(aa, 1, alen)
    reg = cu.cuMemHostRegister_v2
    reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    ok(reg(fa, flen, 0x08), "register the file's map")
    ok(reg(aa, alen, 0), "register anonymous memory")
    t_reg = time.perf_counter() - t
    print(f"registered {file_gib} GiB file + {anon_gib} GiB anon in {t_reg:.3f} s", file=sys.stderr)
    print(f"DONE {time.time():.6f}", flush=True)
    if mode == "fast":
        os._exit(0)
    t = time.perf_counter()
    unreg = cu.cuMemHostUnregister
    unreg.argtypes = [ctypes.c_void_p]
    ok(unreg(fa), "unregister file"); ok(unreg(aa), "unregister anon")
    t1 = time.perf_counter()
    ok(cu.cuDevicePrimaryCtxRelease(dev), "release")
    t2 = time.perf_counter()
    print(f"unregister {t1 - t:.3f} s, context release {t2 - t1:.3f} s", file=sys.stderr)
    os._exit(0)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file-gib", type=float, default=8)
    p.add_argument("--anon-gib", type=float, default=2.25)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--child", nargs=4)
    a = p.parse_args()
    if a.child:
        mode, path, fg, ag = a.child
        return child(mode, path, float(fg), float(ag))
    path = os.path.join(a.dir, "exit_cost.bin")
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20) * 64
        for _ in range(int(a.file_gib * 2**30) // len(chunk)):
            f.write(chunk)
    for rep in range(a.reps):
        for mode in ("orderly", "fast"):
            c = subprocess.Popen([sys.executable, __file__, "--child", mode, path, str(a.file_gib), str(a.anon_gib)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = c.communicate()
            end = time.time()
            done = float(out.split()[1])
            print(f"rep {rep} {mode:8s}: exit took {end - done:.3f} s after the work; child: {err.strip()}")
    os.unlink(path)

if __name__ == "__main__":
    main()
