"""The CUDA path against the rules real CUDA and PyTorch enforce (tests/fake_cuda.py names each
rule's source): graph capture from another thread, one hardware queue, several GPUs and the
per-thread current device, pool streams shared with NCCL, events that must be complete before
``elapsed_time``, and the user's own memory counters. These are the CPU checks of issue 18; each
failed on the code before it.

Ground truth is the simulated GPU's own timeline (each kernel's start and end, host
``perf_counter`` seconds). Durations are compared within 1 µs plus the clock's 20 ppm rate
difference: they are differences of events on one device and must not depend on calibration.
These are accuracy bounds, not speed thresholds.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
import sys
import threading
import time

import pytest

import steptrace
from steptrace.testing import MemorySink, capture

torch = pytest.importorskip("torch", reason="the CUDA path is torch's: pip install steptrace[torch]")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fake_cuda import FakeCuda, FakeCudaTensor  # noqa: E402

pytestmark = pytest.mark.integration

MS = 1e-3
US = 1e-6
# The simulated GPU clock runs 20 ppm fast; with no tight anchor (a device that never drains) the
# rate cannot be measured, so device seconds are reported as they are: within 20 ppm.
RATE = 20e-6


class ArrivalSink(MemorySink):
    """Notes when each step record reached the sink (host perf_counter)."""

    name = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.arrived: dict[int, float] = {}

    def export(self, records):
        now = time.perf_counter()
        for r in records:
            if r.get("type") == "step":
                self.arrived[r["step"]] = now
        super().export(records)


def test_a_global_mode_graph_capture_mid_run_is_never_invalidated(monkeypatch):
    """torch.cuda.graph captures in "global" mode: a query/record/elapsed_time from the resolver thread
    during it would invalidate the user's capture (pytorch#104487). Steps 0-2 are still running on
    the device through the whole capture, so the resolver is polling them."""
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        for n in range(8):
            with steptrace.step(n):
                for _ in range(4):
                    fake.run(15 * MS)  # 60 ms per step: steps 0-2 run through the capture below
                if n == 3:
                    with fake.graph_capture("global"):
                        deadline = time.perf_counter() + 0.15
                        while time.perf_counter() < deadline:
                            fake.run(0.1 * MS)  # captured, not executed
                            time.sleep(MS)
    assert fake.captures_invalidated == 0, fake.unsafe_calls_during_capture
    assert fake.records_on_capturing_stream == 0
    assert ("steptrace-resolver", "thread_local") in fake.driver.exchanges
    steps = sink.steps()
    assert [r["step"] for r in steps] == list(range(8))
    assert all(r["end_source"] == "device_clock" for r in steps)


def _poll_stretches(monkeypatch):
    """The longest stretch (seconds) over which the resolver thread kept polling one incomplete event
    (three queries or more, with no other query, no finalizing and no return to its wait in between): how long a
    resolver call waited on the device. Two looks alone are not a wait (the GIL may pass between)."""
    run = {"event": None, "since": 0.0, "count": 0}
    longest = [0.0]
    Event = torch.cuda.Event
    original_query = Event.query

    def query(self):
        before = time.perf_counter()
        done = original_query(self)
        if threading.current_thread().name == "steptrace-resolver":
            if done or run["event"] is not self:
                run["event"], run["since"], run["count"] = (None if done else self), before, 1
            else:
                run["count"] += 1
                if run["count"] >= 3:
                    longest[0] = max(longest[0], before - run["since"])
        return done

    monkeypatch.setattr(Event, "query", query)
    from steptrace import _wakeup

    original_wait = _wakeup.Wakeup.wait

    def wait(self, *args, **kwargs):
        if threading.current_thread().name == "steptrace-resolver":
            run["event"] = None  # it went back to waiting: whatever it polled next is a new look
        return original_wait(self, *args, **kwargs)

    monkeypatch.setattr(_wakeup.Wakeup, "wait", wait)
    from steptrace import _resolver

    original_handle = _resolver.Resolver._handle

    def handle(self, item):
        run["event"] = None  # it finalized something in between: not a wait either
        return original_handle(self, item)

    monkeypatch.setattr(_resolver.Resolver, "_handle", handle)
    return longest


def test_one_hardware_queue_never_drained_finalizes_every_step_while_training_with_exact_durations(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron): every stream, the calibration stream too, runs in
    submission order. 200 steps x 32 microbatches, the host one step ahead, so the device never
    drains: steps are finalized while training runs, durations are the device's to 1 µs, and the
    resolver never waits on the device."""
    fake = FakeCuda(monkeypatch, one_queue=True, drift_ppm=20.0)
    longest_poll = _poll_stretches(monkeypatch)
    sink = ArrivalSink()
    kernels: dict[int, list] = {}
    steptrace.init(sinks=[sink], jsonl=False, strict=True, run_id="test", backend="torch")
    try:
        for n in range(200):
            with steptrace.step(n):
                kernels[n] = []
                for i in range(32):
                    with steptrace.microbatch(i, stage=0, kind="forward"):
                        kernels[n].append(fake.run(0.4 * MS))
            if n:
                kernels[n - 1][-1].block_until_ready()  # the host runs one step ahead
        loop_end = time.perf_counter()
    finally:
        steptrace.shutdown()
    steps = {r["step"]: r for r in sink.steps()}
    assert sorted(steps) == list(range(200))
    late = [n for n in range(195) if sink.arrived[n] > loop_end]
    assert not late, f"{len(late)} steps were finalized only after training ended"
    lags = [sink.arrived[n] - kernels[n][-1].end_time for n in range(195)]
    assert max(lags) <= 1.0, max(lags)
    back_to_back = 0
    for n in range(1, 200):
        r, k = steps[n], kernels[n]
        assert r["end_source"] == "device_clock"
        true_interval = k[-1].end_time - kernels[n - 1][-1].end_time
        assert r["interval_seconds"] == pytest.approx(true_interval, abs=US + RATE * true_interval), n
        # The step's window opens at its start marker: at the previous step's end unless the device
        # drained in between (the host held up, e.g. waiting for the GIL), when it opens a launch early.
        if k[0].start_time == kernels[n - 1][-1].end_time:
            back_to_back += 1
            true_compute = k[-1].end_time - k[0].start_time
            assert r["compute_seconds"] == pytest.approx(true_compute, abs=US + RATE * true_compute), n
        else:
            assert r["compute_seconds"] >= k[-1].end_time - k[0].start_time - US, n
    assert back_to_back >= 150, back_to_back  # the device practically never drained
    mbs = {(m["step"], m["microbatch"]): m for m in sink.microbatches()}
    assert len(mbs) == 200 * 32
    for n in range(1, 200):
        for i in range(1, 32):
            if kernels[n][i].start_time == kernels[n][i - 1].end_time:
                assert mbs[n, i]["compute_seconds"] == pytest.approx(0.4 * MS, abs=US), (n, i)
    assert longest_poll[0] <= 1 * MS, longest_poll[0]


