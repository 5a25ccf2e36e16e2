"""What the per-step cost cuts of issue 35 must keep: every record, in order, the same text.

The costs themselves are measured by bench/bench_overhead.py (no timing here); these tests check
the behaviour each cut changed: the resolver hands a backlog of step records to the sinks in
batches (in the order it finalized them, nothing lost), a sink thread is woken only when it may be
asleep with work to do, a pending wake-up is not signalled again, the JSONL sink encodes with one
encoder (the same text as ``json.dumps``; a record that cannot be encoded costs itself alone).
"""

import collections
import json
import threading
import time

import pytest

import steptrace
from steptrace import _resolver
from steptrace._sinks import JsonlSink, SinkWorker, _json_default
from steptrace._wakeup import Wakeup
from steptrace.testing import MemorySink


class _CountingSink(MemorySink):
    """A MemorySink that counts its export calls."""

    def __init__(self):
        super().__init__()
        self.exports = 0

    def export(self, records):
        self.exports += 1
        super().export(records)


def test_a_backlog_of_steps_reaches_the_sinks_in_batches_in_order_and_whole():
    sink = _CountingSink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="backlog", strict=False)
    runtime = steptrace._active
    resolver = runtime.resolver
    with steptrace.step(0) as s:
        s.wait_for(object())
    assert steptrace.flush(30.0)
    # The steps' handles, kept back from the resolver, then queued at once: a backlog such as a
    # tight loop leaves (the resolver cannot run while the training thread holds the GIL).
    # (The resolver thread keeps its own reference to its queue: a fresh one on the attribute holds the
    # handles back, whether Resolver.submit or the compiled step's exit appends them.)
    queue = resolver._queue
    items = resolver._queue = collections.deque()
    steps = 3 * _resolver._EMIT_BATCH + 17
    saves_after = {100, 600}
    for n in range(1, steps + 1):
        with steptrace.step(n) as s:
            s.wait_for(object())
        if n in saves_after:
            with steptrace.checkpoint(n):
                pass
    resolver._queue = queue
    offers = []
    worker = resolver.sinks[0]
    real_offer = worker.offer

    def counting_offer(records):
        offers.append(len(records))
        real_offer(records)

    worker.offer = counting_offer
    resolver._queue.extend(items)
    assert steptrace.flush(60.0)
    records = [r for r in sink.records if r["type"] in ("step", "checkpoint")]
    # Every record, in the order the training thread produced them.
    want = []
    for n in range(1, steps + 1):
        want.append(("step", n))
        if n in saves_after:
            want.append(("checkpoint", n))
    assert [(r["type"], r["step"]) for r in records][1:] == want
    # One hand-over per full batch, one per checkpoint (it goes out with the steps before it, then
    # alone) and one for the rest: not one per step.
    assert sum(offers) == steps + len(saves_after)
    assert len(offers) <= steps // _resolver._EMIT_BATCH + 2 * len(saves_after) + 1
    assert max(offers) <= _resolver._EMIT_BATCH
    stats = steptrace.stats()
    assert stats["dropped"] == {}
    steptrace.shutdown()


class _BlockedSink:
    """A sink whose first export waits until the test lets it go."""

    name = "blocked"

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.records = []

    def export(self, records):
        self.entered.set()
        self.release.wait(30.0)
        self.records.extend(records)

    def force_flush(self, timeout_s):
        return True

    def shutdown(self, timeout_s):
        pass


class _CountingWakeup(Wakeup):
    __slots__ = ("sets",)

    def __init__(self):
        super().__init__()
        self.sets = 0

    def set(self):
        self.sets += 1
        super().set()


