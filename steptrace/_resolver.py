"""The resolver: a background thread that learns when the device finished each step
and turns the training thread's raw observations into finalized records.

Items arrive in the order the training thread produced them and are
finalized in that order, so ``end(n-1)`` is always known when step ``n`` is
resolved. Waiting on the device happens here and only here: the training
thread never waits because of steptrace.

* Stream units (CUDA): the resolver polls their markers (``query``) every
  ``_STREAM_POLL_S`` and, once complete, reads their durations from the device
  clock and places them on the host clock (``steptrace._clock``). When it looks
  changes nothing in what it records, so it looks rarely and finalizes what
  completed in one batch: few GIL hand-offs with the training thread, no
  spinning core. It never waits on the device: a unit is finalized on the
  first poll that finds its markers complete, whatever the calibration state
  (the record's ``placement_uncertainty_seconds`` says how well it is placed).
* Value units (JAX): as soon as they arrive, the resolver asks the device for
  a device-clock end (JAX on a CUDA GPU: the outputs handed to a stream of
  steptrace's own, an event behind them; ``end_source: "device"``) and then
  polls it as it polls markers. Elsewhere it blocks on the outputs and reads
  the clock when the wait returns (``end_source: "observed"``), so it waits on
  them as soon as they arrive.
"""

from __future__ import annotations

import collections
import logging
import math
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from steptrace import _attribution as attribution
from steptrace import _loops, _peaks
from steptrace._clock import DeviceClock
from steptrace._devices import HOST
from steptrace._pauses import summary as host_pauses_summary
from steptrace._handles import CheckpointHandle, ClosedSpan, StepHandle, TimedUnit
from steptrace._schema import (
    DROP_DEVICE_CLOCK_ERROR,
    DROP_DEVICE_WAIT_ERROR,
    DROP_GC_PAUSES,
    DROP_RESOLVER_ERROR,
    DROP_RESOLVER_QUEUE,
    DROP_SCALAR_ERROR,
    DROP_UNRESOLVED_AT_SHUTDOWN,
    CheckpointRecord,
    RecordBuilder,
    SpanRecord,
    StepRecord,
)
from steptrace._sinks import SinkWorker
from steptrace._wakeup import Wakeup

if TYPE_CHECKING:
    from steptrace._config import Config

log = logging.getLogger("steptrace")
_perf = time.perf_counter
# How many step end times are kept for checkpoints that refer to an earlier step.
_STEP_ENDS_KEPT = 4096
#: How long the resolver sleeps between two bursts of items it finalizes (it gives the GIL away; see _run).
_YIELD_S = 50e-6
#: While a stream device (CUDA) is timed, the resolver finalizes the ready steps at the head of its queue
#: for up to this long in one go, then gives the GIL away (_YIELD_S). One sleep per step cost ~10 µs of
#: CPU and ~160 µs of wall time on the 2-vCPU VM (a backlog of short steps was finalized at most ~4,000
#: a second); the training thread still waits for the GIL at most about this long.
_BURST_S = 100e-6
# How long an idle resolver sleeps before looking at its queue again.
_IDLE_POLL_S = 0.02
# The same while steps are timed by their values (JAX) and no stream device is timed: each such step
# wakes the resolver as it is handed over, so looking sooner only finds the items that do not wake it
# (a checkpoint, a span after the last step), whose times do not depend on when they are looked at.
# Each look costs a thread wake-up: ~100 us of CPU on the 2-vCPU VM of bench_jax_trainer.py, where
# the 20 ms looks during evals and checkpoints were ~100 us of the resolver's CPU per step.
_IDLE_POLL_VALUES_S = 0.25
# The idle back-off (Resolver._idle_poll). Otherwise (host-timed steps, which do not wake it; or no
# step yet) an idle resolver that found nothing doubles its sleep, from _IDLE_POLL_S up to
# _IDLE_POLL_VALUES_S, and goes back to _IDLE_POLL_S at the next item: a host step's record is then late
# by at most that, and an idle process does not wake 50 times a second. On nanodo (a JAX loop) the 20 ms
# looks before its first step (initialising and compiling, ~5 s) were ~270 wake-ups: 100-170 µs of the
# resolver's CPU per step of a 121-step run. Not while a stream device is timed (idle looks anchor its
# clock) or the capture reads each finalized step (a slow step arms a profile of the steps right after).
# How often the resolver looks at the markers of a stream unit that has not completed. Its
# times come from the device clock, so this sets only how fresh the records are.
_STREAM_POLL_S = 0.02
# Stream items confirmed complete in one look (one calibration anchor serves them all).
_CONFIRM_BATCH = 256
# Steps from the queue's head whose value device is asked for a device-clock end ahead of their turn
# (a JAX loop runs a few steps ahead of its GPU).
_PREPARE_AHEAD = 16
# Step records the resolver hands the sinks at once, at most: while it works through a backlog it
# gathers them (one offer, one wake-up per sink instead of one per step); it hands them over as
# soon as its queue is empty, before anything else, and before it waits.
_EMIT_BATCH = 256
# Steps timed by their values (JAX, no stream marker) are observed one at a time, as each ends (the wait
# on its outputs, its end, its host exit, its device memory and scalars), and finalized together (their records, the
# timing model, the spans): up to this many, or as soon as the oldest was observed this long ago. The
# observation is the part that must happen per step, right after a wake-up, on caches the training loop
# evicted; the rest costs ~2-4x less run back to back (bench_jax_trainer.py --cpu-breakdown). The stall
# watch's pace is fed at the observation, so it does not wait for the batch.
_DEFER_STEPS = 16
_DEFER_S = 1.0
# How long the record of a steps() step whose body raised waits for the exception to be readable
# (it ended the program, or a steptrace call in its handler) before it is written with the place the
# body raised instead (_loops). The training thread settles it at once at its next steptrace call.
ERROR_TEXT_WAIT_S = 30.0
# end_source values: where a unit's end time came from.
END_DEVICE_CLOCK = "device_clock"  # a stream marker's device timestamp, placed on the host clock
END_DEVICE = "device"  # the device reported the completion time itself
END_OBSERVED = "observed"  # the resolver saw the wait return (late by any GIL hold meanwhile)
END_HOST = "host"  # synchronous work: the host clock at the end of the block


class RunStart:
    """Queued at the first step: the resolver writes the run's metadata record (off the training thread)."""

    __slots__ = ("host_start", "tags", "cuda_index")

    def __init__(self, host_start: float, tags: dict[str, str], cuda_index: int | None = None):
        self.host_start = host_start
        self.tags = tags
        self.cuda_index = cuda_index  # the GPU the rank's steps are timed on (training thread's choice)


class AttemptStart:
    """Queued at init(): the resolver writes the ``attempt`` record (process start, attempt source)."""

    __slots__ = ("init_time", "source", "run_id_source")

    def __init__(self, init_time: float, source: str, run_id_source: str):
        self.init_time = init_time
        self.source = source
        self.run_id_source = run_id_source


class _Tail:
    """Spans closed after the last step, handed over by flush()/shutdown()."""

    __slots__ = ("spans", "done")

    def __init__(self, spans: list["ClosedSpan"]):
        self.spans = spans
        self.done = threading.Event()


