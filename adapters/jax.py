"""JAX: wait on step outputs off the training thread, charge compilation, annotate XProf traces.

* :class:`JaxDevice` waits with ``jax.block_until_ready`` on the resolver thread
  (it releases the GIL, so the training thread keeps dispatching). JAX exposes
  no device clock, so a step's end is *observed*: the moment the wait returns
  and the resolver gets the GIL back.
* :func:`install_compile_listener` turns ``jax.monitoring`` compile events
  (``/jax/core/compile/*``) into ``compile`` host spans: compilation inside a
  step lands in that step's ``idle_breakdown["compile"]`` instead of
  inflating its compute time.
* :func:`step_annotator` opens ``jax.profiler.StepTraceAnnotation`` so XProf
  traces line up with steptrace's step numbers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_COMPILE_PREFIX = "/jax/core/compile/"
_listener_target: Any = None  # the Runtime compile spans go to; swapped on re-init
_listener_installed = False
_listener_lock = threading.Lock()


def require_jax() -> Any:
    try:
        import jax
    except ImportError as exc:
        raise ImportError("steptrace's JAX backend needs jax: pip install 'steptrace[jax]'") from exc
    return jax


class JaxDevice:
    """A value device: the step ends when the arrays given to ``wait_for`` are ready."""

    name = "jax"
    uses_events = False

    def __init__(self) -> None:
        self._jax = require_jax()

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        self._jax.block_until_ready(values)
        # JAX has no device clock to read back: the resolver reads the host clock when
        # this returns (end_source "observed"), late by whatever held the GIL meanwhile.
        return None

    def memory_stats(self) -> dict[str, int] | None:
        """This process's first local device's memory (``Device.memory_stats()``; None on CPU)."""
        try:
            stats = self._jax.local_devices()[0].memory_stats()
        except Exception:
            return None
        if not stats or "bytes_in_use" not in stats:
            return None
        memory = {"in_use_bytes": int(stats["bytes_in_use"])}
        if "peak_bytes_in_use" in stats:
            memory["peak_bytes"] = int(stats["peak_bytes_in_use"])  # since the process started
        if stats.get("bytes_limit"):
            memory["limit_bytes"] = int(stats["bytes_limit"])
        return memory


def scalar_reader(value: Any) -> Any:
    """A logged ``jax.Array`` scalar: start its copy to the host now (no wait), read it later.

    The read must not dispatch device work: an op issued from the resolver (``value.reshape``,
    arithmetic) queues behind every step the training thread has dispatched since, so the
    resolver would wait for those and observe the following steps' ends late, in bunches.
    ``numpy.asarray`` only copies the buffer, which is ready soon after this step's outputs.
    """
    try:
        if value.size != 1:
            return None
        value.copy_to_host_async()
    except Exception:
        return None

    def read() -> float:  # on the resolver thread: the import stays off the training thread
        import numpy

        return float(numpy.asarray(value).reshape(()))

    return read


def _on_time_span(event: str, start_time: float, end_time: float, **_kwargs: Any) -> None:
    if not event.startswith(_COMPILE_PREFIX):
        return
    runtime = _listener_target
    if runtime is None:
        return
    # Compilation on another thread (a background checkpointer, say) does not hold up the step.
    if runtime.train_thread not in (None, threading.get_ident()):
        return
    # jax reports time.time(); steptrace runs on perf_counter.
    offset = runtime.resolver.unix_offset
    runtime.close_span("compile", start_time - offset, end_time - offset, {"event": event[len(_COMPILE_PREFIX):]})


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    # Older jax has only duration events, reported as the compile finishes.
    end = time.time()
    _on_time_span(event, end - duration, end, **kwargs)


def install_compile_listener(runtime: Any) -> None:
    """Route compile events to ``runtime`` (registered with jax.monitoring once per process)."""
    global _listener_target, _listener_installed
    jax = require_jax()
    with _listener_lock:
        _listener_target = runtime
        if _listener_installed:
            return
        monitoring = jax.monitoring
        if hasattr(monitoring, "register_event_time_span_listener"):
            monitoring.register_event_time_span_listener(_on_time_span)
        else:
            monitoring.register_event_duration_secs_listener(_on_duration)
        _listener_installed = True


def step_annotator() -> Any:
    """Build the per-step annotator: ``annotate(n)`` enters a ``StepTraceAnnotation`` for step ``n``
    while a profiler trace is running (the caller exits it) and returns None otherwise.

    Creating the annotation costs ~1.6 µs even with no trace active (measured here),
    most of the per-step budget, so the cheap ``is_enabled`` check (~35 ns) goes
    first; the class is looked up once here, not per step (an import statement
    in the hot path cost ~2.8 µs).
    """
    from jax.profiler import StepTraceAnnotation

    is_enabled = StepTraceAnnotation.is_enabled

    def annotate(n: int) -> Any:
        if not is_enabled():
            return None
        annotation = StepTraceAnnotation("train", step_num=n)
        annotation.__enter__()
        return annotation

    return annotate