def test_a_sink_thread_busy_with_a_batch_is_not_woken_for_each_record_and_gets_every_one():
    sink = _BlockedSink()
    drops = []
    worker = SinkWorker(sink, 10_000, lambda reason, count=1: drops.append((reason, count)))
    worker._wake = wake = _CountingWakeup()
    worker.offer([{"type": "step", "step": 0}])
    assert sink.entered.wait(10.0)  # the thread is inside export, the queue empty
    for n in range(1, 101):
        worker.offer([{"type": "step", "step": n}])
    # The first offer after it emptied the queue wakes it; the 99 after find records queued.
    assert wake.sets == 2
    sink.release.set()
    assert worker.shutdown(time.monotonic() + 10.0)
    assert [r["step"] for r in sink.records] == list(range(101))
    assert drops == []


def test_an_idle_sink_thread_sleeps_until_something_wakes_it_not_on_a_short_poll(monkeypatch):
    """An idle sink thread is woken by what it has to do (offer() into an empty queue, flush, stop), so it
    sleeps up to _IDLE_WAIT_S (1 s) between looks: its 0.1 s poll was most of a sink's CPU on a JAX
    loop. An offer still reaches the sink through the wake-up, not the timeout."""
    from steptrace import _sinks

    waits: list[tuple[float, bool]] = []

    class _RecordingWakeup(Wakeup):
        __slots__ = ()

        def wait(self, timeout):
            signalled = super().wait(timeout)
            waits.append((timeout, signalled))
            return signalled

    monkeypatch.setattr(_sinks, "Wakeup", _RecordingWakeup)
    assert _sinks._IDLE_WAIT_S >= 1.0
    sink = MemorySink()
    worker = SinkWorker(sink, 1000, lambda reason, count=1: None)
    time.sleep(0.3)  # idle: at 0.1 s it would have looked twice or three times by now
    assert waits == []
    worker.offer([{"type": "step", "step": 0}])
    deadline = time.monotonic() + 10
    while not sink.records and time.monotonic() < deadline:
        time.sleep(0.002)
    assert sink.records == [{"type": "step", "step": 0}]
    assert waits == [(_sinks._IDLE_WAIT_S, True)]  # woken by the offer, not by the timeout
    assert worker.shutdown(time.monotonic() + 10.0)


def test_an_idle_resolver_with_nothing_to_wake_it_backs_off_and_looks_soon_again_after_an_item(monkeypatch):
    """No step yet (a JAX program initialising and compiling), or host steps, which do not wake it: the
    idle resolver doubles its sleep from 20 ms up to 0.25 s (at 20 ms, nanodo's start-up cost ~270 wake-ups)
    and starts again at 20 ms after each item, so a host step's record is late by at most 0.25 s."""
    from steptrace import _resolver

    timeouts: list[float] = []

    class _RecordingWakeup(Wakeup):
        __slots__ = ()

        def wait(self, timeout):
            if threading.current_thread().name == "steptrace-resolver":
                timeouts.append(timeout)
            return super().wait(timeout)

    monkeypatch.setattr(_resolver, "Wakeup", _RecordingWakeup)
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="idle-backoff", strict=False, stall_watch=False)
    time.sleep(0.7)  # 20 + 40 + 80 + 160 + 250 ms: five looks, not 35
    idle = list(timeouts)
    start = len(idle) - 1 - idle[::-1].index(0.02)  # after the last item init() queued (the run's start)
    assert idle[start:start + 5] == [0.02, 0.04, 0.08, 0.16, 0.25]
    assert len(idle) <= 9
    with steptrace.step(0):
        pass
    deadline = time.monotonic() + 5
    while not sink.steps() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [r["step"] for r in sink.steps()] == [0]  # found by a look, without a flush
    time.sleep(0.1)
    assert timeouts[len(idle):][:3] == [0.02, 0.04, 0.08]  # after the item, from 20 ms again
    steptrace.shutdown()


class _FakeLock:
    """Stands in for Wakeup's raw lock: says whether a signal is pending, counts releases."""

    def __init__(self, locked):
        self._locked = locked
        self.releases = 0

    def locked(self):
        return self._locked

    def release(self):
        self.releases += 1
        if not self._locked:
            raise RuntimeError("release unlocked lock")
        self._locked = False


