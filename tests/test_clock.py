"""The device clock (steptrace._clock): markers placed on the host clock from calibration anchors.

These tests drive DeviceClock with a virtual host clock and a virtual device whose
clock drifts and whose elapsed times are float32 milliseconds, so an hour of
calibration runs in milliseconds and every placement can be compared with the
truth exactly.
"""

import random
import struct

import pytest

from steptrace._clock import MAX_UNCERTAINTY_S, DeviceClock


class VirtualMarker:
    def __init__(self, host_stamp):
        self.host_stamp = host_stamp  # the true host time the device stamped it
        self.released = False


class VirtualDevice:
    """A device clock running `drift_ppm` fast with an arbitrary origin; time is set by the test."""

    name = "virtual"

    def __init__(self, drift_ppm=60.0, offset_s=12345.0, latency_s=4e-6, blocked=False):
        self.now = 0.0
        self.drift = drift_ppm * 1e-6
        self.offset = offset_s
        self.latency = latency_s
        self.blocked = blocked
        self.busy_until = 0.0
        self.queries = 0

    def tick(self, dt):
        self.now += dt
        return self.now

    def device_clock(self, host):
        return host * (1 + self.drift) + self.offset

    def clock_marker(self):
        self.now += 1e-6  # recording takes a microsecond
        floor = self.busy_until if self.blocked else self.now
        return VirtualMarker(max(self.now + self.latency, floor))

    def unit_marker(self, host_stamp):
        return VirtualMarker(host_stamp)

    def query(self, marker):
        self.queries += 1
        self.now += 1e-6  # a query takes a microsecond
        return self.now >= marker.host_stamp

    def elapsed(self, a, b):
        seconds = self.device_clock(b.host_stamp) - self.device_clock(a.host_stamp)
        assert seconds >= -1e-9, "steptrace asked for a negative elapsed time"
        return struct.unpack("f", struct.pack("f", seconds * 1000.0))[0] / 1000.0

    def release(self, marker):
        assert not marker.released
        marker.released = True


def place(clock, device, marker, recorded_after, completed_seen):
    g = clock.device_time(marker, recorded_after, completed_seen)
    assert g is not None
    return clock.host_time(g)


def test_a_marker_between_two_anchors_is_placed_to_within_the_anchor_uncertainty():
    device = VirtualDevice(drift_ppm=80.0)
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    device.tick(1.0)
    assert clock.calibrate().placed
    device.tick(0.3)
    marker = device.unit_marker(device.now + 0.0123)  # recorded now, stamped 12.3 ms later
    recorded_after = device.now
    device.tick(0.5)
    seen = device.now
    device.tick(0.01)
    assert clock.calibrate().placed
    assert place(clock, device, marker, recorded_after, seen) == pytest.approx(marker.host_stamp, abs=5e-6)


def test_markers_recorded_before_any_anchor_are_placed_from_a_later_one():
    device = VirtualDevice()
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    device.tick(5.0)
    marker = device.unit_marker(device.now + 0.002)
    recorded_after = device.now
    device.tick(0.01)
    seen = device.now
    assert clock.device_time(marker, recorded_after, seen) is None  # no anchor is known to follow it yet
    device.tick(0.001)
    clock.calibrate()
    assert place(clock, device, marker, recorded_after, seen) == pytest.approx(marker.host_stamp, abs=5e-6)


def test_an_hour_of_drift_stays_well_under_a_tenth_of_a_millisecond():
    """100 ppm of drift is 360 ms an hour; anchors every second keep every placement within microseconds."""
    rng = random.Random(7)
    device = VirtualDevice(drift_ppm=100.0, offset_s=-777.0)
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    worst = 0.0
    device.tick(0.5)
    clock.calibrate()
    for _second in range(3600):
        # A step every 100 ms whose end marker is stamped up to 50 ms after it was recorded.
        pending = []
        for _ in range(10):
            device.tick(0.1)
            pending.append((device.unit_marker(device.now + rng.uniform(0.0, 0.05)), device.now))
        device.tick(0.06)
        seen = device.now
        for marker, recorded_after in pending:
            g = clock.device_time(marker, recorded_after, seen)
            if g is None or clock.beyond_placed(g) > 0.2:
                clock.calibrate()
                g = clock.device_time(marker, recorded_after, seen)
            worst = max(worst, abs(clock.host_time(g) - marker.host_stamp))
        clock.prune(pending[-1][1])
        if clock.due(device.now):
            clock.calibrate()
    assert worst < 20e-6
    assert clock.rate() == pytest.approx(1 / (1 + 100e-6), abs=1e-7)
    assert clock.stats()["rate_ppm"] == pytest.approx(-100.0, abs=0.2)


def test_elapsed_times_are_only_asked_forward_and_over_short_spans():
    """float32 milliseconds lose precision over long spans (a quarter millisecond after an hour):
    markers are measured against a nearby anchor, never against the first one."""
    device = VirtualDevice()
    asked = []
    elapsed = device.elapsed

    def recording_elapsed(a, b):
        span = elapsed(a, b)
        asked.append(span)
        return span

    device.elapsed = recording_elapsed
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    clock.calibrate()
    for _ in range(7200):
        device.tick(1.0)
        clock.calibrate()
        clock.prune(device.now - 2.0)
    marker = device.unit_marker(device.now + 0.5)
    recorded_after = device.now
    device.tick(0.6)
    seen = device.now
    clock.calibrate()
    assert place(clock, device, marker, recorded_after, seen) == pytest.approx(marker.host_stamp, abs=5e-6)
    assert min(asked) >= 0 and max(asked) < 2.0


def test_an_anchor_whose_side_stream_was_held_up_orders_markers_but_places_none():
    device = VirtualDevice(blocked=True)
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    device.tick(1.0)
    assert clock.calibrate().placed  # the device is idle: the side stream is not held up
    device.tick(0.001)
    device.busy_until = device.now + 0.03  # 30 ms of queued kernels ahead of the next anchor
    marker = device.unit_marker(device.now + 0.025)  # a step's end marker, inside that queue
    recorded_after = device.now
    anchor = clock.calibrate()
    assert anchor is not None and not anchor.placed and anchor.uncertainty > MAX_UNCERTAINTY_S
    assert clock.stats()["anchors_unplaced"] == 1
    device.tick(0.001)
    assert clock.calibrate().placed
    # The marker is ordered by the held-up anchor and placed by the placed ones around it.
    assert place(clock, device, marker, recorded_after, device.now) == pytest.approx(marker.host_stamp, abs=5e-6)


def test_pruning_releases_anchor_markers_no_pending_marker_needs():
    device = VirtualDevice()
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    anchors = []
    for _ in range(10):
        device.tick(1.0)
        anchors.append(clock.calibrate())
    clock.prune(anchors[6].completed_seen + 0.5)
    assert [a.marker.released for a in anchors] == [True] * 6 + [False] * 4
    clock.close()
    assert all(a.marker.released for a in anchors)


def test_a_failing_device_is_counted_not_raised():
    device = VirtualDevice()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    device.clock_marker = broken
    clock = DeviceClock(device, clock=lambda: device.now, sleep=device.tick)
    assert clock.calibrate() is None
    assert clock.stats()["anchor_failures"] == 1
    with pytest.raises(LookupError):
        clock.host_time(0.0)
