"""The record schema: every record steptrace writes, its fields, and the names exporters share.

One place for the contract between the resolver that builds records and everything that reads them
(the sinks, the exporters, the report, the timeline, the collector):

* the record types as ``TypedDict``s (field names, types, units: ``*_time`` are unix seconds,
  ``*_seconds`` durations), and :class:`RecordBuilder`, the only code that builds them;
* the drop reasons counted before records reach a sink (``DROP_*``) and the per-sink reason;
* the OTLP attribute names (``ATTR_*``, the ``train.*`` namespace) that the OTLP exporter writes
  and the collector reads.

The timing numbers themselves come from the timing model (``_attribution``); this module only
places them in records. A leaf module: it imports nothing from steptrace but ``_ids`` and ``_attribution``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, NotRequired, Sequence, TypedDict

from steptrace._attribution import collective_wait_placement, own_seconds
from steptrace._ids import trace_id_hex_of_run


RECORD_TYPES = ("attempt", "metadata", "step", "microbatch", "checkpoint", "span", "stall", "stall_end", "capture",
                "run")

# -- drop reasons: records that never reached a sink, counted (stats()["dropped"], the run
# record, steptrace_dropped_records_total, steptrace.dropped_records) ------------------------
DROP_RESOLVER_QUEUE = "resolver_queue"  # the resolver's queue was full (max_queue)
DROP_MISUSE = "misuse"  # a misused call was ignored
DROP_DEVICE_WAIT_ERROR = "device_wait_error"  # waiting for a unit's values raised
DROP_UNRESOLVED_AT_SHUTDOWN = "unresolved_at_shutdown"  # still pending when shutdown gave up
DROP_RESOLVER_ERROR = "resolver_error"  # the resolver failed on a unit (a bug: logged)
DROP_SCALAR_ERROR = "scalar_error"  # a logged scalar could not be read (the step record is written without it)
# Degraded, not dropped: the record is written, host-timed instead of device-timed.
DROP_DEVICE_MARKER_ERROR = "device_marker_error"  # a device marker could not be recorded
DROP_DEVICE_CLOCK_ERROR = "device_clock_error"  # a marker could not be placed on the host clock
# pauses=True: garbage collections the ring (steptrace/_pauses.py, GC_RING) could not hold between two of
# the resolver's drains; the step records are written without them.
DROP_GC_PAUSES = "gc_pauses"
RESOLVER_DROP_REASONS = (DROP_RESOLVER_QUEUE, DROP_MISUSE, DROP_DEVICE_WAIT_ERROR, DROP_UNRESOLVED_AT_SHUTDOWN,
                         DROP_RESOLVER_ERROR, DROP_SCALAR_ERROR, DROP_DEVICE_MARKER_ERROR,
                         DROP_DEVICE_CLOCK_ERROR, DROP_GC_PAUSES)
# Counted at a run's end only (not exported at 0 before: a series on every rank for a count that
# can only appear as the run closes). Collectives a step would have held (the next step holds one
# that completes between steps) with no step left to hold them: completed after the run's last step
# (device-timed on NCCL, or a gloo wait), or an async NCCL collective not waited for by the end.
DROP_COLLECTIVES_AFTER_LAST_STEP = "collectives_after_last_step"
RUN_END_DROP_REASONS = (DROP_COLLECTIVES_AFTER_LAST_STEP,)
BUILTIN_SINKS = ("jsonl", "prometheus", "otlp")


def sink_drop_reason(sink_name: str) -> str:
    """The drop reason of records a sink could not take or export: ``sink:<name>``."""
    return f"sink:{sink_name}"


def invalid_record_reason(sink_name: str) -> str:
    """A record the sink could not encode (it is dropped alone): ``invalid:<name>``."""
    return f"invalid:{sink_name}"


def rejected_record_reason(sink_name: str, reason: str) -> str:
    """Records the receiver refused after taking the export (OTLP ``partial_success``): ``rejected:<name>:<why>``."""
    return f"rejected:{sink_name}:{reason}"


def usual_drop_reasons(sink_names: "tuple[str, ...] | list[str]") -> tuple[str, ...]:
    """The resolver's reasons and each named sink's two: what is exported at 0 before any drop.

    Only sinks that exist: a ``sink="otlp"`` series with OTLP off would say an exporter runs.
    """
    return (RESOLVER_DROP_REASONS + tuple(sink_drop_reason(s) for s in sink_names)
            + tuple(invalid_record_reason(s) for s in sink_names))


KNOWN_DROP_REASONS = usual_drop_reasons(BUILTIN_SINKS) + RUN_END_DROP_REASONS


# -- OTLP: the train.* attributes the OTLP exporter writes and the collector reads ------------
ATTR_PREFIX = "train."
SPAN_STEP = "train.step"  # the span name of a step (attribute ATTR_STEP holds its number)
ATTR_RUN_ID = "train.run_id"
ATTR_RANK = "train.rank"
ATTR_STEP = "train.step"
ATTR_WORLD_SIZE = "train.world_size"
ATTR_ATTEMPT = "train.attempt"
ATTR_STATUS = "train.status"
ATTR_INTERVAL_SECONDS = "train.interval_seconds"
ATTR_COMPUTE_SECONDS = "train.compute_seconds"
ATTR_IDLE_SECONDS = "train.idle_seconds"
ATTR_COLLECTIVE_WAIT_SECONDS = "train.collective_wait_seconds"
ATTR_OWN_SECONDS = "train.own_seconds"
ATTR_OWN_COMPUTE_SECONDS = "train.own_compute_seconds"
ATTR_EXPOSED_COMMUNICATION_SECONDS = "train.exposed_communication_seconds"  # NCCL, device-timed
ATTR_COLLECTIVE_WAIT_IDLE_PREFIX = "train.collective_wait_idle."  # + reason + "_seconds"
# A step's device-timed NCCL collectives (the record's ``collectives``), as three arrays of one length:
# group names, per-group sequence numbers, device seconds (-1 where not measured: async collectives).
# Sent only for a step with at most OTLP_MAX_COLLECTIVES of them: the collector joins the ranks on them.
ATTR_COLLECTIVES_GROUP = "train.collectives.group"
ATTR_COLLECTIVES_SEQ = "train.collectives.seq"
ATTR_COLLECTIVES_DEVICE_SECONDS = "train.collectives.device_seconds"
OTLP_MAX_COLLECTIVES = 64
ATTR_BUBBLE_PREFIX = "train.pipeline.bubble_ratio."  # + stage
ATTR_BEFORE_STEP_PREFIX = "train.before_step."  # + reason + "_seconds": a rank's first step only
ATTR_PROCESS_START_TIME = "train.process_start_time"  # unix seconds, on an attempt's first step
ATTR_HOST_PAUSES_PREFIX = "train.host_pauses."  # + field (pauses=True, docs/pauses.md); a list's items + "." + index
ATTR_HEALTH_PREFIX = "train.health."  # + field, or field + "." + key: a step's GPU health window


#: The span a checkpoint restore is timed as (``steptrace.restore``); the step after one is marked
#: ``first_after_restore``.
RESTORE_SPAN = "restore"


def step_field_attribute(field: str) -> str:
    """The attribute a step record's field is exported as: ``train.<field>``."""
    return ATTR_PREFIX + field


