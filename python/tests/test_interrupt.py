"""Ctrl-C, cancel events and exceptions from progress callbacks: each stops the engine
promptly, and a file output resumes where it stopped."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import mgmm_stream as mg
from conftest import close, rand, reference

# Slow enough to interrupt on one thread: 2·N³ = 17 GFLOP in f64 on 64 output tiles.
N = 2048
SLOW = dict(backend="cpu", tile=256, threads=1)


def records(journal):
    """Finished-tile records in a journal (16 bytes each after the header line)."""
    if not os.path.exists(journal):
        return 0
    data = open(journal, "rb").read()
    nl = data.find(b"\n")
    return 0 if nl < 0 else (len(data) - nl - 1) // 16


def test_cancel_event_then_resume(tmp_path):
    a, b = rand((N, N), np.float64, 1), rand((N, N), np.float64, 2)
    out = str(tmp_path / "c.mgt")
    stop = threading.Event()
    seen = []

    def on_progress(u):
        seen.append(u)
        if u["tiles_done"] >= 2:
            stop.set()

    t0 = time.monotonic()
    with pytest.raises(mg.CancelledError, match="same call again resumes"):
        mg.matmul(a, b, out=out, progress=on_progress, cancel=stop, **SLOW)
    assert time.monotonic() - t0 < 60
    done = records(out + ".journal")
    assert 2 <= done < 64, done
    assert all({"tiles_done", "tiles_total", "gflops_per_s", "eta_s"} <= set(u) for u in seen)
    # The last update after the cancel says the step did not finish (it said True).
    assert seen[-1]["tiles_done"] < 64 and not any(u["finished"] for u in seen), seen[-1]
    rep = []
    mg.matmul(a, b, out=out, progress=rep.append, **dict(SLOW, threads=0))
    assert rep[-1]["finished"] is True and rep[-1]["tiles_done"] == 64, rep[-1]
    assert not any(u["finished"] for u in rep[:-1])
    # The resumed call computed only what was left: check through the journal and the data.
    assert records(out + ".journal") >= 64 - done
    close(mg.matmul(out, np.eye(N), backend="cpu", progress=False), reference(a, b), np.float64)


def test_exception_in_progress_callback_propagates():
    a, b = rand((N, N), np.float64, 3), rand((N, N), np.float64, 4)
    seen = []

    def boom(u):
        seen.append(u)
        raise ZeroDivisionError("from the callback")

    t0 = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="from the callback"):
        mg.matmul(a, b, progress=boom, **SLOW)
    assert time.monotonic() - t0 < 30
    # The callback still hears the end, which says the step was stopped, not finished.
    assert len(seen) >= 2 and not any(u["finished"] for u in seen), seen[-1]


# The child restores Python's own SIGINT handler: a test run started in the background of a
# non-interactive shell inherits SIGINT ignored (SIG_IGN), and Ctrl-C never reaches Python there.
CHILD = textwrap.dedent("""
    import signal, sys, time, numpy as np, mgmm_stream as mg
    signal.signal(signal.SIGINT, signal.default_int_handler)
    a = np.load(sys.argv[1], mmap_mode="r"); b = np.load(sys.argv[2], mmap_mode="r")
    print("started", flush=True)
    try:
        mg.matmul(a, b, out=sys.argv[3], progress=False, backend="cpu", tile=256, threads=1)
        print("finished", flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.time(), flush=True)
        sys.exit(3)
""")


def test_ctrl_c_raises_keyboard_interrupt_promptly_and_resumes(tmp_path):
    a, b = rand((N, N), np.float64, 5), rand((N, N), np.float64, 6)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = str(tmp_path / "c.npy")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), out],
        stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while records(out + ".journal") < 2 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.02)
    assert child.poll() is None, "the job finished before it could be interrupted"
    sent = time.time()
    child.send_signal(signal.SIGINT)
    stdout, _ = child.communicate(timeout=60)
    assert child.returncode == 3, stdout
    interrupted_at = float(stdout.split("interrupted")[1])
    assert interrupted_at - sent < 2.0, f"KeyboardInterrupt came {interrupted_at - sent:.2f} s late"
    done = records(out + ".journal")
    assert 2 <= done < 64
    # Unfinished: a header numpy refuses, not an array with zeros where tiles are missing.
    with pytest.raises(ValueError, match="UNFINISHED"):
        np.load(out)
    c = mg.matmul(str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), out=out, progress=False,
                  backend="cpu", tile=256)
    close(c, reference(a, b), np.float64)