def test_a_wakeup_already_signalled_is_not_released_again():
    wake = Wakeup()
    wake._lock = pending = _FakeLock(locked=False)  # a signal pending: the sleeper has not run since
    wake.set()
    assert pending.releases == 0  # no release raised and caught (a tight JAX loop paid it per step)
    wake._lock = idle = _FakeLock(locked=True)
    wake.set()
    assert idle.releases == 1 and not idle.locked()
    real = Wakeup()
    real.set()
    real.set()
    assert real.wait(0.0) is True
    assert real.wait(0.0) is False  # signals do not queue


def test_jsonl_encodes_with_one_encoder_per_sink_the_same_text_as_json_dumps(tmp_path, monkeypatch):
    class Odd:
        def __str__(self):
            return "odd\u00e9"

    records = [
        {"type": "step", "step": 1, "a": 1.5, "nan": float("nan"), "inf": float("inf"), "neg": -float("inf"),
         "text": "\u00e9\n\"x", "nested": [1, 2, {"g": None}], "flag": True, "odd": Odd(), "big": 10**30,
         "pair": (1, 2), "keys": {1: "int key", 2.5: "float key", None: 0, False: 1}},
        {"type": "step", "step": 2, "attrs": {}},
    ]
    want = [json.dumps(r, default=_json_default, separators=(",", ":")) for r in records]
    made = []
    real_init = json.JSONEncoder.__init__

    def counting_init(self, *args, **kwargs):
        made.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(json.JSONEncoder, "__init__", counting_init)
    sink = JsonlSink(tmp_path / "rank-0.jsonl")
    for _ in range(3):
        sink.export(records)
    sink.shutdown(1.0)
    assert made == []  # no encoder built per record (json.dumps with arguments builds one each call)
    assert (tmp_path / "rank-0.jsonl").read_text().splitlines() == want * 3


def test_jsonl_a_circular_record_costs_itself_alone_and_the_encoder_starts_clean(tmp_path):
    shared = {"kind": "shared"}
    circular = {"type": "step", "step": 2, "attrs": shared}
    shared["loop"] = circular  # circular through a dict that later records also hold
    good = [{"type": "step", "step": n, "attrs": {"kind": "plain"}} for n in (1, 3, 4)]
    sink = JsonlSink(tmp_path / "rank-0.jsonl")
    sink.export([good[0], circular, good[1]])
    del shared["loop"]
    sink.export([{"type": "step", "step": 5, "attrs": shared}, good[2]])
    sink.shutdown(1.0)
    lines = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 3, 5, 4]
    assert lines[2]["attrs"] == {"kind": "shared"}
    assert sink.invalid_records == 1


def test_disabled_step_takes_every_call_the_real_one_takes():
    steptrace.init(enabled=False)
    handle = steptrace.step(3, tokens=10, flops="auto", samples=2, phase="warmup")
    with handle as s:
        s.wait_for(object())
        s.log(loss=0.5)
    assert steptrace.step(n=4) is handle  # the shared no-op
    try:
        steptrace.step(1, 2)
    except TypeError:
        pass
    else:
        raise AssertionError("a second positional argument is refused, as when enabled")
    steptrace.shutdown()


def test_step_counts_are_checked_and_kept_through_the_attrs_fast_path():
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="counts", strict=False)
    with steptrace.step(0, tokens=100, samples=4, flops=2e9, phase="a") as s:
        s.wait_for(object())
    with pytest.warns(steptrace.SteptraceWarning, match="tokens=-5"):
        with steptrace.step(1, tokens=-5, phase="b") as s:  # misuse: the count is dropped, the step kept
            s.wait_for(object())
    with steptrace.step(2) as s:
        s.wait_for(object())
    steptrace.shutdown()
    steps = sink.steps()
    assert [(r["step"], r["tokens"], r["samples"], r["model_flops"], r["attrs"]) for r in steps] == [
        (0, 100, 4, 2e9, {"phase": "a"}), (1, None, None, None, {"phase": "b"}), (2, None, None, None, {})]
    assert sink.of_type("run")[0]["dropped"] == {"misuse": 1}


