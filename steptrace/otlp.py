"""OpenTelemetry (OTLP) export: one distributed trace per training step, and the step metrics.

``steptrace.init(otlp_endpoint="http://collector:4318")`` (or
``OTEL_EXPORTER_OTLP_ENDPOINT``) adds an :class:`OtlpSink`. This is the only
module that imports ``opentelemetry``; ``steptrace`` imports it lazily.

Traces
------
Spans are built directly from the finalized records and handed to the OTLP
span exporter; no ``TracerProvider``/``BatchSpanProcessor`` is involved (its
``shutdown`` blocks for 30 s and its ``force_flush`` ignores its timeout, and
the :class:`~steptrace._sinks.SinkWorker` already gives this sink a thread and
a bounded queue). Per rank and step ``n``::

    train.step          [end(n-1), end(n)]   the whole interval, compute + idle
    ├── train.idle      one per idle segment [reason, start, end]   (train.idle.reason)
    ├── <span name>     user spans: step n's spans, and spans closed between steps n-1 and n
    ├── train.microbatch  device-aligned start..end of each microbatch record of step n
    ├── train.compute   [start(n), end(n)]   the device busy with step n
    └── train.checkpoint  host span of a save of step n (arrives after the step)

* **Trace id** = :func:`steptrace._ids.trace_id` ``(run_id, step)``: the first 16
  bytes of ``sha256(f"steptrace/{run_id}/{step}")``. Every rank's spans of one
  step form one trace with no coordination (each rank's ``train.step`` is a
  root of that trace).
* **Span ids** = :func:`steptrace._ids.span_id` ``(run_id, step, rank, role)``
  with roles ``step``, ``compute``, ``idle/<i>`` (i-th idle segment),
  ``microbatch/<k>`` (k-th microbatch record of the step on this rank),
  ``span/<k>`` (k-th user span attached to the step) and
  ``checkpoint/<start_us>`` (the save's start in integer microseconds).
  Re-exporting the same records gives the same ids, so retries do not
  duplicate spans and a collector can join ranks.
* **User spans** keep the name given to ``steptrace.span()``. A span that closed
  inside step ``n`` (``step: n``) is a child of step ``n``'s span. A span that
  closed between steps (``step: null``, e.g. ``data`` loading before ``with
  step(n)``) is a child of the *next* step's span: the idle time it covers is
  charged to that step (DESIGN.md §2), and its record is emitted together with
  that step's. Spans with no following step (closed after the last step,
  handed over by ``flush``/``shutdown``) are exported at ``force_flush``/
  ``shutdown`` as root spans of a trace of their own, with trace id
  ``sha256(f"steptrace/{run_id}/span/{rank}/{name}/{start_us}")[:16]`` and span
  id ``[:8]`` of ``sha256(f"steptrace/{run_id}/span/{rank}/{name}/{start_us}/span")``.
  User spans are flat: nesting between them is not reconstructed.
* **Times**: span times are the records' unix-second times in integer
  nanoseconds, ``round(t * 1e9)``. The step span starts at
  ``end_time - interval_seconds``.
* **Status**: ``ERROR`` with the error text for failed steps and checkpoints,
  otherwise ``UNSET``. Kind ``INTERNAL``; scope ``steptrace`` and its version.
* **Attributes** (``None`` values are left out): every span has ``train.run_id``,
  ``train.rank``, ``train.step``. ``train.step`` adds ``train.world_size``,
  ``train.status``, ``train.error``, ``train.backend``, ``train.interval_seconds``,
  ``train.compute_seconds``, ``train.idle_seconds``, ``train.idle.<reason>_seconds``,
  ``train.tokens``, ``train.samples``, ``train.flops``, ``train.model_flops``,
  ``train.hardware_flops``, ``train.flops_source``, ``train.peak_flops``, ``train.tokens_per_second``,
  ``train.samples_per_second``, ``train.tflops_per_second``, ``train.mfu``, ``train.hfu``,
  ``train.collective_wait_seconds``, ``train.own_seconds``, ``train.own_compute_seconds``,
  ``train.collective_wait_idle.<reason>_seconds``, ``train.collective_wait_source``
  (where the run measures its wait in collectives; the collector names the straggler from them and
  sums the ranks' own compute), ``train.exposed_communication_seconds`` and
  ``train.collectives_dropped`` (NCCL collectives timed on the device) and, for a step with at most
  64 of them, ``train.collectives.group``, ``.seq`` and ``.device_seconds`` (arrays of one length;
  -1 where not measured) for the collector's cross-rank join,
  on an attempt's first step ``train.before_step_seconds``, ``train.before_step.<reason>_seconds``
  and ``train.process_start_time`` (unix seconds: goodput's wall starts there),
  ``train.pipeline.bubble_ratio.<stage>``, ``train.attrs.<key>`` (user
  attributes), ``train.health.<field>`` and ``train.health.<field>.<key>`` (the GPU's health
  window, health="nvml": docs/health.md; null fields left out), ``train.host_pauses.<field>`` (pauses=True:
  docs/pauses.md; ``gc_collections`` as ``.0``/``.1``/``.2``; null fields left out).
  ``train.compute``: ``train.compute_seconds``. ``train.idle``:
  ``train.idle.reason``, ``train.idle_seconds``. ``train.microbatch``:
  ``train.microbatch``, ``train.stage``, ``train.chunk``, ``train.kind``,
  ``train.compute_seconds``. ``train.checkpoint``: ``train.status``,
  ``train.error``, ``train.checkpoint.after_step``, ``train.checkpoint.host_seconds``,
  ``train.checkpoint.blocking_seconds``, ``train.checkpoint.async_seconds``.
  User spans: ``train.span_seconds``, ``train.attrs.<key>``.
* **Resource**: everything in ``OTEL_RESOURCE_ATTRIBUTES``, ``service.name`` =
  ``service_name`` (code, else ``OTEL_SERVICE_NAME``), else ``service.name`` from
  ``OTEL_RESOURCE_ATTRIBUTES``, else ``steptrace``; ``service.instance.id`` =
  ``<run_id>/rank-<rank>`` always (all ranks share the environment, so a value
  from ``OTEL_RESOURCE_ATTRIBUTES`` would make them indistinguishable).
  With nemo-lens's export on (``MEGATRON_OTEL_ENABLED``/``NEMO_LENS_ENABLED``: Megatron-LM's own
  OpenTelemetry), its identity instead (:func:`nemo_lens_resource`): ``nemo.run.id``,
  ``service.instance.id`` = ``<nemo.run.id>-rank<rank>``, ``dl.rank``, ``dl.world_size``, its
  ``service.name``; one resource per rank for both exporters.

Metrics
-------
Through the OpenTelemetry metrics SDK: a ``MeterProvider`` of this sink's own
(never the global one) whose ``PeriodicExportingMetricReader`` is collected every
``otlp_metrics_interval_s`` by a steptrace thread rather than the reader's own
(which an at-fork hook restarts in forked children such as DataLoader workers;
they would export frozen copies of the parent's metrics under its identity).
Every point carries ``train.run_id`` and ``train.rank``. Histograms with explicit bucket boundaries in seconds:
``steptrace.step.interval``, ``steptrace.step.compute``,
``steptrace.checkpoint.blocking``. Counters: ``steptrace.microbatch.compute`` (seconds) and
``steptrace.microbatches`` (``train.stage``, ``train.kind``), ``steptrace.steps``
(``train.status``), ``steptrace.step.idle`` (seconds, ``train.idle.reason``), ``steptrace.host_pause``
(seconds, ``train.pause.cause``: ``gc``, ``preempted``; pauses=True, docs/pauses.md),
``steptrace.tokens``, ``steptrace.step.collective_wait`` and ``steptrace.step.own`` (seconds,
where the wait in collectives is measured), ``steptrace.productive`` and ``steptrace.wall`` (seconds:
own compute of the steps; process start to the latest record), ``steptrace.dropped_records``
(``train.drop.reason``, observed from the run's drop counters). Gauges (last step):
``steptrace.tokens_per_second``, ``steptrace.tflops_per_second``,
``steptrace.mfu`` and ``steptrace.hfu`` with their parts (``steptrace.model_flops``,
``steptrace.hardware_flops``, ``steptrace.peak_flops``), ``steptrace.goodput_ratio`` (goodput:
productive / wall, since the process start), ``steptrace.pipeline.bubble_ratio``
(``train.stage``). The step idle counter holds host idle less the wait in collectives that fell in
it, so own compute + wait + idle add up to the intervals.

Configuration
-------------
Every setting is passed to the SDK exporters explicitly, so code wins over the
environment (``_config`` already merged ``OTEL_EXPORTER_OTLP_*`` into the
``Config``). For http/protobuf the endpoint is a base URL: ``/v1/traces`` and
``/v1/metrics`` are appended (a URL already ending in one of them is accepted
too). For grpc, ``http://host:4317`` (plaintext) or ``https://host:4317`` (TLS).
One quirk of the SDK exporters: they also send the ``OTEL_EXPORTER_OTLP_HEADERS``
keys that code did not set (HTTP), or all of them when code set none (gRPC).

Failure
-------
``export()`` runs on the sink's own thread; the SDK exporter retries with
backoff for at most ``otlp_timeout_s``. When it reports failure, ``export()``
raises :class:`OtlpExportError`, so the SinkWorker counts the batch's records
as dropped under ``sink:otlp`` (``stats()["dropped"]``, the ``run`` record).
A record that cannot be turned into spans costs that record alone
(``invalid:otlp``); attrs holding nested or self-containing lists are exported
as their text.
While the endpoint hangs, records pile up in the SinkWorker's bounded queue and
are dropped and counted there; the training loop never waits.
``force_flush(timeout_s)`` and ``shutdown(timeout_s)`` return within their
timeout: the work runs on daemon threads joined with the time left, and
``shutdown`` shuts the exporters down, which aborts their retries. Spans
closed after the last step whose export fails at ``force_flush``/``shutdown``
are logged, not counted (the sink protocol gives those calls no drop counter).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import urlsplit

try:
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"steptrace's OTLP exporter needs opentelemetry-sdk and opentelemetry-exporter-otlp ({exc}): "
        "pip install 'steptrace[otlp]'"
    ) from exc

from steptrace._version import __version__
from steptrace._attribution import GoodputTotals, split_step
from steptrace._ratelimit import limit_otel_exporter_logs
from steptrace._buckets import CHECKPOINT_BUCKETS_S, STEP_BUCKETS_S
from steptrace._config import MAX_OTLP_BATCH_DELAY_S, OTLP_COMPRESSIONS, OTLP_PROTOCOLS, microbatch_span_every
from steptrace._schema import (
    ATTR_ATTEMPT,
    ATTR_BEFORE_STEP_PREFIX,
    ATTR_BUBBLE_PREFIX,
    ATTR_COLLECTIVE_WAIT_IDLE_PREFIX,
    ATTR_COLLECTIVES_DEVICE_SECONDS,
    ATTR_COLLECTIVES_GROUP,
    ATTR_COLLECTIVES_SEQ,
    ATTR_COMPUTE_SECONDS,
    ATTR_HEALTH_PREFIX,
    ATTR_HOST_PAUSES_PREFIX,
    ATTR_PROCESS_START_TIME,
    ATTR_RANK,
    ATTR_RUN_ID,
    ATTR_STEP,
    ATTR_WORLD_SIZE,
    OTLP_MAX_COLLECTIVES,
    SPAN_STEP,
    step_field_attribute,
)
from steptrace._ids import orphan_span_ids, span_id, trace_id

__all__ = [
    "OtlpExportError",
    "OtlpSink",
    "signal_endpoints",
]

log = logging.getLogger("steptrace")

_DEFAULT_SERVICE_NAME = "steptrace"
#: The most bytes of an OTLP/HTTP answer read: an ExportServiceResponse is a few hundred bytes;
#: an endpoint answering gigabytes must not fill the training process's memory.
MAX_RESPONSE_BYTES = 64 << 10
#: Distinct refusal reasons kept per sink (a receiver's error text is not trusted to be few).
_MAX_REJECT_REASONS = 16
_REASON = re.compile(r"(\d+) ([a-z][a-z0-9_]{0,39})\b")
_INT64 = (-(2**63), 2**63 - 1)


#: The record types the sink turns into spans or metrics; the others (metadata, attempt, run) it skips.
_EXPORTED_TYPES = frozenset(("step", "span", "microbatch", "checkpoint", "stall", "stall_end", "capture"))


class OtlpExportError(RuntimeError):
    """The OTLP endpoint did not accept a batch; the SinkWorker counts its records as dropped.

    ``dropped_records``, when set, is how many of the batch's records that lost (those OTLP
    carries something of, less the ones already counted as invalid).
    """

    dropped_records: int | None = None


def signal_endpoints(endpoint: str, protocol: str = "http/protobuf") -> tuple[str, str]:
    """The (traces, metrics) endpoints for ``endpoint``.

    For http/protobuf, ``endpoint`` is the base URL (as ``OTEL_EXPORTER_OTLP_ENDPOINT``)
    and ``/v1/traces``, ``/v1/metrics`` are appended; a URL that already ends in one
    of them is taken as that collector's signal URL and the other is derived. For
    grpc, the path is dropped: the exporter wants ``scheme://host:port``.
    """
    if protocol == "grpc":
        parts = urlsplit(endpoint)
        url = f"{parts.scheme}://{parts.netloc}"
        return url, url
    base = endpoint.rstrip("/")
    for suffix in ("/v1/traces", "/v1/metrics"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base + "/v1/traces", base + "/v1/metrics"


def _ns(unix_seconds: float) -> int:
    # A float unix time resolves ~0.24 us; this keeps all of it.
    return round(unix_seconds * 1e9)


def _attr(value: Any) -> Any:
    """An OpenTelemetry attribute value for ``value`` (None stays None: the caller skips it)."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        # OTLP integers are int64; FLOP counts of large models do not fit.
        return value if _INT64[0] <= value <= _INT64[1] else float(value)
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (list, tuple)):
        try:
            return _attr(item())
        except Exception:
            return str(value)
    if isinstance(value, (list, tuple)):
        # One level only: OTLP arrays hold one scalar type. A list of lists, mixed types, or a
        # list that contains itself becomes its text (repr marks the cycle; no recursion).
        if all(isinstance(v, (bool, str, int, float)) for v in value):
            values = [_attr(v) for v in value]
            if len({type(v) for v in values}) == 1:
                return tuple(values)
        return str(value) if isinstance(value, list) else str(list(value))
    return str(value)


