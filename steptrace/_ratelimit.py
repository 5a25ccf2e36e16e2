"""Log lines at most once per interval: a failing endpoint must not flood the training job's log.

:class:`RateLimitFilter` is a ``logging.Filter``: the first record of a kind (logger and message
template) passes, the same kind is then suppressed for ``interval_s``, and the next one that
passes says how many were suppressed meanwhile. The clock is injectable for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable

#: The OpenTelemetry exporters' own loggers: one line per failed batch unless limited.
OTEL_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.sdk.metrics._internal.export",
)


class RateLimiter:
    """Per key, admit one event per ``interval_s``; the next admitted one learns how many were held.

    The one mechanism behind every limited log line (the OTel exporters' lines on a rank, the
    collector's refusal lines). At most ``max_keys`` keys are remembered; later new keys share
    one, so a caller that makes keys from input cannot grow it.
    """

    OVERFLOW_KEY = ("(other)",)

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 256):
        self.interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def admit(self, key: Hashable) -> int | None:
        """None when ``key`` is held back; else how many of it were held back since it last passed."""
        now = self._clock()
        with self._lock:
            if key not in self._last and len(self._last) >= self._max_keys:
                key = self.OVERFLOW_KEY
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


class RateLimitFilter(logging.Filter):
    """A ``logging.Filter``: per (logger, message template), one record per ``interval_s``."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self._limiter = RateLimiter(interval_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        suppressed = self._limiter.admit((record.name, str(record.msg)))
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.msg} [{suppressed} more like this in the last {self.interval_s:g} s, not logged]"
        return True


_installed: RateLimitFilter | None = None


def limit_otel_exporter_logs(interval_s: float = 60.0) -> RateLimitFilter:
    """Attach one shared filter to the OpenTelemetry exporters' loggers (idempotent)."""
    global _installed
    if _installed is None:
        _installed = RateLimitFilter(interval_s)
        for name in OTEL_EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(_installed)
    return _installed
