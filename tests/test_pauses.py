"""Host pauses of the training thread (issue 50, steptrace/_pauses.py, docs/pauses.md): garbage collections
from gc.callbacks charged as the idle reason ``gc`` by the overlap rule, the thread's run-queue wait and
faults from /proc, on real collections and a real competing process.

What CPython documents and these tests rely on (docs.python.org/3/library/gc.html#gc.callbacks): every
entry of ``gc.callbacks`` is called with ``("start", info)`` before and ``("stop", info)`` after each
collection, on the thread that triggered it, ``info`` holding ``generation`` and ``collected``. The
reference recorder below is a plain Python callback built on that alone: steptrace's charge is checked
against what it saw. The kernel side (Documentation/scheduler/sched-stats.rst): the second field of
``/proc/<pid>/task/<tid>/schedstat`` is the nanoseconds the thread spent waiting on a run queue."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import steptrace
from steptrace import _pauses
from steptrace._handles import _hotpath
from steptrace.testing import capture

WATCHES = [pytest.param(lambda: _pauses._PyGcWatch(8), id="python")]
if _hotpath is not None:
    WATCHES.append(pytest.param(lambda: _hotpath.GcWatch(8), id="compiled"))


class Reference:
    """What gc.callbacks says about the training thread's collections, by the documented protocol only."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.step: int | None = None  # the step the loop is in (set by the test around each step)
        self.by_step: dict[int, float] = {}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self.thread or self.step is None:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.by_step[self.step] = self.by_step.get(self.step, 0.0) + time.perf_counter() - self._start


def cyclic_garbage(n: int) -> None:
    """``n`` reference cycles left for the collector (only it can free them)."""
    for _ in range(n):
        a: list = []
        b = [a]
        a.append(b)


@pytest.mark.parametrize("make", WATCHES)
def test_the_watch_keeps_the_armed_threads_collections_with_generation_and_count(make):
    watch = make()
    gc.callbacks.append(watch)
    try:
        watch.arm()
        gc.disable()  # the cycles stay young until the explicit collection
        try:
            cyclic_garbage(1000)
            before = time.perf_counter()
            gc.collect(1)
            after = time.perf_counter()
        finally:
            gc.enable()
        # Another thread's collection did not pause this one: counted, not kept.
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
        kept = watch.take()
    finally:
        gc.callbacks.remove(watch)
    explicit = [p for p in kept if p[2] == 1]
    assert len(explicit) == 1
    start, end, generation, collected = explicit[0]
    assert before <= start <= end <= after  # time.perf_counter's clock
    assert collected >= 2000  # the cycles' lists
    assert all(p[2] != 2 for p in kept)  # the other thread's full collection is not there
    assert watch.other_threads >= 1
    assert watch.take() == []  # taken once


@pytest.mark.parametrize("make", WATCHES)
def test_a_full_ring_drops_the_oldest_pauses_and_counts_them(make):
    watch = make()  # 8 slots
    gc.callbacks.append(watch)
    try:
        watch.arm()
        for _ in range(11):
            gc.collect(0)
        kept = watch.take()
        watch.disarm()
        gc.collect(0)
    finally:
        gc.callbacks.remove(watch)
    assert len(kept) == 8 and watch.dropped >= 3
    assert kept == sorted(kept)  # oldest first
    assert watch.take() == []  # disarmed: nothing kept


def test_pauses_must_be_a_bool():
    with pytest.raises(ValueError, match="pauses must be True or False"):
        steptrace.init(pauses="sometimes", jsonl=False)
    steptrace.shutdown()


def test_a_collection_inside_a_host_step_is_charged_gc_within_ten_percent_of_what_gc_callbacks_saw():
    reference = Reference()
    gc.callbacks.append(reference)
    steps_with_garbage = {4, 7}
    try:
        with capture(pauses=True) as sink:
            for n in range(10):
                reference.step = n
                with steptrace.step(n):
                    time.sleep(0.005)
                    with steptrace.span("data"):
                        if n in steps_with_garbage:
                            cyclic_garbage(150_000)
                            gc.collect()
                    time.sleep(0.005)
                reference.step = None
    finally:
        gc.callbacks.remove(reference)
    for record in sink.steps():
        assert sum(record["idle_breakdown"].values()) == pytest.approx(record["idle_seconds"], abs=1e-9)
        pauses = record["host_pauses"]
        charged = record["idle_breakdown"].get("gc", 0.0)
        if record["step"] in steps_with_garbage:
            assert pauses["gc_collections"][2] >= 1 and pauses["gc_collected"] >= 250_000
            # What the documented callback saw in the step, against the charge (a CPU step: all of it idle).
            seen = reference.by_step[record["step"]]
            assert seen > 0.02
            assert charged == pytest.approx(seen, rel=0.10)
            assert pauses["gc_seconds"] == pytest.approx(seen, rel=0.10)
            # The collection ran inside the data span: it is the innermost, so it wins that time.
            assert record["idle_breakdown"]["data"] < charged
        else:
            assert charged <= 0.002
        assert pauses["preempted_seconds"] is None or pauses["preempted_seconds"] >= 0.0