def _put(attributes: dict[str, Any], key: str, value: Any) -> None:
    value = _attr(value)
    if value is not None:
        attributes[key] = value


def _own_trace_ids(run_id: str, rank: int, name: str, start: float) -> tuple[int, int]:
    """Trace and span id of a span with no step after it: a trace of its own."""
    return orphan_span_ids(run_id, rank, name, round(start * 1e6))


def _run_bounded(fn: Callable[[], Any], deadline: float, name: str) -> bool:
    """Run ``fn`` on a daemon thread and wait for it until ``deadline`` (monotonic).

    True when ``fn`` finished in time and returned a truthy value (None counts as success).
    The SDK's calls do not all honour their timeouts; this bounds the caller either way.
    A failure is one warning line, never a traceback: an endpoint that is down is the usual cause
    (the traceback is at debug level). A failure after the caller stopped waiting is at debug level
    only: the caller has already said that it timed out and has returned (from ``shutdown``, say),
    and a traceback printed after that, from a thread of a library that has shut down, misleads.
    (Formatting a traceback off the main thread also races CPython 3.11's shared AST recursion
    counter, python/cpython#106905, which crashed pytest sessions in CI.)
    """
    outcome: list[bool] = []
    abandoned = threading.Event()

    def target() -> None:
        try:
            result = fn()
            outcome.append(result is None or bool(result))
        except Exception as exc:
            outcome.append(False)
            if abandoned.is_set():
                log.debug("steptrace OTLP %s failed after its caller stopped waiting: %r", name, exc)
            else:
                log.warning("steptrace OTLP %s failed: %r", name, exc)
                log.debug("steptrace OTLP %s failure", name, exc_info=True)

    thread = threading.Thread(target=target, name=f"steptrace-otlp-{name}", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        abandoned.set()
    return bool(outcome) and outcome[0]


class _Metrics:
    """The step metrics as OpenTelemetry instruments, fed from finalized records.

    Only the histograms are recorded per record. Counters and gauges are kept as
    plain totals and last values here and observed by the reader at collection
    time (like prometheus_client, the per-step work is a few dict updates): this
    runs on the sink thread, which shares the GIL with the training thread.
    """

    def __init__(self, provider: MeterProvider, base: dict[str, Any]):
        self._base = base
        self._meter = meter = provider.get_meter("steptrace", __version__)
        self._lock = threading.Lock()
        self.interval = meter.create_histogram("steptrace.step.interval", unit="s",
                                               description="Step interval end(n) - end(n-1)")
        self.compute = meter.create_histogram("steptrace.step.compute", unit="s",
                                              description="Device time busy with the step")
        self.blocking = meter.create_histogram("steptrace.checkpoint.blocking", unit="s",
                                               description="Checkpoint host time after the saved step ended")
        # Microbatches as a sum and a count per (stage, kind), read at collection: a histogram
        # point per microbatch cost the export thread ~10 us each (256 per pipeline step).
        self._mb: dict[tuple[str | None, str], list[float]] = {}  # (stage, kind) -> [count, Σcompute]
        self._steps: dict[str, int] = {}
        self._idle: dict[str, float] = {}
        #: pauses=True (docs/pauses.md): host pause seconds by cause (gc, preempted), summed
        self._pauses: dict[str, float] = {}
        self._collective: dict[str, float] = {}  # "collective_wait" / "own" -> seconds
        self._tokens: int | float | None = None
        self._last: dict[str, float] = {}
        self._bubble: dict[str, float] = {}
        #: Goodput as docs/goodput.md defines it, for this process: own compute / wall from its start.
        self._goodput_totals = GoodputTotals()

        def observe(read: Callable[[], Iterable[tuple[Any, dict[str, Any]]]]) -> Callable[[Any], list[Observation]]:
            def callback(_options: Any) -> list[Observation]:
                with self._lock:
                    return [Observation(value, attrs) for value, attrs in read()]
            return callback

        meter.create_observable_counter(
            "steptrace.steps", unit="{step}", description="Steps finalized, by status",
            callbacks=[observe(lambda: [(n, {**base, "train.status": s}) for s, n in self._steps.items()])])
        meter.create_observable_counter(
            "steptrace.step.idle", unit="s", description="Device idle time by the host span that caused it",
            callbacks=[observe(lambda: [(v, {**base, "train.idle.reason": r}) for r, v in self._idle.items()])])
        meter.create_observable_counter(
            "steptrace.host_pause", unit="s", description="Time the training thread was paused on the host, by "
            "cause: gc (every collection), preempted (run-queue wait); pauses=True",
            callbacks=[observe(lambda: [(v, {**base, "train.pause.cause": c}) for c, v in self._pauses.items()])])
        for name, description in (("collective_wait", "Step time spent waiting for other ranks in collectives"),
                                  ("own", "Step time on the rank's own (interval - collective wait)")):
            meter.create_observable_counter(
                f"steptrace.step.{name}", unit="s", description=description,
                callbacks=[observe(lambda name=name: [] if name not in self._collective
                                   else [(self._collective[name], base)])])
        for name, description in (
                ("productive", "Own compute of the steps: compute less the wait in collectives (goodput's numerator)"),
                ("wall", "Wall time from the process start to the latest record's end (goodput's denominator)")):
            meter.create_observable_counter(
                f"steptrace.{name}", unit="s", description=description,
                callbacks=[observe(lambda name=name: [] if self._goodput_totals.process_start is None else [
                    (getattr(self._goodput_totals, f"{name}_seconds"), base)])])
        meter.create_observable_counter(
            "steptrace.tokens", unit="{token}", description="Tokens processed",
            callbacks=[observe(lambda: [] if self._tokens is None else [(self._tokens, base)])])
        for name, unit, description in (
                ("tokens_per_second", "{token}/s", "Tokens per second of interval, last step"),
                ("tflops_per_second", "TFLOP/s", "TFLOP/s per device over compute time, last step"),
                ("model_flops", "{FLOP}", "Model FLOPs per device, last step"),
                ("hardware_flops", "{FLOP}", "Hardware FLOPs per device (from the compiler), last step"),
                ("peak_flops", "{FLOP}/s", "The device's dense bf16 peak MFU and HFU divide by"),
                ("mfu", "1", "Model FLOPs utilisation, last step: model FLOPs / compute / peak"),
                ("hfu", "1", "Hardware FLOPs utilisation, last step: hardware FLOPs / compute / peak"),
                ("goodput_ratio", "1", "Goodput: own compute of the steps (waiting in collectives excluded) / "
                                       "wall from the process start to the latest record")):
            meter.create_observable_gauge(
                f"steptrace.{name}", unit=unit, description=description,
                callbacks=[observe(lambda name=name: [] if name not in self._last else [(self._last[name], base)])])
        def microbatches(field: int) -> list[tuple[float, dict[str, Any]]]:
            return [(v[field], {**base, "train.kind": kind, **({} if stage is None else {"train.stage": stage})})
                    for (stage, kind), v in self._mb.items()]

        meter.create_observable_counter(
            "steptrace.microbatch.compute", unit="s", description="Device time of pipeline microbatches",
            callbacks=[observe(lambda: microbatches(1))])
        meter.create_observable_counter(
            "steptrace.microbatches", unit="{microbatch}", description="Pipeline microbatches finalized",
            callbacks=[observe(lambda: [(int(n), attrs) for n, attrs in microbatches(0)])])
        meter.create_observable_gauge(
            "steptrace.pipeline.bubble_ratio", unit="1",
            description="1 - Σ microbatch compute / pipeline window, per stage, last step",
            callbacks=[observe(lambda: [(v, {**base, "train.stage": s}) for s, v in self._bubble.items()])])

    def attach_drop_counter(self, read: Callable[[], Mapping[str, int]]) -> None:
        base = self._base

        def observe(_options: Any) -> list[Observation]:
            return [Observation(count, {**base, "train.drop.reason": reason}) for reason, count in read().items()]

        self._meter.create_observable_counter("steptrace.dropped_records", callbacks=[observe], unit="{record}",
                                              description="Records dropped instead of blocking training, by reason")

    def record(self, r: Mapping[str, Any]) -> None:
        kind = r.get("type")
        base = self._base
        if kind == "step":
            interval = r.get("interval_seconds")
            compute = r.get("compute_seconds")
            if interval is not None:
                self.interval.record(interval, base)
            if compute is not None:
                self.compute.record(compute, base)
            with self._lock:
                status = str(r.get("status"))
                self._steps[status] = self._steps.get(status, 0) + 1
                # Waiting shown as waiting: own compute + wait + host idle by reason = interval.
                split = split_step(compute or 0.0, dict(r.get("idle_breakdown") or {}),
                                   r.get("collective_wait_seconds"), r.get("own_compute_seconds"),
                                   r.get("collective_wait_idle_breakdown"))
                for reason, seconds in split.idle_breakdown.items():
                    if seconds > 0:
                        self._idle[reason] = self._idle.get(reason, 0.0) + seconds
                pauses = r.get("host_pauses")
                if isinstance(pauses, dict):
                    for cause, field in (("gc", "gc_seconds"), ("preempted", "preempted_seconds")):
                        seconds = pauses.get(field)
                        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0:
                            self._pauses[cause] = self._pauses.get(cause, 0.0) + seconds
                host_start = r.get("host_start_time")
                self._goodput_totals.step(split.own_compute_seconds, None if host_start is None
                                          else host_start - (r.get("before_step_seconds") or 0.0))
                tokens = r.get("tokens")
                if tokens is not None:
                    self._tokens = tokens if self._tokens is None else self._tokens + tokens
                for field, key in (("collective_wait_seconds", "collective_wait"), ("own_seconds", "own")):
                    seconds = r.get(field)
                    if isinstance(seconds, (int, float)) and math.isfinite(seconds):
                        self._collective[key] = self._collective.get(key, 0.0) + seconds
                for field in ("tokens_per_second", "tflops_per_second", "model_flops", "hardware_flops",
                              "peak_flops", "mfu", "hfu"):
                    if r.get(field) is not None:
                        self._last[field] = r[field]
                for stage, ratio in (r.get("pipeline_bubble_ratio") or {}).items():
                    self._bubble[str(stage)] = ratio
        elif kind == "checkpoint":
            if r.get("blocking_seconds") is not None:
                self.blocking.record(r["blocking_seconds"], base)
        end = r.get("end_time")
        if isinstance(end, (int, float)) and not isinstance(end, bool):
            with self._lock:
                self._goodput_totals.ended(float(end))
                goodput = self._goodput_totals.ratio()
                if goodput is not None:
                    self._last["goodput_ratio"] = goodput

    def add_microbatches(self, summary: Mapping[tuple[Any, Any, Any], list[float]]) -> None:
        """Count one step's summarised microbatches (``(stage, chunk, kind) -> [count, Σcompute, ...]``).

        Microbatch records are not recorded one by one: the sink folds each step's summary in
        (256 records a pipeline step; a lock and two dict updates each cost ~1.2 us).
        """
        with self._lock:
            for (stage, _chunk, kind), entry in summary.items():
                key = (None if stage is None else str(stage), str(kind))
                totals = self._mb.get(key)
                if totals is None:
                    self._mb[key] = [entry[0], entry[1]]
                else:
                    totals[0] += entry[0]
                    totals[1] += entry[1]

    def attempt(self, r: Mapping[str, Any]) -> None:
        """The process start, from the ``attempt`` record: goodput's wall begins there."""
        start = r.get("start_time")
        if isinstance(start, (int, float)) and not isinstance(start, bool):
            with self._lock:
                self._goodput_totals.started(float(start))


class OtlpSink:
    """Exports finalized records over OTLP: spans per step (one trace per step across ranks) and metrics.

    Runs behind a :class:`~steptrace._sinks.SinkWorker` (its own thread and bounded
    queue). Built by ``steptrace.init()`` through :meth:`from_config`; construct it
    directly and pass it as ``init(sinks=[...])`` to export somewhere else as well.
    """

    name = "otlp"
    #: Record types after which the SinkWorker sends the batch at once instead of waiting out
    #: ``batch_delay_s``: a checkpoint (where a job is often stopped or preempted, and the progress a
    #: restart keeps) and a stall (the rank may be killed as hung). A hard exit there loses only what
    #: is still in flight (docs/otlp.md, "What a hard exit loses").
    flush_at = frozenset(("checkpoint", "stall"))

    def __init__(self, endpoint: str, *, run_id: str, rank: int = 0, world_size: int = 1,
                 protocol: str = "http/protobuf", headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
                 compression: str = "gzip", timeout_s: float = 10.0, metrics_interval_s: float = 10.0,
                 service_name: str | None = None, attempt: int = 0,
                 microbatch_spans: str = "none", batch_delay_s: float = 0.5):
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must start with http:// or https://, got {endpoint!r}")
        if protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {protocol!r}")
        if compression not in OTLP_COMPRESSIONS:
            raise ValueError(f"otlp_compression must be one of {', '.join(OTLP_COMPRESSIONS)}, got {compression!r}")
        for field, value in (("otlp_timeout_s", timeout_s), ("otlp_metrics_interval_s", metrics_interval_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{field} must be > 0, got {value!r}")
        if isinstance(batch_delay_s, bool) or not isinstance(batch_delay_s, (int, float)) \
                or not 0 <= batch_delay_s <= MAX_OTLP_BATCH_DELAY_S:
            raise ValueError(f"otlp_batch_delay_s must be in [0, {MAX_OTLP_BATCH_DELAY_S:g}], got {batch_delay_s!r}")
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        #: The SinkWorker hands this sink a batch once its oldest record waited this long (or the
        #: batch is full, or a flush asks): at 10 steps/s one request carries ~4 pipeline steps.
        self.batch_delay_s = float(batch_delay_s)
        #: Every how many steps full ``train.microbatch`` spans go out (0: never; 1: every step).
        self.microbatch_span_every = microbatch_span_every(microbatch_spans)
        header_pairs = tuple((str(k), str(v)) for k, v in (headers.items() if isinstance(headers, Mapping)
                                                           else headers))
        self.run_id = str(run_id)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.attempt = int(attempt)
        #: This process's start (unix seconds, from the ``attempt`` record): on the attempt's first step
        #: span, so a reader of the spans alone (ClickHouse) has goodput's wall from the process start.
        self._process_start: float | None = None
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        traces_url, metrics_url = signal_endpoints(endpoint, protocol)
        #: Where spans go (the traces URL for http/protobuf, ``scheme://host:port`` for grpc).
        self.endpoint = traces_url
        #: Where metrics go.
        self.metrics_endpoint = metrics_url

        self.resource = _resource(service_name, f"{self.run_id}/rank-{self.rank}").merge(
            Resource({ATTR_ATTEMPT: self.attempt}))
        # Megatron-LM's own OpenTelemetry export on (nemo-lens): one resource for both, so a backend
        # shows one service instance per rank with both sets of spans and metrics (docs/megatron.md).
        #: nemo-lens's resource identity this sink joined (``nemo_lens_resource``), or None.
        self.nemo_lens = nemo_lens_resource(os.environ, self.run_id, self.rank, self.world_size, service_name)
        if self.nemo_lens is not None:
            self.resource = self.resource.merge(Resource(self.nemo_lens))
        self._scope = InstrumentationScope("steptrace", __version__)
        self._answers = threading.local()  # the last ExportTraceServiceResponse, per exporting thread
        self._span_exporter, self._metric_exporter = _exporters(
            protocol, traces_url, metrics_url, header_pairs, compression, self.timeout_s, self._answers)

        # No attempt label on metrics: a restarted rank's counters restart, which Prometheus's
        # reset handling expects; the attempt is on the resource and on every span.
        base = {ATTR_RUN_ID: self.run_id, ATTR_RANK: self.rank}
        self._base = base
        views = [
            View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(boundaries=bounds))
            for name, bounds in (("steptrace.step.interval", STEP_BUCKETS_S),
                                 ("steptrace.step.compute", STEP_BUCKETS_S),
                                 ("steptrace.checkpoint.blocking", CHECKPOINT_BUCKETS_S))
        ]
        # The reader never starts a thread of its own (infinite interval): its thread would be
        # restarted by an at-fork hook in every forked child (DataLoader workers), which would
        # then export frozen copies of this rank's metrics under the same service.instance.id.
        # Our ticker thread, like every thread, does not survive a fork.
        self._reader = PeriodicExportingMetricReader(
            self._metric_exporter, export_interval_millis=math.inf, export_timeout_millis=self.timeout_s * 1000.0)
        # shutdown_on_exit=False: the SDK's atexit hook would block exit on a dead endpoint;
        # steptrace.shutdown() (also registered with atexit) shuts this provider down within its timeout.
        self._provider = MeterProvider(metric_readers=[self._reader], resource=self.resource, views=views,
                                       shutdown_on_exit=False)
        self._metrics = _Metrics(self._provider, base)
        # The exporters log a line per failed batch: at most one a minute per kind, with a count.
        limit_otel_exporter_logs()

        self._lock = threading.Lock()  # span-building state and exporter calls: sink thread vs flush/shutdown
        self._pending: list[dict[str, Any]] = []  # spans closed between steps, waiting for the next step
        self._span_ordinals: dict[int, int] = {}
        self._mb_ordinals: dict[int, int] = {}
        # step -> (stage, chunk, kind) as recorded -> [count, Σcompute, min, max, first start, last end]
        self._mb_summary: dict[int, dict[tuple[Any, Any, Any], list[float]]] = {}
        self._closed = False
        #: Records that could not be turned into spans (each dropped alone, ``invalid:otlp``).
        self.invalid_records = 0
        #: Spans the receiver refused in ``partial_success``, by its reason (``rejected:otlp:<reason>``).
        self.rejected: dict[str, int] = {}
        self._rejected_since_flush = 0
        self._drop_counter_attached = False
        self._stop_ticker = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(float(metrics_interval_s),),
                                        name="steptrace-otlp-metrics", daemon=True)
        self._ticker.start()

    @classmethod
    def from_config(cls, config: Any) -> "OtlpSink":
        """The sink ``steptrace.init()`` builds when ``otlp_endpoint`` is set."""
        return cls(
            config.otlp_endpoint,
            run_id=config.run_id,
            rank=config.rank,
            world_size=config.world_size,
            protocol=config.otlp_protocol,
            headers=config.otlp_headers,
            compression=config.otlp_compression,
            timeout_s=config.otlp_timeout_s,
            metrics_interval_s=config.otlp_metrics_interval_s,
            service_name=config.service_name,
            attempt=config.attempt,
            microbatch_spans=config.otlp_microbatch_spans,
            batch_delay_s=config.otlp_batch_delay_s,
        )

    def attach_drop_counter(self, read: Callable[[], Mapping[str, int]]) -> None:
        """Publish the run's drop counts (``{reason: count}``) as ``steptrace.dropped_records``."""
        if not self._drop_counter_attached:
            self._drop_counter_attached = True
            self._metrics.attach_drop_counter(read)

    # -- the sink protocol ---------------------------------------------------------------
    def export(self, records: list[dict[str, Any]]) -> None:
        """Record metrics and export the batch's spans; raises :class:`OtlpExportError` on failure."""
        if self._closed:
            # A batch still queued when shutdown ran out of time: the SinkWorker already counted it.
            return
        with self._lock:
            spans: list[ReadableSpan] = []
            invalid_before = self.invalid_records
            not_carried = 0
            for record in records:
                # A record that cannot be turned into spans (a custom sink's malformed dict, a
                # value that will not convert) costs that record alone, counted by the
                # SinkWorker as invalid:otlp; the rest of the batch goes out.
                try:
                    if record.get("type") == "attempt":
                        self._metrics.attempt(record)
                        start = record.get("start_time")
                        if isinstance(start, (int, float)) and not isinstance(start, bool):
                            self._process_start = float(start)
                    if record.get("type") not in _EXPORTED_TYPES:
                        # Metadata, attempt, run: OTLP carries nothing of them (their facts are the
                        # resource's), so a failed request does not lose them, though the batch
                        # delay puts them in one batch with steps.
                        not_carried += 1
                        continue
                    spans += self._record_spans(record)
                except Exception as exc:
                    self.invalid_records += 1
                    if self.invalid_records == 1:
                        log.warning("steptrace OTLP: cannot export a %r record (%s: %s); it is dropped and "
                                    "counted as invalid:otlp",
                                    record.get("type") if isinstance(record, Mapping) else type(record).__name__,
                                    type(exc).__name__, exc)
            if spans:
                try:
                    self._send(spans)
                except OtlpExportError as exc:
                    exc.dropped_records = len(records) - not_carried - self.invalid_records + invalid_before
                    raise

    def _record_spans(self, record: dict[str, Any]) -> list[ReadableSpan]:
        kind = record.get("type")
        if kind == "step":
            spans = self._step_spans(record)
        elif kind == "span":
            spans = [] if record.get("step") is None else [self._user_span(record, record["step"])]
        elif kind == "microbatch":
            self._summarize_microbatch(record)
            every = self.microbatch_span_every
            spans = [self._microbatch_span(record)] if every and record["step"] % every == 0 else []
        elif kind == "checkpoint":
            spans = [self._checkpoint_span(record)]
        elif kind == "capture":
            spans = [self._capture_span(record)]
        else:  # "stall", "stall_end": export() passes only _EXPORTED_TYPES
            spans = [self._stall_span(record)]
        # Metrics after the spans: a record that fails above leaves no half-recorded metrics.
        # (Microbatches reach the metrics through their step's summary.)
        if kind != "microbatch":
            self._metrics.record(record)
        if kind == "span" and record.get("step") is None:
            self._pending.append(record)  # exported with the next step's trace, or at flush
        return spans

    def force_flush(self, timeout_s: float) -> bool:
        """Export spans closed after the last step and collect/export metrics, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self._closed:
            return True
        spans_ok = _run_bounded(self._export_tail, deadline, "flush")
        metrics_ok = _run_bounded(self._collect_metrics, deadline, "metrics-flush")
        # Spans the receiver refused since the last flush make it False, like a failed export.
        with self._lock:
            refused, self._rejected_since_flush = self._rejected_since_flush, 0
        return spans_ok and metrics_ok and not refused

    def shutdown(self, timeout_s: float) -> None:
        """Export what is left and stop, returning within ``timeout_s``; aborts the exporters' retries."""
        deadline = time.monotonic() + timeout_s
        if self._closed:
            return
        self._closed = True
        self._stop_ticker.set()
        try:
            _run_bounded(self._export_tail, deadline, "shutdown")
            # One last collection exports the final cumulative metrics.
            if not _run_bounded(lambda: self._final_metrics(deadline), deadline, "metrics-shutdown"):
                log.warning("steptrace OTLP: final metrics not exported to %s within the shutdown timeout",
                            self.metrics_endpoint)
        finally:
            # Stops retries and closes connections; an export still in flight ends with a failure.
            for exporter in (self._span_exporter, self._metric_exporter):
                try:
                    if not getattr(exporter, "_shutdown", False):
                        exporter.shutdown()
                except Exception:
                    log.debug("steptrace OTLP exporter shutdown failed", exc_info=True)

    # -- metrics -------------------------------------------------------------------------
    def _tick(self, interval_s: float) -> None:
        while not self._stop_ticker.wait(interval_s):
            self._collect_metrics()

    def _collect_metrics(self) -> None:
        # Export failures are logged by the SDK exporter; the reader serialises concurrent exports.
        try:
            self._reader.collect(timeout_millis=self.timeout_s * 1000)
        except Exception:
            log.debug("steptrace OTLP metric collection failed", exc_info=True)

    def _final_metrics(self, deadline: float) -> None:
        with self._lock:  # microbatches whose step record never came still count
            for n in list(self._mb_summary):
                self._metrics.add_microbatches(self._mb_summary.pop(n))
        self._collect_metrics()
        self._provider.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000)

    # -- spans ---------------------------------------------------------------------------
    def _send(self, spans: list[ReadableSpan]) -> None:
        self._answers.response = None
        try:
            result = self._span_exporter.export(spans)
        except Exception as exc:
            raise OtlpExportError(f"OTLP export of {len(spans)} spans to {self.endpoint} failed: {exc!r}") from exc
        if result is not SpanExportResult.SUCCESS:
            raise OtlpExportError(f"OTLP export of {len(spans)} spans to {self.endpoint} failed "
                                  f"(endpoint down, refusing or timing out after {self.timeout_s:g} s)")
        self._read_partial_success(self._answers.response)

    def _read_partial_success(self, answer: Any) -> None:
        """Count the spans the receiver refused (``partial_success``) by the reasons its message gives.

        The steptrace collector says ``"train.step spans skipped: 3 too_many_runs, 1 bad_value"``;
        any other receiver's refusals are counted as ``partial_success``.
        """
        if answer is None:
            return
        try:
            if isinstance(answer, bytes):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

                answer = ExportTraceServiceResponse.FromString(answer)
            rejected = int(answer.partial_success.rejected_spans)
            message = str(answer.partial_success.error_message)[:1000]
        except Exception:
            return  # not an ExportTraceServiceResponse (a JSON or truncated answer): nothing to read
        if rejected <= 0:
            return
        reasons: dict[str, int] = {}
        for count, reason in _REASON.findall(message):
            reasons[reason] = reasons.get(reason, 0) + int(count)
        if sum(reasons.values()) != rejected:
            reasons = {"partial_success": rejected}
        for reason, count in reasons.items():
            if reason not in self.rejected and len(self.rejected) >= _MAX_REJECT_REASONS:
                reason = "partial_success"
            self.rejected[reason] = self.rejected.get(reason, 0) + count
        self._rejected_since_flush += rejected
        log.warning("steptrace OTLP: %s refused %d step span(s) (%s); counted as rejected:otlp:<reason> drops",
                    self.endpoint, rejected, message[:200] or "no reason given")

    def _export_tail(self) -> bool:
        with self._lock:
            if not self._pending:
                return True
            pending, self._pending = self._pending, []
            spans = [self._own_trace_span(r) for r in pending]
            try:
                self._send(spans)
            except OtlpExportError as exc:
                log.warning("steptrace: %s; %d spans closed after the last step are lost", exc, len(spans))
                return False
            return True

    def _span(self, name: str, trace: int, span: int, parent: int | None, start_ns: int, end_ns: int,
              attributes: dict[str, Any], error: str | None = None) -> ReadableSpan:
        return ReadableSpan(
            name=name,
            context=SpanContext(trace, span, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)),
            parent=None if parent is None else SpanContext(trace, parent, is_remote=False,
                                                           trace_flags=TraceFlags(TraceFlags.SAMPLED)),
            resource=self.resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.UNSET),
            start_time=start_ns,
            end_time=max(start_ns, end_ns),
            instrumentation_scope=self._scope,
        )

    def _attrs(self, step: int) -> dict[str, Any]:
        return {ATTR_RUN_ID: self.run_id, ATTR_RANK: self.rank, ATTR_ATTEMPT: self.attempt, ATTR_STEP: step}

    def _step_spans(self, r: dict[str, Any]) -> list[ReadableSpan]:
        n = r["step"]
        run, rank = self.run_id, self.rank
        trace = trace_id(run, n, self.attempt)
        step_span = span_id(run, n, rank, "step", self.attempt)
        end_ns = _ns(r["end_time"])
        interval = r.get("interval_seconds") or 0.0
        error = r.get("error") if r.get("status") == "error" else None
        if r.get("status") == "error" and error is None:
            error = "step failed"

        attrs = self._attrs(n)
        _put(attrs, ATTR_WORLD_SIZE, r.get("world_size", self.world_size))
        for key in ("status", "error", "backend", "interval_seconds", "compute_seconds", "idle_seconds", "tokens",
                    "samples", "flops", "model_flops", "hardware_flops", "flops_source", "peak_flops",
                    "tokens_per_second", "samples_per_second", "tflops_per_second", "mfu", "hfu",
                    "collective_wait_seconds", "own_seconds", "own_compute_seconds", "collective_wait_source",
                    "exposed_communication_seconds", "collectives_dropped", "first_after_restore"):
            _put(attrs, step_field_attribute(key), r.get(key))
        for reason, seconds in (r.get("collective_wait_idle_breakdown") or {}).items():
            _put(attrs, f"{ATTR_COLLECTIVE_WAIT_IDLE_PREFIX}{reason}_seconds", seconds)
        collectives = r.get("collectives")
        if collectives and len(collectives) <= OTLP_MAX_COLLECTIVES:
            # For the collector's cross-rank join (each rank's wait = its duration - the shortest rank's).
            attrs[ATTR_COLLECTIVES_GROUP] = tuple(str(c[0]) for c in collectives)
            attrs[ATTR_COLLECTIVES_SEQ] = tuple(int(c[1]) for c in collectives)
            attrs[ATTR_COLLECTIVES_DEVICE_SECONDS] = tuple(-1.0 if c[2] is None else float(c[2]) for c in collectives)
        for reason, seconds in (r.get("idle_breakdown") or {}).items():
            _put(attrs, f"train.idle.{reason}_seconds", seconds)
        # A rank's first step carries the time from init() to it (startup, eval, ...): a reader of
        # the spans alone (ClickHouse) needs it for the wall and goodput a JSONL report shows.
        _put(attrs, step_field_attribute("before_step_seconds"), r.get("before_step_seconds"))
        if "before_step_seconds" in r:
            _put(attrs, ATTR_PROCESS_START_TIME, self._process_start)
        for reason, seconds in (r.get("before_step_breakdown") or {}).items():
            _put(attrs, f"{ATTR_BEFORE_STEP_PREFIX}{reason}_seconds", seconds)
        for stage, ratio in (r.get("pipeline_bubble_ratio") or {}).items():
            _put(attrs, f"{ATTR_BUBBLE_PREFIX}{stage}", ratio)
        for name, value in (r.get("scalars") or {}).items():
            _put(attrs, f"train.scalar.{name}", value)
        for key, value in (r.get("device_memory") or {}).items():
            _put(attrs, f"train.device_memory.{key}", value)
        for key, value in (r.get("attrs") or {}).items():
            _put(attrs, f"train.attrs.{key}", value)
        health = r.get("health")
        if isinstance(health, dict):
            # The GPU's health window (docs/health.md), flat: train.health.<field>, a dict's entries as
            # train.health.<field>.<key>; a null (unsupported) field is left out, never sent as 0.
            for key, value in health.items():
                if isinstance(value, dict):
                    for inner, item in value.items():
                        _put(attrs, f"{ATTR_HEALTH_PREFIX}{key}.{inner}", item)
                else:
                    _put(attrs, f"{ATTR_HEALTH_PREFIX}{key}", value)
        pauses = r.get("host_pauses")
        if isinstance(pauses, dict):
            # pauses=True (docs/pauses.md): the numbers, flat (train.host_pauses.<field>); gc_collections as
            # train.host_pauses.gc_collections.<generation>; a null (unmeasured) counter is left out, never 0.
            for key, value in pauses.items():
                if isinstance(value, list):
                    for generation, count in enumerate(value):
                        _put(attrs, f"{ATTR_HOST_PAUSES_PREFIX}{key}.{generation}", count)
                else:
                    _put(attrs, f"{ATTR_HOST_PAUSES_PREFIX}{key}", value)
        self._put_microbatch_summary(attrs, n)
        spans = [self._span(SPAN_STEP, trace, step_span, None, _ns(r["end_time"] - interval), end_ns, attrs,
                            error)]

        compute_attrs = self._attrs(n)
        _put(compute_attrs, ATTR_COMPUTE_SECONDS, r.get("compute_seconds"))
        spans.append(self._span("train.compute", trace, span_id(run, n, rank, "compute", self.attempt), step_span,
                                _ns(r["start_time"]), end_ns, compute_attrs))
        for i, segment in enumerate(r.get("idle_segments") or ()):
            reason, start, end = segment
            idle_attrs = self._attrs(n)
            idle_attrs["train.idle.reason"] = str(reason)
            idle_attrs["train.idle_seconds"] = end - start
            spans.append(self._span("train.idle", trace, span_id(run, n, rank, f"idle/{i}", self.attempt), step_span,
                                    _ns(start), _ns(end), idle_attrs))
        # Spans closed before this step entered: the idle time they cover is this step's.
        pending, self._pending = self._pending, []
        spans += [self._user_span(p, n) for p in pending]
        # Records arrive in order (step n's spans and microbatches, then its record), so no
        # ordinal of this or an earlier step is needed again.
        self._span_ordinals.clear()
        self._mb_ordinals.clear()
        return spans

    def _user_span(self, r: dict[str, Any], n: int) -> ReadableSpan:
        k = self._span_ordinals.get(n, 0)
        self._span_ordinals[n] = k + 1
        attrs = self._attrs(n)
        _put(attrs, "train.span_seconds", r.get("seconds"))
        for key, value in (r.get("attrs") or {}).items():
            _put(attrs, f"train.attrs.{key}", value)
        run, rank, attempt = self.run_id, self.rank, self.attempt
        return self._span(str(r.get("name")), trace_id(run, n, attempt), span_id(run, n, rank, f"span/{k}", attempt),
                          span_id(run, n, rank, "step", attempt), _ns(r["start_time"]), _ns(r["end_time"]), attrs)

    def _own_trace_span(self, r: dict[str, Any]) -> ReadableSpan:
        trace, span = _own_trace_ids(self.run_id, self.rank, str(r.get("name")), r["start_time"])
        attrs = {ATTR_RUN_ID: self.run_id, ATTR_RANK: self.rank}
        _put(attrs, "train.span_seconds", r.get("seconds"))
        for key, value in (r.get("attrs") or {}).items():
            _put(attrs, f"train.attrs.{key}", value)
        return self._span(str(r.get("name")), trace, span, None, _ns(r["start_time"]), _ns(r["end_time"]), attrs)

    def _summarize_microbatch(self, r: dict[str, Any]) -> None:
        # Validate before touching the summary: a malformed record costs itself alone (invalid:otlp).
        n, start, end = int(r["step"]), float(r["start_time"]), float(r["end_time"])
        compute = r.get("compute_seconds")
        compute = float(compute) if isinstance(compute, (int, float)) and math.isfinite(compute) else 0.0
        # The values as recorded (names are made at the step: this runs 256 times a pipeline step).
        key = (r.get("stage"), r.get("chunk"), r.get("kind"))
        per_step = self._mb_summary.get(n)
        if per_step is None:
            per_step = self._mb_summary[n] = {}
        try:
            entry = per_step.get(key)
        except TypeError:  # an unhashable stage or chunk (a custom sink's record): by its text
            key = (_summary_key(key[0]), _summary_key(key[1]), _summary_key(key[2]))
            entry = per_step.get(key)
        if entry is None and len(per_step) >= MAX_MICROBATCH_SUMMARY_KEYS:
            # Stages, chunks and kinds are the user's: a step's span gets a bounded number of attributes.
            key = (_OTHER, _OTHER, _OTHER)
            entry = per_step.get(key)
        if entry is None:
            per_step[key] = [1, compute, compute, compute, start, end]
        else:
            entry[0] += 1
            entry[1] += compute
            entry[2] = min(entry[2], compute)
            entry[3] = max(entry[3], compute)
            entry[4] = min(entry[4], start)
            entry[5] = max(entry[5], end)

    def _put_microbatch_summary(self, attrs: dict[str, Any], n: int) -> None:
        """Step ``n``'s microbatches as ``train.microbatch_summary.<stage>.<chunk>.<kind>.<field>``."""
        summary = self._mb_summary.pop(n, None)
        # Microbatches of a step whose record never came (or came first) are counted in the
        # metrics and not kept forever.
        for stale in [s for s in self._mb_summary if s < n]:
            self._metrics.add_microbatches(self._mb_summary.pop(stale))
        if not summary:
            return
        self._metrics.add_microbatches(summary)
        named: dict[tuple[str, str, str], list[float]] = {}
        for (stage, chunk, kind), entry in summary.items():
            key = (_summary_key(stage), _summary_key(chunk), _summary_key(kind))
            merged = named.get(key)
            if merged is None:
                named[key] = entry
            else:  # two recorded values with one name ("a.b" and "a_b"): one summary
                named[key] = [merged[0] + entry[0], merged[1] + entry[1], min(merged[2], entry[2]),
                              max(merged[3], entry[3]), min(merged[4], entry[4]), max(merged[5], entry[5])]
        for (stage, chunk, kind), (count, total, low, high, first, last) in named.items():
            prefix = f"{MICROBATCH_SUMMARY_PREFIX}{stage}.{chunk}.{kind}."
            attrs[prefix + "count"] = int(count)
            attrs[prefix + "compute_seconds_sum"] = total
            attrs[prefix + "compute_seconds_min"] = low
            attrs[prefix + "compute_seconds_max"] = high
            attrs[prefix + "first_start_time"] = first
            attrs[prefix + "last_end_time"] = last

    def _microbatch_span(self, r: dict[str, Any]) -> ReadableSpan:
        n = r["step"]
        k = self._mb_ordinals.get(n, 0)
        self._mb_ordinals[n] = k + 1
        attrs = self._attrs(n)
        for key in ("microbatch", "stage", "chunk", "kind", "compute_seconds"):
            _put(attrs, f"train.{key}", r.get(key))
        run, rank, attempt = self.run_id, self.rank, self.attempt
        return self._span("train.microbatch", trace_id(run, n, attempt),
                          span_id(run, n, rank, f"microbatch/{k}", attempt), span_id(run, n, rank, "step", attempt),
                          _ns(r["start_time"]), _ns(r["end_time"]), attrs)

    def _checkpoint_span(self, r: dict[str, Any]) -> ReadableSpan:
        n = r["step"]
        attrs = self._attrs(n)
        _put(attrs, "train.status", r.get("status"))
        _put(attrs, "train.error", r.get("error"))
        for key in ("after_step", "host_seconds", "blocking_seconds", "async_seconds"):
            _put(attrs, f"train.checkpoint.{key}", r.get(key))
        error = (r.get("error") or "checkpoint failed") if r.get("status") == "error" else None
        # Keyed by the save's start (not an ordinal): a replayed record keeps its id, and a
        # second save of the same step gets its own.
        role = f"checkpoint/{round(r['start_time'] * 1e6)}"
        run, rank, attempt = self.run_id, self.rank, self.attempt
        return self._span("train.checkpoint", trace_id(run, n, attempt), span_id(run, n, rank, role, attempt),
                          span_id(run, n, rank, "step", attempt), _ns(r["start_time"]), _ns(r["end_time"]),
                          attrs, error)


    def _capture_span(self, r: dict[str, Any]) -> ReadableSpan:
        """A deep capture (docs/capture.md) on the trace of the step that fired it (else its first
        step), with the trace file's path: a trace viewer links the slow step to its profile."""
        n = r.get("trigger_step")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            n = r.get("first_step")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("a capture record names no step")
        attrs = self._attrs(n)
        for field in ("status", "trigger", "trigger_step", "reason", "first_step", "last_step", "path", "profiler",
                      "bytes", "skipped_because", "error", "start_seconds", "stop_seconds", "write_seconds"):
            _put(attrs, f"train.capture.{field}", r.get(field))
        run, rank, attempt = self.run_id, self.rank, self.attempt
        return self._span("train.capture", trace_id(run, n, attempt),
                          span_id(run, n, rank, f"capture/{round(r['start_time'] * 1e6)}", attempt),
                          span_id(run, n, rank, "step", attempt), _ns(r["start_time"]), _ns(r["end_time"]), attrs,
                          "capture failed" if r.get("status") == "failed" else None)

    def _stall_span(self, r: dict[str, Any]) -> ReadableSpan:
        """A stall (or its end) on the stalled step's trace: where the training thread was, as text."""
        n = r["step"]
        attrs = self._attrs(n)
        _put(attrs, "train.stall.in_step", r.get("in_step"))
        _put(attrs, "train.stall.span", r.get("span"))
        start = r["start_time"]
        if r["type"] == "stall":
            seconds = r.get("open_seconds") or 0.0
            _put(attrs, "train.stall.open_seconds", seconds)
            _put(attrs, "train.stall.threshold_seconds", r.get("threshold_seconds"))
            train = next((t for t in r.get("threads") or () if t.get("training")), None)
            if train is not None:
                # steptrace's own frames (its hooks around a framework's call) are left out: the
                # collector names where the rank is from this text and cannot tell them apart.
                own = tuple(r.get("steptrace_paths") or ())
                frames = [f for f in train.get("frames", []) if not (own and str(f[0]).startswith(own))]
                lines = [f"{path}:{line} in {function}" for path, line, function in frames[-24:]]
                _put(attrs, "train.stall.stack", "\n".join(lines)[-_STACK_ATTR_CHARS:])
            name, role = "train.stall", f"stall/{round(start * 1e6)}"
        else:
            seconds = r.get("lasted_seconds") or 0.0
            _put(attrs, "train.stall.lasted_seconds", seconds)
            name, role = "train.stall_end", f"stall_end/{round(start * 1e6)}"
        run, rank, attempt = self.run_id, self.rank, self.attempt
        return self._span(name, trace_id(run, n, attempt), span_id(run, n, rank, role, attempt),
                          span_id(run, n, rank, "step", attempt), _ns(start), _ns(start + seconds), attrs,
                          "stalled" if name == "train.stall" else None)


