"""The CUDA path on a CPU machine: the real TorchCudaDevice against a simulated GPU (tests/fake_cuda.py).

The simulated stream keeps executing while the training thread holds the GIL
(steptrace.testing.hold_gil), and its events carry the device's own drifting
clock, so these tests check what the GPU tests in tests/gpu/ check against a
real kernel timeline: every time comes from the device clock, never from when
the resolver got to look. Ground truth is the simulated stream's timeline
(each kernel's start and end), converted to the records' unix seconds.
Tolerances are the calibration's (microseconds), with room for a loaded CI
machine; they are not speed thresholds.
"""

from __future__ import annotations

import sys
import time

import pytest

import steptrace
from steptrace.testing import SimulatedDevice, capture, hold_gil

torch = pytest.importorskip("torch", reason="the CUDA path is torch's: pip install steptrace[torch]")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fake_cuda import FakeCuda, FakeCudaTensor  # noqa: E402

pytestmark = pytest.mark.integration

MS = 1e-3
TOL = 0.5 * MS  # calibration error is microseconds; this leaves room for a loaded machine


class Truth:
    """The simulated stream's own timeline, on the records' unix clock (the run's own perf -> unix
    offset: matching a record's host start to a perf_counter() read after it was off by however
    long the thread was preempted in between, milliseconds on a loaded machine)."""

    def __init__(self):
        self.offset = steptrace._active.resolver.unix_offset

    def unix(self, perf_time: float) -> float:
        return perf_time + self.offset


def test_steps_around_a_gil_holding_call_keep_their_device_times(monkeypatch):
    """A 30 ms GIL-holding call between steps (a C sort, pickling) used to delay the resolver's
    reading of the clock and move time between steps; device-clock times do not move. Launches give
    the GIL away as torch's do: the resolver, waiting since the sort began, runs at the first chance;
    a start marker recorded through torch (which releases the GIL) let it run between the marker and
    the first kernel, the GPU idle, which added 0.2-1.4 ms to those steps on an H200 and up to 2.5 ms
    here. Markers are recorded keeping the GIL."""
    fake = FakeCuda(monkeypatch)
    fake.launches_release_gil = True
    kernels = {}
    with capture() as sink:
        truth = Truth()
        for n in range(12):
            with steptrace.step(n):
                kernels[n] = [fake.run(4 * MS) for _ in range(4)]  # 16 ms of device work
            if n % 3 == 1:
                hold_gil(0.03)  # while the device finishes step n, nobody else can run Python
    steps = {r["step"]: r for r in sink.steps()}
    assert fake.event_synchronize_calls == 0
    for n in range(12):
        r = steps[n]
        assert r["backend"] == "torch-cuda" and r["end_source"] == "device_clock"
        first, last = kernels[n][0], kernels[n][-1]
        assert r["end_time"] == pytest.approx(truth.unix(last.end_time), abs=TOL), n
        assert r["compute_seconds"] == pytest.approx(last.end_time - first.start_time, abs=TOL), n
        if n:
            prev_last = kernels[n - 1][-1]
            assert r["interval_seconds"] == pytest.approx(last.end_time - prev_last.end_time, abs=TOL), n


def test_checkpoint_blocking_and_the_saved_step_are_true_when_the_save_holds_the_gil(monkeypatch):
    """torch.save pickles holding the GIL: the saved step's end must not be stamped after it."""
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        truth = Truth()
        for n in range(5):
            with steptrace.step(n):
                last = fake.run(20 * MS)
                if n == 2:
                    saved_end = last.end_time
            if n == 2:
                with steptrace.checkpoint(n):
                    hold_gil(0.1)  # starts while steps 0-2 (60 ms) still run on the device
    steps = {r["step"]: r for r in sink.steps()}
    (ckpt,) = sink.checkpoints()
    assert steps[2]["end_time"] == pytest.approx(truth.unix(saved_end), abs=TOL)
    true_blocking = ckpt["end_time"] - max(ckpt["start_time"], truth.unix(saved_end))
    assert ckpt["blocking_seconds"] == pytest.approx(true_blocking, abs=TOL)
    # The save began mid-step (by the stream's own timeline, not the plan: on a loaded machine the
    # 0.1 s hold oversleeps and the launches spread out), so it blocked for less than it took.
    overlap = truth.unix(saved_end) - ckpt["start_time"]
    assert overlap > 10 * MS
    assert ckpt["blocking_seconds"] == pytest.approx(ckpt["host_seconds"] - overlap, abs=TOL)
    # The save is the next step's checkpoint idle, and nothing of it is "other" idle of the saved step.
    assert steps[2]["idle_breakdown"].get("other", 0.0) < TOL
    assert steps[3]["idle_breakdown"]["checkpoint"] == pytest.approx(ckpt["blocking_seconds"], abs=TOL)