@pytest.mark.parametrize("style", ["set_device before init", "set_device after init", "never, model.to(rank)"])
def test_a_rank_on_gpu_1_is_timed_on_gpu_1_in_every_style(monkeypatch, style):
    """The current device is per host thread: the resolver's is 0 whatever the rank's is. A rank on GPU 1
    is timed on GPU 1 and reports GPU 1's memory, however it chose its device."""
    fake = FakeCuda(monkeypatch, gpus=2)
    never = style.startswith("never")
    if style == "set_device before init":
        torch.cuda.set_device(1)
    kernels = {}
    with capture(backend="auto" if never else "torch") as sink:
        if style == "set_device after init":
            torch.cuda.set_device(1)
        fake.allocate(3 * 2**30, device=1)
        for n in range(6):
            with steptrace.step(n) as s:
                kernels[n] = [fake.run(seconds, device=1) for seconds in (4 * MS, 2 * MS, 6 * MS)]
                if never:
                    s.wait_for(FakeCudaTensor(1))  # the loss lives on GPU 1
    steps = {r["step"]: r for r in sink.steps()}
    for n in range(1, 6):
        r, k = steps[n], kernels[n]
        truth = k[-1].end_time - k[0].start_time
        assert r["end_source"] == "device_clock", r
        assert r["compute_seconds"] == pytest.approx(truth, rel=0.01), (n, r["compute_seconds"], truth)
    assert steps[5]["device_memory"]["in_use_bytes"] == 3 * 2**30
    assert steps[5]["device_memory"]["peak_bytes"] == 3 * 2**30


def _bench_module():
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_runs_end_to_end_where_elapsed_time_refuses_incomplete_events(monkeypatch):
    """Real PyTorch refuses elapsed_time on an event that has not completed (c10 CUDAEvent::elapsed_time);
    the benchmark's hand-rolled "CUDA events" loop used to read the previous step's pair before it had."""
    fake = FakeCuda(monkeypatch)
    bench = _bench_module()
    measured = bench.measure(torch, lambda: fake.run(0.05 * MS), lambda: fake.run(0.5 * MS),
                             lambda: fake.run(2 * MS), rounds=1, iters=50, steps=8)
    assert set(measured["thread_cpu"]) == {"empty with", "steptrace"}
    assert all(v > 0 for v in measured["thread_cpu"]["steptrace"])
    assert all(len(v) == 1 for v in measured["throughput"].values())
    assert not [t for t in fake.synchronize_threads if t.startswith("steptrace")]


def test_a_memory_spike_is_never_put_on_another_step_and_the_users_peak_is_untouched(monkeypatch):
    """The allocator books memory at dispatch while the host runs ahead, and the resolver reads after the
    device finished, in batches: a per-step peak read there lands on the wrong step. Resetting the
    peak each step also clobbers the counter Megatron's report_memory and Lightning read."""
    fake = FakeCuda(monkeypatch)
    fake.allocate(2 * 2**30)
    with capture() as sink:
        for n in range(10):
            with steptrace.step(n):
                fake.run(5 * MS)
                if n == 5:
                    fake.allocate(30 * 2**30)  # a 30 GiB spike in step 5, freed in the same step
                    fake.run(5 * MS)
                    fake.free(30 * 2**30)
    assert torch.cuda.max_memory_allocated() == 32 * 2**30  # the user's counter, as they read it
    steps = sorted(sink.steps(), key=lambda r: r["step"])
    peaks = [r["device_memory"]["peak_bytes"] for r in steps]
    # The peak is the process's since start (as JAX reports it): never a per-step figure that a
    # batch of reads could put on another step.
    assert peaks == sorted(peaks)
    assert peaks[-1] == 32 * 2**30
    assert all("step_peak_bytes" not in r["device_memory"] for r in steps)