class Resolver:
    """Finalizes steps, checkpoints, spans and microbatches; fans records out to sinks."""

    def __init__(self, config: "Config", sinks: Iterable[Any]):
        self.config = config
        # Records carry unix seconds; the model runs on the monotonic clock.
        self.unix_offset = time.time() - _perf()
        self.records = RecordBuilder(run_id=config.run_id, rank=config.rank, world_size=config.world_size,
                                     peak_tflops=config.peak_tflops, unix_offset=self.unix_offset,
                                     attempt=config.attempt)
        self.dropped: collections.Counter[str] = collections.Counter()
        self._drop_lock = threading.Lock()
        self.sinks = [SinkWorker(sink, config.max_queue, self.count_drop) for sink in sinks]
        self._queue: collections.deque[Any] = collections.deque()
        self._max_queue = config.max_queue  # read at every submit (the training thread)
        self._emit_lock = threading.Lock()
        #: Step records finalized and not handed to the sinks yet (resolver thread; see _EMIT_BATCH).
        self._pending: list[Mapping[str, Any]] = []
        #: Told each finalized step's interval (the stall watch's pace), when one runs.
        self.on_step_interval: Any = None
        #: Told each finalized ok step's record (the capture's slow-step and spike triggers), when one runs.
        self.on_step_finalized: Any = None
        #: The GPU health sampler (steptrace/_health.py), when one runs: each step takes its window.
        self.health: Any = None
        #: The training thread's host pauses (steptrace/_pauses.py), when watched: each step takes its own.
        self.pauses: Any = None
        self._pauses_dropped = 0
        self._wake = Wakeup()
        self._sleeping = False
        #: True while the resolver waits for the head step's device-clock end (submit() then wakes it).
        self._polling_device_end = False
        self._stopping = False
        self._prev_end: float | None = None
        #: When steptrace started (init()): time before the first step is counted from here.
        self.started = _perf()
        self._recent: list[Any] = []  # ClosedSpan, and HostSpan for a garbage collection (pauses)
        self._step_ends: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._wait_failures = 0
        self._clocks: dict[int, DeviceClock] = {}
        #: CPU seconds the resolver spent inside a value device's wait (part of ``cpu_seconds``).
        self.wait_cpu_seconds = 0.0
        self._clock_failures = 0
        self._new_bases: list[tuple[DeviceClock, Any, float]] = []
        self._prev_end_g: tuple[DeviceClock, float, int] | None = None
        self.records_emitted = 0
        self.steps_resolved = 0
        #: How this run measures each step's wait in collectives (set by an adapter at the first
        #: step, e.g. "torch.distributed"); None: not measured, the step records leave it out.
        self.collective_source: str | None = None
        #: CPU seconds this thread has used (it holds the GIL for nearly all of them).
        self.cpu_seconds = 0.0
        self._abandon = False
        self._busy = False
        # This process start of the run, written first (the step records of a crashed attempt
        # still say which attempt they belong to, and the accounting when it started).
        self._queue.append(AttemptStart(self.started, config.attempt_source, config.run_id_source))
        self._device_kind: str | None = None
        #: True while the last step resolved was timed by its values (JAX): the next one wakes this thread.
        self._steps_wake = False
        self._device_platform: str | None = None
        self._warned_no_peak = False
        #: Plain steps take the fast path (_resolve_plain), CUDA steps with their two markers theirs
        #: (_resolve_marked); off, every step takes the general one (tests).
        self.fast_path = True
        #: Steps finalized on the CUDA fast path (_resolve_marked).
        self.fast_cuda_steps = 0
        #: Value-timed steps observed and not finalized yet (see _DEFER_STEPS); off (tests), each is
        #: finalized as observed, as in a run whose capture or GPU health sampler reads each one (_deferrable).
        self.defer_values = True
        self._deferred: list[StepHandle] = []
        #: The next idle sleep while nothing wakes this thread (see _IDLE_POLL_S): doubles while idle.
        self._idle_poll = _IDLE_POLL_S
        self._deferred_since = 0.0
        #: The end of the last deferred step (the next one's interval for the stall watch starts there).
        self._observed_end = 0.0
        self._thread = threading.Thread(target=self._run, name="steptrace-resolver", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------
    def submit(self, item: Any, urgent: bool = False) -> None:
        """Queue ``item``. ``urgent``: its device completion must be observed promptly.

        Waking a sleeping thread costs microseconds on the training thread, so
        it is paid only for urgent items; the rest wait for the resolver's next
        round (at most ``_IDLE_POLL_VALUES_S``), which does not change their timings.
        """
        if self._stopping or len(self._queue) >= self._max_queue:
            self.count_drop(DROP_RESOLVER_QUEUE)
            return
        self._queue.append(item)
        if urgent and (self._sleeping or self._polling_device_end):
            # Polling a device-clock end: the new step's outputs must be handed to the device before
            # they are ready, or its end can only be observed.
            self._wake.set()

    def count_drop(self, reason: str, count: int = 1) -> None:
        with self._drop_lock:
            self.dropped[reason] += count

    def dropped_snapshot(self) -> dict[str, int]:
        """Drops so far by reason (``sink:<name>``, ``resolver_queue``, ``misuse``, ...); any thread."""
        with self._drop_lock:
            return dict(self.dropped)

    def flush(self, closed: list["ClosedSpan"], timeout_s: float | None) -> bool:
        deadline = time.monotonic() + (1e9 if timeout_s is None else timeout_s)
        tail = _Tail(closed)
        self._queue.append(tail)  # never dropped: flush must be able to finish
        self._wake.set()
        if not tail.done.wait(max(0.0, deadline - time.monotonic())):
            return False
        exported = [worker.exported(deadline) for worker in self.sinks]
        # Every sink's own force_flush at once, each on a thread of its own: one that hangs (a tracker
        # whose server is gone) costs the others none of their time, and the caller no more than timeout_s.
        calls = [worker.begin_flush() if done else None for worker, done in zip(self.sinks, exported)]
        return all([done and worker.end_flush(call, deadline)
                    for worker, done, call in zip(self.sinks, exported, calls)])

    def shutdown(self, closed: list["ClosedSpan"], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        # Keep a fifth of the budget for the sinks, so the run record (with the drop
        # counts) still goes out when the device never finishes.
        resolve_deadline = time.monotonic() + 0.8 * timeout_s
        complete = self.flush(closed, 0.8 * timeout_s)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, resolve_deadline - time.monotonic()))
        self._abandon = True  # a unit still polled for will not be finalized now
        unresolved = (sum(1 for item in self._queue if not isinstance(item, _Tail)) + (1 if self._busy else 0)
                      + len(self._deferred))
        if unresolved:
            self.count_drop(DROP_UNRESOLVED_AT_SHUTDOWN, unresolved)
        # Stop the sinks first, so their counts are final (records still queued, a batch stuck in
        # an export that never returned): the run record then carries the final numbers. It is
        # the one record those counts cannot include (it is written after them).
        for worker in self.sinks:
            worker.begin_stop()
        # What is left is shared by the phases: a sink stuck in its export must not use up the time of the
        # others' last export and shutdown (a JSONL file's close would be called hung for want of a turn).
        left = max(0.0, deadline - time.monotonic())
        stop_deadline = deadline - 0.4 * left
        deliver_deadline = deadline - 0.2 * left
        flushes = [worker.stop_thread(stop_deadline) for worker in self.sinks]
        for worker, call in zip(self.sinks, flushes):
            worker.end_stop(call, stop_deadline)
            complete = worker._stop_complete and complete
        run_record = self.records.run(steps=self.steps_resolved, dropped=self.dropped_snapshot(),
                                      background_cpu_seconds=self.background_cpu_seconds(),
                                      device_clock=self.clock_stats())
        if not self._thread.is_alive():  # give the anchors' markers back (the thread no longer uses them)
            for clock in self._clocks.values():
                clock.close()
        # The sinks' own last export and shutdown, each off this thread and bounded by the deadline: a
        # tracker's shutdown that hangs leaves its unconfirmed records counted as dropped, and said.
        delivered = [worker.begin_deliver([run_record]) for worker in self.sinks]
        for worker, call in zip(self.sinks, delivered):
            worker.end_deliver(call, 1, deliver_deadline)
        closing = [worker.begin_close(deadline) for worker in self.sinks]
        for worker, call in zip(self.sinks, closing):
            complete = worker.end_close(call, deadline) and complete
        return complete and not unresolved

    def forked(self) -> None:
        """In a forked child (see ``Runtime.forked``): take nothing more, drop the copied queues (the
        parent finalizes and exports them), and give the locks a thread of the parent may have held at
        the fork fresh copies, so nothing in the child can wait on them."""
        self._stopping = True
        self._abandon = True
        self._drop_lock = threading.Lock()
        self._emit_lock = threading.Lock()
        self._queue.clear()
        self._pending = []
        self._deferred = []
        for worker in self.sinks:
            worker.forked()

    # -- resolver thread ---------------------------------------------------------------
    def _run(self) -> None:
        queue = self._queue
        cpu_start = time.thread_time()
        while True:
            if not queue:
                if self._clocks or self.on_step_finalized is not None:
                    timeout = _IDLE_POLL_S
                elif self._steps_wake:
                    timeout = _IDLE_POLL_VALUES_S
                else:
                    timeout = self._idle_poll
                    self._idle_poll = min(_IDLE_POLL_VALUES_S, 2 * timeout)
                if self._deferred:
                    age = _perf() - self._deferred_since
                    if age >= _DEFER_S or self._stopping:
                        self._finalize_deferred()
                    else:
                        timeout = min(timeout, _DEFER_S - age)
                if self._pending:
                    self._emit_pending()
                if self._clocks and not self._stopping:
                    self._poll_idle_clocks()  # an idle resolver is the moment to anchor a drained device
                self.cpu_seconds = time.thread_time() - cpu_start
                if self._stopping:
                    return
                self._sleeping = True
                if not queue:  # re-check after announcing sleep: submit() may have just appended
                    self._wake.wait(timeout)
                self._sleeping = False
                continue
            item = queue[0]
            if item.__class__ is StepHandle and item.values is not None and self._device_end_due(item):
                self._prepare_device_ends()
            try:
                ready = self._ready(item)
            except Exception:
                ready = True  # let _handle fail on it and count it
            if not ready:
                if self._deferred:
                    self._finalize_deferred()
                if self._pending:
                    self._emit_pending()
                self.cpu_seconds = time.thread_time() - cpu_start
                if self._abandon:
                    return
                self._polling_device_end = item.device_end is not None
                if self._polling_device_end and len(queue) > 1:
                    self._prepare_device_ends()  # steps handed over while this one runs on the device
                self._wake.wait(_STREAM_POLL_S)  # flush(), shutdown() and, here, new steps wake it early
                self._polling_device_end = False
                continue
            queue.popleft()
            self._idle_poll = _IDLE_POLL_S
            self._busy = True
            try:
                self._handle(item)
            except Exception:
                self.count_drop(DROP_RESOLVER_ERROR)
                log.exception("steptrace resolver failed on %r; the record is dropped and counted", item)
            finally:
                self._busy = False
            # Give the GIL away between items: torch's ops release it around every launch, and a
            # training thread that needs it back waits for whatever this thread runs meanwhile (up to
            # the 5 ms switch interval), while the GPU may sit idle behind an unrecorded marker. Only
            # where a stream device (CUDA) is timed: a sleep of 50 us takes 100-200 us on Linux, which
            # bounded the resolver at ~6,000 items/s and made each flush() wait that long per item;
            # elsewhere nothing waits on a marker, and even a sleep(0) cost 40-75 us of CPU per item in GIL
            # hand-overs with the sink threads (bench_overhead: background 137 -> 60 us per step).
            if self._clocks:
                time.sleep(_YIELD_S)

    @staticmethod
    def _device_end_due(step: "StepHandle") -> bool:
        """Whether the queue is to be looked ahead for a device-clock end before ``step`` is: it has values
        not yet handed to its device, and its device may give one (see _prepare_device_ends)."""
        return (step.values is not None and not step.end_prepared
                and getattr(step.device, "prepare_end", None) is not None)

    def _prepare_device_ends(self) -> None:
        """Ask the value device of each step near the queue's head for a device-clock end, once per step
        (JAX on a CUDA GPU hands the outputs to the device now, while they are still being computed).
        Not called for a device whose ``prepare_end`` is None: one that said it has no device-clock end
        (JAX on CPU or TPU), where this look ahead cost ~12 µs of cold CPU per step for nothing."""
        queue = self._queue
        for i in range(min(len(queue), _PREPARE_AHEAD)):
            unit = queue[i]
            # A step without values (host, CUDA) has no device-clock end to ask for: it was queued at
            # its exit, a value step at wait_for, with its values.
            if unit.__class__ is not StepHandle or unit.values is None or unit.end_prepared:
                continue
            unit.end_prepared = True
            prepare = getattr(unit.device, "prepare_end", None)
            if prepare is not None:
                try:
                    unit.device_end = prepare(unit.values)
                except Exception:
                    unit.device_end = None  # observed, as without a device clock

    def _ready(self, item: Any) -> bool:
        """False while the head item's stream markers are incomplete (the resolver never blocks on them).

        When the head is complete, the stream items queued behind it are checked too, and all
        that are complete get one ``seen_complete`` time: one calibration anchor taken after it
        then serves every marker of the batch.
        """
        if getattr(item, "error_pending", False) and not _loops.settle(
                item, on_loop_thread=False, give_up=_perf() - (item.host_end or 0.0) > ERROR_TEXT_WAIT_S):
            return False  # a steps() body raised: its record waits (bounded) for the exception's text
        if getattr(item, "microbatches", None) is None or item.seen_complete:
            return True  # checkpoints and flush markers; or confirmed with an earlier batch
        if not item.microbatches and item.device_end is None and not item.scalars and not item.device.uses_events:
            return True  # no marker, pending device-clock end or device scalar: nothing to look at
        self._poll_clocks(item)
        if not self._markers_complete(item):
            return False
        confirmed = [item]
        queue = self._queue
        for i in range(1, min(len(queue), _CONFIRM_BATCH)):
            later = queue[i]
            if getattr(later, "microbatches", None) is None:
                continue
            if later.values is not None or not self._markers_complete(later):
                break  # a value unit (its host part may still be running), or not done yet
            confirmed.append(later)
        seen = _perf()
        for unit in confirmed:
            unit.seen_complete = seen
        return True

    def _poll_clocks(self, step: "StepHandle") -> None:
        """Give the step's device clock one look at its calibration anchor (never waits on the device)."""
        device = step.device
        if not device.uses_events:
            return
        try:
            drained = getattr(device, "drained", None)
            self._clock(device).poll(True if drained is None else drained)  # asked only if an anchor is due
        except Exception:
            pass  # an anchor is an improvement to placement, never a condition for a record

    def _poll_idle_clocks(self) -> None:
        for clock in list(self._clocks.values()):
            try:
                drained = getattr(clock.device, "drained", None)
                clock.poll(True if drained is None else drained)
            except Exception:
                pass

    @staticmethod
    def _markers_complete(step: "StepHandle") -> bool:
        if step.device_end is not None:
            try:
                if not step.device_end.complete():
                    return False
            except Exception:
                pending, step.device_end = step.device_end, None  # unreadable: observed in _unit_end
                try:
                    pending.release()  # its events back to the device's pool
                except Exception:
                    pass
        for unit in (step, *step.microbatches):
            device = unit.device
            if device.uses_events:
                if unit.end_event is not None:
                    before = _perf()
                    if not device.query(unit.end_event):
                        unit.seen_incomplete = before  # a lower bound on its device timestamp
                        return False
                    # The start marker went on the same stream before the end marker (Runtime.end_marker
                    # records on the unit's stream): a stream runs in order, so it has completed too.
                    continue
                if unit.start_event is not None and not device.query(unit.start_event):
                    return False
        if step.scalars:
            # A device scalar's copy to the host is queued on its own GPU's stream, which may be another
            # than the step's markers': the step is read once the copy has landed too (never waited on).
            for reader in step.scalars.values():
                ready = getattr(reader, "ready", None)
                if ready is not None and not ready():
                    return False
        return True

    def background_cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used by steptrace's background threads, by thread (``resolver``, ``sink:<name>``)."""
        seconds = {"resolver": self.cpu_seconds}
        if self.health is not None:
            seconds["health"] = self.health.cpu_seconds
        if self.wait_cpu_seconds:
            # Of the resolver's CPU, what the framework's own wait used (jaxlib's block_until_ready
            # costs ~20 us of CPU per ms it waits on the CPU backend; measured, docs/records.md).
            seconds["resolver:framework_wait"] = self.wait_cpu_seconds
        for worker in self.sinks:
            seconds[f"sink:{worker.name}"] = worker.cpu_seconds
        return seconds

    def clock_stats(self) -> dict[str, Any]:
        """Calibration figures of each stream device's clock, by backend name."""
        return {getattr(clock.device, "clock_name", clock.device.name): clock.stats()
                for clock in list(self._clocks.values())}

    def _handle(self, item: Any) -> None:
        if isinstance(item, StepHandle):
            self._finalize_steps(item)
            return
        if self._deferred:
            self._finalize_deferred()  # a checkpoint reads the ends of the steps before it
        if self._pending:
            self._emit_pending()  # records go out in the order they were finalized
        if isinstance(item, CheckpointHandle):
            self._emit([self._checkpoint_record(item)])
        elif isinstance(item, AttemptStart):
            import os
            import socket

            from steptrace._attempts import process_start_time

            started = process_start_time()
            init_unix = item.init_time + self.unix_offset
            self._emit([self.records.attempt_started(
                process_start=init_unix if started is None or started > init_unix else started,
                init_time=item.init_time, source=item.source, pid=os.getpid(), hostname=socket.gethostname(),
                run_id_source=item.run_id_source)])
        elif isinstance(item, RunStart):
            from steptrace import _metadata

            facts = _metadata.collect(item.tags, item.cuda_index)
            self._device_kind = facts["devices"].get("kind")
            self._device_platform = facts["devices"].get("platform")
            peak = _peaks.lookup(self._device_kind)
            self.records.set_peak(peak.tflops * 1e12 if peak is not None else None)
            self._emit([self.records.metadata(start=item.host_start, facts=facts)])
        elif isinstance(item, _Tail):
            for span in item.spans:
                self._release_span_marker(span)
            self._recent.extend(item.spans)
            self._emit([self._span_record(s) for s in item.spans if s.emit])
            item.done.set()

    def _finalize_steps(self, step: "StepHandle") -> None:
        """Finalize ``step``, then every step queued right behind it that is ready now, in this one pass
        (a backlog: a tight loop of short steps, or steps the resolver fell behind on), their records
        gathered for the sinks (``_EMIT_BATCH``). Without a trip through ``_run`` per step: its loop,
        ``_handle``'s dispatch and the bookkeeping around them were ~4 µs of a host step's ~20 µs.

        Each step is taken off the queue just before it is finalized (``_busy`` stays set), so a step
        that fails is counted alone by ``_run`` and the ones behind it stay queued. Where a stream
        device is timed, for at most ``_BURST_S``: ``_run`` then gives the GIL away."""
        queue = self._queue
        resolve = self._resolve_step
        burst_start = _perf()
        while True:
            pending = self._pending
            if step.values is not None and self._deferrable(step):  # (no call for a step without values)
                self._observe(step)
                if len(self._deferred) >= _DEFER_STEPS or _perf() - self._deferred_since >= _DEFER_S:
                    self._finalize_deferred()
            else:
                if self._deferred:
                    self._finalize_deferred()  # records in the order the steps ended
                pending += resolve(step)
            if len(pending) >= _EMIT_BATCH:
                self._emit_pending()
            if not queue or (self._clocks and _perf() - burst_start >= _BURST_S):
                return
            later = queue[0]
            if type(later) is not StepHandle:
                return
            if self._device_end_due(later):
                self._prepare_device_ends()  # a device-clock end asked for before the step is looked at
            try:
                if not self._ready(later):
                    return
            except Exception:
                return  # _run meets it again, and counts it
            queue.popleft()
            step = later

    def _deferrable(self, step: "StepHandle") -> bool:
        """Whether ``step`` is observed now and finalized with the ones after it (see _DEFER_STEPS): timed
        by its values on a device without stream markers, nothing else timed by a device clock, and
        nothing that reads each finalized step at once (the capture's triggers, the GPU health sampler)."""
        return (step.values is not None and self.defer_values and not step.microbatches and not self._clocks
                and not step.device.uses_events and step.device is not HOST and self.on_step_finalized is None
                and self.health is None and self.pauses is None)

    def _observe(self, step: "StepHandle") -> None:
        """The part of a value-timed step that must happen as it ends: the wait on its outputs (its end),
        its host exit, its device memory, its logged scalars; and the stall watch told its interval.
        Finalized later (_finalize_deferred), as if it had been finalized now."""
        device_start, end_seen, end_source, host_end = self._end_of(step, step.seen_complete)
        step.observed = (device_start, end_seen, end_source, host_end, self._memory(step.device))
        if step.scalars:
            # Read now, as the step ended (a logged device array may be donated by a later step); the
            # floats are what finalizing reads back (a reader that is not callable is its value).
            step.scalars = self._read_scalars(step)
        # (attribution.previous_end and unit_end, inline: this runs right after a wake-up, on cold caches.)
        deferred = self._deferred
        if deferred:
            prev_end = self._observed_end
        else:
            prev_end = step.host_start if self._prev_end is None else self._prev_end
            self._deferred_since = _perf()
        end = host_end if end_seen is None else end_seen
        if end < prev_end:
            end = prev_end  # as unit_timing places it
        self._observed_end = end
        self._steps_wake = True
        deferred.append(step)
        if self.on_step_interval is not None:
            self.on_step_interval(end - prev_end)

    def _finalize_deferred(self) -> None:
        """Finalize the observed steps, in order, their records gathered for the sinks; a step that fails
        is counted alone (as _run counts one) and the ones after it are still finalized."""
        steps, self._deferred = self._deferred, []
        pending = self._pending
        for step in steps:
            try:
                pending += self._resolve_step(step)
            except Exception:
                self.count_drop(DROP_RESOLVER_ERROR)
                log.exception("steptrace resolver failed on %r; the record is dropped and counted", step)

    def _emit_pending(self) -> None:
        records, self._pending = self._pending, []
        self._emit(records)

    def _emit(self, records: Sequence[Mapping[str, Any]]) -> None:
        if not records:
            return
        with self._emit_lock:  # the stall watch emits from its own thread
            self.records_emitted += len(records)
            for worker in self.sinks:
                worker.offer(records)

    def emit_now(self, records: list[dict[str, Any]]) -> None:
        """Hand records straight to the sinks from another thread (the stall watch): the resolver
        may be the thing that is stuck, waiting on a device that never finishes."""
        if not self._stopping:
            self._emit(records)

    def _unit_end(self, unit: "TimedUnit", seen: float) -> tuple[float | None, float | None, str]:
        """When the unit's device work started and ended: (device start or None, end or None, end_source).

        ``seen``: a host time at which every stream marker of the unit was known to be complete.
        An end of None means the host end (synchronous work).
        """
        device = unit.device
        if device is HOST:
            return None, None, END_HOST
        if device.uses_events:
            placed = self._place_markers(unit, seen)
            if placed is not None:
                return placed[0], placed[1], END_DEVICE_CLOCK
            return None, seen, END_OBSERVED
        if unit.values is None:
            return None, None, END_HOST
        pending = unit.device_end
        if pending is not None:
            unit.device_end = None
            try:
                end = pending.end_time()
            except Exception:
                end = None  # unreadable: observed below
            if end is not None:
                unit.values = None  # do not keep the user's arrays alive
                return None, end, END_DEVICE
        switch = self.config.jax_switch_interval_s if device.name == "jax" else None
        restore = None
        if switch is not None and sys.getswitchinterval() > switch:
            # The end is read when this thread gets the GIL back after the wait: a thread asking for
            # the GIL waits this long before the holder is asked to drop it (CPython's ceval_gil.c).
            restore = sys.getswitchinterval()
            sys.setswitchinterval(switch)
        cpu_before = time.thread_time()
        try:
            done = device.wait_values(unit.values)
            observed = _perf()
        except Exception as exc:
            self._wait_failures += 1
            self.count_drop(DROP_DEVICE_WAIT_ERROR)
            if self._wait_failures == 1:
                log.warning(
                    "steptrace could not wait on a step's outputs (%r); that step's end is the time the "
                    "failure was seen. If you donate the values passed to wait_for (donate_argnums), pass "
                    "the loss or metrics instead.", exc)
            return None, _perf(), END_OBSERVED
        finally:
            self.wait_cpu_seconds += time.thread_time() - cpu_before
            unit.values = None  # do not keep the user's arrays alive
            # Unless the program changed it meanwhile (the interval is kept in whole microseconds).
            if restore is not None and switch is not None and abs(sys.getswitchinterval() - switch) < 1e-6:
                sys.setswitchinterval(restore)
        if done is None:
            return None, observed, END_OBSERVED
        return None, done, END_DEVICE

    def _clock(self, device: Any) -> DeviceClock:
        clock = self._clocks.get(id(device))
        if clock is None:
            clock = self._clocks[id(device)] = DeviceClock(device)
        return clock

    def _locate_markers(self, unit: "TimedUnit", seen: float) -> None:
        """Phase one of placing a stream unit: its markers' device times (``unit.start_g``/``end_g``),
        each marker's bracket taken as a calibration sample (held back until ``commit``).

        Device times come from ``elapsed`` against the clock's base (the previous step's end
        marker). A marker is a sample too: not stamped before it was recorded, nor after it was seen
        complete. The step's end marker becomes the next base (``_prune_clocks``); every other
        marker goes back to the device's pool here. On failure ``end_g`` stays None.
        """
        device = unit.device
        clock = self._clocks.get(id(device)) or self._clock(device)  # (the lookup inline: every unit)
        start_event, end_event = unit.start_event, unit.end_event
        unit.start_event = unit.end_event = None
        unit.start_g = unit.end_g = None
        if end_event is None:
            return
        keep = None
        try:
            start_g = start_error = None
            # A start marker the step was rebased to has given its sample already (_locate_step_markers).
            start_sampled = start_event is not None and clock.is_base(start_event)
            if start_event is not None:
                start_g = clock.locate(start_event, unit.start_recorded_after)
                start_error = clock.located_error
            end_g = clock.locate(end_event, None if start_event is not None else unit.end_recorded_after)
            clock.add_sample(end_g, max(unit.end_recorded_after, unit.seen_incomplete), seen, clock.located_error)
            if start_g is not None and not start_sampled:
                clock.add_sample(start_g, unit.start_recorded_after, seen, start_error or 0.0)
            unit.start_g, unit.end_g = start_g, end_g
            if isinstance(unit, StepHandle):
                keep = end_event
                self._new_bases.append((clock, end_event, end_g))
        except Exception as exc:
            self._clock_failure(device, exc)
        finally:
            for marker in (start_event, end_event):
                if marker is not None and marker is not keep and not clock.owns(marker):
                    try:
                        device.release(marker)
                    except Exception:
                        pass

    def _place_markers(self, unit: "TimedUnit", seen: float) -> tuple[float | None, float] | None:
        """Host times of a stream unit's start and end markers (None on failure).

        Phase two, after ``_locate_markers`` (done here if it was not). All markers of one step are
        mapped to the host with the same map, taken after the step's own samples joined it
        (``_locate_step_markers``), so differences between them (the durations) are the device's
        and their placement uses what the step itself says (its start marker was not reached
        before it was recorded).
        """
        if unit.end_event is not None:
            self._locate_markers(unit, seen)
        end_g, start_g = unit.end_g, unit.start_g
        if end_g is None:
            return None
        clock = self._clocks.get(id(unit.device)) or self._clock(unit.device)
        try:
            mapping = clock.mapping()
            if mapping is None:
                raise LookupError("no calibration sample")
            unit.placement_uncertainty = clock.uncertainty(end_g)
            return (None if start_g is None else mapping.host(start_g)), mapping.host(end_g)
        except Exception as exc:
            self._clock_failure(unit.device, exc)
            return None

    def _locate_step_markers(self, step: "StepHandle", units: Sequence["TimedUnit"], seen: float) -> None:
        """Locate every stream marker of a step (its own and its microbatches') and let their samples
        join the map before any is placed: the step's start marker bounds its placement from below,
        which matters while no tight anchor exists (the first steps; one hardware queue).

        Each clock is first rebased to the step's earliest start marker on it, so the step's other
        markers (microbatches, spans, its end) are measured from there over short spans: its durations
        keep float32's precision after a long gap."""
        rebased: set[int] = set()
        for unit in (step, *units):
            device = unit.device
            if not device.uses_events or unit.start_event is None or id(device) in rebased:
                continue
            rebased.add(id(device))
            clock = self._clocks.get(id(device)) or self._clock(device)
            try:
                g = clock.locate(unit.start_event, unit.start_recorded_after)
                clock.add_sample(g, unit.start_recorded_after, seen, clock.located_error)
                clock.rebase(unit.start_event, g)
            except Exception:
                pass  # _locate_markers meets the same failure, and counts it
        for unit in (step, *units):
            if unit.device.uses_events and unit.end_event is not None:
                self._locate_markers(unit, seen)
        for clock in self._clocks.values():
            clock.commit()  # nothing pending: nothing to do

    def _clock_failure(self, device: Any, exc: BaseException) -> None:
        self._clock_failures += 1
        self.count_drop(DROP_DEVICE_CLOCK_ERROR)
        if self._clock_failures == 1:
            log.warning("steptrace could not place a %s marker on the host clock (%r); such units are "
                        "timed by when the resolver saw them complete", device.name, exc)

    def _await_host_exit(self, unit: "TimedUnit") -> None:
        # A value-device step is handed over at wait_for(); its host part may still be running.
        while unit.host_end is None:
            if self._stopping:
                return
            time.sleep(0.0002)

    def _resolve_step(self, step: "StepHandle") -> list[Mapping[str, Any]]:
        """The records of a step taken off the queue: its own, its spans' and its microbatches'.

        Most steps are a host or JAX step with no span, microbatch, stream marker or anything else
        but their times, and take the fast path (:meth:`_resolve_plain`); the rest, and every step
        while ``fast_path`` is off (tests compare the two), the general one."""
        device = step.device
        if step.microbatches or self._clocks or device.uses_events or not self.fast_path:
            if device.uses_events and self.fast_path:
                records = self._resolve_marked(step)
                if records is not None:
                    return records
            return self._resolve_general(step)
        # No stream marker anywhere (no clock): nothing to locate or commit, the previous end as it
        # is. A value device's outputs are waited on first, then its host exit (spans, microbatches
        # and status are final only after it), as on the general path.
        device_start, end_seen, end_source, host_end = self._end_of(step, step.seen_complete)
        prev_end = self._prev_end
        if (prev_end is None or step.microbatches or step.spans or step.open_spans or self._recent
                or step.collective_source is not None or self.collective_source is not None
                or step.device_collectives or step.device_collectives_dropped or self.health is not None
                or self.pauses is not None
                or device_start is not None):
            if prev_end is None:
                prev_end = step.host_start  # attribution.previous_end
            return self._finish_step(step, prev_end, step.seen_complete or _perf(), (), [], device_start, end_seen,
                                     end_source, host_end)
        return self._resolve_plain(step, prev_end, end_seen, end_source, host_end)

    def _end_of(self, step: "StepHandle", seen: float) -> tuple[float | None, float | None, str, float]:
        """``(device_start, end_seen, end_source, host_end)`` of a step: as it was observed (_observe), else
        read now. A value device's outputs are waited on first, then its host exit (spans, microbatches and
        status are final only after it)."""
        observed = step.observed
        if observed is not None:
            return observed[0], observed[1], observed[2], observed[3]
        if step.device is HOST:
            device_start = end_seen = None
            end_source = END_HOST
        else:
            device_start, end_seen, end_source = self._unit_end(step, seen)
            if step.host_end is None:
                self._await_host_exit(step)
        return device_start, end_seen, end_source, step.host_end if step.host_end is not None else _perf()

    def _resolve_plain(self, step: "StepHandle", prev_end: float, end_seen: float | None, end_source: str,
                       host_end: float) -> list[Mapping[str, Any]]:
        """The fast path of :meth:`_resolve_step`: a step after the first, with no microbatch, span (its
        own, open, or an earlier one that can still cover its idle time), stream marker, device start,
        collective or health window. It skips only what is empty for such a step and gives the record
        the general path gives (tests/test_hot_path.py compares them on the same steps), in about half
        the CPU (host 19.5 -> 10.3 µs a step on the bench VM; bench/RESULTS.md, "background fast path")."""
        by_values = step.device is not HOST
        self._steps_wake = by_values
        if not by_values:
            step.dispatch = step.host_start  # the moved dispatch point is a value device's alone
        timing, segments, idle = attribution.plain_unit(prev_end, step.dispatch,
                                                        host_end if end_seen is None else end_seen)
        end = timing.end
        self._prev_end = end
        if self.on_step_interval is not None and step.observed is None:  # else told at the observation
            self.on_step_interval(timing.interval_seconds)
        ends = self._step_ends
        ends[step.step] = end
        if len(ends) > _STEP_ENDS_KEPT:
            ends.popitem(last=False)
        self.steps_resolved += 1
        if not self._warned_no_peak and (step.flops is not None or step.hardware_flops is not None):
            self._warn_no_peak()
        record = self.records.step_of(
            step, step.device.name, end_source, step.host_end or step.host_start, timing, segments, idle, None, None,
            self._read_scalars(step) if step.scalars else None,
            None if not by_values else self._step_memory(step), None, None, None, 0)
        if self.on_step_finalized is not None and step.status == "ok":
            self._tell_finalized(record)
        return [record]

    def _resolve_marked(self, step: "StepHandle") -> list[Mapping[str, Any]] | None:
        """The CUDA fast path of :meth:`_resolve_step`: a stream-timed step (its markers complete) after the
        first, with its start and end markers, its microbatches' (if any) on its own device, and no span (its
        own, open, or an earlier one that can still cover its idle time), value, device-clock end, collective,
        health window or host pauses, on the one device clock of the run. Its markers are located and the
        map taken in one clock call (``place_step``: every ``elapsed`` read first, the step's two together),
        placed with the map inline, and the step's record built as on :meth:`_resolve_plain`: the records the
        general path gives (tests/test_cuda_fast_path.py compares them record for record), in ~3/5 of the
        calls. None, before anything changed, where the step is not such a step or a read fails (the
        general path then reads it again, and counts the failure)."""
        start, end, prev_end = step.start_event, step.end_event, self._prev_end
        clocks = self._clocks
        if (start is None or end is None or prev_end is None or len(clocks) != 1 or step.spans or step.open_spans
                or self._recent or self._new_bases or step.values is not None or step.device_end is not None
                or step.host_end is None or step.observed is not None or step.device_collectives
                or step.device_collectives_dropped or self.health is not None or self.pauses is not None):
            return None
        device = step.device
        clock = clocks.get(id(device))
        if clock is None:
            return None
        microbatches = step.microbatches
        units: list[tuple[Any, float, Any, float]] | tuple = ()
        if microbatches:
            units = []
            for mb in microbatches:
                if (mb.device is not device or mb.start_event is None or mb.end_event is None
                        or mb.values is not None or mb.device_end is not None):
                    return None
                end_after, incomplete = mb.end_recorded_after, mb.seen_incomplete
                units.append((mb.start_event, mb.start_recorded_after, mb.end_event,
                              incomplete if incomplete > end_after else end_after))
        seen = step.seen_complete or _perf()
        end_after, incomplete = step.end_recorded_after, step.seen_incomplete
        try:
            start_g, end_g, mapping, placed = clock.place_step(
                start, step.start_recorded_after, end, incomplete if incomplete > end_after else end_after, seen, units)
        except Exception:
            return None
        # From here, what _resolve_general, _unit_end, _place_markers, _remapped_prev_end, _prune_clocks and
        # _finish_step do for such a step, in their order (place_step rebased the clock to its end marker).
        step.start_event = step.end_event = None
        step.start_g, step.end_g = start_g, end_g
        offset, rate = mapping.offset, mapping.rate
        prev = self._prev_end_g
        if prev is not None and prev[2] == self.steps_resolved - 1 and prev[0] is clock:
            prev_end = offset + prev[1] * rate  # the previous end placed with this step's map
        mb_results: list[tuple[float | None, float | None, str]] = []
        if microbatches:
            for mb, (mb_start_g, mb_end_g) in zip(microbatches, placed):
                mb.start_event = mb.end_event = None
                mb.start_g, mb.end_g = mb_start_g, mb_end_g
                mb.placement_uncertainty = clock.uncertainty_of(mapping, mb_end_g)
                mb_results.append((offset + mb_start_g * rate, offset + mb_end_g * rate, END_DEVICE_CLOCK))
        used = step.placement_uncertainty = clock.uncertainty_of(mapping, end_g)
        device_start, end_seen = offset + start_g * rate, offset + end_g * rate
        self._prev_end_g = (clock, end_g, self.steps_resolved)
        replenish = getattr(device, "replenish", None)
        if replenish is not None:
            try:
                replenish()
            except Exception:
                pass
        self._steps_wake = False
        step.dispatch = step.host_start
        # unit_timing, idle_windows, window_segments and breakdown of a step with a device start, no exposed
        # window and no span: plain_unit with the device start as its dispatch gives the same floats.
        timing, segments, idle = attribution.plain_unit(prev_end, device_start, end_seen)
        end_time = timing.end
        self._prev_end = end_time
        if self.on_step_interval is not None:
            self.on_step_interval(timing.interval_seconds)
        ends = self._step_ends
        ends[step.step] = end_time
        if len(ends) > _STEP_ENDS_KEPT:
            ends.popitem(last=False)
        self.steps_resolved += 1
        self.fast_cuda_steps += 1
        if not self._warned_no_peak and (step.flops is not None or step.hardware_flops is not None):
            self._warn_no_peak()
        records: list[Mapping[str, Any]] = []
        bubble = optimizer = None
        if microbatches:
            records, mb_compute = self._microbatch_records(step, prev_end, mb_results, end_time)
            if mb_compute:
                bubble = attribution.bubble_ratios(timing.start, mb_compute)
                optimizer = attribution.optimizer_seconds(timing.start, end_time, mb_compute)
        try:
            memory = device.memory_stats()  # (_memory, inline)
        except Exception:
            memory = None  # as _memory: a device without it, or a read that failed
        record = self.records.step_of(
            step, device.name, END_DEVICE_CLOCK, step.host_end or step.host_start, timing, segments, idle, bubble,
            optimizer, self._read_scalars(step) if step.scalars else None, memory, used,
            step.collective_source or self.collective_source, None, 0)
        records.append(record)
        if self.on_step_finalized is not None and step.status == "ok":
            self._tell_finalized(record)
        return records

    def _resolve_general(self, step: "StepHandle") -> list[Mapping[str, Any]]:
        prev_end = attribution.previous_end(self._prev_end, step.host_start)
        # Every stream marker of this step was complete when _ready() looked.
        seen = step.seen_complete or _perf()
        # (Most steps have no microbatches: no empty lists and comprehensions made for them, ~1 µs.)
        waited = list(step.microbatches) if step.microbatches else ()
        if waited or self._clocks:  # else no stream marker and no clock: nothing to locate or commit
            self._locate_step_markers(step, waited, seen)
        # After the step's samples joined the map: the previous end placed with the map its markers use.
        if self._prev_end_g is not None:
            prev_end = self._remapped_prev_end(step, prev_end)
        mb_results = [self._unit_end(mb, seen) for mb in waited] if waited else []
        device_start, end_seen, end_source, host_end = self._end_of(step, seen)
        return self._finish_step(step, prev_end, seen, waited, mb_results, device_start, end_seen, end_source,
                                 host_end)

    def _finish_step(self, step: "StepHandle", prev_end: float, seen: float, waited: Sequence["TimedUnit"],
                     mb_results: list[tuple[float | None, float | None, str]], device_start: float | None,
                     end_seen: float | None, end_source: str, host_end: float) -> list[Mapping[str, Any]]:
        """The general path's part after the step's end is known and its host part has exited."""
        if len(step.microbatches) > len(waited):  # begun after the step was handed over (value devices)
            mb_results += [self._unit_end(mb, seen) for mb in step.microbatches[len(waited):]]
        # Host spans that began inside the step: idle only while the device had drained (DESIGN §2).
        has_spans = bool(step.spans or step.open_spans)
        inside = [s for s in (*step.spans, *step.open_spans) if s.start >= step.host_start] if has_spans else []
        drained = self._span_drain_times(step, inside, seen) if has_spans else {}
        if step.device.uses_events or (step.microbatches and any(mb.device.uses_events for mb in step.microbatches)):
            self._prune_clocks(step)

        end = attribution.unit_end(host_end, end_seen)
        device = step.device
        by_values = device is not HOST and not device.uses_events
        pauses = self.pauses
        gc_pauses = None
        if pauses is not None:
            gc_pauses = pauses.gc_until(end)
            if gc_pauses:
                # Each collection is a host interval named "gc", charged by the overlap rule (DESIGN §2): it
                # names the idle windows it covers (innermost: it began inside any span around it) and stays
                # in _recent while it can still cover a later window. On a synchronous backend the host is
                # the device, so a collection inside the step is idle where it happened; with a device of
                # its own, only where the device was idle anyway (the wait before the step's start, or a
                # span's exposed part): a collection while the device computes is hidden.
                gc_spans = [attribution.HostSpan(attribution.GC, start, stop) for start, stop, _, _ in gc_pauses]
                self._recent.extend(gc_spans)
                if device is HOST:
                    inside = [*inside, *(s for s in gc_spans if s.start >= step.host_start)]
        self._steps_wake = by_values
        exposed = [] if by_values or not inside else attribution.exposed_gaps(
            [self._span_window(s, drained) for s in inside], step.host_start, end)
        if not by_values:
            step.dispatch = step.host_start  # the moved dispatch point is a value device's alone
        # (Positional: naming the arguments cost ~0.4 µs a step.)
        timing = attribution.unit_timing(prev_end, step.dispatch, end, device_start, exposed)

        if has_spans:
            self._recent.extend(step.spans)
            self._recent.extend(step.open_spans)
        before = None
        if self._prev_end is None:
            # Before the first step: the run's wall time too, by the spans covering it; the rest is startup.
            before = attribution.window_segments([(self.started, step.host_start)], self._recent,
                                                 attribution.STARTUP)
        labels = self._recent
        if drained:
            labels = self._span_labels(self._recent, drained, timing.end)
        segments = attribution.window_segments(attribution.idle_windows(prev_end, timing, exposed), labels)
        # Nothing that ended before this step's end can cover a later idle window.
        if self._recent:
            self._recent = attribution.spans_after(self._recent, timing.end)
        self._prev_end = timing.end
        if self.on_step_interval is not None and step.observed is None:  # else told at the observation
            self.on_step_interval(timing.interval_seconds)
        self._step_ends[step.step] = timing.end
        if len(self._step_ends) > _STEP_ENDS_KEPT:
            self._step_ends.popitem(last=False)
        self.steps_resolved += 1

        records: list[Mapping[str, Any]] = [self._span_record(s) for s in step.spans if s.emit] if has_spans else []
        mb_compute: list[tuple[Any, float, float]] = []
        if step.microbatches:
            mb_records, mb_compute = self._microbatch_records(step, prev_end, mb_results, timing.end)
            records += mb_records
        record = self._step_record(step, timing, segments, mb_compute, end_source)
        if before is not None:
            self.records.add_before_steps(record, before)
        if pauses is not None:
            dropped = pauses.dropped
            if dropped > self._pauses_dropped:
                self.count_drop(DROP_GC_PAUSES, dropped - self._pauses_dropped)
            try:
                counters = pauses.counters_delta()
            except Exception:
                log.debug("steptrace: reading the thread's counters failed", exc_info=True)
                counters = (None, None, None)
            record["host_pauses"] = host_pauses_summary(gc_pauses or [], counters, dropped - self._pauses_dropped)
            self._pauses_dropped = dropped
        health = self.health
        if health is not None:
            try:
                window = health.window(timing.end)
            except Exception:
                log.debug("steptrace: the health window failed", exc_info=True)
                window = None
            if window is not None:
                record["health"] = window
        records.append(record)
        if self.on_step_finalized is not None and step.status == "ok":
            self._tell_finalized(record)
        return records

    def _tell_finalized(self, record: Mapping[str, Any]) -> None:
        """Hand an ok step's record to ``on_step_finalized`` (the capture's triggers); called only when it
        is set. A trigger that fails never costs the record: it is logged at debug level and skipped."""
        try:
            self.on_step_finalized(record)
        except Exception:
            log.debug("steptrace: the capture trigger failed", exc_info=True)

    @staticmethod
    def _release_span_marker(span: "ClosedSpan") -> None:
        markers = (span.marker, span.end_marker)
        span.marker = span.end_marker = None
        for held in markers:
            if held is not None:
                device, marker, _ = held
                try:
                    device.release(marker)
                except Exception:
                    pass

    def _span_drain_times(self, step: "StepHandle", spans: list["ClosedSpan"],
                          seen: float) -> dict[int, tuple[float, float | None]]:
        """For spans inside an event-timed step, when the device reached the marker recorded as each
        began (it had drained the step's earlier work) and the one recorded as it ended (it had drained
        the work queued inside it), on the host clock with the same map as the step's own markers
        (located first, so the device's base exists): the span's idle part is their difference, a
        device duration. A span still open at the step's end ends with the step (infinity); one whose
        end marker is missing (recorded during a capture, or failed) ends at its host end (None).
        Every marker of the step goes back to its pool here."""
        drained: dict[int, tuple[float, float | None]] = {}
        for span in (*step.spans, *step.open_spans):
            if span.marker is None:
                continue
            device, marker, recorded_after = span.marker
            try:
                if step.device is device and span in spans:
                    clock = self._clock(device)
                    point = clock.device_time(marker, recorded_after, seen)
                    end = None
                    if span.end_marker is not None and span.end_marker[0] is device:
                        end = clock.device_time(span.end_marker[1], span.end_marker[2], seen)
                    if point is not None:
                        device_end = clock.host_time(end) if end is not None else (
                            math.inf if span in step.open_spans else None)
                        drained[id(span)] = (clock.host_time(point), device_end)
            except Exception as exc:
                self._clock_failures += 1
                self.count_drop(DROP_DEVICE_CLOCK_ERROR)
                if self._clock_failures == 1:
                    log.warning("steptrace could not place a span marker on the host clock (%r); such spans "
                                "count as idle in full", exc)
            finally:
                self._release_span_marker(span)
        return drained

    @staticmethod
    def _span_window(span: "ClosedSpan",
                     drained: dict[int, tuple[float, float | None]]) -> tuple[float, float, float]:
        """``(start, end, drained)`` of a span for ``exposed_gaps``: on a stream device, from the marker the
        device reached as it drained the work before the span to the one recorded at its end (both on
        the step's map: the idle part is the device's own duration); else the host span, idle in full
        from its start (host) or from the start marker where the end marker is missing."""
        placed = drained.get(id(span))
        if placed is None:
            return span.start, span.end, span.start
        drain, device_end = placed
        if device_end is None:
            return span.start, span.end, drain
        return -math.inf, device_end, drain

    @staticmethod
    def _span_labels(spans: list["ClosedSpan"], drained: dict[int, tuple[float, float | None]],
                     step_end: float) -> list[Any]:
        """The spans that name a step's idle windows: a span whose idle part is a device window (its two
        markers, placed) covers that window whole, even where the placement puts an edge of it a little
        outside the host span, so the reason it is charged to does not move with the placement."""
        labels: list[Any] = []
        for span in spans:
            placed = drained.get(id(span))
            device_end = None if placed is None else placed[1]
            if placed is None or device_end is None:
                labels.append(span)
                continue
            labels.append(attribution.HostSpan(span.name, min(span.start, placed[0]),
                                               max(span.end, min(device_end, step_end))))
        return labels

    def _prune_clocks(self, step: "StepHandle") -> None:
        # The step is resolved: its end marker becomes its clock's base for the next step's markers,
        # and its span markers' samples join the map (from the next step on; its unit markers' did
        # before they were placed: _locate_step_markers).
        bases, self._new_bases = self._new_bases, []
        for clock, marker, g in bases:
            clock.rebase(marker, g)
        for clock in self._clocks.values():
            clock.commit()
        if step.end_g is not None and step.device.uses_events:
            self._prev_end_g = (self._clock(step.device), step.end_g, self.steps_resolved)
            replenish = getattr(step.device, "replenish", None)
            if replenish is not None:
                try:
                    replenish()  # the markers' pool, topped up here rather than on the training thread
                except Exception:
                    pass
        else:
            self._prev_end_g = None

    def _remapped_prev_end(self, step: "StepHandle", prev_end: float) -> float:
        """The previous step's end placed with the map this step's markers use (same device), so the
        step's interval is the device's own difference whatever calibration learned in between."""
        prev = self._prev_end_g
        if prev is None or not step.device.uses_events:
            return prev_end
        clock, g, index = prev
        if index != self.steps_resolved - 1 or clock is not self._clocks.get(id(step.device)):
            return prev_end
        mapping = clock.mapping()
        return prev_end if mapping is None else mapping.host(g)

    def _microbatch_records(self, step: "StepHandle", prev_end: float,
                            results: list[tuple[float | None, float | None, str]], step_end: float):
        records = []
        compute_by_stage: list[tuple[Any, float, float]] = []  # (stage, end, compute)
        host_ends = [mb.host_end if mb.host_end is not None else mb.host_start for mb in step.microbatches]
        timings = attribution.microbatch_timings(prev_end, step_end, [
            (mb.dispatch, device_start, attribution.unit_end(host_end, end_seen))
            for mb, host_end, (device_start, end_seen, _) in zip(step.microbatches, host_ends, results)])
        for mb, host_end, t, (_, _, end_source) in zip(step.microbatches, host_ends, timings, results):
            compute_by_stage.append((mb.stage, t.end, t.compute_seconds))
            records.append(self.records.microbatch(
                step=step.step, index=mb.index, stage=mb.stage, chunk=mb.chunk, kind=mb.kind,
                host_start=mb.host_start, host_end=host_end, timing=t, end_source=end_source,
                placement_uncertainty=mb.placement_uncertainty if end_source == END_DEVICE_CLOCK else None))
        return records, compute_by_stage

    def _step_record(self, step: "StepHandle", timing: attribution.Timing, segments: list[attribution.HostSpan],
                     mb_compute: list[tuple[Any, float, float]], end_source: str) -> StepRecord:
        if not self._warned_no_peak and (step.flops is not None or step.hardware_flops is not None):
            self._warn_no_peak()
        if step.device_collectives or step.device_collectives_dropped:
            collectives, collectives_dropped = self._device_collectives(step)
        else:
            collectives, collectives_dropped = None, 0
        return self.records.step_of(
            step, step.device.name, end_source, step.host_end or step.host_start, timing, segments,
            attribution.breakdown(segments),
            attribution.bubble_ratios(timing.start, mb_compute) if mb_compute else None,  # bubble
            (attribution.optimizer_seconds(timing.start, timing.end, mb_compute)
             if mb_compute else None),  # optimizer_seconds
            self._read_scalars(step) if step.scalars else None,  # scalars
            None if step.device is HOST else self._step_memory(step),  # device_memory
            step.placement_uncertainty if end_source == END_DEVICE_CLOCK else None,  # placement_uncertainty
            step.collective_source or self.collective_source, collectives, collectives_dropped)

    def _warn_no_peak(self) -> None:
        """A step counts FLOPs and no peak is known: said once (never a guessed peak, another device's)."""
        if self.records.peak_flops is None:
            self._warned_no_peak = True
            if self._device_platform == "cpu":
                # The table's figures are bf16 tensor-core peaks; CPU training is usually fp32.
                which = ("this CPU's peak in the precision the model trains in (fp32: physical cores x GHz x "
                         "fp32 FLOPs per cycle per core / 1000, 32 per cycle with AVX2 and two FMA units; "
                         "docs/flops.md)")
            else:
                which = ("the device's dense TFLOP/s in the precision the model trains in (the table's are bf16 "
                         "tensor-core peaks; docs/flops.md)")
            log.warning("steptrace has no peak FLOP/s for device kind %r (not in steptrace.flops.PEAKS): MFU and "
                        "HFU stay empty. Set init(peak_tflops=...) or STEPTRACE_PEAK_TFLOPS to %s",
                        self._device_kind, which)

    @staticmethod
    def _device_collectives(step: "StepHandle") -> tuple[list[Any], int]:
        # Device-timed NCCL collectives: their events precede the step's end on its stream, so they
        # are complete now; one that cannot be read is counted, never dropped silently.
        timed, lost = [], step.device_collectives_dropped
        for entry in step.device_collectives:
            value = entry.resolve()
            if value is None:
                lost += 1
            else:
                timed.append(value)
        return timed, lost

    def _read_scalars(self, step: "StepHandle") -> dict[str, float] | None:
        # The step has ended on the device, so device scalars' copies (queued before its end) are done.
        if not step.scalars:
            return None
        values = {}
        for name, reader in step.scalars.items():
            try:
                values[name] = reader() if callable(reader) else reader
            except Exception:
                self.count_drop(DROP_SCALAR_ERROR)
        return values

    def _step_memory(self, step: "StepHandle") -> dict[str, float] | None:
        """The device memory of a step: read as it was observed (_observe), else now."""
        observed = step.observed
        return observed[4] if observed is not None else self._memory(step.device)

    def _memory(self, device: Any) -> dict[str, float] | None:
        read = getattr(device, "memory_stats", None)
        if read is None:
            return None
        try:
            return read()
        except Exception:
            return None

    def _checkpoint_record(self, ckpt: "CheckpointHandle") -> CheckpointRecord:
        host_end = ckpt.host_end if ckpt.host_end is not None else ckpt.host_start
        # The step it follows was submitted before the save began, so it is resolved by now.
        saved_end = None if ckpt.after_step is None else self._step_ends.get(ckpt.after_step)
        return self.records.checkpoint(
            step=ckpt.step, after_step=ckpt.after_step, status=ckpt.status, error=ckpt.error,
            host_start=ckpt.host_start, host_end=host_end,
            blocking_seconds=attribution.blocking_seconds(ckpt.host_start, host_end, saved_end),
            async_end=ckpt.async_end)

    def _span_record(self, span: "ClosedSpan") -> SpanRecord:
        return self.records.span(name=span.name, step=span.step, start=span.start, end=span.end, attrs=span.attrs)
