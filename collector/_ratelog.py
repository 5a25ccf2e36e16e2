"""Log lines a client can cause, at most one per reason per interval.

Every refused request is counted in ``steptrace_collector_rejected_requests_total``;
the log only needs to say that it happens and why. A peer sending garbage in a
loop must not fill the disk, so each reason logs once, then stays quiet for
``interval_s`` and says how many it held back when it speaks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from steptrace._ratelimit import RateLimiter

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """``warning(key, msg, *args)`` logs at most once per ``interval_s`` per ``key`` (no tracebacks)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 256):
        self._log = logger
        self._interval_s = interval_s
        # Keys are refusal reasons, a fixed set; the key bound only guards against misuse.
        self._limiter = RateLimiter(interval_s, clock, max_keys)

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless ``key`` logged within the interval; True when it was logged."""
        held = self._limiter.admit(key)
        if held is None:
            return False
        if held:
            msg += " (%d more like it in the last %gs not logged)"
            args = (*args, held, self._interval_s)
        self._log.warning(msg, *args)
        return True
