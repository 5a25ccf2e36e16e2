"""OTLP export requests in, step spans out: the collector's decoder.

Everything a client sends passes through here before it touches shared
state, and every way it can be wrong ends as a :class:`Rejected` (an HTTP
status plus the ``reason`` label of
``steptrace_collector_rejected_requests_total``), never as another exception.

* :func:`media_type` — ``application/x-protobuf`` or ``application/json``
  (parameters such as ``charset`` allowed); anything else is 415.
* :func:`decompress` — ``gzip``, ``deflate`` or identity, never producing more
  than ``max_bytes`` (a gzip bomb is 413 after at most ``max_bytes + 1`` bytes
  of output, not after inflating it all).
* :func:`parse_request` — the ``Export{Trace,Metrics}ServiceRequest``. OTLP/JSON
  differs from protobuf's canonical JSON in one way that matters: trace and
  span ids are hex strings, not base64 (OTLP spec, "JSON Protobuf Encoding"),
  so they are converted before ``json_format.ParseDict``; unknown fields are
  ignored, as the spec asks of receivers.
* :func:`extract_steps` — the ``train.step`` spans (one per rank and step, see
  ``steptrace/otlp.py``) as :class:`StepSpan` values. A step span whose
  attributes are missing or unusable is counted by reason and skipped; the
  rest of the request still counts.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from steptrace._attribution import own_seconds as _own_seconds
from steptrace._ids import run_id_problem
from steptrace._schema import (
    ATTR_ATTEMPT,
    ATTR_BUBBLE_PREFIX,
    ATTR_COLLECTIVE_WAIT_SECONDS,
    ATTR_COLLECTIVES_DEVICE_SECONDS,
    ATTR_COLLECTIVES_GROUP,
    ATTR_COLLECTIVES_SEQ,
    ATTR_COMPUTE_SECONDS,
    ATTR_EXPOSED_COMMUNICATION_SECONDS,
    ATTR_HEALTH_PREFIX,
    ATTR_HOST_PAUSES_PREFIX,
    ATTR_IDLE_SECONDS,
    ATTR_INTERVAL_SECONDS,
    ATTR_OWN_COMPUTE_SECONDS,
    ATTR_PREFIX,
    ATTR_RANK,
    ATTR_RUN_ID,
    ATTR_STATUS,
    ATTR_STEP,
    ATTR_WORLD_SIZE,
    OTLP_MAX_COLLECTIVES,
    SPAN_STEP,
)

__all__ = [
    "MEDIA_JSON",
    "MEDIA_PROTOBUF",
    "Extracted",
    "LazyTraceRequest",
    "Rejected",
    "StepSpan",
    "count_data_points",
    "count_items",
    "decompress",
    "encode_error",
    "encode_response",
    "extract_steps",
    "media_type",
    "parse_request",
    "response_message",
    "safe_run_id",
    "span_fingerprint",
]

MEDIA_PROTOBUF = "application/x-protobuf"
MEDIA_JSON = "application/json"

#: Rejection reasons, the ``reason`` label values of ``steptrace_collector_rejected_requests_total``.
REJECTION_REASONS = ("malformed", "too_large", "too_many_spans", "unsupported_media_type", "unsupported_encoding",
                     "unauthorized", "forbidden", "not_found", "method_not_allowed", "length_required",
                     "uri_too_long", "headers_too_large", "unsupported_version", "tls", "timeout", "overloaded",
                     "peer_overloaded", "shutting_down", "internal", "journal_failed", "journal_full",
                     "memory_limited", "evicted", "bad_duration")

#: Why a ``train.step`` span was skipped (``steptrace_collector_invalid_spans_total{reason}``).
INVALID_SPAN_REASONS = ("missing_attribute", "bad_value", "bad_run_id", "rank_out_of_range", "step_out_of_range",
                        "world_size_out_of_range", "too_many_runs", "world_size_mismatch", "end_out_of_range")

#: Default bounds on what a span may claim (``--max-world-size``, ``--max-step``).
DEFAULT_MAX_WORLD_SIZE = 65536
DEFAULT_MAX_STEP = 1 << 53

_STEP_SPAN = SPAN_STEP
_BUBBLE_PREFIX = ATTR_BUBBLE_PREFIX
_MAX_LABEL = 64  # status and stage names end up as JSON keys and metric labels
_MAX_STAGES = 256
#: The largest ``--max-world-size`` there is.
MAX_RANK = 1 << 20
#: The largest ``train.attempt`` taken.
MAX_ATTEMPT = 1 << 20
#: The longest duration a span may claim, in seconds (~116 days: longer than any step or collective
#: can take). A value outside ``[0, MAX_DURATION_SECONDS]`` (negative, NaN, infinite, or finite but
#: huge, 1e308) cannot be a duration: the export is refused with a 400 (``bad_duration``). The bound
#: keeps the join's arithmetic finite: its largest sum, over MAX_RANK ranks of OTLP_MAX_COLLECTIVES
#: collectives each, is ~7e14 s, where one rank's 1e308 once overflowed ``math.fsum`` and cost the
#: other ranks their step.
MAX_DURATION_SECONDS = 1e7

_SIGNALS = {
    "traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
    "metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
}


class Rejected(Exception):
    """A request the collector refuses: ``status`` is the HTTP status, ``reason`` the metric label."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def media_type(content_type: str | None) -> str:
    """The request's media type, :data:`MEDIA_PROTOBUF` or :data:`MEDIA_JSON`; 415 otherwise."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in (MEDIA_PROTOBUF, MEDIA_JSON):
        return kind
    raise Rejected(415, "unsupported_media_type",
                   f"Content-Type must be {MEDIA_PROTOBUF} or {MEDIA_JSON}, got {content_type!r}")


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """``body`` decoded per ``Content-Encoding``, at most ``max_bytes`` long (413 beyond)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        # RFC 9110 says zlib-wrapped; some clients send raw deflate. Accept both.
        inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS)
    else:
        raise Rejected(415, "unsupported_encoding",
                       f"Content-Encoding must be gzip, deflate or identity, got {encoding!r}")
    try:
        data = inflater.decompress(body, max_bytes + 1)
        if len(data) > max_bytes or inflater.unconsumed_tail:
            raise Rejected(413, "too_large", f"decompressed body exceeds {max_bytes} bytes")
        data += inflater.flush()
    except zlib.error as exc:
        raise Rejected(400, "malformed", f"cannot decompress the {encoding} body: {exc}") from None
    if len(data) > max_bytes:
        raise Rejected(413, "too_large", f"decompressed body exceeds {max_bytes} bytes")
    if not inflater.eof:
        raise Rejected(400, "malformed", f"truncated {encoding} body")
    return data


