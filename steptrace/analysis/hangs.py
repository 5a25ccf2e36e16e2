"""The job's view of a hang: every rank's ``stall`` record side by side, and the rank that is the cause.

In synchronous training one stuck rank stops them all: the others wait in the next collective. Each
rank's stall watch wrote where its threads were (``steptrace._stall``); this module reads those
records (the newest per rank) and names:

* the **cause**: ranks behind the others (a lower step, or between steps while the others are inside
  the step), else the ranks whose training thread is somewhere else than where most ranks wait (the
  odd ones out), else nobody ("every rank in the same place": a hang inside the collective itself,
  the device or the network);
* the **waiting** ranks, with where they wait (their innermost frame; ``in a collective`` when it is
  in ``torch.distributed``, DDP or autograd, or JAX's blocking calls).

Only the standard library; no rank talks to another.
"""

from __future__ import annotations

from typing import Any

from steptrace.analysis.runs import Run

#: Paths where a thread waits on the other ranks (a collective, or a device blocked behind one).
_WAITING_IN = ("torch/distributed/", "torch/nn/parallel/distributed", "torch/autograd/", "torch/_tensor.py",
               "jax/_src/array.py", "jax/_src/api.py", "jax/_src/dispatch.py", "jax/_src/interpreters/pxla.py")


def _library(path: str) -> bool:
    """A frame of the standard library or an installed package (not the user's own code)."""
    return "site-packages" in path or "dist-packages" in path or "/lib/python3" in path or path.startswith("<")


def own_code_dirs(record: dict) -> tuple[str, ...]:
    """The folders of steptrace's own code where ``record`` was written (its ``steptrace_paths``); for
    records that do not say (older ones, the collector's from OTLP spans, whose stacks leave those
    frames out already), the folders of the steptrace reading it."""
    paths = record.get("steptrace_paths")
    if isinstance(paths, list) and paths and all(isinstance(p, str) and p for p in paths):
        return tuple(paths)
    from steptrace._stall import own_code_dirs as here

    return here()


def training_frame(record: dict, *, user: bool = False) -> list | None:
    """The training thread's innermost frame outside steptrace (``user``: also outside the standard
    library and installed packages, i.e. the program's own code): ``[file, line, function]``.
    steptrace's frames are told by where its code is installed, never by a folder's name: a user's
    ``.../steptrace/train.py`` is the user's."""
    threads = record.get("threads") or []
    train = next((t for t in threads if isinstance(t, dict) and t.get("training")), None)
    if train is None:
        return None
    own = own_code_dirs(record)
    for frame in reversed(train.get("frames") or []):
        if not (isinstance(frame, list) and len(frame) == 3) or str(frame[0]).startswith(own):
            continue
        if user and _library(str(frame[0])):
            continue
        return frame
    return None


def location(record: dict) -> str:
    """Where the training thread is: its own code's innermost frame, and the library frame it is
    inside when that is deeper (``train.py:25 in get_batch (threading.py:327 in wait)``)."""
    inner, own = training_frame(record), training_frame(record, user=True)
    if own is None or inner == own:
        return where(inner)
    return f"{where(own)} ({where(inner)})"


def in_collective(record: dict) -> bool:
    """Whether the training thread waits on other ranks (a frame in a collective or the autograd engine)."""
    threads = record.get("threads") or []
    train = next((t for t in threads if isinstance(t, dict) and t.get("training")), None)
    frames = (train or {}).get("frames") or []
    return any(any(part in str(frame[0]) for part in _WAITING_IN) for frame in frames[-8:]
               if isinstance(frame, list) and frame)


def last_collective(record: dict) -> int | None:
    """The highest collective sequence number the rank's NCCL flight recorder holds, or None."""
    entries = record.get("collectives")
    if not isinstance(entries, list):
        return None
    numbers = [e.get("collective_seq_id") for e in entries if isinstance(e, dict)]
    numbers = [n for n in numbers if isinstance(n, int) and not isinstance(n, bool)]
    return max(numbers) if numbers else None


def where(frame: list | None) -> str:
    if not frame:
        return "unknown"
    path, line, function = frame
    return f"{str(path).rsplit('/', 1)[-1]}:{line} in {function}"


