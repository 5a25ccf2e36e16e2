"""The GPU's own timeline, read from a ``torch.profiler`` (Kineto) Chrome trace: ground truth for tests.

Each device operation (kernel, memcpy, memset) carries the correlation id of the host call that
launched it (``cudaLaunchKernel``, ``cudaGraphLaunch``, ``cuLaunchKernelEx``, ...). A device operation
belongs to an annotated host range (``record_function``, or steptrace's own ``steptrace.step.N``) when
its launch happened inside that range. This is how the CUDA timing issue's measurements were taken,
and it uses no host clock read of ours: only CUPTI's device timestamps, which Kineto puts on the
same time base as the host events of the same trace.

Times are seconds on the trace's own clock; compare differences and durations, never absolute
times, with steptrace's records.
"""

from __future__ import annotations

import bisect
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
ANNOTATION_CATEGORIES = frozenset({"user_annotation"})


@dataclass(frozen=True)
class Window:
    """Device work launched inside one host range: first start, last end, and busy time (union)."""

    start: float
    end: float
    busy: float
    operations: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class KernelTimeline:
    #: (start, end, correlation id) of every device operation, sorted by start
    device_ops: list[tuple[float, float, int]] = field(default_factory=list)
    #: correlation id -> host time of the launch call
    launches: dict[int, float] = field(default_factory=dict)
    #: annotation name -> [(start, end)] host ranges, in order
    annotations: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    #: host times of every CUDA runtime and driver call the trace has (launches, event records, capture
    #: checks), sorted
    api_calls: list[float] = field(default_factory=list)

    @classmethod
    def from_trace(cls, trace: dict[str, Any]) -> "KernelTimeline":
        timeline = cls()
        for event in trace.get("traceEvents", []):
            if event.get("ph") != "X":
                continue
            cat = event.get("cat", "")
            start = float(event["ts"]) / 1e6
            end = start + float(event.get("dur", 0.0)) / 1e6
            args = event.get("args") or {}
            if cat in DEVICE_CATEGORIES and "correlation" in args:
                timeline.device_ops.append((start, end, int(args["correlation"])))
            elif cat in LAUNCH_CATEGORIES and "correlation" in args:
                timeline.launches[int(args["correlation"])] = start
                timeline.api_calls.append(start)
            elif cat in ANNOTATION_CATEGORIES:
                timeline.annotations.setdefault(event["name"], []).append((start, end))
        timeline.device_ops.sort()
        timeline.api_calls.sort()
        for ranges in timeline.annotations.values():
            ranges.sort()
        return timeline

    @classmethod
    def load(cls, path: str | Path) -> "KernelTimeline":
        return cls.from_trace(load_json(path))

    def window(self, name: str, occurrence: int = 0) -> Window:
        """The device work launched inside the ``occurrence``-th host range called ``name``."""
        ranges = self.annotations.get(name)
        if not ranges or occurrence >= len(ranges):
            raise KeyError(f"no annotation {name!r} (occurrence {occurrence}) in the trace")
        lo, hi = ranges[occurrence]
        ops = [(s, e) for s, e, corr in self.device_ops
               if corr in self.launches and lo <= self.launches[corr] <= hi]
        if not ops:
            raise ValueError(f"no device work was launched inside {name!r}")
        return Window(start=min(s for s, _ in ops), end=max(e for _, e in ops), busy=_union(ops),
                      operations=len(ops))

    def step_by_the_timing_model(self, name: str, previous: str | None = None) -> Window:
        """The device work launched inside the host range ``name`` as the timing model times a step
        (DESIGN.md: ``start(n) = max(end(n-1), dispatch(n))``, where ``dispatch(n)`` is the step's entry
        when the adapter does not see the dispatch): from the later of the ``previous`` range's device
        end and this range's entry, to its last device end. ``window`` starts at the first device
        operation instead, which differs where the device was drained when the step began and the host
        took a while to launch its first kernel (the step right after ``torch.save``: 0.3-1.1 ms on an
        H200): that host time is the step's, by the model.

        The entry is the range's first CUDA call (the host's first word to the device in the step;
        steptrace's capture check, right before its start marker), else the range's opening: on a host
        cold from a save the range opened 50-140 µs before that call (H200; Kineto's trace does not hold
        steptrace's own ``cuEventRecord``, made through ctypes)."""
        window = self.window(name)
        opened, closed = self.annotations[name][0]
        i = bisect.bisect_left(self.api_calls, opened)
        start = self.api_calls[i] if i < len(self.api_calls) and self.api_calls[i] <= closed else opened
        if previous is not None and previous in self.annotations:
            start = max(start, self.window(previous).end)
        start = min(start, window.end)
        return Window(start=start, end=window.end, busy=window.busy, operations=window.operations)

    def last_device_end_before(self, t: float) -> float | None:
        """The end of the latest device operation that started before ``t`` (on the trace clock)."""
        starts = [s for s, _, _ in self.device_ops]
        i = bisect.bisect_left(starts, t)
        return max((e for _, e, _ in self.device_ops[:i]), default=None)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def relative_error(measured: float, true: float) -> float:
    return abs(measured - true) / true


