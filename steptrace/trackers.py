"""Sinks for the experiment trackers users already watch: TensorBoard, MLflow, Weights & Biases.

``steptrace.init(trackers="tensorboard,mlflow")`` (or ``STEPTRACE_TRACKERS``) adds one sink per
tracker; ``steptrace.init(sinks=[TensorBoardSink(log_dir=...)])`` does the same with settings in
code. Each is a sink like every other (``steptrace._sinks``): it consumes the finalized records on a
thread of its own behind a bounded queue, so a tracker that is slow or failing never slows or fails
a step; what it could not take or write is dropped and counted under ``sink:<name>``.

Every rank writes its own numbers (per-rank mode), each at **its own step**: the device-true values
of a step arrive after later steps have begun, so they are written with an explicit step
(TensorBoard's event ``step``, MLflow's ``log_batch`` step with a millisecond timestamp, W&B's
``steptrace/step`` axis set by ``define_metric``), never at the tracker's current one. What is
written, under the namespace ``steptrace/`` (:func:`tracker_points`):

* per step record: ``interval_seconds``, ``compute_seconds`` (own compute: less the time waiting in
  collectives where the rank measures it), ``collective_wait_seconds`` (where measured),
  ``idle/<reason>_seconds``, ``pause/gc_seconds``, ``pause/preempted_seconds``, ``pause/major_faults``
  (pauses=True), ``tokens_per_second``, ``samples_per_second``, ``tflops_per_second``,
  ``mfu``, ``hfu``, ``device_memory_in_use_bytes``, ``device_memory_peak_bytes`` (where known),
  ``before_step_seconds`` (the first step), ``goodput`` (this process's, as docs/goodput.md defines
  it: own compute over the wall from the process start, up to the step), and ``scalars/<name>`` for
  each finite number the user logged with ``s.log(name=...)`` (the step record's ``scalars``);
* per checkpoint: ``checkpoint/blocking_seconds``, ``checkpoint/host_seconds``,
  ``checkpoint/async_seconds``, at the checkpoint's step;
* per stall: ``stall/open_seconds`` when the stall watch saw it, ``stall/lasted_seconds`` when the
  rank moved again, at the stalled step.

The trackers' own rules these sinks follow are in docs/trackers.md, with their sources.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from steptrace._attribution import GoodputTotals, split_step
from steptrace._config import TRACKERS

__all__ = ["MlflowSink", "TRACKERS", "TensorBoardSink", "TrackerPoint", "TrackerUnavailable", "WandbSink",
           "cluster_tracker_points", "tracker_points", "tracker_sink"]

log = logging.getLogger("steptrace")

NAMESPACE = "steptrace/"


class TrackerPoint(NamedTuple):
    """Values to write at one step: ``step`` (the trainer's number), ``wall_time`` (unix seconds: when
    what they measure ended) and ``values`` (full tracker key -> number)."""

    step: int
    wall_time: float
    values: dict[str, float]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _step_number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_REASON = re.compile(r"[^A-Za-z0-9_.-]")


def _key_part(text: str) -> str:
    """A reason or name as one key segment every tracker accepts (MLflow refuses most punctuation)."""
    return _REASON.sub("_", text)[:100] or "_"


class _Points:
    """Maps finalized records to :class:`TrackerPoint`, keeping this process's goodput totals (the
    attempt record starts its wall). One per sink: the totals follow the records it was given."""

    def __init__(self) -> None:
        self._goodput = GoodputTotals()

    def __call__(self, records: Iterable[Mapping[str, Any]]) -> list[TrackerPoint]:
        points = []
        for record in records:
            kind = record.get("type")
            try:
                point = None
                if kind == "step":
                    point = self._step(record)
                elif kind == "checkpoint":
                    point = self._checkpoint(record)
                elif kind in ("stall", "stall_end"):
                    point = self._stall(record)
                elif kind == "attempt":
                    start = _number(record.get("start_time"))
                    if start is not None:
                        self._goodput.started(start)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # a malformed record: nothing to write for it (the JSONL file still has it)
            if point is not None and point.values:
                points.append(point)
        return points

    def _step(self, r: Mapping[str, Any]) -> TrackerPoint | None:
        step = _step_number(r.get("step"))
        interval = _number(r.get("interval_seconds"))
        compute = _number(r.get("compute_seconds"))
        if step is None or interval is None or compute is None:
            return None
        idle = {str(k): v for k, v in (r.get("idle_breakdown") or {}).items() if _number(v) is not None}
        wait = _number(r.get("collective_wait_seconds"))
        measured = wait is not None and _number(r.get("own_seconds")) is not None
        split = split_step(compute, idle, wait if measured else None, _number(r.get("own_compute_seconds")),
                           r.get("collective_wait_idle_breakdown") if "collective_wait_idle_breakdown" in r else None)
        values = {"interval_seconds": interval, "compute_seconds": split.own_compute_seconds}
        if measured:
            values["collective_wait_seconds"] = split.collective_wait_seconds
        for reason, seconds in split.idle_breakdown.items():
            values[f"idle/{_key_part(reason)}_seconds"] = seconds
        pauses = r.get("host_pauses")
        if isinstance(pauses, Mapping):
            # pauses=True (docs/pauses.md): what paused the host, beside idle/gc_seconds (its charged part).
            for field, key in (("gc_seconds", "pause/gc_seconds"), ("preempted_seconds", "pause/preempted_seconds"),
                               ("major_faults", "pause/major_faults")):
                value = _number(pauses.get(field))
                if value is not None:
                    values[key] = value
        for field in ("tokens_per_second", "samples_per_second", "tflops_per_second", "mfu", "hfu",
                      "before_step_seconds"):
            value = _number(r.get(field))
            if value is not None:
                values[field] = value
        scalars = r.get("scalars")
        if isinstance(scalars, Mapping):
            # What the user logged with s.log(loss=...): its finite numbers, at the step's own step.
            for name, value in scalars.items():
                number = _number(value)
                if number is not None:
                    values[f"scalars/{_key_part(str(name))}"] = number
        memory = r.get("device_memory")
        if isinstance(memory, Mapping):
            for field in ("in_use_bytes", "peak_bytes"):
                value = _number(memory.get(field))
                if value is not None:
                    values[f"device_memory_{field}"] = value
        host_start = _number(r.get("host_start_time"))
        before = _number(r.get("before_step_seconds")) or 0.0
        self._goodput.step(split.own_compute_seconds, None if host_start is None else host_start - before)
        end = _number(r.get("end_time"))
        if end is not None:
            self._goodput.ended(end)
        goodput = self._goodput.ratio()
        if goodput is not None:
            values["goodput"] = goodput
        return TrackerPoint(step, end if end is not None else time.time(), values)

    def _checkpoint(self, r: Mapping[str, Any]) -> TrackerPoint | None:
        step = _step_number(r.get("step"))
        if step is None:
            step = _step_number(r.get("after_step"))
        if step is None:
            return None
        values = {}
        for field in ("blocking_seconds", "host_seconds", "async_seconds"):
            value = _number(r.get(field))
            if value is not None:
                values[f"checkpoint/{field}"] = value
        end = _number(r.get("end_time"))
        if end is not None:
            self._goodput.ended(end)
        return TrackerPoint(step, end if end is not None else time.time(), values)

    @staticmethod
    def _stall(r: Mapping[str, Any]) -> TrackerPoint | None:
        step = _step_number(r.get("step"))
        start = _number(r.get("start_time"))
        if step is None or start is None:
            return None
        field = "open_seconds" if r.get("type") == "stall" else "lasted_seconds"
        seconds = _number(r.get(field))
        if seconds is None:
            return None
        return TrackerPoint(step, start + seconds, {f"stall/{field}": seconds})


def tracker_points(records: Iterable[Mapping[str, Any]]) -> list[TrackerPoint]:
    """What a tracker sink writes for these records, keys without the namespace (see the module
    docstring); the goodput over the records given, in order."""
    return _Points()(records)


#: Slowest ranks of a joined step written by the aggregate mode (``slowest/<i>_rank``, ``slowest/<i>_own_seconds``).
SLOWEST_RANKS = 3


class _ClusterPoints:
    """Maps the collector's ``cluster_step`` records (a step joined across ranks) to points under
    ``cluster/``: what one writer shows for the whole job (aggregate mode)."""

    def __call__(self, records: Iterable[Mapping[str, Any]]) -> list[TrackerPoint]:
        points = []
        for record in records:
            if record.get("type") != "cluster_step":
                continue
            try:
                point = self._step(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if point is not None and point.values:
                points.append(point)
        return points

    @staticmethod
    def _step(r: Mapping[str, Any]) -> TrackerPoint | None:
        step = _step_number(r.get("step"))
        if step is None:
            return None
        values: dict[str, float] = {}
        for quantity in ("interval", "compute", "own", "collective_wait"):
            for stat in ("min", "median", "max"):
                value = _number(r.get(f"{quantity}_{stat}_seconds"))
                if value is not None:
                    values[f"cluster/{quantity}_seconds/{stat}"] = value
        for field in ("skew_seconds", "ranks_reporting", "missing_rank_count"):
            value = _number(r.get(field))
            if value is not None:
                values[f"cluster/{field}"] = value
        own_sum, interval_sum = _number(r.get("own_compute_sum_seconds")), _number(r.get("interval_sum_seconds"))
        if own_sum is None:
            own_sum = _number(r.get("compute_sum_seconds"))
        if own_sum is not None and interval_sum:
            # Not goodput (own compute over the wall from the process start): the joined step's share.
            values["cluster/compute_share"] = min(1.0, max(0.0, own_sum / interval_sum))
        rank = r.get("straggler_rank")
        if isinstance(rank, int) and not isinstance(rank, bool) and r.get("complete") is True:
            values["cluster/straggler_rank"] = float(rank)
            for field in ("straggler_cost_seconds", "straggler_excess_seconds", "straggler_threshold_seconds"):
                value = _number(r.get(field))
                if value is not None:
                    values[f"cluster/{field}"] = value
        if r.get("complete") is True:
            values["cluster/straggler_steps"] = 1.0 if "cluster/straggler_rank" in values else 0.0
        slowest = r.get("slowest_ranks")
        if isinstance(slowest, list):
            for place, entry in enumerate(slowest[:SLOWEST_RANKS], start=1):
                if isinstance(entry, (list, tuple)) and len(entry) == 2 and _number(entry[1]) is not None \
                        and _step_number(entry[0]) is not None:
                    values[f"cluster/slowest/{place}_rank"] = float(entry[0])
                    values[f"cluster/slowest/{place}_own_seconds"] = float(entry[1])
        wall = _number(r.get("end_time")) or _number(r.get("joined_time")) or time.time()
        return TrackerPoint(step, wall, values)


def cluster_tracker_points(records: Iterable[Mapping[str, Any]]) -> list[TrackerPoint]:
    """What a tracker sink in aggregate mode writes for the collector's ``cluster_step`` records."""
    return _ClusterPoints()(records)


