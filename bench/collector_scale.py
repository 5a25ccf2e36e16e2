"""How far one steptrace collector scales: N simulated ranks sending real OTLP/HTTP over loopback.

Usage::

    .venv/bin/python bench/collector_scale.py            # N = 8, 64, 256, a step-rate ladder each (~3 min)
    .venv/bin/python bench/collector_scale.py --quick    # shorter runs, fewer rungs (~40 s)
    .venv/bin/python bench/collector_scale.py --json out.json
    .venv/bin/python bench/collector_scale.py --ns 64 --rates 20,40,80 --duration 20   # one ladder by hand

What runs
---------
One real collector process, ``python -m steptrace.collector --port 0 --metrics-port 0
--world-size N --run-dir DIR`` on 127.0.0.1, fresh for every configuration (a run id of its
own, an empty run dir). Against it, ``--generators`` load-generator processes (4; real OS
processes, started once) each simulate a contiguous block of the N ranks. 256 real rank
processes would not fit on 2 cores, so a generator builds each rank's spans itself:

* **The payload is what steptrace's exporter sends.** Per rank and step, one ``ResourceSpans``
  (``service.instance.id = <run_id>/rank-<r>``, the SDK's resource attributes, scope
  ``steptrace``) with the three spans ``steptrace/otlp.py`` emits for a step with one idle
  segment: ``train.step`` (16 ``train.*`` attributes: run id, rank, attempt, step, world size, status,
  backend, interval/compute/idle seconds, tokens, flops, tokens/s, TFLOP/s, MFU,
  ``train.idle.data_seconds``), ``train.compute`` and ``train.idle`` (reason ``data``) as its
  children; trace id ``steptrace._ids.trace_id(run_id, step)``, span ids ``span_id(run_id, step,
  rank, role)``. Each rank's ``ResourceSpans`` is encoded once per configuration (and varint
  length of the step number) with opentelemetry-proto, with sentinel values where the step
  number, ids and times go; per step the generator only hashes the ids (as the exporter does)
  and splices the new bytes in.
  Before the first configuration the script checks the result against a real
  ``steptrace.otlp.OtlpSink``: the same step record exported by the real exporter (captured
  over HTTP) must decode to the same ``ResourceSpans`` (resource, scope, names, ids, kind,
  flags, every attribute; times within 1 µs, float attributes within 1e-6). The header says
  whether it held; the script stops if it does not.
* **Batching.** A request carries the spans of ``--ranks-per-request`` ranks (8) of one step,
  each rank in its own ``ResourceSpans``, as a batching OpenTelemetry Collector in front would
  forward them (collector/otelcol.yaml; that one speaks gRPC to the collectors). Ranks that
  post to the collector directly send one request per rank and export batch: at the same span
  rate, up to 8x as many smaller requests. ``req/s`` shows what the collector got;
  ``--ranks-per-request 1`` measures the direct case.
* **Pacing is by wall clock.** Every rank ends step ``k`` at ``go + k / rate`` (ranks of a
  data-parallel job finish together), with ``interval = 1/rate`` and compute 75-80 % of it (rank
  dependent, so there is a straggler to find). At each tick a generator builds that step's
  requests and queues them for its ``--senders`` threads (4), each with its own keep-alive
  connection. Like the exporter's bounded queue, a generator never blocks on the collector:
  requests beyond ``--max-backlog-s`` (1 s) worth of queue are dropped and counted, and a
  generator more than that behind its schedule skips the step. So a collector that cannot keep
  up shows as dropped spans, steps with missing ranks, and growing end-to-end lag.

What is measured
----------------
Each configuration runs ``--duration`` seconds (12; quick 4); the first ``--warmup`` (2; quick 1)
are left out. Over the window that remains:

* ``target sp/s`` = N x 3 spans x the step rate; ``offered`` = spans in the requests the
  generators completed; ``recv sp/s`` = the delta of the collector's
  ``steptrace_collector_received_spans_total`` (scraped at both ends of the window); ``req/s``
  = of ``steptrace_collector_requests_total``; ``joined/s`` = of
  ``steptrace_cluster_steps_joined_total`` (equals the step rate when all is well).
* From ``cluster.jsonl``, read after the collector is stopped with SIGTERM (which emits every
  step still open), for the steps scheduled in the window: ``complete`` = the share joined
  with all N ranks (a step never seen counts as incomplete); ``join p50/p99`` =
  ``join_seconds`` of the complete ones (first span arriving to the last rank's); ``e2e
  p50/p99`` = ``joined_time`` minus the step's end, the time until a step shows up on
  ``/metrics``, queueing in the senders included. ``^`` marks e2e lag that grew during the
  window (median of its last third > 2x the first third and > 50 ms).
* CPU, in % of one core (the machine has ``nproc`` x 100 %): ``coll%`` = the collector's
  utime+stime from ``/proc/<pid>/stat`` over the window (one Python process: little more than
  one core is of use to it); ``gens%`` = the generators together; ``other%`` = everything else
  on the machine (``/proc/stat`` busy time minus these and this script), other people's jobs
  and the kernel; ``idle%``.
* ``rej`` = requests the collector refused + ``train.step`` spans it found invalid + non-200
  answers and connection errors the generators saw (0 unless something is wrong); ``drop`` =
  spans the generators dropped (queue full or behind schedule).

A configuration is **saturated** (``SAT``) when recv < 95 % of target, or fewer than 99 % of
its steps are complete, or the e2e lag grew. The rate ladder is in total target spans/s
(6k, 12k, 24k, 36k, 48k; quick: 6k, 24k), turned into steps/s per rank for each N, so rungs are
comparable across N. Each N climbs until its first saturated rung; when that rung is 2x the
last one that kept up, one rung halfway (geometric mean) is run as well (not in quick mode).
``--rates`` replaces the ladder, ``--keep-going`` runs past saturation.

How to read it
--------------
Per N, one collector's capacity lies between the last rung that kept up and the first
saturated one; the verdict lines say both. At small N the spans come in small requests
(2 ranks each with 4 generators at N=8), so per-request work (HTTP parsing, a handler thread)
limits first; at large N the per-step work (the join and a ``cluster_step`` record that lists
every rank) grows. **The generators share the 2 cores with the collector**, and so does
whatever else runs on the machine (``other%``; the header prints the load average before the
run): with ``idle%`` near 0 at the saturated rung the collector was short of CPU as much as it
was overloaded, so every saturation point here is a lower bound on what a collector with a
core of its own (ranks elsewhere) sustains. ``join p99`` is the collector's own view of a step;
``e2e`` adds the senders' queueing and is what rises first when the collector falls behind.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import math
import multiprocessing as mp
import os
import queue
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

from steptrace._ids import span_id, trace_id  # noqa: E402

SPANS_PER_RANK_STEP = 3
# Ladders of total target spans/s (N x 3 x steps/s per rank); each N climbs until saturated.
FULL_LADDER = (6000, 12000, 24000, 36000, 48000)
QUICK_LADDER = (6000, 24000)
TOKENS_PER_STEP = 8192
TFLOPS_PER_SECOND = 400.0  # per device, over compute time
PEAK_TFLOPS = 989.0
HEADERS = {"Content-Type": "application/x-protobuf"}

# What the template's slots hold, in the order of _Template.values().
TRACE, STEP, SID_STEP, SID_COMPUTE, SID_IDLE, T_START, T_COMPUTE_START, T_END = range(8)


# -- the simulated ranks' records and their OTLP encoding ------------------------------------------


def compute_fraction(rank: int) -> float:
    """Compute share of the interval for ``rank`` (0.75..0.80: every rank a little different)."""
    return 0.80 - 0.05 * ((rank * 7919) % 97) / 96


def step_record(run_id: str, rank: int, world: int, step: int, end_time: float, interval: float) -> dict[str, Any]:
    """The ``step`` record steptrace finalizes for this rank and step (what ``OtlpSink.export`` reads)."""
    compute = interval * compute_fraction(rank)
    idle = interval - compute
    flops = TFLOPS_PER_SECOND * 1e12 * compute
    return {
        "type": "step", "run_id": run_id, "rank": rank, "world_size": world, "step": step,
        "trace_id": f"{trace_id(run_id, step):032x}", "status": "ok", "backend": "simulated",
        "host_start_time": end_time - interval, "host_end_time": end_time - idle, "dispatch_time": end_time - compute,
        "start_time": end_time - compute, "end_time": end_time, "interval_seconds": interval,
        "compute_seconds": compute, "idle_seconds": idle, "idle_breakdown": {"data": idle},
        "idle_segments": [["data", end_time - interval, end_time - compute]],
        "tokens": TOKENS_PER_STEP, "samples": None, "flops": flops, "tokens_per_second": TOKENS_PER_STEP / interval,
        "samples_per_second": None, "tflops_per_second": flops / compute / 1e12,
        "mfu": flops / compute / 1e12 / PEAK_TFLOPS, "peak_tflops": PEAK_TFLOPS, "attrs": {},
    }


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_RESOURCE_BASE: list[tuple[str, Any]] | None = None


def _resource_attributes(instance_id: str) -> list[tuple[str, Any]]:
    """The resource steptrace's exporter sends: the SDK's defaults (+ OTEL_RESOURCE_ATTRIBUTES),
    ``service.name`` (steptrace), ``service.instance.id`` and ``train.attempt``, in the SDK's order."""
    global _RESOURCE_BASE
    if _RESOURCE_BASE is None:
        from opentelemetry.sdk.resources import Resource

        _RESOURCE_BASE = [(k, v) for k, v in Resource.create({}).attributes.items()
                          if k not in ("service.name", "service.instance.id")]
    return _RESOURCE_BASE + [("service.instance.id", instance_id), ("service.name", "steptrace"), ("train.attempt", 0)]


