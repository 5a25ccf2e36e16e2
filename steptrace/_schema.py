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

from typing import Any, Iterable, NotRequired, Sequence, TypedDict

from steptrace._attribution import own_seconds
from steptrace._ids import trace_id_hex


RECORD_TYPES = ("metadata", "step", "microbatch", "checkpoint", "span", "run")

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
RESOLVER_DROP_REASONS = (DROP_RESOLVER_QUEUE, DROP_MISUSE, DROP_DEVICE_WAIT_ERROR, DROP_UNRESOLVED_AT_SHUTDOWN,
                         DROP_RESOLVER_ERROR, DROP_SCALAR_ERROR, DROP_DEVICE_MARKER_ERROR,
                         DROP_DEVICE_CLOCK_ERROR)
BUILTIN_SINKS = ("jsonl", "prometheus", "otlp")


def sink_drop_reason(sink_name: str) -> str:
    """The drop reason of records a sink could not take or export: ``sink:<name>``."""
    return f"sink:{sink_name}"


def invalid_record_reason(sink_name: str) -> str:
    """A record the sink could not encode (it is dropped alone): ``invalid:<name>``."""
    return f"invalid:{sink_name}"


KNOWN_DROP_REASONS = (RESOLVER_DROP_REASONS + tuple(sink_drop_reason(s) for s in BUILTIN_SINKS)
                      + tuple(invalid_record_reason(s) for s in BUILTIN_SINKS))


# -- OTLP: the train.* attributes the OTLP exporter writes and the collector reads ------------
ATTR_PREFIX = "train."
SPAN_STEP = "train.step"  # the span name of a step (attribute ATTR_STEP holds its number)
ATTR_RUN_ID = "train.run_id"
ATTR_RANK = "train.rank"
ATTR_STEP = "train.step"
ATTR_WORLD_SIZE = "train.world_size"
ATTR_STATUS = "train.status"
ATTR_INTERVAL_SECONDS = "train.interval_seconds"
ATTR_COMPUTE_SECONDS = "train.compute_seconds"
ATTR_IDLE_SECONDS = "train.idle_seconds"
ATTR_COLLECTIVE_WAIT_SECONDS = "train.collective_wait_seconds"
ATTR_OWN_SECONDS = "train.own_seconds"
ATTR_BUBBLE_PREFIX = "train.pipeline.bubble_ratio."  # + stage


def step_field_attribute(field: str) -> str:
    """The attribute a step record's field is exported as: ``train.<field>``."""
    return ATTR_PREFIX + field


# -- records ---------------------------------------------------------------------------------
class _Common(TypedDict):
    type: str
    run_id: str
    rank: int


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
    flops: float | None
    tokens_per_second: float | None
    samples_per_second: float | None
    tflops_per_second: float | None
    mfu: float | None
    attrs: dict[str, Any]
    pipeline_bubble_ratio: NotRequired[dict[str, float]]  # stage -> ratio, steps with microbatches
    optimizer_seconds: NotRequired[float]  # device time after the last microbatch, steps with microbatches
    scalars: NotRequired[dict[str, float]]  # s.log(name=value), read after the step ended
    # Device memory after the step, where the backend reports it: in_use_bytes, peak_bytes,
    # limit_bytes, peak_percent (peak / limit * 100).
    device_memory: NotRequired[dict[str, float]]
    # Where the run measures its wait in collectives (steptrace.adapters.torch_distributed): the
    # seconds of the step this rank spent waiting for other ranks, the rest (interval - wait), and
    # how the wait was measured ("torch.distributed", "ddp_comm_hook", joined by "+").
    collective_wait_seconds: NotRequired[float]
    own_seconds: NotRequired[float]
    collective_wait_source: NotRequired[str]


class MicrobatchRecord(_Common):
    step: int
    microbatch: Any
    stage: Any
    chunk: Any
    kind: str  # "forward" | "backward"
    host_start_time: float
    host_end_time: float
    start_time: float
    end_time: float
    compute_seconds: float
    end_source: str


class CheckpointRecord(_Common):
    step: int
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


class RunRecord(_Common):
    world_size: int
    steps: int
    dropped: dict[str, int]
    background_cpu_seconds: dict[str, float]
    device_clock: NotRequired[dict[str, Any]]


def _per_second(amount: float | None, seconds: float) -> float | None:
    return amount / seconds if amount is not None and seconds > 0 else None