def _missing(tracker: str, module: str, exc: ImportError) -> ValueError:
    return ValueError(f"trackers: {tracker} needs the {module!r} package, which does not import here ({exc}); "
                      f"pip install 'steptrace[{TRACKERS[tracker]}]'")


class TrackerUnavailable(RuntimeError):
    """A tracker that could not open its store at ``init()``: its records are dropped and counted. Said
    once, in one line, when it failed to open (``said``: the sink worker does not repeat it)."""

    said = True


#: The fix an MLflow store that does not open is told, in one line.
MLFLOW_FIX = ("set MLFLOW_TRACKING_URI to your tracking server (http://host:5000), or use the default local "
              "store sqlite:///mlflow.db, which with mlflow-skinny needs sqlalchemy and alembic: "
              "pip install 'steptrace[mlflow]'")


class _TrackerSink:
    """What the three sinks share: the record-to-point mapping, the key namespace, the rank."""

    name = "tracker"

    def __init__(self, *, rank_in_key: bool | None = None, aggregate: bool = False):
        #: Aggregate mode: the sink takes the collector's ``cluster_step`` records (one writer for the
        #: job) instead of a rank's own.
        self.aggregate = aggregate
        self._points: Any = _ClusterPoints() if aggregate else _Points()
        self._rank_in_key = rank_in_key
        self._prefix = NAMESPACE
        self.rank = 0
        self.world_size = 1
        self.run_id = ""
        self.step_offset = 0
        self._bound = False

    def bind(self, config: Any) -> None:
        """Called by ``steptrace.init()`` with the run's configuration, before the first record: opens
        the tracker (errors raise here, at setup, never in the loop)."""
        self.rank, self.world_size, self.run_id = config.rank, config.world_size, config.run_id
        self.step_offset = int(getattr(config, "tracker_step_offset", 0) or 0)
        self._open(config)
        self._bound = True

    def _open(self, config: Any) -> None:
        raise NotImplementedError

    def _keys(self, shared_run: bool) -> None:
        """Ranks sharing one tracker run write under ``steptrace/rank_<r>/``; a rank's own run needs no
        rank in its keys (the run says it), so one key compares across the ranks' runs."""
        in_key = not self.aggregate and (self._rank_in_key if self._rank_in_key is not None
                                         else (shared_run and self.world_size > 1))
        self._prefix = f"{NAMESPACE}rank_{self.rank}/" if in_key else NAMESPACE

    #: Why the tracker could not be opened at ``init()`` (its store unusable, its server unreachable), or
    #: None. The training job goes on: every record given to the sink is then dropped and counted.
    unavailable: str | None = None

    def export(self, records: Sequence[Mapping[str, Any]]) -> None:
        if not self._bound:
            raise RuntimeError(f"steptrace {self.name} sink used before steptrace.init() bound it")
        if self.unavailable is not None:
            raise TrackerUnavailable(self.unavailable)
        points = self._points(records)
        if self.step_offset:
            points = [point._replace(step=point.step + self.step_offset) for point in points]
        if points:
            self._write(points)

    def _write(self, points: list[TrackerPoint]) -> None:
        raise NotImplementedError