# -- records ---------------------------------------------------------------------------------
class _Common(TypedDict):
    type: str
    run_id: str
    rank: int
    attempt: int  # which process start of the run wrote it (see _config: attempt)


#: ``collective_wait_source`` of waits joined across ranks from NCCL collectives timed on the device
#: (written by the analysis, steptrace.analysis.collectives; the adapter that times them names it too).
COLLECTIVE_SOURCE_NCCL_DEVICE = "nccl-device"


class StepRecord(_Common):
    world_size: int
    step: int
    trace_id: str  # 32 hex digits shared by every rank's step (see _ids)
    status: str  # "ok" | "error"
    error: NotRequired[str]
    backend: str  # "jax" | "torch-cuda" | "host" | "simulated"
    end_source: str  # "device_clock" | "device" | "observed" | "host"
    host_start_time: float
    host_end_time: float
    dispatch_time: float
    start_time: float
    end_time: float
    interval_seconds: float
    compute_seconds: float
    idle_seconds: float
    idle_breakdown: dict[str, float]  # reason -> seconds, sums to idle_seconds
    idle_segments: list[list[Any]]  # [reason, start_time, end_time]
    tokens: float | None
    samples: float | None
    flops: float | None  # the count tflops_per_second is of: hardware_flops where measured, else model_flops
    model_flops: float | None  # step(n, flops=<number>): what the model needs (MFU's numerator)
    hardware_flops: float | None  # flops="auto": what the device executed, from the compiler (HFU's)
    flops_source: str | None  # where hardware_flops come from: "xla_cost_analysis" | "torch_flop_counter"
    peak_flops: float | None  # the device's dense bf16 peak, FLOP/s (config peak_tflops, else the table)
    tokens_per_second: float | None
    samples_per_second: float | None
    tflops_per_second: float | None
    mfu: float | None  # model_flops / compute_seconds / peak_flops
    hfu: float | None  # hardware_flops / compute_seconds / peak_flops
    attrs: dict[str, Any]
    pipeline_bubble_ratio: NotRequired[dict[str, float]]  # stage -> ratio, steps with microbatches
    optimizer_seconds: NotRequired[float]  # device time after the last microbatch, steps with microbatches
    scalars: NotRequired[dict[str, float]]  # s.log(name=value), read after the step ended
    # Device memory after the step, where the backend reports it: in_use_bytes, peak_bytes,
    # limit_bytes, peak_percent (peak / limit * 100).
    device_memory: NotRequired[dict[str, float]]
    # Device-clock steps (end_source "device_clock"): half-width (seconds) of the interval the step's
    # placement on the host clock is known within; its durations do not depend on it.
    placement_uncertainty_seconds: NotRequired[float]
    # On the first step of a run only: the time from init() to this step's host start, by the
    # spans covering it ("eval", "data", ...), "startup" for what no span covers. It is wall time
    # of the run outside every step's interval.
    before_step_seconds: NotRequired[float]
    before_step_breakdown: NotRequired[dict[str, float]]
    # Where the run measures its wait in collectives (steptrace.adapters.torch_distributed): the
    # seconds of the step this rank spent waiting for other ranks, the rest (interval - wait), and
    # how the wait was measured ("torch.distributed", "ddp", joined by "+"; "nccl-device", joined
    # across ranks by the analysis).
    # The wait splits the step: own_compute_seconds (compute less the wait inside it) +
    # collective_wait_seconds + (idle_breakdown less collective_wait_idle_breakdown, the wait that
    # fell in each idle reason's windows) = interval_seconds.
    collective_wait_seconds: NotRequired[float]
    own_seconds: NotRequired[float]
    own_compute_seconds: NotRequired[float]
    collective_wait_idle_breakdown: NotRequired[dict[str, float]]
    collective_wait_source: NotRequired[str]
    # NCCL (steptrace.adapters.torch_distributed, device-timed): per collective completed in the step,
    # [group, sequence number, device seconds from this rank's arrival to completion, exposed seconds
    # (the part the waiting stream had no work to overlap)]; their exposed sum; collectives not timed.
    # The wait fields above are joined across ranks from these (steptrace.analysis.collectives).
    collectives: NotRequired[list[list[Any]]]
    exposed_communication_seconds: NotRequired[float]
    collectives_dropped: NotRequired[int]
    # True on the first step after a restore (a ``restore`` span closed between steps): it carries
    # the restart's one-off costs (compile, graph capture, warm-up). Absent on every other step.
    # Its one_off_seconds (interval less the run's typical step interval) is computed by the
    # analysis, which sees the whole run (steptrace.analysis.summary.after_restore_costs).
    first_after_restore: NotRequired[bool]
    # health="nvml" (steptrace/_health.py, docs/health.md): the GPU's health over the sampling window
    # that ended in this step (the steps since the previous window share it: window_steps). Counters
    # as deltas (violation_ms / violation_percent per policy, energy_joules, error counts), gauges as
    # min/mean/max (sm_clock_mhz_*, temperature_c_max, power_watts_mean), clocks_event_reasons OR-ed;
    # a field the GPU does not support is null and named in unsupported (field -> NVML error).
    health: NotRequired[dict[str, Any]]
    # pauses=True (steptrace/_pauses.py, docs/pauses.md): what paused the training thread in this step:
    # gc_seconds, gc_collections ([gen 0, gen 1, gen 2]), gc_collected, gc_max_seconds, gc_max_generation
    # (the collections that began in its interval; the part of them charged is idle_breakdown["gc"]),
    # preempted_seconds (run-queue wait), involuntary_switches, major_faults (null where the kernel has none).
    host_pauses: NotRequired[dict[str, Any]]