def test_a_collection_while_a_jax_like_device_computes_is_hidden_and_one_before_dispatch_is_charged():
    from steptrace.testing import SimulatedDevice

    device = SimulatedDevice()
    try:
        with capture(pauses=True) as sink:
            for n in range(6):
                with steptrace.step(n) as s:
                    with steptrace.span("data"):
                        if n == 3:  # before the work is handed over (a span's end): the device has none
                            cyclic_garbage(100_000)
                            gc.collect()
                    out = device.run(0.03)
                    s.wait_for(out)
                    if n == 4:  # after wait_for, while the device computes its 30 ms: hidden
                        gc.collect(0)
                    time.sleep(0.04)  # the device is done before the next step: each step's interval is its own
    finally:
        device.close()
    steps = {r["step"]: r for r in sink.steps()}
    assert steps[3]["idle_breakdown"].get("gc", 0.0) == pytest.approx(steps[3]["host_pauses"]["gc_seconds"],
                                                                      rel=0.10)
    assert steps[3]["host_pauses"]["gc_seconds"] > 0.01
    assert steps[3]["idle_breakdown"]["data"] < steps[3]["idle_breakdown"]["gc"]
    assert steps[4]["host_pauses"]["gc_collections"][0] >= 1
    assert steps[4]["idle_breakdown"].get("gc", 0.0) == 0.0


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="this kernel gives no per-thread schedstat (CONFIG_SCHEDSTATS)")
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_a_thread_sharing_its_cpu_with_a_busy_process_is_seen_waiting_on_the_run_queue():
    """Robust by what it checks: pinned to one CPU with a process that never sleeps, the kernel's fair
    scheduler runs each for about half the time, so a 0.4 s CPU-bound loop waits at least a quarter of
    its wall time on the run queue (whatever else the shared machine runs, it only adds wait)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    previous = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # the busy process is running, pinned
        counters = _pauses.ThreadCounters(threading.get_native_id())
        os.sched_setaffinity(0, {cpu})
        try:
            before = counters.read()
            start = time.perf_counter()
            while time.perf_counter() - start < 0.4:
                pass
            wall = time.perf_counter() - start
            after = counters.read()
        finally:
            os.sched_setaffinity(0, previous)
            counters.close()
    finally:
        busy.kill()
        busy.wait()
    assert before[0] is not None and after[0] is not None
    assert after[0] - before[0] >= 0.25 * wall
    assert after[1] - before[1] >= 1  # involuntary switches: the kernel took the CPU away


# -- across ranks: the OTLP step span, the collector's join and metrics -------------------------------------


def test_otlp_step_span_carries_host_pauses_flat():
    pytest.importorskip("opentelemetry.sdk", reason="needs steptrace[otlp]")
    from otlp_receiver import OtlpHttpReceiver

    with OtlpHttpReceiver() as receiver:
        with capture(pauses=True, otlp_endpoint=receiver.url, otlp_batch_delay_s=0.05) as sink:
            for n in range(4):
                with steptrace.step(n):
                    if n == 2:
                        cyclic_garbage(50_000)
                        gc.collect()
        spans = {s.attributes["train.step"]: s.attributes for s in receiver.spans() if s.name == "train.step"}
        metric = receiver.last_metric("steptrace.host_pause")
    # The counter: every step's collections, by cause (point attributes as the OTLP proto holds them).
    by_cause = {next(kv.value.string_value for kv in p.attributes if kv.key == "train.pause.cause"): p.as_double
                for p in metric.sum.data_points}
    assert by_cause["gc"] == pytest.approx(sum(r["host_pauses"]["gc_seconds"] for r in sink.steps()), rel=1e-9)
    record = next(r for r in sink.steps() if r["step"] == 2)
    attrs, pauses = spans[2], record["host_pauses"]
    assert attrs["train.host_pauses.gc_seconds"] == pauses["gc_seconds"] > 0
    assert attrs["train.host_pauses.gc_max_generation"] == 2
    assert attrs["train.host_pauses.gc_collections.2"] == pauses["gc_collections"][2] >= 1
    assert attrs["train.idle.gc_seconds"] == record["idle_breakdown"]["gc"]
    if pauses["preempted_seconds"] is None:
        assert "train.host_pauses.preempted_seconds" not in attrs  # unmeasured: left out, never 0
    else:
        assert attrs["train.host_pauses.preempted_seconds"] == pauses["preempted_seconds"]


def _pause_span(rank: int, *, gc_seconds: float, wait: float, step: int = 5, preempted: float | None = 0.001):
    from collector_helpers import step_span

    attrs = {"train.collective_wait_seconds": wait, "train.idle.gc_seconds": gc_seconds,
             "train.host_pauses.gc_seconds": gc_seconds, "train.host_pauses.gc_max_seconds": gc_seconds,
             "train.host_pauses.gc_max_generation": 2 if gc_seconds else 0}
    if preempted is not None:
        attrs["train.host_pauses.preempted_seconds"] = preempted
    return step_span(step=step, rank=rank, compute=0.32, interval=0.33, world_size=2, **attrs)


def test_the_collector_names_the_stragglers_host_cause_and_counts_it_per_rank():
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    pytest.importorskip("prometheus_client", reason="the collector needs steptrace[prometheus]")
    from prometheus_client import generate_latest

    from collector_helpers import request, step_span, value
    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner
    from steptrace.collector._metrics import ClusterMetrics
    from steptrace.collector._runlog import _span_from_values, _span_line

    # Rank 1 collected for 300 ms; rank 0 waited for it in the all-reduce.
    steps = extract_steps(request(_pause_span(0, gc_seconds=0.0, wait=0.30),
                                  _pause_span(1, gc_seconds=0.30, wait=0.002))).steps
    assert steps[1].causes == {"gc": pytest.approx(0.30), "data": 0.0, "preempted": 0.001}
    assert steps[1].gc_max == (pytest.approx(0.30), 2)
    # The journal keeps them (a restarted collector replays them).
    assert _span_from_values(json.loads(_span_line(steps[1]))) == steps[1]
    (record,) = Joiner(world_size=2, per_rank=True).add(steps).records
    assert record["straggler_rank"] == 1
    assert record["straggler_causes"] == {"gc": pytest.approx(0.30)}
    assert record["straggler_gc"] == {"max_seconds": pytest.approx(0.30), "generation": 2}
    metrics = ClusterMetrics()
    metrics.publish([record])
    text = generate_latest(metrics.registry).decode()
    assert value(text, "steptrace_cluster_straggler_cause_seconds_total", run_id=record["run_id"], rank="1",
                 cause="gc") == pytest.approx(0.30)
    assert value(text, "steptrace_cluster_straggler_cause_seconds_total", run_id=record["run_id"], rank="1",
                 cause="preempted") is None  # no series for a cause it was not named with

    # A rank that did not measure its pauses: no cause is claimed (its gc would read as none).
    (unmeasured,) = Joiner(world_size=2).add(extract_steps(request(
        _pause_span(0, gc_seconds=0.0, wait=0.30, step=6),
        step_span(step=6, rank=1, compute=0.32, interval=0.33, world_size=2,
                  **{"train.collective_wait_seconds": 0.002}))).steps).records
    assert unmeasured["straggler_rank"] == 1 and unmeasured["straggler_causes"] is None


# -- the job's GC finding and coordinated collection --------------------------------------------------------


def _gc_record(step: int, gc_seconds: float, wait: float | None = None) -> dict:
    record = {"type": "step", "status": "ok", "step": step, "idle_breakdown": {"gc": gc_seconds} if gc_seconds else {},
              "host_pauses": {"gc_seconds": gc_seconds}}
    if wait is not None:
        record["collective_wait_seconds"] = wait
    return record


def test_the_gc_finding_prices_staggered_collections_and_the_coordinated_alternative():
    from steptrace.analysis.pauses import gc_finding, gc_sentence

    # Two ranks collect 300 ms every 6 steps, three steps apart: each collection makes the other wait.
    ranks = {rank: [_gc_record(n, 0.3 if n % 6 == 3 * rank and n else 0.001, wait=0.0) for n in range(24)]
             for rank in (0, 1)}
    for rank in (0, 1):
        for record in ranks[rank]:
            other_collects = any(r["step"] == record["step"] and r["idle_breakdown"].get("gc", 0) > 0.1
                                 for r in ranks[1 - rank])
            record["collective_wait_seconds"] = 0.3 if other_collects else 0.0
    finding = gc_finding(ranks)
    assert finding["long_collections"] == {"0": 3, "1": 4}
    assert finding["aligned_share"] == 0.0
    assert finding["job_gc_seconds"] == pytest.approx(7 * 0.3 + 17 * 0.001)
    assert finding["waited_seconds"] == pytest.approx(7 * 0.3)
    assert finding["every_steps"] == 7  # the median of the ranks' periods, 24/3 and 24/4
    assert finding["coordinated_estimate_seconds"] == pytest.approx((23 // 7) * 0.3)
    assert finding["saving_seconds"] == pytest.approx(finding["job_gc_seconds"] - 0.9)
    assert gc_finding(ranks, every_steps=6)["coordinated_estimate_seconds"] == pytest.approx(3 * 0.3)
    assert "steptrace.gc_every(7)" in gc_sentence(finding)
    # Aligned collections: nothing to suggest; a rank that measured no pauses: no finding.
    aligned = {rank: [_gc_record(n, 0.3 if n % 6 == 5 else 0.0) for n in range(12)] for rank in (0, 1)}
    assert gc_finding(aligned)["aligned_share"] == 1.0 and "gc_every" not in gc_sentence(gc_finding(aligned))
    assert gc_finding({0: ranks[0], 1: [{**r, "host_pauses": None} for r in ranks[1]]}) is None


def test_gc_every_turns_automatic_collection_off_and_collects_every_nth_step():
    with pytest.raises(ValueError, match="n must be a whole number"):
        steptrace.gc_every(0)
    with pytest.raises(ValueError, match="generation"):
        steptrace.gc_every(5, generation=3)
    assert gc.isenabled()
    watch = _pauses._PyGcWatch(64)
    gc.callbacks.append(watch)
    sched = steptrace.gc_every(4, generation=1)
    try:
        assert not gc.isenabled()
        watch.arm()
        collected = [n for n in range(10) if sched(n)]
        cyclic_garbage(5000)  # automatic collection is off: nothing collects these
        kept = watch.take()
    finally:
        sched.close()
        gc.callbacks.remove(watch)
    assert gc.isenabled()
    assert collected == [0, 4, 8] and sched.collections == 3
    assert [p[2] for p in kept] == [1, 1, 1]  # the scheduled ones, of the generation asked


def test_rank_metrics_count_each_cause_and_leave_unmeasured_counters_alone():
    pytest.importorskip("prometheus_client", reason="needs steptrace[prometheus]")
    from prometheus_client import generate_latest

    from collector_helpers import value
    from steptrace.prometheus import PrometheusSink

    sink = PrometheusSink(0, run_id="r", rank=1)
    try:
        base = {"type": "step", "run_id": "r", "rank": 1, "step": 0, "status": "ok", "interval_seconds": 0.4,
                "compute_seconds": 0.1, "idle_breakdown": {"gc": 0.3}}
        plain = {**base, "idle_breakdown": {}}
        sink.export([plain])  # pauses off: no pause series
        text = generate_latest(sink._metrics).decode()
        assert value(text, "steptrace_host_pause_seconds_total", run_id="r", rank="1", cause="gc") is None
        assert value(text, "steptrace_major_faults_total", run_id="r", rank="1") is None
        pauses = {"gc_seconds": 0.3, "gc_collections": [4, 1, 1], "gc_collected": 10, "gc_max_seconds": 0.29,
                  "gc_max_generation": 2, "preempted_seconds": 0.02, "involuntary_switches": 3, "major_faults": 2}
        sink.export([{**base, "step": 1, "host_pauses": pauses},
                     {**base, "step": 2, "host_pauses": {**pauses, "preempted_seconds": None, "major_faults": None}}])
        text = generate_latest(sink._metrics).decode()
        labels = {"run_id": "r", "rank": "1"}
        assert value(text, "steptrace_host_pause_seconds_total", cause="gc", **labels) == pytest.approx(0.6)
        assert value(text, "steptrace_host_pause_seconds_total", cause="preempted", **labels) == pytest.approx(0.02)
        assert value(text, "steptrace_gc_collections_total", generation="2", **labels) == 2
        assert value(text, "steptrace_gc_collections_total", generation="0", **labels) == 8
        assert value(text, "steptrace_major_faults_total", **labels) == 2
        assert value(text, "steptrace_involuntary_switches_total", **labels) == 6
        assert value(text, "steptrace_step_idle_seconds_total", reason="gc", **labels) == pytest.approx(0.6)
    finally:
        sink.shutdown(1)


def test_trackers_and_the_slow_capture_say_what_paused_the_host():
    from steptrace._pauses import pause_clause
    from steptrace.trackers import tracker_points

    pauses = {"gc_seconds": 0.3, "gc_collections": [3, 0, 1], "gc_max_seconds": 0.29, "gc_max_generation": 2,
              "preempted_seconds": 0.012, "major_faults": 0, "involuntary_switches": 4}
    record = {"type": "step", "step": 3, "status": "ok", "end_time": 10.0, "interval_seconds": 0.4,
              "compute_seconds": 0.1, "idle_breakdown": {"gc": 0.3}, "host_pauses": pauses}
    (point,) = tracker_points([record])
    assert point.values["idle/gc_seconds"] == 0.3
    assert point.values["pause/gc_seconds"] == 0.3 and point.values["pause/preempted_seconds"] == 0.012
    assert point.values["pause/major_faults"] == 0
    assert pause_clause(record) == "; host pauses: gc 300 ms (largest a gen-2 collection of 290 ms), preempted 12 ms"
    assert pause_clause({**record, "host_pauses": {**pauses, "gc_seconds": 0.0, "preempted_seconds": None}}) == ""
    assert pause_clause({"type": "step"}) == ""


def test_the_collectors_straggler_verdict_says_its_host_cause_to_the_capture():
    """The verdict the capture's ``straggler`` trigger hands to the ranks (collector/_captures.py) says why."""
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    pytest.importorskip("prometheus_client", reason="the collector needs steptrace[prometheus]")
    from collector_helpers import request
    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner
    from steptrace.collector._metrics import ClusterMetrics

    verdicts = []
    metrics = ClusterMetrics(straggler_window_steps=8)
    metrics.on_verdict = lambda *args: verdicts.append(args)
    joiner = Joiner(world_size=2, per_rank=True)
    for n in range(8):
        steps = extract_steps(request(_pause_span(0, gc_seconds=0.0, wait=0.30, step=n),
                                      _pause_span(1, gc_seconds=0.30, wait=0.002, step=n))).steps
        metrics.publish(joiner.add(steps).records)
    _run_id, culprit, _reference, _step, detail = verdicts[0]
    assert culprit == 1
    # The verdict comes once the rank is persistent (3 complete steps, steptrace._attribution's minimum).
    assert detail == ("named in 100 % of its last 3 complete steps, median cost 298 ms, host cause: gc in 3 of 3 "
                      "steps it was named")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs os.posix_fadvise (Linux) to evict a file's pages")
