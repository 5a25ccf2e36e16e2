"""The resolver's CUDA fast path (``Resolver._resolve_marked``, issue 47) against its general path.

A CUDA step with its markers complete (its own, its microbatches') and nothing else to place (no span,
device-clock end, collective, health window or host pauses) is located and placed in one clock call
(``DeviceClock.place_step``) and its record built as a host step's fast path builds it. These tests hold
it to the general path's records, field for field, on the CUDA fake (tests/fake_cuda.py, which enforces
the CUDA rules it names: among them ``cuEventElapsedTime`` refusing an unknown handle with
CUDA_ERROR_INVALID_HANDLE, cuda.h / CUDA Driver API, and an event recorded into a capturing stream never
completing, CUDA Programming Guide "Stream Capture").

How they are compared: a CUDA placement depends on when the resolver looked (the upper bound of every
sample) and on anchors recorded on the device as it runs, so two live runs never give the same floats.
The workload runs once on the fake with the resolver's queue taken over (the handles are kept, not
resolved); once the fake device has finished it, the same handles are finalized by two fresh resolvers,
fast path on and off, with the resolver's clock read fixed (``_resolver._perf``), no anchor taken but the
live run's own at fixed steps (``DeviceClock.poll`` does nothing), and every handle reset between them to
what the training thread left.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from typing import Any

import pytest

import steptrace
from steptrace import _clock
from steptrace import _resolver as resolver_module
from steptrace._errors import SteptraceWarning
from steptrace._handles import StepHandle
from steptrace.testing import MemorySink, capture

torch = pytest.importorskip("torch", reason="the CUDA path is torch's: pip install steptrace[torch]")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fake_cuda import FakeCuda  # noqa: E402

from steptrace.adapters import torch as torch_adapter  # noqa: E402

pytestmark = pytest.mark.integration

#: What the resolver may change on a handle: kept before the first replay, put back before the second.
_UNIT_FIELDS = ("start_event", "end_event", "start_g", "end_g", "placement_uncertainty", "seen_complete",
                "seen_incomplete", "dispatch", "device_end", "values", "end_prepared", "host_end", "stream", "device")
_STEP_FIELDS = _UNIT_FIELDS + ("observed", "scalars", "microbatches", "spans", "open_spans")
_SPAN_FIELDS = ("marker", "end_marker")


def _snapshot(steps: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    kept = []
    for step in steps:
        kept.append((step, {name: getattr(step, name) for name in _STEP_FIELDS}))
        for mb in step.microbatches:
            kept.append((mb, {name: getattr(mb, name) for name in _UNIT_FIELDS}))
        for span in (*step.spans, *step.open_spans):
            kept.append((span, {name: getattr(span, name) for name in _SPAN_FIELDS}))
    return kept


def _restore(kept: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, fields in kept:
        for name, value in fields.items():
            setattr(obj, name, value)


def _recorded(fake: FakeCuda, workload: Any) -> list[Any]:
    """The step handles ``workload()`` makes on the fake, kept from the resolver; the device then drained."""
    with capture(backend="torch", strict=False):
        # (The resolver thread keeps its own reference to its queue: a fresh one on the attribute holds the
        # handles back, whether Resolver.submit or the compiled step's exit appends them; tests/test_hot_path.py.)
        resolver = steptrace._active.resolver
        items = resolver._queue = collections.deque()
        workload()
        torch.cuda.synchronize()
    return [item for item in items if isinstance(item, StepHandle)]


def _finalized(monkeypatch: Any, steps: list[Any], fast: bool, seen: float,
               anchors: list[tuple[int, Any, float, float]]) -> tuple[list[str], list[int], Any]:
    """The records a fresh resolver makes of ``steps`` (JSON text), the steps the CUDA fast path took, and the
    drops counted. ``anchors``: ``(step, marker, host time before it was recorded, host time it was seen
    complete)`` of calibration anchors the live run recorded, taken by the clock's own ``_query_anchor`` just
    before that step is finalized (so both resolvers take them at the same point)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resolver_module, "_perf", lambda: seen)
        patch.setattr(_clock.DeviceClock, "poll", lambda self, drained: None)
        return _finalized_as_is(steps, fast, anchors)


