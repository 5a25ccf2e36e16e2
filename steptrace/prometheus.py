"""Prometheus exporter: each rank serves its own ``/metrics`` from finalized records.

``steptrace.init(prometheus_port=9464)`` (or ``STEPTRACE_PROMETHEUS_PORT``)
serves ``http://127.0.0.1:<9464 + local_rank>/metrics``: one port per rank, so
a dead rank shows up as ``up == 0`` for its own target instead of hiding
behind a live one. Every series is labelled ``run_id`` and ``rank`` and never
with the step number (one series per step would grow without bound).

:class:`PrometheusSink` runs behind its own :class:`~steptrace._sinks.SinkWorker`,
so ``export`` (one observation per step record, not an average)
happens off the training thread, and a scrape reads what is already
aggregated. Durations are summaries without quantiles (``_sum``, ``_count``)
by default: ``rank`` is on every series, and ~20 buckets per rank and label
set is what grows a big job's Prometheus (docs/prometheus.md, "A series budget
per rank"). With ``histograms=True`` (``prometheus_histograms``) they are
bucketed histograms whose observations carry the step's trace id as an
OpenMetrics exemplar, which links a slow bucket in Grafana to the step's
distributed trace (exemplars only appear in the OpenMetrics exposition,
``Accept: application/openmetrics-text``).

Metrics (all with ``run_id`` and ``rank``):

=====================================================  =========  ======================
name                                                   type       extra labels
=====================================================  =========  ======================
``steptrace_step_interval_seconds``                    summary
``steptrace_step_compute_seconds``                     summary
``steptrace_step_idle_seconds_total``                  counter    ``reason`` (less the wait in collectives in it)
``steptrace_step_collective_wait_seconds_total``       counter    (where the wait in collectives is measured)
``steptrace_step_own_seconds_total``                   counter    (interval - collective wait, the same steps)
``steptrace_step_exposed_communication_seconds_total`` counter    (NCCL, device-timed: not overlapped with compute)
``steptrace_productive_seconds_total``                 counter    (own compute: compute - wait in it)
``steptrace_wall_seconds_total``                       counter    (process start -> latest record's end)
``steptrace_steps_total``                              counter    ``status``
``steptrace_last_step``                                gauge
``steptrace_tokens_total``                             counter
``steptrace_tokens_per_second``                        gauge
``steptrace_tflops_per_second``                        gauge      (per device)
``steptrace_step_flops``                               gauge      ``kind`` (model, hardware; per device)
``steptrace_peak_flops``                               gauge      (FLOP/s per device, with a known peak)
``steptrace_mfu``                                      gauge      (with a peak: configured or the table's)
``steptrace_hfu``                                      gauge      (with a peak and hardware FLOPs)
``steptrace_pipeline_bubble_ratio``                    gauge      ``stage``
``steptrace_step_scalar``                              gauge      ``name`` (``s.log``; first 64 names)
``steptrace_device_memory_bytes``                      gauge      ``kind`` (in_use, peak, limit)
``steptrace_gpu_violation_seconds_total``              counter    ``policy`` (health="nvml": docs/health.md)
``steptrace_gpu_energy_joules_total``                  counter    (health="nvml")
``steptrace_gpu_power_watts``                          gauge      (health="nvml", last window's mean)
``steptrace_gpu_sm_clock_hertz``                       gauge      (health="nvml", last window's mean)
``steptrace_gpu_memory_clock_hertz``                   gauge      (health="nvml", last window's mean)
``steptrace_gpu_temperature_celsius``                  gauge      (health="nvml", last window's max)
``steptrace_gpu_clocks_event_reasons``                 gauge      (health="nvml", bitmask)
``steptrace_gpu_errors_total``                         counter    ``kind`` (xid, ecc_uncorrected, remapped_rows, nvlink)
``steptrace_host_pause_seconds_total``                 counter    ``cause`` (gc, preempted; pauses=True: docs/pauses.md)
``steptrace_gc_collections_total``                     counter    ``generation`` (pauses=True)
``steptrace_major_faults_total``                       counter    (pauses=True)
``steptrace_involuntary_switches_total``               counter    (pauses=True)
``steptrace_microbatch_seconds``                       summary    ``kind, stage, chunk``
``steptrace_checkpoint_blocking_seconds``              summary
``steptrace_checkpoint_async_seconds``                 summary
``steptrace_checkpoints_total``                        counter    ``status``
``steptrace_dropped_records_total``                    counter    ``sink, reason``
``steptrace_info``                                     gauge (1)  ``version, backend``
``steptrace_step_interval_median_seconds``             gauge      (last ``goodput_window_steps`` steps)
``steptrace_current_step``                             gauge      (read at scrape time)
``steptrace_attempt``                                  gauge      (which process start of the run)
``steptrace_stall_seconds``                            gauge      ``span`` (0 unless a stall is open)
``steptrace_open_seconds``                             gauge      ``span`` (read at scrape time)
``steptrace_captures_total``                           counter    ``trigger, status`` (deep capture records)
=====================================================  =========  ======================

Goodput (docs/goodput.md) is ``steptrace_productive_seconds_total / steptrace_wall_seconds_total``:
a rank's since its process start, the job's with both summed over ranks, a window's with ``rate()``
of both (``collector/rules.yml``). Two counters rather than a ratio gauge: a ratio cannot be summed
over ranks or windowed, and every series counts against a rank's budget.

``steptrace_current_step`` and ``steptrace_open_seconds`` say where the training
thread is at the moment of the scrape (:meth:`PrometheusSink.attach_position`):
the step open now (between steps, the last one entered), how long since that
step was entered (between steps, since it was left), and ``span``, the innermost
host span or checkpoint opened since then and open now: ``data``, ``checkpoint``, a span of yours, or
``step`` inside a step outside any span (the step's own work: dispatch, device
work, collectives) and ``between_steps`` outside both. A rank hung inside a step
is a growing ``steptrace_open_seconds`` naming where it hangs; the "job stalled"
alert (docs/alerts.md) reads it. One series at a time; span names past the first
32 of a run read ``other``, so a run cannot grow the series without bound. Both
are absent before the first step (start-up and compilation are not a stall).

``steptrace_dropped_records_total`` is read at scrape time from the run's drop
counters (:meth:`PrometheusSink.attach_drop_counter`): records a sink's queue
dropped or its export failed on are ``{sink="<name>", reason="queue_full_or_error"}``;
records a sink could not take, this exporter's malformed ones included, are
``{sink="<name>", reason="invalid_record"}`` (counted like every sink's, through
``invalid_records`` and the SinkWorker, so they are in ``stats()`` and the run
record too); drops before any sink (the resolver's queue, misuse, steps still
unresolved at shutdown, failed device waits, collectives after the last step) are ``{sink="resolver",
reason="<reason>"}``. Before any drop, the resolver's reasons and those of the
sinks that exist are exported at 0; a sink that is not configured has no series.

``steptrace_captures_total`` counts the deep capture records (docs/capture.md) by ``trigger`` and
``status`` (``ok``: a trace taken, ``failed``: the profiler failed to start or stop, ``skipped``);
with capture on, ``ok`` and ``failed`` of each configured trigger exist from the start at 0 (two
series a trigger). With ``capture_token`` the same server takes ``POST /v1/steptrace/capture`` (the
HTTP capture trigger, :class:`CaptureRoute`); without it that path answers 404.
"""

