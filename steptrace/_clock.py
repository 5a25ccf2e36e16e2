"""A stream device's marker timestamps: durations from the device clock, placement on the host clock.

A stream device (CUDA) stamps each marker (``cudaEventRecord``) with its own
clock when the stream reaches it, and only the difference between two
completed markers of one device can be read (``cudaEventElapsedTime``, float32
milliseconds). Two separate questions, answered separately:

* **Durations** (interval, compute, microbatch compute, bubble, optimizer
  time) are differences of markers on one device. Each marker's time on the
  device timeline ``G`` (float64 seconds) is ``G(ref) + elapsed(ref, m)``
  from a reference the clock keeps out of the pool: the step's own start
  marker for the rest of its markers (the resolver rebases there first), the
  previous step's end for the next step's start, or, when the start was
  recorded after it, the newest anchor (anchors chain from each other). So
  every ``elapsed`` spans a short interval even after a long gap (an eval, a
  checkpoint): float32 milliseconds lose one 62.5 µs step at 10 minutes,
  which would put a 1 ms step's compute off by that much. What float32 does
  lose on a long span widens that marker's sample by one float32 step, so a
  sample measured from an old reference is never taken for a tight one. All
  of a step's markers are mapped to the host clock with one linear map, so
  the record's durations are those device differences (times the measured
  clock rate), whatever the calibration did.
* **Placement** (absolute times: the step's start and end on the host clock,
  next to host spans and checkpoints) comes from *samples*: markers whose host
  time is bracketed. The device cannot stamp a marker before it was recorded
  (a host clock read just before ``record`` is a lower bound) nor after the
  resolver saw it complete (an upper bound). Every step end marker is such a
  sample, and so is an *anchor*: a marker the resolver records on a stream of
  its own and queries until it completes. An anchor taken while the device is
  drained (the newest marker complete) completes within microseconds, which is
  the one moment a device with one hardware queue
  (``CUDA_DEVICE_MAX_CONNECTIONS=1``) gives a tight sample. The map's offset is
  the intersection of the recent samples' brackets; half its width is the
  *placement uncertainty* each record carries.
* **Lineages.** A marker measured over a long span (no reference for tens of
  seconds: an eval with no anchor) takes float32's loss into its device time,
  and so does every marker measured from it later: they form a *lineage*
  whose times are all off by the same unknown amount, which the map's offset
  absorbs as long as the samples and the marker placed are of one lineage.
  Two markers measured across the same gap from two references (the step's
  start from the step before, the resolver's anchors from the anchor before)
  start two lineages off by different amounts: a sample of one bounds a
  marker of the other only to the losses between them (each loss at most one
  float32 step), so the map of a lineage widens the other lineages' samples by
  that much, and markers are placed with the map of the base's lineage.

Nothing here waits on the device: at most one anchor is in flight, queried on
later polls until it completes (``poll``). Nothing here imports a framework:
the device is anything implementing ``clock_marker``/``query``/``elapsed``/
``release`` (see ``steptrace._devices``).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable

_perf = time.perf_counter

#: Samples narrower than this (seconds, half-width) count as placed anchors (tight).
MAX_UNCERTAINTY_S = 50e-6
#: How long one anchor may be polled in a row before it is left in flight (seconds).
ANCHOR_SPIN_S = 0.2e-3
#: Tight samples at least this far apart form the long baseline for the clock rate.
RATE_BASELINE_S = 10.0
#: Fewer than this many seconds of baseline: assume the clocks tick at the same rate.
_RATE_MIN_SPAN_S = 1.0
#: How far back (device seconds) samples bound the offset: with a measured rate / without one.
_WINDOW_RATED_S = 30.0
_WINDOW_UNRATED_S = 2.0
#: Rate error assumed (host seconds per device second) before the rate is measured; oscillators
#: of GPUs and hosts differ by tens of ppm. Once measured: its own error, at least _DRIFT_RATED.
_DRIFT_UNRATED = 100e-6
_DRIFT_RATED = 2e-6
#: The event timer's resolution (cudaEventElapsedTime: about half a microsecond), and float32 rounding.
_RESOLUTION_S = 1e-6
#: Samples kept (the newest; tight ones survive longer through the rate baseline).
_SAMPLES_KEPT = 32
#: While the placement is wider than MAX_UNCERTAINTY_S, a drained device is re-anchored this often.
_TIGHTEN_EVERY_S = 0.05
#: A marker measured with more float32 loss than this starts a new lineage (see the module docstring);
#: less is only widening of its own sample (``located_error``).
_LINEAGE_LOSS_S = _RESOLUTION_S
#: Lineages remembered (oldest forgotten first; an unknown lineage is as far as the sum of all losses).
_LINEAGES_KEPT = 256


class Mapping:
    """One linear map from the device timeline to host ``perf_counter`` seconds."""

    __slots__ = ("offset", "rate", "uncertainty", "newest", "drift")

    def __init__(self, offset: float, rate: float, uncertainty: float, newest: float, drift: float):
        self.offset = offset
        self.rate = rate
        self.uncertainty = uncertainty  # half-width of the offset's interval
        self.newest = newest  # the newest sample's device time
        self.drift = drift

    def host(self, g: float) -> float:
        return self.offset + g * self.rate

    def uncertainty_at(self, g: float) -> float:
        return _RESOLUTION_S + self.uncertainty + max(0.0, g - self.newest) * self.drift


def float32_step_s(elapsed_s: float) -> float:
    """One float32 step (ulp) of ``elapsed_s`` expressed in milliseconds, in seconds: what
    ``cudaEventElapsedTime``'s float32 result can be off by (62.5 µs at 10 minutes)."""
    # (Twice a step on the resolver: one C call, the rest operators.)
    ms = (elapsed_s if elapsed_s >= 0.0 else -elapsed_s) * 1000.0
    if ms == 0.0 or ms - ms != 0.0:  # zero, or not finite (inf - inf and nan are nan)
        return 0.0
    _, exponent = math.frexp(ms)  # ms = m * 2**exponent, 0.5 <= m < 1
    return 2.0 ** (exponent - 24) / 1000.0


