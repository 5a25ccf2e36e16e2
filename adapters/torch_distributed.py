"""torch.distributed: each rank's time waiting in collectives, so the cross-rank view can name the
rank that slows a synchronous job instead of the ranks that wait for it (DESIGN.md §2).

A collective makes every rank's step as long as the slowest rank's: per-rank step times all look
alike. What differs is where the time went: the slow rank arrives last and hardly waits, the others
arrive early and wait for it. This module measures, on the training thread and never with a sync or
a barrier, how long each step waited in collectives (``collective_wait_seconds`` in the step record;
the rest of the step's interval is ``own_seconds``). A collective called between steps (a loss
all-reduce after ``with step(n)`` closed) waits within the next step's interval and counts there;
one after the run's last step has no step to go to and is counted at ``shutdown()`` (the run's drop
``collectives_after_last_step``).

* **Collectives called from Python** (``torch.distributed.all_reduce``, ``broadcast``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``barrier``, ...; FSDP and Megatron's
  gradient sync call these): :func:`track_collectives` wraps them. A synchronous call is timed from
  arrival to return; with ``async_op=True``, ``Work.wait()`` is timed (patched on the class: the
  time the training thread was blocked). Source ``torch.distributed``.
* **DDP gradient buckets** (all-reduced by DDP's C++ reducer, which no Python wrapper sees):
  :func:`track_ddp` (installed on every DDP model at its first forward) notes when the backward's
  last gradient arrived and when the backward ended: DDP holds it until every bucket's all-reduce
  completed. Its C++ all-reduce and any communication hook stay as they are (a Python comm hook
  would cost ~50 µs per bucket here). Source ``ddp``.

Only host-synchronous backends are measured this way: on gloo (CPU tensors) a collective's call or
``wait()`` returns when it completed, so its host time *is* the wait. On NCCL a call returns once
the kernel is enqueued; the wait happens inside the NCCL kernel on the device, so
:func:`track_collectives` does not install itself there: :func:`track_device_collectives` times each
collective on the GPU with CUDA events instead (source ``nccl-device``, joined across ranks by
``steptrace.analysis.collectives``; see the section at the end of this module and docs/collector.md:
what each framework can and cannot show).

``steptrace`` installs :func:`track_collectives` itself at the first step when torch.distributed
is initialised with the gloo backend; call it earlier to have it in place before. The wrappers cost
0.3-0.6 µs per collective on the training thread, DDP tracking ~1 µs per parameter per backward
(``bench/bench_collectives.py``).
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any, Callable

from steptrace._schema import COLLECTIVE_SOURCE_NCCL_DEVICE as SOURCE_NCCL_DEVICE
from steptrace._schema import DROP_COLLECTIVES_AFTER_LAST_STEP

__all__ = ["SOURCE_DDP", "SOURCE_NCCL_DEVICE", "SOURCE_TORCH", "installed", "track_collectives", "track_ddp",
           "track_device_collectives", "untrack_collectives"]

#: ``collective_wait_source`` of waits measured in collectives called from Python.
SOURCE_TORCH = "torch.distributed"
#: ``collective_wait_source`` of waits measured in DDP's backward (its gradient all-reduce).
SOURCE_DDP = "ddp"

#: The tensor collectives wrapped (object collectives such as ``all_gather_object`` call these, so
#: they are measured through them). A collective that runs inside another wrapped one, or the Work
#: a synchronous one waits on inside, is not timed again (``_inside``).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "monitored_barrier")
#: Backends whose collectives complete on the host before the call (or ``wait()``) returns.
HOST_SYNCHRONOUS_BACKENDS = ("gloo",)

_perf = time.perf_counter
#: The run whose steps the waits go to (set at each run's first step by :func:`mark_runtime`). A leaf
#: module like the other device backends: it imports no steptrace module, the runtime comes to it.
_runtime: list[Any] = [None]
#: (owner, attribute, original) of every function replaced, in the order replaced.
_patched: list[tuple[Any, str, Any]] = []
#: Seconds waited in collectives while no step was open: they belong to the next step's interval.
_pending = [0.0]
#: ... and when (``(start, end)`` on ``perf_counter``), so the resolver can say whether each wait fell
#: in the step's compute or in one of its idle windows (``collective_wait_idle_breakdown``).
_pending_windows: list[tuple[float, float]] = []
#: ... and how many waits those are: counted at the run's end if no step came to hold them.
_pending_waits = [0]
#: Wait windows kept per step. Past this (thousands of collectives a step), a new window is merged
#: into the last one: the wait's total stays exact, only where it fell becomes coarser.
MAX_WAIT_WINDOWS = 1024
#: True while a wrapped synchronous collective runs: it waits on its Work inside, timed already.
_inside = [False]


def _current_step() -> Any:
    runtime = _runtime[0]
    return None if runtime is None else runtime.current


def _patch(owner: Any, attribute: str, make: Callable[[Any], Any], rebind_in: tuple[Any, ...] = ()) -> None:
    """Replace ``owner.attribute`` by ``make(original)`` (and in ``rebind_in`` where those modules hold
    the same original); once: a second call finds the marked wrapper and leaves it."""
    original = inspect.getattr_static(owner, attribute, None)
    if original is None or getattr(original, "__steptrace_hook__", False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    wrapper.__steptrace_hook__ = True
    setattr(owner, attribute, wrapper)
    _patched.append((owner, attribute, original))
    for module in rebind_in:
        if getattr(module, attribute, None) is original:
            setattr(module, attribute, wrapper)
            _patched.append((module, attribute, original))


def _add_window(step: Any, start: float, end: float) -> None:
    windows = step.collective_windows
    if not windows:
        windows = step.collective_windows = []
    if len(windows) < MAX_WAIT_WINDOWS:
        windows.append((start, end))
    else:
        windows[-1] = (windows[-1][0], end)


def _add_wait(step: Any, start: float, end: float, source: str) -> None:
    # Runs on the thread that waited: the training thread (synchronous calls, Work.wait), or the
    # autograd engine's at the end of a DDP backward (the calling thread, for CPU tensors).
    seconds = max(0.0, end - start)
    if _pending[0] or _pending_windows:
        seconds += _pending[0]
        _pending[0] = 0.0
        _pending_waits[0] = 0
        for lo, hi in _pending_windows:
            _add_window(step, lo, hi)
        _pending_windows.clear()
    step.collective_wait += seconds
    _add_window(step, start, end)
    if step.collective_source is None:
        step.collective_source = source
    elif source not in step.collective_source.split("+"):
        step.collective_source = "+".join(sorted({*step.collective_source.split("+"), source}))


def _wait_outside_step(start: float, end: float) -> None:
    """A wait while no step is open: the next step's interval holds it."""
    _pending[0] += end - start
    _pending_waits[0] += 1
    if len(_pending_windows) < MAX_WAIT_WINDOWS:
        _pending_windows.append((start, end))
    else:
        _pending_windows[-1] = (_pending_windows[-1][0], end)