def latest_stalls(run: Run) -> dict[int, dict]:
    """The newest stall record of each rank that has one (and whether it ended since)."""
    found: dict[int, dict] = {}
    for rank in run.ranks:
        stall = None
        for record in run.records_by_rank[rank]:
            if record.get("type") == "stall":
                stall = dict(record, ended_after=None)
            elif record.get("type") == "stall_end" and stall is not None:
                stall["ended_after"] = record.get("lasted_seconds")
        if stall is not None:
            found[rank] = stall
    return found


def job_view(run: Run) -> dict[str, Any] | None:
    """Who is the cause of the hang and who waits, from every rank's newest stall; None without stalls."""
    stalls = latest_stalls(run)
    return view_of(stalls) if stalls else None


def view_of(stalls: dict[int, dict]) -> dict[str, Any]:
    """The job's view of rank → stall record (``step, in_step, span, open_seconds, threads``, and
    ``ended_after`` when it ended): also what the collector writes from the ranks' stall spans."""
    ranks = sorted(stalls)

    def position(rank: int) -> tuple[int, int]:
        record = stalls[rank]
        step = record.get("step") if isinstance(record.get("step"), int) else -1
        return (step, 1 if record.get("in_step") else 0)

    lowest = min(position(r) for r in ranks)
    behind = [r for r in ranks if position(r) == lowest]
    cause: list[int] = []
    reason = ""
    sequence = {r: last_collective(stalls[r]) for r in ranks}
    known = [seq for seq in sequence.values() if seq is not None]
    if len(behind) < len(ranks):
        cause, reason = behind, "behind the others (an earlier step, or not yet in it)"
    elif len(known) == len(ranks) and min(known) < max(known):
        # The NCCL flight recorder says which collective each rank reached: the ones behind never joined.
        cause = [r for r in ranks if sequence[r] == min(known)]
        reason = f"behind in collectives (last collective #{min(known)}, the others #{max(known)})"
    else:
        by_place: dict[str, list[int]] = {}
        for rank in ranks:
            by_place.setdefault(where(training_frame(stalls[rank])), []).append(rank)
        waiting = [r for r in ranks if in_collective(stalls[r])]
        not_waiting = [r for r in ranks if r not in waiting]
        if waiting and not_waiting:
            cause, reason = not_waiting, "not in a collective while the others wait in one"
        elif len(by_place) > 1:
            biggest = max(by_place.values(), key=len)
            if len(biggest) > len(ranks) / 2:
                cause = sorted(r for r in ranks if r not in biggest)
                reason = "somewhere else than the others"
    others = [r for r in ranks if r not in cause]
    return {
        "ranks": ranks,
        "cause_ranks": cause,
        "reason": reason or "every rank in the same place: a hang inside the collective, the device or the network",
        "where": {r: location(stalls[r]) for r in ranks},
        "in_collective": {r: in_collective(stalls[r]) for r in ranks},
        "step": {r: stalls[r].get("step") for r in ranks},
        "span": {r: stalls[r].get("span") for r in ranks},
        "open_seconds": {r: stalls[r].get("open_seconds") for r in ranks},
        "ended_after": {r: stalls[r].get("ended_after") for r in ranks},
        "summary": _sentence(cause, others, stalls),
    }


def _rank_list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _sentence(cause: list[int], others: list[int], stalls: dict[int, dict]) -> str:
    """"rank 2: train.py:123 in get_batch (span data); ranks 0, 1, 3 waiting in graph.py:825 in ..."."""
    parts = []
    for rank in cause:
        record = stalls[rank]
        span = f" (span {record.get('span')})" if record.get("span") else ""
        parts.append(f"rank {rank}: {location(record)}{span}")
    if others:
        places = {where(training_frame(stalls[r])) for r in others}
        place = places.pop() if len(places) == 1 else "several places"
        verb = "waiting in" if any(in_collective(stalls[r]) for r in others) else "at"
        label = "rank" if len(others) == 1 else "ranks"
        parts.append(f"{label} {_rank_list(others)} {verb} {place}")
    return "; ".join(parts)