class _Template:
    """One rank's ``ResourceSpans`` for one varint length of the step number, as bytes with slots.

    Encoded once with sentinel values (random ids and times, found again in the bytes); per
    step, :meth:`encode` joins the fixed pieces with the step's values. The request-level
    field header (``resource_spans``, tag and length) is part of the first piece, so a request
    body is the concatenation of its ranks' encodings.
    """

    def __init__(self, run_id: str, rank: int, world: int, interval: float, step_len: int):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

        from steptrace._version import __version__

        self.run_id, self.rank = run_id, rank
        self.interval_ns = round(interval * 1e9)
        self.compute_ns = round(interval * compute_fraction(rank) * 1e9)
        sentinel_step = {1: 1, 2: 200, 3: 20000, 4: 3_000_000}[step_len]
        assert len(_varint(sentinel_step)) == step_len
        # A representative end time: the idle span's train.idle_seconds is computed from float unix times.
        record = step_record(run_id, rank, world, sentinel_step, time.time(), interval)
        rng = random.Random(f"{run_id}/{rank}/{step_len}")
        sentinels: dict[bytes, int] = {}

        def sentinel(kind: int, size: int) -> bytes:
            while True:
                value = rng.randbytes(size)
                if value not in sentinels and b"\x00" not in value:
                    sentinels[value] = kind
                    return value

        def time_sentinel(kind: int) -> int:
            return struct.unpack("<Q", sentinel(kind, 8))[0]

        def kv(key: str, value: Any) -> KeyValue:
            if isinstance(value, bool):
                any_value = AnyValue(bool_value=value)
            elif isinstance(value, int):
                any_value = AnyValue(int_value=value)
            elif isinstance(value, float):
                any_value = AnyValue(double_value=value)
            else:
                any_value = AnyValue(string_value=str(value))
            return KeyValue(key=key, value=any_value)

        def base(step: int) -> list[KeyValue]:
            return [kv("train.run_id", run_id), kv("train.rank", rank), kv("train.attempt", 0), kv("train.step", step)]

        # Attribute order as steptrace/otlp.py writes them (None values left out).
        step_attrs = base(sentinel_step) + [kv("train.world_size", world)]
        for key in ("status", "error", "backend", "interval_seconds", "compute_seconds", "idle_seconds", "tokens",
                    "samples", "flops", "tokens_per_second", "samples_per_second", "tflops_per_second", "mfu"):
            if record.get(key) is not None:
                step_attrs.append(kv(f"train.{key}", record[key]))
        for reason, seconds in record["idle_breakdown"].items():
            step_attrs.append(kv(f"train.idle.{reason}_seconds", seconds))
        _, seg_start, seg_end = record["idle_segments"][0]

        flags = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, not remote: what the SDK's encoder sets

        def span(name: str, own: int, parent: int | None, start: int, end: int, attrs: list[KeyValue]) -> Span:
            s = Span(trace_id=sentinel(TRACE, 16), span_id=sentinel(own, 8), name=name,
                     kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=time_sentinel(start),
                     end_time_unix_nano=time_sentinel(end), attributes=attrs, status=Status(), flags=flags)
            if parent is not None:
                s.parent_span_id = sentinel(parent, 8)
            return s

        spans = [
            span("train.step", SID_STEP, None, T_START, T_END, step_attrs),
            span("train.compute", SID_COMPUTE, SID_STEP, T_COMPUTE_START, T_END,
                 base(sentinel_step) + [kv("train.compute_seconds", record["compute_seconds"])]),
            span("train.idle", SID_IDLE, SID_STEP, T_START, T_COMPUTE_START,
                 base(sentinel_step) + [kv("train.idle.reason", "data"),
                                        kv("train.idle_seconds", seg_end - seg_start)]),
        ]
        resource = Resource(attributes=[kv(k, v) for k, v in _resource_attributes(f"{run_id}/rank-{rank}")])
        rs = ResourceSpans(resource=resource, scope_spans=[
            ScopeSpans(scope=InstrumentationScope(name="steptrace", version=__version__), spans=spans)])
        request = ExportTraceServiceRequest(resource_spans=[rs])
        data = request.SerializeToString()

        slots: list[tuple[int, int, int]] = []  # (offset, length, kind)
        for value, kind in sentinels.items():
            offset = data.find(value)
            if offset < 0 or data.find(value, offset + 1) >= 0:
                raise AssertionError(f"sentinel for slot {kind} not found exactly once")
            slots.append((offset, len(value), kind))
        key = b"\x0a\x0atrain.step\x12" + bytes([1 + step_len]) + b"\x18"
        offset = data.find(key)
        while offset >= 0:
            slots.append((offset + len(key), step_len, STEP))
            offset = data.find(key, offset + 1)
        slots.sort()
        if sum(1 for s in slots if s[2] == STEP) != 3 or any(a[0] + a[1] > b[0] for a, b in zip(slots, slots[1:])):
            raise AssertionError("template slots are not where they should be")
        self.pieces: list[bytes] = []
        self.kinds: list[int] = []
        position = 0
        for offset, length, kind in slots:
            self.pieces.append(data[position:offset])
            self.kinds.append(kind)
            position = offset + length
        self.pieces.append(data[position:])
        self.size = len(data)

    def encode(self, step: int, end_ns: int, trace: bytes, step_bytes: bytes) -> list[bytes]:
        """The pieces of this rank's encoding for ``step`` ending at ``end_ns`` (join them, or a request's)."""
        run, rank = self.run_id, self.rank
        values = (trace, step_bytes,
                  span_id(run, step, rank, "step").to_bytes(8, "big"),
                  span_id(run, step, rank, "compute").to_bytes(8, "big"),
                  span_id(run, step, rank, "idle/0").to_bytes(8, "big"),
                  struct.pack("<Q", end_ns - self.interval_ns),
                  struct.pack("<Q", end_ns - self.compute_ns),
                  struct.pack("<Q", end_ns))
        pieces = self.pieces
        out = [pieces[0]]
        for i, kind in enumerate(self.kinds):
            out.append(values[kind])
            out.append(pieces[i + 1])
        return out