def _finalized_as_is(steps: list[Any], fast: bool,
                     anchors: list[tuple[int, Any, float, float]]) -> tuple[list[str], list[int], Any]:
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="fast-cuda", strict=False, stall_watch=False,
                   backend="torch", prometheus_port=None)
    resolver = steptrace._active.resolver
    resolver.unix_offset = resolver.records.unix_offset = 1.7e9  # records in unix seconds: one offset for both
    resolver.fast_path = fast
    taken: list[int] = []
    marked = resolver._resolve_marked

    def counting(step: Any) -> Any:
        records = marked(step)
        if records is not None:
            taken.append(step.step)
        return records

    resolver._resolve_marked = counting
    resolve = resolver._resolve_step

    def anchored_first(step: Any) -> Any:
        for number, marker, recorded_before, seen_complete in anchors:
            if step.step == number:
                (clock,) = resolver._clocks.values()
                clock._clock = lambda seen=seen_complete: seen
                clock._anchor = [marker, recorded_before, recorded_before]
                clock._query_anchor()
        return resolve(step)

    resolver._resolve_step = anchored_first
    for step in steps:
        resolver.submit(step)
    steptrace.flush()
    fast_steps = resolver.fast_cuda_steps
    assert [clock.anchors for clock in resolver._clocks.values()] == [len(anchors)]
    drops = steptrace.stats()["dropped"]
    steptrace.shutdown()
    records = [json.dumps(r, sort_keys=True) for r in sink.records if r["type"] in ("step", "span", "microbatch")]
    assert fast_steps == len(taken)
    return records, taken, drops


def _compare(monkeypatch: Any, steps: list[Any],
             anchors: list[tuple[int, Any, float, float]]) -> tuple[list[dict[str, Any]], list[int], dict[str, int]]:
    kept = _snapshot(steps)
    seen = time.perf_counter()  # after the device finished everything: every marker seen complete then
    general, general_taken, general_drops = _finalized(monkeypatch, steps, False, seen, anchors)
    _restore(kept)
    fast, fast_taken, fast_drops = _finalized(monkeypatch, steps, True, seen, anchors)
    assert general_taken == []
    assert len(fast) == len(general)
    for got, want in zip(fast, general):
        got_record, want_record = json.loads(got), json.loads(want)
        assert sorted(got_record) == sorted(want_record)
        for field in want_record:
            assert got_record[field] == want_record[field], (want_record["type"], want_record.get("step"), field)
        assert got == want  # the same floats, to the last bit
    assert fast_drops == general_drops
    return [json.loads(r) for r in fast], fast_taken, fast_drops