#: Step-span attributes that summarise the step's microbatches (see :meth:`OtlpSink._put_microbatch_summary`).
MICROBATCH_SUMMARY_PREFIX = "train.microbatch_summary."
#: Distinct (stage, chunk, kind) summarised per step; later ones are summed under ``other.other.other``.
MAX_MICROBATCH_SUMMARY_KEYS = 32
_OTHER = "other"


def _summary_key(value: Any) -> str:
    """A stage, chunk or kind as one dot-free attribute-name segment (``_`` when unset)."""
    if value is None:
        return "_"
    return str(value).replace(".", "_")[:64] or "_"


#: The stalled training thread's innermost frames, as one attribute of at most this many characters.
_STACK_ATTR_CHARS = 4096


#: nemo-lens (NVIDIA NeMo's OpenTelemetry library, behind Megatron-LM's own export) reads each setting from
#: ``MEGATRON_OTEL_<KEY>`` in Megatron-LM, falling back to ``NEMO_LENS_<KEY>`` when that is empty
#: (``NemoLensConfig.from_env(prefix="MEGATRON_OTEL", fallback_prefix="NEMO_LENS")`` in Megatron-LM's
#: ``megatron/training/global_vars.py:_set_telemetry``; nemo-lens 0.1.0 ``config.py``).
NEMO_LENS_PREFIXES = ("MEGATRON_OTEL", "NEMO_LENS")
_NEMO_LENS_TRUE = ("1", "true", "yes", "on")