from __future__ import annotations

import hmac
import json
import logging
import collections
import math
import socket
import statistics
import threading
from typing import Any, Callable, Iterable

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import choose_encoder
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "steptrace's Prometheus exporter needs prometheus_client: pip install 'steptrace[prometheus]'"
    ) from _exc

from steptrace._version import __version__
from steptrace._attribution import GoodputTotals, split_step
from steptrace._buckets import CHECKPOINT_BUCKETS_S, MICROBATCH_BUCKETS_S, STEP_BUCKETS_S
from steptrace._capture import CAPTURE_PATH
from steptrace._config import CAPTURE_TRIGGERS, ENV_CAPTURE_TOKEN, ENV_LOCAL_RANK, ENV_PROMETHEUS_ADDR, \
    ENV_PROMETHEUS_PORT
from steptrace._ids import trace_id_hex
from steptrace._schema import usual_drop_reasons

__all__ = ["PrometheusSink"]

log = logging.getLogger("steptrace")

_RUN_LABELS = ("run_id", "rank")
_MAX_SCALAR_NAMES = 64
_MAX_SPAN_NAMES = 32
#: The statuses of a capture record (steptrace/_capture.py): the ``status`` of ``steptrace_captures_total``.
_CAPTURE_STATUSES = ("ok", "failed", "skipped")
#: The largest body ``POST /v1/steptrace/capture`` takes: ``{"reason": "..."}``, the reason cut at 200 characters.
CAPTURE_BODY_MAX_BYTES = 4096


_HEALTH_POLICIES = frozenset(("power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability"))
_HEALTH_ERRORS = (("xid_events", "xid"), ("ecc_uncorrected_volatile_errors", "ecc_uncorrected"),
                  ("remapped_rows_uncorrectable", "remapped_rows"), ("nvlink_errors", "nvlink"))


def _observe(metric: Any, value: float, exemplar: dict[str, str]) -> None:
    """One observation; a Histogram keeps the step's trace id as its bucket's exemplar (a Summary has none)."""
    if isinstance(metric, Histogram):
        metric.observe(value, exemplar)
    else:
        metric.observe(value)


def _drop_labels(reason: str) -> tuple[str, str]:
    """The (sink, reason) labels of a drop reason of ``stats()["dropped"]``."""
    if reason.startswith("sink:"):
        return reason[len("sink:"):], "queue_full_or_error"
    if reason.startswith("invalid:"):
        return reason[len("invalid:"):], "invalid_record"
    if reason.startswith("rejected:"):
        sink, _, why = reason[len("rejected:"):].partition(":")
        return sink, f"rejected:{why}"
    return "resolver", reason


