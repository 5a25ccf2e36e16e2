"""Sinks consume finalized records; each runs behind its own bounded queue and thread.

A sink implements the tiny protocol :class:`Sink` (``export``, ``force_flush``,
``shutdown``, after OpenTelemetry's exporters). :class:`SinkWorker` gives each
sink a thread of its own, so a slow sink delays neither the training thread
nor the resolver (whose promptness is what makes device end times exact) nor
the other sinks. When a sink falls behind, records are dropped and counted
under ``sink:<name>``; sink exceptions are logged once and counted.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from steptrace._wakeup import Wakeup

log = logging.getLogger("steptrace")


class Sink(Protocol):
    """Where finalized records go. Called from the sink's own background thread."""

    name: str

    def export(self, records: Sequence[Mapping[str, Any]]) -> None: ...

    def force_flush(self, timeout_s: float) -> bool: ...

    def shutdown(self, timeout_s: float) -> None: ...


class JsonlSink:
    """The embedded default: ``<run_dir>/<run_id>/rank-<rank>.jsonl``, one record per line.

    Lines are written whole and the file is line-buffered, so every record
    handed to the OS survives a crash of the training process.
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")
            if self._file.tell() > 0 and not _ends_with_newline(self.path):
                # A crashed earlier writer left half a line: end it, so our first record
                # starts a line of its own (readers skip the torn line).
                self._file.write("\n")
        except OSError as exc:
            raise ValueError(f"run_dir: cannot write {self.path}: {exc.strerror or exc}") from exc

    def export(self, records: Sequence[Mapping[str, Any]]) -> None:
        text = "".join(json.dumps(r, default=_json_default, separators=(",", ":")) + "\n" for r in records)
        self._file.write(text)

    def force_flush(self, timeout_s: float) -> bool:
        self._file.flush()
        return True

    def shutdown(self, timeout_s: float) -> None:
        try:
            self._file.flush()
        finally:
            self._file.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _json_default(value: Any) -> Any:
    """User attrs may hold numpy scalars and the like: numbers stay numbers, the rest becomes text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:
            pass
    return str(value)


class SinkWorker:
    """A sink's bounded queue and background thread."""

    def __init__(self, sink: Sink, max_queue: int, count_drop: Callable[[str, int], None]):
        self.sink = sink
        self.name = getattr(sink, "name", type(sink).__name__)
        self._max_queue = max_queue
        self._count_drop = count_drop
        self._queue: collections.deque[Mapping[str, Any]] = collections.deque()
        self._wake = Wakeup()
        self._offered = 0
        self._done = 0
        self._stopping = False
        self._failures = 0
        #: CPU seconds this sink's thread has used (it holds the GIL for nearly all of them).
        self.cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=f"steptrace-sink-{self.name}", daemon=True)
        self._thread.start()

    def offer(self, records: Sequence[Mapping[str, Any]]) -> None:
        if len(self._queue) + len(records) > self._max_queue:
            self._count_drop(f"sink:{self.name}", len(records))
            return
        self._queue.extend(records)
        self._offered += len(records)
        self._wake.set()

    def _run(self) -> None:
        cpu_start = time.thread_time()
        while True:
            self.cpu_seconds = time.thread_time() - cpu_start
            self._wake.wait(0.1)
            while self._queue:
                batch: list[Mapping[str, Any]] = []
                while self._queue and len(batch) < 1024:
                    batch.append(self._queue.popleft())
                try:
                    self.sink.export(batch)
                except Exception:
                    self._failures += 1
                    self._count_drop(f"sink:{self.name}", len(batch))
                    if self._failures == 1:
                        log.exception("steptrace sink %s failed; its records are dropped and counted", self.name)
                self._done += len(batch)
            if self._stopping and not self._queue:
                self.cpu_seconds = time.thread_time() - cpu_start
                return

    def flush(self, deadline: float) -> bool:
        """Wait until everything offered so far is exported, then flush the sink."""
        target = self._offered
        while self._done < target:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            self._wake.set()
            time.sleep(0.001)
        try:
            return bool(self.sink.force_flush(max(0.0, deadline - time.monotonic())))
        except Exception:
            log.exception("steptrace sink %s failed to flush", self.name)
            return False

    def shutdown(self, deadline: float) -> bool:
        flushed = self.flush(deadline)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        left = len(self._queue)
        if left:
            # The thread may still be alive (a hung export): make sure it stops here
            # rather than exporting after shutdown() has returned.
            self._queue.clear()
            self._count_drop(f"sink:{self.name}", left)
        try:
            self.sink.shutdown(max(0.0, deadline - time.monotonic()))
        except Exception:
            log.exception("steptrace sink %s failed to shut down", self.name)
            return False
        return flushed and not left