class MicrobatchRecord(_Common):
    step: int
    microbatch: Any
    stage: Any
    chunk: Any
    kind: str  # "forward" | "backward" | "backward_input" | "backward_weight" (a zero-bubble split backward)
    host_start_time: float
    host_end_time: float
    start_time: float
    end_time: float
    compute_seconds: float
    end_source: str
    placement_uncertainty_seconds: NotRequired[float]  # as the step's, device-clock microbatches


class CheckpointRecord(_Common):
    step: int  # the trainer's number for the save
    after_step: int | None  # the step whose device work preceded it (blocking_seconds counts from its end)
    status: str  # "ok" | "error" | "incomplete"
    error: NotRequired[str]
    start_time: float
    end_time: float
    host_seconds: float
    blocking_seconds: float
    async_seconds: float | None


class SpanRecord(_Common):
    name: str
    step: int | None
    start_time: float
    end_time: float
    seconds: float
    attrs: dict[str, Any]


class MetadataRecord(_Common):
    """Written once per run and rank, before its first step: what a comparison must know."""

    world_size: int
    start_time: float
    hostname: str
    versions: dict[str, str]  # python, steptrace, and jax, jaxlib, torch, cuda, ... as imported
    devices: dict[str, Any]  # platform, kind, count (global_count with JAX)
    git_commit: str | None  # of the working directory, when it is in a git repository
    tags: dict[str, str]  # init(tags=...) / STEPTRACE_TAGS


