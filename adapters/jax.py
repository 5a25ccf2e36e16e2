"""JAX: wait on step outputs off the training thread, charge compilation, annotate XProf traces.

* :class:`JaxDevice` waits with ``jax.block_until_ready`` on the resolver thread
  (it releases the GIL, so the training thread keeps dispatching). JAX exposes
  no device clock, so a step's end is *observed*: the moment the wait returns
  and the resolver gets the GIL back.
* :func:`install_compile_listener` turns ``jax.monitoring`` compile events
  (``/jax/core/compile/*``) into ``compile`` host spans: compilation inside a
  step lands in that step's ``idle_breakdown["compile"]`` instead of
  inflating its compute time.
* :class:`ProgramFlops` reads XLA's cost analysis of every program compiled inside a
  ``flops="auto"`` step, once per compiled program, as it compiles: the step's hardware
  FLOPs (``flops_source: "xla_cost_analysis"``).
* :func:`timed` wraps a jitted step function so that a step's dispatch point is the moment its
  call returned (the device has the work), not the end of the last span before it.
* :func:`step_annotator` opens ``jax.profiler.StepTraceAnnotation`` so XProf
  traces line up with steptrace's step numbers.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

_COMPILE_PREFIX = "/jax/core/compile/"
_listener_target: Any = None  # the Runtime compile spans and dispatch marks go to; swapped on re-init
_listener_installed = False
_listener_lock = threading.Lock()
_flops_target: Any = None  # the ProgramFlops compiled programs go to; swapped on re-init
_compile_wrapped = False


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
        #: False once the device said it keeps no memory statistics (``memory_stats()`` is None on
        #: JAX's CPU backend): asking again each step cost the resolver ~24 us of CPU per step on
        #: bench_jax_trainer's loop (a cold call: jax.local_devices() and the device's own query).
        self._memory_stats_kept = True

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        self._jax.block_until_ready(values)
        # JAX has no device clock to read back: the resolver reads the host clock when
        # this returns (end_source "observed"), late by whatever held the GIL meanwhile.
        return None

    def memory_stats(self) -> dict[str, int] | None:
        """This process's first local device's memory (``Device.memory_stats()``; None on CPU)."""
        if not self._memory_stats_kept:
            return None
        try:
            stats = self._jax.local_devices()[0].memory_stats()
        except Exception:
            return None
        if stats is None:  # the backend keeps none (CPU): it will not start to
            self._memory_stats_kept = False
            return None
        if "bytes_in_use" not in stats:
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
    # Before the first step the training thread is the one that called init().
    train_thread = runtime.train_thread if runtime.train_thread is not None else runtime.init_thread
    if train_thread != threading.get_ident():
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


def timed(fn: Any) -> Any:
    """Wrap a jitted step function so steptrace sees when the device was handed the step's work.

    ``train_step = steptrace.adapters.jax.timed(jax.jit(train_step))``, once, then call it as before.
    JAX shows a step's work to steptrace only at ``wait_for``, so without this the step's dispatch
    point is inferred: its start, or the end of the last span closed inside it before ``wait_for``.
    The host time between that point and the moment the device really got the work (JAX flattening
    and checking a large state pytree, moving arguments, host code between the span and the call)
    then counts as compute, though the device sat idle: 5-29 ms per step after a host stall on a
    Flax trainer (issue 34). With the wrapper, the first call that returns inside a step on the
    training thread marks its dispatch; the time before it is idle, by the spans that cover it.

    Costs one attribute check and one clock read per call; outside a step, before ``init()``, with
    steptrace disabled, or on another thread it only calls ``fn``. Works on any callable (a jitted
    function, a ``pjit``, a Flax ``nnx.jit``); it does not change what the call returns or raises.
    """
    @functools.wraps(fn)
    def dispatched(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        # The runtime that installed the compile listener is the one recording (a leaf module: no
        # import of steptrace itself); a runtime that has shut down has no open step.
        runtime = _listener_target
        if runtime is not None and runtime.current is not None:
            runtime.dispatched()
        return out

    return dispatched


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


def executable_flops(executable: Any) -> float | None:
    """FLOPs of one execution of a compiled XLA program (``cost_analysis()["flops"]``), or None.

    XLA counts what the optimized program executes on one device: a multiply-add is 2 FLOPs,
    rematerialized work is counted again, and an SPMD program is its per-device partition."""
    analysis = executable.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jaxlib: one dict per program
        analysis = analysis[0] if analysis else None
    flops = analysis.get("flops") if isinstance(analysis, dict) else None
    if isinstance(flops, (int, float)) and flops >= 0:
        return float(flops)
    return None


def program_flops(jitted: Any, *args: Any, **kwargs: Any) -> float | None:
    """Hardware FLOPs of one call of ``jitted`` with these arguments: ``jitted.lower(...).compile()``
    and XLA's cost analysis. It compiles once more (call it once, before the loop): for programs
    compiled outside any step, pass the result as the step's count yourself."""
    return executable_flops(jitted.lower(*args, **kwargs).compile())


def _program_name(args: tuple, kwargs: dict) -> str:
    computation = args[1] if len(args) > 1 else kwargs.get("computation")
    try:
        return str(computation.operation.attributes["sym_name"]).strip('"')
    except Exception:
        return f"program-{id(computation)}"


class ProgramFlops:
    """A step's hardware FLOPs from the programs JAX compiles inside ``flops="auto"`` steps.

    JAX compiles a jitted function once per input signature and then runs the cached program:
    there is no per-call hook to count executions without costing every step. So the programs
    compiled while an auto step is open on the training thread are taken to be what such a
    step runs, each by name (``jit_train_step``; a recompilation for new shapes replaces it),
    and their XLA cost-analysis FLOPs are summed. Cost analysis runs once per program, when it
    is compiled (the compile already takes far longer). A program compiled before the first step
    (a warm-up call) is not seen: see :func:`program_flops`.
    """

    source = "xla_cost_analysis"

    def __init__(self, runtime: Any):
        self._runtime = runtime
        self.programs: dict[str, float] = {}
        self.total: float | None = None
        _wrap_compile(self)

    def compiled(self, name: str, executable: Any) -> None:
        rt = self._runtime
        step = rt.current
        if step is None or not step.auto_flops or rt.train_thread not in (None, threading.get_ident()):
            return
        flops = executable_flops(executable)
        if flops is None:
            return
        self.programs[name] = flops
        self.total = sum(self.programs.values())

    def enter(self, step: Any) -> None:
        return None

    def exit(self, step: Any) -> float | None:
        return self.total if self.total else None


def _wrap_compile(target: ProgramFlops) -> None:
    """Route every XLA compilation to ``target`` (``jax._src.compiler.compile_or_get_cached``,
    which pjit calls by module attribute once per program it has not compiled in this process,
    also when the persistent cache has it). Wrapped once per process; private API, so any
    failure leaves JAX untouched and ``flops="auto"`` empty."""
    global _flops_target, _compile_wrapped
    with _listener_lock:
        _flops_target = target
        if _compile_wrapped:
            return
        try:
            from jax._src import compiler
        except Exception:
            return
        original = compiler.compile_or_get_cached

        @functools.wraps(original)
        def compile_or_get_cached(*args: Any, **kwargs: Any) -> Any:
            executable = original(*args, **kwargs)
            counter = _flops_target
            if counter is not None:
                try:
                    counter.compiled(_program_name(args, kwargs), executable)
                except Exception:
                    pass
            return executable

        compiler.compile_or_get_cached = compile_or_get_cached
        _compile_wrapped = True
