"""Deep capture: a profiler trace of the steps after something went wrong, taken without anyone watching.

A trigger *arms* a capture; the training thread starts the profiler at the next step boundary (the
start of the next step, never inside one) and stops it at the boundary ``capture_steps`` steps later
(or at shutdown). Triggers:

* ``slow``: a finalized step whose own time (:func:`own_seconds`: its interval less the idle time a
  span names, an eval, a data wait, a checkpoint, a capture) is above both ``capture_slow_factor`` ×
  the run's median and the median + ``capture_slow_mad`` robust standard deviations (1.4826 × MAD)
  over the last ``capture_window_steps`` steps (ml-goodput-measurement's ideal step time uses
  median + 3·MAD; a capture wants fewer false alarms), and above :data:`TAIL_MARGIN` × the window's
  second-slowest step (a busy machine's noise tail). A step that held an eval or waited on its data
  is not slow: its trace would show the eval, not the step. Judged on the resolver thread as steps
  are finalized; needs ``MIN_STEPS`` steps first (the first ones compile).
* ``stall``: the stall watch saw the rank stop moving. A profiler cannot start inside a hang (the
  training thread is stuck), so the ``stall`` record's stacks are the hang's evidence, and the
  capture covers the steps once the rank moves again.
* ``request``: ``steptrace.request_capture()`` (from any thread, or a signal handler: it takes no lock,
  see :meth:`Capture.request`), or ``POST
  /v1/steptrace/capture`` with the ``capture_token`` on the rank's ``/metrics`` server
  (``steptrace.prometheus.CaptureRoute``).
* ``straggler``: the collector named this rank the run's straggler, or the reference rank to compare
  it with (``collector/_captures.py``). A daemon thread asks the collector every ``capture_poll_s``
  (``GET /v1/steptrace/capture``, the OTLP endpoint and headers); a failed poll is counted, never raised.
* ``spike``: a logged scalar (``s.log(loss=...)``; ``capture_spike_scalar``) above the median +
  ``capture_slow_mad`` robust standard deviations of its last values, or not finite (NaN, inf).

At most one capture at a time; then ``capture_cooldown_steps`` steps without one; at most
``capture_max`` per run and ``capture_max_bytes`` of trace files. A profiler that is already running
(the user's own) is detected and left alone: the capture is skipped and says so. Every capture, taken
or not, is a ``capture`` record (``status``: ``ok``, ``failed``, ``skipped``; ``reason``): an anomaly
trigger refused by the cooldown or a spent budget writes its own ``skipped`` record naming its step
and why; a repeated ``request`` refused for a budget already said spent is counted in the next
record's ``triggers_skipped``. A failure is never raised into the training loop.

Profilers: ``torch.profiler`` (CPU, and CUDA where available; a Chrome trace, ``trace.json``) or
``jax.profiler`` (an XProf trace under ``plugins/profile/``, and a Perfetto trace
``perfetto_trace.json.gz``). Both hold steptrace's step annotations (``annotate=True``), so the
trace's steps carry the recorded step numbers. The training thread starts and stops the profiler; a
writer thread collects and writes the trace and its record (``stop_seconds``: what the training thread
paid; ``write_seconds``: what it did not), so a trace of seconds to write does not stall the loop.

A leaf-level module: the runtime hands it what it needs as callables.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import shutil
import statistics
import threading
import time
from typing import Any, Callable

from steptrace._attribution import MAD_TO_SIGMA
from steptrace._pauses import pause_clause

log = logging.getLogger("steptrace")
_perf = time.perf_counter

#: Steps finalized before the slow-step trigger judges any (the first steps compile).
MIN_STEPS = 20
#: Where a steptrace collector hands out capture requests (collector/_captures.py).
CAPTURE_PATH = "/v1/steptrace/capture"


#: The slow-step threshold is recomputed every this many steps (a median and a MAD of the window each
#: time; in between a step costs one comparison on the resolver thread).
RECOMPUTE_EVERY = 10


#: Idle reasons that are not the step's own doing when judging a slow step: everything a span names.
#: ``other`` (idle no span covers) stays in: an unexplained host pause is what a trace should show.
UNNAMED_IDLE = "other"


def own_seconds(record: dict[str, Any]) -> tuple[float, float]:
    """``(the step's own seconds, its named idle seconds)``: the interval less the idle time that host
    spans name (``eval``, ``data``, ``checkpoint``, ``capture``, ``compile``, the user's own names). An
    eval run before ``begin_step`` (as the README says to) or a data stall is in the step's interval,
    as idle time by its reason; the step itself did not take longer."""
    interval = record["interval_seconds"]
    named = 0.0
    for reason, seconds in (record.get("idle_breakdown") or {}).items():
        if reason != UNNAMED_IDLE and isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0:
            named += seconds
    return max(0.0, interval - named), named


#: A slow step must also be this many times the second-slowest step of the window. A busy machine's
#: noise is heavy-tailed: a few steps in a hundred at 2-3x the median, with a small MAD between them
#: (the newcomer trial at load 10: 2.2x and 3.3x noise steps among 11 ms ones). Each would pass the
#: median bars and spend the capture budget on noise; a real slow step (a collection, a stall, a
#: preemption) stands above the run's own tail. On a quiet run the tail is near the median and the
#: factor bar decides. A recurring slow step stops triggering once two of it are in the window.
TAIL_MARGIN = 1.5


class SlowStepRule:
    """Is a finalized step's interval anomalous against the run's own recent steps? ``tail_margin``
    (None: off) also asks for that multiple of the window's second-largest value (:data:`TAIL_MARGIN`)."""

    def __init__(self, window_steps: int, factor: float, mad_k: float, min_steps: int = MIN_STEPS,
                 tail_margin: float | None = None):
        self._window: collections.deque[float] = collections.deque(maxlen=window_steps)
        self.factor = factor
        self.mad_k = mad_k
        self.tail_margin = tail_margin
        self.min_steps = min_steps
        self._median = 0.0
        self._threshold: float | None = None
        self._since = 0

    def _recompute(self) -> None:
        values = list(self._window)
        median = statistics.median(values)
        spread = MAD_TO_SIGMA * statistics.median([abs(v - median) for v in values])
        self._median = median
        threshold = max(self.factor * median, median + self.mad_k * spread)
        if self.tail_margin is not None:
            threshold = max(threshold, self.tail_margin * heapq.nlargest(2, values)[-1])
        self._threshold = threshold if median > 0 else None
        self._since = 0

    def judge(self, interval: float) -> tuple[float, float] | None:
        """``(ratio to the median, threshold)`` when ``interval`` is anomalous, else None; the interval
        then joins the window (an anomaly too: a run that settles at a slower pace stops triggering)."""
        if len(self._window) >= self.min_steps and (self._threshold is None or self._since >= RECOMPUTE_EVERY):
            self._recompute()
        threshold = self._threshold
        verdict = None
        if threshold is not None and interval > threshold:
            verdict = (interval / self._median, threshold)
        self._window.append(interval)
        self._since += 1
        return verdict


class _Profiler:
    """One running profiler: ``start()`` and ``stop()`` on the training thread, then ``write()`` on the
    capture's writer thread -> the path written. ``stop()`` is all the training thread waits for: what the
    profiler can collect and write on another thread, it does there."""

    name = "none"

    def __init__(self, directory: str):
        self.directory = directory

    @staticmethod
    def busy() -> bool:
        return False

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def write(self) -> str:
        raise NotImplementedError


class _TorchProfiler(_Profiler):
    """torch keeps the profiler's state per thread (``ProfilerStateBase`` in the calling thread's debug
    info): ``stop()`` from another thread finds "no active profiling session" and leaves the profiler
    running (torch 2.13, tried). So the stop, which also builds Kineto's results, stays on the training
    thread, and only the Chrome trace's export (``kineto_results.save``, C++ that releases the GIL: the
    training thread ran on, tested in tests/test_capture.py) goes to the writer."""

    name = "torch"

    @staticmethod
    def busy() -> bool:
        import torch

        return bool(torch.autograd._profiler_enabled())  # the C++ profiler's state: any torch profiler

    def start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def stop(self) -> None:
        self._profile.stop()

    def write(self) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, "trace.json")
        self._profile.export_chrome_trace(path)
        return path


#: Rewrites a JAX trace's ``*.trace.json.gz`` as ``perfetto_trace.json.gz`` beside it, without its
#: ``metadata`` (which ui.perfetto.dev refuses): what ``start_trace(create_perfetto_trace=True)`` makes,
#: in a child process, because it is one ``json.load`` of the whole trace holding the GIL (1.8 s for a
#: 3.5 MB trace here) that would stop the training thread just as long.
_PERFETTO_SCRIPT = """
import gzip, json, pathlib, sys
runs = (pathlib.Path(sys.argv[1]) / "plugins" / "profile").iterdir()
folder = max(runs, key=lambda run: run.stat().st_mtime)
(source,) = folder.glob("*.trace.json.gz")
with gzip.open(source, "rb") as f:
    trace = json.load(f)
trace.pop("metadata", None)
with gzip.open(folder / "perfetto_trace.json.gz", "wb") as f:
    f.write(json.dumps(trace).encode())
"""
#: How long the child process may take to write the Perfetto trace.
PERFETTO_TIMEOUT_S = 600.0


class _JaxProfiler(_Profiler):
    """jax.profiler's ``stop_trace()`` is one call that stops the tracers, collects the trace (XLA's
    ``ProfilerSession::CollectData``) and exports it (``ExportToTensorBoard``), then, with
    ``create_perfetto_trace``, rewrites it in Python (jax/_src/profiler.py, jaxlib 0.10.2). No public call
    stops the tracers alone, so the whole ``stop_trace`` runs on the writer thread, the moment the
    training thread hands it over: the trace runs on into the next step for the writer's first
    instructions (a GIL switch, ~5 ms). The collection and export release the GIL (the training thread's
    longest pause beside them: 0.09 s, for a 12 MB trace collected in 2.3 s and exported in 2.9 s); the
    Perfetto rewrite, which does not, runs in a child process (``_PERFETTO_SCRIPT``)."""

    name = "jax"

    def start(self) -> None:
        import jax

        os.makedirs(self.directory, exist_ok=True)
        # jax.profiler raises if a trace is already running (the user's): that is the busy check.
        jax.profiler.start_trace(self.directory)

    def stop(self) -> None:
        pass  # stop_trace() collects as it stops: the writer calls it (the class's docstring)

    def write(self) -> str:
        import subprocess
        import sys

        import jax

        jax.profiler.stop_trace()
        # -I -S: the child needs only the standard library, and nothing of the user's environment.
        try:
            subprocess.run([sys.executable, "-I", "-S", "-c", _PERFETTO_SCRIPT, self.directory], check=True,
                           timeout=PERFETTO_TIMEOUT_S, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except (OSError, subprocess.SubprocessError) as exc:
            # The XProf trace (the capture) is written; only its Perfetto copy is missing: said, not raised.
            detail = getattr(exc, "stderr", None)
            log.warning("steptrace capture: no perfetto_trace.json.gz beside the JAX trace in %s (%s%s)",
                        self.directory, exc, f": {detail.decode(errors='replace')[-500:]}" if detail else "")
        return self.directory


def directory_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class Capture:
    """The capture state of one runtime. ``pending`` and ``active`` are read by the training thread at
    every step boundary (two attribute reads); everything else happens only when one is set."""

    def __init__(self, *, directory: str, triggers: tuple[str, ...], profiler: str, steps: int,
                 cooldown_steps: int, max_captures: int, max_bytes: int, window_steps: int, slow_factor: float,
                 slow_mad: float, emit: Callable[[list[dict[str, Any]]], None], build: Any,
                 span: Callable[[str, float, float], None] | None = None,
                 spike_scalar: str = "loss", collector_url: str | None = None,
                 headers: tuple[tuple[str, str], ...] = (), poll_s: float = 5.0):
        self.directory = directory
        self.triggers = frozenset(triggers)
        self.profiler_name = profiler
        self.steps = steps
        self.cooldown_steps = cooldown_steps
        self.max_captures = max_captures
        self.max_bytes = max_bytes
        self._emit = emit
        self._build = build
        self._span = span
        self._rule = SlowStepRule(window_steps, slow_factor, slow_mad, tail_margin=TAIL_MARGIN) \
            if "slow" in triggers else None
        #: The scalar (``s.log(name=...)``) whose spikes trigger ``spike``: above the median + ``slow_mad``
        #: robust sigmas of its last values, or not finite.
        self.spike_scalar = spike_scalar
        self._spike = SlowStepRule(window_steps, 1.0, slow_mad) if "spike" in triggers else None
        #: Set by a trigger: (trigger, step it fired at, reason). Read by the training thread.
        self.pending: tuple[str, int | None, str] | None = None
        #: The running capture, or None.
        self.active: dict[str, Any] | None = None
        self.taken = 0
        self.bytes = 0
        self._cooldown_until: int | None = None  # first step that may start a capture again
        self.failures = 0
        # Guards a trace's write (the writer thread) against shutdown's wait for it. Never taken by a
        # trigger (see _arm): a signal handler may run while the training thread holds it.
        self._lock = threading.Lock()
        #: Triggers that took no trace and were not recorded (the cooldown, a budget already said spent),
        #: since the last capture record: its ``triggers_skipped``.
        self.triggers_skipped = 0
        self._said: set[str] = set()
        #: Polls of the collector that failed (unreachable, refused, malformed), and requests it gave.
        self.poll_failures = 0
        self.requests_received = 0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if "straggler" in triggers and collector_url:
            self._poll_url = collector_url.rstrip("/") + CAPTURE_PATH
            self._poll_headers = dict(headers)
            self._poll_s = poll_s
            self._poller = threading.Thread(target=self._poll_loop, name="steptrace-capture-poll", daemon=True)
            self._poller.start()
        #: (first, last) steps the slow-step rule skips: a running capture's (last None) or the last one's.
        self._ignored: tuple[int | None, int | None] = (None, None)

    # -- triggers (any thread) ----------------------------------------------------------------
    def _arm(self, trigger: str, step: int | None, reason: str) -> bool:
        """Whether this trigger armed the next capture (False: one armed or running covers it). A capture
        whose steps are over but whose trace is still being written covers nothing more: the trigger arms
        the next, which starts once the write has ended.

        Takes no lock: a signal handler (``request_capture()``) runs on the training thread between
        two bytecodes, possibly while that thread is inside :meth:`boundary`; a lock held there would
        never be released to it (the handler waits, nested handlers pile up until a RecursionError).
        Plain attribute reads and one store, each atomic under the GIL: two triggers racing from
        two threads can both see nothing armed, and the later store wins; one capture is armed either
        way, which covers both (as a trigger arriving while one is armed is covered). The training
        thread stores ``active`` before it clears ``pending``, so a trigger never sees neither while a
        capture starts."""
        active = self.active
        if self.pending is not None or (active is not None and "writer" not in active):
            return False  # one at a time: the running (or armed) capture covers this too
        self.pending = (trigger, step, reason)
        return True

    def step_finalized(self, record: dict[str, Any]) -> None:
        """The resolver, for each finalized ok step's record. Steps a capture profiled, and the one whose
        interval holds the trace's write, are not judged slow: a capture never triggers the next."""
        step = record["step"]
        if self._spike is not None:
            value = (record.get("scalars") or {}).get(self.spike_scalar)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(value):
                    self._arm("spike", step, f"{self.spike_scalar} was {value} at step {step}")
                else:
                    verdict = self._spike.judge(float(value))
                    if verdict is not None:
                        self._arm("spike", step, f"{self.spike_scalar} spiked to {value:.4g} at step {step} "
                                                 f"(threshold {verdict[1]:.4g}, the last steps' median + "
                                                 f"{self._spike.mad_k:g} robust sigmas)")
        if self._rule is None:
            return
        low, high = self._ignored
        if low is not None and step >= low and (high is None or step <= high):
            return
        own, named = own_seconds(record)
        verdict = self._rule.judge(own)
        if verdict is not None:
            ratio, threshold = verdict
            less = f" of its own (interval {record['interval_seconds'] * 1e3:.1f} ms less {named * 1e3:.1f} ms " \
                   "of named idle)" if named > 0 else ""
            self._arm("slow", step, f"step {step} took {own * 1e3:.1f} ms{less}, {ratio:.1f}x the run's median "
                                    f"(threshold {threshold * 1e3:.1f} ms){pause_clause(record)}")

    def stalled(self, step: int, open_seconds: float) -> None:
        """The stall watch, once per stall."""
        if "stall" in self.triggers:
            self._arm("stall", step, f"the rank stalled at step {step} for {open_seconds:.0f} s (the stall "
                                     "record holds its stacks); the capture covers the steps once it moved again")

    def _poll_loop(self) -> None:
        import json
        import urllib.parse
        import urllib.request

        query = urllib.parse.urlencode({"run_id": self._build.run_id, "rank": self._build.rank})
        request = urllib.request.Request(f"{self._poll_url}?{query}", headers=self._poll_headers)
        while not self._stop.wait(self._poll_s):
            try:
                with urllib.request.urlopen(request, timeout=min(5.0, self._poll_s)) as response:
                    answer = json.loads(response.read(65536))
            except Exception as exc:
                self.poll_failures += 1
                if self.poll_failures == 1:
                    log.warning("steptrace capture: cannot ask the collector for capture requests at %s (%s); "
                                "further failures are counted", self._poll_url, exc)
                continue
            if isinstance(answer, dict) and answer.get("capture") is True:
                self.requests_received += 1
                step = answer.get("step")
                self._arm("straggler", step if isinstance(step, int) and not isinstance(step, bool) else None,
                          str(answer.get("reason") or "the collector asked")[:300])

    def request(self, reason: str = "requested") -> bool:
        """``steptrace.request_capture()`` and the HTTP trigger: whether it armed the next capture (False: one
        already armed or running covers it). Lock-free (see :meth:`_arm`): safe in a signal handler at any
        instant, however often and however nested; the training thread acts on it at the next step
        boundary."""
        return self._arm("request", None, reason)

    # -- the training thread, at a step boundary -------------------------------------------------
    def boundary(self, next_step: int) -> None:
        """Called before step ``next_step`` starts when ``pending`` or ``active`` is set."""
        active = self.active
        if active is not None:
            writer = active.get("writer")
            if writer is None:
                if next_step >= active["first_step"] + self.steps:
                    self._finish(active, next_step - 1)
                return
            if writer.is_alive():
                return  # one profiler at a time: an armed capture starts once this trace is written
            self._written(active, next_step)
        pending = self.pending
        if pending is None:
            return
        self._start(pending, next_step)

    def _record(self, **fields: Any) -> None:
        record = {"type": "capture", "run_id": self._build.run_id, "rank": self._build.rank,
                  "attempt": self._build.attempt, **fields, "triggers_skipped": self.triggers_skipped}
        self.triggers_skipped = 0
        try:
            self._emit([record])
        except Exception:
            log.debug("steptrace capture: the record could not be emitted", exc_info=True)

    def _skip(self, pending: tuple[str, int | None, str], step: int, why: str, kind: str | None = None) -> None:
        """A trigger that takes no trace, said in a ``skipped`` record naming the step it fired at and why.
        An anomaly trigger (slow, spike, stall, straggler) is rare by construction and always said, in the
        cooldown too: a slow step the cooldown refused must leave a trace of its own. A ``request`` refused
        again for a reason already said (``kind``: the cooldown, a spent budget) is counted in the next
        record's ``triggers_skipped`` instead: a signal per step would otherwise write a record per step."""
        trigger, fired, reason = pending
        self.pending = None
        if trigger == "request" and kind is not None and kind in self._said:
            self.triggers_skipped += 1
            return
        if kind is not None and trigger == "request":
            self._said.add(kind)
        self._record(status="skipped", trigger=trigger, trigger_step=fired, reason=reason, skipped_because=why,
                     first_step=None, last_step=None, path=None, profiler=None, bytes=0,
                     start_time=time.time(), end_time=time.time())

    def _profiler(self, directory: str) -> _Profiler | None:
        name = self.profiler_name
        import sys

        if name == "auto":
            name = "torch" if "torch" in sys.modules else "jax" if "jax" in sys.modules else ""
        if name == "torch":
            return _TorchProfiler(directory)
        if name == "jax":
            return _JaxProfiler(directory)
        return None

    def _refused(self, step: int | None) -> tuple[str, str] | None:
        """Why a capture armed for ``step`` takes no trace (why, kind), or None: the cooldown, a budget
        (``step`` None: the budgets only)."""
        if step is not None and self._cooldown_until is not None and step < self._cooldown_until:
            return (f"cooldown: no capture before step {self._cooldown_until} "
                    f"(capture_cooldown_steps={self.cooldown_steps})"), "cooldown"
        if self.taken >= self.max_captures:
            return f"capture_max ({self.max_captures}) reached", "max"
        if self.bytes >= self.max_bytes:
            return f"capture_max_bytes ({self.max_bytes}) reached", "bytes"
        return None

    def _start(self, pending: tuple[str, int | None, str], step: int) -> None:
        refused = self._refused(step)
        if refused is not None:
            self._skip(pending, step, refused[0], kind=refused[1])
            return
        directory = os.path.join(self.directory, f"step-{step}")
        profiler = self._profiler(directory)
        if profiler is None:
            self._skip(pending, step, "no profiler: neither torch nor jax is imported (capture_profiler)")
            return
        started = _perf()
        try:
            if profiler.busy():
                self._skip(pending, step, f"a {profiler.name} profiler is already running (yours): left alone")
                return
            profiler.start()
            started_seconds = _perf() - started
            if self._span is not None:
                # Starting a profiler can take seconds (Kineto's first start): idle time of its own, named.
                self._span("capture", started, _perf())
        except Exception as exc:
            if "already" in str(exc).lower() or "only one" in str(exc).lower():
                self._skip(pending, step, f"a {profiler.name} trace is already running (yours): left alone")
                return
            # A profiler that would not start is a failure (status "failed", counted like a failed stop), not
            # a skip: steptrace_captures_total{status="failed"} is then every failure.
            self.failures += 1
            self.pending = None
            self._record(status="failed", trigger=pending[0], trigger_step=pending[1], reason=pending[2],
                         first_step=None, last_step=None, path=None, profiler=profiler.name, bytes=0,
                         start_time=time.time(), end_time=time.time(),
                         error=f"the profiler did not start: {type(exc).__name__}: {exc}")
            return
        with self._lock:  # (the writer thread's bookkeeping; a trigger takes no lock, see _arm)
            self._ignored = (step, None)
            # ``active`` before ``pending`` is cleared: a trigger in between (a signal) sees one running.
            self.active = {"trigger": pending[0], "trigger_step": pending[1], "reason": pending[2],
                           "first_step": step, "profiler": profiler, "start": time.time(),
                           "start_seconds": started_seconds}
            self.pending = None
        self.taken += 1

    def _finish(self, active: dict[str, Any], last_step: int | None) -> None:
        """The training thread: stop the profiler and hand the collection and the write to a writer thread.
        The capture stays ``active`` (one at a time) until the next boundary after the write ended."""
        profiler: _Profiler = active["profiler"]
        start = _perf()
        error = None
        try:
            profiler.stop()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        end = _perf()
        if self._span is not None:
            try:
                self._span("capture", start, end)  # the stop's pause is idle time of its own, named
            except Exception:
                pass
        covered = last_step if last_step is not None else active["first_step"]
        self._cooldown_until = covered + 1 + self.cooldown_steps
        fields = {"status": "ok", "trigger": active["trigger"], "trigger_step": active["trigger_step"],
                  "reason": active["reason"], "first_step": active["first_step"], "last_step": last_step,
                  "path": None, "profiler": profiler.name, "bytes": 0, "start_time": active["start"],
                  "start_seconds": active["start_seconds"], "stop_seconds": end - start}
        writer = threading.Thread(target=self._write, args=(active, fields, error), daemon=True,
                                  name="steptrace-capture-write")
        with self._lock:
            active["writer"] = writer
            active["recorded"] = False
            active["last_step"] = last_step
        writer.start()

    def _write(self, active: dict[str, Any], fields: dict[str, Any], error: str | None) -> None:
        """The writer thread: collect and write the trace, then its record."""
        profiler: _Profiler = active["profiler"]
        start = _perf()
        path, size = None, 0
        if error is None:
            try:
                path = profiler.write()
                size = directory_bytes(path)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            shutil.rmtree(profiler.directory, ignore_errors=True)
            fields.update(status="failed", error=error)
        fields.update(path=path, bytes=size, write_seconds=_perf() - start, end_time=time.time())
        with self._lock:
            if active["recorded"]:
                return  # shutdown stopped waiting for this write and recorded it as failed (and counted it)
            active["recorded"] = True
            self.bytes += size
            if error is not None:
                self.failures += 1
        self._record(**fields)

    def _written(self, active: dict[str, Any], next_step: int) -> None:
        """The training thread, at the first boundary after the write ended: the capture is over. Steps up
        to this one ran beside the write (its CPU, the pauses it may cause): the slow-step rule skips them."""
        with self._lock:
            self.active = None
            self._ignored = (active["first_step"], next_step - 1)

    def close(self, last_step: int | None, timeout_s: float | None = None) -> None:
        """At shutdown: stop a running capture (it covered the steps up to ``last_step``) and wait up to
        ``timeout_s`` for its write; a write still going then is recorded as failed. An armed capture that
        never started is recorded as skipped."""
        self._stop.set()
        active = self.active
        if active is not None:
            if active.get("writer") is None:
                self._finish(active, max(active["first_step"], last_step if last_step is not None else -1))
            waited = _perf()
            active["writer"].join(timeout_s)
            with self._lock:
                late = not active["recorded"]
                active["recorded"] = True
                self.active = None
            if late:
                self.failures += 1
                error = f"the trace was still being written when shutdown stopped waiting ({_perf() - waited:.1f} s)"
                self._record(status="failed", trigger=active["trigger"], trigger_step=active["trigger_step"],
                             reason=active["reason"], first_step=active["first_step"],
                             last_step=active["last_step"], path=None, profiler=active["profiler"].name,
                             bytes=0, start_time=active["start"], end_time=time.time(), error=error)
        pending = self.pending
        if pending is not None:
            # Armed while the last trace was written, or after the last step: a budget spent by that trace
            # is the reason, else the run's end.
            refused = self._refused(None)
            if refused is not None:
                self._skip(pending, -1, refused[0], kind=refused[1])
            else:
                self._skip(pending, -1, "the run ended before the next step")
