"""How late steptrace observes the device finishing a step, measured against an exact clock.

Usage::

    .venv/bin/python bench/bench_latency.py            # 3 repetitions x 40 steps per scenario
    .venv/bin/python bench/bench_latency.py --quick    # 1 x 20
    .venv/bin/python bench/bench_latency.py --json out.json

Why: on a real device the true end of a step is unknown to the host, so bench_accuracy has to
compare with an isolated re-run (noisy on a shared machine). Here the "device" is a child
process that executes queued work items in order (``time.sleep(T)`` each, like one device
stream) and reports when each one really started and ended, on ``CLOCK_MONOTONIC``, which is
what ``time.perf_counter`` reads in every process on Linux. The ground truth is exact.

The device object implements steptrace's value-device protocol the way the JAX adapter does:
``wait_values`` blocks (a blocking ``os.read``, which releases the GIL like
``jax.block_until_ready``) and returns ``None``, so the resolver reads the clock the moment it
runs again. It is passed as ``init(backend=device)``. Loop (T = 30 ms)::

    with steptrace.step(n) as s:
        with steptrace.span("data"): <host data work, 0.6 T>
        work = device.run(T)          # asynchronous dispatch
        s.wait_for(work)

The host is faster than the device, so it runs ahead and each step's device work ends while
the host is doing the data work of a later step. Scenarios for that data work:

* ``sleep``: ``time.sleep`` (I/O-bound loading; the GIL is free).
* ``busy``: a pure-Python busy loop (CPU-bound Python preprocessing; the training thread holds
  the GIL and gives it up only when another thread has asked for it for
  ``sys.getswitchinterval()``, 5 ms by default).
* ``busy, switchinterval 1 ms``: the same with ``sys.setswitchinterval(0.001)``.

Reported per scenario (steps 2.. of every run): the *observation latency*
(steptrace's ``end_time`` minus the device's true end) median / p90 / max, and the per-step
error of ``compute_seconds`` against the true busy time of that work item (median and max
|error|, count within 10%). A late observation of ``end(n)`` makes step n read long and step n+1
short by the same amount (intervals still tile the wall time).

How to read it: with the GIL free, latency is the resolver's wake-up time (sub-millisecond) and
per-step errors are a few percent at most. When the training thread runs Python while the device
finishes, latency grows up to about the switch interval (or more if another background thread
takes the GIL first), and per-step error grows to latency / step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

import steptrace  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

perf = time.perf_counter
T = 0.030
DATA = 0.6 * T
TARGET_REL = 0.10

_CHILD = r"""
import os, sys, time
out = sys.stdout.fileno()
for line in sys.stdin:
    i, d = line.split()
    t0 = time.perf_counter()
    time.sleep(float(d))
    t1 = time.perf_counter()
    os.write(out, f"{i} {t0!r} {t1!r}\n".encode())
