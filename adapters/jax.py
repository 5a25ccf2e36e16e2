"""JAX: wait on step outputs off the training thread, charge compilation, annotate XProf traces.

* :class:`JaxDevice` times a step by its outputs. On a CUDA GPU the end is read
  from the device's clock (:class:`DeviceEnds`: the outputs handed to a CUDA
  stream of steptrace's own through DLPack, an event recorded behind them).
  Elsewhere (CPU, TPU, a GPU without the CUDA driver library) JAX exposes no
  device clock, so the end is *observed*: the resolver waits with
  ``jax.block_until_ready`` (the GIL released) and reads the host clock when the
  wait returns and it has the GIL back.
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
import hashlib
import logging
import threading
import time
from typing import Any

log = logging.getLogger("steptrace")
_perf = time.perf_counter

_COMPILE_PREFIX = "/jax/core/compile/"
_BACKEND_COMPILE = _COMPILE_PREFIX + "backend_compile_duration"
_listener_target: Any = None  # the Runtime compile spans and dispatch marks go to; swapped on re-init
_listener_installed = False
_listener_lock = threading.Lock()
_flops_target: Any = None  # the ProgramFlops compiled programs go to; swapped on re-init
_compile_wrapped = False
#: ``program``: the fingerprint of the program this thread is compiling, set by the wrapped
#: ``compile_or_get_cached`` and taken by the backend-compile event that JAX records right after it.
_compiling = threading.local()


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
        #: Device-clock ends on CUDA GPUs, made at the first GPU array (None: none seen yet).
        self._ends: DeviceEnds | None = None
        #: False once the outputs were seen on a backend without a device-clock end (CPU, TPU): the
        #: resolver's ``prepare_end`` then costs one attribute read per step.
        self._device_ends_possible = True
        #: The concrete class of a jax.Array (jaxlib's ArrayImpl), once one was waited on.
        self._array_class: type | None = None

    # -- device-clock ends (resolver thread) --------------------------------------------------
    def prepare_end(self, values: tuple[Any, ...]) -> Any:
        """Start a device-clock end for ``values`` (resolver thread, as soon as the step is handed
        over): a pending end, or None when this step's end will be observed instead."""
        if not self._device_ends_possible:
            return None
        buffers = _cuda_buffers(values)
        if buffers is None:
            return None
        if not buffers:
            # Not CUDA arrays: this backend has no device-clock end. The resolver asks no more (it calls
            # no prepare_end that is None: this instance attribute hides the method).
            self._device_ends_possible = False
            self.prepare_end = None  # type: ignore[assignment]
            return None
        ends = self._ends
        if ends is None:
            ends = self._ends = DeviceEnds(_driver())
        return ends.prepare(buffers)

    def wait_values(self, values: tuple[Any, ...]) -> float | None:
        if len(values) == 1 and values[0].__class__ is self._array_class:
            # One jax.Array (wait_for(loss)): its own block_until_ready(), which is what
            # jax.block_until_ready calls for a single array (jax/_src/api.py, "Fast path for single
            # array"), without the pytree walk and the wrappers around it: ~2.4 of its ~3.2 us a step
            # on the bench VM. A deleted (donated) array raises the same JaxRuntimeError.
            values[0].block_until_ready()
            return None
        self._jax.block_until_ready(values)
        if len(values) == 1 and self._array_class is None and isinstance(values[0], self._jax.Array):
            self._array_class = values[0].__class__  # jaxlib's ArrayImpl
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
            # The resolver asks no more (it calls no memory_stats that is None: this hides the method).
            self.memory_stats = None  # type: ignore[assignment]
            return None
        if "bytes_in_use" not in stats:
            return None
        memory = {"in_use_bytes": int(stats["bytes_in_use"])}
        if "peak_bytes_in_use" in stats:
            memory["peak_bytes"] = int(stats["peak_bytes_in_use"])  # since the process started
        if stats.get("bytes_limit"):
            memory["limit_bytes"] = int(stats["bytes_limit"])
        return memory


