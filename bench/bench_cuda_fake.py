"""steptrace's CUDA path on the CPU fake (tests/fake_cuda.py): what it costs the training thread and the
resolver per step, per microbatch, per span and per ``s.log``, timed and counted.

Usage::

    python bench/bench_cuda_fake.py            # 7 rounds of 5,000 steps
    python bench/bench_cuda_fake.py --quick    # 3 rounds of 2,000 steps
    python bench/bench_cuda_fake.py --json out.json

Timed (CPU seconds, so what other processes on the machine take is not counted): the training thread's
own CPU (``time.thread_time()``) and the resolver thread's (its CPU clock, ``pthread_getcpuclockid``:
GIL time, the resolver being pure Python). Loops, interleaved within each round, each ``--steps`` steps
of one fake kernel launch:

* ``plain``: the launch alone; ``steptrace``: inside ``with steptrace.step(n):``;
* ``plain, 8 mb`` / ``steptrace, 8 mb``: eight launches per step, each in ``steptrace.microbatch``;
* ``steptrace, span``: the step with a ``steptrace.span`` around its launch (a marker at the span's
  start and end);
* ``plain, scalar`` / ``steptrace, s.log``: the launch computes a one-element CUDA tensor, which the
  traced loop logs with ``s.log(loss=...)`` (its copy to pinned host memory and an event).

Two regimes: ``tight`` (the loops above back to back: the resolver falls behind and finalizes a backlog,
the fake's figures of issues 18, 32 and 47) and ``paced`` (a 0.5 ms host pause after each step, a
host-bound GPU loop's shape: the resolver keeps up, each step finalized on its own, which is what
bench_gpu.py's host-bound loop measures on an H200).

Counted, in the paced regime (``sys.setprofile``; load does not move these): Python calls (each call and
C call, the fake's included) per unit on the training thread and on the resolver, the training
thread's GIL hand-overs (torch bindings that release the GIL: the fake's ``gil_releases_on_training_thread``)
and the events it had to create (the pool ran dry), per step. ``tests/test_cuda_cost.py`` holds the
counts to budgets in ``make test``.

The fake's ``Event.record``, stream lookups and driver calls are Python here (a few µs each; C calls on
a GPU), so the timed figures are an upper bound on what the same code costs against real CUDA; the
``the fake alone`` lines time two of its driver records and two queries, its share of a step on the
training thread, and one query and two elapsed-time reads, its share of the resolver's step.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACE_S = 0.5e-3


def _thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (2000 if args.quick else 5000)
    paced_steps = max(200, steps // 10)
    try:
        import torch  # noqa: F401
        from _pytest.monkeypatch import MonkeyPatch
    except ImportError:
        print("bench_cuda_fake: needs torch and pytest (pip install -e '.[torch,test]')")
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_cuda import FakeCuda

    import steptrace
    from steptrace import _handles
    from steptrace.testing import MemorySink

    patch = MonkeyPatch()
    fake = FakeCuda(patch)
    base = [0]

    def next_base(n: int) -> int:
        base[0] += n
        return base[0] - n

    def body(kind: str, s: Any) -> None:
        if kind == "mb":
            for j in range(8):
                with steptrace.microbatch(j, stage=0):
                    fake.run(0.0)
        elif kind == "span":
            with steptrace.span("data"):
                fake.run(0.0)
        elif kind == "log":
            s.log(loss=fake.scalar(1.0))
        else:
            fake.run(0.0)

    def plain(n: int, kind: str, pace: float = 0.0) -> float:
        c0 = time.thread_time()
        cpu = 0.0
        for _ in range(n):
            if kind == "mb":
                for _i in range(8):
                    fake.run(0.0)
            elif kind == "log":
                fake.scalar(1.0)
            else:
                fake.run(0.0)
            if pace:
                cpu += time.thread_time() - c0
                time.sleep(pace)
                c0 = time.thread_time()
        return cpu + time.thread_time() - c0

    def traced(n: int, kind: str, pace: float = 0.0) -> tuple[float, float]:
        """(training-thread CPU, resolver CPU) over n steps, the resolver's taken once it is done."""
        b = next_base(n)
        r0 = _thread_cpu(resolver_ident)
        c0 = time.thread_time()
        training = 0.0
        for i in range(n):
            with steptrace.step(b + i) as s:
                body(kind, s)
            if pace:
                training += time.thread_time() - c0
                time.sleep(pace)
                c0 = time.thread_time()
        training += time.thread_time() - c0
        steptrace.flush()
        return training, _thread_cpu(resolver_ident) - r0

    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="bench-cuda-fake", backend="torch",
                   prometheus_port=None, stall_watch=False)
    resolver_ident = steptrace._active.resolver._thread.ident
    results: dict[str, Any] = {}
    try:
        for kind in ("step", "mb", "span", "log"):
            traced(200, kind)
        # -- timed, tight ------------------------------------------------------------------------
        tight: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(rounds):
            a, (b, rb) = plain(steps, "step"), traced(steps, "step")
            c, (d, _r) = plain(steps // 8, "mb"), traced(steps // 8, "mb")
            (e, _r) = traced(steps, "span")
            f, (g, _r) = plain(steps, "log"), traced(steps, "log")
            tight["step"].append((b - a) / steps)
            tight["microbatch"].append(((d - c) / (steps // 8) - (b - a) / steps) / 8)
            tight["span"].append((e - b) / steps)
            tight["log"].append((g - f) / steps - (b - a) / steps)
            tight["resolver"].append(rb / steps)
        # -- timed, paced (training thread: CPU in the steps only; the pause is not counted) --------
        paced: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(rounds):
            a = plain(paced_steps, "step", PACE_S)
            b, rb = traced(paced_steps, "step", PACE_S)
            c = plain(paced_steps, "mb", PACE_S)
            d, rd = traced(paced_steps, "mb", PACE_S)
            e, re_ = traced(paced_steps, "span", PACE_S)
            f = plain(paced_steps, "log", PACE_S)
            g, rg = traced(paced_steps, "log", PACE_S)
            paced["step"].append((b - a) / paced_steps)
            paced["microbatch"].append(((d - c) - (b - a)) / paced_steps / 8)
            paced["span"].append((e - b) / paced_steps)
            paced["log"].append((g - f - (b - a)) / paced_steps)
            paced["resolver"].append(rb / paced_steps)
            paced["resolver, 8 mb"].append(rd / paced_steps)
            paced["resolver, span"].append(re_ / paced_steps)
            paced["resolver, s.log"].append(rg / paced_steps)
        stats = steptrace.stats()
        steptrace.shutdown()
        # -- counted, paced (a run of its own: its resolver thread starts with the profile set) --------
        calls: collections.Counter[int] = collections.Counter()
        on = [False]  # the training thread's calls: in its steps only (not its pauses)
        main_ident = threading.get_ident()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if (event == "call" or event == "c_call") and (on[0] or threading.get_ident() != main_ident):
                calls[threading.get_ident()] += 1

        threading.setprofile(profile)
        steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="bench-cuda-fake-counted", backend="torch",
                       prometheus_port=None, stall_watch=False)
        resolver_ident = steptrace._active.resolver._thread.ident
        for kind in ("step", "mb", "span", "log"):
            traced(100, kind, PACE_S)
        counted: dict[str, dict[str, float]] = {}
        for kind in ("step", "mb", "span", "log"):
            steptrace.flush()
            time.sleep(0.05)
            calls.clear()
            sys.setprofile(profile)
            gil, made = getattr(fake, "gil_releases_on_training_thread", 0), fake.events_created_on_training_thread
            n = 200
            b = next_base(n)
            on[0] = True
            for i in range(n):
                with steptrace.step(b + i) as s:
                    body(kind, s)
                on[0] = False
                time.sleep(PACE_S)
                on[0] = True
            on[0] = False
            steptrace.flush()
            time.sleep(0.05)  # flush() returns as the last record is handed over: the resolver's last lines
            sys.setprofile(None)
            counted[kind] = {"training": calls[threading.get_ident()] / n, "resolver": calls[resolver_ident] / n,
                             "gil_releases": (getattr(fake, "gil_releases_on_training_thread", 0) - gil) / n,
                             "events_created": (fake.events_created_on_training_thread - made) / n}
        # -- the fake's own share: two driver records and two queries, as a step's markers take ---------
        event_a, event_b = fake.Event(enable_timing=True), fake.Event(enable_timing=True)
        stream = fake.current_stream()
        event_a.record(stream)
        event_b.record(stream)
        driver = fake.driver
        reps = 20000
        c0 = time.thread_time()
        for _ in range(reps):
            driver.record_keeping_gil(event_a.cuda_event, stream.cuda_stream)
            driver.record_keeping_gil(event_b.cuda_event, stream.cuda_stream)
            driver.query_keeping_gil(event_b.cuda_event)
            driver.query_keeping_gil(event_a.cuda_event)
        fake_share = (time.thread_time() - c0) / reps
        # ...and on the resolver: a step's end queried, its two durations read (the CUDA fast path's calls).
        time.sleep(0.01)  # both events completed
        c0 = time.thread_time()
        for _ in range(reps):
            driver.event_query(event_b.cuda_event)
            driver.event_elapsed_ms(event_a.cuda_event, event_b.cuda_event)
            driver.event_elapsed_ms(event_a.cuda_event, event_b.cuda_event)
        fake_resolver_share = (time.thread_time() - c0) / reps
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        steptrace.shutdown()
        patch.undo()

    def med(values: list[float]) -> float:
        return statistics.median(values) * 1e6

    compiled = "compiled (steptrace/_hotpath.c)" if _handles._hotpath is not None else "in Python"
    print(f"bench_cuda_fake: {rounds} rounds of {steps} steps (paced: {paced_steps}, {PACE_S * 1e3:.1f} ms pauses), "
          f"torch {torch.__version__} (CPU, CUDA faked), per-step calls {compiled}")
    print(f"{'µs of CPU':<34}{'tight':>10}{'paced':>10}")
    rows = [("training thread per step", "step"), ("training thread per microbatch", "microbatch"),
            ("training thread per span", "span"), ("training thread per s.log", "log"),
            ("resolver per step", "resolver")]
    for label, key in rows:
        print(f"  {label:<32}{'+' if key != 'resolver' else ' '}{med(tight[key]):8.2f} "
              f"{'+' if key != 'resolver' else ' '}{med(paced[key]):8.2f}")
    for label in ("resolver, 8 mb", "resolver, span", "resolver, s.log"):
        print(f"  {label + ' per step':<32}{'':>10} {med(paced[label]):8.2f}")
    print(f"  the fake alone (2 records + 2 queries): {fake_share * 1e6:.2f} µs (its part of a step above)")
    print(f"  the fake alone on the resolver (1 query + 2 elapsed reads): {fake_resolver_share * 1e6:.2f} µs "
          "(its part of the resolver's step)")
    print(f"{'counted, paced, per step':<34}{'step':>9}{'8 mb':>9}{'span':>9}{'s.log':>9}")
    for field, label in (("training", "Python calls, training thread"), ("resolver", "Python calls, resolver"),
                         ("gil_releases", "GIL hand-overs, training thread"),
                         ("events_created", "events made on the training thread")):
        values = "".join(f"{counted[k][field]:9.1f}" for k in ("step", "mb", "span", "log"))
        print(f"  {label:<32}{values}")
    total = sum(stats["background_cpu_seconds"].values())
    print(f"  background CPU (resolver + sinks), whole run: {total:.3f} s")
    results = {"rounds": rounds, "steps": steps, "paced_steps": paced_steps, "compiled": _handles._hotpath is not None,
               "tight_us": {k: med(v) for k, v in tight.items()}, "paced_us": {k: med(v) for k, v in paced.items()},
               "counted_per_step": counted, "fake_share_us": fake_share * 1e6,
               "fake_resolver_share_us": fake_resolver_share * 1e6}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
