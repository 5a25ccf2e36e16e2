"""The stall watch: when a rank stops moving, write down where its Python is, before anything kills it.

A background thread (never the training thread) looks at where the training thread is (the open
step, or the time since the last one; ``Runtime.position``) every fraction of a threshold derived
from the run's own pace::

    threshold = max(stall_min_s, stall_factor × median step interval)     (3 steps or more)
              = stall_factor × stall_min_s                               (before that: compilation)

Past it, once per stall, it writes a ``stall`` record: the step, whether it is inside it, the open
span, seconds open, the Python stack of every thread (``sys._current_frames()``: file, line and
function, innermost 64 frames, at most 32 threads, the training thread first), the folders of
steptrace's own code (``steptrace_paths``: readers skip those frames) and, where
``torch.distributed`` runs NCCL with its flight recorder on, the collectives in flight. When the
rank moves again a ``stall_end`` record says how long the stall lasted. Nothing is sent to another
rank and nothing waits: the job's view (who is the cause, who waits) is put together afterwards
from every rank's records (``steptrace.analysis.hangs``).

A leaf-level module: the runtime hands it what it needs as callables.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

_perf = time.perf_counter
#: Frames kept per thread (the innermost), threads per record, characters per string.
MAX_FRAMES = 64
MAX_THREADS = 32
MAX_TEXT = 200
#: Steps finalized before the threshold follows the run's median (the first ones compile).
MIN_STEPS_FOR_MEDIAN = 3
#: In-flight collectives kept from the NCCL flight recorder.
MAX_COLLECTIVES = 64


def own_code_dirs() -> tuple[str, ...]:
    """The directories steptrace's own code runs from in this process (``steptrace``, its
    ``adapters`` and ``collector`` subpackages, which a source checkout keeps in folders of their
    own), as imported and resolved, each ending in a separator. A frame is steptrace's own when its
    file is in one of them: where it lives, not what its folders are called (user code in
    ``.../steptrace/train.py`` is the user's). Finding a subpackage's folder does not import it."""
    global _OWN_CODE_DIRS
    if _OWN_CODE_DIRS is None:
        import importlib.util

        folders = [os.path.dirname(os.path.abspath(__file__))]
        for name in ("steptrace.adapters", "steptrace.collector"):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.submodule_search_locations:
                folders.extend(spec.submodule_search_locations)
        dirs: list[str] = []
        for folder in folders:
            for form in (os.path.abspath(folder), os.path.realpath(folder)):
                form = os.path.join(form, "")
                if form not in dirs:
                    dirs.append(form)
        _OWN_CODE_DIRS = tuple(dirs)
    return _OWN_CODE_DIRS


_OWN_CODE_DIRS: tuple[str, ...] | None = None


class StallWatch:
    """Watches one runtime's training thread from its own daemon thread."""

    def __init__(self, *, position: Callable[[], tuple[int, bool, float, str | None] | None],
                 train_thread: Callable[[], int | None], emit: Callable[[list[dict[str, Any]]], None],
                 build: Any, unix_offset: float, factor: float, min_s: float, clock: Callable[[], float] = _perf):
        self._position = position
        self._train_thread = train_thread
        self._emit = emit
        self._build = build  # the RecordBuilder (run id, rank, attempt)
        self._unix_offset = unix_offset
        self.factor = factor
        self.min_s = min_s
        self._clock = clock
        self._intervals: collections.deque[float] = collections.deque(maxlen=101)
        self._stall: dict[str, Any] | None = None  # the open stall: its position and record
        self.stalls = 0
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steptrace-stall-watch", daemon=True)
        self._thread.start()

    # -- fed by the resolver -----------------------------------------------------------------
    def step_finalized(self, interval_seconds: float) -> None:
        self._intervals.append(interval_seconds)

    def threshold(self) -> float:
        """Seconds a step (or the time between steps) may stay open before it is a stall."""
        if len(self._intervals) < MIN_STEPS_FOR_MEDIAN:
            return self.factor * self.min_s
        return max(self.min_s, self.factor * _median(self._intervals))

    def open_stall(self) -> tuple[str | None, bool] | None:
        """(open span, in_step) of the stall in progress, or None (what ``/metrics`` reads)."""
        stall = self._stall
        return None if stall is None else (stall["span"], stall["in_step"])

    # -- the watch thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.threshold() / 4))):
            try:
                self.check()
            except Exception:  # the watch must never take anything down with it
                pass

    def check(self) -> None:
        """One look (the thread calls it; tests may too)."""
        position = self._position()
        now = self._clock()
        stall = self._stall
        if position is None:
            return
        self.looks += 1
        step, in_step, seconds, span = position
        since = now - seconds
        if stall is not None:
            if (step, in_step) == (stall["step"], stall["in_step"]):
                return  # still stuck where it was (step numbers only grow: the same place is the same stall)
            # Moved on: the stall lasted until the boundary it crossed.
            self._stall = None
            self._emit([self._build.stall_end(step=stall["step"], in_step=stall["in_step"],
                                              span=stall["span"], start=stall["since"] + self._unix_offset,
                                              lasted_seconds=max(0.0, since - stall["since"]))])
        threshold = self.threshold()
        if seconds <= threshold:
            return
        self.stalls += 1
        self._stall = {"step": step, "in_step": in_step, "since": since, "span": span}
        self._emit([self._build.stall(step=step, in_step=in_step, span=span, open_seconds=seconds,
                                      threshold_seconds=threshold, start=since + self._unix_offset,
                                      threads=thread_stacks(self._train_thread()),
                                      collectives=nccl_in_flight(), steptrace_paths=list(own_code_dirs()))])

    def close(self) -> None:
        """Stop watching; a stall that ended since the last look still gets its ``stall_end``."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        try:
            if self._stall is not None:
                self.check()
        except Exception:
            pass


def _median(values: Any) -> float:
    # Not statistics.median: importing statistics (decimal, fractions, random) at init costs
    # milliseconds and a burst of allocations that the training thread then pays for in GC passes.
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def thread_stacks(train_thread: int | None) -> list[dict[str, Any]]:
    """Every thread's Python stack, the training thread first, bounded in size."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != train_thread, names.get(ident, "")))
    threads = []
    for ident in order:
        if ident == me:
            continue  # the watch's own stack says nothing
        frame = frames[ident]
        depth = 0
        walker: Any = frame
        while walker is not None:
            depth += 1
            walker = walker.f_back
        summary = traceback.extract_stack(frame, limit=MAX_FRAMES)
        threads.append({
            "name": _text(names.get(ident, f"thread-{ident}")),
            "training": ident == train_thread,
            "frames": [[_text(f.filename), f.lineno or 0, _text(f.name)] for f in summary],
            "frames_left_out": max(0, depth - len(summary)),
        })
        if len(threads) == MAX_THREADS:
            break
    return threads


def nccl_in_flight() -> list[dict[str, Any]] | None:
    """The NCCL flight recorder's entries (sequence number, op, process group, state), where
    ``torch.distributed`` is initialized with NCCL and the recorder is on
    (``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0); None elsewhere. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None or not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0").strip("0"):
        return None
    try:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
            return None
        import pickle

        dump = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
        entries = []
        for entry in (dump.get("entries") or [])[-MAX_COLLECTIVES:]:
            entries.append({key: _plain(entry.get(key)) for key in _NCCL_FIELDS})
        return entries
    except Exception:
        return None


_NCCL_FIELDS = ("collective_seq_id", "profiling_name", "process_group", "state", "time_discovered_started_ns",
                "time_discovered_completed_ns")


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value if not isinstance(value, str) else _text(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value[:8]]
    return _text(repr(value))


def _text(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"