class RankEncoder:
    """Encodes steps of a set of ranks as OTLP request bodies (``ranks_per_request`` ranks each)."""

    def __init__(self, run_id: str, world: int, ranks: list[int], interval: float, max_step: int):
        self.run_id = run_id
        lengths = sorted({len(_varint(s)) for s in (0, 127, 128, 16383, 16384, 2097151, 2097152) if s <= max_step}
                         | {len(_varint(max_step))})
        self.templates = {n: [_Template(run_id, r, world, interval, n) for r in ranks] for n in lengths}

    def bodies(self, step: int, end_ns: int, ranks_per_request: int) -> list[tuple[bytes, int]]:
        """(body, spans) of each request for ``step``."""
        trace = trace_id(self.run_id, step).to_bytes(16, "big")
        step_bytes = _varint(step)
        templates = self.templates[len(step_bytes)]
        out = []
        for i in range(0, len(templates), ranks_per_request):
            parts: list[bytes] = []
            chunk = templates[i:i + ranks_per_request]
            for template in chunk:
                parts += template.encode(step, end_ns, trace, step_bytes)
            out.append((b"".join(parts), SPANS_PER_RANK_STEP * len(chunk)))
        return out


# -- checking the payload against steptrace's own exporter -------------------------------------------


class _Capture(wl.AcceptOtlp):
    bodies: list[tuple[str, bytes]] = []