def parse_request(signal: str, data: bytes, media: str) -> Any:
    """The ``Export<Signal>ServiceRequest`` in ``data``; 400 when it does not decode.

    Traces come back *lazy* (:data:`LazyTraceRequest`): resources and scopes decoded, each span
    left as its encoded bytes, so :func:`extract_steps` decodes only the spans it uses (a
    pipeline rank's ``train.microbatch`` spans were ~99 % of the parsing, all thrown away). From
    OTLP/JSON, the spans it does not use are blanked before the conversion (each scope's first
    one kept: it names the resource's run when no used span does).
    """
    request_type = _SIGNALS[signal][0]
    try:
        if media == MEDIA_JSON:
            document = json.loads(data)
            if not isinstance(document, dict):
                raise ValueError("the body is not a JSON object")
            if signal == "traces":
                _blank_unused_json_spans(document)
            _hex_ids_to_base64(document)
            message = json_format.ParseDict(document, request_type(), ignore_unknown_fields=True)
            if signal == "traces":
                return _LAZY_REQUEST.FromString(message.SerializeToString())
            return message
        if signal == "traces":
            return _LAZY_REQUEST.FromString(data)
        return request_type.FromString(data)
    except Exception as exc:  # DecodeError, ParseError, ValueError, RecursionError, ...: all a bad body
        raise Rejected(400, "malformed", f"cannot decode the {signal} request as {media}: "
                                         f"{type(exc).__name__}: {str(exc)[:200]}") from None


def response_message(signal: str, rejected: int = 0, message: str = "") -> Any:
    """The ``Export<Signal>ServiceResponse``, with ``partial_success`` when spans were rejected."""
    response = _SIGNALS[signal][1]()
    if rejected:
        if signal == "traces":
            response.partial_success.rejected_spans = rejected
        else:
            response.partial_success.rejected_data_points = rejected
        response.partial_success.error_message = message
    return response


def encode_response(signal: str, media: str, rejected: int = 0, message: str = "") -> bytes:
    """:func:`response_message` encoded for an HTTP answer in ``media``."""
    response = response_message(signal, rejected, message)
    if media == MEDIA_JSON:
        return json.dumps(json_format.MessageToDict(response)).encode()
    return response.SerializeToString()


