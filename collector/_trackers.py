"""The collector's trackers (``--trackers``): each run's joined steps in TensorBoard, MLflow or W&B,
written by one writer for the whole job (the aggregate mode of steptrace.trackers).

Per run and tracker one sink in aggregate mode (``steptrace.trackers``: min/median/max across ranks,
skew, the straggler and its cost, the slowest ranks, at each step). They are opened and written on
one thread of their own, never under the collector's lock: opening a W&B run takes seconds, and a
tracker that hangs must not hold the join. What waits for that thread is bounded (``max_queue``
records); beyond, and when a tracker cannot open or write, records are dropped and counted
(``steptrace_collector_tracker_dropped_records_total{tracker, reason}``). A run whose tracker failed
to open is not retried (one warning per run and tracker); at most ``max_runs`` runs hold open
trackers, the least recently written run's are closed first.
"""

from __future__ import annotations

import collections
import logging
import threading
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping

from steptrace._wakeup import Wakeup

log = logging.getLogger("steptrace.collector")

#: Drop reasons of ``steptrace_collector_tracker_dropped_records_total``.
TRACKER_DROP_REASONS = ("queue_full", "open_failed", "write_failed")


def require_trackers(names: Iterable[str]) -> None:
    """Raise ValueError naming the ``pip install`` for a tracker whose package does not import."""
    import importlib

    from steptrace._config import TRACKERS

    for name in names:
        try:
            importlib.import_module({"tensorboard": "tensorboard.summary.writer.event_file_writer",
                                     "mlflow": "mlflow.tracking", "wandb": "wandb"}[name])
        except ImportError as exc:
            raise ValueError(f"trackers: {name} needs the {name!r} package, which does not import here ({exc}); "
                             f"pip install 'steptrace[{TRACKERS[name]}]'") from exc


class ClusterTrackers:
    """Writes the collector's ``cluster_step`` records to the named trackers, per run, off the join."""

    def __init__(self, names: Iterable[str], *, run_dir: str, tensorboard_dir: str | None = None,
                 max_queue: int = 65536, max_runs: int = 64,
                 count_drop: Callable[[str, str, int], None] | None = None,
                 make_sink: Callable[[str], Any] | None = None):
        from steptrace.trackers import tracker_sink

        self.names = tuple(names)
        self.run_dir = run_dir
        self.max_queue = max_queue
        self.max_runs = max_runs
        self._count_drop = count_drop or (lambda tracker, reason, n: None)
        self._make_sink = make_sink or (
            lambda name: tracker_sink(name, aggregate=True, tensorboard_dir=tensorboard_dir))
        self._queue: collections.deque[Mapping[str, Any]] = collections.deque()
        self._wake = Wakeup()
        self._stopping = False
        # run_id -> tracker name -> sink (None: it failed to open; not retried). Touched by the thread only.
        self._open: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._thread = threading.Thread(target=self._run, name="steptrace-collector-trackers", daemon=True)
        self._thread.start()

    def offer(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Hand over joined records (any type; only ``cluster_step`` ones are written). Never blocks."""
        steps = [r for r in records if r.get("type") == "cluster_step"]
        if not steps:
            return
        if self._stopping or len(self._queue) + len(steps) > self.max_queue:
            for name in self.names:
                self._count_drop(name, "queue_full", len(steps))
            return
        self._queue.extend(steps)
        self._wake.set()

    def _run(self) -> None:
        while True:
            if not self._queue:
                if self._stopping:
                    return
                self._wake.wait(0.5)
                continue
            batch: dict[str, list[Mapping[str, Any]]] = {}
            while self._queue and sum(map(len, batch.values())) < 1024:
                record = self._queue.popleft()
                batch.setdefault(str(record.get("run_id")), []).append(record)
            for run_id, records in batch.items():
                self._write(run_id, records)

    def _sinks(self, run_id: str, world_size: Any) -> dict[str, Any]:
        sinks = self._open.get(run_id)
        if sinks is not None:
            self._open.move_to_end(run_id)
            return sinks
        while len(self._open) >= self.max_runs:
            _, old = self._open.popitem(last=False)
            self._close(old)
        sinks = {}
        config = SimpleNamespace(run_id=run_id, rank=0, world_size=world_size if isinstance(world_size, int) else 0,
                                 run_dir=self.run_dir, tensorboard_dir=None)
        for name in self.names:
            try:
                sink = self._make_sink(name)
                sink.bind(config)
                sinks[name] = sink
            except Exception as exc:
                sinks[name] = None
                log.warning("steptrace collector: cannot open the %s tracker for run %r (%s); its steps are "
                            "dropped and counted", name, run_id, exc)
        self._open[run_id] = sinks
        return sinks

    def _write(self, run_id: str, records: list[Mapping[str, Any]]) -> None:
        for name, sink in self._sinks(run_id, records[0].get("world_size")).items():
            if sink is None:
                self._count_drop(name, "open_failed", len(records))
                continue
            try:
                sink.export(records)
            except Exception as exc:
                self._count_drop(name, "write_failed", len(records))
                log.debug("steptrace collector: the %s tracker of run %r failed: %s", name, run_id, exc)

    @staticmethod
    def _close(sinks: dict[str, Any]) -> None:
        for sink in sinks.values():
            if sink is None:
                continue
            try:
                sink.force_flush(5.0)
                sink.shutdown(5.0)
            except Exception as exc:
                log.warning("steptrace collector: a tracker failed to close: %s", exc)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Write what is queued (within ``timeout_s``), then close every tracker. True when nothing was left."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        left = len(self._queue)
        if left:
            self._queue.clear()
            for name in self.names:
                self._count_drop(name, "queue_full", left)
        if not self._thread.is_alive():
            for sinks in self._open.values():
                self._close(sinks)
            self._open.clear()
        return not left and not self._thread.is_alive()
