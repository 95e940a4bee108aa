"""How fast could a product of two GPU arrays reach a pinned host array? (issue 36)

Torch's route is one GEMM, then one copy to the host: `out.copy_(a @ b)`. An engine that
overlaps the copy with compute can do better only if the pieces it cuts the GEMM into run at
the one GEMM's rate. This probe times, in one process on one GPU, interleaved:
  * torch: `c = a @ b; out.copy_(c)` (pinned `out`), and `a @ b` alone;
  * bands: rows of C in bands (sizes given), each `torch.mm(a[r], b, out=dev_band)` on the
    compute stream and copied to the pinned `out` rows on a copy stream as soon as it is done,
    a band's device buffer reused once its copy ended (two buffers);
  * tiles: the same with square output tiles of full depth (an 8192² grid), zero-copy views.
    (Torch copies a device tile into a strided, non-contiguous host view slowly — 3.99 s on one
    H100 — so these rows bound torch's copy, not what tiles could do; the bands' host rows are
    contiguous.)
Reports the median of --reps for each; every schedule's result is compared with torch's
(within fp32 rounding: another GEMM shape may take another cuBLAS kernel). One H100,
2026-12-06: torch GEMM + pinned copy 1.108 s, 4 bands of n/4 rows 1.064 s, 8 bands 1.078 s,
2 bands 1.156 s (docs/measurements/2026-12-06c-h100-5-parked-ends.log).

  python3 tools/probes/device_bands.py --n 30000 --reps 3
"""
import argparse
import statistics
import time

import torch


def bands_sched(a, b, out, sizes, bufs):
    comp, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    evs = [None] * len(bufs)
    r0 = 0
    for i, s in enumerate(sizes):
        j = i % len(bufs)
        if evs[j] is not None:
            comp.wait_event(evs[j])  # the buffer's last copy is done
        d = bufs[j][: s * b.shape[1]].view(s, b.shape[1])
        torch.mm(a[r0:r0 + s], b, out=d)
        done = torch.cuda.Event()
        done.record(comp)
        copy.wait_event(done)
        with torch.cuda.stream(copy):
            out[r0:r0 + s].copy_(d, non_blocking=True)
            e = torch.cuda.Event()
            e.record(copy)
        evs[j] = e
        r0 += s
    copy.synchronize()
    comp.synchronize()


def tiles_sched(a, b, out, t, bufs):
    n = a.shape[0]
    comp, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    evs = [None] * len(bufs)
    i = 0
    for r0 in range(0, n, t):
        for c0 in range(0, n, t):
            rs, cs = min(t, n - r0), min(t, n - c0)
            j = i % len(bufs)
            if evs[j] is not None:
                comp.wait_event(evs[j])
            d = bufs[j][: rs * cs].view(rs, cs)
            torch.mm(a[r0:r0 + rs], b[:, c0:c0 + cs], out=d)
            done = torch.cuda.Event()
            done.record(comp)
            copy.wait_event(done)
            with torch.cuda.stream(copy):
                out[r0:r0 + rs, c0:c0 + cs].copy_(d, non_blocking=True)
                e = torch.cuda.Event()
                e.record(copy)
            evs[j] = e
            i += 1
    copy.synchronize()
    comp.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.n
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(n, n, device="cuda", generator=g)
    b = torch.randn(n, n, device="cuda", generator=g)
    out = torch.empty(n, n, pin_memory=True)
    ref = torch.empty(n, n, pin_memory=True)
    big = [torch.empty(n * (n // 2 + 8), device="cuda") for _ in range(2)]
    bufs = lambda: [x.view(-1) for x in big]  # noqa: E731
    q = n // 4
    runs = {
        "torch a @ b alone": lambda: (a @ b, torch.cuda.synchronize()),
        "torch a @ b; out.copy_ (pinned)": lambda: (out.copy_(a @ b), torch.cuda.synchronize()),
        "bands 2 × n/2": lambda: bands_sched(a, b, out, [n // 2, n - n // 2], bufs()),
        "bands 4 × n/4": lambda: bands_sched(a, b, out, [q, q, q, n - 3 * q], bufs()),
        "bands n·(.4,.3,.2,.1)": lambda: bands_sched(
            a, b, out, [int(n * .4), int(n * .3), int(n * .2), n - int(n * .4) - int(n * .3) - int(n * .2)],
            bufs()),
        "bands n·(.35,.3,.2,.1,.05)": lambda: bands_sched(
            a, b, out, [int(n * .35), int(n * .3), int(n * .2), int(n * .1),
                        n - int(n * .35) - int(n * .3) - int(n * .2) - int(n * .1)], bufs()),
        "bands 8 × n/8": lambda: bands_sched(a, b, out, [n // 8] * 7 + [n - 7 * (n // 8)], bufs()),
        "tiles 8192², full depth": lambda: tiles_sched(a, b, out, 8192, bufs()),
        "tiles 15000², full depth": lambda: tiles_sched(a, b, out, (n + 1) // 2, bufs()),
    }
    ref.copy_(a @ b)
    torch.cuda.synchronize()
    for f in runs.values():  # warm every shape once
        f()
    times = {k: [] for k in runs}
    for _ in range(args.reps):
        for k, f in runs.items():
            out.zero_()
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
            if k != "torch a @ b alone":
                # Another GEMM shape may take another cuBLAS kernel (another summation order):
                # judged within fp32 rounding of a k-term sum, not bit for bit.
                rows = torch.randint(0, n, (64,))
                err = (out[rows] - ref[rows]).abs().max().item()
                assert err <= 1e-4 * ref[rows].abs().max().item() + 1e-3, f"{k}: off by {err}"
    base = statistics.median(times["torch a @ b; out.copy_ (pinned)"])
    print(f"n = {n} f32, {args.reps} interleaved reps, {torch.cuda.get_device_name()}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:34s} median {m:.3f} s (min {min(v):.3f})  {2 * n**3 / m / 1e12:5.1f} TFLOP/s"
              f"  torch-pinned / this {base / m:.3f}")


if __name__ == "__main__":
    main()
