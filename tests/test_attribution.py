"""The timing model's arithmetic (DESIGN.md §2), on exact numbers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steptrace._attribution import (
    HostSpan,
    blocking_seconds,
    breakdown,
    bubble_ratios,
    idle_segments,
    optimizer_seconds,
    unit_timing,
)


def test_step_waits_for_previous_step_on_device():
    # Dispatched at 1.0 while the device was busy until 2.0: it starts at 2.0, not 1.0.
    t = unit_timing(prev_end=2.0, dispatch=1.0, end=3.5)
    assert (t.start, t.end) == (2.0, 3.5)
    assert t.interval_seconds == 1.5
    assert t.compute_seconds == 1.5
    assert t.idle_seconds == 0.0


def test_device_idle_until_dispatch_is_idle_not_compute():
    t = unit_timing(prev_end=2.0, dispatch=2.75, end=3.5)
    assert t.start == 2.75
    assert t.compute_seconds == pytest.approx(0.75)
    assert t.idle_seconds == pytest.approx(0.75)


def test_device_clock_start_replaces_the_dispatch_time():
    # The start marker was recorded at 2.1 but the stream reached it at 2.5 (work queued
    # outside any step ran first): the device was not computing this step before 2.5.
    t = unit_timing(prev_end=2.0, dispatch=2.1, end=3.0, device_start=2.5)
    assert t.start == pytest.approx(2.5)
    assert t.compute_seconds == pytest.approx(0.5)
    assert t.idle_seconds == pytest.approx(0.5)


def test_device_start_before_the_previous_end_starts_at_the_previous_end():
    # Calibration noise can place a start a microsecond before the previous end: intervals still tile.
    t = unit_timing(prev_end=2.0, dispatch=1.5, end=3.0, device_start=1.999999)
    assert t.start == 2.0 and t.compute_seconds == pytest.approx(1.0) and t.idle_seconds == 0.0


def test_end_before_previous_end_is_clamped_so_intervals_tile():
    t = unit_timing(prev_end=5.0, dispatch=4.0, end=4.5)
    assert t.end == 5.0 and t.interval_seconds == 0.0 and t.compute_seconds == 0.0


def test_innermost_span_wins_and_uncovered_time_is_other():
    spans = [HostSpan("eval", 1.0, 5.0), HostSpan("data", 2.0, 3.0)]
    segs = idle_segments(0.0, 6.0, spans)
    assert [(s.name, s.start, s.end) for s in segs] == [
        ("other", 0.0, 1.0), ("eval", 1.0, 2.0), ("data", 2.0, 3.0), ("eval", 3.0, 5.0), ("other", 5.0, 6.0)]
    assert breakdown(segs) == {"other": 2.0, "eval": 3.0, "data": 1.0}


def test_spans_outside_the_window_are_ignored_and_clipped():
    segs = idle_segments(10.0, 12.0, [HostSpan("data", 0.0, 1.0), HostSpan("checkpoint", 9.0, 11.0)])
    assert breakdown(segs) == {"checkpoint": 1.0, "other": 1.0}


def test_empty_window_has_no_segments():
    assert idle_segments(3.0, 3.0, [HostSpan("data", 0.0, 9.0)]) == []


@given(
    window=st.tuples(st.floats(0, 100), st.floats(0, 100)).map(sorted),
    spans=st.lists(
        st.tuples(st.sampled_from(["data", "eval", "checkpoint"]), st.floats(0, 100), st.floats(0, 100)), max_size=8),
)
def test_segments_tile_the_window(window, spans):
    lo, hi = window
    segs = idle_segments(lo, hi, [HostSpan(n, min(a, b), max(a, b)) for n, a, b in spans])
    assert sum(breakdown(segs).values()) == pytest.approx(max(0.0, hi - lo), abs=1e-9)
    for a, b in zip(segs, segs[1:]):
        assert a.end == b.start and a.name != b.name


def test_checkpoint_blocking_excludes_time_the_saved_step_was_still_computing():
    # Save started at 10 while step n computed until 12; the save ended at 15: 3 s blocked.
    assert blocking_seconds(10.0, 15.0, saved_step_end=12.0) == 3.0
    assert blocking_seconds(13.0, 15.0, saved_step_end=12.0) == 2.0
    assert blocking_seconds(10.0, 11.0, saved_step_end=12.0) == 0.0
    assert blocking_seconds(10.0, 15.0, saved_step_end=None) == 5.0


def test_bubble_ratio_per_stage_is_measured_over_the_stages_pipeline_window():
    # Step starts at 0; stage 0's last microbatch ends at 10, stage 1's at 8.
    ratios = bubble_ratios(0.0, [(0, 4.0, 2.0), (0, 10.0, 3.0), (1, 8.0, 8.0)])
    assert ratios == {"0": pytest.approx(0.5), "1": pytest.approx(0.0)}


def test_the_optimizer_after_the_last_microbatch_is_not_bubble():
    """A step [0, 14] whose microbatches fill [0, 10] back to back, then 4 s of gradient
    finalization and optimizer: bubble 0 (the old step-window rule said 4/14), optimizer 4 s."""
    mbs = [(0, 5.0, 5.0), (0, 10.0, 5.0)]
    assert bubble_ratios(0.0, mbs) == {"0": pytest.approx(0.0)}
    assert optimizer_seconds(0.0, 14.0, mbs) == pytest.approx(4.0)
    assert optimizer_seconds(0.0, 14.0, []) == 0.0
    assert bubble_ratios(3.0, [(None, 3.0, 0.0)]) == {"0": 0.0}  # an empty window is no bubble


def test_the_rest_of_the_timing_model_lives_beside_unit_timing():
    from steptrace import _attribution as a

    # dispatch moves to the end of a host span closing inside the step, before wait_for only
    assert a.dispatch_after_span(1.0, waited=False, span_end=1.5) == 1.5
    assert a.dispatch_after_span(1.0, waited=True, span_end=1.5) is None
    assert a.dispatch_after_span(2.0, waited=False, span_end=1.5) is None
    # the first step starts at its host start; a host-timed unit ends at its host exit
    assert a.previous_end(None, 3.0) == 3.0 and a.previous_end(2.0, 3.0) == 2.0
    assert a.unit_end(5.0, None) == 5.0 and a.unit_end(5.0, 4.5) == 4.5
    # microbatches chain from the previous step's end and never end after their step
    t0, t1 = a.microbatch_timings(10.0, 12.0, [(10.1, None, 11.0), (11.2, 11.3, 13.0)])
    assert (t0.start, t0.end, t0.compute_seconds) == (10.1, 11.0, pytest.approx(0.9))
    assert (t1.start, t1.end, t1.idle_seconds) == (11.3, 12.0, pytest.approx(0.3))
    spans = [a.HostSpan("data", 0.0, 1.0), a.HostSpan("eval", 0.0, 3.0)]
    assert a.spans_after(spans, 2.0) == [spans[1]]


def test_the_collectors_compute_share_window_sums_its_last_steps_exactly():
    from steptrace._attribution import ComputeShareWindow

    window = ComputeShareWindow(2)
    assert window.ratio() is None
    window.add(0.5, 1.0)
    window.add(1.0, 1.0)
    assert window.ratio() == pytest.approx(0.75)
    window.add(0.0, 2.0)  # the first step leaves the window
    assert window.ratio() == pytest.approx(1.0 / 3.0)
    for _ in range(10_000):  # running sums stay exact: re-added once per window
        window.add(0.1, 0.3)
    assert window.ratio() == pytest.approx(1.0 / 3.0, rel=1e-12)
    with pytest.raises(ValueError, match="goodput_window_steps"):
        ComputeShareWindow(0)


def test_a_span_is_idle_only_after_the_device_drained_and_nested_spans_count_once():
    from steptrace._attribution import exposed_gaps, idle_windows

    # Step device window [0, 10]. Span A [2, 5] began while the device still had work until 3;
    # span B [6, 8] on a drained device (synchronous: drained at its start); C [6.5, 7] inside B;
    # D [8.5, 9.5] after everything was handed over (drained = inf: hidden).
    gaps = exposed_gaps([(2.0, 5.0, 3.0), (6.0, 8.0, 6.0), (6.5, 7.0, 6.5), (8.5, 9.5, float("inf"))], 0.0, 10.0)
    assert gaps == [(3.0, 5.0), (6.0, 8.0)]
    t = unit_timing(prev_end=-1.0, dispatch=0.0, end=10.0, exposed=gaps)
    assert (t.start, t.compute_seconds, t.idle_seconds) == (0.0, 6.0, 5.0)
    assert idle_windows(-1.0, t, gaps) == [(-1.0, 0.0), (3.0, 5.0), (6.0, 8.0)]
    # A span reaching past the step's end is clipped to it; one entirely before its start is not idle twice.
    assert exposed_gaps([(9.0, 12.0, 9.0), (-3.0, -2.0, -3.0)], 0.0, 10.0) == [(9.0, 10.0)]


def test_window_segments_name_the_time_before_the_first_step_startup():
    from steptrace._attribution import STARTUP, window_segments

    segs = window_segments([(0.0, 4.0)], [HostSpan("eval", 1.0, 3.0)], STARTUP)
    assert breakdown(segs) == {"startup": 2.0, "eval": 2.0}
    segs = window_segments([(0.0, 1.0), (2.0, 3.0)], [HostSpan("data", 2.0, 2.5)])
    assert breakdown(segs) == {"other": 1.5, "data": 0.5}


@given(prev_end=st.floats(-1e9, 2e9, allow_nan=False), dispatch_after=st.floats(-5.0, 5.0, allow_nan=False),
       length=st.floats(-1.0, 10.0, allow_nan=False))
def test_plain_unit_is_unit_timing_and_its_idle_split_for_a_step_with_nothing_else(prev_end, dispatch_after, length):
    """The resolver's fast path (attribution.plain_unit) gives, float for float, what the general rules
    give a step with no device start, no exposed window and no span to cover its idle time."""
    from steptrace import _attribution as a

    dispatch = prev_end + dispatch_after
    end = dispatch + length
    timing, segments, idle = a.plain_unit(prev_end, dispatch, end)
    general = unit_timing(prev_end, dispatch, end, None, [])
    assert type(timing) is a.Timing and tuple(timing) == tuple(general)
    want_segments = a.window_segments(a.idle_windows(prev_end, general, []), [])
    assert list(segments) == want_segments and all(type(s) is HostSpan for s in segments)
    assert idle == breakdown(want_segments)
    assert sum(idle.values()) == pytest.approx(timing.idle_seconds, abs=1e-5)