class DeviceClock:
    """Device timeline and host placement of one device's markers (resolver thread only; ``stats()``
    from any thread)."""

    def __init__(self, device: Any, *, every_s: float = 1.0, clock: Callable[[], float] | None = None):
        self.device = device
        self.every_s = every_s
        self._clock = clock if clock is not None else _perf
        self._base: Any = None  # the reference markers are measured from (kept from the pool)
        self._base_g = 0.0
        self._base_lineage = 0
        # Lineages (see the module docstring): id -> (parent id, float32 loss from the parent in seconds,
        # depth). Lineage 0 is the first marker's.
        self._lineages: dict[int, tuple[int, float, int]] = {0: (0, 0.0, 0)}
        self._next_lineage = 1
        #: The lineage of the newest ``locate``.
        self.located_lineage = 0
        # The lineage of recently located markers (by id), for ``rebase`` (the pool reuses markers, and a
        # marker is rebased to shortly after it was located).
        self._marker_lineage: collections.OrderedDict[int, int] = collections.OrderedDict()
        # The newest completed anchor, kept as a reference for markers recorded after it was seen
        # complete: [marker, g, seen complete (host), lineage].
        self._ref_anchor: list[Any] | None = None
        #: What float32 may have lost in the newest ``locate`` (seconds; see ``float32_step_s``).
        self.located_error = 0.0
        # The newest map the resolver computed, for stats() from other threads (never recomputed there).
        self._published: Mapping | None = None
        self.newest_located = 0.0  # the latest device time located so far
        # Samples: (device time, host lower bound, host upper bound, lineage).
        self._samples: collections.deque[tuple[float, float, float, int]] = collections.deque(maxlen=_SAMPLES_KEPT)
        self._tight: collections.deque[tuple[float, float, float, int]] = collections.deque(maxlen=8)
        self._pending: list[tuple[float, float, float, int]] = []  # the step being resolved's own samples
        self._mapping: Mapping | None = None  # the map of the base's lineage
        # The anchor in flight: [marker, recorded_before, lower bound so far].
        self._anchor: list[Any] | None = None
        self._last_anchor = -math.inf
        # Tight (g, host) points kept for the long-baseline rate, one per RATE_BASELINE_S.
        self._rate_points: list[tuple[float, float]] = []
        self._newest_tight: tuple[float, float] | None = None
        self.anchors = 0
        self.anchors_unplaced = 0
        self.failures = 0
        self.max_uncertainty_used = 0.0

    # -- the device timeline ---------------------------------------------------------------
    def locate(self, marker: Any, recorded_after: float | None = None) -> float:
        """The device time of a complete marker. The first marker ever located becomes the origin.

        Measured from the base (a marker earlier on the same stream), or, given the host time the marker
        was recorded after, from the newest anchor if it was seen complete before that (so it is
        earlier) and is newer than the base: the shortest ``elapsed`` that is known not to be negative.
        ``located_error`` is then what float32 may have lost on it, unless that starts a new lineage
        (``located_lineage``; see the module docstring)."""
        self.located_error = 0.0
        if self._base is None:
            self._base, self._base_g, self._base_lineage = marker, 0.0, 0
            self.located_lineage = 0
            self._remember_lineage(marker, 0)
            return 0.0
        if marker is self._base:
            self.located_lineage = self._base_lineage
            return self._base_g
        ref, ref_g, lineage = self._base, self._base_g, self._base_lineage
        anchor = self._ref_anchor
        if anchor is not None and recorded_after is not None and recorded_after >= anchor[2] and anchor[1] > ref_g:
            ref, ref_g, lineage = anchor[0], anchor[1], anchor[3]
        elapsed = self.device.elapsed(ref, marker)
        g = ref_g + elapsed
        self._located(marker, g, elapsed, lineage)
        return g

    def place_step(self, start: Any, start_after: float, end: Any, end_after: float, seen: float,
                   units: "list[tuple[Any, float, Any, float]] | tuple" = ()
                   ) -> tuple[float, float, Mapping, list[tuple[float, float]]]:
        """The resolver's CUDA fast path: a step's start and end markers, and its microbatches' (``units``:
        ``(start, start_after, end, end_after)`` each, on this device), located and their map taken in one
        call, ``(start_g, end_g, mapping, [(unit start_g, unit end_g), ...])``, leaving this clock as the
        general path's sequence leaves it (Resolver._locate_step_markers and _locate_markers):
        ``locate(start)``, its sample, ``rebase(start)``; ``locate(end)`` from there, its sample (lower bound
        ``end_after``); for each unit ``locate`` of its start (from the step's start, or the newest anchor
        where the unit's start was recorded after it was seen) and of its end (from the step's start), the
        end's sample, the start's (with the end's lineage, as ``add_sample`` takes it), both markers back to
        the pool; ``commit()``, ``mapping()``, then ``rebase(end)`` (the next step's base; the start back to
        the pool). The map returned is the one before that last rebase, which the general path places the
        step with. (tests/test_cuda_fast_path.py compares the records of the two paths.)

        Every ``elapsed`` read comes first (the step's two in one device call where the device has one,
        ``elapsed_pair``): one that fails raises before anything here changed, and the caller takes the
        general path. So does a clock with no base yet, with ``start`` as its base, or with no sample yet
        (the general path commits the first at once): LookupError, before anything changed."""
        base = self._base
        if base is None or base is start or not self._samples:
            raise LookupError("not the fast path's case")
        ref, ref_g, lineage = base, self._base_g, self._base_lineage
        anchor = self._ref_anchor
        if anchor is not None and start_after >= anchor[2] and anchor[1] > ref_g:
            ref, ref_g, lineage = anchor[0], anchor[1], anchor[3]
        device = self.device
        pair = getattr(device, "elapsed_pair", None)
        if pair is not None:
            to_start, to_end = pair(ref, start, end)
        else:
            to_start, to_end = device.elapsed(ref, start), device.elapsed(start, end)
        start_g = ref_g + to_start
        reads = []
        if units:
            elapsed = device.elapsed
            for unit_start, unit_after, unit_end, _ in units:
                # (locate's choice of reference, with the step's start as the base it will be.)
                if anchor is not None and unit_after >= anchor[2] and anchor[1] > start_g:
                    reads.append((anchor[1], anchor[3], elapsed(anchor[0], unit_start), elapsed(start, unit_end)))
                else:
                    reads.append((start_g, -1, elapsed(start, unit_start), elapsed(start, unit_end)))
        kept = self._marker_lineage
        pending = self._pending
        # locate(start) and its sample; rebase(start): the old base back to the pool.
        loss, lineage = self._located(start, start_g, to_start, lineage)
        if not seen < start_after:
            pending.append((start_g, start_after - loss, seen + loss, lineage))
        if lineage != self._base_lineage:
            self._mapping = None
        self._base, self._base_g, self._base_lineage = start, start_g, lineage
        try:
            device.release(base)  # (_give_back, inline; base is not start: checked above)
        except Exception:
            pass
        # locate(end) from the start, and its sample.
        end_g = start_g + to_end
        loss, end_lineage = self._located(end, end_g, to_end, lineage)
        if not seen < end_after:
            pending.append((end_g, end_after - loss, seen + loss, end_lineage))
        placed = []
        if units:
            for (unit_start, unit_after, unit_end, unit_end_after), (ref_g, ref_lineage, to_unit_start, to_unit_end) \
                    in zip(units, reads):
                unit_start_g = ref_g + to_unit_start
                start_loss, _ = self._located(unit_start, unit_start_g, to_unit_start,
                                              lineage if ref_lineage < 0 else ref_lineage)
                unit_end_g = start_g + to_unit_end
                loss, unit_lineage = self._located(unit_end, unit_end_g, to_unit_end, lineage)
                if not seen < unit_end_after:
                    pending.append((unit_end_g, unit_end_after - loss, seen + loss, unit_lineage))
                if not seen < unit_after:
                    pending.append((unit_start_g, unit_after - start_loss, seen + start_loss, unit_lineage))
                placed.append((unit_start_g, unit_end_g))
                for marker in (unit_start, unit_end):
                    try:
                        device.release(marker)
                    except Exception:
                        pass
        # commit(), with _take's first test inline: a wide sample of the base's lineage inside the current
        # offset interval changes nothing (most step markers once anchors are tight).
        if pending:
            for sample in pending:
                g, lower, upper, sample_lineage = sample
                mapping = self._mapping
                if (mapping is not None and sample_lineage == lineage
                        and not (upper - lower) / 2 <= MAX_UNCERTAINTY_S):
                    at = g * mapping.rate
                    if (lower - at <= mapping.offset - mapping.uncertainty
                            and upper - at >= mapping.offset + mapping.uncertainty):
                        continue
                self._take(sample)
            pending.clear()
        mapping = self._mapping
        if mapping is None:
            mapping = self.mapping()  # samples exist: never None
            assert mapping is not None
        # rebase(end), after the step's map was taken.
        if kept.get(id(end), lineage) != lineage:
            self._mapping = None
        self._base, self._base_g, self._base_lineage = end, end_g, end_lineage
        try:
            device.release(start)
        except Exception:
            pass
        return start_g, end_g, mapping, placed

    def _located(self, marker: Any, g: float, elapsed_s: float, lineage: int) -> tuple[float, int]:
        """What ``locate`` leaves behind for ``marker``, found at ``g`` by ``elapsed_s`` from a reference of
        ``lineage``: ``(located_error, located_lineage)``, both also set here, the marker's lineage
        remembered, the newest device time located kept."""
        ms = (elapsed_s if elapsed_s >= 0.0 else -elapsed_s) * 1000.0  # (float32_step_s, inline)
        loss = 0.0 if ms == 0.0 or ms - ms != 0.0 else 2.0 ** (math.frexp(ms)[1] - 24) / 1000.0
        if loss > _LINEAGE_LOSS_S:
            lineage = self._new_lineage(lineage, loss)
            loss = 0.0
        self.located_error = loss
        self.located_lineage = lineage
        kept, key = self._marker_lineage, id(marker)
        kept[key] = lineage
        kept.move_to_end(key)
        if len(kept) > 64:
            kept.popitem(last=False)
        if g > self.newest_located:
            self.newest_located = g
        return loss, lineage

    def uncertainty_of(self, mapping: Mapping, g: float) -> float:
        """``uncertainty(g)`` with the map given (the one a step was placed with): the placement uncertainty
        of ``g`` on the base's lineage, kept as the worst used."""
        ahead = g - mapping.newest
        used = _RESOLUTION_S + mapping.uncertainty + (ahead if ahead > 0.0 else 0.0) * mapping.drift
        if used > self.max_uncertainty_used:
            self.max_uncertainty_used = used
        return used

    # -- lineages ----------------------------------------------------------------------------
    def _new_lineage(self, parent: int, loss: float) -> int:
        lineage = self._next_lineage
        self._next_lineage += 1
        self._lineages[lineage] = (parent, loss, self._lineages.get(parent, (0, 0.0, 0))[2] + 1)
        if len(self._lineages) > _LINEAGES_KEPT:
            del self._lineages[next(iter(self._lineages))]
        return lineage

    def _remember_lineage(self, marker: Any, lineage: int) -> None:
        kept = self._marker_lineage
        kept[id(marker)] = lineage
        kept.move_to_end(id(marker))
        if len(kept) > 64:
            kept.popitem(last=False)

    def lineage_distance(self, a: int, b: int) -> float:
        """How far apart the device times of two lineages can be (seconds): the float32 losses on the
        path between them through their common ancestor."""
        if a == b:
            return 0.0
        lineages = self._lineages
        distance = 0.0
        while a != b:
            node_a, node_b = lineages.get(a), lineages.get(b)
            if node_a is None or node_b is None:  # forgotten: every loss there could be in between
                return sum(loss for _, loss, _ in lineages.values())
            if node_a[2] >= node_b[2]:
                distance += node_a[1]
                a = node_a[0]
            else:
                distance += node_b[1]
                b = node_b[0]
        return distance

    def device_time(self, marker: Any, recorded_after: float, completed_seen: float) -> float | None:
        """The device time of a complete marker the caller gives back to the pool itself (a span
        boundary), its bracket ``[recorded_after, completed_seen]`` taken as a sample (from the next
        commit); None before any marker of this device was located (it cannot be the origin)."""
        if self._base is None:
            return None
        g = self.locate(marker)
        self.add_sample(g, recorded_after, completed_seen, self.located_error, self.located_lineage)
        return g

    def calibrate(self) -> None:
        """Take an anchor now if one is due (never waits on the device; see ``poll``)."""
        self.poll(drained=True)

    def rebase(self, marker: Any, g: float) -> None:
        """Make ``marker`` (complete, at ``g``) the base later markers are measured from; the clock keeps
        it (``owns``) and gives the previous base back to the device's pool."""
        old = self._base
        lineage = self._marker_lineage.get(id(marker), self._base_lineage)
        if lineage != self._base_lineage:
            self._mapping = None  # placed with the new lineage's map from now on
        self._base, self._base_g, self._base_lineage = marker, g, lineage
        if old is not None and old is not marker:
            self._give_back(old)

    def is_base(self, marker: Any) -> bool:
        return marker is self._base

    def owns(self, marker: Any) -> bool:
        return (marker is self._base or (self._anchor is not None and marker is self._anchor[0])
                or (self._ref_anchor is not None and marker is self._ref_anchor[0]))

    # -- samples -----------------------------------------------------------------------------
    def add_sample(self, g: float, lower: float, upper: float, error: float = 0.0,
                   lineage: int | None = None) -> None:
        """A marker at device time ``g`` (known to ``error`` seconds: ``located_error``) was stamped between
        host times ``lower`` and ``upper``. Held back until ``commit()`` (the resolver commits a step's
        unit markers before placing any of them, its span markers after, so one step's markers share
        one map), except for the very first. ``lineage``: the marker's (default: that of the newest
        ``locate``, which is how the resolver calls it)."""
        if upper < lower:
            return
        if lineage is None:
            lineage = self.located_lineage
        self._pending.append((g, lower - error, upper + error, lineage))
        if self._mapping is None and not self._samples:
            self.commit()

    def commit(self) -> None:
        """Take the held-back samples into the map (between steps)."""
        if self._pending:
            for sample in self._pending:
                self._take(sample)
            self._pending.clear()

    def _take(self, sample: tuple[float, float, float, int]) -> None:
        g, lower, upper, lineage = sample
        tight = (upper - lower) / 2 <= MAX_UNCERTAINTY_S
        mapping = self._mapping
        if mapping is not None and not tight and lineage == self._base_lineage:
            # A wide sample that does not cut into the current offset interval changes nothing
            # (most step markers once anchors are tight): skip it, and the map's recomputation.
            at = g * mapping.rate
            low, high = mapping.offset - mapping.uncertainty, mapping.offset + mapping.uncertainty
            if lower - at <= low and upper - at >= high:
                return
        self._samples.append(sample)
        self._mapping = None
        if tight:
            self._tight.append(sample)  # kept beyond the newest samples: they bound the offset best
            host = (lower + upper) / 2
            self._newest_tight = (g, host)
            points = self._rate_points
            if not points or host - points[-1][1] >= RATE_BASELINE_S:
                points.append((g, host))
                if len(points) > 64:
                    del points[1:2]  # keep the oldest: the longest baseline

    def _rated_span(self) -> float:
        points, newest = self._rate_points, self._newest_tight
        if not points or newest is None:
            return 0.0
        return newest[0] - points[0][0]

    def rate(self) -> float:
        """Host seconds per device second over the longest baseline of tight samples (1.0 until there
        is one of at least a second)."""
        span = self._rated_span()
        if span < _RATE_MIN_SPAN_S:
            return 1.0
        g0, h0 = self._rate_points[0]
        assert self._newest_tight is not None
        return (self._newest_tight[1] - h0) / span

    def mapping(self) -> Mapping | None:
        """The current map (None before the first sample). Changes only on ``commit`` and anchors."""
        mapping = self._mapping
        if mapping is None and self._samples:
            mapping = self._mapping = self._published = self._compute()
        return mapping

    def _compute(self) -> Mapping:
        rate = self.rate()
        span = self._rated_span()
        if span >= _RATE_MIN_SPAN_S:
            drift = min(_DRIFT_UNRATED, max(_DRIFT_RATED, 2 * MAX_UNCERTAINTY_S / span))
            window = _WINDOW_RATED_S
        else:
            drift, window = _DRIFT_UNRATED, _WINDOW_UNRATED_S
        newest = max([sample[0] for sample in self._samples])
        # Sorted by age, ties in the set's order (a stable sort by that key: the index breaks ties, the
        # samples themselves are never compared); no key function, abs() or lineage walk per sample where
        # a comparison does (~130 Python calls a map, once every few steps on the resolver).
        aged = sorted([(newest - sample[0] if newest >= sample[0] else sample[0] - newest, i, sample)
                       for i, sample in enumerate({*self._samples, *self._tight})])
        lo, hi = -math.inf, math.inf
        target = self._base_lineage
        # Each sample bounds the offset as of its own time; an older one, as of now, only up to the
        # drift since; one of another lineage, only up to the float32 losses between the lineages.
        # Newest first; a sample that contradicts the newer ones (a rate error beyond the assumed
        # drift) ends the intersection there.
        for age, _, (g, lower, upper, lineage) in aged:
            if age > window:
                break
            widen = age * drift + (0.0 if lineage == target else self.lineage_distance(lineage, target))
            new_lo, new_hi = max(lo, lower - g * rate - widen), min(hi, upper - g * rate + widen)
            if new_lo > new_hi:
                break
            lo, hi = new_lo, new_hi
        return Mapping((lo + hi) / 2, rate, (hi - lo) / 2, newest, drift)

    def host_time(self, g: float) -> float:
        """Host time of a point on the device timeline (needs one sample)."""
        mapping = self.mapping()
        if mapping is None:
            raise LookupError("no sample yet")
        return mapping.host(g)

    def uncertainty(self, g: float, lineage: int | None = None) -> float:
        """Placement uncertainty (seconds, half-width) of a point on the device timeline, of the base's
        lineage unless another is given (``located_lineage`` of a marker measured from elsewhere)."""
        mapping = self.mapping()
        if mapping is None:
            return math.inf
        used = mapping.uncertainty_at(g)
        if lineage is not None:
            used += self.lineage_distance(lineage, self._base_lineage)
        self.max_uncertainty_used = max(self.max_uncertainty_used, used)
        return used

    # -- anchors -----------------------------------------------------------------------------
    def poll(self, drained: "bool | Callable[[], bool]") -> None:
        """One look at the anchors (resolver thread, every poll; never waits on the device).

        ``drained``: whether the device has no work left, or a call that says so, made only when an
        anchor is due (it costs the device a query: most polls, between anchors, need no answer).

        Queries the anchor in flight, if any; else records a new one when one is due: every
        ``every_s``, and more often while the placement is wide and the device is ``drained``. A
        device of one hardware queue (``one_queue``, assumed where the device does not say) is
        anchored only when drained: an anchor recorded behind queued work waits for it.
        """
        now = self._clock()
        try:
            if self._anchor is not None:
                self._query_anchor()
                return
            mapping = self.mapping()
            if callable(drained):
                # Its answer matters only for a device of one hardware queue that is placed already (see
                # below), and only once an anchor is otherwise due: asked then, not at every poll.
                if mapping is None or not getattr(self.device, "one_queue", True):
                    drained = True
                elif now - self._last_anchor < min(self.every_s, _TIGHTEN_EVERY_S):
                    return  # not due, drained or not
                else:
                    drained = drained()
            since = now - self._last_anchor
            if mapping is None:
                due = since >= _TIGHTEN_EVERY_S
            else:
                wide = mapping.uncertainty_at(self.newest_located) > MAX_UNCERTAINTY_S / 2
                due = since >= self.every_s or (wide and since >= _TIGHTEN_EVERY_S)
                if not drained:
                    # With one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) an anchor would wait
                    # behind the queued work: the step markers' own samples place meanwhile. With
                    # several, the anchor's own stream is not behind it (an H200, busy: 34 µs p50,
                    # 62 µs max), and a device that is never drained (a GPU-bound loop) is anchored
                    # like a drained one. Its anchors are recorded releasing the GIL (a busy device
                    # can hold the record behind another thread's copy), so some brackets are wide:
                    # while the placement is wide they are retaken sooner, as on a drained device.
                    due = due and not getattr(self.device, "one_queue", True)
            if not due:
                return
            self._last_anchor = now
            prepare = getattr(self.device, "prepare_clock_marker", None)
            if prepare is not None:
                prepare()  # a stream or an event made inside the bracket would widen it
            recorded_before = self._clock()
            marker = self.device.clock_marker()
            self._anchor = [marker, recorded_before, recorded_before]
            self._query_anchor(spin=True)
        except Exception:
            self.failures += 1
            anchor, self._anchor = self._anchor, None
            if anchor is not None:
                self._give_back(anchor[0])

    def _query_anchor(self, spin: bool = False) -> None:
        anchor = self._anchor
        assert anchor is not None
        marker = anchor[0]
        clock = self._clock
        deadline = clock() + (ANCHOR_SPIN_S if spin else 0.0)
        # A query that keeps the GIL where the device has one: a query that releases it lets another
        # thread run between it and the clock read after it (3 ms brackets measured on an H200).
        query = getattr(self.device, "clock_query", None) or self.device.query
        while True:
            before = clock()
            done = query(marker)
            after = clock()
            if done:
                break
            anchor[2] = before  # still incomplete when queried: stamped after this
            if after >= deadline:
                return  # left in flight: looked at again on the next poll
        self._anchor = None
        self.anchors += 1
        if self._base is None:
            self._base, self._base_g, self._base_lineage = marker, 0.0, 0
            g, error, lineage = 0.0, 0.0, 0
        else:
            # From the previous anchor when this one was recorded after it was seen complete: the
            # anchors of a long gap (an eval) form a chain of short spans.
            try:
                g = self.locate(marker, recorded_after=anchor[1])
            except Exception:
                self._give_back(marker)
                raise
            error, lineage = self.located_error, self.located_lineage
            previous, self._ref_anchor = self._ref_anchor, [marker, g, after, lineage]
            if previous is not None:
                self._give_back(previous[0])
        lower, upper = anchor[2] - error, after + error
        if (upper - lower) / 2 > MAX_UNCERTAINTY_S:
            self.anchors_unplaced += 1
        self._take((g, lower, upper, lineage))

    def _give_back(self, marker: Any) -> None:
        try:
            self.device.release(marker)
        except Exception:
            pass

    def close(self) -> None:
        """Give the base, the kept anchor and any anchor in flight back to the device."""
        for marker in (self._base, self._anchor[0] if self._anchor is not None else None,
                       self._ref_anchor[0] if self._ref_anchor is not None else None):
            if marker is not None:
                self._give_back(marker)
        self._base = None
        self._anchor = None
        self._ref_anchor = None

    def stats(self) -> dict[str, Any]:
        """Calibration figures for ``steptrace.stats()`` and the run record, from any thread: the newest
        map the resolver computed (it never computes one here: that would race the resolver's own
        samples, and could store a map older than a sample it just took)."""
        mapping = self._published
        return {
            "anchors": self.anchors,
            "anchors_unplaced": self.anchors_unplaced,
            "anchor_failures": self.failures,
            "samples": len(self._samples),
            "uncertainty_seconds": mapping.uncertainty if mapping is not None else None,
            "max_uncertainty_seconds": self.max_uncertainty_used,
            "rate_ppm": ((mapping.rate if mapping is not None else 1.0) - 1.0) * 1e6,
        }