def _nemo_lens_setting(env: Mapping[str, str], key: str) -> tuple[str, str]:
    """(value, the prefix it came from) of nemo-lens setting ``key``; ("", "") when unset."""
    for prefix in NEMO_LENS_PREFIXES:
        value = (env.get(f"{prefix}_{key}") or "").strip()
        if value:
            return value, prefix
    return "", ""


def nemo_lens_resource(env: Mapping[str, str], run_id: str, rank: int, world_size: int,
                       service_name: str | None) -> dict[str, Any] | None:
    """The resource identity nemo-lens gives this rank's telemetry when its export is on in ``env``
    (``MEGATRON_OTEL_ENABLED``/``NEMO_LENS_ENABLED``), for steptrace's spans and metrics to join the same
    resource; None when it is off.

    As nemo-lens 0.1.0 builds it (``setup_telemetry``, ``providers.build_providers``): ``nemo.run.id`` =
    ``MEGATRON_OTEL_RUN_ID``/``NEMO_LENS_RUN_ID``, else ``SLURM_JOB_ID``, else (where nemo-lens draws a
    random id per process) steptrace's ``run_id``, which Megatron's steptrace hook hands to Megatron;
    ``service.instance.id`` = ``<nemo.run.id>-rank<rank>``; ``dl.rank``, ``dl.world_size``;
    ``service.name``: steptrace's ``service_name`` given in code, else ``OTEL_SERVICE_NAME``, else
    Megatron-LM's ``megatron-lm`` (``_set_telemetry``) when ``MEGATRON_OTEL_ENABLED`` turned it on,
    nemo-lens's ``nemo`` otherwise.
    """
    enabled, prefix = _nemo_lens_setting(env, "ENABLED")
    if enabled.lower() not in _NEMO_LENS_TRUE:
        return None
    nemo_run_id = _nemo_lens_setting(env, "RUN_ID")[0] or (env.get("SLURM_JOB_ID") or "").strip() or run_id
    name = service_name or (env.get("OTEL_SERVICE_NAME") or "").strip() or (
        "megatron-lm" if prefix == "MEGATRON_OTEL" else "nemo")
    return {"nemo.run.id": nemo_run_id, SERVICE_INSTANCE_ID: f"{nemo_run_id}-rank{rank}",
            SERVICE_NAME: name, "dl.rank": rank, "dl.world_size": world_size}