# -- the records themselves: unchanged by the batched finalization ---------------------------------
_GOLDEN = __import__("pathlib").Path(__file__).parent / "golden" / "hot_path_records.json"


def _feature_loop_items():
    """The handles of a loop that uses every host-timed feature a step record can carry (spans inside
    and between steps, nested spans, tokens/samples/flops, attrs, scalars, an error step, microbatches,
    checkpoints), kept back from the resolver, with every clock reading replaced, in order,
    by a fixed one: the records they make are then the same in every run."""
    from steptrace._handles import CheckpointHandle, StepHandle

    runtime = steptrace._active
    resolver = runtime.resolver
    # (The resolver thread keeps its own reference to its queue: a fresh one on the attribute holds the
    # handles back, whether Resolver.submit or the compiled step's exit appends them.)
    queue = resolver._queue
    items = resolver._queue = collections.deque()
    for n in range(40):
        if n % 7 == 3:
            with steptrace.span("data", shard=n):
                pass
        kwargs = {"tokens": 4096, "samples": 8, "flops": 3e12} if n % 3 == 0 else {}
        if n % 5 == 1:
            kwargs["lr"] = 0.001 * n
        try:
            with steptrace.step(n, **kwargs) as s:
                if n % 2 == 0:
                    with steptrace.span("data"):
                        with steptrace.span("h2d"):
                            pass
                if n % 4 == 1:
                    s.log(loss=1.0 / (n + 1), grad_norm=float(n))
                if n % 6 == 5:
                    for index in range(3):
                        with steptrace.microbatch(index, stage=0, kind="forward"):
                            pass
                if n == 17:
                    raise ValueError("bad batch ü")
                s.wait_for(object())
        except ValueError:
            pass
        if n % 10 == 9:
            with steptrace.checkpoint(n):
                with steptrace.span("serialize"):
                    pass
    resolver._queue = queue
    items = [item for item in items if isinstance(item, (StepHandle, CheckpointHandle))]
    times: set[float] = set()

    def spans_of(step):
        return [*step.spans, *step.open_spans]

    tail = runtime.closed_spans  # closed after the last step: flush() hands them over
    times.update(t for span in tail for t in (span.start, span.end))
    for item in items:
        times.update(t for t in (item.host_start, item.host_end, getattr(item, "dispatch", None),
                                 getattr(item, "async_end", None)) if t is not None)
        for unit in getattr(item, "microbatches", ()):
            times.update(t for t in (unit.host_start, unit.host_end, unit.dispatch) if t is not None)
        for span in spans_of(item) if isinstance(item, StepHandle) else ():
            times.update((span.start, span.end))
    fixed = {t: 100.0 + 0.001 * i for i, t in enumerate(sorted(times))}
    for item in items:
        item.host_start = fixed[item.host_start]
        if item.host_end is not None:
            item.host_end = fixed[item.host_end]
        if isinstance(item, StepHandle):
            item.dispatch = fixed[item.dispatch]
            for unit in item.microbatches:
                unit.host_start, unit.dispatch = fixed[unit.host_start], fixed[unit.dispatch]
                if unit.host_end is not None:
                    unit.host_end = fixed[unit.host_end]
            for span in spans_of(item):
                span.start, span.end = fixed[span.start], fixed[span.end]
    for span in tail:
        span.start, span.end = fixed[span.start], fixed[span.end]
    return items


def _finalized(items):
    resolver = steptrace._active.resolver
    resolver.started = 99.0  # init(): before every fixed time
    resolver.unix_offset = resolver.records.unix_offset = 1.7e9
    resolver._queue.extend(items)
    resolver._wake.set()
    assert steptrace.flush(60.0)