def encode_error(media: str | None, status: int, message: str) -> tuple[bytes, str]:
    """(body, content type) of an error response: a ``google.rpc.Status``, as OTLP/HTTP asks."""
    try:
        from google.rpc import status_pb2
    except ImportError:  # pragma: no cover - googleapis-common-protos comes with the OTLP exporters
        return message.encode(), "text/plain; charset=utf-8"
    # gRPC codes for the HTTP statuses we send (google.rpc.Code).
    code = {400: 3, 401: 16, 403: 7, 404: 5, 405: 12, 408: 4, 411: 3, 413: 8, 415: 3, 503: 14}.get(status, 13)
    payload = status_pb2.Status(code=code, message=message)
    if media == MEDIA_JSON:
        return json.dumps(json_format.MessageToDict(payload)).encode(), MEDIA_JSON
    if media == MEDIA_PROTOBUF:
        return payload.SerializeToString(), MEDIA_PROTOBUF
    return message.encode(), "text/plain; charset=utf-8"


# -- OTLP/JSON ids -------------------------------------------------------------------------------

_ID_SIZES = {"traceId": 16, "spanId": 8, "parentSpanId": 8, "trace_id": 16, "span_id": 8, "parent_span_id": 8}


def _hex_ids_to_base64(document: Any) -> None:
    """Rewrite OTLP/JSON's hex trace/span ids as the base64 ``json_format`` expects, in place.

    Only a string of exactly twice the id's size in hex digits is rewritten; a
    producer that sends base64 anyway (24 characters with padding for a trace
    id, so never mistaken for hex) still parses. Iterative, so a deeply nested
    body cannot overflow the stack here.
    """
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, str):
                    size = _ID_SIZES.get(key)
                    if size is not None and len(value) == 2 * size:
                        try:
                            node[key] = base64.b64encode(bytes.fromhex(value)).decode()
                        except ValueError:
                            pass
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


# -- lazy trace requests -------------------------------------------------------------------------


def _lazy_request_type() -> Any:
    """``ExportTraceServiceRequest`` with each span kept as bytes: the same wire format (fields 1,
    2 and 3 of each level), so a request parses in one C call without decoding any span."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="steptrace/collector/lazy_trace.proto",
                                               package="steptrace.collector.lazy", syntax="proto3")
    field_type = descriptor_pb2.FieldDescriptorProto
    for name, fields in (("Request", [("resource_spans", 1, "ResourceSpans")]),
                         ("ResourceSpans", [("resource", 1, None), ("scope_spans", 2, "ScopeSpans"),
                                            ("schema_url", 3, None)]),
                         ("ScopeSpans", [("scope", 1, None), ("spans", 2, None), ("schema_url", 3, None)])):
        message = proto.message_type.add(name=name)
        for field_name, number, of in fields:
            repeated = field_name in ("resource_spans", "scope_spans", "spans")
            entry = message.field.add(name=field_name, number=number,
                                      label=field_type.LABEL_REPEATED if repeated else field_type.LABEL_OPTIONAL,
                                      type=field_type.TYPE_MESSAGE if of else field_type.TYPE_BYTES)
            if of:
                entry.type_name = f".steptrace.collector.lazy.{of}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("steptrace.collector.lazy.Request"))


#: What :func:`parse_request` gives for traces: ``resource_spans[i].scope_spans[j].spans[k]`` are bytes.
LazyTraceRequest = _LAZY_REQUEST = _lazy_request_type()

#: The span names the collector decodes: step spans (the join) and stall spans (collector/_stalls.py).
_USED_SPANS = ("train.step", "train.stall", "train.stall_end")
#: Each used name as protobuf writes it in a span (field 5, its length, the name): a span without
#: one of these byte strings is not named so and is skipped without a look at its fields. (A
#: name written with a non-minimal length varint, which no protobuf encoder does, is not seen.)
_NAME_FIELD = re.compile(b"|".join(re.escape(bytes([0x2A, len(name)]) + name.encode()) for name in _USED_SPANS))


def _varint(blob: bytes, i: int) -> tuple[int, int]:
    """The base-128 varint at ``blob[i]`` and the index after it (IndexError when cut short)."""
    value, shift = 0, 0
    while True:
        byte = blob[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _span_name(blob: bytes) -> bytes | None:
    """Field 5 (``name``) of an encoded span, read without decoding the rest; None if unreadable."""
    i, end = 0, len(blob)
    try:
        while i < end:
            tag, i = _varint(blob, i)
            wire = tag & 7
            if wire == 2:
                size, i = _varint(blob, i)
                if tag >> 3 == 5:
                    return blob[i:i + size]
                i += size
            elif wire == 0:
                _, i = _varint(blob, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            else:
                return None
    except IndexError:
        return None
    return None


def _used_span(blob: bytes) -> str | None:
    """The span's name when the collector uses it (:data:`_USED_SPANS`), else None: nothing decoded."""
    if _NAME_FIELD.search(blob) is None:
        return None
    name = _span_name(blob)
    if name is None:
        return None
    text = name.decode("utf-8", "replace")
    return text if text in _USED_SPANS else None


