"""``<run_dir>/<run_id>/cluster.jsonl``: the joined records, one JSON line each.

Like the ranks' JSONL files: append-only, each batch of lines handed to the OS
in one ``write`` of an unbuffered file, so a killed collector leaves at most a
torn last line (which ``steptrace report`` skips, and which the next writer
ends with a newline before appending). :meth:`ClusterLog.history` reads the
tail of an existing file back, so a restarted collector knows which steps it
already emitted.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from typing import Any, Callable, Iterable

__all__ = ["CLUSTER_FILE", "ClusterLog"]

log = logging.getLogger("steptrace.collector")

CLUSTER_FILE = "cluster.jsonl"
_HISTORY_BYTES = 4 << 20  # the tail read back at restart: some 4000 steps of 256 ranks


class ClusterLog:
    """Appends records to each run's ``cluster.jsonl``; keeps at most ``max_open`` files open."""

    def __init__(self, run_dir: str | os.PathLike[str], *, max_open: int = 64,
                 on_error: Callable[[int], None] | None = None):
        self.run_dir = os.fspath(run_dir)
        self._max_open = max_open
        self._files: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._on_error = on_error
        self._failed_once = False

    def path(self, run_id: str) -> str:
        return os.path.join(self.run_dir, run_id, CLUSTER_FILE)

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ``records`` (each has a ``run_id`` that :func:`safe_run_id` accepted)."""
        by_run: dict[str, list[str]] = {}
        for record in records:
            by_run.setdefault(record["run_id"], []).append(json.dumps(record, separators=(",", ":")) + "\n")
        for run_id, lines in by_run.items():
            try:
                self._file(run_id).write("".join(lines).encode())
            except OSError as exc:
                self._close(run_id)
                if self._on_error is not None:
                    self._on_error(len(lines))
                if not self._failed_once:
                    self._failed_once = True
                    log.error("steptrace collector: cannot write %s (%s); records are dropped and counted in "
                              "steptrace_collector_write_errors_total", self.path(run_id), exc)

    def history(self, run_id: str) -> list[tuple[int, list[int], float | None]]:
        """(step, ranks, end time) of the emitted steps and late spans in the tail of the run's file."""
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
        out: list[tuple[int, list[int], float | None]] = []
        for line in lines:
            try:
                record = json.loads(line)
                step = record["step"]
                if record["type"] == "cluster_step":
                    ranks = [int(r) for r in record["rank_compute_seconds"]]
                elif record["type"] == "late":
                    ranks = [int(record["rank"])]
                else:
                    continue
                end = record.get("end_time")
                end = float(end) if isinstance(end, (int, float)) and not isinstance(end, bool) else None
                if isinstance(step, int) and all(0 <= r < (1 << 20) for r in ranks):
                    out.append((step, ranks, end))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line, or not ours
        return out

    def close(self) -> None:
        for run_id in list(self._files):
            self._close(run_id)

    def _file(self, run_id: str) -> Any:
        handle = self._files.get(run_id)
        if handle is not None:
            self._files.move_to_end(run_id)
            return handle
        path = self.path(run_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle = open(path, "ab", buffering=0)
        if handle.tell() > 0 and not _ends_with_newline(path):
            # A killed writer left half a line: end it so our first record starts its own line.
            handle.write(b"\n")
        self._files[run_id] = handle
        while len(self._files) > self._max_open:
            self._close(next(iter(self._files)))
        return handle

    def _close(self, run_id: str) -> None:
        handle = self._files.pop(run_id, None)
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
