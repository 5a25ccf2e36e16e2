"""A stand-in for Megatron-LM's own OpenTelemetry export, for tests/test_megatron_otel.py.

The real thing cannot run here: nemo-lens 0.1.0 (PyPI) requires Python >= 3.13 and Megatron-LM's
``training.py`` its whole GPU stack. This models what steptrace's join relies on, each rule from the
source named beside it (Megatron-LM main of Aug 2026; nemo-lens 0.1.0), and enforces it:

- ``set_telemetry`` = Megatron-LM ``global_vars._set_telemetry`` + nemo-lens ``setup_telemetry`` /
  ``providers.build_providers``: settings from ``MEGATRON_OTEL_<KEY>``, else ``NEMO_LENS_<KEY>``; off
  unless ``ENABLED`` is 1/true/yes/on; run id = ``RUN_ID``, else ``SLURM_JOB_ID``, else a random 12-hex id
  *per process*; only the export rank (``EXPORT_RANK``, -1 = the last rank) gets real providers, set
  globally, whose resource has ``service.name`` (``OTEL_SERVICE_NAME``, else ``megatron-lm``),
  ``service.version``, ``dl.rank``, ``dl.world_size``, ``nemo.run.id``, ``service.instance.id`` =
  ``<run id>-rank<rank>``; every other rank no-op providers and no span group at all.
- ``managed_span`` = nemo-lens ``helpers.managed_span``: yields None when the group is off (no span);
  else ``tracer.start_span(name)`` in the current context, attributes set, attached while the body runs,
  an exception recorded, always ended.
- ``train`` = the OpenTelemetry parts of Megatron-LM ``training.train()``: at each checkpoint-interval
  boundary a ``megatron.train`` root in an empty context (a fresh trace) linked to the previous one
  (``_reroot_otel_interval``); ``megatron.train.first_iteration`` for the first iteration this process
  runs and ``megatron.train.iteration`` around ``train_step(..., iteration=iteration)``, both through the
  module global ``training._otel_managed_span`` looked up at call time; the checkpoint save in the
  interval's trace; ``record_training_metrics`` at the log interval on the export rank.
- ``record_training_metrics`` = ``megatron/core/telemetry/training_metrics.py``: instrument names, kinds
  and units as there.
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager, nullcontext

from opentelemetry import context, metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, StatusCode, set_span_in_context

# Megatron's MegatronSpanGroup presets (megatron/core/telemetry/span_groups.py), the groups used here.
PRESETS = {
    "default": frozenset({"job", "checkpoint", "evaluate", "first_iteration", "inference"}),
    "per_step": frozenset({"job", "checkpoint", "evaluate", "model_init", "load_checkpoint", "step",
                           "forward_backward", "optimizer", "communication", "data_loading", "first_iteration",
                           "inference"}),
}
# megatron/core/telemetry/training_metrics.py
STEP_DURATION_MS = "megatron.training.step_duration_ms"
LOSS = "megatron.training.loss"
THROUGHPUT_TFLOPS = "megatron.training.throughput_tflops"
TOKENS_PER_SEC = "megatron.training.tokens_per_sec"
SKIPPED_ITERS = "megatron.training.skipped_iters"
MEGATRON_METRIC_NAMES = (STEP_DURATION_MS, LOSS, THROUGHPUT_TFLOPS, TOKENS_PER_SEC, SKIPPED_ITERS)


class Handle:
    def __init__(self, tracer, meter, is_exporting, providers=()):
        self.tracer, self.meter, self.is_exporting, self._providers = tracer, meter, is_exporting, providers

    def shutdown(self):
        for provider in self._providers:
            provider.force_flush()
            provider.shutdown()


_handle: Handle | None = None
_groups: frozenset = frozenset()


def _setting(key: str, default: str = "") -> str:
    for prefix in ("MEGATRON_OTEL", "NEMO_LENS"):
        value = os.environ.get(f"{prefix}_{key}", "").strip()
        if value:
            return value
    return default


def get_telemetry() -> Handle | None:
    return _handle


def set_telemetry(rank: int, world_size: int, traces_url: str, metrics_url: str) -> Handle:
    global _handle, _groups
    enabled = _setting("ENABLED").lower() in ("1", "true", "yes", "on")
    run_id = _setting("RUN_ID") or os.environ.get("SLURM_JOB_ID", "") or uuid.uuid4().hex[:12]
    export_rank = int(_setting("EXPORT_RANK", "-1"))
    exporting = enabled and rank == (world_size - 1 if export_rank == -1 else export_rank)
    if not exporting:
        trace.set_tracer_provider(trace.NoOpTracerProvider())
        metrics.set_meter_provider(metrics.NoOpMeterProvider())
        _groups = frozenset()
        _handle = Handle(trace.get_tracer("nemo.lens"), metrics.get_meter("nemo.lens"), False)
        return _handle
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "").strip() or "megatron-lm",
        "service.version": "0.1.0", "dl.rank": rank, "dl.world_size": world_size,
        "nemo.run.id": run_id, "service.instance.id": f"{run_id}-rank{rank}",
        "megatron.precision": "bf16",  # one of build_telemetry_resource_attrs's, for the resource to differ
    })
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url)))
    trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=metrics_url), export_interval_millis=60_000)])
    metrics.set_meter_provider(meter_provider)
    _groups = PRESETS[_setting("SPAN_GROUPS", "default")]
    _handle = Handle(trace.get_tracer("nemo.lens"), metrics.get_meter("nemo.lens"), True,
                     (tracer_provider, meter_provider))
    return _handle


@contextmanager
def managed_span(group, name, tracer=None, **attributes):
    if group not in _groups:
        yield None
        return
    tracer = tracer or trace.get_tracer("nemo.lens")
    span = tracer.start_span(name)
    span.set_attributes(attributes)
    token = context.attach(set_span_in_context(span))
    try:
        yield span
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(StatusCode.ERROR, str(exc))
        raise
    finally:
        context.detach(token)
        span.end()


_instruments: dict = {}


def record_training_metrics(meter, step_duration_ms=None, loss=None, throughput_tflops=None, tokens_per_sec=None):
    if not _instruments:
        _instruments.update({
            "step_duration_ms": meter.create_histogram(STEP_DURATION_MS, unit="ms"),
            "loss": meter.create_gauge(LOSS),
            "throughput_tflops": meter.create_gauge(THROUGHPUT_TFLOPS),
            "tokens_per_sec": meter.create_gauge(TOKENS_PER_SEC),
            "skipped_iters": meter.create_counter(SKIPPED_ITERS),
        })
    _instruments["step_duration_ms"].record(step_duration_ms)
    _instruments["loss"].set(loss)
    _instruments["throughput_tflops"].set(throughput_tflops)
    _instruments["tokens_per_sec"].set(tokens_per_sec)


def train(training, forward_backward_func, start_iteration: int, iterations: int, save_interval: int,
          log_interval: int = 1, tokens_per_step: int = 96) -> None:
    interval_span, interval_token = None, None
    interval_step = 0
    iteration = start_iteration
    tracer = _handle.tracer
    elapsed_since_log = 0.0
    while iteration < start_iteration + iterations:
        if "job" in _groups and save_interval > 0 and interval_step % save_interval == 0:
            links = [Link(interval_span.get_span_context())] if interval_span is not None else []
            if interval_span is not None:
                context.detach(interval_token)
                interval_span.end()
            interval_span = tracer.start_span("megatron.train", context=Context(), links=links)
            interval_token = context.attach(set_span_in_context(interval_span))
        interval_step += 1
        first = iteration == start_iteration
        first_cm = (training._otel_managed_span("first_iteration", "megatron.train.first_iteration",
                                                is_goodput_span=True, **{"megatron.iteration": iteration})
                    if first else nullcontext())
        started = time.time()
        with first_cm, training._otel_managed_span("step", "megatron.train.iteration", is_goodput_span=True,
                                                   **{"megatron.iteration": iteration}):
            training.train_step(None, None, None, None, None, None, forward_backward_func, iteration=iteration)
        elapsed_since_log += time.time() - started
        iteration += 1
        if iteration % log_interval == 0 and _handle.is_exporting:
            per_iteration = elapsed_since_log / log_interval
            record_training_metrics(_handle.meter, step_duration_ms=per_iteration * 1000.0, loss=1.0 / iteration,
                                    throughput_tflops=1.0, tokens_per_sec=tokens_per_step / per_iteration)
            elapsed_since_log = 0.0
        if save_interval > 0 and iteration % save_interval == 0:
            with training._otel_managed_span("checkpoint", "megatron.checkpoint.save", is_goodput_span=True,
                                             **{"megatron.iteration": iteration}):
                training.save_checkpoint_and_time(iteration, None, None, None, 0, None)
    if interval_span is not None:
        context.detach(interval_token)
        interval_span.end()