def _timed_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    # Patched on the Work class itself (no proxy object: code that checks isinstance(work, Work),
    # as FSDP does, or hands the Work to C++, sees the real one).
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _inside[0]:
            return original(self, *args, **kwargs)
        start = _perf()
        try:
            return original(self, *args, **kwargs)
        finally:
            end = _perf()
            step = _current_step()
            if step is None:
                _wait_outside_step(start, end)
            else:
                _add_wait(step, start, end, SOURCE_TORCH)

    return wait


def _timed(original: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _inside[0]:
            return original(*args, **kwargs)
        _inside[0] = True
        start = _perf()
        try:
            work = original(*args, **kwargs)
        finally:
            _inside[0] = False
        if work is not None and hasattr(work, "wait"):  # async_op=True: the wait is in Work.wait()
            return work
        # Synchronous: it returned when the collective completed.
        end = _perf()
        step = _current_step()
        if step is None:
            _wait_outside_step(start, end)
        elif step.collective_source == SOURCE_TORCH and not _pending[0] \
                and len(step.collective_windows) < MAX_WAIT_WINDOWS:
            step.collective_wait += end - start  # the common case, kept short
            step.collective_windows.append((start, end))
        else:
            _add_wait(step, start, end, SOURCE_TORCH)
        return work

    return collective


def _default_backend() -> str | None:
    import torch.distributed as dist

    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return str(dist.get_backend())
    except Exception:
        return None


def track_collectives(*, force: bool = False) -> list[str]:
    """Time every collective called through ``torch.distributed`` (idempotent); returns the names wrapped.

    Installs only when the default process group's backend is host-synchronous (gloo), unless
    ``force``: on NCCL the host returns before the collective completes and would read 0 wait.
    Before ``init_process_group`` nothing is known yet: pass ``force=True`` when you know the
    backend is gloo, or let steptrace install it at the first step.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import distributed as ddp_module

    if not force and _default_backend() not in HOST_SYNCHRONOUS_BACKENDS:
        return []
    for name in COLLECTIVES:
        # distributed_c10d is where they live (and where object collectives look them up);
        # torch.distributed re-exports the same functions, rebound too.
        _patch(distributed_c10d, name, _timed, rebind_in=(dist,))
    # An async_op=True collective (and a p2p op) is waited for in Work.wait().
    _patch(distributed_c10d.Work, "wait", _timed_wait)
    # DDP's gradient all-reduce runs in C++, out of the wrappers' sight: its models are tracked at
    # their first forward (track_ddp).
    _patch(ddp_module.DistributedDataParallel, "forward", _ddp_forward)
    return installed()


def untrack_collectives() -> None:
    """Put the original ``torch.distributed`` functions back, newest first."""
    while _patched:
        owner, attribute, original = _patched.pop()
        setattr(owner, attribute, original)


def installed() -> list[str]:
    """What is wrapped now (``all_reduce``, ..., ``Work.wait``, ``DistributedDataParallel.forward``)."""
    names = []
    for owner, attribute, _ in _patched:
        name = attribute if inspect.ismodule(owner) else f"{owner.__name__}.{attribute}"
        if name not in names:
            names.append(name)
    return names


class _DdpBackward:
    """The wait of DDP's gradient all-reduce in one backward pass, without replacing DDP's C++ all-reduce.

    A hook on every parameter's gradient accumulation notes when the last one arrived (the rank's
    backward is done; the last bucket goes out); a callback queued at the end of the backward, after
    DDP's own (which waits for every bucket's all-reduce), notes the completion. Any communication
    hook the model has keeps working: nothing of DDP's is replaced.
    """

    __slots__ = ("arrival", "queued")

    def __init__(self) -> None:
        self.arrival = 0.0
        self.queued = False

    def grad_ready(self, _param: Any) -> None:
        self.arrival = _perf()
        if not self.queued:
            self.queued = True
            _queue_callback(self._requeue)

    def _requeue(self) -> None:
        # DDP queues its finalize callback when the last bucket is ready, after this one was
        # queued at the first gradient: go to the back of the queue once, behind it.
        _queue_callback(self._done)

    def _done(self) -> None:
        self.queued = False
        step = _current_step()
        end = _perf()
        if step is not None:
            _add_wait(step, min(self.arrival, end), end, SOURCE_DDP)
        elif _runtime[0] is not None:
            # A backward between steps (gradient accumulation outside the step): held for the next
            # step, as a collective's wait is, and counted at the run's end if none comes.
            _wait_outside_step(min(self.arrival, end), end)


def _queue_callback(callback: Callable[[], None]) -> None:
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def track_ddp(model: Any, *, force: bool = False) -> Any:
    """Measure the wait of a ``DistributedDataParallel`` model's gradient all-reduce (idempotent);
    returns the model. Installed by :func:`track_collectives` on every DDP model's first forward,
    so a gloo job needs no call; call it for a model whose backward runs before the first step.

    The wait is from the last gradient's arrival (the rank's backward is done) to the end of the
    backward, which DDP holds until every bucket's all-reduce completed. Like
    :func:`track_collectives`, only on gloo unless ``force`` (on NCCL the backward ends before the
    all-reduce does: the host would read no wait).
    """
    if getattr(model, "_steptrace_ddp", None) is not None:
        return model
    if not force and _default_backend() not in HOST_SYNCHRONOUS_BACKENDS:
        model._steptrace_ddp = False
        return model
    tracker = _DdpBackward()
    for param in model.module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(tracker.grad_ready)
    model._steptrace_ddp = tracker
    return model


def _ddp_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_steptrace_ddp") is None:
            try:
                track_ddp(self)
            except Exception:
                self._steptrace_ddp = False  # not trackable (no parameters, a wrapped module): leave it
        return original(self, *args, **kwargs)

    return forward


def release_runtime(runtime: Any) -> None:
    """Called by steptrace when a run shuts down: the wrappers it installed go (a later run installs
    them again at its first step if the process group is still there), so nothing of steptrace's
    stays on ``torch.distributed`` after ``shutdown()``. Collectives held for a next step that did
    not come are counted (:func:`_count_after_last_step`)."""
    if _runtime[0] is runtime:
        _runtime[0] = None
        untrack_collectives()
        _count_after_last_step(runtime)


def _count_after_last_step(runtime: Any) -> None:
    """At the run's end, what waits for the next step has none: a collective that completed after the
    last step (device-timed, or a gloo wait), one not timed then, an async one never waited for. No
    step record can hold them (their time is after the last interval), so they are counted as the
    run's ``collectives_after_last_step`` drop (the run record, steptrace_dropped_records_total, OTLP's
    steptrace.dropped_records), never lost silently; their events and Works are let go."""
    count = len(_pending_device) + _dropped[0] + len(_awaiting) + _pending_waits[0]
    for entry in _pending_device:
        entry.release()
    for _, entry in _awaiting.values():
        entry.release()
    _pending_device.clear()
    _awaiting.clear()
    _dropped[0] = 0
    _pending[0] = 0.0
    _pending_windows.clear()
    _pending_waits[0] = 0
    if count:
        runtime.resolver.count_drop(DROP_COLLECTIVES_AFTER_LAST_STEP, count)


def mark_runtime(runtime: Any) -> None:
    """Called by steptrace at a run's first step: install the collective wrappers where they apply,
    and tell the run which sources it measures (its steps then carry ``collective_wait_seconds``,
    0 when a step had no collective)."""
    try:
        track_collectives()
    except Exception:
        pass
    try:
        if track_device_collectives():
            # Every rank starts counting each group's collectives here, at its first step.
            _sequences.clear()
            _default_group_name[0] = None
            _awaiting.clear()
            for entry in _pending_device:
                entry.release()
            _pending_device.clear()
            _dropped[0] = 0
    except Exception:
        pass
    _runtime[0] = runtime
    _pending[0] = 0.0  # waits before this run's first step are not its steps'
    _pending_windows.clear()
    _pending_waits[0] = 0
    if _patched and _default_backend() in HOST_SYNCHRONOUS_BACKENDS:
        # Every step is measured now: one without a collective waited 0 (steps whose waits were
        # measured say so themselves, e.g. "ddp+torch.distributed"). Wrappers left installed by an
        # earlier run whose process group is gone measure nothing: such a run claims no wait.
        runtime.resolver.collective_source = SOURCE_TORCH


# -- NCCL: collectives timed on the device ---------------------------------------------------------
#
# On NCCL a collective's call returns once it is enqueued, and the wait for the other ranks happens in
# its kernel on the device, so the host cannot see it. What PyTorch does with streams
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): before the collective, ``syncStream`` records an
# event on the caller's current stream and makes the NCCL stream wait on it (the collective starts no
# earlier than the work queued before the call); ``WorkNCCL::wait`` -> ``synchronizeStream`` makes the
# current stream wait on the collective's end event (the host does not block). So two CUDA events of
# steptrace's own, both on the current stream, bracket the collective on the device without touching
# PyTorch's NCCL stream: ``arrived`` recorded just before the call (the same stream position as
# PyTorch's ``syncStream`` event) and ``done`` just after the wait (reached when the collective ended).
# With ``async_op=True`` a third, ``reached``, recorded in ``Work.wait()`` before the stream wait, marks
# when the current stream ran out of work to overlap with: ``done - reached`` is the communication the
# stream was held on (exposed communication, HolisticTraceAnalysis's sense, as far as the stream that
# waits can tell). An async collective's own duration is not measured: ``done - arrived`` also holds
# the compute overlapped with it (a rank slow in that compute would look like the rank that waited),
# and the collective's end event is reachable only through ``Work.wait()``, which also hands its
# buffers back to the allocator (``WorkNCCL::synchronizeStream`` unstashes them), so it cannot be
# called early on a stream of steptrace's; ``Work._get_duration()`` (``TORCH_NCCL_ENABLE_TIMING=1``)
# needs the Work, and its output tensors, kept until the collective ends. Its duration is then None,
# and the cross-rank join leaves the step without a wait rather than give it a wrong one.
# Durations are differences of two events on one GPU, read by the resolver after the step ended on the
# device; the cross-rank wait is joined offline (steptrace.analysis.collectives).

#: Backends whose collectives run asynchronously on a GPU stream: timed by CUDA events.
DEVICE_TIMED_BACKENDS = ("nccl",)
#: Device-timed collectives kept per step, and async ones enqueued but not yet waited for. Past either,
#: a collective is not timed and is counted (``collectives_dropped`` in the step record).
MAX_DEVICE_COLLECTIVES = 4096

#: (group, sequence number) -> how many collectives this process enqueued on each group: the n-th
#: collective on a group is the same on every rank (torch.distributed: every rank of a group must
#: call its collectives in the same order), so ``(group, n)`` names one collective across ranks.
_sequences: dict[str, int] = {}
#: id(work) -> (work, its collective): async collectives waiting for ``Work.wait()``.
_awaiting: dict[int, tuple[Any, "_DeviceCollective"]] = {}
#: Collectives completed while no step was open (the next step holds them), and drops not yet told.
_pending_device: list["_DeviceCollective"] = []
_dropped = [0]


class _DeviceCollective:
    """One collective as this rank's device saw it: events on the caller's current stream."""

    __slots__ = ("group", "seq", "arrived", "reached", "done")

    def __init__(self, group: str, seq: int, arrived: Any):
        self.group, self.seq, self.arrived = group, seq, arrived
        self.reached: Any = None
        self.done: Any = None

    def resolve(self) -> list[Any] | None:
        """``[group, sequence, device_seconds, exposed_seconds]``, read by the resolver once the step
        ended on the device (``done`` precedes the step's end on the same stream); None when it cannot
        be read (its events were not complete: counted by the caller). ``device_seconds`` is None for an
        async collective (see the comment above ``DEVICE_TIMED_BACKENDS``). Torch's event calls are safe
        here: the resolver thread read the step's own markers first, which put it in thread-local
        capture mode on the step's GPU (steptrace.adapters.torch ``_off_thread``), so a 'global'-mode
        graph capture on the training thread is not invalidated (tests/test_nccl_device.py)."""
        try:
            if self.done is None or not self.done.query():
                return None
            if self.reached is None:  # synchronous: the stream waited at once, arrival to end
                device_seconds: float | None = max(0.0, self.arrived.elapsed_time(self.done) / 1000.0)
                exposed_seconds = device_seconds
            else:
                device_seconds = None
                exposed_seconds = max(0.0, self.reached.elapsed_time(self.done) / 1000.0)
        except Exception:
            return None
        finally:
            self.release()  # the events go with the record: nothing of the step's is kept
        return [self.group, self.seq, device_seconds, exposed_seconds]

    def release(self) -> None:
        self.arrived = self.reached = self.done = None


def _timing_event() -> Any:
    # A new one each time: an event is bound to the device of its first record (c10 CUDAEvent), and
    # torch creates the driver's event only then, so there is nothing to gain from a pool.
    import torch

    return torch.cuda.Event(enable_timing=True)


#: The default group's name, looked up at its first collective (it does not change while it exists;
#: reset when a run installs the wrappers).
_default_group_name: list[str | None] = [None]


def _group_name(group: Any) -> str:
    if group is not None:
        name = getattr(group, "group_name", None)
        return str(name) if name is not None else "default"
    cached = _default_group_name[0]
    if cached is None:
        try:
            from torch.distributed import distributed_c10d

            default = distributed_c10d._get_default_group()
        except Exception:
            return "default"  # no default group yet: not cached, asked again next time
        cached = _default_group_name[0] = _group_name(default)
    return cached


#: ``torch.cuda``, set when the wrappers are installed (the wrapper asks it about graph capture).
_cuda: list[Any] = [None]


def _count_drop() -> None:
    """A collective not timed: the open step (or the next one) says so in ``collectives_dropped``."""
    step = _current_step()
    if step is None:
        _dropped[0] += 1
    else:
        step.device_collectives_dropped += 1


def _device_done(entry: _DeviceCollective) -> None:
    """Give a completed collective to the open step (or the next one)."""
    step = _current_step()
    if step is None:
        if len(_pending_device) < MAX_DEVICE_COLLECTIVES:
            _pending_device.append(entry)
        else:
            _dropped[0] += 1
            entry.release()
        return
    held = step.device_collectives
    if not held:
        held = step.device_collectives = []
    if _pending_device:
        held.extend(_pending_device)
        _pending_device.clear()
    if _dropped[0]:
        step.device_collectives_dropped += _dropped[0]
        _dropped[0] = 0
    if len(held) < MAX_DEVICE_COLLECTIVES:
        held.append(entry)
    else:
        step.device_collectives_dropped += 1
        entry.release()


def _device_timed(original: Callable[..., Any]) -> Callable[..., Any]:
    try:
        group_index = list(inspect.signature(original).parameters).index("group")
    except (ValueError, TypeError):
        group_index = -1

    def collective(*args: Any, **kwargs: Any) -> Any:
        if _inside[0]:
            return original(*args, **kwargs)
        if _cuda[0] is not None and _cuda[0].is_current_stream_capturing():
            # A CUDA graph is being captured on this stream: an event recorded now would become a node
            # of the user's graph (DESIGN.md: never touch a stream being captured). Not timed, counted.
            _count_drop()
            return original(*args, **kwargs)
        group = kwargs.get("group")
        if group is None and 0 <= group_index < len(args):
            group = args[group_index]
        name = _group_name(group)
        seq = _sequences[name] = _sequences.get(name, 0) + 1
        arrived = _timing_event()
        arrived.record()  # the current stream's position: where PyTorch's syncStream event goes
        entry = _DeviceCollective(name, seq, arrived)
        _inside[0] = True
        try:
            work = original(*args, **kwargs)
        finally:
            _inside[0] = False
        if work is not None and hasattr(work, "wait"):  # async_op=True: ends at Work.wait()
            if len(_awaiting) < MAX_DEVICE_COLLECTIVES:
                _awaiting[id(work)] = (work, entry)
            else:
                _count_drop()
                entry.release()
            return work
        # Synchronous: PyTorch has made the current stream wait on the collective already.
        entry.done = _timing_event()
        entry.done.record()
        _device_done(entry)
        return work

    return collective


def _device_timed_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = None if _inside[0] else _awaiting.pop(id(self), None)
        if held is None:
            return original(self, *args, **kwargs)
        entry = held[1]
        entry.reached = _timing_event()
        entry.reached.record()  # the current stream ran out of work to overlap with here
        try:
            return original(self, *args, **kwargs)
        finally:
            entry.done = _timing_event()
            entry.done.record()  # reached once the current stream resumed: the collective ended
            _device_done(entry)

    return wait


def track_device_collectives(*, force: bool = False) -> list[str]:
    """Time every collective called through ``torch.distributed`` on the GPU with CUDA events
    (idempotent); returns the names wrapped. Installs only when the default process group's backend
    is NCCL, unless ``force``. Each step record then carries ``collectives`` (per collective: group,
    sequence number, device seconds from arrival to completion, exposed seconds) and
    ``exposed_communication_seconds``; the wait for peers is joined across ranks by
    :func:`steptrace.analysis.collectives.join_device_collectives`. Collectives are counted per
    group from this call on: every rank installs it at its first step (or calls it at the same point)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not force and _default_backend() not in DEVICE_TIMED_BACKENDS:
        return []
    import torch

    _cuda[0] = torch.cuda
    for name in COLLECTIVES:
        _patch(distributed_c10d, name, _device_timed, rebind_in=(dist,))
    _patch(distributed_c10d.Work, "wait", _device_timed_wait)
    return installed()