# -- the device-clock end of a step on a CUDA GPU -----------------------------------------------
#
# What it relies on (each checked on an H200, jax 0.11.2, driver 580.159.04, gpudiag probe of issue 34):
# * ``jax.Array.__dlpack__(stream=s)`` makes the CUDA stream ``s`` wait for the array's definition event
#   and returns without waiting (jaxlib ``xla/python/dlpack.cc``: ``WaitUntilBufferReadyOnStream``; the
#   DLPack Python specification: the producer makes the consumer's stream wait). 36-188 µs of host time
#   per call on 2.1 ms steps. On other backends it raises (``UNIMPLEMENTED: WaitUntilBufferReadyOnStream
#   is only implemented for GPU``); on a deleted (donated) array, ``RuntimeError``. It works on a single
#   device's buffer only, so a sharded array goes shard by shard (``addressable_shards``).
# * The capsule holds an external reference to the buffer until it is freed, and PJRT refuses to donate
#   a buffer with an external reference: the capsule is freed at once, before this thread can give the
#   GIL to the training thread (which may be donating the array in its next step).
# * An event recorded on that stream after the wait completes when the array is ready: on the probe,
#   the intervals between such events matched the XLA trace's execution ends within 0.23 %.
# * The event's device time is placed on the host clock by an anchor: another event, recorded on an idle
#   stream of steptrace's own at a known host time, and ``cuEventElapsedTime`` between the two.
#
# The end is exact only if the wait was enqueued before the array became ready; an array already ready
# when the resolver first looks is left to the observed end (``end_source: "observed"``).

#: Single-device buffers a step's outputs may have for a device-clock end (each costs a DLPack export,
#: ~45 µs); past it, the end is observed. ``wait_for(loss)`` has one.
MAX_END_BUFFERS = 16
_NO_BUFFERS: list[Any] = []


def _driver() -> Any:
    """The CUDA driver API through ctypes (shared with the torch adapter; imports no torch)."""
    from steptrace.adapters.torch import cuda_driver

    return cuda_driver()


def _cuda_buffers(values: Any) -> list[tuple[int, Any]] | None:
    """The (CUDA ordinal, single-device array) pairs of the ``jax.Array`` leaves of ``values``; an empty
    list when the arrays are not on CUDA GPUs; None when this step cannot have a device-clock end (too
    many buffers, a leaf that is not an array, a deleted array)."""
    found: list[tuple[int, Any]] = []
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
            continue
        if isinstance(value, dict):
            stack.extend(value.values())
            continue
        try:
            devices = value.devices()
        except Exception:
            return None  # not an array (a Python number in the pytree), or deleted
        for device in devices:
            if getattr(device, "platform", None) != "gpu" or "cuda" not in _platform_version(device):
                return _NO_BUFFERS  # CPU, TPU or ROCm: no CUDA stream to hand the buffer to
        if len(devices) == 1:
            (device,) = devices
            found.append((int(device.local_hardware_id), value))
        else:
            try:
                found.extend((int(shard.device.local_hardware_id), shard.data) for shard in value.addressable_shards)
            except Exception:
                return None
        if len(found) > MAX_END_BUFFERS:
            return None
    return found if found else None


def _platform_version(device: Any) -> str:
    try:
        return str(device.client.platform_version).lower()
    except Exception:
        return ""


class _GpuEnds:
    """One GPU's streams and event pool: an anchor stream that only ever holds anchors (so an anchor
    runs as soon as it is recorded), and a wait stream the outputs are handed to."""

    __slots__ = ("ordinal", "anchor_stream", "wait_stream", "free")

    def __init__(self, driver: Any, ordinal: int):
        self.ordinal = ordinal
        driver.use_device(ordinal)
        _least, greatest = driver.stream_priority_range(ordinal)
        self.anchor_stream = driver.create_stream(greatest, ordinal)
        self.wait_stream = driver.create_stream(greatest, ordinal)
        self.free: list[int] = []


