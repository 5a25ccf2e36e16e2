"""Device-timed collectives (NCCL) joined across ranks: each rank's wait for its peers, from device time.

On NCCL a collective's call returns once it is enqueued; the wait for the other ranks happens inside
the collective's kernel on the device. Each rank's records carry, per collective it completed in the
step, its device duration from its arrival (the point of its current stream the NCCL stream waits on,
ProcessGroupNCCL's ``syncStream``) to its completion (the point where the current stream resumes
after waiting on the NCCL stream, ``WorkNCCL::synchronizeStream``): ``collectives``, a list of
``[group, sequence, device_seconds, exposed_seconds]`` (steptrace.adapters.torch_distributed).

A collective kernel cannot finish on any rank before the last rank's kernel has started, and
finishes on every rank about together (the last transfer): on rank ``r`` its device duration is
``wait_r + transfer``, with ``wait_r`` = the latest peer's arrival less ``r``'s own. The rank that
arrived last waited ~0, so over the ranks that ran one collective (joined by ``(group, sequence)``)
``wait_r = duration_r - min(duration)`` and ``transfer = min(duration)``. No clock is compared
across hosts: each figure is a difference of two events on one GPU.

:func:`join_device_collectives` fills, on every step record that has ``collectives``, the fields the
CPU path measures on the host (``collective_wait_seconds``, ``own_seconds``,
``own_compute_seconds``, ``collective_wait_idle_breakdown``, ``collective_wait_source`` =
``"nccl-device"``), so the straggler verdict, the report and compare read one shape.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from steptrace._attribution import own_seconds
from steptrace._schema import COLLECTIVE_SOURCE_NCCL_DEVICE as SOURCE_NCCL_DEVICE

__all__ = ["SOURCE_NCCL_DEVICE", "join_device_collectives"]


def _entries(record: dict) -> Iterable[tuple[Any, int, float]]:
    entries = record.get("collectives")
    if not isinstance(entries, list):
        return
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) >= 3):
            continue
        group, seq, seconds = entry[0], entry[1], entry[2]
        if isinstance(seq, bool) or not isinstance(seq, int) or isinstance(seconds, bool) \
                or not isinstance(seconds, (int, float)) or not seconds >= 0:
            continue
        yield str(group), seq, float(seconds)


def join_device_collectives(records_by_rank: dict[int, list[dict]]) -> int:
    """Fill each rank's step records that carry ``collectives`` with their wait for peers (in place);
    returns how many step records were filled.

    A collective seen by one rank only (its peers' files are missing) tells nothing about waiting:
    the step that holds it is left without the fields, never given a wait of 0. A record that already
    has a host-measured wait (gloo) keeps it."""
    shortest: dict[tuple[str, int], float] = {}
    seen_by: dict[tuple[str, int], int] = {}
    for records in records_by_rank.values():
        for record in records:
            if record.get("type") != "step":
                continue
            for group, seq, seconds in _entries(record):
                key = (group, seq)
                shortest[key] = min(seconds, shortest.get(key, math.inf))
                seen_by[key] = seen_by.get(key, 0) + 1
    filled = 0
    for records in records_by_rank.values():
        for record in records:
            if record.get("type") != "step" or "collective_wait_seconds" in record:
                continue
            entries = list(_entries(record))
            if not entries or any(seen_by[(g, s)] < 2 for g, s, _ in entries):
                continue
            if len(entries) != len(record["collectives"]):
                continue  # an untimed collective (async, no duration): its wait is unknown, not 0
            interval, compute = record.get("interval_seconds"), record.get("compute_seconds")
            if not isinstance(interval, (int, float)) or not isinstance(compute, (int, float)):
                continue
            # The device waited inside the step's compute (the current stream was held on the NCCL stream).
            wait = min(math.fsum(seconds - shortest[(g, s)] for g, s, seconds in entries), float(compute))
            record["collective_wait_seconds"] = wait
            record["own_seconds"] = own_seconds(float(interval), wait)
            record["own_compute_seconds"] = max(0.0, compute - wait)
            record["collective_wait_idle_breakdown"] = {}
            record["collective_wait_source"] = SOURCE_NCCL_DEVICE
            filled += 1
    return filled
