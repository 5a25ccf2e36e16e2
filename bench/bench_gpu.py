"""steptrace on a CUDA GPU: training-thread cost, background cost, process CPU, and throughput.

Usage::

    python bench/bench_gpu.py            # 7 rounds
    python bench/bench_gpu.py --quick    # 3 rounds, shorter loops
    python bench/bench_gpu.py --json out.json

Without a CUDA GPU it prints why and exits 0 (CI and the 2-core dev machines have none).

What is timed
-------------
Every loop is a torch loop on ``cuda:0``; variants run interleaved within each round (so drifts hit
all alike), and ratios are paired within a round, then the median over rounds is printed.

* **Training-thread cost**: a trivial step (one ``x.add_(1)`` on a small tensor), ``--iters`` steps.
  ``empty with`` is ``with contextlib.nullcontext():``; ``steptrace`` is ``with steptrace.step(n):``
  with a ``MemorySink`` (``jsonl=False``). The interpreter's switch interval is raised to 1 s during
  the loop so the background threads cannot take the GIL in the middle: the difference is the
  work done on the training thread per step (the issue's target: at most 10 µs).
* **Background cost**: ``steptrace.stats()["background_cpu_seconds"]`` (the CPU time of the
  resolver and sink threads, which is GIL time for these pure-Python threads) divided by steps,
  measured over the GPU-bound loop with the default switch interval.
* **Throughput**: steps/s of a *host-bound* loop (``--host-ops`` tiny kernels per step, ~3-4 ms of
  launch work, the device mostly idle) and a *GPU-bound* loop (4096² fp32 matmuls, ~5 ms per step),
  each run as: uninstrumented; steptrace; ``sync every step`` (the naive way:
  ``torch.cuda.synchronize()`` and two ``perf_counter()`` reads per step); ``CUDA events`` (the usual
  hand-rolled way: an event pair per step, read one step later after ``synchronize()`` on the previous
  step's end event, since ``elapsed_time`` refuses events that have not completed). Ratios are to
  the uninstrumented loop of the same round.
* **Process CPU**: ``time.process_time()`` per wall-clock second of each throughput loop: a resolver
  that spins in ``event.synchronize()`` shows here as ~1 extra CPU-second per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

perf = time.perf_counter


def _median(values):
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--iters", type=int, help="steps per training-thread-cost loop")
    parser.add_argument("--steps", type=int, help="steps per throughput loop")
    parser.add_argument("--host-ops", type=int, default=300, help="tiny kernels per host-bound step")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure")
        return 0
    rounds = args.rounds or (3 if args.quick else 7)
    iters = args.iters or (2000 if args.quick else 10000)
    steps = args.steps or (100 if args.quick else 300)

    device = torch.device("cuda")
    small = torch.zeros(256, device=device)
    big = torch.randn(4096, 4096, device=device)
    tiny = torch.zeros(16, device=device)
    torch.cuda.synchronize()

    def small_work():
        small.add_(1.0)

    def host_bound_work():
        for _ in range(args.host_ops):
            tiny.add_(1.0)

    def gpu_bound_work():
        nonlocal big
        for _ in range(2):
            big = torch.tanh(big @ big) * 0.5

    measured = measure(torch, small_work, host_bound_work, gpu_bound_work, rounds=rounds, iters=iters, steps=steps)
    report(torch, measured, rounds=rounds, iters=iters, steps=steps, json_path=args.json)
    return 0


def measure(torch, small_work, host_bound_work, gpu_bound_work, *, rounds, iters, steps):
    """Every loop of the benchmark, on whatever ``torch.cuda`` is (tests run it on tests/fake_cuda.py)."""
    import steptrace
    from steptrace.testing import MemorySink

    # ---- the loops -------------------------------------------------------------------------------
    def loop_plain(work, n):
        for _ in range(n):
            work()

    def loop_steptrace(work, n, base):
        for i in range(n):
            with steptrace.step(base + i):
                work()

    def loop_sync(work, n):
        times = []
        for _ in range(n):
            t0 = perf()
            work()
            torch.cuda.synchronize()
            times.append(perf() - t0)
        return times

    def loop_events(work, n):
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)]
        times = []
        for i in range(n):
            start, end = pairs[i % 2]
            start.record()
            work()
            end.record()
            if i:
                prev_start, prev_end = pairs[(i - 1) % 2]
                # elapsed_time refuses events that have not completed (c10 CUDAEvent::elapsed_time
                # checks both): the hand-rolled way waits for the previous step's end first.
                prev_end.synchronize()
                times.append(prev_start.elapsed_time(prev_end) / 1e3)
        return times

    def timed(fn):
        torch.cuda.synchronize()
        wall0, cpu0 = perf(), time.process_time()
        fn()
        torch.cuda.synchronize()
        wall, cpu = perf() - wall0, time.process_time() - cpu0
        return wall, cpu / wall

    base = [0]

    def background_cpu():
        return sum(steptrace.stats()["background_cpu_seconds"].values())

    def next_base(n):
        base[0] += n
        return base[0] - n

    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="bench-gpu", prometheus_port=None)
    try:
        # warm-up: kernels, cuBLAS, steptrace's pool and clock anchors
        for work in (host_bound_work, gpu_bound_work):
            loop_plain(work, 20)
            loop_steptrace(work, 20, next_base(20))
            loop_sync(work, 5)
            loop_events(work, 5)
        steptrace.flush()

        thread = {"empty with": [], "steptrace": []}
        thread_cpu = {"empty with": [], "steptrace": []}
        throughput = {(kind, v): [] for kind in ("host-bound", "GPU-bound")
                      for v in ("uninstrumented", "steptrace", "sync every step", "CUDA events")}
        cpu_per_s = {key: [] for key in throughput}
        background_per_step = []
        for _ in range(rounds):
            # training-thread cost: background threads kept off the GIL during the loop
            old = sys.getswitchinterval()
            sys.setswitchinterval(1.0)
            try:
                torch.cuda.synchronize()
                t0, c0 = perf(), time.thread_time()
                for _i in range(iters):
                    with contextlib.nullcontext():
                        small_work()
                empty, empty_cpu = perf() - t0, time.thread_time() - c0
                steptrace.flush()
                b = next_base(iters)
                torch.cuda.synchronize()
                t0, c0 = perf(), time.thread_time()
                for i in range(iters):
                    with steptrace.step(b + i):
                        small_work()
                traced, traced_cpu = perf() - t0, time.thread_time() - c0
            finally:
                sys.setswitchinterval(old)
            steptrace.flush()
            thread["empty with"].append(empty / iters)
            thread["steptrace"].append(traced / iters)
            # The training thread's own CPU (time.thread_time): what steptrace costs that thread,
            # whatever the background threads took meanwhile (torch ops release the GIL).
            thread_cpu["empty with"].append(empty_cpu / iters)
            thread_cpu["steptrace"].append(traced_cpu / iters)

            for kind, work in (("host-bound", host_bound_work), ("GPU-bound", gpu_bound_work)):
                variants = {
                    "uninstrumented": lambda work=work: loop_plain(work, steps),
                    "steptrace": lambda work=work: loop_steptrace(work, steps, next_base(steps)),
                    "sync every step": lambda work=work: loop_sync(work, steps),
                    "CUDA events": lambda work=work: loop_events(work, steps),
                }
                for name, fn in variants.items():
                    if name == "steptrace":
                        bg0 = background_cpu()
                    wall, cpu = timed(fn)
                    if name == "steptrace":
                        steptrace.flush()
                        if kind == "GPU-bound":
                            background_per_step.append(
                                (background_cpu() - bg0) / steps)
                    throughput[(kind, name)].append(steps / wall)
                    cpu_per_s[(kind, name)].append(cpu)
        clock = steptrace.stats().get("device_clock")
        parts = breakdown(torch, small_work, iters)
    finally:
        steptrace.shutdown()

    return {"thread": thread, "throughput": throughput, "cpu_per_s": cpu_per_s,
            "background_per_step": background_per_step, "thread_cpu": thread_cpu, "clock": clock,
            "breakdown": parts}


def breakdown(torch, small_work, n):
    """The parts of a CUDA step's cost, each timed alone in a loop of ``n`` calls (µs per call), and the
    Python calls of a whole step counted (``sys.setprofile``: each call and C call) on the training thread.

    Training thread: the stream device's lookup (``Backends.stream_for_unit``), the current stream's
    (``current_stream``: the capture check, the GPU, the cached placement), one marker recorded and given
    back (the pool and ``cuEventRecord`` keeping the GIL). Resolver side, on a thread of its own as the
    resolver runs them: ``query`` of a completed marker (``cuEventQuery``) and ``elapsed`` between two
    (``cuEventElapsedTime``), each through ctypes releasing the GIL."""
    import threading

    import steptrace

    runtime = steptrace._active
    backends = runtime.backends if runtime is not None else None
    device = backends.stream_for_unit() if backends is not None else None
    if device is None:
        return {}

    def per_call(fn):
        t0 = perf()
        for _ in range(n):
            fn()
        return (perf() - t0) / n * 1e6

    parts = {"stream device lookup": per_call(backends.stream_for_unit),
             "current stream": per_call(device.current_stream)}
    placement = device.current_stream()
    gpu = placement.steptrace_device

    def record_and_release():
        gpu.release(gpu.record(placement))

    parts["marker record + pool"] = per_call(record_and_release)
    first, second = gpu.record(placement), gpu.record(placement)
    torch.cuda.synchronize()

    def resolver_side():
        parts["query (resolver)"] = per_call(lambda: gpu.query(second))
        parts["elapsed (resolver)"] = per_call(lambda: gpu.elapsed(first, second))

    thread = threading.Thread(target=resolver_side, name="steptrace-bench-resolver-side")
    thread.start()
    thread.join()
    gpu.release(first)
    gpu.release(second)
    calls = [0]
    main = threading.get_ident()

    def count(frame, event, arg):
        if (event == "call" or event == "c_call") and threading.get_ident() == main:
            calls[0] += 1

    steps = 200
    base = 10**9  # after every step the benchmark numbered
    steptrace.flush()
    sys.setprofile(count)
    try:
        for i in range(steps):
            with steptrace.step(base + i):
                small_work()
    finally:
        sys.setprofile(None)
    traced, calls[0] = calls[0], 0
    steptrace.flush()
    sys.setprofile(count)
    try:
        for _ in range(steps):
            small_work()
    finally:
        sys.setprofile(None)
    parts["python calls per step, training thread (over the work's)"] = (traced - calls[0]) / steps
    return parts


def report(torch, measured, *, rounds, iters, steps, json_path):
    thread, throughput, cpu_per_s = measured["thread"], measured["throughput"], measured["cpu_per_s"]
    background_per_step, clock = measured["background_per_step"], measured["clock"]
    thread_cpu = measured["thread_cpu"]
    props = torch.cuda.get_device_properties(0)
    print(f"bench_gpu: {props.name}, torch {torch.__version__}, {rounds} rounds, "
          f"{iters} trivial steps, {steps} steps per throughput loop")
    print()
    print("training-thread cost per step (switch interval 1 s during the loop)")
    e, s = _median(thread["empty with"]), _median(thread["steptrace"])
    paired = _median([b - a for a, b in zip(thread["empty with"], thread["steptrace"])])
    print(f"  empty with     {e * 1e6:8.2f} µs")
    print(f"  steptrace      {s * 1e6:8.2f} µs   (+{paired * 1e6:.2f} µs over the empty with, median of paired)")
    cpu_paired = _median([b - a for a, b in zip(thread_cpu["empty with"], thread_cpu["steptrace"])])
    print(f"  thread CPU     {_median(thread_cpu['steptrace']) * 1e6:8.2f} µs   (+{cpu_paired * 1e6:.2f} µs over the "
          "empty with: time.thread_time() of the training thread)")
    print(f"  background     {_median(background_per_step) * 1e6:8.2f} µs CPU (GIL) per step, resolver + sinks")
    print()
    print(f"{'loop':<12}{'variant':<18}{'steps/s':>10}{'x uninstr.':>12}{'CPU-s/s':>10}")
    results = {}
    for kind in ("host-bound", "GPU-bound"):
        ref = throughput[(kind, "uninstrumented")]
        for name in ("uninstrumented", "steptrace", "sync every step", "CUDA events"):
            values = throughput[(kind, name)]
            ratio = _median([v / r for v, r in zip(values, ref)])
            cpu = _median(cpu_per_s[(kind, name)])
            results[f"{kind}/{name}"] = {"steps_per_s": _median(values), "ratio": ratio, "cpu_per_s": cpu}
            print(f"{kind:<12}{name:<18}{_median(values):>10.1f}{ratio:>12.3f}{cpu:>10.2f}")
    parts = measured.get("breakdown") or {}
    if parts:
        print()
        print("the parts of a CUDA step (each timed alone, µs per call; calls counted)")
        for name, value in parts.items():
            print(f"  {name:<58}{value:10.2f}")
    if clock:
        print()
        print(f"device clock: {clock}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "rounds": rounds,
                       "thread_seconds": thread, "thread_cpu_seconds": thread_cpu,
                       "background_cpu_per_step": background_per_step,
                       "throughput": results, "device_clock": clock, "breakdown": parts}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
