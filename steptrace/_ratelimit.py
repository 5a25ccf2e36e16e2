"""Log lines at most once per interval: a failing endpoint must not flood the training job's log.

:class:`RateLimitFilter` is a ``logging.Filter``: the first record of a kind (logger and message
template) passes, the same kind is then suppressed for ``interval_s``, and the next one that
passes says how many were suppressed meanwhile. The clock is injectable for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

#: The OpenTelemetry exporters' own loggers: one line per failed batch unless limited.
OTEL_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.sdk.metrics._internal.export",
)


class RateLimitFilter(logging.Filter):
    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
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
