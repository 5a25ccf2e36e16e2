"""Log lines from a failing endpoint are limited to one per interval per kind, with a count."""

import logging

from steptrace._ratelimit import OTEL_EXPORTER_LOGGERS, RateLimitFilter


def test_one_line_per_interval_then_the_count_of_what_was_suppressed():
    now = [0.0]
    flt = RateLimitFilter(60.0, clock=lambda: now[0])
    logger = logging.getLogger("steptrace.test.ratelimit")
    logger.addFilter(flt)
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Collect()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for second in range(0, 150):
            now[0] = float(second)
            logger.warning("Failed to export batch code: %s", 500)
        logger.warning("another kind")
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(flt)
    assert seen == ["Failed to export batch code: 500",
                    "Failed to export batch code: 500 [59 more like this in the last 60 s, not logged]",
                    "Failed to export batch code: 500 [59 more like this in the last 60 s, not logged]",
                    "another kind"]


def test_the_otlp_sink_limits_the_opentelemetry_exporters_loggers():
    import pytest

    pytest.importorskip("opentelemetry.sdk")
    from steptrace.otlp import OtlpSink

    sink = OtlpSink("http://127.0.0.1:9", run_id="r")
    try:
        for name in OTEL_EXPORTER_LOGGERS:
            assert any(isinstance(f, RateLimitFilter) for f in logging.getLogger(name).filters), name
    finally:
        sink.shutdown(1)


def test_the_limiter_remembers_a_bounded_number_of_keys():
    """Keys made from input (a peer's garbage) cannot grow it: new keys past the bound share one."""
    from steptrace._ratelimit import RateLimiter

    now = [0.0]
    limiter = RateLimiter(10.0, clock=lambda: now[0], max_keys=3)
    assert [limiter.admit(k) for k in "abc"] == [0, 0, 0]
    assert limiter.admit("d") == 0  # the first key past the bound passes as the shared one
    assert limiter.admit("e") is None and limiter.admit("f") is None  # ...which is now held
    assert limiter.admit("a") is None
    now[0] = 10.0
    assert limiter.admit("g") == 2  # the shared key speaks again with its count
    assert limiter.admit("a") == 1
