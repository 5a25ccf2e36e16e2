"""Warnings and misuse handling shared by the public API.

Misuse inside the training loop must never crash training (house rule): it is
reported once per kind as a :class:`SteptraceWarning` and counted. With
``init(strict=True)`` (or ``STEPTRACE_STRICT=1``) the same misuse raises
``ValueError`` instead, which is what tests and CI want.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

#: steptrace's own files: a misuse warning points at the first frame outside them.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class SteptraceWarning(UserWarning):
    """Misuse of the steptrace API inside a training loop, or telemetry that was lost."""


def misuse(message: str, *, strict: bool, stacklevel: int | None = 3) -> None:
    """Raise ``ValueError`` in strict mode, otherwise warn (Python shows each call site once).

    ``stacklevel=None``: the warning points at the first caller outside steptrace's package, the
    user's line, however many of steptrace's frames lie between (``steptrace.step`` bound to the
    runtime or the module function, ``begin_step``, a ``steps()`` loop, a handle)."""
    if strict:
        raise ValueError(message)
    if stacklevel is None:
        stacklevel = _outside_steptrace()
    warnings.warn(message, SteptraceWarning, stacklevel=stacklevel)


def _outside_steptrace() -> int:
    """``misuse``'s stacklevel for its first caller outside steptrace (Python 3.12's
    ``skip_file_prefixes``, which 3.11 lacks). Level 2 is misuse's caller: frame 2 from here."""
    level = 2
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
