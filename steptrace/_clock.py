"""Placing a stream device's marker timestamps on the host clock.

A stream device (CUDA) stamps each marker (``cudaEventRecord``) with its own
clock when the stream reaches it, and only the difference between two
completed markers can be read (``cudaEventElapsedTime``, float32 milliseconds).
The resolver needs host times (``perf_counter`` seconds), and it must not take
them from the moment it *notices* a marker completed: it needs the GIL to read
a clock, and a GIL-holding call on the training thread (``torch.save``'s
pickling, a C sort, a GC pass) delays that moment by its whole length.

So every marker time is computed, never observed:

* **Anchors.** On its own thread the resolver records a marker on an idle side
  stream, reading the host clock just before recording (``t0``) and polling
  until it completes (first seen complete at ``t2``; last seen incomplete at
  ``t1``). The device stamped it inside ``[max(t0, t1), t2]``; the midpoint is
  the anchor's host time and half the width its uncertainty. Samples wider
  than ``max_uncertainty_s`` (the side stream was held up, or the GIL was
  taken mid-sample) still order markers, but place nothing.
* **Device time of a marker.** Anchors are chained by ``elapsed`` into one
  device timeline ``G`` (float64 seconds). A unit marker is measured against
  a nearby anchor it is *known* to follow or precede: an anchor that had
  completed before the marker was recorded (``G_m = G_a + elapsed(a, m)``), or
  one recorded after the marker was seen complete (``G_m = G_a - elapsed(m, a)``).
  Only non-negative elapsed times are ever asked for, and over short spans,
  so float32 milliseconds keep sub-microsecond precision.
* **Host time.** ``G`` is mapped to the host clock by interpolating between
  the placed anchors around it, which follows any rate difference (drift)
  between the two oscillators; past the newest anchor it extrapolates with the
  rate measured over a long baseline. Anchors are taken every ``every_s``
  and whenever a marker would otherwise only be extrapolated, so the error is
  the anchors' own uncertainty (a few microseconds), not accumulated drift.

Nothing here imports a framework: the device is anything implementing
``clock_marker``/``query``/``elapsed``/``release`` (see ``steptrace._devices``).
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable

_perf = time.perf_counter

#: Anchors wider than this (seconds, half-width) order markers but place none.
MAX_UNCERTAINTY_S = 50e-6
#: How long one calibration sample may poll its marker before giving up.
SAMPLE_POLL_S = 0.5e-3
#: Placed anchors at least this far apart form the long baseline for the clock rate.
RATE_BASELINE_S = 10.0
#: Fewer than this many seconds of baseline: assume the clocks tick at the same rate.
_RATE_MIN_SPAN_S = 1.0


class Anchor:
    """A marker on the device clock whose host time is known (within ``uncertainty``)."""

    __slots__ = ("marker", "recorded_before", "completed_seen", "host", "uncertainty", "device")

    def __init__(self, marker: Any, recorded_before: float, completed_seen: float, host: float,
                 uncertainty: float, device: float):
        self.marker = marker
        self.recorded_before = recorded_before  # host clock read just before recording it
        self.completed_seen = completed_seen  # first host time it was seen complete
        self.host = host  # estimated host time of its device timestamp
        self.uncertainty = uncertainty  # half-width of the interval that timestamp lies in
        self.device = device  # its time on the chained device timeline, seconds

    @property
    def placed(self) -> bool:
        return self.uncertainty <= MAX_UNCERTAINTY_S


class DeviceClock:
    """Maps one stream device's markers to host ``perf_counter`` seconds.

    Used from the resolver thread only (``calibrate``, ``to_host``, ``prune``).
    """

    def __init__(self, device: Any, *, every_s: float = 1.0, clock: Callable[[], float] = _perf,
                 sleep: Callable[[float], None] = time.sleep):
        self.device = device
        self.every_s = every_s
        self._clock = clock
        self._sleep = sleep
        self._anchors: list[Anchor] = []  # in recording order (== device order: one thread records them)
        self._placed: list[Anchor] | None = None  # cache of the placed anchors
        # Placed (device, host) points kept for the long-baseline rate, thinned to one per RATE_BASELINE_S.
        self._rate_points: list[tuple[float, float]] = []
        self.samples = 0
        self.rejected = 0
        self.failures = 0
        self.max_uncertainty_used = 0.0

    # -- anchors -----------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return not self._anchors or now - self._anchors[-1].recorded_before >= self.every_s

    def calibrate(self) -> Anchor | None:
        """Record one anchor (resolver thread). Returns it, or None if the sample failed.

        Polls its marker for at most ``SAMPLE_POLL_S`` while holding the GIL (a few
        microseconds when the side stream is idle); a marker that takes longer is
        left to complete and still serves to order markers once it has.
        """
        device = self.device
        clock = self._clock
        self.samples += 1
        try:
            recorded_before = lower = clock()  # the device cannot stamp it before it is recorded
            marker = device.clock_marker()
            deadline = lower + SAMPLE_POLL_S
            while True:
                before = clock()
                done = device.query(marker)
                after = clock()
                if done:
                    upper = after  # stamped before this query returned
                    break
                lower = before  # still incomplete when queried: stamped after this
                if after > deadline:
                    # A blocked side stream (CUDA_DEVICE_MAX_CONNECTIONS=1 behind a long kernel):
                    # wait for it off the hot path; it will order markers but place none.
                    pause = 0.001
                    while not device.query(marker):
                        self._sleep(pause)
                        pause = min(pause * 2, 0.02)
                    upper = clock()
                    break
        except Exception:
            self.failures += 1
            return None
        anchor = Anchor(marker, recorded_before, upper, (lower + upper) / 2, (upper - lower) / 2, 0.0)
        if self._anchors:
            prev = self._anchors[-1]
            # prev completed before this one was recorded: elapsed(prev, anchor) >= 0.
            try:
                anchor.device = prev.device + device.elapsed(prev.marker, marker)
            except Exception:
                self.failures += 1
                device.release(marker)
                return None
        self._placed = None
        if not anchor.placed:
            self.rejected += 1
        self._anchors.append(anchor)
        if anchor.placed:
            points = self._rate_points
            if not points or anchor.host - points[-1][1] >= RATE_BASELINE_S:
                points.append((anchor.device, anchor.host))
                if len(points) > 64:
                    del points[1:2]  # keep the oldest: the longest baseline
        return anchor

    def prune(self, keep_after_host: float) -> None:
        """Release anchors no pending marker can need (resolver thread).

        ``keep_after_host``: the earliest record time of a marker not yet placed. The
        newest anchor completed before it is kept (the forward base of that marker),
        and a placed one at or before it, so the marker can be interpolated.
        """
        anchors = self._anchors
        base = None
        for i, anchor in enumerate(anchors):
            if anchor.completed_seen >= keep_after_host:
                break
            base = i
        if base is None:
            return
        cut = base
        while cut > 0 and not anchors[cut].placed:
            cut -= 1
        for anchor in anchors[:cut]:
            try:
                self.device.release(anchor.marker)
            except Exception:
                pass
        del anchors[:cut]
        self._placed = None

    def close(self) -> None:
        """Give every anchor's marker back to the device."""
        for anchor in self._anchors:
            try:
                self.device.release(anchor.marker)
            except Exception:
                pass
        self._anchors.clear()
        self._placed = None

    # -- mapping -----------------------------------------------------------------------
    def device_time(self, marker: Any, recorded_after: float, completed_seen: float) -> float | None:
        """The marker's time on the chained device timeline, or None when no anchor is known to
        precede or follow it (take an anchor now, after ``completed_seen``, and ask again).

        ``recorded_after``: a host time read before the marker was recorded.
        ``completed_seen``: a host time at which the marker was known to be complete.
        """
        anchors = self._anchors
        forward = None
        backward = None
        # The newest anchor seen complete before the marker was recorded...
        for anchor in reversed(anchors):
            if anchor.completed_seen < recorded_after:
                forward = anchor
                break
        # ...and the oldest one recorded after the marker was seen complete.
        for anchor in anchors:
            if anchor.recorded_before > completed_seen:
                backward = anchor
                break
        device = self.device
        if forward is not None and (backward is None
                                    or recorded_after - forward.completed_seen
                                    <= backward.recorded_before - completed_seen):
            return forward.device + device.elapsed(forward.marker, marker)
        if backward is not None:
            return backward.device - device.elapsed(marker, backward.marker)
        return None

    def host_time(self, device_time: float) -> float:
        """Host ``perf_counter`` time of a point on the device timeline (needs one placed anchor)."""
        placed = self._placed
        if placed is None:
            placed = self._placed = [a for a in self._anchors if a.placed]
        if not placed:
            if not self._anchors:
                raise LookupError("no anchor yet")
            # No sample was ever tight (a side stream always queued behind the training stream):
            # the best one still bounds the marker; its width is reported as the uncertainty.
            best = min(self._anchors, key=lambda a: a.uncertainty)
            self.max_uncertainty_used = max(self.max_uncertainty_used, best.uncertainty)
            return best.host + (device_time - best.device) * self.rate()
        keys = [a.device for a in placed]
        i = bisect.bisect_right(keys, device_time)
        if 0 < i < len(placed):
            lo, hi = placed[i - 1], placed[i]
            span = hi.device - lo.device
            if span > 0:
                used = max(lo.uncertainty, hi.uncertainty)
                self.max_uncertainty_used = max(self.max_uncertainty_used, used)
                return lo.host + (device_time - lo.device) * (hi.host - lo.host) / span
        nearest = placed[0] if i == 0 else placed[-1]
        self.max_uncertainty_used = max(self.max_uncertainty_used, nearest.uncertainty)
        return nearest.host + (device_time - nearest.device) * self.rate()

    def has_placed(self) -> bool:
        """True once some anchor places markers (its sample was tight)."""
        return any(anchor.placed for anchor in self._anchors)

    def beyond_placed(self, device_time: float) -> float:
        """How far ``device_time`` lies past the newest placed anchor (how far it would be
        extrapolated); infinity when no anchor is placed."""
        for anchor in reversed(self._anchors):
            if anchor.placed:
                return device_time - anchor.device
        return float("inf")

    def rate(self) -> float:
        """Host seconds per device second, over the longest baseline of placed anchors (1.0 until
        there is one of at least a second)."""
        points = self._rate_points
        newest = next((a for a in reversed(self._anchors) if a.placed), None)
        if not points or newest is None:
            return 1.0
        g0, h0 = points[0]
        span = newest.device - g0
        if span < _RATE_MIN_SPAN_S:
            return 1.0
        return (newest.host - h0) / span

    def stats(self) -> dict[str, Any]:
        """Calibration figures for ``steptrace.stats()`` and the run record."""
        rate = self.rate()
        return {
            "anchors": self.samples - self.failures,
            "anchors_unplaced": self.rejected,
            "anchor_failures": self.failures,
            "max_uncertainty_seconds": self.max_uncertainty_used,
            "rate_ppm": (rate - 1.0) * 1e6,
        }