def test_the_finalized_records_are_the_same_as_before_the_batched_path_field_by_field(hot_path):
    """The records of a fixed loop, compared field by field with those the one-record-at-a-time
    resolver made from the same handles (tests/golden/hot_path_records.json, written by the code
    before issue 35's batched finalization; WRITE_GOLDEN_HOT_PATH=1 rewrites it), made with the per-step
    calls compiled (steptrace/_hotpath.c) and in Python."""
    import os

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="golden-run", strict=False, peak_tflops=100.0,
                   stall_watch=False)
    items = _feature_loop_items()
    _finalized(items)
    records = [r for r in sink.records if r["type"] in ("step", "span", "checkpoint", "microbatch")]
    steptrace.shutdown()
    text = [json.dumps(r, sort_keys=True) for r in records]
    if os.environ.get("WRITE_GOLDEN_HOT_PATH"):
        _GOLDEN.write_text("\n".join(text) + "\n")
    want = _GOLDEN.read_text().splitlines()
    counts = collections.Counter(r["type"] for r in records)
    # 20 steps with data > h2d, 6 data spans between steps, a serialize span in each of 4 saves.
    assert counts == {"step": 40, "span": 2 * 20 + 6 + 4, "checkpoint": 4, "microbatch": 6 * 3}
    assert len(text) == len(want)
    for got, expected in zip(text, want):
        got_record, want_record = json.loads(got), json.loads(expected)
        assert sorted(got_record) == sorted(want_record), (got_record.get("type"), got_record.get("step"))
        for field in want_record:
            assert got_record[field] == want_record[field], (want_record["type"], want_record.get("step"), field)
        assert got == expected  # the same values, and the same float text


_GOLDEN_JSONL = _GOLDEN.with_suffix(".jsonl")


def _jsonl_lines_of_the_fixed_loop(run_dir) -> list[bytes]:
    steptrace.init(jsonl=True, run_dir=str(run_dir), run_id="golden-run", strict=False, peak_tflops=100.0,
                   stall_watch=False)
    _finalized(_feature_loop_items())
    steptrace.shutdown()
    lines = (run_dir / "golden-run" / "rank-0.jsonl").read_bytes().splitlines(keepends=True)
    return [line for line in lines if json.loads(line)["type"] in ("step", "span", "checkpoint", "microbatch")]


def test_the_jsonl_bytes_of_the_fixed_loop_are_the_same_as_before_the_background_cuts(tmp_path):
    """The JSONL sink's bytes for the fixed loop's records, line for line, as the code before the
    background fast path wrote them (tests/golden/hot_path_records.jsonl): the fields in the same order,
    the same float text (the golden test above compares values, with sorted keys)."""
    lines = _jsonl_lines_of_the_fixed_loop(tmp_path)
    want = _GOLDEN_JSONL.read_bytes().splitlines(keepends=True)
    assert len(lines) == len(want) == 40 + 50 + 4 + 18
    for got, expected in zip(lines, want):
        assert got == expected