class PrometheusSink:
    """Serves ``/metrics`` for one rank and updates it from every exported record.

    ``port`` is the base port: the server listens on ``port + local_rank``, or on
    an ephemeral port when ``port`` is 0 (read the real one from :attr:`endpoint`).
    Raises ``ValueError`` when the port cannot be bound.
    """

    name = "prometheus"
    instant_flush = True  # metrics are updated in export(): force_flush only says so

    def __init__(self, port: int = 0, *, addr: str = "127.0.0.1", local_rank: int = 0, run_id: str,
                 rank: int = 0, goodput_window_steps: int = 100, peak_tflops: float | None = None,
                 attempt: int = 0, histograms: bool = False, capture_triggers: tuple[str, ...] = (),
                 capture_token: str | None = None):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535 - local_rank:
            raise ValueError(f"prometheus_port must be an integer in [0, 65535 - local_rank], got {port!r}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0, got {peak_tflops!r}")
        #: Bucketed per-rank histograms (``prometheus_histograms``); else ``_sum``/``_count`` only.
        self.histograms = bool(histograms)
        self._run_id = str(run_id)
        self._rank = str(rank)
        self._labels = (self._run_id, self._rank)
        if isinstance(goodput_window_steps, bool) or not isinstance(goodput_window_steps, int) \
                or goodput_window_steps < 1:
            raise ValueError(f"goodput_window_steps must be an integer >= 1, got {goodput_window_steps!r}")
        self._window_steps = goodput_window_steps
        #: Goodput as docs/goodput.md defines it, for this process: own compute / wall from its start.
        self._goodput_totals = GoodputTotals()
        self._wall_exported = 0.0
        self._drop_counter: Callable[[], dict[str, int]] | None = None
        #: Drop reasons exported at 0 before any drop (see _dropped_family).
        self._usual_drops: dict[str, int] = dict.fromkeys(usual_drop_reasons((self.name,)), 0)
        self._position: Callable[[], tuple[int, bool, float, str | None] | None] | None = None
        self._position_failed = False
        self._stalled: tuple[int, bool] | None = None  # the stall the watch reported, until its end
        self._span_names: set[str] = set()
        self._span_lock = threading.Lock()
        # The recent intervals the median gauge reads (the goodput window's length).
        self._intervals: collections.deque[float] = collections.deque(maxlen=goodput_window_steps)
        #: Records skipped as malformed (each dropped alone; the SinkWorker counts ``invalid:prometheus``).
        self.invalid_records = 0
        self._drop_counter_failed = False
        self._backend: str | None = None
        self._lock = threading.Lock()
        self._closed = False

        unknown = [t for t in capture_triggers if t not in CAPTURE_TRIGGERS]
        if unknown:
            raise ValueError(f"capture_triggers: unknown trigger(s) {unknown} (known: {', '.join(CAPTURE_TRIGGERS)})")
        #: The HTTP capture trigger (POST /v1/steptrace/capture), served only with a token.
        self.capture_route = CaptureRoute(capture_token) if capture_token is not None else None
        self._metrics = CollectorRegistry()
        self._define_metrics(peak_tflops)
        # With capture on, a trace taken and a failure of each configured trigger read 0 before the first
        # (increase() cannot see the first count of a series that appears with it); skips appear when they do.
        for trigger in capture_triggers:
            for status in ("ok", "failed"):
                self._captures.labels(*self._labels, trigger, status)
        # Counters restart with each attempt (a new process); Prometheus's reset handling expects that.
        self._attempt.labels(*self._labels).set(attempt)
        # The served registry wraps ours: it drops `_created` series (which would double the series
        # count of every counter; the switch in prometheus_client is process-global and would change
        # the user's own metrics) and adds the drop counters, read at scrape time.
        served = CollectorRegistry()
        served.register(_Exposition(self))

        bind_port = port + local_rank if port else 0
        try:
            self._server = MetricsServer(addr, bind_port, served, capture=self.capture_route)
        except OSError as exc:
            raise _bind_error(exc, addr, port, local_rank) from exc
        bound = self._server.port
        host = f"[{addr}]" if ":" in addr else addr
        #: The URL Prometheus should scrape (with the real port when ``port`` was 0).
        self.endpoint = f"http://{host}:{bound}/metrics"
        #: The port actually bound.
        self.port = bound

    @classmethod
    def from_config(cls, config: Any) -> "PrometheusSink":
        """The sink ``steptrace.init`` builds when ``prometheus_port`` is set."""
        return cls(config.prometheus_port, addr=config.prometheus_addr, local_rank=config.local_rank,
                   run_id=config.run_id, rank=config.rank, goodput_window_steps=config.goodput_window_steps,
                   peak_tflops=config.peak_tflops, attempt=config.attempt,
                   histograms=config.prometheus_histograms, capture_triggers=tuple(config.capture),
                   capture_token=config.capture_token)

    def _define_metrics(self, peak_tflops: float | None) -> None:
        reg = self._metrics
        run = _RUN_LABELS

        def histogram(name: str, doc: str, extra: tuple[str, ...] = (),
                      buckets: tuple[float, ...] = STEP_BUCKETS_S) -> Histogram | Summary:
            # ~20 buckets per rank and label set is what grows a big job's Prometheus (ranks x
            # buckets series); by default a rank serves _sum and _count only (a Summary without
            # quantiles) and the distribution across ranks is taken where all ranks are seen.
            if self.histograms:
                return Histogram(name, doc, run + extra, registry=reg, buckets=buckets)
            return Summary(name, doc, run + extra, registry=reg)

        self._interval = histogram("steptrace_step_interval_seconds",
                                   "Wall time per step: device end of the previous step to device end of this one.")
        self._compute = histogram("steptrace_step_compute_seconds", "Device busy time per step.")
        self._idle = Counter("steptrace_step_idle_seconds", "Device idle time within steps, by the host "
                             "activity that covered it (checkpoint, data, compile, eval, other, user spans), "
                             "less the time waiting for other ranks in collectives in it.",
                             run + ("reason",), registry=reg)
        self._collective_wait = Counter("steptrace_step_collective_wait_seconds", "Step time spent waiting "
                                        "for other ranks in collectives (steps that measure it).", run, registry=reg)
        self._own = Counter("steptrace_step_own_seconds", "Step time on this rank's own: interval minus the "
                            "wait in collectives (steps that measure it).", run, registry=reg)
        # NCCL collectives timed on the device (steptrace.adapters.torch_distributed): a rank's own
        # record holds its exposed communication, but not its wait for peers (that needs the other
        # ranks' durations, joined offline). Created at the first step that carries it: a rank
        # without device-timed collectives serves no series.
        self._exposed_communication = Counter(
            "steptrace_step_exposed_communication_seconds", "Step time the device stream waited on "
            "collectives with no compute to overlap (exposed communication, HolisticTraceAnalysis's sense: "
            "the wait for the latest peer and the transfer; NCCL collectives timed on the device).", run,
            registry=reg)
        self._steps = Counter("steptrace_steps", "Steps finalized, by status (ok, error).",
                              run + ("status",), registry=reg)
        self._last_step = Gauge("steptrace_last_step", "Number of the last finalized step.", run, registry=reg)
        self._attempt = Gauge("steptrace_attempt", "Which process start of the run this rank is (0 for the first; "
                              "see docs/goodput.md).", run, registry=reg)
        self._tokens = Counter("steptrace_tokens", "Tokens processed by this rank.", run, registry=reg)
        self._tokens_per_second = Gauge("steptrace_tokens_per_second",
                                        "Tokens per second of wall time (interval) in the last step.",
                                        run, registry=reg)
        self._tflops = Gauge("steptrace_tflops_per_second",
                             "TFLOP/s per device over device compute time in the last step.", run, registry=reg)
        self._peak_tflops = peak_tflops
        # The parts travel with the ratios: MFU = model FLOPs / compute / peak, HFU the same of
        # hardware FLOPs, each part a series of its own.
        self._step_flops = Gauge("steptrace_step_flops", "FLOPs per device in the last step: model (what the "
                                 "model needs) and hardware (what the device executed, from the compiler).",
                                 run + ("kind",), registry=reg)
        self._peak = Gauge("steptrace_peak_flops", "The device's dense bf16 peak FLOP/s MFU and HFU divide by "
                           "(configured peak_tflops, else steptrace's table for the device kind).", run,
                           registry=reg)
        self._mfu = Gauge("steptrace_mfu", "Model FLOPs utilization in the last step: model FLOPs / compute "
                          "seconds / peak FLOP/s.", run, registry=reg)
        self._hfu = Gauge("steptrace_hfu", "Hardware FLOPs utilization in the last step: hardware FLOPs / "
                          "compute seconds / peak FLOP/s.", run, registry=reg)
        self._productive = Counter("steptrace_productive_seconds", "Own compute of this process's steps: "
                                   "compute less the time waiting for other ranks in collectives (goodput's "
                                   "numerator).", run, registry=reg)
        self._wall = Counter("steptrace_wall_seconds", "Wall time of this process from its start to its latest "
                             "record's end (goodput's denominator).", run, registry=reg)
        self._bubble = Gauge("steptrace_pipeline_bubble_ratio", "1 - microbatch compute / pipeline window per "
                             "pipeline stage, in the last step with microbatches.", run + ("stage",), registry=reg)
        self._microbatch = histogram("steptrace_microbatch_seconds", "Device compute time per pipeline "
                                     "microbatch ('' for no stage or chunk).", ("kind", "stage", "chunk"),
                                     MICROBATCH_BUCKETS_S)
        self._ckpt_blocking = histogram("steptrace_checkpoint_blocking_seconds", "Training time blocked per "
                                        "checkpoint save (host time after the saved step's device work ended).",
                                        buckets=CHECKPOINT_BUCKETS_S)
        self._ckpt_async = histogram("steptrace_checkpoint_async_seconds",
                                     "Background commit time per asynchronous checkpoint save.",
                                     buckets=CHECKPOINT_BUCKETS_S)
        self._checkpoints = Counter("steptrace_checkpoints", "Checkpoint saves finalized, by status "
                                    "(ok, error, incomplete).", run + ("status",), registry=reg)
        self._scalar = Gauge("steptrace_step_scalar", "Scalars the last step logged with s.log(name=value) "
                             f"(the first {_MAX_SCALAR_NAMES} names).", run + ("name",), registry=reg)
        self._scalar_names: set[str] = set()
        self._memory = Gauge("steptrace_device_memory_bytes", "Device memory after the last step: in use, "
                             "peak, and the device's limit.", run + ("kind",), registry=reg)
        # GPU health (health="nvml", docs/health.md): NVML's units converted to Prometheus' base units.
        self._gpu_violation = Counter("steptrace_gpu_violation_seconds", "Time an NVML perf policy held the GPU's "
                                      "clocks down (nvmlDeviceGetViolationStatus), by policy.", run + ("policy",),
                                      registry=reg)
        self._gpu_energy = Counter("steptrace_gpu_energy_joules", "GPU energy used (NVML's mJ counter) over the "
                                   "health windows.", run, registry=reg)
        self._gpu_power = Gauge("steptrace_gpu_power_watts", "GPU power, mean of the last health window (NVML "
                                "reports mW).", run, registry=reg)
        self._gpu_sm_clock = Gauge("steptrace_gpu_sm_clock_hertz", "SM clock, mean of the last health window.", run,
                                   registry=reg)
        self._gpu_memory_clock = Gauge("steptrace_gpu_memory_clock_hertz", "Memory clock, mean of the last health "
                                       "window.", run, registry=reg)
        self._gpu_temperature = Gauge("steptrace_gpu_temperature_celsius", "GPU temperature, max of the last "
                                      "health window.", run, registry=reg)
        self._gpu_reasons = Gauge("steptrace_gpu_clocks_event_reasons", "NVML clocks-event reasons of the last "
                                  "health window, OR-ed (a bitmask; GpuIdle masked, a lone HwSlowdown dropped).", run,
                                  registry=reg)
        self._gpu_errors = Counter("steptrace_gpu_errors", "GPU errors seen by the health sampler, by kind: xid "
                                   "(events; NVML coalesces bursts), ecc_uncorrected (volatile), remapped_rows "
                                   "(uncorrectable), nvlink.", run + ("kind",), registry=reg)
        # Host pauses (pauses=True, docs/pauses.md): 7 series, created by the first step that has them. The part
        # of a collection charged as idle time is steptrace_step_idle_seconds_total{reason="gc"}.
        self._pause_seconds = Counter("steptrace_host_pause_seconds", "Time the training thread was paused on the "
                                      "host, by cause: gc (every collection on it, charged or hidden), preempted "
                                      "(its run-queue wait).", run + ("cause",), registry=reg)
        self._gc_collections = Counter("steptrace_gc_collections", "Garbage collections on the training thread, by "
                                       "generation.", run + ("generation",), registry=reg)
        self._major_faults = Counter("steptrace_major_faults", "Major page faults of the training thread.", run,
                                     registry=reg)
        self._involuntary_switches = Counter("steptrace_involuntary_switches", "Involuntary context switches of the "
                                             "training thread (the kernel took its CPU away).", run, registry=reg)
        self._info = Info("steptrace", "steptrace version and the device backend timing the steps.", run,
                          registry=reg)
        self._interval_median = Gauge("steptrace_step_interval_median_seconds", "Median interval of the last "
                                      f"{self._window_steps} steps: the run's pace, which the stall alert "
                                      "scales.", run, registry=reg)

        self._captures = Counter("steptrace_captures", "Deep captures (profiler traces, docs/capture.md) by the "
                                 "trigger that armed them and status: ok (a trace taken), failed (the profiler "
                                 "failed to start or stop), skipped (cooldown, budget, your own profiler).",
                                 run + ("trigger", "status"), registry=reg)

        # Series that exist from the start read as 0 instead of missing, so rate() and sum() work
        # before the first step (and a run with no errors still has an error series).
        labels = self._labels
        for status in ("ok", "error"):
            self._steps.labels(*labels, status)
        for status in ("ok", "error", "incomplete"):
            self._checkpoints.labels(*labels, status)
        self._interval.labels(*labels)
        self._compute.labels(*labels)
        self._productive.labels(*labels)
        self._wall.labels(*labels)
        self._set_info("")

    def _set_info(self, backend: str) -> None:
        self._backend = backend
        self._info.labels(*self._labels).info({"version": __version__, "backend": backend})

    def attach_drop_counter(self, fn: Callable[[], dict[str, int]]) -> None:
        """Publish ``fn()`` (reason → records dropped) as ``steptrace_dropped_records_total``.

        ``steptrace.init`` attaches the run's counters; ``fn`` is called at scrape time. The
        resolver's reasons, and those of the sinks ``fn.sink_names`` names (a
        :class:`~steptrace._sinks.DropCounter`; this sink alone otherwise), are exported at 0
        until something is dropped; a sink that does not exist gets no series.
        """
        self._drop_counter = fn
        names = tuple(getattr(fn, "sink_names", ())) or (self.name,)
        self._usual_drops = dict.fromkeys(usual_drop_reasons(names), 0)

    def attach_capture(self, arm: Callable[[str], bool]) -> None:
        """Serve the HTTP capture trigger with ``arm(reason)`` (whether it armed the next capture).

        ``steptrace.init`` attaches the run's capture when its triggers include ``request``; without a
        ``capture_token`` there is no route and this does nothing.
        """
        if self.capture_route is not None:
            self.capture_route.arm = arm

    def attach_position(self, fn: Callable[[], tuple[int, bool, float, str | None] | None]) -> None:
        """Publish where the training thread is (``steptrace_current_step``, ``steptrace_open_seconds``).

        ``fn()`` returns ``(step, in_step, seconds, span)`` or None (see
        :meth:`steptrace._runtime.Runtime.position`); ``steptrace.init`` attaches the run's
        runtime; ``fn`` is called at scrape time.
        """
        self._position = fn

    # -- export (the sink's own thread) ------------------------------------------------------------

    def export(self, records: list[dict[str, Any]]) -> None:
        """Update the metrics from finalized records; unknown types are ignored, malformed ones skipped."""
        steps = False
        for record in records:
            kind = record.get("type") if isinstance(record, dict) else None
            handler = self._HANDLERS.get(kind)
            if handler is None:
                continue
            try:
                handler(self, record)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                # Raising would make the worker drop the whole batch; skip just this record.
                self.invalid_records += 1
                if self.invalid_records == 1:
                    log.warning("steptrace prometheus: skipping a malformed %s record (%r); further ones are "
                                "counted in steptrace_dropped_records_total{reason=\"invalid_record\"}", kind, exc)
                continue
            steps = steps or kind == "step"
            end = record.get("end_time") if kind in ("step", "checkpoint", "span", "microbatch") else None
            if isinstance(end, (int, float)) and not isinstance(end, bool):
                self._goodput_totals.ended(float(end))
        # Once per batch, not per record: only the value at scrape time matters.
        totals = self._goodput_totals
        if totals.wall_seconds > self._wall_exported:
            self._wall.labels(*self._labels).inc(totals.wall_seconds - self._wall_exported)
            self._wall_exported = totals.wall_seconds
        if steps and self._intervals:
            self._interval_median.labels(*self._labels).set(statistics.median(self._intervals))

    def _step(self, r: dict[str, Any]) -> None:
        # Read and check everything first, so a bad field skips the record without half-applying it.
        step = _int(r["step"])
        status = str(r["status"])
        interval = _seconds(r["interval_seconds"])
        compute = _seconds(r["compute_seconds"])
        idle = {str(k): _seconds(v) for k, v in (r.get("idle_breakdown") or {}).items()}
        wait = _optional(r.get("collective_wait_seconds"), nonnegative=True)
        own = _optional(r.get("own_seconds"), nonnegative=True)
        exposed = _optional(r.get("exposed_communication_seconds"), nonnegative=True)
        wait_idle = {str(k): _seconds(v) for k, v in (r.get("collective_wait_idle_breakdown") or {}).items()}
        # Waiting shown as waiting: own compute + wait + host idle by reason = interval.
        split = split_step(compute, idle, wait if own is not None else None,
                           _optional(r.get("own_compute_seconds"), nonnegative=True),
                           wait_idle if "collective_wait_idle_breakdown" in r else None)
        host_start = _optional(r.get("host_start_time"))
        first_entry = None if host_start is None else host_start - (_optional(r.get("before_step_seconds")) or 0.0)
        tokens = _optional(r.get("tokens"), nonnegative=True)
        tokens_per_second = _optional(r.get("tokens_per_second"))
        tflops = _optional(r.get("tflops_per_second"))
        mfu = _optional(r.get("mfu"))
        hfu = _optional(r.get("hfu"))
        # Records written before model_flops existed carry their model FLOPs as `flops`.
        model_flops = _optional(r.get("model_flops") if "model_flops" in r else r.get("flops"), nonnegative=True)
        hardware_flops = _optional(r.get("hardware_flops"), nonnegative=True)
        peak = _optional(r.get("peak_flops"))
        if peak is None and self._peak_tflops is not None:
            peak = self._peak_tflops * 1e12
            if mfu is None and model_flops is not None and compute > 0:
                mfu = model_flops / compute / peak
            if hfu is None and hardware_flops is not None and compute > 0:
                hfu = hardware_flops / compute / peak
        bubble = {str(k): float(v) for k, v in (r.get("pipeline_bubble_ratio") or {}).items()}
        scalars = {str(k): float(v) for k, v in (r.get("scalars") or {}).items()}
        memory = {str(k).removesuffix("_bytes"): float(v) for k, v in (r.get("device_memory") or {}).items()
                  if str(k).endswith("_bytes")}
        trace_id = r.get("trace_id")
        if not (isinstance(trace_id, str) and len(trace_id) == 32):
            # prometheus_client checks an exemplar only after counting the observation: never pass a bad one.
            trace_id = trace_id_hex(self._run_id, step)
        exemplar = {"trace_id": trace_id}
        backend = r.get("backend")

        labels = self._labels
        _observe(self._interval.labels(*labels), interval, exemplar)
        _observe(self._compute.labels(*labels), compute, exemplar)
        for reason, seconds in split.idle_breakdown.items():
            self._idle.labels(*labels, reason).inc(seconds)
        self._productive.labels(*labels).inc(split.own_compute_seconds)
        self._goodput_totals.step(split.own_compute_seconds, first_entry)
        if wait is not None and own is not None:
            self._collective_wait.labels(*labels).inc(wait)
            self._own.labels(*labels).inc(own)
        if exposed is not None:
            self._exposed_communication.labels(*labels).inc(exposed)
        self._steps.labels(*labels, status).inc()
        self._last_step.labels(*labels).set(step)
        if tokens is not None:
            self._tokens.labels(*labels).inc(tokens)
        if tokens_per_second is not None:
            self._tokens_per_second.labels(*labels).set(tokens_per_second)
        if tflops is not None:
            self._tflops.labels(*labels).set(tflops)
        if model_flops is not None:
            self._step_flops.labels(*labels, "model").set(model_flops)
        if hardware_flops is not None:
            self._step_flops.labels(*labels, "hardware").set(hardware_flops)
        if peak is not None:
            self._peak.labels(*labels).set(peak)
        if mfu is not None:
            self._mfu.labels(*labels).set(mfu)
        if hfu is not None:
            self._hfu.labels(*labels).set(hfu)
        for stage, ratio in bubble.items():
            self._bubble.labels(*labels, stage).set(ratio)
        for name, value in scalars.items():
            # Names are the user's: cap the series a run can create.
            if name in self._scalar_names or len(self._scalar_names) < _MAX_SCALAR_NAMES:
                self._scalar_names.add(name)
                self._scalar.labels(*labels, name).set(value)
        for kind, value in memory.items():
            self._memory.labels(*labels, kind).set(value)
        if isinstance(r.get("health"), dict):
            self._health(r["health"])
        if isinstance(r.get("host_pauses"), dict):
            self._pauses(r["host_pauses"])
        if isinstance(backend, str) and backend != self._backend:
            self._set_info(backend)
        self._intervals.append(interval)

    def _pauses(self, p: dict[str, Any]) -> None:
        """A step's host pauses (docs/pauses.md); a null (unmeasured) counter leaves its series alone."""
        labels = self._labels
        # Every value is checked before any series moves: a bad record is dropped whole (ValueError).
        gc_seconds = _optional(p.get("gc_seconds"), nonnegative=True)
        preempted = _optional(p.get("preempted_seconds"), nonnegative=True)
        faults = _optional(p.get("major_faults"), nonnegative=True)
        switches = _optional(p.get("involuntary_switches"), nonnegative=True)
        collections = p.get("gc_collections") or ()
        counts = [_optional(c, nonnegative=True) or 0.0 for c in list(collections)[:3]]
        if gc_seconds is not None:
            self._pause_seconds.labels(*labels, "gc").inc(gc_seconds)
        if preempted is not None:
            self._pause_seconds.labels(*labels, "preempted").inc(preempted)
        for generation, count in enumerate(counts):
            self._gc_collections.labels(*labels, str(generation)).inc(count)
        if faults is not None:
            self._major_faults.labels(*labels).inc(faults)
        if switches is not None:
            self._involuntary_switches.labels(*labels).inc(switches)

    def _health(self, h: dict[str, Any]) -> None:
        """A GPU health window (docs/health.md): counters add its deltas, gauges show it; a null
        (unsupported) field leaves its series alone. 16 series at most, created by the first window."""
        labels = self._labels
        # Every value is checked before any series moves: a bad window is dropped whole (ValueError).
        violation = {str(p): _optional(ms, nonnegative=True) for p, ms in (h.get("violation_ms") or {}).items()
                     if str(p) in _HEALTH_POLICIES}
        values = {field: _optional(h.get(field), nonnegative=True)
                  for field in ("energy_joules", "power_watts_mean", "sm_clock_mhz_mean", "memory_clock_mhz_mean",
                                "temperature_c_max", "clocks_event_reasons")}
        errors = {kind: _optional(h.get(field), nonnegative=True) for field, kind in _HEALTH_ERRORS}
        for policy, ms in violation.items():
            if ms is not None:
                self._gpu_violation.labels(*labels, policy).inc(ms / 1e3)
        if values["energy_joules"] is not None:
            self._gpu_energy.labels(*labels).inc(values["energy_joules"])
        for field, series, scale in (("power_watts_mean", self._gpu_power, 1.0),
                                     ("sm_clock_mhz_mean", self._gpu_sm_clock, 1e6),
                                     ("memory_clock_mhz_mean", self._gpu_memory_clock, 1e6),
                                     ("temperature_c_max", self._gpu_temperature, 1.0),
                                     ("clocks_event_reasons", self._gpu_reasons, 1.0)):
            value = values[field]
            if value is not None:
                series.labels(*labels).set(value * scale)
        for kind, count in errors.items():
            if count is not None:
                self._gpu_errors.labels(*labels, kind).inc(count)

    def _checkpoint(self, r: dict[str, Any]) -> None:
        step = _int(r["step"])
        status = str(r["status"])
        blocking = _seconds(r["blocking_seconds"])
        async_seconds = _optional(r.get("async_seconds"), nonnegative=True)
        exemplar = {"trace_id": trace_id_hex(self._run_id, step)}

        labels = self._labels
        self._checkpoints.labels(*labels, status).inc()
        _observe(self._ckpt_blocking.labels(*labels), blocking, exemplar)
        if async_seconds is not None:
            _observe(self._ckpt_async.labels(*labels), async_seconds, exemplar)

    def _microbatch(self, r: dict[str, Any]) -> None:
        step = _int(r["step"])
        compute = _seconds(r["compute_seconds"])
        kind = str(r["kind"])
        stage = "" if r.get("stage") is None else str(r["stage"])
        chunk = "" if r.get("chunk") is None else str(r["chunk"])
        exemplar = {"trace_id": trace_id_hex(self._run_id, step)}
        _observe(self._microbatch.labels(*self._labels, kind, stage, chunk), compute, exemplar)

    def _stall(self, record: dict[str, Any]) -> None:
        self._stalled = (record["step"], bool(record["in_step"]))

    def _stall_end(self, record: dict[str, Any]) -> None:
        if self._stalled == (record["step"], bool(record["in_step"])):
            self._stalled = None

    def _attempt_record(self, record: dict[str, Any]) -> None:
        self._goodput_totals.started(_seconds(record["start_time"]))

    def _capture_record(self, record: dict[str, Any]) -> None:
        trigger, status = record["trigger"], record["status"]
        # Label values from a record: only the known ones, so a bad record cannot grow the series.
        if trigger not in CAPTURE_TRIGGERS or status not in _CAPTURE_STATUSES:
            raise ValueError(f"a capture record with trigger {trigger!r} and status {status!r}")
        self._captures.labels(*self._labels, trigger, status).inc()

    _HANDLERS: dict[Any, Callable[["PrometheusSink", dict[str, Any]], None]] = {
        "step": _step, "checkpoint": _checkpoint, "microbatch": _microbatch, "stall": _stall,
        "stall_end": _stall_end, "attempt": _attempt_record, "capture": _capture_record,
    }

    # -- scrape (the HTTP server's threads) --------------------------------------------------------

    def _dropped_family(self) -> CounterMetricFamily:
        family = CounterMetricFamily("steptrace_dropped_records", "Records dropped instead of exported, by the "
                                     "sink that dropped them ('resolver' before any sink) and the reason.",
                                     labels=_RUN_LABELS + ("sink", "reason"))
        counts: dict[str, int] = {}
        if self._drop_counter is not None:
            try:
                counts = dict(self._drop_counter())
            except Exception:
                if not self._drop_counter_failed:
                    self._drop_counter_failed = True
                    log.exception("steptrace prometheus: reading the drop counters failed")
        # The usual reasons are always present, at 0 until something is dropped: Prometheus's
        # increase() cannot see the first count of a series that appears with it.
        counts = {**self._usual_drops, **counts}
        for reason, count in sorted(counts.items()):
            family.add_metric([*self._labels, *_drop_labels(reason)], count)
        return family

    def _position_families(self) -> list[GaugeMetricFamily]:
        position = None
        if self._position is not None:
            try:
                position = self._position()
            except Exception:
                if not self._position_failed:
                    self._position_failed = True
                    log.exception("steptrace prometheus: reading the training thread's position failed")
        if position is None:
            return []
        step, in_step, seconds, span = position
        if span is None:
            span = "step" if in_step else "between_steps"
        else:
            with self._span_lock:
                # Span names are the user's: cap the label values a run can create.
                if span not in self._span_names:
                    if len(self._span_names) < _MAX_SPAN_NAMES:
                        self._span_names.add(span)
                    else:
                        span = "other"
        current = GaugeMetricFamily("steptrace_current_step", "The step open on the training thread now; "
                                    "between steps, the last one entered.", labels=_RUN_LABELS)
        current.add_metric(list(self._labels), step)
        opened = GaugeMetricFamily("steptrace_open_seconds", "Seconds since the open step was entered (between "
                                   "steps: since the last one was left); span: where the training thread is now "
                                   "(the innermost open span, 'step' for the step's own work, "
                                   "'between_steps').", labels=_RUN_LABELS + ("span",))
        opened.add_metric([*self._labels, span], seconds)
        stall = GaugeMetricFamily("steptrace_stall_seconds", "Seconds the rank has been stuck where the stall watch "
                                  "found it (a stall record with every thread's stack is in the run file); 0 unless "
                                  "a stall is open. span as for steptrace_open_seconds.",
                                  labels=_RUN_LABELS + ("span",))
        stall.add_metric([*self._labels, span], seconds if self._stalled == (step, in_step) else 0.0)
        return [current, opened, stall]

    # -- protocol ----------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float) -> bool:
        """Metrics are updated in ``export``; a scrape sees them at once."""
        return True

    def shutdown(self, timeout_s: float) -> None:
        """Stop serving and free the port (later calls are no-ops)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.close(timeout_s)


class MetricsServer:
    """``/metrics`` on a server with bounds, in place of ``prometheus_client.start_http_server``.

    That one keeps a thread per connection with no timeout: 2,000 idle connections made
    2,005 threads, and under a container's pids limit the training process died. Here one
    thread accepts and waits, in a selector, for each connection's first bytes; ``workers``
    threads read and answer the requests that arrive; at most ``max_connections`` connections are
    held at once (half of them from one peer address), the rest closed at accept; a
    connection must send its request within ``timeout_s`` or is closed. One request per
    connection (HTTP/1.0, as Prometheus scrapes); ``GET``/``HEAD`` of any path serves
    prometheus_client's exposition of ``registry`` (text or OpenMetrics by ``Accept``,
    ``name[]`` filters, gzip by ``Accept-Encoding``), but ``/v1/steptrace/capture``: ``POST`` there
    is the HTTP capture trigger when ``capture`` (a :class:`CaptureRoute`) is given, its body
    (at most ``CAPTURE_BODY_MAX_BYTES``) read within the same ``timeout_s``; 404 without one.
    """

    def __init__(self, addr: str, port: int, registry: Any, *, workers: int = 4, max_connections: int = 32,
                 timeout_s: float = 5.0, capture: "CaptureRoute | None" = None):
        self._registry = registry
        self._capture = capture
        self._timeout_s = timeout_s
        self._max = max_connections
        self._per_peer = max(1, max_connections // 2)
        self._held: dict[str, int] = {}
        self._held_lock = threading.Lock()
        #: Connections closed at accept because the bounds were reached.
        self.refused = 0
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((addr, port))
            self._sock.listen(64)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="steptrace-metrics")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="steptrace-metrics-accept", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(max(0.0, timeout_s))
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        # Connections wait for their request here, in one selector, not in a thread each; a
        # worker is given only to a connection that has sent something.
        import selectors
        import time

        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        waiting: dict[socket.socket, tuple[str, float]] = {}
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(0.2):
                    if key.fileobj is self._sock:
                        self._take(selector, waiting)
                        continue
                    conn = key.fileobj
                    selector.unregister(conn)
                    host, deadline = waiting.pop(conn)  # type: ignore[call-overload]
                    try:
                        self._pool.submit(self._serve, conn, host, deadline)
                    except RuntimeError:  # the pool is shut down
                        conn.close()  # type: ignore[union-attr]
                        self._release(host)
                now = time.monotonic()
                for conn, (host, deadline) in list(waiting.items()):
                    if deadline <= now:  # idle past the timeout
                        selector.unregister(conn)
                        del waiting[conn]
                        conn.close()
                        self._release(host)
        finally:
            for conn, (host, _) in waiting.items():
                conn.close()
                self._release(host)
            selector.close()

    def _take(self, selector: Any, waiting: dict[socket.socket, tuple[str, float]]) -> None:
        import selectors
        import time

        try:
            conn, peer = self._sock.accept()
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            time.sleep(0.05)  # out of descriptors: do not spin
            return
        host = peer[0] if isinstance(peer, tuple) else ""
        with self._held_lock:
            ok = sum(self._held.values()) < self._max and self._held.get(host, 0) < self._per_peer
            if ok:
                self._held[host] = self._held.get(host, 0) + 1
        if not ok:
            self.refused += 1
            conn.close()
            return
        conn.setblocking(False)
        waiting[conn] = (host, time.monotonic() + self._timeout_s)
        selector.register(conn, selectors.EVENT_READ)

    def _release(self, host: str) -> None:
        with self._held_lock:
            left = self._held.get(host, 1) - 1
            if left > 0:
                self._held[host] = left
            else:
                self._held.pop(host, None)

    def _serve(self, conn: socket.socket, host: str, deadline: float) -> None:
        import time

        try:
            conn.setblocking(True)
            data = b""
            while b"\r\n\r\n" not in data and b"\n\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0 or len(data) > 16384:
                    return
                conn.settimeout(left)
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.settimeout(self._timeout_s)
            conn.sendall(self._answer(data, conn, host, deadline))
        except OSError:
            pass
        finally:
            conn.close()
            self._release(host)

    def _answer(self, data: bytes, conn: socket.socket | None = None, host: str = "", deadline: float = 0.0) -> bytes:
        import gzip
        from urllib.parse import parse_qs, urlsplit

        # The head ends at the first blank line; what follows is the start of a body (a capture request's).
        ends = [(i, len(sep)) for sep in (b"\r\n\r\n", b"\n\n") if (i := data.find(sep)) >= 0]
        end, sep_len = min(ends) if ends else (len(data), 0)
        head, body = data[:end], data[end + sep_len:]
        lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
        parts = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                headers[key.strip().lower()] = value.strip()
        if len(parts) == 3 and urlsplit(parts[1]).path == CAPTURE_PATH:
            return self._capture_answer(parts[0], headers, body, conn, host, deadline)
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            return b"HTTP/1.0 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\n\r\n"
        registry = self._registry
        names = parse_qs(urlsplit(parts[1]).query).get("name[]")
        if names:
            registry = registry.restricted_registry(names)
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(registry)
        except Exception:
            log.exception("steptrace prometheus: building the exposition failed")
            return b"HTTP/1.0 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
        extra = ""
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            extra = "Content-Encoding: gzip\r\n"
        head = (f"HTTP/1.0 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}"
                "Connection: close\r\n\r\n").encode()
        return head if parts[0] == "HEAD" else head + body

    def _capture_answer(self, method: str, headers: dict[str, str], body: bytes, conn: socket.socket | None,
                        host: str, deadline: float) -> bytes:
        """``/v1/steptrace/capture``: the HTTP capture trigger (docs/capture.md). The body (bounded) is read
        before any answer: closing a socket with unread data resets it, and the client would see the reset
        instead of the answer."""
        import time

        if "chunked" in headers.get("transfer-encoding", "").lower():
            return self._refuse_unread(conn, deadline, _json_reply(
                411, {"error": "chunked bodies are not accepted: send Content-Length"}))
        declared = headers.get("content-length", "0").strip()
        if not (declared.isascii() and declared.isdigit()) or len(declared) > 12:  # "²".isdigit(): int() refuses it
            return self._refuse_unread(conn, deadline, _json_reply(
                400, {"error": "Content-Length must be a number of bytes"}))
        length = int(declared)
        if length > CAPTURE_BODY_MAX_BYTES:
            return self._refuse_unread(conn, deadline, _json_reply(
                413, {"error": f"body of {length} bytes: at most {CAPTURE_BODY_MAX_BYTES} ({{\"reason\": \"...\"}})"}))
        while len(body) < length and conn is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return _json_reply(408, {"error": f"the body did not arrive within {self._timeout_s:g} s"})
            conn.settimeout(left)
            chunk = conn.recv(length - len(body))
            if not chunk:
                return b""  # the client went away
            body += chunk
        if conn is not None:
            conn.settimeout(self._timeout_s)  # the answer's send gets the usual time, not what was left
        route = self._capture
        if route is None:
            return _json_reply(404, {"error": f"the HTTP capture trigger is off on this rank: it needs capture with "
                                              f"'request' and a capture_token ({ENV_CAPTURE_TOKEN})"})
        if method != "POST":
            return _json_reply(405, {"error": f"{method[:16]} {CAPTURE_PATH}: use POST"}, "Allow: POST\r\n")
        if not route.authorized(headers.get("authorization")):
            return _json_reply(401, {"error": "missing or wrong bearer token (capture_token)"},
                               'WWW-Authenticate: Bearer realm="steptrace-capture"\r\n')
        status, answer = route.request(body[:length], host)
        return _json_reply(status, answer)

    def _refuse_unread(self, conn: socket.socket | None, deadline: float, reply: bytes) -> bytes:
        """Answer a request whose body is not read, then read (and drop) what the client still sends, up to
        64 KiB until the deadline, so that closing does not reset the connection before it read the answer."""
        import time

        if conn is None:
            return reply
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < 65536:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            chunk = conn.recv(16384)
            if not chunk:
                break
            drained += len(chunk)
        return b""


_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required", 413: "Content Too Large",
            503: "Service Unavailable"}


def _json_reply(status: int, payload: dict[str, Any], extra: str = "") -> bytes:
    body = json.dumps(payload).encode()
    return (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\n{extra}Connection: close\r\n\r\n").encode() + body


class CaptureRoute:
    """The HTTP capture trigger: ``POST /v1/steptrace/capture`` with ``Authorization: Bearer <capture_token>``
    and an optional JSON body ``{"reason": "..."}`` arms the next capture, as ``steptrace.request_capture``
    does (the ``request`` trigger; its cooldown and budgets bound what requests can make the rank do).

    Answers: 202 ``{"armed": true}``; 200 ``{"armed": false, ...}`` when a capture armed or running already
    covers it; 400 for a body that is not that object; 401 without the token (compared in constant time);
    503 before the run's capture is attached. The recorded reason names the peer address.
    """

    def __init__(self, token: str):
        self._token = token.encode()
        #: ``reason -> armed``; attached by ``steptrace.init`` (:meth:`PrometheusSink.attach_capture`).
        self.arm: Callable[[str], bool] | None = None
        #: Requests that armed a capture, and those refused (unauthorized or malformed).
        self.armed = 0
        self.refused = 0

    def authorized(self, header: str | None) -> bool:
        scheme, _, credentials = (header or "").strip().partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self._token)
        if not ok:
            self.refused += 1
        return ok

    def request(self, body: bytes, peer: str) -> tuple[int, dict[str, Any]]:
        reason = ""
        if body.strip():
            try:
                payload = json.loads(body)
            except ValueError:  # UnicodeDecodeError included
                payload = None
            if not isinstance(payload, dict) or set(payload) - {"reason"} or \
                    not isinstance(payload.get("reason", ""), str):
                self.refused += 1
                return 400, {"error": 'the body must be empty or a JSON object {"reason": "<text>"}'}
            reason = payload.get("reason", "")
        arm = self.arm
        if arm is None:
            return 503, {"error": "capture is not running on this rank"}
        said = f"HTTP request from {peer or 'a local socket'}" + (f": {reason}" if reason else "")
        if arm(said[:200]):
            self.armed += 1
            return 202, {"armed": True}
        return 200, {"armed": False, "why": "a capture already armed or running covers this request"}


class _Exposition:
    """What ``/metrics`` serves: the sink's metrics without ``_created`` samples, the drop counters and
    the training thread's position."""

    def __init__(self, sink: PrometheusSink):
        self._sink = sink

    def collect(self) -> Iterable[Any]:
        for family in self._sink._metrics.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family
        yield self._sink._dropped_family()
        yield from self._sink._position_families()