class TensorBoardSink(_TrackerSink):
    """Writes each rank's points as scalars into an event file of its own:
    ``<log_dir>/rank_<r>/events.out.tfevents.*``, written with TensorBoard's own ``EventFileWriter``.

    ``log_dir`` (``STEPTRACE_TENSORBOARD_DIR``): default ``<run_dir>/<run_id>/tensorboard``. Point it
    at ``<your logdir>/steptrace`` and ``tensorboard --logdir <your logdir>`` shows steptrace's runs
    (``steptrace/rank_0``, ...) beside yours. Never the directory a writer of yours uses: TensorBoard
    follows only the newest event file of a directory (tensorflow/tensorboard#1011), so two writers
    in one directory hide each other's points; each rank has its own directory for that reason.
    Values are TensorBoard scalars (``simple_value``, 32-bit floats, as every TensorBoard writer
    stores them)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, flush_secs: float = 10.0,
                 aggregate: bool = False):
        super().__init__(rank_in_key=False, aggregate=aggregate)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.flush_secs = flush_secs
        self.rank_dir: str | None = None
        self._writer: Any = None

    def _open(self, config: Any) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise _missing("tensorboard", "tensorboard", exc) from exc
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        base = self.log_dir or getattr(config, "tensorboard_dir", None)
        if base is None:
            base = os.path.join(config.run_dir, config.run_id, "tensorboard")
        elif self.aggregate:
            base = os.path.join(base, config.run_id)  # one collector, many runs: a directory each
        self.rank_dir = os.path.join(base, "cluster" if self.aggregate else f"rank_{config.rank}")
        try:
            os.makedirs(self.rank_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"tensorboard_dir: cannot write {self.rank_dir}: {exc.strerror or exc}") from exc
        self._writer = EventFileWriter(self.rank_dir, max_queue_size=1000, flush_secs=self.flush_secs,
                                       filename_suffix=".steptrace-cluster" if self.aggregate
                                       else f".steptrace-rank{config.rank}")
        self._keys(shared_run=False)

    def _write(self, points: list[TrackerPoint]) -> None:
        Event, Summary = self._event_pb2.Event, self._summary_pb2.Summary
        for point in points:
            summary = Summary(value=[Summary.Value(tag=self._prefix + key, simple_value=value)
                                     for key, value in point.values.items()])
            self._writer.add_event(Event(wall_time=point.wall_time, step=point.step, summary=summary))

    def force_flush(self, timeout_s: float) -> bool:
        if self._writer is not None:
            self._writer.flush()
        return True

    def shutdown(self, timeout_s: float) -> None:
        if self._writer is not None:
            self._writer.close()


class MlflowSink(_TrackerSink):
    """Logs each rank's points to an MLflow run with explicit steps and millisecond timestamps
    (``MlflowClient.log_batch``: thread-safe, no fluent active-run state touched).

    Which run: ``run_id`` (or MLflow's own ``MLFLOW_RUN_ID``), shared by the ranks that name it, whose
    keys then carry the rank (``steptrace/rank_<r>/interval_seconds``) when there are several; else
    the run active in this process when ``init()`` ran (yours: steptrace's keys sit beside your
    metrics); else a run of the rank's own, named ``<run_id>/rank-<r>`` with the tags
    ``steptrace.run_id``, ``steptrace.rank``, ``steptrace.world_size``, in MLflow's current
    experiment (``MLFLOW_EXPERIMENT_NAME``), ended at shutdown. ``tracking_uri``: MLflow's own default
    (``MLFLOW_TRACKING_URI``) unless given."""

    name = "mlflow"
    #: MLflow's limit on metrics per ``log_batch`` request.
    MAX_BATCH = 1000
    #: Records wait up to this long to share a ``log_batch`` request (the sink worker gathers them): a
    #: request a step cost ~1.5 ms of CPU per step on a local file store (bench/bench_trackers.py).
    batch_delay_s = 1.0

    def __init__(self, *, tracking_uri: str | None = None, run_id: str | None = None,
                 rank_in_key: bool | None = None, aggregate: bool = False):
        super().__init__(rank_in_key=rank_in_key, aggregate=aggregate)
        self.tracking_uri = tracking_uri
        self.mlflow_run_id = run_id
        self._client: Any = None
        self._owns_run = False

    #: How long ``init()`` waits for a tracking *server* (an http(s) or databricks URI) to open the run.
    #: MLflow retries a request to a server that does not answer for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES
    #: 7, backoff factor 2, 120 s a request: mlflow/utils/rest_utils.py); past this the job starts without
    #: the tracker, whose records are dropped and counted until the run opens (if it ever does), and then
    #: written. A local store (the default sqlite:///mlflow.db) is waited for: creating its tables the
    #: first time took 16-36 s on a loaded 2-core VM, and it ends.
    open_timeout_s = 15.0

    def _open(self, config: Any) -> None:
        try:
            import mlflow
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", "mlflow", exc) from exc
        self._metric = Metric
        raised: list[BaseException] = []
        # MLflow keeps the active run per thread: the user's is looked up here, on init()'s thread.
        active = None if self.aggregate else mlflow.active_run()
        active_run_id = active.info.run_id if active is not None and (
            self.tracking_uri is None or self.tracking_uri == mlflow.get_tracking_uri()) else None

        def open_store() -> None:
            try:
                self._open_store(config, mlflow, MlflowClient, active_run_id)
            except BaseException as exc:  # a setting to fix: raised by init() if it is still waiting
                raised.append(exc)
                if opening.is_set():
                    log.error("steptrace trackers: mlflow, opened late: %s", exc)

        opening = threading.Event()  # set once init() stopped waiting
        opener = threading.Thread(target=open_store, name="steptrace-mlflow-open", daemon=True)
        opener.start()
        uri = str(self.tracking_uri or mlflow.get_tracking_uri())
        remote = uri.startswith(("http://", "https://", "databricks"))
        opener.join(self.open_timeout_s if remote else None)
        if opener.is_alive():
            self.unavailable = (f"trackers: mlflow did not open its run at {uri} within {self.open_timeout_s:g} s "
                                "(a tracking server that does not answer); its records are dropped and counted "
                                "until it does")
            opening.set()
            log.error("steptrace %s. Training goes on (sink:mlflow)", self.unavailable)
            return
        if raised:
            raise raised[0]

    def _open_store(self, config: Any, mlflow: Any, MlflowClient: Any,  # noqa: N803 (a class)
                    active_run_id: str | None) -> None:
        """Open (or find) the run; on the opener thread. A late success clears ``unavailable`` last, so
        the sink worker sees a run id and keys before it writes."""
        run_id = self.mlflow_run_id or os.environ.get("MLFLOW_RUN_ID") or None
        shared = run_id is not None
        try:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            if run_id is None:
                run_id = active_run_id
            if run_id is None:
                experiment = mlflow.tracking.fluent._get_experiment_id()
                who = {"steptrace.role": "cluster"} if self.aggregate else {"steptrace.rank": str(config.rank)}
                run = self._client.create_run(
                    experiment, run_name=f"{config.run_id}/{'cluster' if self.aggregate else f'rank-{config.rank}'}",
                    tags={"steptrace.run_id": config.run_id, "steptrace.world_size": str(config.world_size), **who})
                run_id = run.info.run_id
                self._owns_run = True
            else:
                self._client.get_run(run_id)  # a run that does not exist fails here, at init()
        except Exception as exc:
            if isinstance(exc, ValueError):
                raise
            named = shared and getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"
            if self.aggregate or named:
                # A run you named that does not exist is a setting to fix, said at init(); the collector
                # counts a tracker that did not open (open_failed) itself.
                raise ValueError(f"trackers: mlflow cannot open its run ({type(exc).__name__}: {exc})") from exc
            # The store itself did not open (MLflow 3's default sqlite store without sqlalchemy, a server
            # gone): the training job goes on without this tracker, told once, in one line, how to fix it.
            uri = getattr(self._client, "tracking_uri", None) or self.tracking_uri or mlflow.get_tracking_uri()
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            self.unavailable = (f"trackers: mlflow cannot open its store {uri} ({type(exc).__name__}: {first_line}); "
                                f"{MLFLOW_FIX}")
            log.error("steptrace %s. Training goes on; its records are dropped and counted (sink:mlflow)",
                      self.unavailable)
            return
        self.mlflow_run_id = run_id
        self._keys(shared_run=shared)
        if self.unavailable is not None:  # init() stopped waiting: from now on the records are written
            log.warning("steptrace trackers: mlflow opened its run %s late; the records before it were dropped "
                        "and counted (sink:mlflow)", run_id)
            self.unavailable = None

    def _write(self, points: list[TrackerPoint]) -> None:
        Metric = self._metric
        metrics = [Metric(self._prefix + key, value, int(point.wall_time * 1000), point.step)
                   for point in points for key, value in point.values.items()]
        for start in range(0, len(metrics), self.MAX_BATCH):
            self._client.log_batch(self.mlflow_run_id, metrics=metrics[start:start + self.MAX_BATCH],
                                   synchronous=True)

    def force_flush(self, timeout_s: float) -> bool:
        return True  # every log_batch above is synchronous

    def shutdown(self, timeout_s: float) -> None:
        if self._owns_run and self._client is not None:
            self._client.set_terminated(self.mlflow_run_id)


class WandbSink(_TrackerSink):
    """Logs each rank's points to a W&B run of the rank's own, on the axis ``steptrace/step``
    (``define_metric("steptrace/*", step_metric="steptrace/step")``), so a value that arrives after
    later steps is drawn at its own step: W&B's own ``step`` must only increase, and a write to a
    lower one is dropped ("Tried to log to step 0 that is less than the current step 3").

    The run: ``wandb.init(group=<run_id>, name="rank-<r>", job_type="steptrace",
    reinit="create_new")`` in the project (and entity) of the run already open in this process, if
    any, else ``project`` (W&B's own ``WANDB_PROJECT`` applies). Not written into your run: W&B
    commits a history row per ``log`` call, so a second thread logging into it would commit a row
    you are building with ``commit=False``. The group puts each rank's run beside the others (W&B
    draws a group's runs of one key as one chart). ``mode``: W&B's (``WANDB_MODE``: ``online``,
    ``offline``); ``dir``: where the run's files go."""

    name = "wandb"
    #: W&B's run holds what log() was given until finish(): a force_flush confirms nothing written, so a
    #: finish() that outlives the shutdown timeout leaves every record counted as dropped (steptrace._sinks).
    flush_confirms = False

    def __init__(self, *, project: str | None = None, entity: str | None = None, mode: str | None = None,
                 dir: str | os.PathLike[str] | None = None, group: str | None = None, aggregate: bool = False):
        super().__init__(rank_in_key=False, aggregate=aggregate)
        if mode not in (None, "online", "offline", "disabled", "shared"):
            raise ValueError(f"WandbSink mode must be 'online', 'offline', 'disabled' or 'shared' (W&B's modes), "
                             f"got {mode!r}")
        self.project, self.entity, self.group = project, entity, group
        self.mode: Any = mode
        self.dir = None if dir is None else os.fspath(dir)
        self.run: Any = None

    def _open(self, config: Any) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb", exc) from exc
        users = wandb.run
        project = self.project or (users.project if users is not None else None)
        entity = self.entity or (users.entity if users is not None else None)
        group = self.group or (users.group if users is not None and users.group else None) or config.run_id
        # Read here, not left to wandb: its settings are read once per process, at its first init.
        directory = self.dir or os.environ.get("WANDB_DIR") or None
        if directory is None and self.aggregate:
            directory = os.path.join(config.run_dir, config.run_id)  # the collector's: beside cluster.jsonl
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"trackers: wandb cannot write {directory}: {exc.strerror or exc}") from exc
        try:
            name = "cluster" if self.aggregate else f"rank-{config.rank}"
            self.run = wandb.init(project=project, entity=entity, group=group, name=name,
                                  job_type="steptrace", mode=self.mode, dir=directory, reinit="create_new",
                                  config={"steptrace.run_id": config.run_id, "steptrace.rank": config.rank,
                                          "steptrace.world_size": config.world_size})
            self.run.define_metric(f"{NAMESPACE}step")
            self.run.define_metric(f"{NAMESPACE}*", step_metric=f"{NAMESPACE}step")
        except Exception as exc:
            raise ValueError(f"trackers: wandb cannot start its run ({type(exc).__name__}: {exc})") from exc
        self._keys(shared_run=False)

    def _write(self, points: list[TrackerPoint]) -> None:
        for point in points:
            row = {self._prefix + key: value for key, value in point.values.items()}
            row[f"{NAMESPACE}step"] = point.step
            self.run.log(row)

    def force_flush(self, timeout_s: float) -> bool:
        return True  # W&B's service holds what log() was given and writes it at finish()

    def shutdown(self, timeout_s: float) -> None:
        if self.run is not None:
            self.run.finish()


def tracker_sink(name: str, *, aggregate: bool = False, tensorboard_dir: str | None = None) -> _TrackerSink:
    """The sink ``init(trackers=...)`` (or the collector's ``--trackers``, ``aggregate``) builds for one
    tracker name; ``bind`` opens it."""
    if name == "tensorboard":
        return TensorBoardSink(tensorboard_dir, aggregate=aggregate)
    if name == "mlflow":
        return MlflowSink(aggregate=aggregate)
    if name == "wandb":
        return WandbSink(aggregate=aggregate)
    raise ValueError(f"trackers: unknown tracker {name!r}; known: {', '.join(TRACKERS)}")