def xla_module_windows(trace: dict[str, Any] | list[dict[str, Any]], *, module: str | None = None,
                       runs: int | None = None) -> list[tuple[float, float]]:
    """(start, end) of every XLA program execution on a GPU, in order, from a ``jax.profiler`` trace
    (``create_perfetto_trace=True``).

    From the "XLA Modules" line of each ``/device:GPU:N`` process where the trace has one; else
    (jax 0.11's exported trace has only ``Stream #N(...)`` lines under ``/device:GPU:0``) from the
    kernels themselves: those whose ``hlo_module`` argument is ``module`` (any module when None),
    grouped by their ``run_id`` argument when they carry one, else cut into ``runs`` executions of
    equally many kernels (one jitted step launches the same kernels every time)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu_pids = {pid for pid, name in process.items() if name.startswith("/device:GPU")}
    modules = [(float(e["ts"]) / 1e6, (float(e["ts"]) + float(e.get("dur", 0.0))) / 1e6) for e in events
               if e.get("ph") == "X" and e.get("pid") in gpu_pids
               and thread.get((e["pid"], e.get("tid"))) == "XLA Modules"]
    if modules:
        return sorted(modules)
    kernels = sorted((float(e["ts"]) / 1e6, (float(e["ts"]) + float(e.get("dur", 0.0))) / 1e6,
                      (e.get("args") or {}).get("run_id"))
                     for e in events
                     if e.get("ph") == "X" and e.get("pid") in gpu_pids
                     and str(thread.get((e["pid"], e.get("tid")), "")).startswith("Stream")
                     and "hlo_module" in (e.get("args") or {})
                     and (module is None or e["args"]["hlo_module"] == module))
    windows: list[tuple[float, float]] = []
    if kernels and all(run_id is not None for _, _, run_id in kernels):
        by_run: dict[Any, list[tuple[float, float]]] = {}
        for start, end, run_id in kernels:
            by_run.setdefault(run_id, []).append((start, end))
        windows = sorted((min(s for s, _ in ks), max(e for _, e in ks)) for ks in by_run.values())
    elif kernels and runs and len(kernels) % runs == 0:
        per_run = len(kernels) // runs
        windows = [(kernels[i][0], max(e for _, e, _ in kernels[i:i + per_run]))
                   for i in range(0, len(kernels), per_run)]
    if not windows:
        lines = sorted({name for (pid, _), name in thread.items() if pid in gpu_pids})
        raise ValueError(f"no 'XLA Modules' line on a GPU in this trace, and no kernels with an hlo_module "
                         f"to group; GPU lines: {lines}")
    return windows


def load_json(path: str | Path) -> Any:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)