def test_each_microbatch_has_its_own_markers_and_the_bubble_is_true(monkeypatch):
    """Four microbatches per step, with host gaps that starve the stage: every microbatch keeps its own
    device time (they used to collapse to ~0.02 ms) and the bubble ratio matches the stream's."""
    fake = FakeCuda(monkeypatch)
    plan = [2 * MS, 7 * MS, 3 * MS, 5 * MS]
    launched = {}
    # When the host entered and left each microbatch (and step): a marker recorded on an idle device
    # completes when it is recorded, so a host preempted inside a microbatch (a loaded CI machine: 9 ms
    # seen) rightly widens its window. Exactness is asserted where the host kept ahead of the device.
    entered, left = {}, {}
    with capture() as sink:
        for n in range(4):
            entered[n] = time.perf_counter()
            with steptrace.step(n):
                for i, seconds in enumerate(plan):
                    entered[n, i] = time.perf_counter()
                    with steptrace.microbatch(i, stage=0, kind="forward"):
                        launched[n, i] = fake.run(seconds)
                    left[n, i] = time.perf_counter()
                    if i < 3:
                        time.sleep(4 * MS)  # host work between microbatches: the device waits
            left[n] = time.perf_counter()
            if n == 1:
                hold_gil(0.03)

    def kept_ahead(n, i):  # the end marker was recorded before the kernel ended, the start one just before it
        return left[n, i] < launched[n, i].end_time and launched[n, i].start_time - entered[n, i] < TOL / 2

    mbs = sink.microbatches()
    assert len(mbs) == 16
    exact = 0
    for m in mbs:
        n, i = m["step"], m["microbatch"]
        assert m["end_source"] == "device_clock"
        # Never collapsed (they once read ~0.02 ms): at least the kernel, at most what the host spanned.
        widest = max(launched[n, i].end_time, left[n, i]) - min(launched[n, i].start_time, entered[n, i])
        assert plan[i] - TOL <= m["compute_seconds"] <= widest + TOL, m
        if kept_ahead(n, i):
            exact += 1
            assert m["compute_seconds"] == pytest.approx(plan[i], abs=TOL), m
    assert exact >= 1  # the exact case was checked at least once (on a quiet machine: all 16)
    for r in sink.steps():
        n = r["step"]
        if all(kept_ahead(n, i) for i in range(4)) and left[n] < launched[n, 3].end_time:
            true_compute = launched[n, 3].end_time - launched[n, 0].start_time
            assert r["compute_seconds"] == pytest.approx(true_compute, abs=TOL)
            assert r["pipeline_bubble_ratio"]["0"] == pytest.approx(1 - sum(plan) / true_compute, abs=0.02)
        # Whatever the host did, the bubble is the step's stage window less its microbatches' compute
        # (the records' times are placed on the host clock: to its placement, microseconds).
        own = [m for m in mbs if m["step"] == n]
        window = max(m["end_time"] for m in own) - r["start_time"]
        assert r["pipeline_bubble_ratio"]["0"] == pytest.approx(
            1 - sum(m["compute_seconds"] for m in own) / window, abs=1e-3)


def test_cuda_steps_need_no_wait_for_and_cuda_tensors_keep_event_timing(monkeypatch):
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        with steptrace.step(0):
            fake.run(5 * MS)
        with steptrace.step(1) as s:
            fake.run(5 * MS)
            s.wait_for(FakeCudaTensor())
    assert [(r["backend"], r["end_source"]) for r in sink.steps()] == [("torch-cuda", "device_clock")] * 2
    assert [r["compute_seconds"] for r in sink.steps()] == [pytest.approx(5 * MS, abs=TOL)] * 2


def test_jax_arrays_are_timed_by_jax_even_with_torch_cuda_initialised(monkeypatch):
    """A JAX program that imports torch (a DataLoader with pin_memory initialises CUDA) used to be timed
    on an empty torch stream."""
    jax = pytest.importorskip("jax")
    FakeCuda(monkeypatch)
    f = jax.jit(lambda x: (x @ x).sum())
    x = jax.numpy.ones((256, 256))
    f(x).block_until_ready()
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                s.wait_for(f(x))
    assert [r["backend"] for r in sink.steps()] == ["jax"] * 3
    assert [r["end_source"] for r in sink.steps()] == ["observed"] * 3


def test_cpu_torch_on_a_gpu_machine_is_host_timed(monkeypatch):
    """CUDA available but never initialised (the program trains on CPU): host timing, labelled host."""
    fake = FakeCuda(monkeypatch, initialized=False)
    model = torch.nn.Linear(64, 64)
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n):
                model(torch.randn(32, 64)).sum().backward()
    assert [(r["backend"], r["end_source"]) for r in sink.steps()] == [("host", "host")] * 3
    assert fake.events_created == 0