def _resource(service_name: str | None, instance_id: str) -> Resource:
    """``OTEL_RESOURCE_ATTRIBUTES`` plus our service.name and service.instance.id (see the module doc)."""
    detected = Resource.create({})  # reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    name = service_name
    if not name:
        env_name = detected.attributes.get(SERVICE_NAME)
        # Resource.create invents "unknown_service:<executable>" when nothing names the service.
        name = env_name if env_name and not str(env_name).startswith("unknown_service") else _DEFAULT_SERVICE_NAME
    return detected.merge(Resource({SERVICE_NAME: name, SERVICE_INSTANCE_ID: instance_id}))


def _bounded_session(answers: threading.local | None) -> Any:
    """A ``requests`` session that reads at most :data:`MAX_RESPONSE_BYTES` of each answer.

    The SDK's exporter reads the whole body of every response; this one streams it, keeps the
    first bytes (where an OTLP answer fits) and drops the connection when there is more. The traces
    exporter's session also hands each answer's body to the sink (``answers.response``), which
    reads ``partial_success`` from it.
    """
    import requests

    class BoundedSession(requests.Session):
        def __init__(self) -> None:
            super().__init__()
            self._environment: dict[tuple[Any, ...], Any] = {}

        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            # requests reads the proxy and CA-bundle variables (and walks NO_PROXY) on every
            # request: a fifth of an export's CPU. The sink posts to one or two URLs with fixed
            # settings, so the environment is read once per URL, when the first export starts.
            key = (url, tuple(sorted((proxies or {}).items())), stream, verify, str(cert))
            settings = self._environment.get(key)
            if settings is None:
                if len(self._environment) >= 16:
                    self._environment.clear()
                settings = self._environment[key] = super().merge_environment_settings(
                    url, proxies, stream, verify, cert)
            return settings

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["stream"] = True
            response = super().request(method, url, *args, **kwargs)
            try:
                data = response.raw.read(MAX_RESPONSE_BYTES + 1, decode_content=True) or b""
            except Exception:
                data = b""
            finally:
                # A short answer read to its end has already put the connection back in the pool
                # (kept alive: tests/test_otlp.py checks one connection serves every export);
                # an answer longer than the bound is never read further: its connection goes.
                response.close()
            response._content = data[:MAX_RESPONSE_BYTES]
            response._content_consumed = True
            if answers is not None and response.status_code == 200 and len(data) <= MAX_RESPONSE_BYTES and \
                    "json" not in (response.headers.get("Content-Type") or ""):
                answers.response = data
            return response

    return BoundedSession()