@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/stat"),
                    reason="needs Linux's per-thread /proc stat")
def test_major_faults_count_pages_read_from_disk_by_this_thread(tmp_path):
    """proc(5): majflt (field 12 of /proc/<pid>/task/<tid>/stat) counts the thread's faults that loaded a page
    from disk. A mapped file whose pages were dropped from the page cache (POSIX_FADV_DONTNEED on clean,
    synced pages) faults them in from disk as it is read."""
    import mmap

    path = tmp_path / "pages"
    pages = 256
    with open(path, "wb") as f:
        f.write(os.urandom(pages * mmap.PAGESIZE))
        f.flush()
        os.fsync(f.fileno())
    counters = _pauses.ThreadCounters(threading.get_native_id())
    try:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            before = counters.read()
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                total = sum(mapped[i] for i in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE))
            after = counters.read()
    finally:
        counters.close()
    assert total >= 0
    if after[2] - before[2] == 0:
        pytest.skip("the kernel kept the file's pages (a filesystem that ignores DONTNEED, e.g. tmpfs)")
    assert after[2] - before[2] >= 1


def test_counters_the_kernel_does_not_offer_are_absent_not_zero():
    counters = _pauses.ThreadCounters(2**31 - 1)  # no such thread: no file to read
    try:
        assert counters.read() == (None, None, None)
    finally:
        counters.close()
    summary = _pauses.summary([], (None, None, None), 0)
    assert summary["preempted_seconds"] is None and summary["major_faults"] is None
    assert summary["involuntary_switches"] is None and summary["gc_seconds"] == 0.0


def test_collections_the_ring_cannot_hold_are_counted_as_dropped(monkeypatch):
    monkeypatch.setattr(_pauses, "GC_RING", 4)
    with capture(pauses=True) as sink:
        with steptrace.step(0):
            pass
        with steptrace.step(1):
            for _ in range(10):
                gc.collect(0)
        steptrace.flush()
        dropped = steptrace.stats()["dropped"]
    record = next(r for r in sink.steps() if r["step"] == 1)
    kept = sum(record["host_pauses"]["gc_collections"])
    assert kept == 4  # the newest four: the oldest went first
    # Counted on the record the resolver was finalizing when it found them gone (which step a dropped
    # collection belonged to is what was lost), and in the run's drops.
    on_records = sum(r["host_pauses"].get("gc_dropped", 0) for r in sink.steps())
    assert on_records == dropped["gc_pauses"] >= 6