class AttemptRecord(_Common):
    """Written at init(): this process start of the run. How it ended is read from what follows
    (a ``run`` record: a clean shutdown; none and a later attempt: it crashed)."""

    world_size: int
    start_time: float  # the process start (Linux /proc), else init()
    init_time: float
    attempt_source: str  # where the attempt number came from: code, env, launcher, run_dir, default
    run_id_source: str  # where the run id came from: code, env, launcher:<VAR>, torchelastic_agent, generated
    pid: int
    hostname: str


class StallRecord(_Common):
    """The rank stopped moving for longer than its threshold: where every thread's Python was."""

    step: int  # the open step, or (between steps) the last one entered
    in_step: bool
    span: str | None  # the innermost span or checkpoint open since the step boundary
    start_time: float  # when the step was entered (in_step) or the last one left
    open_seconds: float  # how long it had been open when the watch noticed
    threshold_seconds: float
    threads: list[dict[str, Any]]  # name, training, frames [[file, line, function], ...], frames_left_out
    collectives: list[dict[str, Any]] | None  # NCCL flight recorder entries, where available
    steptrace_paths: list[str]  # folders of steptrace's own code in the writing process: its frames


class StallEndRecord(_Common):
    """The stalled rank moved again."""

    step: int
    in_step: bool
    span: str | None
    start_time: float
    lasted_seconds: float


