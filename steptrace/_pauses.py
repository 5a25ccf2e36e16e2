"""Host pauses of the training thread (issue 50, DESIGN.md §2 "Host pauses are reasons too").

What stops the host the way a ``data`` span does, measured where it happened, without per-step work on
the training thread:

* **gc**: every garbage collection the training thread runs, from ``gc.callbacks`` (CPython calls each
  entry with ``("start", info)`` before and ``("stop", info)`` after a collection, on the thread that
  triggered it; ``info`` holds ``generation`` and ``collected``: docs.python.org/3/library/gc.html#gc.callbacks).
  The entry is :class:`steptrace._hotpath.GcWatch` (C: two clock reads and a ring slot per collection), or
  :class:`_PyGcWatch` where the extension is not built. The resolver drains the pauses and charges each
  one, as a host interval named ``gc``, by the overlap rule.
* **preempted**: the training thread's wait on a run queue (``/proc/self/task/<tid>/schedstat``, second
  field, nanoseconds: kernel Documentation/scheduler/sched-stats.rst) and its involuntary context switches
  (``nonvoluntary_ctxt_switches`` in ``/proc/self/task/<tid>/status``: proc(5)), read by the resolver.
* **major faults**: ``majflt``, field 12 of ``/proc/self/task/<tid>/stat`` (proc(5)), read by the resolver.

The counters are cumulative and read by the resolver as it finalizes each step, so a step's share is
what accrued between two reads (the resolver's lag moves it by at most that lag); where the kernel has
no such file (not Linux, schedstats off) the field is None: absent, never 0.
"""

from __future__ import annotations

import gc
import math
import os
import threading
from collections import deque
from typing import Any

#: Pauses kept between two drains by the resolver; more are dropped (oldest first) and counted.
GC_RING = 4096


class _PyGcWatch:
    """The pure-Python :class:`steptrace._hotpath.GcWatch` (same interface, same behaviour)."""

    def __init__(self, capacity: int = GC_RING):
        self._thread = 0
        self._started = -1.0
        self._ring: deque[tuple[float, float, int, int]] = deque()
        self._capacity = capacity
        self.dropped = 0
        self.other_threads = 0

    @property
    def armed(self) -> bool:
        return self._thread != 0

    def arm(self) -> None:
        self._thread = threading.get_ident()
        self._started = -1.0

    def disarm(self) -> None:
        self._thread = 0

    def __call__(self, phase: str, info: dict) -> None:
        from time import perf_counter

        if not self._thread:
            return
        if threading.get_ident() != self._thread:
            if phase == "stop":
                self.other_threads += 1
            return
        if phase == "start":
            self._started = perf_counter()
            return
        if self._started < 0:
            return
        if len(self._ring) == self._capacity:
            self._ring.popleft()
            self.dropped += 1
        self._ring.append((self._started, perf_counter(), int(info.get("generation", -1)),
                           int(info.get("collected", 0))))
        self._started = -1.0

    def take(self) -> list[tuple[float, float, int, int]]:
        out = list(self._ring)
        self._ring.clear()
        return out


class ThreadCounters:
    """The training thread's scheduler and fault counters, read from /proc by another thread."""

    def __init__(self, native_id: int):
        base = f"/proc/self/task/{native_id}"
        self._schedstat = self._open(f"{base}/schedstat")
        self._stat = self._open(f"{base}/stat")
        self._status = self._open(f"{base}/status")

    @staticmethod
    def _open(path: str) -> int | None:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError:
            return None

    @staticmethod
    def _read(fd: int | None, size: int) -> str | None:
        if fd is None:
            return None
        try:
            return os.pread(fd, size, 0).decode("ascii", "replace")  # procfs regenerates at offset 0
        except OSError:
            return None

    def read(self) -> tuple[float | None, int | None, int | None]:
        """``(run_queue_wait_seconds, involuntary_switches, major_faults)``, cumulative; None where absent."""
        wait = switches = faults = None
        text = self._read(self._schedstat, 128)
        if text:
            parts = text.split()
            if len(parts) >= 2 and parts[1].isdigit():
                wait = int(parts[1]) * 1e-9
        text = self._read(self._stat, 1024)
        if text:
            # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
            fields = text[text.rfind(")") + 2:].split()
            if len(fields) > 9 and fields[9].isdigit():
                faults = int(fields[9])  # majflt: field 12, the 10th after the name
        text = self._read(self._status, 4096)
        if text:
            at = text.find("nonvoluntary_ctxt_switches:")
            if at >= 0:
                value = text[at + 27:].split(None, 1)[0]
                if value.isdigit():
                    switches = int(value)
        return wait, switches, faults

    def close(self) -> None:
        for fd in (self._schedstat, self._stat, self._status):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._schedstat = self._stat = self._status = None