def verify_payload() -> str:
    """Export the same step records through ``steptrace.otlp.OtlpSink`` and through the generator's
    templates and compare the decoded ``ResourceSpans``; raises ``AssertionError`` on a difference."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from steptrace.otlp import OtlpSink

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    run_id, world, interval = "verify-run", 300, 0.05
    cases = [(0, 7), (5, 300), (200, 40000), (299, 2_500_000)]
    checked = 0
    try:
        for rank, step in cases:
            end_time = time.time()
            end_ns = round(end_time * 1e9)
            _Capture.bodies = []
            sink = OtlpSink(endpoint, run_id=run_id, rank=rank, world_size=world, metrics_interval_s=3600.0,
                            compression="none")  # the bodies are compared as protobuf
            try:
                sink.export([step_record(run_id, rank, world, step, end_time, interval)])
            finally:
                sink.shutdown(2.0)
            real = [ExportTraceServiceRequest.FromString(b) for p, b in _Capture.bodies if p == "/v1/traces"]
            assert len(real) == 1 and len(real[0].resource_spans) == 1, "the exporter sent an unexpected request"
            real_rs = real[0].resource_spans[0]
            ours = RankEncoder(run_id, world, [rank], interval, step).bodies(step, end_ns, 8)
            ours_rs = ExportTraceServiceRequest.FromString(ours[0][0]).resource_spans[0]
            spans_real, spans_ours = real_rs.scope_spans[0].spans, ours_rs.scope_spans[0].spans
            assert len(spans_real) == len(spans_ours) == SPANS_PER_RANK_STEP, "span count differs"
            for a, b in zip(spans_real, spans_ours):
                # The exporter rounds float unix seconds; the generator works in integer ns.
                for field in ("start_time_unix_nano", "end_time_unix_nano"):
                    assert abs(getattr(a, field) - getattr(b, field)) <= 1000, f"{a.name}.{field} differs"
                    setattr(a, field, getattr(b, field))
                for x, y in zip(a.attributes, b.attributes):
                    if x.value.WhichOneof("value") == "double_value" == y.value.WhichOneof("value"):
                        assert math.isclose(x.value.double_value, y.value.double_value, rel_tol=1e-6), x.key
                        x.value.double_value = y.value.double_value
            assert real_rs == ours_rs, f"rank {rank} step {step}: the generator's ResourceSpans differ:\n" \
                                       f"exporter: {real_rs}\ngenerator: {ours_rs}"
            checked += 1
    finally:
        server.shutdown()
        server.server_close()
    return (f"payload = steptrace.otlp.OtlpSink's (resource, scope, names, ids, flags, "
            f"{len(spans_real[0].attributes)}+{len(spans_real[1].attributes)}+{len(spans_real[2].attributes)} "
            f"attributes; times within 1 us) for {checked} (rank, step) cases")


# -- load generators (one process each) --------------------------------------------------------------


def _generator_main(conn: Any) -> None:
    """A generator process: ``setup`` builds the templates, ``go`` runs one configuration."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and stops us
    encoder = None
    while True:
        message = conn.recv()
        if message is None:
            return
        command, args = message
        if command == "setup":
            encoder = RankEncoder(args["run_id"], args["world"], args["ranks"], 1.0 / args["rate"], args["max_step"])
            conn.send("ready")
        elif command == "go":
            conn.send(_generate(encoder, **args))


