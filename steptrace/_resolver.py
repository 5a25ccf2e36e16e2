"""The resolver: a background thread that learns when the device finished each step
and turns the training thread's raw observations into finalized records.

Items arrive in the order the training thread produced them and are
finalized in that order, so ``end(n-1)`` is always known when step ``n`` is
resolved. Waiting on the device (``jax.block_until_ready``, CUDA event
synchronisation) happens here and only here: the training thread never waits
because of steptrace. Because the device executes steps in order, waiting on
them in order observes each completion promptly.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from steptrace import _attribution as attribution
from steptrace._devices import HOST
from steptrace._ids import trace_id_hex
from steptrace._sinks import SinkWorker
from steptrace._wakeup import Wakeup

if TYPE_CHECKING:
    from steptrace._config import Config
    from steptrace._runtime import CheckpointHandle, ClosedSpan, MicrobatchHandle, StepHandle, TimedUnit

log = logging.getLogger("steptrace")
_perf = time.perf_counter
# How many step end times are kept for checkpoints that refer to an earlier step.
_STEP_ENDS_KEPT = 4096
# How long an idle resolver sleeps before looking at its queue again.
_IDLE_POLL_S = 0.05


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
        self.dropped: collections.Counter[str] = collections.Counter()
        self._drop_lock = threading.Lock()
        self.sinks = [SinkWorker(sink, config.max_queue, self.count_drop) for sink in sinks]
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = Wakeup()
        self._sleeping = False
        self._stopping = False
        self._prev_end: float | None = None
        self._recent: list[ClosedSpan] = []
        self._step_ends: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._wait_failures = 0
        self.records_emitted = 0
        self.steps_resolved = 0
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="steptrace-resolver", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------
    def submit(self, item: Any, urgent: bool = False) -> None:
        """Queue ``item``. ``urgent``: its device completion must be observed promptly.

        Waking a sleeping thread costs microseconds on the training thread, so
        it is paid only for urgent items; the rest wait for the resolver's next
        round (at most ``_IDLE_POLL_S``), which does not change their timings.
        """
        if self._stopping or len(self._queue) >= self.config.max_queue:
            self.count_drop("resolver_queue")
            return
        self._queue.append(item)
        if urgent and self._sleeping:
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
        return all([worker.flush(deadline) for worker in self.sinks])

    def shutdown(self, closed: list["ClosedSpan"], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        # Keep a fifth of the budget for the sinks, so the run record (with the drop
        # counts) still goes out when the device never finishes.
        resolve_deadline = time.monotonic() + 0.8 * timeout_s
        complete = self.flush(closed, 0.8 * timeout_s)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, resolve_deadline - time.monotonic()))
        unresolved = sum(1 for item in self._queue if not isinstance(item, _Tail)) + (1 if self._busy else 0)
        if unresolved:
            self.count_drop("unresolved_at_shutdown", unresolved)
        run_record = {
            "type": "run",
            "run_id": self.config.run_id,
            "rank": self.config.rank,
            "world_size": self.config.world_size,
            "steps": self.steps_resolved,
            "dropped": self.dropped_snapshot(),
        }
        for worker in self.sinks:
            worker.offer([run_record])
        for worker in self.sinks:
            complete = worker.shutdown(deadline) and complete
        return complete and not unresolved

    # -- resolver thread ---------------------------------------------------------------
    def _run(self) -> None:
        queue = self._queue
        while True:
            try:
                item = queue.popleft()
            except IndexError:
                if self._stopping:
                    return
                self._sleeping = True
                if not queue:  # re-check after announcing sleep: submit() may have just appended
                    self._wake.wait(_IDLE_POLL_S)
                self._sleeping = False
                continue
            self._busy = True
            try:
                self._handle(item)
            except Exception:
                self.count_drop("resolver_error")
                log.exception("steptrace resolver failed on %r; the record is dropped and counted", item)
            finally:
                self._busy = False

    def _handle(self, item: Any) -> None:
        from steptrace._runtime import CheckpointHandle, StepHandle

        if isinstance(item, StepHandle):
            self._emit(self._resolve_step(item))
        elif isinstance(item, CheckpointHandle):
            self._emit([self._checkpoint_record(item)])
        elif isinstance(item, _Tail):
            self._recent.extend(item.spans)
            self._emit([self._span_record(s) for s in item.spans if s.emit])
            item.done.set()

    def _emit(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self.records_emitted += len(records)
        for worker in self.sinks:
            worker.offer(records)

    def _wait_unit(self, unit: "TimedUnit") -> tuple[float | None, float | None]:
        """Block until the unit's device work is done: (host end time or None, device seconds or None)."""
        device = unit.device
        if device is HOST:
            return None, None
        try:
            if unit.end_event is not None and unit.start_event is not None:
                done = device.wait_event(unit.end_event)
                end = _perf() if done is None else done
                return end, device.elapsed(unit.start_event, unit.end_event)
            if unit.values is not None:
                done = device.wait_values(unit.values)
                unit.values = None  # do not keep the user's arrays alive
                return (_perf() if done is None else done), None
        except Exception as exc:
            unit.values = None
            self._wait_failures += 1
            self.count_drop("device_wait_error")
            if self._wait_failures == 1:
                log.warning(
                    "steptrace could not wait on a step's outputs (%r); that step's end is the time the "
                    "failure was seen. If you donate the values passed to wait_for (donate_argnums), pass "
                    "the loss or metrics instead.", exc)
            return _perf(), None
        return None, None

    def _await_host_exit(self, unit: "TimedUnit") -> None:
        # A value-device step is handed over at wait_for(); its host part may still be running.
        while unit.host_end is None:
            if self._stopping:
                return
            time.sleep(0.0002)

    def _resolve_step(self, step: "StepHandle") -> list[dict[str, Any]]:
        prev_end = step.host_start if self._prev_end is None else self._prev_end
        waited = list(step.microbatches)
        mb_results = [self._wait_unit(mb) for mb in waited]
        end_seen, device_compute = self._wait_unit(step)
        self._await_host_exit(step)
        host_end = step.host_end if step.host_end is not None else _perf()
        mb_results += [self._wait_unit(mb) for mb in step.microbatches[len(waited):]]

        end = host_end if end_seen is None else end_seen
        timing = attribution.unit_timing(
            prev_end=prev_end, dispatch=step.dispatch, end=end, device_compute=device_compute)

        self._recent.extend(step.spans)
        self._recent.extend(step.open_spans)
        segments = attribution.idle_segments(prev_end, timing.start, self._recent)
        # Nothing that ended before this step's end can cover a later idle window.
        self._recent = [s for s in self._recent if s.end > timing.end]
        self._prev_end = timing.end
        self._step_ends[step.step] = timing.end
        if len(self._step_ends) > _STEP_ENDS_KEPT:
            self._step_ends.popitem(last=False)
        self.steps_resolved += 1

        records = [self._span_record(s) for s in step.spans if s.emit]
        mb_records, mb_compute = self._microbatch_records(step, prev_end, mb_results, timing.end)
        records += mb_records
        records.append(self._step_record(step, timing, segments, mb_compute))
        return records

    def _microbatch_records(self, step: "StepHandle", prev_end: float,
                            results: list[tuple[float | None, float | None]], step_end: float):
        records = []
        compute_by_stage: list[tuple[Any, float]] = []
        cfg = self.config
        for mb, (end_seen, device_compute) in zip(step.microbatches, results):
            host_end = mb.host_end if mb.host_end is not None else mb.host_start
            # A microbatch is part of its step: it cannot end after the step did.
            end = host_end if end_seen is None else min(end_seen, step_end)
            t = attribution.unit_timing(prev_end=prev_end, dispatch=mb.host_start, end=end,
                                        device_compute=device_compute)
            prev_end = t.end
            compute_by_stage.append((mb.stage, t.compute_seconds))
            records.append({
                "type": "microbatch", "run_id": cfg.run_id, "rank": cfg.rank, "step": step.step,
                "microbatch": mb.index, "stage": mb.stage, "chunk": mb.chunk, "kind": mb.kind,
                "host_start_time": mb.host_start + self.unix_offset,
                "host_end_time": host_end + self.unix_offset,
                "start_time": t.start + self.unix_offset, "end_time": t.end + self.unix_offset,
                "compute_seconds": t.compute_seconds,
            })
        return records, compute_by_stage

    def _step_record(self, step: "StepHandle", timing: attribution.Timing,
                     segments: list[attribution.HostSpan], mb_compute: list[tuple[Any, float]]) -> dict[str, Any]:
        cfg = self.config
        off = self.unix_offset
        compute = timing.compute_seconds
        interval = timing.interval_seconds
        tflops = step.flops / compute / 1e12 if step.flops is not None and compute > 0 else None
        record: dict[str, Any] = {
            "type": "step",
            "run_id": cfg.run_id,
            "rank": cfg.rank,
            "world_size": cfg.world_size,
            "step": step.step,
            "trace_id": trace_id_hex(cfg.run_id, step.step),
            "status": step.status,
            "backend": step.device.name,
            "host_start_time": step.host_start + off,
            "host_end_time": (step.host_end or step.host_start) + off,
            "dispatch_time": step.dispatch + off,
            "start_time": timing.start + off,
            "end_time": timing.end + off,
            "interval_seconds": interval,
            "compute_seconds": compute,
            "idle_seconds": timing.idle_seconds,
            "idle_breakdown": attribution.breakdown(segments),
            "idle_segments": [[s.name, s.start + off, s.end + off] for s in segments],
            "tokens": step.tokens,
            "samples": step.samples,
            "flops": step.flops,
            "tokens_per_second": step.tokens / interval if step.tokens is not None and interval > 0 else None,
            "samples_per_second": step.samples / interval if step.samples is not None and interval > 0 else None,
            "tflops_per_second": tflops,
            "mfu": tflops / cfg.peak_tflops if tflops is not None and cfg.peak_tflops else None,
            "attrs": step.attrs,
        }
        if step.error is not None:
            record["error"] = step.error
        if mb_compute:
            record["pipeline_bubble_ratio"] = attribution.bubble_ratios(compute, mb_compute)
        return record

    def _checkpoint_record(self, ckpt: "CheckpointHandle") -> dict[str, Any]:
        cfg = self.config
        host_end = ckpt.host_end if ckpt.host_end is not None else ckpt.host_start
        saved_end = self._step_ends.get(ckpt.step)
        return {
            "type": "checkpoint",
            "run_id": cfg.run_id,
            "rank": cfg.rank,
            "step": ckpt.step,
            "status": ckpt.status,
            **({"error": ckpt.error} if ckpt.error else {}),
            "start_time": ckpt.host_start + self.unix_offset,
            "end_time": host_end + self.unix_offset,
            "host_seconds": host_end - ckpt.host_start,
            "blocking_seconds": attribution.blocking_seconds(ckpt.host_start, host_end, saved_end),
            "async_seconds": None if ckpt.async_end is None else max(0.0, ckpt.async_end - host_end),
        }

    def _span_record(self, span: "ClosedSpan") -> dict[str, Any]:
        cfg = self.config
        return {
            "type": "span",
            "run_id": cfg.run_id,
            "rank": cfg.rank,
            "name": span.name,
            "step": span.step,
            "start_time": span.start + self.unix_offset,
            "end_time": span.end + self.unix_offset,
            "seconds": span.end - span.start,
            "attrs": span.attrs,
        }
