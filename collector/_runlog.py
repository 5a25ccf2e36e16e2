"""``<run_dir>/<run_id>/cluster.jsonl``: the joined records, one JSON line each; and two companions.

``conflicts.jsonl`` keeps the spans of ranks that sent two different spans for
one step (at most ``max_conflicts`` lines per run and collector lifetime; the
rest are only counted). ``journal.jsonl`` holds every accepted span of the
run's still-open steps: appended before the request is answered, emptied when
the run has no open step, rewritten with only the open steps' spans when it
grows past ``journal_compact_bytes``, and replayed by the next collector, so
a killed collector loses no span it acknowledged (it is written, not fsynced:
it survives the process, not the machine).

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
import os
from collections.abc import Callable, Iterable
from typing import Any

from steptrace.collector._decode import StepSpan, safe_run_id, span_fingerprint

__all__ = ["CLUSTER_FILE", "CONFLICTS_FILE", "JOURNAL_FILE", "ClusterLog"]

log = logging.getLogger("steptrace.collector")

CLUSTER_FILE = "cluster.jsonl"
CONFLICTS_FILE = "conflicts.jsonl"
JOURNAL_FILE = "journal.jsonl"
_SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(StepSpan))
_HISTORY_BYTES = 4 << 20  # the tail read back at restart: some 4000 steps of 256 ranks


class ClusterLog:
    """Appends records to each run's ``cluster.jsonl``; keeps at most ``max_open`` files open."""

    def __init__(self, run_dir: str | os.PathLike[str], *, max_open: int = 64,
                 on_error: Callable[[int], None] | None = None, max_conflicts: int = 1000,
                 journal: bool = True, journal_compact_bytes: int = 4 << 20):
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

    def path(self, run_id: str, name: str = CLUSTER_FILE) -> str:
        return os.path.join(self.run_dir, run_id, name)

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``records`` (each has a ``run_id`` that :func:`safe_run_id` accepted)."""
        self._append(CLUSTER_FILE, _by_run(records))

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

    # -- the journal ---------------------------------------------------------------------------

    def journal(self, spans: Iterable[StepSpan]) -> None:
        """Append accepted spans to their runs' journals (before the request is answered)."""
        if not self.journal_enabled:
            return
        by_run: dict[str, list[str]] = {}
        for span in spans:
            by_run.setdefault(span.run_id, []).append(
                json.dumps([getattr(span, f) for f in _SPAN_FIELDS], separators=(",", ":")) + "\n")
        self._append(JOURNAL_FILE, by_run)
        for run_id, lines in by_run.items():
            self._journal_bytes[run_id] = self._journal_bytes.get(run_id, 0) + sum(len(x) for x in lines)

    def journal_needs_compaction(self, run_id: str) -> bool:
        return self._journal_bytes.get(run_id, 0) > self._journal_compact_bytes

    def reset_journal(self, run_id: str, keep: Iterable[StepSpan] = ()) -> None:
        """Replace the run's journal with ``keep`` (its open steps' spans): write aside, then rename."""
        if not self.journal_enabled or run_id not in self._journal_bytes:
            return
        self._close((run_id, JOURNAL_FILE))
        path = self.path(run_id, JOURNAL_FILE)
        lines = [json.dumps([getattr(s, f) for f in _SPAN_FIELDS], separators=(",", ":")) + "\n" for s in keep]
        try:
            if lines:
                with open(path + ".tmp", "wb") as f:
                    f.write("".join(lines).encode())
                os.replace(path + ".tmp", path)
            else:
                os.truncate(path, 0)
            self._journal_bytes[run_id] = sum(len(x) for x in lines)
        except OSError as exc:
            log.warning("steptrace collector: cannot rewrite %s (%s)", path, exc)

    def replay(self) -> list[StepSpan]:
        """The spans in every run's journal under the run dir (read at start; torn lines skipped)."""
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
            for line in data.split(b"\n"):
                try:
                    values = json.loads(line)
                    if len(values) > len(_SPAN_FIELDS):
                        raise ValueError("not a journal line")
                    # A journal written before StepSpan gained its last optional fields has fewer.
                    span = StepSpan(**dict(zip(_SPAN_FIELDS, values)))
                except (ValueError, TypeError):
                    continue  # a torn last line
                if span.run_id == run_id:
                    spans.append(span)
        return spans

    def _append(self, name: str, by_run: dict[str, list[str]]) -> None:
        for run_id, lines in by_run.items():
            try:
                self._file(run_id, name).write("".join(lines).encode())
            except OSError as exc:
                self._close((run_id, name))
                if self._on_error is not None:
                    self._on_error(len(lines))
                if not self._failed_once:
                    self._failed_once = True
                    log.error("steptrace collector: cannot write %s (%s); records are dropped and counted in "
                              "steptrace_collector_write_errors_total", self.path(run_id, name), exc)

    def history(self, run_id: str) -> list[tuple[int, list[tuple[int, int | None]], float | None]]:
        """(step, [(rank, fingerprint)], end time) of the emitted steps and late spans in the run file's tail."""
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
        out: list[tuple[int, list[tuple[int, int | None]], float | None]] = []
        for line in lines:
            try:
                record = json.loads(line)
                step = record["step"]
                if record["type"] == "cluster_step":
                    computes, intervals = record["rank_compute_seconds"], record["rank_interval_seconds"]
                    ranks = [(int(r), _fingerprint(computes[r], intervals.get(r))) for r in computes]
                    # A conflicting rank's spans are in neither map; None makes a later one a duplicate.
                    ranks += [(int(r), None) for r in record.get("conflicting_ranks") or ()]
                elif record["type"] == "late":
                    ranks = [(int(record["rank"]),
                              _fingerprint(record.get("compute_seconds"), record.get("interval_seconds")))]
                else:
                    continue
                end = record.get("end_time")
                end = float(end) if isinstance(end, (int, float)) and not isinstance(end, bool) else None
                if isinstance(step, int) and all(0 <= r < (1 << 20) for r, _ in ranks):
                    out.append((step, ranks, end))
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
