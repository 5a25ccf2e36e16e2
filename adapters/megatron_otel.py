"""Megatron-LM's own OpenTelemetry export and steptrace's, joined: one trace per step, one resource per rank.

Megatron-LM (since Aug 2026, NVIDIA/Megatron-LM#6415, #6438; ``docs/user-guide/observability/``) exports
host-side spans and metrics through nemo-lens, from the last rank by default. What this module relies on,
read in Megatron-LM's source (main, Aug 2026) and nemo-lens 0.1.0:

- ``megatron/training/training.py`` ``train()``: each loop pass first re-roots the trace at checkpoint
  intervals (``_maybe_reroot_otel_interval``: a ``megatron.train`` span in an empty context, a fresh
  random trace id per interval), then opens ``megatron.train.first_iteration`` (the first iteration this
  process runs) and ``megatron.train.iteration`` (every iteration; the docs call it ``megatron.train_step``)
  with ``_otel_managed_span(group, name, **{"megatron.iteration": iteration})``, a module global (nemo-lens's
  ``managed_span``, or Megatron's no-op fallback without nemo-lens), and calls ``train_step(...,
  iteration=iteration)`` inside them.
- nemo-lens ``helpers.managed_span``: yields None when the span group is off (no span at all, as on every
  rank that does not export); else ``tracer.start_span(name)`` in the *current* context, attached while
  the body runs.
- ``megatron.training.global_vars.get_telemetry()`` (imported by ``training``): the handle, None without
  nemo-lens; ``handle.is_exporting`` on the ranks that export.

The join: while steptrace exports OTLP and Megatron's telemetry exports on this rank, the hook on
``training._otel_managed_span`` opens those per-step spans under steptrace's ``train.step`` span of the
same step (trace id from ``(run_id, step)``, DESIGN.md §4; span id its ``step`` role), as a remote
parent carrying the sampling decision of the trace Megatron would have used. So each step is one trace:
every rank's steptrace spans and Megatron's step subtree (forward/backward, optimizer, microbatches,
pipeline receives). The checkpoint-interval ``megatron.train`` traces keep everything else (checkpoints,
evaluation). The resource side is :func:`steptrace.otlp.nemo_lens_resource`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator

import steptrace
from steptrace._errors import SteptraceWarning

__all__ = ["STEP_SPAN_NAMES", "install_join"]

#: Megatron-LM's per-step spans: the source's names, and the name its docs give.
STEP_SPAN_NAMES = frozenset({"megatron.train.first_iteration", "megatron.train.iteration", "megatron.train_step"})
#: The span attribute Megatron puts the iteration in (``megatron.iteration``, span-groups.md).
ITERATION_ATTRIBUTE = "megatron.iteration"
#: What nemo-lens reads the run id from first, in Megatron-LM (``NemoLensConfig.from_env`` prefix).
MEGATRON_RUN_ID_VARIABLE = "MEGATRON_OTEL_RUN_ID"

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, SteptraceWarning, stacklevel=4)


def _exporting(training: Any) -> bool:
    get_telemetry = getattr(training, "get_telemetry", None)
    try:
        handle = get_telemetry() if callable(get_telemetry) else None
    except Exception:
        return False
    return handle is not None and bool(getattr(handle, "is_exporting", False))


_api: list[Any] = []  # opentelemetry's trace API and steptrace's ids, imported at the first join


def _otel_api() -> Any:
    if not _api:
        from opentelemetry import context, trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        from steptrace._ids import span_id, trace_id

        _api.append((context, trace, NonRecordingSpan, SpanContext, TraceFlags, trace_id, span_id))
    return _api[0]


_checked_resource: list[Any] = []  # the configurations whose resource join was checked (once each)


def _check_resource(config: Any) -> None:
    """Warn once when Megatron exports but steptrace's resource did not join nemo-lens's (its export was
    turned on by ``--otel-enabled`` alone, after steptrace made its resource)."""
    if _checked_resource and _checked_resource[-1] is config:
        return
    _checked_resource[:] = [config]
    if config.service_name is not None:
        return  # a resource named in code: the user's choice
    from steptrace.otlp import nemo_lens_resource

    if nemo_lens_resource(os.environ, config.run_id, config.rank, config.world_size, None) is None:
        _warn_once("resource", "steptrace: Megatron's OpenTelemetry export is on, but neither "
                   "MEGATRON_OTEL_ENABLED nor NEMO_LENS_ENABLED was set when steptrace started (--otel-enabled "
                   "alone): steptrace's spans join Megatron's traces, not its resource (nemo.run.id, "
                   "service.instance.id). Set MEGATRON_OTEL_ENABLED=1 (docs/megatron.md)")


def _step_parent(training: Any, iteration: Any, next_step: int) -> Any:
    """The OpenTelemetry context to open Megatron's span of ``iteration`` in (steptrace's step span as a
    remote parent), or None to leave it where Megatron puts it."""
    config = steptrace.config()
    if (config is None or config.otlp_endpoint is None or not steptrace.enabled()
            or steptrace.current_step() is not None or not isinstance(iteration, int)
            or isinstance(iteration, bool) or not _exporting(training)):
        return None
    _, trace, NonRecordingSpan, SpanContext, TraceFlags, trace_id, span_id = _otel_api()  # noqa: N806
    # The step train_step's hook is about to open: Megatron's iteration, unless behind the numbering.
    n = iteration if iteration >= next_step else next_step
    step_trace = trace_id(config.run_id, n, config.attempt)
    current = trace.get_current_span().get_span_context()
    if current.is_valid and current.trace_id == step_trace:
        return None  # inside the step's trace already (the iteration span within first_iteration)
    _check_resource(config)
    flags = current.trace_flags if current.is_valid else TraceFlags(TraceFlags.SAMPLED)
    parent = SpanContext(step_trace, span_id(config.run_id, n, config.rank, "step", config.attempt), is_remote=True,
                         trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(parent))


@contextlib.contextmanager
def _within(context: Any, span_cm: Any) -> Iterator[Any]:
    otel_context = _otel_api()[0]
    token = otel_context.attach(context)
    try:
        with span_cm as span:
            yield span
    finally:
        otel_context.detach(token)


def _hook_managed_span(original: Callable[..., Any], training: Any, next_step: Callable[[], int]) -> Callable[..., Any]:
    def managed_span(group: Any, name: Any, *args: Any, **attributes: Any) -> Any:
        if name not in STEP_SPAN_NAMES:
            return original(group, name, *args, **attributes)
        try:
            parent = _step_parent(training, attributes.get(ITERATION_ATTRIBUTE), next_step())
        except Exception as exc:  # telemetry never breaks training: Megatron's span stays where it was
            _warn_once("join", f"steptrace: joining Megatron's {name} span to steptrace's step failed "
                       f"({type(exc).__name__}: {exc}); Megatron's spans stay in its own traces")
            parent = None
        if parent is None:
            return original(group, name, *args, **attributes)
        return _within(parent, original(group, name, *args, **attributes))

    return managed_span


def hand_run_id_to_megatron(env: Any = None) -> str | None:
    """Give Megatron's nemo-lens steptrace's run id (``MEGATRON_OTEL_RUN_ID``) where it would draw a random
    one per process (no ``MEGATRON_OTEL_RUN_ID``, ``NEMO_LENS_RUN_ID`` nor ``SLURM_JOB_ID``) and steptrace
    exports OTLP: every rank and both exporters then name the run alike. Returns the id handed, or None."""
    env = os.environ if env is None else env
    config = steptrace.config()
    if config is None or config.otlp_endpoint is None or not steptrace.enabled():
        return None
    if any((env.get(v) or "").strip() for v in (MEGATRON_RUN_ID_VARIABLE, "NEMO_LENS_RUN_ID", "SLURM_JOB_ID")):
        return None
    from steptrace.otlp import nemo_lens_resource

    if nemo_lens_resource(env, config.run_id, config.rank, config.world_size, config.service_name) is None:
        return None
    env[MEGATRON_RUN_ID_VARIABLE] = config.run_id
    return str(config.run_id)


def install_join(hooks: Any, training: Any, next_step: Callable[[], int]) -> bool:
    """Hook ``training._otel_managed_span`` (absent in a Megatron-LM without OpenTelemetry: skipped
    quietly) and hand steptrace's run id to Megatron. Returns whether the hook is installed."""
    installed = bool(hooks.patch(f"{training.__name__}._otel_managed_span", training, "_otel_managed_span",
                                 lambda fn: _hook_managed_span(fn, training, next_step), requires=("group", "name"),
                                 missing_ok=True))
    if installed:
        hand_run_id_to_megatron()
    return installed