def _blank_unused_json_spans(document: dict[str, Any]) -> None:
    """OTLP/JSON: replace each span the collector does not use by ``{}`` (it is still counted),
    before the ids are converted and the document parsed; each scope's first span stays whole."""
    for resource in _json_list(document, "resourceSpans", "resource_spans"):
        if isinstance(resource, dict):
            for scope in _json_list(resource, "scopeSpans", "scope_spans"):
                spans = scope.get("spans") if isinstance(scope, dict) else None
                if isinstance(spans, list):
                    for k in range(1, len(spans)):
                        if not (isinstance(spans[k], dict) and spans[k].get("name") in _USED_SPANS):
                            spans[k] = {}


def _json_list(node: dict[str, Any], *keys: str) -> list[Any]:
    for key in keys:
        value = node.get(key)
        if isinstance(value, list):
            return value
    return []


# -- step spans ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepSpan:
    """One rank's ``train.step`` span: what the join needs of it."""

    run_id: str
    step: int
    rank: int
    world_size: int | None
    trace_id: str
    compute_seconds: float
    interval_seconds: float
    idle_seconds: float | None = None
    status: str = "ok"
    end_time: float | None = None
    bubble: dict[str, float] = field(default_factory=dict)
    attempt: int = 0  # train.attempt: the run's process start that sent it (old journals lack it)
    #: where the rank measures its wait in collectives (steptrace.adapters.torch_distributed); last:
    #: journals written before they existed lack them
    collective_wait_seconds: float | None = None
    own_seconds: float | None = None
    #: compute less the wait in collectives inside it (the rank's own compute); last, for the journals
    own_compute_seconds: float | None = None
    #: the GPU's health window that ended in this step (``train.health.*``, docs/health.md): the
    #: fields the straggler's cause needs (HEALTH_FIELDS), None where the rank sent none; last, for
    #: the journals
    health: dict[str, Any] | None = None
    #: NCCL collectives timed on the device: the step's communication no compute overlapped
    #: (``train.exposed_communication_seconds``), None where the rank sent none; last, for the journals
    exposed_communication_seconds: float | None = None
    #: its device-timed NCCL collectives (``train.collectives.*``): ``(group, sequence, device
    #: seconds or None)``, at most OTLP_MAX_COLLECTIVES; the join derives each rank's wait from them
    #: where no rank measured it itself. Last, for the journals
    collectives: tuple[tuple[str, int, float | None], ...] | None = None
    #: pauses=True (docs/pauses.md): the rank's seconds per host cause (``gc``, ``data`` charged idle,
    #: ``preempted`` run-queue wait; a cause it did not measure left out) and its largest collection
    #: (``gc_max_seconds``, ``gc_max_generation``); None where the rank sent none. Last, for the journals
    causes: dict[str, float] | None = None
    gc_max: tuple[float, int | None] | None = None


@dataclass
class Extracted:
    """What :func:`extract_steps` found in one request."""

    spans: int = 0
    steps: list[StepSpan] = field(default_factory=list)
    #: reason → step spans skipped
    invalid: dict[str, int] = field(default_factory=dict)
    #: run_id → spans received ("" when the sending resource's spans carry none)
    spans_by_run: dict[str, int] = field(default_factory=dict)
    #: the ranks' ``train.stall`` / ``train.stall_end`` spans (:func:`_stall_span`); bad ones are dropped
    stalls: list[dict[str, Any]] = field(default_factory=list)
    #: spans the collector does not use (not step or stall spans): counted, never decoded
    skipped: int = 0

    @property
    def invalid_total(self) -> int:
        return sum(self.invalid.values())