def test_a_busy_pool_stream_neither_stalls_nor_misplaces(monkeypatch):
    """torch.cuda.Stream() hands out 32 pool streams round robin, the same pool NCCL process groups use:
    with 32 busy process-group streams, a pool "side stream" is a stream that never drains."""
    fake = FakeCuda(monkeypatch)
    nccl = [torch.cuda.Stream() for _ in range(32)]  # one per process group
    for stream in nccl:
        fake.run(1.5, stream=stream)  # collectives that keep them busy for the whole run
    sink = ArrivalSink()
    kernels = {}
    steptrace.init(sinks=[sink], jsonl=False, strict=True, run_id="test", backend="torch")
    unix_offset = steptrace._active.resolver.unix_offset  # the records' own perf -> unix offset
    try:
        for n in range(40):
            with steptrace.step(n):
                kernels[n] = fake.run(4 * MS)
            time.sleep(2 * MS)
        loop_end = time.perf_counter()
        time.sleep(0.1)
    finally:
        steptrace.shutdown()
    steps = {r["step"]: r for r in sink.steps()}
    assert sorted(steps) == list(range(40))
    assert all(sink.arrived[n] <= loop_end + 0.1 for n in range(40))
    for n in range(40):
        r = steps[n]
        stated = r["placement_uncertainty_seconds"]
        assert stated < 50 * US, r
        assert abs(r["end_time"] - (kernels[n].end_time + unix_offset)) <= stated + US, (n, stated)
    assert fake.streams_created == 1  # the anchors' stream is steptrace's own, not one of the pool's


def test_without_the_driver_library_steptrace_says_so_and_still_times(monkeypatch, caplog):
    """No libcuda for ctypes: the resolver's calls cannot be made capture-safe and the anchors fall back to
    a high-priority pool stream; both are said once, and steps are still device-timed."""
    fake = FakeCuda(monkeypatch, driver=False)
    with caplog.at_level(logging.WARNING, logger="steptrace"), capture(backend="torch") as sink:
        for n in range(6):
            with steptrace.step(n):
                fake.run(2 * MS)
            time.sleep(MS)
    steps = sink.steps()
    assert [r["end_source"] for r in steps] == ["device_clock"] * 6
    assert all(r["compute_seconds"] == pytest.approx(2 * MS, abs=0.5 * MS) for r in steps[1:])
    messages = [r.getMessage() for r in caplog.records]
    assert sum("capture-safe" in m for m in messages) == 1
    assert sum("stream of its own" in m for m in messages) == 1
    assert fake.streams_created == 0


# -- issue 32: the CUDA path, second review -------------------------------------------------------
# Each test below failed on the code before issue 32 (commit 318c6bb), for the reason its docstring gives.


def test_compute_with_a_span_inside_is_the_devices_own_whatever_the_placement(monkeypatch):
    """A span inside a step is idle from when the device drained the work before it to when it ended.
    The drain time is a device timestamp placed on the host clock, the span's end a host time: their
    difference (so the step's compute) moved with the placement, by up to its uncertainty (milliseconds
    with no tight anchor: one hardware queue). A marker at the span's end makes it a device duration."""
    from steptrace import _clock

    monkeypatch.setattr(_clock.DeviceClock, "poll", lambda self, drained: None)  # no anchor, ever
    fake = FakeCuda(monkeypatch)
    kernels, spans = {}, {}
    with capture(backend="torch") as sink:
        unix_offset = steptrace._active.resolver.unix_offset
        for n in range(8):
            fake.device.synchronize()
            with steptrace.step(n):
                first = fake.run(4 * MS)
                with steptrace.span("data"):
                    time.sleep(8 * MS)  # the device drains 4 ms in
                span_end = time.perf_counter()
                second = fake.run(4 * MS)
            kernels[n], spans[n] = (first, second), span_end
            time.sleep(25 * MS)
    steps = {r["step"]: r for r in sink.steps()}
    assert max(r["placement_uncertainty_seconds"] for r in steps.values()) > 0.2 * MS  # placement is loose
    for n in range(1, 8):
        first, second = kernels[n]
        # The step's window opens at its start marker (between its host start and the first kernel) and
        # closes at the second kernel's end; it was idle from the first kernel's end to the span's end
        # marker, reached between the host leaving the span and the second kernel's start.
        host_start = steps[n]["host_start_time"] - unix_offset
        least = (second.end_time - first.start_time) - (second.start_time - first.end_time)
        most = (second.end_time - host_start) - (spans[n] - first.end_time)
        assert least - 2 * US <= steps[n]["compute_seconds"] <= most + 10 * US, n
