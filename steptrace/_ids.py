"""Trace and span ids derived from what every rank already knows.

A step's OTLP trace id is a hash of ``(run_id, step)``, so every rank's spans
of step 1234 form one distributed trace with no coordination, and a
load-balancing collector that routes by trace id sends a step's spans from
all ranks to the same place (DESIGN.md §4). The hash is documented so other
tools can compute it:

    trace_id = int.from_bytes(sha256(f"steptrace/{run_id}/{step}".encode()).digest()[:16], "big")

Span ids hash the trace id's inputs plus the rank and the span's role within
the step (``step``, ``compute``, ``idle/3``, ``microbatch/7``, ...), 8 bytes.
A zero id is invalid in OpenTelemetry; the (astronomically unlikely) zero is
replaced by 1.
"""

from __future__ import annotations

import hashlib


def trace_id(run_id: str, step: int) -> int:
    """The 128-bit trace id of step ``step`` of run ``run_id``, shared by all ranks."""
    value = int.from_bytes(hashlib.sha256(f"steptrace/{run_id}/{step}".encode()).digest()[:16], "big")
    return value or 1


def span_id(run_id: str, step: int, rank: int, role: str) -> int:
    """A 64-bit span id for ``role`` (``"step"``, ``"compute"``, ``"idle/0"``, ...) of one rank's step."""
    digest = hashlib.sha256(f"steptrace/{run_id}/{step}/{rank}/{role}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def trace_id_hex(run_id: str, step: int) -> str:
    """The trace id as the 32 lowercase hex digits OpenTelemetry and exemplars use."""
    return f"{trace_id(run_id, step):032x}"