class HostPauses:
    """The pauses of one training thread: armed on it (``start``), drained by the resolver (``step_pauses``)."""

    def __init__(self, compiled: Any = None) -> None:
        # The compiled hot path (steptrace._hotpath, as the handles loaded it), whose GcWatch is the C one.
        gc_watch = getattr(compiled, "GcWatch", None)
        self.watch: Any = gc_watch(GC_RING) if gc_watch is not None else _PyGcWatch(GC_RING)
        self.counters: ThreadCounters | None = None
        self._gc: list[tuple[float, float, int, int]] = []
        self._last: tuple[float | None, int | None, int | None] | None = None

    def start(self) -> None:
        """On the training thread: watch its collections and open its counters."""
        self.watch.arm()
        if self.watch not in gc.callbacks:
            gc.callbacks.append(self.watch)
        self.counters = ThreadCounters(threading.get_native_id())
        self._last = self.counters.read()

    def close(self) -> None:
        self.watch.disarm()
        try:
            gc.callbacks.remove(self.watch)
        except ValueError:
            pass
        if self.counters is not None:
            self.counters.close()

    @property
    def dropped(self) -> int:
        return int(self.watch.dropped)

    def gc_until(self, end: float) -> list[tuple[float, float, int, int]]:
        """The collections that began before ``end`` and were not taken yet, oldest first."""
        self._gc += self.watch.take()
        pending = self._gc
        if not pending or pending[-1][0] < end:
            self._gc = []
            return pending
        cut = 0
        while cut < len(pending) and pending[cut][0] < end:
            cut += 1
        taken, self._gc = pending[:cut], pending[cut:]
        return taken

    def counters_delta(self) -> tuple[float | None, int | None, int | None]:
        """What the thread's counters gained since the last call (None where the kernel has no such counter)."""
        if self.counters is None or self._last is None:
            return None, None, None
        now = self.counters.read()
        last, self._last = self._last, now
        return tuple(None if a is None or b is None else max(b - a, 0)  # type: ignore[return-value]
                     for a, b in zip(last, now))


def summary(pauses: list[tuple[float, float, int, int]], counters: tuple[float | None, int | None, int | None],
            dropped: int) -> dict[str, Any]:
    """A step's ``host_pauses`` field (docs/records.md): the collections and counters, not a record per one."""
    wait, switches, faults = counters
    longest = max(pauses, key=lambda p: p[1] - p[0]) if pauses else None
    counts = [0, 0, 0]
    for pause in pauses:
        if 0 <= pause[2] <= 2:
            counts[pause[2]] += 1
    out: dict[str, Any] = {
        "gc_seconds": math.fsum(p[1] - p[0] for p in pauses),
        "gc_collections": counts,
        "gc_collected": sum(p[3] for p in pauses),
        "gc_max_seconds": 0.0 if longest is None else longest[1] - longest[0],
        "gc_max_generation": None if longest is None else longest[2],
        "preempted_seconds": wait,
        "involuntary_switches": switches,
        "major_faults": faults,
    }
    if dropped:
        out["gc_dropped"] = dropped
    return out


def pause_clause(record: dict[str, Any]) -> str:
    """What paused the host in a step, for a sentence about it (the capture's ``slow`` reason): e.g. ``; host
    pauses: gc 300 ms (largest a gen-2 collection of 290 ms), preempted 12 ms``, or "" where none was over a
    millisecond or the step has no ``host_pauses``."""
    pauses = record.get("host_pauses")
    if not isinstance(pauses, dict):
        return ""
    parts = []
    gc_seconds = pauses.get("gc_seconds") or 0.0
    if gc_seconds >= 1e-3:
        part = f"gc {gc_seconds * 1e3:.0f} ms"
        longest, generation = pauses.get("gc_max_seconds") or 0.0, pauses.get("gc_max_generation")
        if longest >= 1e-3 and generation is not None:
            part += f" (largest a gen-{generation} collection of {longest * 1e3:.0f} ms)"
        parts.append(part)
    preempted = pauses.get("preempted_seconds")
    if preempted is not None and preempted >= 1e-3:
        parts.append(f"preempted {preempted * 1e3:.0f} ms")
    faults = pauses.get("major_faults")
    if faults:
        parts.append(f"{faults} major faults")
    return "; host pauses: " + ", ".join(parts) if parts else ""


class GcEvery:
    """Coordinated garbage collection (``steptrace.gc_every``): CPython's automatic collection off, and a
    collection of ``generation`` at every ``n``-th step, called between steps on every rank at the same
    step numbers, so the ranks pause together instead of one at a time (each rank's pause, alone, makes
    every other rank wait for it in the next collective). The recipe torchtitan (``gc_freq``), Megatron
    (``--manual-gc``) and OLMo apply; the collection is a host pause like any other (``gc``, charged by the
    overlap rule where ``pauses=True``).

    ``schedule(n)`` before step ``n`` runs (cheap when it does not collect: a modulo); ``close()`` turns
    automatic collection back on as it was."""

    def __init__(self, every_steps: int, generation: int = 2):
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"gc_every(n): n must be a whole number of steps >= 1, got {every_steps!r}")
        if isinstance(generation, bool) or generation not in (0, 1, 2):
            raise ValueError(f"gc_every(generation=...): a generation is 0, 1 or 2, got {generation!r}")
        self.every_steps = every_steps
        self.generation = generation
        self.collections = 0
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()  # a clean start: what the automatic collector left is collected now, once, on every rank

    def __call__(self, step: int) -> bool:
        """Before step ``step``: collect when it is a multiple of ``n``; whether it did."""
        if step % self.every_steps:
            return False
        gc.collect(self.generation)
        self.collections += 1
        return True

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