def _generate(encoder: RankEncoder, *, port: int, rate: float, go: float, warm: float, end: float,
              ranks_per_request: int, senders: int, max_backlog_s: float, grace_s: float) -> dict[str, Any]:
    period = 1.0 / rate
    n_ranks = len(next(iter(encoder.templates.values())))
    requests_per_step = math.ceil(n_ranks / ranks_per_request)
    q: queue.Queue = queue.Queue(maxsize=max(4, math.ceil(requests_per_step * rate * max_backlog_s)))
    stats = {"target_spans": 0, "offered_spans": 0, "offered_requests": 0, "dropped_queue": 0, "dropped_behind": 0,
             "errors": 0, "bad_status": {}, "lost_spans": 0, "unsent_at_end": 0, "ticks": 0, "build_s": 0.0}
    lock = threading.Lock()

    def sender() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        local = {"offered_spans": 0, "offered_requests": 0, "errors": 0, "lost_spans": 0, "unsent_at_end": 0}
        bad: dict[str, int] = {}
        while True:
            item = q.get()
            if item is None:
                break
            body, spans = item
            if time.time() > end + grace_s:
                local["unsent_at_end"] += spans
                continue
            status = 0
            try:
                conn.request("POST", "/v1/traces", body=body, headers=HEADERS)
                response = conn.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                local["errors"] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            done = time.time()
            if status != 200:
                local["lost_spans"] += spans
                if status:
                    bad[str(status)] = bad.get(str(status), 0) + 1
            if warm <= done < end:
                local["offered_spans"] += spans
                local["offered_requests"] += 1
        conn.close()
        with lock:
            for k, v in local.items():
                stats[k] += v
            for k, v in bad.items():
                stats["bad_status"][k] = stats["bad_status"].get(k, 0) + v

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    for t in threads:
        t.start()
    k = 0
    while True:
        tick = go + k * period
        if tick >= end:
            break
        in_window = tick >= warm
        now = time.time()
        if now < tick:
            time.sleep(tick - now)
        elif now - tick > max_backlog_s:  # too far behind schedule: skip the step, as a bounded queue would
            if in_window:
                stats["dropped_behind"] += n_ranks * SPANS_PER_RANK_STEP
                stats["target_spans"] += n_ranks * SPANS_PER_RANK_STEP
            k += 1
            continue
        t0 = time.perf_counter()
        bodies = encoder.bodies(k, round(tick * 1e9), ranks_per_request)
        stats["build_s"] += time.perf_counter() - t0
        for body, spans in bodies:
            try:
                q.put_nowait((body, spans))
            except queue.Full:
                if in_window:
                    stats["dropped_queue"] += spans
        if in_window:
            stats["target_spans"] += n_ranks * SPANS_PER_RANK_STEP
        stats["ticks"] += 1
        k += 1
    for _ in threads:
        q.put(None)
    for t in threads:
        t.join(grace_s + 15)
    return stats


