"""``<run_dir>/<run_id>/cluster.jsonl``: the joined records, one JSON line each; and two companions.

``conflicts.jsonl`` keeps the spans of ranks that sent two different spans for
one step (at most ``max_conflicts`` lines per run and collector lifetime; the
rest are only counted). ``journal.jsonl`` holds every accepted span whose
record is not yet written: appended before the request is answered (a failed
append raises :class:`JournalError`, and the request is answered 503, never
200); once a step's records are in ``cluster.jsonl`` a marker line
``["w", [steps]]`` says so (a step of a later attempt as ``[attempt, step]``),
and the spans before it of those steps are not replayed. Records that
cannot be written (a full disk) are kept and written again on the next
write or tick; until then their run's journal is neither
emptied nor compacted. The journal is emptied when the run has no open step
and nothing pending, rewritten with only the open steps' spans when it grows
past twice its size after the last rewrite (at least ``journal_compact_bytes``),
and replayed by the next collector, so a killed collector loses no span it
acknowledged and writes no step twice (it is written, not fsynced: it survives
the process, not the machine). It is bounded: ``max_journal_bytes_per_run``
per run and ``max_journal_bytes`` in all, beyond which appends are refused
(``journal_full``, 503). A journal line that does not decode as a span or a
marker is skipped and counted (``skipped_lines``), never fatal.

Like the ranks' JSONL files: append-only, each batch of lines handed to the OS
in one ``write`` of an unbuffered file, so a killed collector leaves at most a
torn last line (which ``steptrace report`` skips, and which the next writer
ends with a newline before appending). :meth:`ClusterLog.history` reads the
tail of an existing file back, so a restarted collector knows which steps it
already emitted.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from steptrace.collector._decode import MAX_DURATION_SECONDS, StepSpan, safe_run_id, span_fingerprint

__all__ = ["CLUSTER_FILE", "CONFLICTS_FILE", "JOURNAL_FILE", "ClusterLog", "JournalError"]

log = logging.getLogger("steptrace.collector")

CLUSTER_FILE = "cluster.jsonl"
CONFLICTS_FILE = "conflicts.jsonl"
JOURNAL_FILE = "journal.jsonl"
_SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(StepSpan))
_HISTORY_BYTES = 4 << 20  # the tail read back at restart: some 4000 steps of 256 ranks
_WRITTEN = "w"  # the first element of a journal marker line: ["w", [steps written]]
_MAX_PENDING = 100_000  # records kept for a retry at most, per run; beyond, they are dropped and counted


class JournalError(Exception):
    """An append to the journal that did not happen: ``reason`` is ``journal_failed`` or ``journal_full``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class ClusterLog:
    """Appends records to each run's ``cluster.jsonl``; keeps at most ``max_open`` files open."""

    def __init__(self, run_dir: str | os.PathLike[str], *, max_open: int = 64,
                 on_error: Callable[[int], None] | None = None, max_conflicts: int = 1000,
                 journal: bool = True, journal_compact_bytes: int = 4 << 20,
                 max_journal_bytes_per_run: int = 64 << 20, max_journal_bytes: int = 1 << 30,
                 open_spans: Callable[[str], list[StepSpan]] | None = None):
        self.run_dir = os.fspath(run_dir)
        self._max_open = max_open
        # (run_id, file name) -> unbuffered append handle
        self._files: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._on_error = on_error
        self._failed_once = False
        self._max_conflicts = max_conflicts
        self._conflicts_written: dict[str, int] = {}
        self.journal_enabled = journal
        self._journal_compact_bytes = journal_compact_bytes
        self._journal_bytes: dict[str, int] = {}
        self._journal_compacted: dict[str, int] = {}  # run -> journal size after its last rewrite
        self._max_journal_run = max_journal_bytes_per_run
        self._max_journal = max_journal_bytes
        self._open_spans = open_spans
        #: records whose write failed, by run: written again before the next ones
        self._pending: dict[str, list[dict[str, Any]]] = {}
        #: journal lines skipped at replay (torn, corrupt or not ours)
        self.skipped_lines = 0

    def path(self, run_id: str, name: str = CLUSTER_FILE) -> str:
        return os.path.join(self.run_dir, run_id, name)

    def write(self, records: Iterable[dict[str, Any]]) -> set[str]:
        """Append ``records`` (each has a ``run_id`` that :func:`safe_run_id` accepted); returns the runs written.

        Records a run's file refuses (a full disk) are kept and tried again, first, by the next
        :meth:`write` or :meth:`retry`; their spans stay in the journal until then. A run is in
        the returned set when everything it had to write is written.
        """
        by_run: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            by_run.setdefault(record["run_id"], []).append(record)
        return self._write(by_run)

    def retry(self) -> set[str]:
        """Write the records kept from failed writes; returns the runs now fully written."""
        return self._write({}) if self._pending else set()

    def pending(self, run_id: str) -> int:
        """Records of ``run_id`` waiting for a write that failed."""
        return len(self._pending.get(run_id, ()))

    def _write(self, by_run: dict[str, list[dict[str, Any]]]) -> set[str]:
        written: set[str] = set()
        for run_id in list(self._pending) + [r for r in by_run if r not in self._pending]:
            records = self._pending.pop(run_id, []) + by_run.get(run_id, [])
            if not records:
                continue
            lines = [json.dumps(r, separators=(",", ":")) + "\n" for r in records]
            if self._append(CLUSTER_FILE, {run_id: lines}, count=False):
                written.add(run_id)
                self._mark(run_id, {(r.get("attempt", 0), r["step"]) for r in records if r.get("type") != "conflict"})
            else:
                self._count_error(len(by_run.get(run_id, ())))  # each record counted once, not per retry
                if len(records) > _MAX_PENDING:
                    self._count_error(len(records) - _MAX_PENDING)
                    records = records[-_MAX_PENDING:]
                self._pending[run_id] = records
        return written

    def write_conflicts(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``conflict`` records, at most ``max_conflicts`` per run; the rest only counted by the caller."""
        by_run = _by_run(records)
        for run_id in list(by_run):
            room = self._max_conflicts - self._conflicts_written.get(run_id, 0)
            by_run[run_id] = by_run[run_id][:max(0, room)]
            self._conflicts_written[run_id] = self._conflicts_written.get(run_id, 0) + len(by_run[run_id])
            if not by_run[run_id]:
                del by_run[run_id]
        self._append(CONFLICTS_FILE, by_run)

    def write_advice(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records that acknowledge nothing (``cluster_stall``) to their runs' ``cluster.jsonl``:
        no journal marker, no retry (a failed write is counted; the next change writes a fresh one)."""
        self._append(CLUSTER_FILE, _by_run(records))

    def mark(self, run_id: str, units: Iterable[tuple[int, int]]) -> None:
        """Say in the journal that the spans so far of ``units`` ((attempt, step)) are dealt with."""
        self._mark(run_id, set(units))

    # -- the journal ---------------------------------------------------------------------------

    def journal(self, spans: Iterable[StepSpan]) -> None:
        """Append accepted spans to their runs' journals (before the request is answered).

        Raises :class:`JournalError` when they are not all there: a write that failed
        (``journal_failed``) or a journal at its bound (``journal_full``); the caller must
        then not acknowledge them.
        """
        if not self.journal_enabled:
            return
        by_run: dict[str, list[str]] = {}
        for span in spans:
            by_run.setdefault(span.run_id, []).append(_span_line(span))
        for run_id, lines in by_run.items():
            size = sum(len(x) for x in lines)
            have = self._journal_bytes.get(run_id, 0)
            if have + size > self._max_journal_run and self._open_spans is not None and not self.pending(run_id):
                self.reset_journal(run_id, self._open_spans(run_id))
                have = self._journal_bytes.get(run_id, 0)
            if have + size > self._max_journal_run or self.journal_bytes + size > self._max_journal:
                raise JournalError("journal_full", f"the journal of run {run_id!r} is full ({have} bytes; at most "
                                                   f"{self._max_journal_run} per run, {self._max_journal} in all)")
            if not self._append(JOURNAL_FILE, {run_id: lines}, count=False):
                raise JournalError("journal_failed", f"cannot append to {self.path(run_id, JOURNAL_FILE)}")
            self._journal_bytes[run_id] = have + size

    @property
    def journal_bytes(self) -> int:
        """Bytes in all journals (as this collector wrote and read them)."""
        return sum(self._journal_bytes.values())

    def journal_needs_compaction(self, run_id: str) -> bool:
        if self.pending(run_id):
            return False
        threshold = max(self._journal_compact_bytes, 2 * self._journal_compacted.get(run_id, 0))
        return self._journal_bytes.get(run_id, 0) > threshold

    def reset_journal(self, run_id: str, keep: Iterable[StepSpan] = ()) -> None:
        """Replace the run's journal with ``keep`` (its open steps' spans): write aside, then rename."""
        if not self.journal_enabled or run_id not in self._journal_bytes or self.pending(run_id):
            return  # records still to write: their spans must stay
        self._close((run_id, JOURNAL_FILE))
        path = self.path(run_id, JOURNAL_FILE)
        lines = [_span_line(s) for s in keep]
        try:
            if lines:
                with open(path + ".tmp", "wb") as f:
                    f.write("".join(lines).encode())
                os.replace(path + ".tmp", path)
            else:
                os.truncate(path, 0)
            self._journal_bytes[run_id] = self._journal_compacted[run_id] = sum(len(x) for x in lines)
        except OSError as exc:
            log.warning("steptrace collector: cannot rewrite %s (%s)", path, exc)

    def replay(self) -> list[StepSpan]:
        """The spans in every run's journal whose records were not written (read at start).

        A line that is neither a span nor a marker (torn, corrupt, another run's) is skipped,
        counted in :attr:`skipped_lines` and logged once per journal.
        """
        spans: list[StepSpan] = []
        try:
            runs = sorted(os.listdir(self.run_dir))
        except OSError:
            return spans
        for run_id in runs:
            path = self.path(run_id, JOURNAL_FILE)
            if not safe_run_id(run_id) or not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            self._journal_bytes[run_id] = len(data)
            # Spans by step in journal order: a marker drops the spans of its steps seen so far.
            by_step: dict[tuple[int, int], list[StepSpan]] = {}
            skipped = 0
            for line in data.split(b"\n"):
                if not line:
                    continue
                try:
                    values = json.loads(line)
                except (ValueError, RecursionError):
                    values = None
                if _is_marker(values):
                    for unit in values[1]:
                        by_step.pop((0, unit) if isinstance(unit, int) else (unit[0], unit[1]), None)
                    continue
                span = _span_from_values(values)
                if span is None or span.run_id != run_id:
                    skipped += 1
                    continue
                by_step.setdefault((span.attempt, span.step), []).append(span)
            if skipped:
                self.skipped_lines += skipped
                log.warning("steptrace collector: skipped %d unreadable line(s) of %s; counted in "
                            "steptrace_collector_journal_skipped_lines_total", skipped, path)
            for group in by_step.values():
                spans += group
        return spans

    def _append(self, name: str, by_run: dict[str, list[str]], count: bool = True) -> bool:
        """Append each run's lines in one write; False when one of them failed (counted, logged once)."""
        ok = True
        for run_id, lines in by_run.items():
            data = "".join(lines).encode()
            try:
                handle = self._file(run_id, name)
                start = handle.tell()
                written = handle.write(data)
                if written != len(data):  # a short write (a full disk): take it back
                    handle.truncate(start)
                    raise OSError(f"short write ({written} of {len(data)} bytes)")
            except OSError as exc:
                ok = False
                self._close((run_id, name))
                if count:
                    self._count_error(len(lines))
                if not self._failed_once:
                    self._failed_once = True
                    log.error("steptrace collector: cannot write %s (%s); counted in "
                              "steptrace_collector_write_errors_total (records are kept and written again, "
                              "spans refused with 503)", self.path(run_id, name), exc)
        return ok

    def _count_error(self, n: int) -> None:
        if self._on_error is not None:
            self._on_error(n)

    def _mark(self, run_id: str, units: set[tuple[int, int]]) -> None:
        if not self.journal_enabled or not units or run_id not in self._journal_bytes:
            return
        # A step of attempt 0 is written as its number, of a later attempt as [attempt, step].
        marks = [step if attempt == 0 else [attempt, step] for attempt, step in sorted(units)]
        line = json.dumps([_WRITTEN, marks], separators=(",", ":")) + "\n"
        if self._append(JOURNAL_FILE, {run_id: [line]}, count=False):
            self._journal_bytes[run_id] += len(line)

    def history(self, run_id: str) -> list[tuple[int, list[tuple[int, int | None]], float | None, int]]:
        """(step, [(rank, fingerprint)], end time, attempt) of the emitted steps and late spans in the file's tail."""
        path = self.path(run_id)
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - _HISTORY_BYTES))
                data = f.read()
        except OSError:
            return []
        lines = data.split(b"\n")
        if size > _HISTORY_BYTES:
            lines = lines[1:]  # starts mid-line
        out: list[tuple[int, list[tuple[int, int | None]], float | None, int]] = []
        for line in lines:
            try:
                record = json.loads(line)
                step = record["step"]
                if record["type"] == "cluster_step" and "rank_compute_seconds" in record:
                    computes, intervals = record["rank_compute_seconds"], record["rank_interval_seconds"]
                    ranks = [(int(r), _fingerprint(computes[r], intervals.get(r))) for r in computes]
                    # A conflicting rank's spans are in neither map; None makes a later one a duplicate.
                    ranks += [(int(r), None) for r in record.get("conflicting_ranks") or ()]
                elif record["type"] == "cluster_step":
                    # Without per-rank maps (the default): the ranks are the world less the missing
                    # ranges, their fingerprints unknown (a later span of one is a duplicate).
                    ranks = [(r, None) for r in _present_ranks(record)]
                    ranks += [(int(r), None) for r in record.get("conflicting_ranks") or ()]
                elif record["type"] == "late":
                    ranks = [(int(record["rank"]),
                              _fingerprint(record.get("compute_seconds"), record.get("interval_seconds")))]
                else:
                    continue
                end = record.get("end_time")
                end = float(end) if isinstance(end, (int, float)) and not isinstance(end, bool) else None
                attempt = record.get("attempt", 0)
                if isinstance(step, int) and _is_int(attempt) and all(0 <= r < (1 << 20) for r, _ in ranks):
                    out.append((step, ranks, end, attempt))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line, or not ours
        return out

    def close(self) -> None:
        for key in list(self._files):
            self._close(key)

    def _file(self, run_id: str, name: str = CLUSTER_FILE) -> Any:
        key = (run_id, name)
        handle = self._files.get(key)
        if handle is not None:
            self._files.move_to_end(key)
            return handle
        path = self.path(run_id, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle = open(path, "ab", buffering=0)
        if handle.tell() > 0 and not _ends_with_newline(path):
            # A killed writer left half a line: end it so our first record starts its own line.
            handle.write(b"\n")
        self._files[key] = handle
        while len(self._files) > self._max_open:
            self._close(next(iter(self._files)))
        return handle

    def _close(self, key: tuple[str, str]) -> None:
        handle = self._files.pop(key, None)
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass


def _span_line(span: StepSpan) -> str:
    return json.dumps([getattr(span, f) for f in _SPAN_FIELDS], separators=(",", ":")) + "\n"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_marker(values: Any) -> bool:
    return (isinstance(values, list) and len(values) == 2 and values[0] == _WRITTEN and isinstance(values[1], list)
            and all(_is_int(u) or (isinstance(u, list) and len(u) == 2 and _is_int(u[0]) and _is_int(u[1]))
                    for u in values[1]))


def _number(value: Any, optional: bool = False) -> bool:
    if value is None:
        return optional
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _duration(value: Any, optional: bool = False) -> bool:
    """What the decoder takes as a duration (``MAX_DURATION_SECONDS``): a journal line is replayed into
    the same bounded join."""
    return _number(value, optional) and (value is None or 0 <= value <= MAX_DURATION_SECONDS)


def _span_from_values(values: Any) -> StepSpan | None:
    """A journal line's span, or None when any field is not what the decoder would have produced."""
    # Journals written before spans had an attempt, the collective wait and time on its own, or the
    # own compute lack those last fields (a collector upgraded across a crash still replays them).
    # ... and before the GPU health window, exposed communication and the collectives (the last two), and
    # before the host causes (causes, gc_max: the last two, written together).
    if not isinstance(values, list) or len(values) not in (len(_SPAN_FIELDS), len(_SPAN_FIELDS) - 2,
                                                           len(_SPAN_FIELDS) - 3, len(_SPAN_FIELDS) - 4,
                                                           len(_SPAN_FIELDS) - 5, len(_SPAN_FIELDS) - 6,
                                                           len(_SPAN_FIELDS) - 8, len(_SPAN_FIELDS) - 9):
        return None
    span = dict(zip(_SPAN_FIELDS, values))
    causes = span.get("causes")
    if causes is not None and not (isinstance(causes, dict) and all(
            isinstance(k, str) and _number(v) for k, v in causes.items())):
        return None
    gc_max = span.get("gc_max")
    if gc_max is not None:
        if not (isinstance(gc_max, list) and len(gc_max) == 2 and _number(gc_max[0])
                and (gc_max[1] is None or _is_int(gc_max[1]))):
            return None
        span["gc_max"] = (float(gc_max[0]), gc_max[1])
    collectives = span.get("collectives")
    if collectives is not None:
        if not (isinstance(collectives, list) and all(
                isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and _is_int(c[1])
                and _duration(c[2], True) for c in collectives)):
            return None
        span["collectives"] = tuple((c[0], c[1], None if c[2] is None else float(c[2])) for c in collectives)
    span.setdefault("attempt", 0)
    if not all(_duration(span.get(field), True) for field in ("collective_wait_seconds", "own_seconds",
                                                              "own_compute_seconds", "exposed_communication_seconds")):
        return None
    health = span.get("health")
    if health is not None and not (isinstance(health, dict) and all(
            isinstance(k, str) and (_number(v) or (k == "violation_percent" and isinstance(v, dict) and all(
                isinstance(p, str) and _number(x) for p, x in v.items()))) for k, v in health.items())):
        return None

    def integer(value: Any, minimum: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    bubble = span["bubble"]
    if not (safe_run_id(span["run_id"]) and integer(span["step"], 0) and integer(span["rank"], 0)
            and (span["world_size"] is None or integer(span["world_size"], 1)) and isinstance(span["trace_id"], str)
            and _duration(span["compute_seconds"]) and _duration(span["interval_seconds"])
            and _duration(span["idle_seconds"], True) and isinstance(span["status"], str)
            and _number(span["end_time"], True) and isinstance(bubble, dict)
            and all(isinstance(k, str) and _number(v) for k, v in bubble.items()) and integer(span["attempt"], 0)):
        return None
    return StepSpan(**span)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _by_run(records: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    by_run: dict[str, list[str]] = {}
    for record in records:
        by_run.setdefault(record["run_id"], []).append(json.dumps(record, separators=(",", ":")) + "\n")
    return by_run


def _fingerprint(compute: Any, interval: Any) -> int | None:
    if isinstance(compute, (int, float)) and isinstance(interval, (int, float)):
        return span_fingerprint(float(compute), float(interval))
    return None


def _present_ranks(record: dict[str, Any]) -> range | list[int]:
    """The ranks a ``cluster_step`` record without per-rank maps had: ``[0, world_size)`` less its
    missing ranges (conflicting ranks count as missing and are in them). Where more ranges were
    missing than the record lists, the ranks after its last range count as present."""
    world = record.get("world_size")
    if not _is_int(world) or not 0 < world <= (1 << 20):
        return []
    ranges = record.get("missing_rank_ranges") or []
    if not ranges:
        return range(world)
    present: list[int] = []
    low = 0
    for first, last in sorted((int(a), int(b)) for a, b in ranges):
        present += range(low, min(first, world))
        low = max(low, last + 1)
    present += range(low, world)
    return present