class _AnswerKeepingStub:
    """An OTLP/gRPC trace stub that hands each Export answer to the sink (``answers.response``)."""

    def __init__(self, stub: Any, answers: threading.local):
        self._stub = stub
        self._answers = answers

    def Export(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the gRPC method's name
        response = self._stub.Export(*args, **kwargs)
        self._answers.response = response
        return response


def _exporters(protocol: str, traces_url: str, metrics_url: str, headers: tuple[tuple[str, str], ...],
               compression: str, timeout_s: float, answers: threading.local | None = None) -> tuple[Any, Any]:
    """The SDK's span and metric exporters, every setting passed explicitly (code wins over env)."""
    if protocol == "grpc":
        try:
            import grpc
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ImportError(f"otlp_protocol='grpc' needs opentelemetry-exporter-otlp-proto-grpc ({exc}): "
                              "pip install 'steptrace[otlp]'") from exc
        grpc_compression = grpc.Compression.Gzip if compression == "gzip" else grpc.Compression.NoCompression
        insecure = urlsplit(traces_url).scheme == "http"
        # gRPC metadata keys must be lowercase.
        metadata = tuple((k.lower(), v) for k, v in headers)
        kwargs = dict(insecure=insecure, headers=metadata, timeout=timeout_s, compression=grpc_compression)
        spans = OTLPSpanExporter(endpoint=traces_url, **kwargs)
        stub = getattr(spans, "_stub", None)
        if answers is not None and callable(stub) and getattr(spans, "_client", None) is not None:
            # The SDK drops the Export answer; keep it (also across the exporter's reconnects).
            spans._stub = lambda channel: _AnswerKeepingStub(stub(channel), answers)
            spans._client = _AnswerKeepingStub(spans._client, answers)
        return spans, OTLPMetricExporter(endpoint=metrics_url, **kwargs)
    try:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ImportError(f"steptrace's OTLP exporter needs opentelemetry-exporter-otlp-proto-http ({exc}): "
                          "pip install 'steptrace[otlp]'") from exc
    http_compression = Compression.Gzip if compression == "gzip" else Compression.NoCompression
    kwargs = dict(headers=dict(headers), timeout=timeout_s, compression=http_compression)
    return (OTLPSpanExporter(endpoint=traces_url, session=_bounded_session(answers), **kwargs),
            OTLPMetricExporter(endpoint=metrics_url, session=_bounded_session(None), **kwargs))
