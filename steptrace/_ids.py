"""Trace and span ids derived from what every rank already knows.

A step's OTLP trace id is a hash of ``(run_id, step)``, so every rank's spans
of step 1234 form one distributed trace with no coordination, and a
load-balancing collector that routes by trace id sends a step's spans from
all ranks to the same place (DESIGN.md §4). The hash is documented so other
tools can compute it:

    trace_id = int.from_bytes(sha256(f"steptrace/{run_id}/{step}".encode()).digest()[:16], "big")

for the first attempt of a run, and ``f"steptrace/{run_id}/a{attempt}/{step}"`` for a later one (a
process restarted within the run, see ``_config``): a redone step is a unit of its own, never a
conflicting copy of the step it redoes.

Span ids hash the trace id's inputs plus the rank and the span's role within
the step, 8 bytes. Roles used by the OTLP exporter: ``step``, ``compute``,
``idle/<i>`` (i-th idle segment), ``span/<k>``, ``microbatch/<k>`` and
``checkpoint/<start_us>``. Deterministic ids make a retried export idempotent.

A host span with no step after it (closed after the last step) gets a trace of
its own: :func:`orphan_span_ids`.
A zero id is invalid in OpenTelemetry; the (astronomically unlikely) zero is
replaced by 1.
"""

from __future__ import annotations

import hashlib
from typing import Callable

#: The longest run id a rank accepts and the collector stores (it names a directory).
MAX_RUN_ID_LENGTH = 200


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` cannot name a run (a directory under the run dir), or None if it can.

    The one rule for both sides: ``init`` refuses what the collector would refuse, so a
    rank never sends spans that are all rejected.
    """
    if not isinstance(run_id, str) or not run_id:
        return "must be a non-empty string"
    if len(run_id) > MAX_RUN_ID_LENGTH:
        return f"is {len(run_id)} characters; at most {MAX_RUN_ID_LENGTH}"
    if run_id in (".", ".."):
        return "cannot be '.' or '..'"
    if "/" in run_id or "\\" in run_id:
        return "cannot contain '/' or '\\'"
    if not run_id.isprintable():
        return "must be printable (no tabs, newlines or NUL bytes)"
    return None


def _step_key(run_id: str, step: int, attempt: int) -> str:
    # The first attempt keeps the original key, so its ids do not change with attempts.
    return f"steptrace/{run_id}/{step}" if not attempt else f"steptrace/{run_id}/a{attempt}/{step}"


def trace_id(run_id: str, step: int, attempt: int = 0) -> int:
    """The 128-bit trace id of step ``step`` of run ``run_id`` in ``attempt``, shared by all ranks."""
    return int(trace_id_hex(run_id, step, attempt), 16)


def span_id(run_id: str, step: int, rank: int, role: str, attempt: int = 0) -> int:
    """A 64-bit span id for ``role`` (``"step"``, ``"compute"``, ``"idle/0"``, ...) of one rank's step."""
    digest = hashlib.sha256(f"{_step_key(run_id, step, attempt)}/{rank}/{role}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def trace_id_hex(run_id: str, step: int, attempt: int = 0) -> str:
    """The trace id as the 32 lowercase hex digits OpenTelemetry and exemplars use: the first 128 bits
    of the step key's SHA-256, never all zeros (an invalid trace id in OpenTelemetry). Read straight
    from the digest, since every step record carries one; :func:`trace_id` is its integer."""
    digits = hashlib.sha256(_step_key(run_id, step, attempt).encode()).hexdigest()[:32]
    return digits if digits != _ZERO_TRACE_ID else _ONE_TRACE_ID


_ZERO_TRACE_ID = "0" * 32
_ONE_TRACE_ID = f"{1:032x}"


def trace_id_hex_of_run(run_id: str, attempt: int = 0) -> Callable[[int], str]:
    """``step -> trace_id_hex(run_id, step, attempt)``, the same digits for one run and attempt: the
    step key's constant prefix is hashed once, and each step copies that state and adds its number
    (the resolver gives every step record one; this is ~0.4 of its ~1.2 µs). An int step only; any
    other goes through :func:`trace_id_hex`."""
    prefix = _step_key(run_id, 0, attempt)[:-1]  # "steptrace/<run_id>/" (+ "a<attempt>/")
    hashed_prefix = hashlib.sha256(prefix.encode())

    def of_step(step: int) -> str:
        if step.__class__ is not int:
            return trace_id_hex(run_id, step, attempt)
        state = hashed_prefix.copy()
        state.update(b"%d" % step)
        digits = state.hexdigest()[:32]
        return digits if digits != _ZERO_TRACE_ID else _ONE_TRACE_ID

    return of_step


def orphan_span_ids(run_id: str, rank: int, name: str, start_us: int) -> tuple[int, int]:
    """(trace id, span id) of a span that belongs to no step, keyed by its start in whole µs::

        key = f"steptrace/{run_id}/span/{rank}/{name}/{start_us}"
        trace_id = sha256(key)[:16], span_id = sha256(key + "/span")[:8]
    """
    key = f"steptrace/{run_id}/span/{rank}/{name}/{start_us}"
    trace = int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big") or 1
    span = int.from_bytes(hashlib.sha256((key + "/span").encode()).digest()[:8], "big") or 1
    return trace, span