"""


class Work:
    __slots__ = ("id", "start", "end")

    def __init__(self, i: int):
        self.id = i
        self.start: float | None = None
        self.end: float | None = None


class ProcessDevice:
    """An in-order 'device' in a child process that reports exact start/end times."""

    name = "process"
    uses_events = False

    def __init__(self) -> None:
        self._p = subprocess.Popen([sys.executable, "-u", "-c", _CHILD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, bufsize=0)
        self._fd = self._p.stdout.fileno()
        self._buf = b""
        self._pending: dict[int, Work] = {}
        self._n = 0

    def run(self, seconds: float) -> Work:
        w = Work(self._n)
        self._n += 1
        self._pending[w.id] = w
        self._p.stdin.write(f"{w.id} {seconds!r}\n".encode())
        return w

    # -- steptrace's device protocol (value device, like adapters.jax.JaxDevice) ----------
    def event(self):
        return None

    def wait_event(self, event):
        return None

    def elapsed(self, start_event, end_event):
        raise NotImplementedError

    def wait_values(self, values):
        for w in values:
            while w.end is None:
                chunk = os.read(self._fd, 65536)  # blocks with the GIL released
                if not chunk:
                    raise RuntimeError("device process exited")
                self._buf += chunk
                *lines, self._buf = self._buf.split(b"\n")
                for line in lines:
                    i, t0, t1 = line.split()
                    done = self._pending.pop(int(i))
                    done.start, done.end = float(t0), float(t1)
        return None  # the resolver reads the clock when this returns, as with JAX

    def close(self) -> None:
        self._p.stdin.close()
        self._p.wait(10)


def _busy(seconds: float) -> None:
    end = perf() + seconds
    while perf() < end:
        pass


SCENARIOS = [
    ("sleep", time.sleep, None),
    ("busy", _busy, None),
    ("busy, switchinterval 1 ms", _busy, 0.001),
]


def run_once(data_fn, switch: float | None, steps: int) -> dict:
    dev = ProcessDevice()
    sink = MemorySink()
    old = sys.getswitchinterval()
    steptrace.init(jsonl=False, sinks=[sink], run_id="bench-latency", backend=dev, strict=False)
    # Records carry unix seconds = perf_counter + the resolver's offset.
    offset = steptrace._active.resolver.unix_offset
    works = []
    try:
        if switch is not None:
            sys.setswitchinterval(switch)
        for n in range(steps):
            with steptrace.step(n) as s:
                with steptrace.span("data"):
                    data_fn(DATA)
                w = dev.run(T)
                works.append(w)
                s.wait_for(w)
    finally:
        sys.setswitchinterval(old)
    steptrace.flush(60.0)
    steptrace.shutdown()
    dev.close()
    recs = {r["step"]: r for r in sink.steps()}
    lat, err = [], []
    for n in range(2, steps):
        r, w = recs.get(n), works[n]
        if r is None or w.end is None:
            continue
        lat.append(r["end_time"] - offset - w.end)
        err.append(r["compute_seconds"] / (w.end - w.start) - 1.0)
    return {"latency_s": lat, "rel_err": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition x 20 steps")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    repeats = args.reps or (1 if args.quick else 3)
    steps = args.steps or (20 if args.quick else 40)
    wall0 = perf()
    data = {name: {"latency_s": [], "rel_err": []} for name, _, _ in SCENARIOS}
    for _ in range(repeats):
        for name, fn, switch in SCENARIOS:
            res = run_once(fn, switch, steps)
            data[name]["latency_s"] += res["latency_s"]
            data[name]["rel_err"] += res["rel_err"]
    rows, summary = [], {}
    for name, _, _ in SCENARIOS:
        lat = [1e3 * v for v in data[name]["latency_s"]]
        err = [abs(e) for e in data[name]["rel_err"]]
        within = sum(1 for e in err if e <= TARGET_REL)
        summary[name] = {"latency_ms_median": wl.median(lat), "latency_ms_p90": wl.percentile(lat, 90),
                         "latency_ms_max": max(lat), "abs_rel_err_median": wl.median(err),
                         "abs_rel_err_max": max(err), "within_10pct": within, "count": len(err)}
        s = summary[name]
        rows.append([name, f"{s['latency_ms_median']:.2f}", f"{s['latency_ms_p90']:.2f}", f"{s['latency_ms_max']:.2f}",
                     f"{100 * s['abs_rel_err_median']:.1f}%", f"{100 * s['abs_rel_err_max']:.1f}%",
                     f"{within}/{len(err)}"])
    table = wl.fmt_table(["host data work", "latency ms (median)", "p90", "max", "compute |err| median", "max",
                          "within 10%"], rows)
    out = [
        wl.header("steptrace bench_latency: observation latency of device completion vs an exact clock"),
        f"  {repeats} repetition(s) x {steps} steps per scenario; device step {1e3 * T:.0f} ms, host data "
        f"{1e3 * DATA:.0f} ms/step; exact device times from a child process (CLOCK_MONOTONIC)",
        "",
        table,
        "",
        "  latency = steptrace end_time - true device end; compute |err| = |compute_seconds / true busy time - 1|",
        f"  (wall {perf() - wall0:.0f} s)",
    ]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "latency", "machine": wl.machine_info(), "repeats": repeats, "steps": steps,
                       "T_seconds": T, "data_seconds": DATA, "summary": summary, "raw": data}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