def _records_with_fast_path(fast_path: bool, make_items, run_id: str) -> tuple[list[str], int]:
    """The records (JSON text) a fresh resolver makes of the handles ``make_items()`` captures, with its
    fast path on or off, and how many steps took the fast path."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=run_id, strict=False, peak_tflops=100.0, stall_watch=False)
    resolver = steptrace._active.resolver
    items = make_items()
    resolver.fast_path = fast_path
    plain = []
    real_plain = resolver._resolve_plain

    def counting_plain(step, *args):
        plain.append(step.step)
        return real_plain(step, *args)

    resolver._resolve_plain = counting_plain
    _finalized(items)
    records = [json.dumps(r, sort_keys=True) for r in sink.records
               if r["type"] in ("step", "span", "checkpoint", "microbatch")]
    steptrace.shutdown()
    return records, len(plain)


def test_the_fast_path_gives_the_general_paths_records_on_the_same_steps():
    """Plain steps (no span, microbatch, marker...) take the resolver's fast path; with it forced off,
    the same handles give the same records, float for float. The fixed loop mixes plain steps with
    every feature that sends a step down the general path, and the steps right after them."""
    general, general_plain = _records_with_fast_path(False, _feature_loop_items, "fast-path")
    fast, fast_plain = _records_with_fast_path(True, _feature_loop_items, "fast-path")
    assert general_plain == 0
    assert fast_plain == 12  # the odd steps with no span before them or microbatch in them
    assert len(fast) == len(general) == 40 + 50 + 4 + 18
    for got, expected in zip(fast, general):
        assert got == expected


def test_the_fast_path_of_a_value_device_step_gives_the_general_paths_record():
    """The same for steps timed by their values (JAX's path: the outputs waited on by the resolver,
    the dispatch point left where the step put it), with device end times, device memory, FLOPs
    and a failed step."""
    from steptrace._handles import StepHandle
    from steptrace.testing import SimulatedDevice

    device = SimulatedDevice(uses_events=False, report_end_times=True, memory_limit_bytes=1 << 30)
    work = []
    for n in range(30):  # dispatched once: both resolvers wait on the same, already computed, work
        device.memory_in_use_bytes = (n % 5) << 20
        work.append(device.run(0.0005 * (1 + n % 3)))
    device.synchronize()

    def value_steps():
        resolver = steptrace._active.resolver
        items = []
        resolver.submit = lambda item, urgent=False: items.append(item)
        for n, done in enumerate(work):
            try:
                with steptrace.step(n, **({"flops": 1e9} if n % 4 == 0 else {})) as s:
                    s.wait_for(done)
                    if n == 11:
                        raise RuntimeError("lost")
            except RuntimeError:
                pass
        del resolver.submit
        steps = [item for item in items if isinstance(item, StepHandle)]
        for i, step in enumerate(steps):  # fixed host times, so both runs are the same
            step.host_start = step.dispatch = work[i].start_time - 1e-4
            step.host_end = work[i].start_time + 2e-5
        return steps

    general, general_plain = _records_with_fast_path(False, value_steps, "fast-path-values")
    fast, fast_plain = _records_with_fast_path(True, value_steps, "fast-path-values")
    assert (general_plain, fast_plain) == (0, 29)  # all but the first step
    assert len(fast) == 30
    assert {json.loads(r)["end_source"] for r in fast} == {"device"}
    assert fast == general


def test_a_backlog_is_finalized_in_one_pass_and_a_step_that_fails_in_it_costs_itself_alone():
    """Steps queued behind each other are finalized in one pass of the resolver (not one trip through
    its loop per step); a step that fails in the middle is dropped and counted alone, and the steps
    behind it are still finalized, in order."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="one-pass", strict=False)
    resolver = steptrace._active.resolver
    with steptrace.step(0) as s:
        s.wait_for(object())
    assert steptrace.flush(30.0)
    # (The resolver thread keeps its own reference to its queue: a fresh one on the attribute holds the
    # handles back, whether Resolver.submit or the compiled step's exit appends them.)
    queue = resolver._queue
    items = resolver._queue = collections.deque()
    steps = 600
    for n in range(1, steps + 1):
        with steptrace.step(n) as s:
            s.wait_for(object())
    resolver._queue = queue
    handled = []
    real_handle, real_resolve = resolver._handle, resolver._resolve_step

    def counting_handle(item):
        handled.append(item)
        real_handle(item)

    def failing_resolve(step):
        if step.step == 300:
            raise RuntimeError("a bug in the resolver")
        return real_resolve(step)

    resolver._handle, resolver._resolve_step = counting_handle, failing_resolve
    resolver._queue.extend(items)
    resolver._wake.set()
    assert steptrace.flush(60.0)
    del resolver._handle, resolver._resolve_step
    numbers = [r["step"] for r in sink.steps()]
    assert numbers == [0] + [n for n in range(1, steps + 1) if n != 300]
    assert steptrace.stats()["dropped"] == {"resolver_error": 1}
    # One pass up to the failing step, one after it (and the flush's own item): not one per step.
    handled_steps = [item for item in handled if not isinstance(item, _resolver._Tail)]
    assert 2 <= len(handled_steps) <= 4
    steptrace.shutdown()