def test_cpu_tensors_in_wait_for_make_the_step_host_timed_even_with_cuda_initialised(monkeypatch):
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                loss = torch.ones(4).sum()
                s.wait_for(loss)
    assert [(r["backend"], r["end_source"]) for r in sink.steps()] == [("host", "host")] * 3
    # The first step's speculative markers went back to the pool; later steps recorded none (the events
    # are the pool's first reserve, made before the first marker).
    from steptrace.adapters import torch as torch_adapter

    assert fake.events_created <= torch_adapter._POOL_RESERVE
    assert fake.driver.calls.count(("MainThread", "cuEventRecord")) <= 2


def test_events_come_from_a_pool_and_all_go_back(monkeypatch):
    """Steady state allocates no event on the training thread, and no marker is leaked."""
    device = SimulatedDevice(clock_drift_ppm=-40.0)
    fake = FakeCuda(monkeypatch, device)
    with capture() as sink:
        for n in range(200):
            with steptrace.step(n):
                fake.run(0.2 * MS)
            time.sleep(MS)  # host work between steps
    assert len(sink.steps()) == 200
    # About one poll's worth of steps (20 ms) is in flight at a time; 200 steps need 400 markers
    # without a pool.
    assert fake.events_created < 120


def test_the_resolver_polls_and_never_spins_or_synchronises(monkeypatch):
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        with steptrace.step(0):
            fake.run(0.4)  # a long device step
        time.sleep(0.45)
    assert sink.steps()[0]["compute_seconds"] == pytest.approx(0.4, abs=TOL)
    assert fake.event_synchronize_calls == 0
    # Polling every 20 ms is ~20 queries in 0.4 s (plus calibration); a spin would be hundreds of thousands.
    assert fake.query_calls < 400


def test_no_marker_is_recorded_while_a_cuda_graph_is_being_captured(monkeypatch):
    fake = FakeCuda(monkeypatch)
    fake.capturing = True
    with capture() as sink:
        with steptrace.step(0):
            fake.run(MS)
    assert fake.events_created == 0
    assert sink.steps()[0]["backend"] == "host"


def clock_uncertainty() -> float:
    """The simulated GPU's current placement uncertainty (half-width, seconds; inf before any sample)."""
    (clock,) = steptrace.stats()["device_clock"].values()
    value = clock["uncertainty_seconds"]
    return float("inf") if value is None else value


def test_a_side_stream_queued_behind_the_training_stream_degrades_gracefully(monkeypatch):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 a calibration marker waits behind queued kernels, so an anchor
    is tight only when the device has drained (a data stall here). Steps are finalized at once with
    what is known (they used to wait up to 5 s for a tight anchor): durations are the device's, and
    every step's end lies within the placement uncertainty its record states, tight after the stall."""
    device = SimulatedDevice(side_stream_blocked=True, clock_drift_ppm=50.0)
    fake = FakeCuda(monkeypatch, device)
    kernels = {}
    with capture() as sink:
        unix_offset = Truth().offset
        for n in range(20):
            with steptrace.step(n):
                kernels[n] = fake.run(10 * MS)
            if n % 4 == 3:
                device.synchronize()  # the loop reads a grad norm: the stream drains for a moment
            if n == 11:
                time.sleep(0.1)  # a data stall: the device idles, and an anchor is taken...
                deadline = time.perf_counter() + 5.0
                while clock_uncertainty() > 20e-6 and time.perf_counter() < deadline:
                    time.sleep(0.02)  # ...tight unless the resolver was preempted inside it: retaken
    steps = {r["step"]: r for r in sink.steps()}
    for n in range(20):
        r = steps[n]
        stated = r["placement_uncertainty_seconds"]
        kernel_end = kernels[n].end_time + unix_offset
        assert abs(r["end_time"] - kernel_end) <= stated + 1e-6, (n, stated)
        if n % 4:
            assert r["compute_seconds"] == pytest.approx(10 * MS, abs=2e-6), n
        else:
            # After a drain the step's window opens at its start marker, reached once the host
            # recorded it, before the kernel's launch (by however long the host took to launch it).
            assert 10 * MS - 2e-6 <= r["compute_seconds"] <= kernel_end - r["host_start_time"] + 10e-6, n
    assert all(steps[n]["placement_uncertainty_seconds"] < 50e-6 for n in range(13, 20))