class CaptureRecord(_Common):
    """A deep capture (steptrace/_capture.py): a profiler trace taken, or why not."""

    status: str  # ok, failed, skipped
    trigger: str  # slow, stall, spike, straggler, request
    trigger_step: int | None
    reason: str
    first_step: int | None
    last_step: int | None
    path: str | None
    profiler: str | None
    bytes: int
    start_time: float
    end_time: float
    triggers_skipped: int  # requests since the previous capture record refused again for a reason already said
    start_seconds: NotRequired[float]  # the training thread's pause starting the profiler
    stop_seconds: NotRequired[float]  # the training thread's pause stopping it, stop to resume
    write_seconds: NotRequired[float]  # collecting and writing the trace, on the capture's writer thread
    skipped_because: NotRequired[str]
    error: NotRequired[str]


class RunRecord(_Common):
    world_size: int
    steps: int
    dropped: dict[str, int]
    background_cpu_seconds: dict[str, float]
    device_clock: NotRequired[dict[str, Any]]


def _per_second(amount: float | None, seconds: float) -> float | None:
    return amount / seconds if amount is not None and seconds > 0 else None


def _utilization(flops: float | None, compute_seconds: float, per: float | None) -> float | None:
    """FLOPs per second of compute, divided by ``per`` (1e12 for TFLOP/s, the peak for MFU/HFU)."""
    if flops is None or not per or compute_seconds <= 0:
        return None
    return flops / compute_seconds / per


class _StepFields(NamedTuple):
    """What a step record takes from the training thread's step handle (``StepHandle`` has these names)."""

    step: int
    status: str
    error: str | None
    host_start: float
    dispatch: float
    tokens: float | None
    samples: float | None
    flops: float | None
    attrs: dict[str, Any]
    hardware_flops: float | None
    flops_source: str | None
    collective_wait: float
    collective_windows: Sequence[tuple[float, float]]
    first_after_restore: bool


#: The fields every step record has, in the order it has them (the optional ones follow).
_STEP_FIELD_ORDER = (
    "type", "run_id", "rank", "attempt", "world_size", "step", "trace_id", "status", "backend", "end_source",
    "host_start_time", "host_end_time", "dispatch_time", "start_time", "end_time", "interval_seconds",
    "compute_seconds", "idle_seconds", "idle_breakdown", "idle_segments", "tokens", "samples", "flops",
    "model_flops", "hardware_flops", "flops_source", "peak_flops", "tokens_per_second", "samples_per_second",
    "tflops_per_second", "mfu", "hfu", "attrs")