class Generators:
    def __init__(self, count: int):
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_generator_main, args=(child,), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def setup(self, run_id: str, world: int, rate: float, max_step: int) -> None:
        count = len(self.procs)
        blocks = [list(range(world * g // count, world * (g + 1) // count)) for g in range(count)]
        for pipe, ranks in zip(self.pipes, blocks):
            pipe.send(("setup", {"run_id": run_id, "world": world, "ranks": ranks, "rate": rate,
                                 "max_step": max_step}))
        self.active = [pipe for pipe, ranks in zip(self.pipes, blocks) if ranks]
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a generator failed to set up")

    def go(self, **args: Any) -> None:
        for pipe in self.active:
            pipe.send(("go", args))

    def results(self, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        for pipe in self.active:
            if not pipe.poll(timeout_s):
                raise RuntimeError("a generator did not report back")
            out.append(pipe.recv())
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


# -- the collector and what we read from it -----------------------------------------------------------


class CollectorProcess:
    """``python -m steptrace.collector`` on free ports; the bound ports come from its start line."""

    def __init__(self, world: int, run_dir: str):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steptrace.collector", "--port", "0", "--metrics-port", "0",
             "--world-size", str(world), "--run-dir", run_dir, "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        line = self.proc.stdout.readline()
        match = re.search(r"otlp_http=127\.0\.0\.1:(\d+) .*metrics=127\.0\.0\.1:(\d+)", line)
        if match is None:
            self.proc.kill()
            self.stderr.seek(0)
            raise RuntimeError(f"the collector did not start: {line!r} {self.stderr.read()}")
        self.port, self.metrics_port = int(match.group(1)), int(match.group(2))
        self.pid = self.proc.pid

    def scrape(self) -> dict[str, float]:
        """Sums over labels of the counters we read (``{name: value}``)."""
        from prometheus_client.parser import text_string_to_metric_families

        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc.stdout.close()
        if code != 0:
            self.stderr.seek(0)
            print(f"collector exited {code}: {self.stderr.read()[-2000:]}", file=sys.stderr)
        self.stderr.close()
        return code


COUNTERS = ("steptrace_collector_received_spans_total", "steptrace_cluster_steps_joined_total",
            "steptrace_collector_rejected_requests_total", "steptrace_collector_invalid_spans_total",
            "steptrace_collector_late_spans_total", "steptrace_collector_duplicate_spans_total",
            "steptrace_cluster_incomplete_steps_total", "steptrace_collector_requests_total")

_TICK = os.sysconf("SC_CLK_TCK")
NPROC = os.cpu_count() or 1


def process_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    total = sum(values[:8])
    return total - values[3] - values[4], total


def snapshot(collector: CollectorProcess, gen_pids: list[int]) -> dict[str, Any]:
    t = time.time()
    metrics = collector.scrape()
    return {"time": t, "metrics": {k: metrics.get(k, 0.0) for k in COUNTERS},
            "collector_cpu": process_cpu_s(collector.pid), "gen_cpu": sum(process_cpu_s(p) for p in gen_pids),
            "parent_cpu": process_cpu_s(os.getpid()), "machine": machine_cpu()}


def read_cluster(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("type") == "cluster_step":
                    out.append(record)
    except OSError:
        pass
    return out


# -- one configuration --------------------------------------------------------------------------------


def run_config(gens: Generators, world: int, rate: float, *, duration: float, warmup: float, ranks_per_request: int,
               senders: int, max_backlog_s: float) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="steptrace-bench-collector-")
    run_id = f"scale-n{world}-r{rate:g}-{os.getpid()}"
    period = 1.0 / rate
    max_step = math.ceil(duration * rate) + 1
    collector = CollectorProcess(world, run_dir)
    try:
        gens.setup(run_id, world, rate, max_step)
        go = time.time() + 0.3
        warm, end = go + warmup, go + duration
        gens.go(port=collector.port, rate=rate, go=go, warm=warm, end=end, ranks_per_request=ranks_per_request,
                senders=senders, max_backlog_s=max_backlog_s, grace_s=1.0)
        time.sleep(max(0.0, warm - time.time()))
        a = snapshot(collector, gens.pids)
        time.sleep(max(0.0, end - time.time()))
        b = snapshot(collector, gens.pids)
        results = gens.results(30.0)
        time.sleep(0.3)
        final = collector.scrape()
    finally:
        code = collector.stop()
    records = read_cluster(os.path.join(run_dir, run_id, "cluster.jsonl"))
    shutil.rmtree(run_dir, ignore_errors=True)

    window = b["time"] - a["time"]
    delta = {k: b["metrics"][k] - a["metrics"][k] for k in COUNTERS}
    gen = {k: sum(r[k] for r in results) for k in ("target_spans", "offered_spans", "offered_requests",
                                                    "dropped_queue", "dropped_behind", "errors", "lost_spans",
                                                    "unsent_at_end", "build_s")}
    bad_status: dict[str, int] = {}
    for r in results:
        for k, v in r["bad_status"].items():
            bad_status[k] = bad_status.get(k, 0) + v
    # Steps scheduled inside the window, and their joined records.
    k_lo, k_hi = math.ceil(warmup / period), math.ceil(duration / period)
    by_step = {r["step"]: r for r in records if k_lo <= r["step"] < k_hi}
    expected = k_hi - k_lo
    complete = [r for r in by_step.values() if r["complete"]]
    join = [r["join_seconds"] for r in complete]
    e2e_by_step = sorted((r["step"], r["joined_time"] - (go + r["step"] * period)) for r in complete)
    e2e = [v for _, v in e2e_by_step]
    third = len(e2e_by_step) // 3
    first = wl.median([v for _, v in e2e_by_step[:third]]) if third else float("nan")
    last = wl.median([v for _, v in e2e_by_step[-third:]]) if third else float("nan")
    lag_growing = bool(third) and last > 2 * first and last > 0.05
    busy = (b["machine"][0] - a["machine"][0]) / max(1, b["machine"][1] - a["machine"][1])
    target_per_s = world * SPANS_PER_RANK_STEP * rate
    received_per_s = delta["steptrace_collector_received_spans_total"] / window
    complete_share = len(complete) / expected if expected else float("nan")
    result = {
        "world": world, "rate": rate, "run_id": run_id, "window_s": window, "collector_exit": code,
        "target_spans_per_s": target_per_s,
        "offered_spans_per_s": gen["offered_spans"] / window,
        "received_spans_per_s": received_per_s,
        "requests_per_s": delta["steptrace_collector_requests_total"] / window,
        "steps_joined_per_s": delta["steptrace_cluster_steps_joined_total"] / window,
        "steps_expected": expected, "steps_complete": len(complete), "steps_recorded": len(by_step),
        "complete_share": complete_share,
        "join_p50_s": wl.median(join), "join_p99_s": wl.percentile(join, 99),
        "e2e_p50_s": wl.median(e2e), "e2e_p99_s": wl.percentile(e2e, 99),
        "e2e_first_third_median_s": first, "e2e_last_third_median_s": last, "lag_growing": lag_growing,
        "collector_cpu_pct": 100 * (b["collector_cpu"] - a["collector_cpu"]) / window,
        "generators_cpu_pct": 100 * (b["gen_cpu"] - a["gen_cpu"]) / window,
        "machine_idle_pct": 100 * (1 - busy) * NPROC,
        "other_cpu_pct": 100 * busy * NPROC - 100 * (b["collector_cpu"] - a["collector_cpu"] + b["gen_cpu"]
                                                     - a["gen_cpu"] + b["parent_cpu"] - a["parent_cpu"]) / window,
        "rejected_requests": delta["steptrace_collector_rejected_requests_total"],
        "invalid_spans": delta["steptrace_collector_invalid_spans_total"],
        "late_spans": delta["steptrace_collector_late_spans_total"],
        "duplicate_spans": delta["steptrace_collector_duplicate_spans_total"],
        "generator_errors": gen["errors"], "generator_bad_status": bad_status,
        "generator_lost_spans": gen["lost_spans"],
        "dropped_spans": gen["dropped_queue"] + gen["dropped_behind"],
        "dropped_queue_full": gen["dropped_queue"], "dropped_behind_schedule": gen["dropped_behind"],
        "unsent_at_end": gen["unsent_at_end"],
        "generator_build_s_per_s": gen["build_s"] / duration,
        "totals_after_run": {k: final.get(k, 0.0) for k in COUNTERS},
    }
    result["rejected_total"] = (result["rejected_requests"] + result["invalid_spans"] + gen["errors"]
                                + sum(bad_status.values()))
    reasons = []
    if received_per_s < 0.95 * target_per_s:
        reasons.append(f"recv {received_per_s / target_per_s:.0%} of target")
    if not complete_share >= 0.99:
        reasons.append(f"{complete_share:.0%} complete")
    if lag_growing:
        reasons.append(f"e2e lag grew {first * 1e3:.0f}->{last * 1e3:.0f} ms")
    result["saturated"] = bool(reasons)
    result["saturation_reasons"] = reasons
    return result


# -- the report ---------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    return f"{seconds * 1e3:.0f}" if seconds >= 0.0995 else f"{seconds * 1e3:.1f}"


def render(rows: list[dict[str, Any]], settings: dict[str, Any], check: str) -> str:
    rows = sorted(rows, key=lambda r: (r["world"], r["rate"]))
    table = []
    for r in rows:
        table.append([
            r["world"], f"{r['rate']:g}", f"{r['target_spans_per_s']:.0f}", f"{r['offered_spans_per_s']:.0f}",
            f"{r['received_spans_per_s']:.0f}", f"{r['requests_per_s']:.0f}", f"{r['steps_joined_per_s']:.1f}",
            f"{100 * r['complete_share']:.1f}%", f"{_ms(r['join_p50_s'])}/{_ms(r['join_p99_s'])}",
            f"{_ms(r['e2e_p50_s'])}/{_ms(r['e2e_p99_s'])}" + ("^" if r["lag_growing"] else ""),
            f"{r['collector_cpu_pct']:.0f}", f"{r['generators_cpu_pct']:.0f}", f"{r['other_cpu_pct']:.0f}",
            f"{r['machine_idle_pct']:.0f}",
            f"{r['rejected_total']:.0f}", f"{r['dropped_spans']:.0f}", "SAT" if r["saturated"] else "ok"])
    out = [wl.header("steptrace collector: N simulated ranks -> one collector over OTLP/HTTP on loopback"),
           f"  {settings['generators']} generator processes x {settings['senders']} keep-alive connections, "
           f"{settings['ranks_per_request']} ranks per request (one ResourceSpans each), 3 spans per rank-step; "
           f"{settings['duration']:g} s per configuration, first {settings['warmup']:g} s excluded",
           f"  {check}",
           f"  load average before the run: {' '.join(f'{x:.2f}' for x in settings['load_average_before'])}",
           f"  The generators share the machine's {NPROC} cores with the collector (gens%, idle%): every saturation "
           "point below is a lower bound on one collector's capacity.",
           "",
           wl.fmt_table(["N", "steps/s", "target sp/s", "offered", "recv sp/s", "req/s", "joined/s", "complete",
                         "join p50/p99 ms", "e2e p50/p99 ms", "coll%", "gens%", "other%", "idle%", "rej", "drop", ""],
                        table),
           f"  steps/s: per rank. CPU columns in % of one core (the machine has {100 * NPROC}%); other%: every other "
           "process and the kernel. ^: e2e lag grew during the window.",
           ""]
    for world in sorted({r["world"] for r in rows}):
        out.append(verdict([r for r in rows if r["world"] == world]))
    ok = [r for r in rows if not r["saturated"]]
    sat = [r for r in rows if r["saturated"]]
    if ok:
        top = max(ok, key=lambda r: r["received_spans_per_s"])
        line = (f"Saturation point: one collector kept up with at most {top['received_spans_per_s']:.0f} spans/s "
                f"({top['received_spans_per_s'] / SPANS_PER_RANK_STEP:.0f} rank-steps/s in "
                f"{top['requests_per_s']:.0f} requests/s: N={top['world']} at {top['rate']:g} steps/s per rank), "
                f"collector at {top['collector_cpu_pct']:.0f}% of a core, generators {top['generators_cpu_pct']:.0f}%, "
                f"machine idle {top['machine_idle_pct']:.0f}%")
        if sat:
            peak = max(sat, key=lambda r: r["received_spans_per_s"])
            line += (f"; overloaded, it still took in {peak['received_spans_per_s']:.0f} spans/s (N={peak['world']}, "
                     f"collector {peak['collector_cpu_pct']:.0f}% of a core, machine idle "
                     f"{peak['machine_idle_pct']:.0f}%)")
        out.append(line + ".")
    return "\n".join(out) + "\n"


def verdict(rows: list[dict[str, Any]]) -> str:
    """One line for one N: the last rung that kept up and the first that did not."""
    world = rows[0]["world"]
    ok = [r for r in rows if not r["saturated"]]
    sat = [r for r in rows if r["saturated"]]
    top = max(ok, key=lambda r: r["rate"]) if ok else None
    first = min((r for r in sat if top is None or r["rate"] > top["rate"]), key=lambda r: r["rate"], default=None)
    if top is not None:
        text = (f"N={world}: keeps up through {top['rate']:g} steps/s per rank ({top['received_spans_per_s']:.0f} "
                f"spans/s in {top['requests_per_s']:.0f} req/s, all steps complete, join p99 "
                f"{_ms(top['join_p99_s'])} ms, collector {top['collector_cpu_pct']:.0f}% of a core)")
    else:
        text = f"N={world}: saturated at every rung tried"
    if first is not None:
        text += (f"; saturates at {first['rate']:g} ({first['target_spans_per_s']:.0f} spans/s offered, "
                 f"{first['received_spans_per_s']:.0f} received, collector {first['collector_cpu_pct']:.0f}%, "
                 f"machine idle {first['machine_idle_pct']:.0f}%: {'; '.join(first['saturation_reasons'])})")
    else:
        text += "; did not saturate on this ladder"
    return text + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 s per configuration, two rungs per N, no refinement")
    parser.add_argument("--ns", default="8,64,256", help="world sizes (default: 8,64,256)")
    parser.add_argument("--rates", default=None,
                        help="steps/s per rank to try for every N, instead of the ladder (comma-separated)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per configuration (default: 12; quick 4)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds excluded at the start (default: 2; quick 1)")
    parser.add_argument("--generators", type=int, default=4, help="load-generator processes (default: 4)")
    parser.add_argument("--senders", type=int, default=4, help="connections per generator (default: 4)")
    parser.add_argument("--ranks-per-request", type=int, default=8, help="ranks per OTLP request (default: 8)")
    parser.add_argument("--max-backlog-s", type=float, default=1.0,
                        help="a generator drops what would wait longer than this to be sent (default: 1)")
    parser.add_argument("--keep-going", action="store_true", help="run every rung, also past saturation")
    parser.add_argument("--json", metavar="PATH", help="also write every number measured")
    args = parser.parse_args(argv)
    duration = args.duration or (4.0 if args.quick else 12.0)
    warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    if not 0 <= warmup <= duration - 1:
        parser.error("--warmup must leave at least 1 s of --duration")
    if args.generators < 1 or args.senders < 1 or args.ranks_per_request < 1:
        parser.error("--generators, --senders and --ranks-per-request must be >= 1")
    worlds = [int(n) for n in args.ns.split(",")]
    ladder = QUICK_LADDER if args.quick else FULL_LADDER
    settings = {"duration": duration, "warmup": warmup, "generators": args.generators, "senders": args.senders,
                "ranks_per_request": args.ranks_per_request, "max_backlog_s": args.max_backlog_s,
                "ladder_spans_per_s": None if args.rates else list(ladder)}

    load_before = os.getloadavg()
    check = verify_payload()
    settings["load_average_before"] = load_before
    gens = Generators(args.generators)
    rows: list[dict[str, Any]] = []

    def run(world: int, rate: float) -> dict[str, Any]:
        row = run_config(gens, world, rate, duration=duration, warmup=warmup,
                         ranks_per_request=args.ranks_per_request, senders=args.senders,
                         max_backlog_s=args.max_backlog_s)
        rows.append(row)
        print(f"  N={world:<4} {rate:>7g} steps/s/rank: target {row['target_spans_per_s']:.0f} spans/s, "
              f"received {row['received_spans_per_s']:.0f}, complete {100 * row['complete_share']:.1f}%, "
              f"collector {row['collector_cpu_pct']:.0f}% CPU"
              + (f"  SATURATED ({'; '.join(row['saturation_reasons'])})" if row["saturated"] else ""),
              file=sys.stderr, flush=True)
        return row

    def per_rank(total_spans_per_s: float, world: int) -> float:
        return float(f"{total_spans_per_s / (SPANS_PER_RANK_STEP * world):.3g}")

    try:
        for world in worlds:
            rates = ([float(r) for r in args.rates.split(",")] if args.rates
                     else [per_rank(t, world) for t in ladder])
            last_ok = None
            for rate in rates:
                row = run(world, rate)
                if not row["saturated"]:
                    last_ok = rate
                elif not args.keep_going:
                    # One more rung between the last that kept up and this one, when they are far apart.
                    if not args.rates and not args.quick:
                        low = last_ok if last_ok is not None else rate / 4
                        if rate / low > 1.9:
                            run(world, float(f"{math.sqrt(low * rate):.3g}"))
                    break
    finally:
        gens.close()
    print(render(rows, settings, check))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": wl.machine_info(), "settings": settings, "payload_check": check, "results": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
