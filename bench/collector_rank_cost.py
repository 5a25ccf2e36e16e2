"""What one rank-step costs the steptrace collector, and what one step's record weighs.

Usage::

    .venv/bin/python bench/collector_rank_cost.py            # ~30 s
    .venv/bin/python bench/collector_rank_cost.py --quick    # ~8 s
    .venv/bin/python bench/collector_rank_cost.py --json out.json

Part 1, **collector CPU per rank-step**, in process (no sockets): per step, ``--ranks`` ranks
(64) send their spans in requests of 8 ranks (one ``ResourceSpans`` each, as a batching
OpenTelemetry Collector forwards them), and the collector's own code path runs on each request
body: ``parse_request`` (protobuf) → ``extract_steps`` → ``Joiner.add`` → the ``cluster_step``
record serialized as the run log writes it. The process CPU time (``time.process_time``) of that
path over ``--steps`` steps, divided by ranks × steps, is the cost per rank-step; median of
``--repeats`` interleaved rounds. Two payloads, as ``steptrace/otlp.py`` exports a step:

* ``plain``: ``train.step`` (the SDK's attributes: run, rank, attempt, step, world size, status,
  backend, interval/compute/idle seconds, tokens, FLOPs, tokens/s, TFLOP/s, MFU, the wait in
  collectives and time on its own) with its ``train.compute`` and ``train.idle`` children;
* ``pipeline``: the same, the step span also carrying its microbatch summary (2 chunks × 2
  kinds × 6 fields, ``train.microbatch_summary.*``), plus the full ``train.microbatch`` spans of
  32 microbatches × 2 chunks × 2 kinds = 128 per rank (``otlp_microbatch_spans`` on), each with
  the SDK's attributes.

Part 2, **bytes per cluster_step line**: ``--world`` (4,096) synthetic ranks with measured waits
into a ``Joiner``; the length of the record's JSON line as the run log writes it, by default
(aggregates and the 10 slowest ranks) and with ``--cluster-per-rank`` (per-rank maps).

Spans are built with opentelemetry-proto in the shape the SDK emits (attribute names and types
from ``steptrace/otlp.py``); ids and times are the SDK's (``steptrace._ids``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from steptrace._ids import span_id, trace_id
from steptrace.collector._decode import StepSpan, extract_steps, parse_request
from steptrace.collector._join import Joiner

RUN = "bench-run"
PROTOBUF = "application/x-protobuf"


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def rank_spans(rank: int, world: int, step: int, end_s: float, pipeline: bool,
               microbatch_spans: bool | None = None) -> ResourceSpans:
    """One rank's spans of one step, as the SDK's exporter groups them (a pipeline rank's full
    microbatch spans unless ``microbatch_spans`` is False: the SDK's default sends the summary only)."""
    interval, compute = 0.5, 0.375 + rank % 7 / 1000
    base = {"train.run_id": RUN, "train.rank": rank, "train.attempt": 0, "train.step": step}
    trace = trace_id(RUN, step).to_bytes(16, "big")
    step_id = span_id(RUN, step, rank, "step").to_bytes(8, "big")
    end = round(end_s * 1e9)
    attrs = dict(base, **{"train.world_size": world, "train.status": "ok", "train.backend": "torch",
                          "train.interval_seconds": interval, "train.compute_seconds": compute,
                          "train.idle_seconds": interval - compute, "train.tokens": 65536, "train.flops": 1.2e15,
                          "train.tokens_per_second": 131072.0, "train.tflops_per_second": 2400.0,
                          "train.mfu": 0.41, "train.collective_wait_seconds": 0.05,
                          "train.own_seconds": interval - 0.05, "train.idle.data_seconds": 0.1})
    spans = []
    if pipeline:
        for chunk in range(2):
            for kind in ("forward", "backward"):
                prefix = f"train.microbatch_summary.{rank % 4}.{chunk}.{kind}."
                for field in ("count", "compute_seconds_sum", "compute_seconds_min", "compute_seconds_max",
                              "first_start_time", "last_end_time"):
                    attrs[prefix + field] = 32 if field == "count" else 0.01
    if pipeline and (microbatch_spans is None or microbatch_spans):
        k = 0
        for chunk in range(2):
            for kind in ("forward", "backward"):
                for mb in range(32):
                    mb_attrs = dict(base, **{"train.microbatch": mb, "train.stage": rank % 4, "train.chunk": chunk,
                                             "train.kind": kind, "train.compute_seconds": 0.003})
                    spans.append(Span(trace_id=trace, span_id=span_id(RUN, step, rank, f"microbatch/{k}").to_bytes(
                        8, "big"), parent_span_id=step_id, name="train.microbatch", kind=Span.SPAN_KIND_INTERNAL,
                        start_time_unix_nano=end - 400_000_000 + k * 3_000_000,
                        end_time_unix_nano=end - 397_000_000 + k * 3_000_000,
                        attributes=[_kv(a, v) for a, v in mb_attrs.items()]))
                    k += 1
    spans.insert(0, Span(trace_id=trace, span_id=step_id, name="train.step", kind=Span.SPAN_KIND_INTERNAL,
                         start_time_unix_nano=end - round(interval * 1e9), end_time_unix_nano=end,
                         attributes=[_kv(a, v) for a, v in attrs.items()]))
    spans.insert(1, Span(trace_id=trace, span_id=span_id(RUN, step, rank, "compute").to_bytes(8, "big"),
                         parent_span_id=step_id, name="train.compute", kind=Span.SPAN_KIND_INTERNAL,
                         start_time_unix_nano=end - round(compute * 1e9), end_time_unix_nano=end,
                         attributes=[_kv(a, v) for a, v in dict(base, **{"train.compute_seconds": compute}).items()]))
    spans.insert(2, Span(trace_id=trace, span_id=span_id(RUN, step, rank, "idle/0").to_bytes(8, "big"),
                         parent_span_id=step_id, name="train.idle", kind=Span.SPAN_KIND_INTERNAL,
                         start_time_unix_nano=end - round(interval * 1e9),
                         end_time_unix_nano=end - round(compute * 1e9),
                         attributes=[_kv(a, v) for a, v in dict(base, **{"train.idle.reason": "data",
                                                                         "train.idle_seconds": 0.1}).items()]))
    resource = Resource(attributes=[_kv("service.name", "steptrace"), _kv("service.instance.id", f"{RUN}/rank-{rank}"),
                                    _kv("telemetry.sdk.name", "steptrace")])
    return ResourceSpans(resource=resource, scope_spans=[ScopeSpans(
        scope=InstrumentationScope(name="steptrace"), spans=spans)])


def bodies(ranks: int, steps: int, per_request: int, pipeline: bool,
           microbatch_spans: bool | None = None) -> list[list[bytes]]:
    now = time.time() - 60
    out = []
    for step in range(steps):
        requests = []
        for first in range(0, ranks, per_request):
            group = range(first, min(ranks, first + per_request))
            request = ExportTraceServiceRequest(resource_spans=[
                rank_spans(r, ranks, step, now + step, pipeline, microbatch_spans) for r in group])
            requests.append(request.SerializeToString())
        out.append(requests)
    return out


def collector_path(steps: list[list[bytes]], ranks: int) -> tuple[float, int]:
    """CPU seconds of the collector's path over these request bodies, and records written."""
    joiner = Joiner(world_size=ranks, max_open_steps=1 << 16)
    written = 0
    start = time.process_time()
    for requests in steps:
        for data in requests:
            extracted = extract_steps(parse_request("traces", data, PROTOBUF), ranks)
            for record in joiner.add(extracted.steps).records:
                record.pop("_own", None)
                written += len(json.dumps(record, separators=(",", ":")))
    return time.process_time() - start, written


def record_bytes(world: int, per_rank: bool) -> int:
    try:
        joiner = Joiner(world_size=world, per_rank=per_rank)
    except TypeError:  # a collector from before --cluster-per-rank: its records always had the maps
        joiner = Joiner(world_size=world)
    spans = [StepSpan(run_id=RUN, step=0, rank=r, world_size=world, trace_id="", compute_seconds=0.4 + r * 1e-7,
                      interval_seconds=0.5 + r * 1e-7, idle_seconds=0.1, end_time=1.7e9,
                      collective_wait_seconds=0.05 + r * 1e-7, own_seconds=0.45 - r * 1e-7,
                      bubble={str(r % 4): 0.12})
             for r in range(world)]
    (record,) = joiner.add(spans).records
    record.pop("_own", None)
    return len(json.dumps(record, separators=(",", ":"))) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 20; quick 5)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 5; quick 3)")
    parser.add_argument("--world", type=int, default=4096, help="ranks of the record-size measurement")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    steps = args.steps or (5 if args.quick else 20)
    repeats = args.repeats or (3 if args.quick else 5)
    payloads = {kind: bodies(args.ranks, steps, 8, kind == "pipeline") for kind in ("plain", "pipeline")}
    results: dict[str, Any] = {"ranks": args.ranks, "steps": steps, "repeats": repeats}
    samples: dict[str, list[float]] = {kind: [] for kind in payloads}
    for _ in range(repeats):
        for kind, data in payloads.items():  # interleaved
            cpu, _ = collector_path(data, args.ranks)
            samples[kind].append(cpu / (args.ranks * steps))
    print(f"collector CPU per rank-step ({args.ranks} ranks, {steps} steps, 8 ranks per request, "
          f"median of {repeats}):")
    for kind, values in samples.items():
        size = sum(len(b) for b in payloads[kind][0]) / args.ranks
        spans = 3 + (128 if kind == "pipeline" else 0)
        median = statistics.median(values)
        results[kind] = {"us_per_rank_step": median * 1e6, "spread_us": [min(values) * 1e6, max(values) * 1e6],
                         "bytes_per_rank_step": size, "spans_per_rank_step": spans}
        print(f"  {kind:9s} {spans:4d} spans {size / 1024:6.1f} KiB/rank-step  {median * 1e6:8.1f} us "
              f"(min {min(values) * 1e6:.1f}, max {max(values) * 1e6:.1f})")
    default, full = record_bytes(args.world, False), record_bytes(args.world, True)
    results["record_bytes"] = {"world": args.world, "default": default, "per_rank": full}
    print(f"cluster_step line at {args.world} ranks: {default:,} bytes by default, "
          f"{full:,} with --cluster-per-rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