def test_the_cuda_fast_path_gives_the_general_paths_records(monkeypatch):
    """Steps, microbatches, spans inside steps, s.log of CUDA scalars, a step whose end a look found still
    running, a step inside a graph capture and one whose end falls in one, a marker the driver refused, a
    marker whose read fails on the resolver, and markers located from a calibration anchor: the same
    records, float for float, with the fast path on and off; and the fast path taken by the steps that are
    its case, and only by them."""
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(torch_adapter._SCALARS, "free", {})  # the replays read each logged scalar twice
    kernels: dict[int, float] = {}
    anchors: list[tuple[int, Any, float, float]] = []

    def anchor(before_step: int) -> None:
        """A calibration anchor recorded now on the training stream, seen complete 1 ms later."""
        gpu = steptrace._active.backends._cuda.gpu(0)
        recorded_before = time.perf_counter()
        marker = gpu._new_event(torch.cuda.current_stream(0))
        time.sleep(1e-3)
        anchors.append((before_step, marker, recorded_before, time.perf_counter()))

    def workload() -> None:
        for n in range(40):
            kind = n % 8
            if n == 11:  # the step's end marker falls inside a capture: the step is host-timed
                steptrace.begin_step(n)
                fake.run(0.2e-3)
                with fake.graph_capture("global"):
                    fake.run(0.2e-3)
                    steptrace.end_step()
            elif n == 19:  # a step opened and closed inside a capture
                with fake.graph_capture("global"):
                    with steptrace.step(n):
                        fake.run(0.1e-3)
            else:
                with steptrace.step(n) as s:
                    if n == 34:
                        # Between the step's start marker and its microbatches': their starts are located from
                        # it, the step's start and end from the step's start.
                        anchor(n)
                    if kind == 2:
                        for j in range(3):
                            with steptrace.microbatch(j, stage=0):
                                fake.run(0.2e-3)
                    elif kind == 4:
                        fake.run(0.3e-3)
                        with steptrace.span("data"):
                            fake.run(0.1e-3)
                    elif kind == 6:
                        kernels[n] = 0.4e-3
                        s.log(loss=fake.scalar(float(n), seconds=0.4e-3))
                    else:
                        kernels[n] = 0.3e-3
                        fake.run(0.3e-3)
            time.sleep(0.2e-3)
            if n == 29:
                anchor(30)  # after step 29's end: step 30's start is located from it
            if n == 26:
                # The next marker taken from the pool (step 27's start) is an event the driver no longer knows.
                gpu = steptrace._active.backends._cuda.gpu(0)
                broken = gpu._new_event(torch.cuda.current_stream(0))
                del fake._handles[broken.steptrace_handle]
                gpu._free.append(broken)

    with pytest.warns(SteptraceWarning, match="could not record a device marker"):
        steps = _recorded(fake, workload)
    by_number = {step.step: step for step in steps}
    assert sorted(by_number) == list(range(40))
    # A look just before step 17's end completed (5 µs before the fake stamped it) bounds its device time from
    # below, tighter than its record did: its sample moves the map.
    end_17 = fake._handles[by_number[17].end_event.steptrace_handle]
    by_number[17].seen_incomplete = end_17._marker.done_at - 5e-6
    # Step 35's end marker destroyed before the resolver reads it: its query and elapsed time fail.
    del fake._handles[by_number[35].end_event.steptrace_handle]

    records, taken, drops = _compare(monkeypatch, steps, anchors)
    steps_by_number = {r["step"]: r for r in records if r["type"] == "step"}
    assert sorted(steps_by_number) == list(range(40))
    assert [r["type"] for r in records].count("microbatch") == 5 * 3
    assert drops.get("device_clock_error") == 1  # step 35's read, counted once on either path
    assert steps_by_number[35]["end_source"] == "observed"
    for n in (11, 19, 27):
        assert steps_by_number[n]["end_source"] == "host", n
    # The fast path's case: a CUDA step after the first with no span and all its markers read. Not step 0 (the
    # first) or span (n % 8 == 4) steps, nor those whose markers are not all there or not readable (11, 19,
    # 27, 35); a step right after a span may go the general way too (the span can still cover its idle time).
    expected = {n for n in range(1, 40) if n % 8 != 4 and n not in (11, 19, 27, 35)}
    assert set(taken) <= expected
    assert {1, 7, 8, 9, 14, 15, 16, 17, 22, 23, 24, 25, 38, 39} <= set(taken)  # plain and s.log steps
    assert {2, 10, 18, 26, 34} <= set(taken)  # microbatch steps
    microbatches = [r for r in records if r["type"] == "microbatch" and r["step"] in taken]
    assert len(microbatches) == 5 * 3
    for record in microbatches:
        assert record["end_source"] == "device_clock" and record["compute_seconds"] >= 0.2e-3 - 5e-6, record
    for n in taken:
        record = steps_by_number[n]
        assert record["end_source"] == "device_clock" and record["backend"] == "torch-cuda"
        if n in kernels:  # its kernel's device time at least (more where the host was slow to launch it)
            assert record["compute_seconds"] >= kernels[n] - 5e-6, (n, record["compute_seconds"])
        if n % 8 == 6:
            assert record["scalars"] == {"loss": float(n)}


def test_a_cuda_step_whose_end_has_not_completed_waits_on_the_fast_path_without_blocking(monkeypatch):
    """The resolver finds the end marker still running (``query`` never blocks: CUDA's cudaEventQuery returns
    cudaErrorNotReady), leaves the step queued and looks again later; meanwhile the training thread runs
    on and the flush gives up at its timeout. Once the kernel is done the step is finalized on the fast
    path, its compute the kernel's device time."""
    fake = FakeCuda(monkeypatch)
    with capture(backend="torch") as sink:
        for n in range(4):
            with steptrace.step(n):
                fake.run(1e-3)
        steptrace.flush()
        resolver = steptrace._active.resolver
        before = resolver.fast_cuda_steps
        with steptrace.step(4):
            fake.run(2.0)
        # Back on the training thread with the kernel still running on the fake device.
        gpu = steptrace._active.backends._cuda.gpu(0)
        assert not fake._handles[gpu._last.steptrace_handle].query()
        assert steptrace.flush(timeout_s=0.05) is False
        assert [r["step"] for r in sink.steps()] == [0, 1, 2, 3]
        torch.cuda.synchronize()
        assert steptrace.flush(timeout_s=30) is True
        assert resolver.fast_cuda_steps == before + 1
    step = {r["step"]: r for r in sink.steps()}[4]
    assert step["end_source"] == "device_clock"
    # The kernel's device time (and any launch gap before it), on the fake GPU's clock: it runs at its own rate
    # (80 ppm fast against the host by default; the map's rate is measured over the run, not exact).
    assert step["compute_seconds"] >= 2.0 * (1 - 100e-6)