def _bind_error(exc: OSError, addr: str, port: int, local_rank: int) -> ValueError:
    """The setup error for a port that cannot be bound, naming the settings that chose it."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror):
        return ValueError(f"prometheus_addr: cannot serve /metrics on {addr!r}: {reason}. Set "
                          f"init(prometheus_addr=...) or {ENV_PROMETHEUS_ADDR}")
    where = f"port {port}"
    if port and local_rank:
        where = (f"port {port + local_rank} (prometheus_port {port} + local_rank {local_rank}: each rank on "
                 f"a host serves its own port; local_rank comes from {ENV_LOCAL_RANK} or LOCAL_RANK)")
    return ValueError(f"prometheus_port: cannot serve /metrics on {addr}, {where}: {reason}. Choose a free "
                      f"port with init(prometheus_port=...) or {ENV_PROMETHEUS_PORT}, or 0 for any free port")


def _seconds(value: Any) -> float:
    """A duration from a record: a finite number >= 0 (a negative one would break the counters)."""
    seconds = float(value)
    if not 0 <= seconds < math.inf:
        raise ValueError(f"expected a duration >= 0, got {value!r}")
    return seconds


def _optional(value: Any, nonnegative: bool = False) -> float | None:
    if value is None:
        return None
    number = float(value)
    if math.isnan(number) or (nonnegative and not 0 <= number < math.inf):
        raise ValueError(f"expected a number{' >= 0' if nonnegative else ''}, got {value!r}")
    return number


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer step, got {value!r}")
    return value