class _Invalid(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class _NotADuration(Exception):
    """A number where a duration goes that cannot be one: the export is refused (400), not the span skipped."""

    def __init__(self, key: str, value: float):
        self.key = key
        self.value = value


def _is_duration(value: float) -> bool:
    return 0.0 <= value <= MAX_DURATION_SECONDS  # False for NaN too


def safe_run_id(run_id: Any) -> bool:
    """Whether ``run_id`` can name a directory under the run dir (no path tricks, printable)."""
    return run_id_problem(run_id) is None


def _scalar(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return None  # arrays, key-value lists, bytes: only the collectives' arrays (_collectives_arrays)


_COLLECTIVES_ATTRS = {ATTR_COLLECTIVES_GROUP: "string_value", ATTR_COLLECTIVES_SEQ: "int_value",
                      ATTR_COLLECTIVES_DEVICE_SECONDS: "double_value"}


def _collectives(span: Any) -> tuple[tuple[str, int, float | None], ...] | None:
    """The step's device-timed collectives from its three ``train.collectives.*`` arrays, or None when
    they are absent or unusable (not of one length, over OTLP_MAX_COLLECTIVES, a wrong type or value):
    the join then claims no wait for the step, it never fails the span."""
    arrays: dict[str, list[Any]] = {}
    for kv in span.attributes:
        kind = _COLLECTIVES_ATTRS.get(kv.key)
        if kind is None:
            continue
        if kv.value.WhichOneof("value") != "array_value":
            return None
        values = kv.value.array_value.values
        if len(values) > OTLP_MAX_COLLECTIVES or any(v.WhichOneof("value") != kind for v in values):
            return None
        arrays[kv.key] = [getattr(v, kind) for v in values]
    if len(arrays) != len(_COLLECTIVES_ATTRS):
        return None
    groups, seqs, seconds = (arrays[ATTR_COLLECTIVES_GROUP], arrays[ATTR_COLLECTIVES_SEQ],
                             arrays[ATTR_COLLECTIVES_DEVICE_SECONDS])
    if not groups or not len(groups) == len(seqs) == len(seconds):
        return None
    found = []
    for group, seq, value in zip(groups, seqs, seconds):
        if value != -1.0 and not _is_duration(value):
            raise _NotADuration(ATTR_COLLECTIVES_DEVICE_SECONDS, value)
        if not 0 < len(group) <= _MAX_LABEL or seq < 1:
            return None
        found.append((group, seq, None if value == -1.0 else float(value)))
    return tuple(found)


# Required attributes that are missing or unusable skip the span; optional ones are left out instead.


def _int(attrs: dict[str, Any], key: str, *, minimum: int, required: bool = True) -> int | None:
    value = attrs.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if not required:
            return None
        raise _Invalid("missing_attribute" if value is None else "bad_value")
    return value


def _seconds(attrs: dict[str, Any], key: str, *, required: bool = True) -> float | None:
    value = attrs.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if not required:
            return None
        raise _Invalid("missing_attribute" if value is None else "bad_value")
    if not _is_duration(value):
        raise _NotADuration(key, value)
    return float(value)


def span_fingerprint(compute_seconds: float, interval_seconds: float) -> int:
    """32 bits that tell two spans of one (run, step, rank) apart: a retry has the same, a forgery not.

    Only what ``cluster.jsonl`` keeps per rank goes in, so a restarted collector can compute
    it for the steps it wrote before.
    """
    return zlib.crc32(struct.pack("<dd", compute_seconds, interval_seconds))


#: The step span's attributes the join reads (and ``train.pipeline.bubble_ratio.*``); the others
#: (FLOPs, scalars, microbatch summaries, ...) are not decoded.
_STEP_ATTRS = frozenset((ATTR_RUN_ID, ATTR_STEP, ATTR_RANK, ATTR_ATTEMPT, ATTR_WORLD_SIZE, ATTR_COMPUTE_SECONDS,
                         ATTR_INTERVAL_SECONDS, ATTR_IDLE_SECONDS, ATTR_COLLECTIVE_WAIT_SECONDS, ATTR_STATUS,
                         ATTR_OWN_COMPUTE_SECONDS, ATTR_EXPOSED_COMMUNICATION_SECONDS))


#: The ``train.health.<field>`` attributes decoded (a fixed set: one peer cannot make a span hold
#: more), each a finite number >= 0; the straggler's GPU cause needs no others (docs/health.md).
HEALTH_FIELDS = ("window_seconds", "window_steps", "sm_clock_mhz_mean", "sm_clock_mhz_min", "temperature_c_max",
                 "power_watts_mean", "energy_joules", "clocks_event_reasons", "xid_events", "last_xid",
                 "ecc_uncorrected_volatile_errors", "remapped_rows_uncorrectable", "nvlink_errors")
HEALTH_POLICIES = ("power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability")
_HEALTH_KEYS = frozenset({ATTR_HEALTH_PREFIX + f for f in HEALTH_FIELDS}
                         | {f"{ATTR_HEALTH_PREFIX}violation_percent.{p}" for p in HEALTH_POLICIES})


def _health(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The span's health window in the shape of the step record's (numbers only, bad ones left out)."""
    health: dict[str, Any] = {}
    percent: dict[str, float] = {}
    for key, value in attrs.items():
        if key not in _HEALTH_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < math.inf:
            continue
        name = key[len(ATTR_HEALTH_PREFIX):]
        if name.startswith("violation_percent."):
            percent[name.removeprefix("violation_percent.")] = min(100.0, float(value))
        else:
            health[name] = value
    if not health and not percent:
        return None
    if percent:
        health["violation_percent"] = percent
    return health


#: The attributes a straggler's host causes are read from (steptrace._attribution.HOST_CAUSES).
_CAUSE_ATTRS = {"train.idle.gc_seconds": "gc", "train.idle.data_seconds": "data",
                ATTR_HOST_PAUSES_PREFIX + "preempted_seconds": "preempted"}
_GC_MAX_SECONDS = ATTR_HOST_PAUSES_PREFIX + "gc_max_seconds"
_GC_MAX_GENERATION = ATTR_HOST_PAUSES_PREFIX + "gc_max_generation"
_PAUSE_KEYS = frozenset((*_CAUSE_ATTRS, _GC_MAX_SECONDS, _GC_MAX_GENERATION, ATTR_HOST_PAUSES_PREFIX + "gc_seconds"))


def _causes(attrs: dict[str, Any], interval: float) -> tuple[dict[str, float] | None, tuple[float, int | None] | None]:
    """A span's host causes (numbers in ``[0, interval]``, bad ones left out) and its largest collection; both
    None where the rank measured no host pauses (no ``train.host_pauses.*``: its gc would read as 0)."""
    if not any(key.startswith(ATTR_HOST_PAUSES_PREFIX) for key in attrs):
        return None, None
    causes = {"gc": 0.0, "data": 0.0}  # charged idle reasons: absent means none in the step
    for key, cause in _CAUSE_ATTRS.items():
        value = attrs.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            if cause == "preempted":
                causes.pop(cause, None)
            continue
        causes[cause] = min(float(value), interval)
    longest = attrs.get(_GC_MAX_SECONDS)
    generation = attrs.get(_GC_MAX_GENERATION)
    gc_max = None
    if not isinstance(longest, bool) and isinstance(longest, (int, float)) and 0 < longest < math.inf:
        gc_max = (min(float(longest), interval),
                  generation if isinstance(generation, int) and not isinstance(generation, bool)
                  and 0 <= generation <= 2 else None)
    return causes, gc_max


def _step_span(span: Any, world_size: int | None, max_world_size: int = DEFAULT_MAX_WORLD_SIZE,
               max_step: int = DEFAULT_MAX_STEP, ends: tuple[float, float] | None = None) -> StepSpan:
    attrs = {kv.key: _scalar(kv.value) for kv in span.attributes
             if kv.key in _STEP_ATTRS or kv.key.startswith(_BUBBLE_PREFIX) or kv.key in _HEALTH_KEYS
             or kv.key in _PAUSE_KEYS}
    run_id = attrs.get(ATTR_RUN_ID)
    if run_id is None:
        raise _Invalid("missing_attribute")
    if not safe_run_id(run_id):
        raise _Invalid("bad_run_id")
    step = _int(attrs, ATTR_STEP, minimum=0)
    if step > max_step:
        raise _Invalid("step_out_of_range")
    rank = _int(attrs, ATTR_RANK, minimum=0)
    if rank >= (world_size if world_size is not None else max_world_size):
        raise _Invalid("rank_out_of_range")
    attempt = _int(attrs, ATTR_ATTEMPT, minimum=0, required=False) or 0
    if attempt > MAX_ATTEMPT:
        raise _Invalid("bad_value")
    span_world = _int(attrs, ATTR_WORLD_SIZE, minimum=1, required=False)
    if span_world is not None and span_world > max_world_size:
        raise _Invalid("world_size_out_of_range")
    compute = _seconds(attrs, ATTR_COMPUTE_SECONDS)
    interval = _seconds(attrs, ATTR_INTERVAL_SECONDS)
    idle = _seconds(attrs, ATTR_IDLE_SECONDS, required=False)
    # The time on its own is recomputed from compute and wait (one rule whatever the sender says).
    wait = _seconds(attrs, ATTR_COLLECTIVE_WAIT_SECONDS, required=False)
    if wait is not None:
        wait = min(wait, interval)
    # The rank's own compute (waiting in collectives taken out): never more than its compute.
    own_compute = _seconds(attrs, ATTR_OWN_COMPUTE_SECONDS, required=False) if wait is not None else None
    if own_compute is not None:
        own_compute = min(own_compute, compute)
    exposed = _seconds(attrs, ATTR_EXPOSED_COMMUNICATION_SECONDS, required=False)
    if exposed is not None:
        exposed = min(exposed, interval)  # exposed communication is part of the step's interval
    status = attrs.get(ATTR_STATUS, "ok")
    if not isinstance(status, str) or not 0 < len(status) <= _MAX_LABEL:
        status = "unknown"
    bubble: dict[str, float] = {}
    for key, value in attrs.items():
        if key.startswith(_BUBBLE_PREFIX) and len(bubble) < _MAX_STAGES:
            stage = key[len(_BUBBLE_PREFIX):]
            # A ratio (1 - compute / window) is in [0, 1]: anything else is left out, so the
            # join's mean over the ranks stays a ratio (two ranks' 1e308 once summed to inf).
            if (0 < len(stage) <= _MAX_LABEL and not isinstance(value, bool) and isinstance(value, (int, float))
                    and 0.0 <= value <= 1.0):
                bubble[stage] = float(value)
    trace = bytes(span.trace_id)
    end_ns = span.end_time_unix_nano
    if ends is not None and end_ns and not ends[0] <= end_ns / 1e9 <= ends[1]:
        raise _Invalid("end_out_of_range")
    causes, gc_max = _causes(attrs, interval)
    return StepSpan(run_id=run_id, step=step, rank=rank, world_size=span_world,
                    trace_id=trace.hex() if len(trace) == 16 else "", compute_seconds=compute,
                    interval_seconds=interval, idle_seconds=idle, status=status,
                    end_time=end_ns / 1e9 if end_ns else None, bubble=bubble, attempt=attempt,
                    collective_wait_seconds=wait, own_seconds=None if wait is None else _own_seconds(interval, wait),
                    own_compute_seconds=own_compute, health=_health(attrs), exposed_communication_seconds=exposed,
                    collectives=_collectives(span), causes=causes, gc_max=gc_max)


#: What one stall span may bring: its stack text and its frames (the sender sends 4 KiB, 24 frames).
_MAX_STACK_CHARS = 8192
_MAX_STACK_FRAMES = 64


def _stall_span(span: Any, rank_limit: int, max_step: int) -> dict[str, Any] | None:
    """A rank's stall (or its end) from its OTLP span, as the stall record's fields the job's view
    reads; None when its run, rank or step is unusable (a stall is advice: it is dropped, not counted)."""
    attrs = {kv.key: _scalar(kv.value) for kv in span.attributes if kv.key.startswith(ATTR_PREFIX)}
    try:
        run_id = attrs.get(ATTR_RUN_ID)
        if not safe_run_id(run_id):
            return None
        step = _int(attrs, ATTR_STEP, minimum=0)
        rank = _int(attrs, ATTR_RANK, minimum=0)
    except _Invalid:
        return None
    if step > max_step or rank >= rank_limit:
        return None
    text = attrs.get("train.stall.stack")
    frames = []
    for line in (text[-_MAX_STACK_CHARS:] if isinstance(text, str) else "").splitlines()[-_MAX_STACK_FRAMES:]:
        where, _, function = line.rpartition(" in ")
        path, _, lineno = where.rpartition(":")
        # str.isdigit() takes "²" (int() refuses it) and Arabic-Indic digits: ASCII digits only.
        frames.append([path, int(lineno) if lineno.isascii() and lineno.isdigit() and len(lineno) <= 9 else 0,
                       function])
    span_name = attrs.get("train.stall.span")
    return {"type": "stall" if span.name == "train.stall" else "stall_end", "run_id": run_id, "rank": rank,
            "attempt": _int(attrs, ATTR_ATTEMPT, minimum=0, required=False) or 0, "step": step,
            "in_step": attrs.get("train.stall.in_step") is True,
            "span": span_name if isinstance(span_name, str) else None,
            "open_seconds": _seconds(attrs, "train.stall.open_seconds", required=False),
            "threads": [{"name": "training", "training": True, "frames": frames}]}


def _run_of(span: Any) -> str:
    for kv in span.attributes:
        if kv.key == ATTR_RUN_ID:
            value = _scalar(kv.value)
            return value if safe_run_id(value) else ""
    return ""


def _resource_run_id(scope_spans: Any) -> str:
    """The run of a resource's spans whose first span is not one the collector uses: that span's
    ``train.run_id`` (all of a rank's spans share it), decoded for this alone."""
    for scope in scope_spans:
        for span in scope.spans:
            if isinstance(span, bytes):
                try:
                    span = Span.FromString(span)
                except Exception:  # a span it does not use may be malformed: no run
                    return ""
            return _run_of(span)
    return ""


def extract_steps(request: ExportTraceServiceRequest, world_size: int | None = None, *,
                  max_world_size: int = DEFAULT_MAX_WORLD_SIZE, max_step: int = DEFAULT_MAX_STEP,
                  ends: tuple[float, float] | None = None) -> Extracted:
    """The ``train.step`` spans of ``request``; other spans are only counted.

    Only the spans named ``train.step``, ``train.stall`` and ``train.stall_end`` are decoded; the
    name is read from each span's bytes first, so any other span (``train.microbatch``,
    ``train.compute``, user spans) costs a byte search and is counted in ``skipped``, its
    attributes never decoded. A used span whose bytes do not decode is ``bad_value``.

    ``ends`` (unix seconds, earliest and latest) skips a step span that ended outside it as
    ``end_out_of_range``: the collector's clock minus ``--max-span-age-s`` to plus
    ``--max-clock-skew-s``, so spans sent ahead of a run with made-up ends cannot take its steps.

    A rank outside ``[0, world_size)`` (the collector's ``--world-size``, else
    ``max_world_size``) is skipped as ``rank_out_of_range``; a ``train.world_size``
    above ``max_world_size`` as ``world_size_out_of_range``; a step above
    ``max_step`` as ``step_out_of_range``. What one span can make the collector
    hold is bounded by these, whoever sent it.
    """
    if not isinstance(request, _LAZY_REQUEST):  # a decoded request (tests, tools): the same path
        request = _LAZY_REQUEST.FromString(request.SerializeToString())
    out = Extracted()
    for resource_spans in request.resource_spans:
        count = 0
        run: str | None = None
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            count += len(spans)
            out.skipped += len(spans)
            search = _NAME_FIELD.search
            for blob in spans:
                if search(blob) is None:  # the common case, kept to one C call per span
                    continue
                name = _used_span(blob)
                if name is None:
                    continue
                out.skipped -= 1
                try:
                    span = Span.FromString(blob)
                except Exception:  # the span alone is malformed: counted as a step span we cannot use
                    out.invalid["bad_value"] = out.invalid.get("bad_value", 0) + 1
                    continue
                if run is None:
                    run = _run_of(span)
                if name != _STEP_SPAN:
                    stall = _stall_span(span, world_size if world_size is not None else max_world_size, max_step)
                    if stall is not None:
                        out.stalls.append(stall)
                    continue
                try:
                    out.steps.append(_step_span(span, world_size, max_world_size, max_step, ends))
                except _Invalid as bad:
                    out.invalid[bad.reason] = out.invalid.get(bad.reason, 0) + 1
                except _NotADuration as bad:
                    # The sender's durations cannot be trusted: the whole export is refused, nothing
                    # of it journaled or joined, and every other rank's step is untouched.
                    attrs = {kv.key: _scalar(kv.value) for kv in span.attributes if kv.key in (ATTR_RANK, ATTR_STEP)}
                    raise Rejected(400, "bad_duration",
                                   f"train.step span of rank {str(attrs.get(ATTR_RANK))[:20]}, step "
                                   f"{str(attrs.get(ATTR_STEP))[:20]}: {bad.key} = {bad.value!r} cannot be a "
                                   f"duration (seconds from 0 to {MAX_DURATION_SECONDS:g})") from None
        if count:
            if run is None:
                run = _resource_run_id(resource_spans.scope_spans)
            out.spans_by_run[run] = out.spans_by_run.get(run, 0) + count
        out.spans += count
    return out


def count_items(signal: str, request: Any) -> int:
    """Spans (traces) or data points (metrics) in a request: checked against ``--max-spans-per-request``."""
    if signal == "metrics":
        return count_data_points(request)
    return sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)


def count_data_points(request: ExportMetricsServiceRequest) -> int:
    """Data points in a metrics request (metrics are accepted and counted, not joined)."""
    points = 0
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind is not None:
                    points += len(getattr(metric, kind).data_points)
    return points