class PendingEnd:
    """A step's outputs handed to the device: per GPU, (anchor event, its host time, end event)."""

    __slots__ = ("owner", "marks")

    def __init__(self, owner: "DeviceEnds", marks: list[tuple[_GpuEnds, int, float, int]]):
        self.owner, self.marks = owner, marks

    def complete(self) -> bool:
        """Whether the outputs are ready (every GPU's end event completed; never waits)."""
        driver = self.owner.driver
        for gpu, _anchor, _at, end in self.marks:
            driver.use_device(gpu.ordinal)
            if not driver.event_query(end):
                return False
        return True

    def end_time(self) -> float:
        """When the outputs became ready, on the host clock (``perf_counter``): the latest GPU's end, by
        the device's clock. The events go back to their pools."""
        driver, latest = self.owner.driver, None
        try:
            for gpu, anchor, at, end in self.marks:
                driver.use_device(gpu.ordinal)
                t = at + max(0.0, driver.event_elapsed_ms(anchor, end) / 1000.0)
                latest = t if latest is None or t > latest else latest
        finally:
            self.release()
        assert latest is not None
        return latest

    def release(self) -> None:
        for gpu, anchor, _at, end in self.marks:
            gpu.free += (anchor, end)
        self.marks = []


class DeviceEnds:
    """Device-clock ends for JAX arrays on CUDA GPUs, made and read on the resolver thread."""

    #: Host time an anchor's record may take before it is taken again (the GIL is released during the
    #: call, so another thread can run in between; the anchor's host time is the middle of the call).
    ANCHOR_BRACKET_S = 100e-6

    def __init__(self, driver: Any):
        self.driver = driver
        self._gpus: dict[int, _GpuEnds] = {}
        self.failed: str | None = None
        #: Steps whose outputs were already ready when the resolver first looked (their end is observed).
        self.too_late = 0

    def prepare(self, buffers: list[tuple[int, Any]]) -> PendingEnd | None:
        if self.failed is not None:
            return None
        try:
            if any(array.is_ready() for _ordinal, array in buffers):
                self.too_late += 1
                return None
        except Exception:
            return None  # a deleted (donated) array: the resolver's wait says so, and counts it
        by_gpu: dict[int, list[Any]] = {}
        for ordinal, array in buffers:
            by_gpu.setdefault(ordinal, []).append(array)
        pending = PendingEnd(self, [])
        try:
            for ordinal, arrays in by_gpu.items():
                self._mark(ordinal, arrays, pending)
        except _ArrayRefused:
            pending.release()
            return None
        except Exception as exc:  # the driver: it will not start working
            pending.release()
            self.failed = repr(exc)
            log.warning("steptrace cannot read JAX steps' ends from the GPU's clock (%s); they are observed "
                        "(end_source \"observed\"), late by whatever holds the GIL meanwhile", self.failed)
            return None
        return pending

    def _gpu(self, ordinal: int) -> _GpuEnds:
        gpu = self._gpus.get(ordinal)
        if gpu is None:
            gpu = self._gpus[ordinal] = _GpuEnds(self.driver, ordinal)
        return gpu

    def _event(self, gpu: _GpuEnds) -> int:
        return gpu.free.pop() if gpu.free else self.driver.create_event(gpu.ordinal)

    def _mark(self, ordinal: int, arrays: list[Any], pending: PendingEnd) -> None:
        """Anchor, hand ``arrays`` to the wait stream, record the end behind them (added to ``pending``)."""
        driver, gpu = self.driver, self._gpu(ordinal)
        driver.use_device(ordinal)
        anchor = self._event(gpu)
        try:
            end = self._event(gpu)
        except Exception:
            gpu.free.append(anchor)
            raise
        at = 0.0
        try:
            for _ in range(3):
                before = _perf()
                rc = driver.record_releasing_gil(anchor, gpu.anchor_stream)
                after = _perf()
                if rc:
                    raise OSError(f"cuEventRecord failed (CUresult {rc})")
                at = (before + after) / 2
                if after - before <= self.ANCHOR_BRACKET_S:
                    break
            for array in arrays:
                try:
                    # The capsule is freed at once: while it lives, the buffer cannot be donated (above).
                    array.__dlpack__(stream=gpu.wait_stream)
                except Exception as exc:
                    raise _ArrayRefused() from exc
            rc = driver.record_releasing_gil(end, gpu.wait_stream)
            if rc:
                raise OSError(f"cuEventRecord failed (CUresult {rc})")
        except BaseException:
            gpu.free += (anchor, end)
            raise
        pending.marks.append((gpu, anchor, at, end))