def _positive(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


class RecordBuilder:
    """Builds the records of one rank's run. Times given are ``perf_counter`` seconds; records
    carry unix seconds (``+ unix_offset``)."""

    def __init__(self, *, run_id: str, rank: int, world_size: int, peak_tflops: float | None, unix_offset: float):
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.unix_offset = unix_offset

    def step(self, *, step: int, status: str, error: str | None, backend: str, end_source: str,
             host_start: float, host_end: float, dispatch: float, timing: Any,
             segments: Sequence[Any], breakdown: dict[str, float], tokens: float | None,
             samples: float | None, flops: float | None, attrs: dict[str, Any],
             bubble: dict[str, float] | None, optimizer_seconds: float | None = None,
             scalars: dict[str, float] | None = None,
             device_memory: dict[str, float] | None = None,
             collective_wait: float = 0.0, collective_source: str | None = None) -> StepRecord:
        off = self.unix_offset
        compute, interval = timing.compute_seconds, timing.interval_seconds
        tflops = flops / compute / 1e12 if flops is not None and compute > 0 else None
        # MFU's peak: the configured one, else one the step was given (a framework hook that
        # knows the device, e.g. the Megatron hooks' table of bf16 dense peaks).
        peak = self.peak_tflops or _positive(attrs.get("peak_tflops"))
        record: StepRecord = {
            "type": "step", "run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
            "step": step, "trace_id": trace_id_hex(self.run_id, step), "status": status,
            "backend": backend, "end_source": end_source,
            "host_start_time": host_start + off, "host_end_time": host_end + off, "dispatch_time": dispatch + off,
            "start_time": timing.start + off, "end_time": timing.end + off,
            "interval_seconds": interval, "compute_seconds": compute, "idle_seconds": timing.idle_seconds,
            "idle_breakdown": breakdown,
            "idle_segments": [[s.name, s.start + off, s.end + off] for s in segments],
            "tokens": tokens, "samples": samples, "flops": flops,
            "tokens_per_second": _per_second(tokens, interval),
            "samples_per_second": _per_second(samples, interval),
            "tflops_per_second": tflops,
            "mfu": tflops / peak if tflops is not None and peak else None,
            "attrs": attrs,
        }
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
        if collective_source is not None:
            # The wait happened within the step's interval (during its compute, or in a host span
            # or between steps: idle time); it cannot be longer.
            wait = min(max(0.0, collective_wait), interval)
            record["collective_wait_seconds"] = wait
            record["own_seconds"] = own_seconds(interval, wait)
            record["collective_wait_source"] = collective_source
        return record

    def microbatch(self, *, step: int, index: Any, stage: Any, chunk: Any, kind: str, host_start: float,
                   host_end: float, timing: Any, end_source: str) -> MicrobatchRecord:
        off = self.unix_offset
        return {
            "type": "microbatch", "run_id": self.run_id, "rank": self.rank, "step": step,
            "microbatch": index, "stage": stage, "chunk": chunk, "kind": kind,
            "host_start_time": host_start + off, "host_end_time": host_end + off,
            "start_time": timing.start + off, "end_time": timing.end + off,
            "compute_seconds": timing.compute_seconds, "end_source": end_source,
        }

    def checkpoint(self, *, step: int, status: str, error: str | None, host_start: float, host_end: float,
                   blocking_seconds: float, async_end: float | None) -> CheckpointRecord:
        record: CheckpointRecord = {
            "type": "checkpoint", "run_id": self.run_id, "rank": self.rank, "step": step, "status": status,
            "start_time": host_start + self.unix_offset, "end_time": host_end + self.unix_offset,
            "host_seconds": host_end - host_start, "blocking_seconds": blocking_seconds,
            "async_seconds": None if async_end is None else max(0.0, async_end - host_end),
        }
        if error:
            record["error"] = error
        return record

    def span(self, *, name: str, step: int | None, start: float, end: float, attrs: dict[str, Any]) -> SpanRecord:
        return {
            "type": "span", "run_id": self.run_id, "rank": self.rank, "name": name, "step": step,
            "start_time": start + self.unix_offset, "end_time": end + self.unix_offset,
            "seconds": end - start, "attrs": attrs,
        }

    def metadata(self, *, start: float, facts: dict[str, Any]) -> MetadataRecord:
        return {"type": "metadata", "run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
                "start_time": start + self.unix_offset, "hostname": facts["hostname"], "versions": facts["versions"],
                "devices": facts["devices"], "git_commit": facts["git_commit"], "tags": facts["tags"]}

    def run(self, *, steps: int, dropped: dict[str, int], background_cpu_seconds: dict[str, float],
            device_clock: dict[str, Any] | None) -> RunRecord:
        record: RunRecord = {
            "type": "run", "run_id": self.run_id, "rank": self.rank, "world_size": self.world_size,
            "steps": steps, "dropped": dropped, "background_cpu_seconds": background_cpu_seconds,
        }
        if device_clock:
            record["device_clock"] = device_clock
        return record


def fields_of(record_type: str) -> Iterable[str]:
    """Every field a record of ``record_type`` can have (for docs and tests)."""
    cls = {"metadata": MetadataRecord, "step": StepRecord, "microbatch": MicrobatchRecord,
           "checkpoint": CheckpointRecord,
           "span": SpanRecord, "run": RunRecord}[record_type]
    return tuple(cls.__annotations__)
