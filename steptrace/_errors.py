"""Warnings and misuse handling shared by the public API.

Misuse inside the training loop must never crash training (house rule): it is
reported once per kind as a :class:`SteptraceWarning` and counted. With
``init(strict=True)`` (or ``STEPTRACE_STRICT=1``) the same misuse raises
``ValueError`` instead, which is what tests and CI want.
"""

from __future__ import annotations

import warnings


class SteptraceWarning(UserWarning):
    """Misuse of the steptrace API inside a training loop, or telemetry that was lost."""


def misuse(message: str, *, strict: bool, stacklevel: int = 3) -> None:
    """Raise ``ValueError`` in strict mode, otherwise warn (Python shows each call site once)."""
    if strict:
        raise ValueError(message)
    warnings.warn(message, SteptraceWarning, stacklevel=stacklevel)