class RecordBuilder:
    """Builds the records of one rank's run. Times given are ``perf_counter`` seconds; records
    carry unix seconds (``+ unix_offset``)."""

    def __init__(self, *, run_id: str, rank: int, world_size: int, peak_tflops: float | None, unix_offset: float,
                 attempt: int = 0):
        self.run_id = run_id
        self.rank = rank
        self.attempt = attempt
        self.world_size = world_size
        #: The device's peak FLOP/s for MFU and HFU: the configured one, else the table's for the
        #: device kind (set_peak, once the resolver knows the device), else None (no MFU).
        self.peak_flops = peak_tflops * 1e12 if peak_tflops else None
        self.unix_offset = unix_offset
        self._trace_id_hex = trace_id_hex_of_run(run_id, attempt)
        #: Every field of a step record, in its order (the record's JSON text follows it), with the run's
        #: own values (fixed here, as the trace ids' are) and None for the rest: step_of copies it and
        #: sets the step's values.
        self._step_fields: dict[str, Any] = dict.fromkeys(_STEP_FIELD_ORDER)
        self._step_fields.update(type="step", run_id=run_id, rank=rank, attempt=attempt, world_size=world_size)

    def set_peak(self, peak_flops: float | None) -> None:
        """The device's peak from the table, unless one is configured."""
        if self.peak_flops is None:
            self.peak_flops = peak_flops

    def step(self, *, step: int, status: str, error: str | None, backend: str, end_source: str,
             host_start: float, host_end: float, dispatch: float, timing: Any,
             segments: Sequence[Any], breakdown: dict[str, float], tokens: float | None,
             samples: float | None, flops: float | None, attrs: dict[str, Any],
             bubble: dict[str, float] | None, optimizer_seconds: float | None = None,
             scalars: dict[str, float] | None = None,
             device_memory: dict[str, float] | None = None, hardware_flops: float | None = None,
             flops_source: str | None = None, placement_uncertainty: float | None = None,
             collective_wait: float = 0.0, collective_source: str | None = None,
             collective_windows: Sequence[tuple[float, float]] = (),
             first_after_restore: bool = False, collectives: list[list[Any]] | None = None,
             collectives_dropped: int = 0) -> StepRecord:
        """A step record from its parts named one by one (tests, tools); the resolver uses :meth:`step_of`."""
        unit = _StepFields(step, status, error, host_start, dispatch, tokens, samples, flops, attrs,
                           hardware_flops, flops_source, collective_wait, collective_windows, first_after_restore)
        return self.step_of(unit, backend, end_source, host_end, timing, segments, breakdown, bubble,
                            optimizer_seconds, scalars, device_memory, placement_uncertainty, collective_source,
                            collectives, collectives_dropped)

    def step_of(self, unit: Any, backend: str, end_source: str, host_end: float, timing: Any,
                segments: Sequence[Any], breakdown: dict[str, float], bubble: dict[str, float] | None,
                optimizer_seconds: float | None, scalars: dict[str, float] | None,
                device_memory: dict[str, float] | None, placement_uncertainty: float | None,
                collective_source: str | None, collectives: list[list[Any]] | None,
                collectives_dropped: int, /) -> StepRecord:
        """The record of a finalized step. ``unit`` holds what the training thread recorded, by the names of
        :class:`_StepFields` (the resolver passes its step handle); the rest is what the resolver worked out.
        Positional: a call naming its ~30 arguments cost ~2.7 µs a step on the 2-vCPU bench VM, a fifth
        of building the record (bench/RESULTS.md, issue 35)."""
        step, tokens, samples, model_flops = unit.step, unit.tokens, unit.samples, unit.flops
        hardware_flops = unit.hardware_flops
        host_start, dispatch = unit.host_start, unit.dispatch
        off = self.unix_offset
        compute, interval = timing.compute_seconds, timing.interval_seconds
        flops_source = None if hardware_flops is None else unit.flops_source
        counted = hardware_flops if hardware_flops is not None else model_flops
        peak = self.peak_flops
        # A copy of the record's fields in their order, then the step's values: copying a dict's table
        # cost less than half of building the 33-key literal (~0.8 against ~1.8 µs on the bench VM).
        record: StepRecord = self._step_fields.copy()  # type: ignore[assignment]
        record["step"] = step
        record["trace_id"] = self._trace_id_hex(step)
        record["status"] = unit.status
        record["backend"] = backend
        record["end_source"] = end_source
        record["host_start_time"] = host_start + off
        record["host_end_time"] = host_end + off
        record["dispatch_time"] = dispatch + off
        record["start_time"] = timing.start + off
        record["end_time"] = timing.end + off
        record["interval_seconds"] = interval
        record["compute_seconds"] = compute
        record["idle_seconds"] = timing.idle_seconds
        record["idle_breakdown"] = breakdown
        if len(segments) == 1:  # a plain step's one idle window: no comprehension (a function call in 3.11)
            only = segments[0]
            record["idle_segments"] = [[only.name, only.start + off, only.end + off]]
        else:
            record["idle_segments"] = [[s.name, s.start + off, s.end + off] for s in segments]
        # What a step counts, and the rates, only where there is something (most steps count nothing:
        # the copy holds None for them).
        if tokens is not None:
            record["tokens"] = tokens
            record["tokens_per_second"] = _per_second(tokens, interval)
        if samples is not None:
            record["samples"] = samples
            record["samples_per_second"] = _per_second(samples, interval)
        if counted is not None:
            record["flops"] = counted
            record["tflops_per_second"] = _utilization(counted, compute, 1e12)
        if model_flops is not None:
            record["model_flops"] = model_flops
            record["mfu"] = _utilization(model_flops, compute, peak)
        if hardware_flops is not None:
            record["hardware_flops"] = hardware_flops
            record["flops_source"] = flops_source
            record["hfu"] = _utilization(hardware_flops, compute, peak)
        record["peak_flops"] = peak
        record["attrs"] = unit.attrs
        error = unit.error
        if error is not None:
            record["error"] = error
        if bubble is not None:
            record["pipeline_bubble_ratio"] = bubble
        if optimizer_seconds is not None:
            record["optimizer_seconds"] = optimizer_seconds
        if scalars:
            record["scalars"] = scalars
        if device_memory:
            memory = dict(device_memory)
            if memory.get("limit_bytes") and "peak_bytes" in memory:
                memory["peak_percent"] = 100.0 * memory["peak_bytes"] / memory["limit_bytes"]
            record["device_memory"] = memory
        if placement_uncertainty is not None:
            record["placement_uncertainty_seconds"] = placement_uncertainty
        if unit.first_after_restore:
            record["first_after_restore"] = True
        if collectives is not None:
            record["collectives"] = collectives
            record["exposed_communication_seconds"] = math.fsum(entry[3] for entry in collectives)
            if collectives_dropped:
                record["collectives_dropped"] = collectives_dropped
        if collective_source is not None:
            # The wait happened within the step's interval (during its compute, or in a host span
            # or between steps: idle time); it cannot be longer. Where it fell splits the step into
            # own compute + wait + host idle by reason (waiting shown as waiting).
            in_compute, in_idle = collective_wait_placement(min(max(0.0, unit.collective_wait), interval), compute,
                                                            unit.collective_windows, segments)
            wait = in_compute + math.fsum(in_idle.values())
            record["collective_wait_seconds"] = wait
            record["own_seconds"] = own_seconds(interval, wait)
            record["own_compute_seconds"] = compute - in_compute
            record["collective_wait_idle_breakdown"] = in_idle
            record["collective_wait_source"] = collective_source
        return record

    @staticmethod
    def add_before_steps(record: StepRecord, segments: Sequence[Any]) -> None:
        """Put the time before the run's first step (``segments`` tiling it) on that step's record."""
        breakdown: dict[str, float] = {}
        for segment in segments:
            breakdown[segment.name] = breakdown.get(segment.name, 0.0) + (segment.end - segment.start)
        record["before_step_seconds"] = sum(breakdown.values())
        record["before_step_breakdown"] = breakdown

    def microbatch(self, *, step: int, index: Any, stage: Any, chunk: Any, kind: str, host_start: float,
                   host_end: float, timing: Any, end_source: str,
                   placement_uncertainty: float | None = None) -> MicrobatchRecord:
        off = self.unix_offset
        record: MicrobatchRecord = {
            "type": "microbatch", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt, "step": step,
            "microbatch": index, "stage": stage, "chunk": chunk, "kind": kind,
            "host_start_time": host_start + off, "host_end_time": host_end + off,
            "start_time": timing.start + off, "end_time": timing.end + off,
            "compute_seconds": timing.compute_seconds, "end_source": end_source,
        }
        if placement_uncertainty is not None:
            record["placement_uncertainty_seconds"] = placement_uncertainty
        return record

    def checkpoint(self, *, step: int, after_step: int | None, status: str, error: str | None, host_start: float,
                   host_end: float, blocking_seconds: float, async_end: float | None) -> CheckpointRecord:
        record: CheckpointRecord = {
            "type": "checkpoint", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt, "step": step,
            "after_step": after_step, "status": status,
            "start_time": host_start + self.unix_offset, "end_time": host_end + self.unix_offset,
            "host_seconds": host_end - host_start, "blocking_seconds": blocking_seconds,
            "async_seconds": None if async_end is None else max(0.0, async_end - host_end),
        }
        if error:
            record["error"] = error
        return record

    def span(self, *, name: str, step: int | None, start: float, end: float, attrs: dict[str, Any]) -> SpanRecord:
        return {
            "type": "span", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt, "name": name,
            "step": step,
            "start_time": start + self.unix_offset, "end_time": end + self.unix_offset,
            "seconds": end - start, "attrs": attrs,
        }

    def metadata(self, *, start: float, facts: dict[str, Any]) -> MetadataRecord:
        return {"type": "metadata", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt,
                "world_size": self.world_size,
                "start_time": start + self.unix_offset, "hostname": facts["hostname"], "versions": facts["versions"],
                "devices": facts["devices"], "git_commit": facts["git_commit"], "tags": facts["tags"]}

    def attempt_started(self, *, process_start: float, init_time: float, source: str, pid: int,
                        hostname: str, run_id_source: str = "generated") -> AttemptRecord:
        """``process_start`` is unix seconds already; ``init_time`` a ``perf_counter`` time."""
        return {"type": "attempt", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt,
                "world_size": self.world_size, "start_time": process_start, "init_time": init_time + self.unix_offset,
                "attempt_source": source, "run_id_source": run_id_source, "pid": pid, "hostname": hostname}

    def stall(self, *, step: int, in_step: bool, span: str | None, open_seconds: float, threshold_seconds: float,
              start: float, threads: list[dict[str, Any]], collectives: list[dict[str, Any]] | None,
              steptrace_paths: list[str]) -> StallRecord:
        """``start`` is unix seconds already (the watch converts)."""
        return {"type": "stall", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt, "step": step,
                "in_step": in_step, "span": span, "start_time": start, "open_seconds": open_seconds,
                "threshold_seconds": threshold_seconds, "threads": threads, "collectives": collectives,
                "steptrace_paths": steptrace_paths}

    def stall_end(self, *, step: int, in_step: bool, span: str | None, start: float,
                  lasted_seconds: float) -> StallEndRecord:
        return {"type": "stall_end", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt, "step": step,
                "in_step": in_step, "span": span, "start_time": start, "lasted_seconds": lasted_seconds}

    def run(self, *, steps: int, dropped: dict[str, int], background_cpu_seconds: dict[str, float],
            device_clock: dict[str, Any] | None) -> RunRecord:
        record: RunRecord = {
            "type": "run", "run_id": self.run_id, "rank": self.rank, "attempt": self.attempt,
            "world_size": self.world_size,
            "steps": steps, "dropped": dropped, "background_cpu_seconds": background_cpu_seconds,
        }
        if device_clock:
            record["device_clock"] = device_clock
        return record


def fields_of(record_type: str) -> Iterable[str]:
    """Every field a record of ``record_type`` can have (for docs and tests)."""
    cls = {"attempt": AttemptRecord, "metadata": MetadataRecord, "stall": StallRecord,
           "stall_end": StallEndRecord, "step": StepRecord, "microbatch": MicrobatchRecord,
           "checkpoint": CheckpointRecord, "capture": CaptureRecord,
           "span": SpanRecord, "run": RunRecord}[record_type]
    return tuple(cls.__annotations__)