class _ArrayRefused(Exception):
    """An output refused the DLPack export (deleted by a donation meanwhile): this step's end is observed."""


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
    attrs = {"event": event[len(_COMPILE_PREFIX):]}
    function = compiled_function(event, _kwargs.get("fun_name"))
    if function is not None:
        attrs["function"] = function
    if event == _BACKEND_COMPILE:
        program = getattr(_compiling, "program", None)
        _compiling.program = None
        if program is not None:
            attrs["program"] = program
    runtime.close_span("compile", start_time - offset, end_time - offset, attrs)


def compiled_function(event: str, fun_name: Any) -> str | None:
    """The jitted function a compile event is for, as JAX names its programs: ``jit(train_step)``.

    JAX passes ``fun_name`` with each of its three compile events (``dispatch.log_elapsed_time``, jax
    0.10): the trace (``jaxpr_trace_duration``, from pjit, with the Python function's name,
    ``train_step``), the lowering and the backend compile (the module's name, ``jit(train_step)``). The
    trace's name gets the ``jit(...)`` of the other two, so that the three events of one compile share it."""
    if not isinstance(fun_name, str) or not fun_name:
        return None
    if event.endswith("/jaxpr_trace_duration") and not fun_name.startswith("jit("):
        return f"jit({fun_name})"
    return fun_name


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
    _wrap_compile()


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

    # annotate(n) is None while this says False: the runtime may call it alone (no Python frame).
    annotate.enabled = is_enabled  # type: ignore[attr-defined]
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
        global _flops_target
        self._runtime = runtime
        self.programs: dict[str, float] = {}
        self.total: float | None = None
        with _listener_lock:
            _flops_target = self
        _wrap_compile()

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


def program_fingerprint(computation: Any) -> str | None:
    """A 16-hex-digit hash of the lowered program's text (StableHLO, large constants elided), or None.

    JAX's compile events name only the function (``fun_name``), and a function is compiled once per
    input signature: the fingerprint tells a compile for new shapes, dtypes, shardings or static
    arguments (another program) from a compile of a program already compiled (the same text: a
    cache miss, e.g. ``jax.jit`` of a new lambda each step, or ``jax.clear_caches()``). Printing the
    module (verified already: JAX verifies what it lowers) costs 0.1 % of a 4 s compile for a 23 KB
    program, 2.6–3.9 % for bench_jax_trainer's 175 KB train step (38–55 ms of a 1.5–1.9 s compile),
    on the training thread, once per compile. Its bytecode is cheaper but not the same for the same
    program compiled twice."""
    operation = getattr(computation, "operation", None)
    try:
        text = operation.get_asm(large_elements_limit=16, assume_verified=True)
    except TypeError:  # older MLIR bindings
        try:
            text = operation.get_asm(large_elements_limit=16)
        except Exception:
            return None
    except Exception:
        return None
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _wrap_compile() -> None:
    """Route every XLA compilation through steptrace (``jax._src.compiler.compile_or_get_cached``,
    which pjit calls by module attribute once per program it has not compiled in this process,
    also when the persistent cache has it, inside the backend-compile event): the program's
    fingerprint for the compile listener, the executable for ``flops="auto"``. Wrapped once per
    process; private API, so any failure leaves JAX untouched (compile spans without ``program``,
    ``flops="auto"`` empty)."""
    global _compile_wrapped
    with _listener_lock:
        if _compile_wrapped:
            return
        try:
            from jax._src import compiler
        except Exception:
            return
        original = compiler.compile_or_get_cached

        @functools.wraps(original)
        def compile_or_get_cached(*args: Any, **kwargs: Any) -> Any:
            runtime = _listener_target
            if runtime is not None:
                computation = args[1] if len(args) > 1 else kwargs.get("computation")
                _compiling.program = program_fingerprint(computation)
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