def test_the_first_step_keeps_its_device_duration_when_only_a_wide_sample_places_it(monkeypatch):
    """With one hardware queue the first anchor waits behind the first step's kernel; a GIL-holding
    call then keeps the resolver from looking until well after the kernel ended, so every sample
    but the step's own start marker brackets the end widely, and their midpoint lies before the
    kernel even ended. The step's start marker cannot have been reached before the host recorded it:
    its sample joins the map before the step is placed, so the step's compute is the device's
    (it came out as what the early midpoint left after the host start: 78 of 100 ms)."""
    device = SimulatedDevice(one_queue=True)
    fake = FakeCuda(monkeypatch, device)
    with capture() as sink:
        unix_offset = Truth().offset
        with steptrace.step(0):
            kernel = fake.run(100 * MS)
        time.sleep(0.03)  # the resolver looks: the step's end marker and its anchor are incomplete
        hold_gil(0.1)  # ...and cannot look again until 30 ms after the kernel ended
    (step,) = sink.steps()
    assert step["end_source"] == "device_clock"
    assert abs(step["end_time"] - (kernel.end_time + unix_offset)) <= step["placement_uncertainty_seconds"] + 1e-6
    assert step["compute_seconds"] == pytest.approx(100 * MS, abs=TOL)
    assert step["start_time"] >= step["host_start_time"] - 2e-6


def test_the_run_record_reports_the_device_clock_and_background_cpu(monkeypatch):
    fake = FakeCuda(monkeypatch)
    with capture() as sink:
        for n in range(5):
            with steptrace.step(n):
                fake.run(2 * MS)
        # An anchor whose bracket a preemption widened past 50 µs is not placed, and retaken 50 ms later
        # while the placement is wide (seen once on the 2-vCPU VM: 1 anchor, 1 unplaced): wait for one
        # that placed, as a longer run would have.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            stats = list(steptrace._active.resolver.clock_stats().values())
            if stats and stats[0]["anchors"] > stats[0]["anchors_unplaced"]:
                break
            time.sleep(0.01)
    (run,) = sink.of_type("run")
    (clock,) = run["device_clock"].values()
    assert clock["anchors"] > clock["anchors_unplaced"]
    assert clock["max_uncertainty_seconds"] < 50e-6
    assert all(r["placement_uncertainty_seconds"] < 50e-6 for r in sink.steps())
    assert set(run["background_cpu_seconds"]) == {"resolver", "sink:memory"}
    assert run["background_cpu_seconds"]["resolver"] > 0


def test_shutdown_gives_every_marker_back_including_the_clock_anchors():
    device = SimulatedDevice(clock_drift_ppm=25.0)
    with capture(backend=device) as sink:
        for n in range(50):
            with steptrace.step(n):
                device.run(0.2 * MS)
            time.sleep(0.2 * MS)
    assert len(sink.steps()) == 50 and device.markers_created > 0
    assert device.markers_outstanding == 0


@pytest.fixture
def warp(monkeypatch):
    """``jump(seconds)``: every clock steptrace and the simulated GPU read (``perf_counter``) moves forward
    at once, as after a long eval, without waiting for it."""
    from steptrace import _clock, _handles, _resolver, _runtime, _stall, testing

    offset = [0.0]
    real = time.perf_counter

    def perf() -> float:
        return real() + offset[0]

    for module in (_clock, _handles, _resolver, _runtime, _stall, testing):
        monkeypatch.setattr(module, "_perf", perf)
    monkeypatch.setattr(_clock.DeviceClock.__init__, "__kwdefaults__", {"every_s": 1.0, "clock": perf})

    def jump(seconds: float) -> None:
        offset[0] += seconds

    return jump


def test_durations_after_a_ten_minute_gap_keep_float32_precision(monkeypatch, warp):
    """elapsed_time is float32 milliseconds: measured from the step before a 10-minute eval, every marker
    of the next step was kept only to 62.5 µs, so a microbatch's compute came out as a multiple of that
    (1.0 or 1.0625 ms for 1.03 ms), and the placement claimed microseconds. The step is measured from its
    own start marker now, and what float32 loses on the long span widens the placement it states."""
    fake = FakeCuda(monkeypatch, drift_ppm=20.0)
    kernels = {}
    with capture(backend="torch") as sink:
        truth = Truth()
        for n in range(8):
            if n == 4:
                steptrace.flush()
                fake.device.synchronize()
                warp(600.0)  # ten minutes of eval: the GPU's clock and the host's move on together
                time.sleep(0.1)  # the idle resolver anchors, 600 s after the step before
            with steptrace.step(n):
                fake.run(10 * MS)  # queued first: the microbatch's start marker waits for it
                with steptrace.microbatch(0, stage=0):
                    kernels[n] = fake.run(1.03 * MS)
            time.sleep(20 * MS)
    steps = {r["step"]: r for r in sink.steps()}
    mbs = {m["step"]: m for m in sink.microbatches()}
    for n in range(8):
        assert mbs[n]["compute_seconds"] == pytest.approx(1.03 * MS, abs=1e-6), n
        r = steps[n]
        assert abs(r["end_time"] - truth.unix(kernels[n].end_time)) <= r["placement_uncertainty_seconds"] + 1e-6, n
