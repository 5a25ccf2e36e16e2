"""The collector in process: decoding, the cross-rank join, /metrics, the HTTP receiver's answers, fuzzing.

Requests are built with opentelemetry-proto (``tests/collector_helpers.py``)
the way steptrace's OTLP exporter shapes them; the end-to-end tests through
real rank processes are in ``test_collector_e2e.py``.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zlib

import pytest

pytest.importorskip("opentelemetry.proto",
                    reason="the collector needs opentelemetry-proto (pip install 'steptrace[otlp]')")
pytest.importorskip("prometheus_client",
                    reason="the collector needs prometheus_client (pip install 'steptrace[prometheus]')")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Gauge, Metric, NumberDataPoint  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

import steptrace  # noqa: E402
from collector_helpers import (  # noqa: E402
    END_BASE_S,
    JSON,
    PROTOBUF,
    FakeClock,
    body,
    collectors,
    otlp_json,
    post,
    read_records,
    request,
    scrape,
    span,
    step_span,
    value,
    wait_for,
)
from steptrace._ids import trace_id_hex  # noqa: E402
from steptrace.collector import Collector, CollectorConfig  # noqa: E402
from steptrace.collector._cli import add_collector_arguments  # noqa: E402
from steptrace.collector._decode import (  # noqa: E402
    Rejected,
    StepSpan,
    decompress,
    extract_steps,
    media_type,
    parse_request,
)
from steptrace.collector._join import Joiner, cluster_record  # noqa: E402
from steptrace.testing import SimulatedDevice  # noqa: E402

TRACES = "/v1/traces"


@pytest.fixture
def make_collector(tmp_path):
    with collectors(tmp_path / "runs", world_size=3) as make:
        yield make


@pytest.fixture
def collector(make_collector) -> Collector:
    return make_collector()


def cluster_file(c: Collector, run_id: str = "run"):
    from pathlib import Path

    return Path(c.config.run_dir) / run_id / "cluster.jsonl"


# -- decoding ------------------------------------------------------------------------------------


def test_protobuf_request_decodes_to_step_spans_and_counts_other_spans():
    data = body(step_span(step=7, rank=1, compute=0.25, interval=0.5, bubble={"0": 0.125, "1": 0.5}),
                step_span(step=7, rank=1, name="train.compute"),
                step_span(step=7, rank=2, compute=0.75, interval=1.0, status="error"))
    extracted = extract_steps(parse_request("traces", data, PROTOBUF))
    assert extracted.spans == 3
    assert extracted.spans_by_run == {"run": 3}
    assert extracted.invalid == {}
    first, second = extracted.steps
    assert (first.run_id, first.step, first.rank, first.world_size) == ("run", 7, 1, 3)
    assert first.compute_seconds == 0.25 and first.interval_seconds == 0.5 and first.idle_seconds == 0.25
    assert first.bubble == {"0": 0.125, "1": 0.5}
    assert first.trace_id == trace_id_hex("run", 7)
    assert first.end_time == pytest.approx(END_BASE_S + 7.0)
    assert (second.rank, second.status, second.compute_seconds) == (2, "error", 0.75)


def test_spans_the_collector_does_not_use_are_never_decoded(make_collector):
    """Microbatch spans carrying attributes no decoder would take (malformed bytes, invalid UTF-8,
    a 2 MB value) are counted and skipped by name: the request is accepted and the step joins."""
    c = make_collector(world_size=2)

    def microbatch(rank: int, k: int, attribute: bytes) -> bytes:
        good = step_span(step=4, rank=rank, world_size=2, name="train.microbatch", **{"train.microbatch": k})
        return good.SerializeToString() + b"\x4a" + _varint(len(attribute)) + attribute  # Span.attributes

    broken = [b"\x0a\xff\x01train.step",  # a key longer than the KeyValue
              b"\x0a\x04\xff\xfe\xfd\xfc",  # a key that is not UTF-8
              b"\x0a\x0atrain.huge\x12\x85\x80\x80\x01\x0a\x80\x80\x80\x01" + b"x" * (1 << 21)]  # 2 MiB
    rank_spans = []
    for rank in range(2):
        spans = b"".join(_field(2, microbatch(rank, k, attribute)) for k, attribute in enumerate(broken))
        spans += _field(2, step_span(step=4, rank=rank, world_size=2).SerializeToString())
        rank_spans.append(_field(1, _field(2, spans)))  # ResourceSpans{ScopeSpans{spans}}
    with pytest.raises(DecodeError):  # what a full decode does with it (the collector before)
        ExportTraceServiceRequest.FromString(b"".join(rank_spans))
    status, _, _ = post(c.port, TRACES, b"".join(rank_spans))
    assert status == 200
    assert wait_for(lambda: len(read_records(cluster_file(c))) == 1)
    (record,) = read_records(cluster_file(c))
    assert (record["step"], record["complete"], record["ranks_reporting"]) == (4, True, 2)
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_collector_skipped_spans_total") == 6
    assert value(text, "steptrace_collector_received_spans_total", run_id="run") == 8  # its meaning is unchanged

    # OTLP/JSON: spans it does not use are blanked before the document is parsed.
    message = request(step_span(step=5, rank=0, world_size=2), step_span(step=5, rank=1, world_size=2))
    document = json.loads(otlp_json(message))
    for resource in document["resourceSpans"]:
        resource["scopeSpans"][0]["spans"].append({"name": "train.microbatch", "attributes": "not a list",
                                                   "traceId": 17, "startTimeUnixNano": {"x": []}})
    status, _, _ = post(c.port, TRACES, json.dumps(document).encode(), JSON)
    assert status == 200
    assert wait_for(lambda: len(read_records(cluster_file(c))) == 2)
    assert read_records(cluster_file(c))[1]["complete"] is True
    assert value(scrape(c.metrics_url), "steptrace_collector_skipped_spans_total") == 8


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_otlp_json_with_hex_ids_decodes_like_protobuf():
    message = request(step_span(step=3, rank=0, compute=0.5), step_span(step=3, rank=2, compute=0.25))
    data = otlp_json(message)
    document = json.loads(data)
    hex_id = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    assert hex_id == trace_id_hex("run", 3)  # the spec's encoding: hex, not base64

    decoded = parse_request("traces", data, JSON)
    assert ExportTraceServiceRequest.FromString(decoded.SerializeToString()) == message  # spans kept as bytes
    steps = extract_steps(decoded).steps
    assert [(s.rank, s.compute_seconds, s.trace_id) for s in steps] == [
        (0, 0.5, trace_id_hex("run", 3)), (2, 0.25, trace_id_hex("run", 3))]

    # Unknown fields are ignored (as OTLP asks of receivers); base64 ids from a non-conforming producer still parse.
    document["somethingNew"] = {"x": 1}
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "AAAAAAAAAAAAAAAAAAAAAQ=="
    decoded = parse_request("traces", json.dumps(document).encode(), JSON)
    assert Span.FromString(decoded.resource_spans[0].scope_spans[0].spans[0]).trace_id == (1).to_bytes(16, "big")


def test_metrics_requests_decode_in_both_encodings():
    metrics = ExportMetricsServiceRequest()
    scope = metrics.resource_metrics.add().scope_metrics.add()
    scope.metrics.append(Metric(name="steptrace.mfu", gauge=Gauge(data_points=[
        NumberDataPoint(as_double=0.5), NumberDataPoint(as_double=0.25)])))
    assert parse_request("metrics", metrics.SerializeToString(), PROTOBUF) == metrics
    assert parse_request("metrics", otlp_json(metrics), JSON) == metrics


@pytest.mark.parametrize("content_type, expected", [
    ("application/x-protobuf", PROTOBUF), ("application/json; charset=utf-8", JSON), ("Application/JSON", JSON)])
def test_media_types(content_type, expected):
    assert media_type(content_type) == expected


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/protobuf", "application/grpc"])
def test_other_media_types_are_415(content_type):
    with pytest.raises(Rejected) as info:
        media_type(content_type)
    assert (info.value.status, info.value.reason) == (415, "unsupported_media_type")


def test_decompress_gzip_deflate_and_refuse_bombs():
    data = body(step_span())
    assert decompress(gzip.compress(data), "gzip", 1 << 20) == data
    assert decompress(zlib.compress(data), "deflate", 1 << 20) == data
    assert decompress(data, None, 1 << 20) == data
    bomb = gzip.compress(b"\0" * (4 << 20))
    assert len(bomb) < 10_000
    with pytest.raises(Rejected) as info:
        decompress(bomb, "gzip", 1 << 20)
    assert (info.value.status, info.value.reason) == (413, "too_large")
    with pytest.raises(Rejected) as info:
        decompress(gzip.compress(data)[:-10], "gzip", 1 << 20)
    assert (info.value.status, info.value.reason) == (400, "malformed")
    with pytest.raises(Rejected) as info:
        decompress(data, "br", 1 << 20)
    assert (info.value.status, info.value.reason) == (415, "unsupported_encoding")


def test_unusable_step_spans_are_skipped_and_counted_by_reason():
    data = body(step_span(rank=0),
                step_span(rank=1, drop=("train.compute_seconds",)),
                step_span(rank=2, **{"train.compute_seconds": "0.1"}),  # a string: bad_value (a number that
                # cannot be a duration refuses the whole export: test_collector_hostile)
                step_span(run_id="../../etc", rank=0),
                step_span(rank=5),
                step_span(rank=1, **{"train.step": "seven"}))
    extracted = extract_steps(parse_request("traces", data, PROTOBUF), world_size=3)
    assert [s.rank for s in extracted.steps] == [0]
    assert extracted.invalid == {"missing_attribute": 1, "bad_value": 2, "bad_run_id": 1, "rank_out_of_range": 1}
    # Without --world-size, rank 5 is a rank like any other.
    assert 5 in [s.rank for s in extract_steps(parse_request("traces", data, PROTOBUF)).steps]


# -- the join ------------------------------------------------------------------------------------


def test_records_hold_aggregates_and_the_slowest_ranks_not_per_rank_maps_by_default(tmp_path):
    spans = [span(rank=r, world_size=12, compute=0.1, interval=0.2 + r / 1000) for r in range(12) if r != 4]
    joiner = Joiner(world_size=12)
    joiner.add(spans)
    [record] = joiner.flush().records
    assert not any(key.startswith("rank_") for key in record)
    # the ranks with the most time on their own (compute: no waits measured; a tie goes to the lowest)
    assert [rank for rank, _ in record["slowest_ranks"]] == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert (record["missing_rank_count"], record["missing_rank_ranges"], record["ranks_reporting"]) == (1, [[4, 4]], 11)
    assert record["interval_max_seconds"] == pytest.approx(0.211) and record["_own"][11] == 0.1
    full = cluster_record("run", 0, "", 12, spans, reason="window", first_seen_time=0.0,
                          joined_time=0.0, join_seconds=0.0)
    assert len(full["rank_compute_seconds"]) == 11 and "_own" not in full

    # A restarted collector reads which ranks a step had from the aggregates: a retry of a span
    # it wrote is a duplicate, the missing rank's span a late record, never a second step.
    from steptrace.collector._runlog import _present_ranks
    assert list(_present_ranks(record)) == [r for r in range(12) if r != 4]
    restarted = Joiner(world_size=12, history=lambda run: [(0, list(_present_ranks(record)), None)])
    result = restarted.add([spans[0], span(rank=4, world_size=12)])
    assert result.duplicates == {"run": 1} and [r["type"] for r in result.records] == ["late"]


def test_written_steps_are_remembered_compactly_and_still_tell_duplicates_late_spans_and_conflicts():
    from steptrace.collector._decode import span_fingerprint
    from steptrace.collector._join import _Emitted

    world = 1000
    joiner = Joiner(world_size=world)
    spans = [span(rank=r, world_size=world, compute=0.1 + r / 1e4) for r in range(world)]
    [record] = joiner.add(spans).records
    emitted = joiner._runs["run"].emitted[(0, 0)]
    # a complete step: the ranks are a count and the fingerprints 4 bytes each
    assert emitted.ranks is None and emitted.count == world and emitted.fingerprints.typecode == "I"
    assert emitted.fingerprints.itemsize * len(emitted.fingerprints) == 4 * world
    assert emitted.find(7) == span_fingerprint(spans[7].compute_seconds, spans[7].interval_seconds)
    assert emitted.find(world) is None
    again = joiner.add([spans[7], span(rank=7, world_size=world, compute=9.0), span(rank=world + 3, world_size=world)])
    assert again.duplicates == {"run": 1} and len(again.conflicts) == 1 and [r["type"] for r in again.records] == [
        "late"]
    assert emitted.ranks is not None and emitted.find(world + 3) is not None and emitted.find(7) != -1
    # seeded from a record without per-rank maps: the ranks only, any later span of one a duplicate
    seeded = _Emitted([(r, None) for r in range(world) if r != 4], None)
    assert seeded.fingerprints is None and seeded.ranks is not None and seeded.find(5) == -1
    assert seeded.find(4) is None


def test_step_is_emitted_when_all_ranks_reported_with_straggler_skew_and_stats():
    joiner = Joiner(world_size=3, per_rank=True)
    assert joiner.add([span(rank=0, compute=0.1, interval=0.5), span(rank=2, compute=0.2, interval=0.7)]).records == []
    assert joiner.open_steps == 1
    [record] = joiner.add([span(rank=1, compute=0.35, interval=0.6, status="error")]).records
    assert joiner.open_steps == 0
    assert record["type"] == "cluster_step" and record["reason"] == "all_ranks"
    assert (record["run_id"], record["step"], record["trace_id"]) == ("run", 0, trace_id_hex("run", 0))
    assert record["complete"] is True
    assert (record["world_size"], record["ranks_reporting"], record["missing_ranks"]) == (3, 3, [])
    assert record["rank_compute_seconds"] == {"0": 0.1, "1": 0.35, "2": 0.2}
    assert record["rank_interval_seconds"] == {"0": 0.5, "1": 0.6, "2": 0.7}
    assert (record["compute_min_seconds"], record["compute_median_seconds"], record["compute_max_seconds"]) == (
        0.1, 0.2, 0.35)
    assert (record["interval_min_seconds"], record["interval_median_seconds"], record["interval_max_seconds"]) == (
        0.5, 0.6, 0.7)
    assert record["skew_seconds"] == pytest.approx(0.25)
    assert record["straggler_rank"] == 1
    assert record["status"] == {"ok": 2, "error": 1}
    assert record["compute_sum_seconds"] == pytest.approx(0.65)
    assert record["interval_sum_seconds"] == pytest.approx(1.8)


def test_straggler_tie_goes_to_the_lowest_rank_and_bubble_is_the_stage_mean():
    joiner = Joiner(world_size=4)
    [record] = joiner.add([span(rank=r, compute=c, bubble=b) for r, c, b in (
        (3, 0.3, {"1": 0.5}), (1, 0.3, {"0": 0.25}), (0, 0.1, {"0": 0.75}), (2, 0.2, {"1": 0.25}))]).records
    assert record["straggler_rank"] == 1
    assert record["pipeline_bubble_ratio"] == {"0": 0.5, "1": 0.375}


def test_world_size_comes_from_the_spans_without_the_flag():
    joiner = Joiner()
    assert joiner.add([span(rank=0, world_size=2)]).records == []
    [record] = joiner.add([span(rank=1, world_size=2)]).records
    assert record["complete"] and record["world_size"] == 2


def test_window_expiry_emits_the_step_with_its_missing_ranks_and_no_straggler():
    clock = FakeClock()
    joiner = Joiner(world_size=4, window_s=5.0, clock=clock)
    joiner.add([span(step=1, rank=0, compute=0.5), span(step=1, rank=2, compute=0.25)])
    clock.now += 1.0
    joiner.add([span(step=2, rank=0)])
    clock.now += 3.9
    assert joiner.expire().records == []
    clock.now += 0.2  # step 1's window (5 s from its first span) has passed, step 2's has not
    [record] = joiner.expire().records
    assert (record["step"], record["reason"], record["complete"]) == (1, "window", False)
    assert record["missing_ranks"] == [1, 3] and record["ranks_reporting"] == 2
    assert record["straggler_rank"] is None
    assert record["skew_seconds"] == pytest.approx(0.25)  # over the ranks that reported
    assert record["join_seconds"] == pytest.approx(5.1)
    assert joiner.open_steps == 1
    clock.now += 1.0
    assert [r["step"] for r in joiner.expire().records] == [2]


def test_late_spans_become_late_records_and_duplicates_are_dropped():
    clock = FakeClock()
    joiner = Joiner(world_size=3, window_s=1.0, clock=clock)
    joiner.add([span(rank=0), span(rank=1)])
    clock.now += 2
    [emitted] = joiner.expire().records
    assert emitted["missing_ranks"] == [2]
    result = joiner.add([span(rank=2, compute=0.9), span(rank=0)])
    [late] = result.records
    assert late["type"] == "late"
    assert (late["run_id"], late["step"], late["rank"], late["compute_seconds"]) == ("run", 0, 2, 0.9)
    assert late["trace_id"] == trace_id_hex("run", 0)
    assert result.duplicates == {"run": 1}  # rank 0 was already in the step
    # The same late span again (an exporter retry) is a duplicate, not a second late record.
    again = joiner.add([span(rank=2, compute=0.9)])
    assert again.records == [] and again.duplicates == {"run": 1}
    # A retried span of an open step is a duplicate too.
    joiner.add([span(step=1, rank=0)])
    assert joiner.add([span(step=1, rank=0)]).duplicates == {"run": 1}


def test_too_many_open_steps_emits_the_oldest_early():
    joiner = Joiner(world_size=2, max_open_steps=3)
    for step in range(3):
        assert joiner.add([span(step=step, rank=0)]).records == []
    [evicted] = joiner.add([span(step=3, rank=0)]).records
    assert (evicted["step"], evicted["reason"], evicted["complete"]) == (0, "evicted", False)
    assert joiner.open_steps == 3
    [flushed_first, *_] = joiner.flush().records
    assert flushed_first["step"] == 1 and flushed_first["reason"] == "shutdown" and joiner.open_steps == 0


def test_history_from_a_previous_collector_makes_old_steps_late_not_new():
    joiner = Joiner(world_size=3, history=lambda run_id: [(5, [0, 1], None)] if run_id == "run" else [])
    result = joiner.add([span(step=5, rank=0), span(step=5, rank=2), span(step=6, rank=0)])
    assert [(r["type"], r["rank"]) for r in result.records] == [("late", 2)]
    assert result.duplicates == {"run": 1}
    assert joiner.open_steps == 1


def test_a_written_step_is_never_replaced_however_late_its_second_version_ends():
    """A re-sent step with ends an hour on once wrote a second record for it (a forgery that stood)."""
    clock = FakeClock()
    joiner = Joiner(world_size=2, window_s=1.0, clock=clock)
    first = [span(step=3, rank=r) for r in range(2)]
    [record] = joiner.add(first).records
    assert record["end_time"] == pytest.approx(1.7e9 + 3)
    again = [StepSpan(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}, "end_time": s.end_time + 3600,
                         "compute_seconds": 0.5}) for s in first]
    assert joiner.add([first[0]]).duplicates == {"run": 1}
    result = joiner.add(again)
    assert result.records == []
    assert [(c["type"], c["rank"], c["when"]) for c in result.conflicts] == [("conflict", 0, "after_emit"),
                                                                            ("conflict", 1, "after_emit")]


# -- the collector: metrics and cluster.jsonl --------------------------------------------------------


def send(c: Collector, *spans) -> ExportTraceServiceResponse:
    status, headers, data = post(c.port, TRACES, body(*spans))
    assert status == 200, data
    assert headers["content-type"] == PROTOBUF
    return ExportTraceServiceResponse.FromString(data)


def test_metrics_and_cluster_records_after_joined_steps(make_collector):
    c = make_collector(window_s=0.3, goodput_window_steps=2)
    computes = {0: (0.1, 0.4, 0.2), 1: (0.3, 0.1, 0.2), 2: (0.2, 0.3, 0.5)}  # step -> per-rank compute
    for step, per_rank in computes.items():
        send(c, *[step_span(step=step, rank=r, compute=comp, interval=1.0, bubble={"0": 0.1 * (r + 1)})
                  for r, comp in enumerate(per_rank)])
    send(c, step_span(step=3, rank=0, compute=0.2, interval=1.0), step_span(step=3, rank=1, compute=0.2, interval=1.0))
    assert wait_for(lambda: len(read_records(cluster_file(c))) == 4, 5)
    records = read_records(cluster_file(c))
    assert [(r["step"], r["complete"], r["straggler_rank"]) for r in records] == [
        (0, True, 1), (1, True, 0), (2, True, 2), (3, False, None)]
    assert records[3]["missing_ranks"] == [2] and records[3]["reason"] == "window"

    send(c, step_span(step=3, rank=2, compute=0.9))  # late
    text = scrape(c.metrics_url)
    run = {"run_id": "run"}
    # The gauges describe step 2, the last complete one.
    assert value(text, "steptrace_cluster_last_complete_step", **run) == 2
    assert value(text, "steptrace_cluster_step_compute_seconds", stat="min", **run) == pytest.approx(0.2)
    assert value(text, "steptrace_cluster_step_compute_seconds", stat="median", **run) == pytest.approx(0.3)
    assert value(text, "steptrace_cluster_step_compute_seconds", stat="max", **run) == pytest.approx(0.5)
    assert value(text, "steptrace_cluster_step_interval_seconds", stat="median", **run) == pytest.approx(1.0)
    assert value(text, "steptrace_cluster_step_skew_seconds", **run) == pytest.approx(0.3)
    assert value(text, "steptrace_cluster_straggler_rank", **run) == 2
    for rank, n in (("0", 1), ("1", 1), ("2", 1)):
        assert value(text, "steptrace_cluster_straggler_steps_total", rank=rank, **run) == n
    assert value(text, "steptrace_cluster_pipeline_bubble_ratio", stage="0", **run) == pytest.approx(0.2)
    # Step 3 is the last joined: two of three ranks.
    assert value(text, "steptrace_cluster_last_step", **run) == 3
    assert value(text, "steptrace_cluster_ranks_reporting", **run) == 2
    assert value(text, "steptrace_cluster_world_size", **run) == 3
    # The compute share of the last 2 steps (not goodput: no process start, no time outside steps):
    # (0.2 + 0.3 + 0.5 + 0.2 + 0.2) / 5 intervals of 1 s.
    assert value(text, "steptrace_cluster_compute_share_ratio", **run) == pytest.approx(1.4 / 5)
    assert not [line for line in text.splitlines() if "goodput" in line and not line.startswith("#")]
    assert value(text, "steptrace_cluster_steps_joined_total", **run) == 4
    assert value(text, "steptrace_cluster_incomplete_steps_total", **run) == 1
    assert value(text, "steptrace_cluster_join_lag_seconds_count", **run) == 4
    assert value(text, "steptrace_collector_received_spans_total", **run) == 12
    assert value(text, "steptrace_collector_late_spans_total", **run) == 1
    assert value(text, "steptrace_collector_requests_total", signal="traces", transport="http") == 5
    assert value(text, "steptrace_collector_open_steps") == 0
    assert "_created" not in text

    late = [r for r in read_records(cluster_file(c)) if r["type"] == "late"]
    assert [(r["step"], r["rank"], r["compute_seconds"]) for r in late] == [(3, 2, 0.9)]


def test_metrics_requests_are_counted(collector):
    metrics = ExportMetricsServiceRequest()
    metrics.resource_metrics.add().scope_metrics.add().metrics.append(
        Metric(name="m", gauge=Gauge(data_points=[NumberDataPoint(as_double=1.0)] * 3)))
    status, headers, _ = post(collector.port, "/v1/metrics", metrics.SerializeToString())
    assert status == 200 and headers["content-type"] == PROTOBUF
    text = scrape(collector.metrics_url)
    assert value(text, "steptrace_collector_received_metric_points_total") == 3
    assert value(text, "steptrace_collector_requests_total", signal="metrics", transport="http") == 1


def test_exposition_passes_promtool_check_metrics(make_collector):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (Debian package 'prometheus')")
    c = make_collector(window_s=0.2)
    send(c, *[step_span(step=0, rank=r, compute=0.1 * (r + 1), bubble={"0": 0.5}) for r in range(3)])
    send(c, step_span(step=1, rank=0))
    assert wait_for(lambda: len(read_records(cluster_file(c))) == 2, 5)
    send(c, step_span(step=1, rank=1))  # late
    post(c.port, TRACES, b"\xff\xff garbage")
    text = scrape(c.metrics_url)
    assert "steptrace_cluster_straggler_rank" in text and "steptrace_collector_late_spans_total" in text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_runs_beyond_max_runs_leave_the_exposition(make_collector):
    # run_idle_s=0: an idle run gives its place up at once (the default keeps it 300 s; see test_collector_hostile).
    c = make_collector(max_runs=2, world_size=1, run_idle_s=0)
    for run_id in ("a", "b", "c"):
        send(c, step_span(run_id=run_id, world_size=1))
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_cluster_last_step", run_id="a") is None
    assert value(text, "steptrace_cluster_last_step", run_id="b") == 0
    assert value(text, "steptrace_cluster_last_step", run_id="c") == 0
    # The records are all written; only the exposition forgets.
    assert all(len(read_records(cluster_file(c, run))) == 1 for run in "abc")


def test_shutdown_flushes_open_steps(make_collector):
    c = make_collector()
    send(c, step_span(step=4, rank=0))
    c.close()
    [record] = read_records(cluster_file(c))
    assert (record["step"], record["reason"], record["missing_ranks"]) == (4, "shutdown", [1, 2])


def test_restarted_collector_does_not_write_a_step_twice(make_collector):
    first = make_collector()
    send(first, *[step_span(step=0, rank=r) for r in range(3)])
    first.close()
    second = make_collector(run_dir=first.config.run_dir)
    send(second, step_span(step=0, rank=1), step_span(step=1, rank=0))
    second.close()
    records = read_records(cluster_file(second))
    assert [(r["step"], r["reason"]) for r in records] == [(0, "all_ranks"), (1, "shutdown")]


# -- HTTP: answers and counted rejections -------------------------------------------------------------


def rejected(c: Collector, reason: str) -> float:
    return value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason=reason)


def test_bad_requests_get_their_status_and_are_counted(make_collector):
    c = make_collector(max_body_bytes=4096)
    good = body(step_span())
    cases = [
        (dict(path="/v1/logs", data=good), 404, "not_found"),
        (dict(path=TRACES, data=b"\x0a\x05\x0a\x03", content_type=PROTOBUF), 400, "malformed"),
        (dict(path=TRACES, data=b'{"resourceSpans": [', content_type=JSON), 400, "malformed"),
        (dict(path=TRACES, data=b'{"resourceSpans": 7}', content_type=JSON), 400, "malformed"),
        (dict(path=TRACES, data=good, content_type="text/plain"), 415, "unsupported_media_type"),
        (dict(path=TRACES, data=good, content_type=None), 415, "unsupported_media_type"),
        (dict(path=TRACES, data=b"x" * 5000), 413, "too_large"),
        (dict(path=TRACES, data=gzip.compress(b"\0" * 100_000), headers={"Content-Encoding": "gzip"}), 413,
         "too_large"),
        (dict(path=TRACES, data=good, headers={"Content-Encoding": "zstd"}), 415, "unsupported_encoding"),
    ]
    for kwargs, status, reason in cases:
        got, headers, data = post(c.port, kwargs.pop("path"), kwargs.pop("data"), **kwargs)
        assert got == status, (reason, data)
        assert rejected(c, reason) >= 1, reason
    # Errors carry a google.rpc.Status in the request's encoding.
    from google.rpc import status_pb2

    got, headers, data = post(c.port, TRACES, b"\x0a\x05\x0a\x03")
    assert got == 400 and headers["content-type"] == PROTOBUF
    assert "cannot decode" in status_pb2.Status.FromString(data).message
    got, headers, data = post(c.port, TRACES, b"[", JSON)
    assert got == 400 and "cannot decode" in json.loads(data)["message"]
    assert rejected(c, "malformed") == 5
    assert rejected(c, "too_large") == 2
    # A GET on the signal path is 405.
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=5)
    conn.request("GET", TRACES)
    assert conn.getresponse().status == 405
    conn.close()
    # None of it joined anything.
    assert read_records(cluster_file(c)) == []


def test_bearer_token_is_required_when_set(make_collector):
    c = make_collector(token="s3cret", world_size=1)
    data = body(step_span(world_size=1))
    assert post(c.port, TRACES, data)[0] == 401
    status, headers, _ = post(c.port, TRACES, data, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert post(c.port, TRACES, data, headers={"Authorization": "Basic s3cret"})[0] == 401
    assert rejected(c, "unauthorized") == 3
    assert read_records(cluster_file(c)) == []
    assert post(c.port, TRACES, data, headers={"Authorization": "Bearer s3cret"})[0] == 200
    assert len(read_records(cluster_file(c))) == 1


def test_token_comes_from_the_environment(monkeypatch):
    import argparse

    monkeypatch.setenv("STEPTRACE_COLLECTOR_TOKEN", "from-env")
    args = add_collector_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.token is None and args.host == "127.0.0.1" and args.port == 4318 and args.metrics_port == 9464
    # run_collector reads the variable when --token is absent; the CLI test starts it for real.


def test_gzip_and_json_requests_are_joined_with_matching_responses(collector):
    status, headers, data = post(collector.port, TRACES, gzip.compress(body(step_span(rank=0))),
                                 headers={"Content-Encoding": "gzip"})
    assert status == 200 and ExportTraceServiceResponse.FromString(data) == ExportTraceServiceResponse()
    status, headers, data = post(collector.port, TRACES, otlp_json(request(step_span(rank=1))), JSON)
    assert status == 200 and headers["content-type"] == JSON and json.loads(data) == {}
    status, _, _ = post(collector.port, TRACES, zlib.compress(otlp_json(request(step_span(rank=2)))), JSON,
                        headers={"Content-Encoding": "deflate"})
    assert status == 200
    [record] = read_records(cluster_file(collector))
    assert record["complete"] and record["ranks_reporting"] == 3


def test_invalid_spans_are_reported_as_partial_success(collector):
    response = send(collector, step_span(rank=0), step_span(rank=7), step_span(rank=1, drop=("train.step",)))
    assert response.partial_success.rejected_spans == 2
    assert "rank_out_of_range" in response.partial_success.error_message
    text = scrape(collector.metrics_url)
    assert value(text, "steptrace_collector_invalid_spans_total", reason="rank_out_of_range") == 1
    assert value(text, "steptrace_collector_invalid_spans_total", reason="missing_attribute") == 1


def test_a_bad_request_between_good_ones_loses_nothing(collector):
    send(collector, step_span(step=0, rank=0), step_span(step=1, rank=0))
    assert post(collector.port, TRACES, b"\x12\x34garbage")[0] == 400
    assert post(collector.port, TRACES, b"x" * 100, "text/plain")[0] == 415
    send(collector, step_span(step=0, rank=1), step_span(step=1, rank=1))
    assert post(collector.port, TRACES, gzip.compress(body(step_span()))[:20],
                headers={"Content-Encoding": "gzip"})[0] == 400
    send(collector, step_span(step=0, rank=2), step_span(step=1, rank=2))
    records = read_records(cluster_file(collector))
    assert [(r["step"], r["ranks_reporting"], r["complete"]) for r in records] == [(0, 3, True), (1, 3, True)]


def test_a_slow_client_does_not_block_others_and_times_out(make_collector):
    c = make_collector(request_timeout_s=1.0, world_size=1)
    slow = socket.create_connection(("127.0.0.1", c.port), timeout=5)
    try:
        slow.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 1000\r\n\r\nabc")
        started = time.monotonic()
        assert post(c.port, TRACES, body(step_span(world_size=1)))[0] == 200
        assert time.monotonic() - started < 1.0
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        slow.close()
    assert rejected(c, "timeout") == 1
    assert len(read_records(cluster_file(c))) == 1


def test_a_connection_beyond_the_limit_takes_back_one_without_a_request(make_collector):
    """Full, the collector takes back a connection that has not completed a request (once: 503 to the newcomer).

    The stalled one is closed and counted (``evicted``); when every slot is answering a
    request, the newcomer is the one refused (test_collector_hostile.py).
    """
    c = make_collector(max_connections=1, world_size=1)
    held = socket.create_connection(("127.0.0.1", c.port), timeout=5)
    try:
        held.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")  # headers not finished: holds the slot
        assert post(c.port, TRACES, body(step_span(world_size=1)))[0] == 200
        try:
            assert held.recv(4096) == b""
        except ConnectionResetError:
            pass
    finally:
        held.close()
    assert wait_for(lambda: rejected(c, "evicted") == 1)
    assert not rejected(c, "overloaded")
    assert len(read_records(cluster_file(c))) == 1


def test_missing_content_length_is_411(collector):
    conn = socket.create_connection(("127.0.0.1", collector.port), timeout=5)
    try:
        conn.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 411")
    finally:
        conn.close()
    assert rejected(collector, "length_required") == 1


# -- through steptrace's own exporter -----------------------------------------------------------------


def test_steptrace_exporter_over_http_gzip_and_grpc(make_collector, tmp_path):
    pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    c = make_collector(world_size=2, grpc_port=0)
    device = SimulatedDevice()
    dropped = []
    try:
        for rank, settings in ((0, dict(otlp_endpoint=c.endpoint, otlp_compression="gzip")),
                               (1, dict(otlp_endpoint=f"http://127.0.0.1:{c.grpc_port}", otlp_protocol="grpc"))):
            steptrace.init(run_id="own", rank=rank, world_size=2, jsonl=False, run_dir=str(tmp_path), **settings)
            for n in range(3):
                with steptrace.step(n) as s:
                    # Rank 1 stands out: 25 ms more than rank 0, clear of the 5 ms threshold (5 ms more
                    # would sit on it).
                    s.wait_for(device.run(0.005 if rank == 0 else 0.03))
            steptrace.shutdown()
            dropped.append(steptrace.stats().get("dropped"))
    finally:
        device.close()
    joined = wait_for(lambda: len(read_records(cluster_file(c, "own"))) == 3, 15)
    records = read_records(cluster_file(c, "own"))
    assert joined, (records, dropped, [line for line in scrape(c.metrics_url).splitlines() if "collector_" in line])
    assert [(r["step"], r["complete"], r["straggler_rank"]) for r in records] == [(0, True, 1), (1, True, 1),
                                                                                  (2, True, 1)]
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_collector_requests_total", signal="traces", transport="grpc") >= 1
    assert value(text, "steptrace_collector_requests_total", signal="traces", transport="http") >= 1


def test_grpc_token_is_checked(make_collector):
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    c = make_collector(world_size=1, grpc_port=0, token="tok")
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Export(request(step_span(world_size=1)), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.Export(request(step_span(world_size=1)), timeout=5, metadata=[("authorization", "Bearer tok")])
    assert rejected(c, "unauthorized") == 1
    assert len(read_records(cluster_file(c))) == 1


def test_grpc_reports_invalid_spans_as_partial_success(make_collector):
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    c = make_collector(grpc_port=0)
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        response = stub.Export(request(step_span(rank=0), step_span(rank=7), step_span(rank=1, drop=("train.step",))),
                               timeout=5)
    assert response.partial_success.rejected_spans == 2
    assert "rank_out_of_range" in response.partial_success.error_message


# -- fuzzing ---------------------------------------------------------------------------------------------


def decode_all(data: bytes, media: str, encoding: str | None, world_size: int | None = 3):
    """The receiver's pipeline without the socket: either a result or a Rejected with a 4xx status."""
    raw = decompress(data, encoding, 1 << 16)
    message = parse_request("traces", raw, media)
    return extract_steps(message, world_size)


def check_decodes_or_rejects(data: bytes, media: str, encoding: str | None = None) -> None:
    try:
        extracted = decode_all(data, media, encoding)
    except Rejected as exc:
        # bad_duration: a mutated double that decodes as no duration can be (1e307 s) refuses the export.
        assert 400 <= exc.status < 500 and exc.reason in ("malformed", "too_large", "bad_duration")
        return
    for s in extracted.steps:  # whatever decoded is usable by the join
        assert s.compute_seconds >= 0 and s.interval_seconds >= 0 and 0 <= s.rank < 3 and s.step >= 0
    Joiner(world_size=3).add(extracted.steps)


VALID = body(*[step_span(step=s, rank=r, compute=0.1 * r, bubble={"0": 0.5}) for s in range(2) for r in range(3)],
             step_span(name="train.compute"))
VALID_JSON = otlp_json(request(step_span(rank=0), step_span(rank=1, bubble={"1": 0.25})))
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(("flip", "delete", "insert", "truncate")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_as_protobuf_json_and_gzip(data):
    check_decodes_or_rejects(data, PROTOBUF)
    check_decodes_or_rejects(data, JSON)
    check_decodes_or_rejects(data, PROTOBUF, "gzip")


@FUZZ
@given(mutated(VALID))
def test_fuzz_mutated_protobuf(data):
    check_decodes_or_rejects(data, PROTOBUF)
    check_decodes_or_rejects(gzip.compress(data), PROTOBUF, "gzip")


@FUZZ
@given(mutated(VALID_JSON))
def test_fuzz_mutated_json(data):
    check_decodes_or_rejects(data, JSON)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                           lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.sampled_from(["resourceSpans", "scopeSpans", "spans", "attributes",
                                                              "key", "value", "intValue", "traceId", "name",
                                                              "stringValue", "doubleValue", "x"]), children,
                                             max_size=4), max_leaves=30)


@FUZZ
@given(JSON_VALUES)
def test_fuzz_json_documents(document):
    check_decodes_or_rejects(json.dumps(document).encode(), JSON)


def test_deeply_nested_payloads_are_rejected_not_crashing():
    check_decodes_or_rejects(b"[" * 100_000 + b"]" * 100_000, JSON)
    check_decodes_or_rejects(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JSON)
    # AnyValue nests (an array of arrays of ...): encoded by hand, protobuf would not build it.
    def field(number: int, payload: bytes) -> bytes:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload

    def payload(depth: int, name: str = "train.step") -> bytes:
        value = field(1, b"x")  # AnyValue.string_value
        for _ in range(depth):
            value = field(5, field(1, value))  # AnyValue.array_value -> ArrayValue.values
        attribute = field(1, b"train.attrs.deep") + field(2, value)  # KeyValue
        span_bytes = step_span(name=name).SerializeToString() + field(9, attribute)  # Span.attributes
        return field(1, field(2, field(2, span_bytes)))  # request.resource_spans.scope_spans.spans

    assert len(decode_all(payload(5), PROTOBUF, None).steps) == 1  # the hand encoding is right
    # Spans are decoded one by one: the step span that does not decode is skipped and counted.
    extracted = decode_all(payload(200), PROTOBUF, None)
    assert (extracted.steps, extracted.invalid, extracted.spans) == ([], {"bad_value": 1}, 1)
    # A span the collector does not use is never decoded at all.
    extracted = decode_all(payload(200, "train.microbatch") + payload(5), PROTOBUF, None)
    assert (len(extracted.steps), extracted.invalid, extracted.skipped) == (1, {}, 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=512), mutated(VALID)),
       content_type=st.sampled_from([PROTOBUF, JSON, "text/plain"]),
       encoding=st.sampled_from([None, "gzip", "identity"]))
def test_fuzz_http_never_500_and_the_server_lives(fuzz_collector, data, content_type, encoding):
    headers = {"Content-Encoding": encoding} if encoding else {}
    status, _, _ = post(fuzz_collector.port, TRACES, data, content_type, headers=headers)
    assert status in (200, 400, 413, 415)


@pytest.fixture(scope="module")
def fuzz_collector(tmp_path_factory):
    c = Collector(CollectorConfig(port=0, metrics_port=0, world_size=3, window_s=60.0,
                                  run_dir=str(tmp_path_factory.mktemp("fuzz")))).start()
    yield c
    # Still alive and joining after all of it.
    send(c, *[step_span(run_id="after-fuzz", step=0, rank=r) for r in range(3)])
    assert len(read_records(cluster_file(c, "after-fuzz"))) == 1
    assert value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason="internal") == 0
    c.close()


# -- the command line ----------------------------------------------------------------------------------


def test_command_line_serves_and_flushes_on_sigterm(tmp_path):
    env = {**os.environ, "STEPTRACE_COLLECTOR_TOKEN": "tok"}
    proc = subprocess.Popen([sys.executable, "-m", "steptrace", "collector", "--port", "0", "--metrics-port", "0",
                             "--world-size", "2", "--run-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("steptrace collector: otlp_http=127.0.0.1:"), line + proc.stderr.read()
        assert "auth=bearer" in line
        port = int(line.split("otlp_http=127.0.0.1:")[1].split()[0])
        assert post(port, TRACES, body(step_span(world_size=2)))[0] == 401
        assert post(port, TRACES, body(step_span(world_size=2)), headers={"Authorization": "Bearer tok"})[0] == 200
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    [record] = read_records(tmp_path / "run" / "cluster.jsonl")
    assert (record["reason"], record["missing_ranks"]) == ("shutdown", [1])


def test_command_line_port_in_use_is_a_clear_error(collector):
    result = subprocess.run([sys.executable, "-m", "steptrace.collector", "--port", str(collector.port),
                             "--metrics-port", "0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "port: cannot serve OTLP/HTTP" in result.stderr


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="window_s"):
        CollectorConfig(window_s=0)
    with pytest.raises(ValueError, match="world_size"):
        CollectorConfig(world_size=0)
    with pytest.raises(ValueError, match="token"):
        CollectorConfig(token="  ")


# -- exposed communication (NCCL collectives timed on the device) ------------------------------------

EXPOSED_ATTR = "train.exposed_communication_seconds"


def test_exposed_communication_is_joined_per_step_and_served_as_min_median_max():
    """The ranks' train.exposed_communication_seconds (docs/records.md) travel into the join: each step's
    min / median / max over the ranks that sent it, and steptrace_cluster_step_exposed_communication_seconds
    {stat} from the last complete step, as the wait in collectives is; a run whose ranks send none
    (no NCCL) has neither the fields nor the series."""
    from prometheus_client import generate_latest

    from steptrace.collector._metrics import ClusterMetrics

    exposed = {0: 0.30, 1: 0.02, 2: 0.25}
    spans = [step_span(run_id="nccl", step=n, rank=rank, compute=0.5, interval=1.0, world_size=3,
                       **{EXPOSED_ATTR: seconds + 0.1 * n})
             for n in range(2) for rank, seconds in exposed.items()]
    spans += [step_span(run_id="gloo", step=0, rank=rank, compute=0.5, interval=1.0, world_size=3)
              for rank in range(3)]
    decoded = extract_steps(request(*spans)).steps
    assert sorted(s.exposed_communication_seconds for s in decoded if s.run_id == "nccl" and s.step == 0) \
        == [0.02, 0.25, 0.30]
    records = {(r["run_id"], r["step"]): r for r in Joiner(world_size=3).add(decoded).records}
    for n in range(2):
        r = records[("nccl", n)]
        assert (r["exposed_communication_min_seconds"], r["exposed_communication_median_seconds"],
                r["exposed_communication_max_seconds"]) == (0.02 + 0.1 * n, 0.25 + 0.1 * n, 0.30 + 0.1 * n)
    assert records[("gloo", 0)]["exposed_communication_median_seconds"] is None
    # A rank's exposed communication is part of its step: a value past the interval is cut to it.
    (hostile,) = extract_steps(request(step_span(run_id="h", compute=0.5, interval=1.0, **{EXPOSED_ATTR: 5.0}))).steps
    assert hostile.exposed_communication_seconds == 1.0
    metrics = ClusterMetrics()
    metrics.publish(list(records.values()))
    text = generate_latest(metrics.registry).decode()
    name = "steptrace_cluster_step_exposed_communication_seconds"
    for stat, seconds in (("min", 0.12), ("median", 0.35), ("max", 0.40)):
        assert value(text, name, run_id="nccl", stat=stat) == pytest.approx(seconds)
    assert f'{name}{{run_id="gloo"' not in text


def test_exposed_communication_survives_the_journal_and_old_journal_lines_still_replay(tmp_path):
    """A restarted collector replays the open steps' spans from its journal with their exposed
    communication; a line written before the field existed replays without it."""
    import dataclasses

    from steptrace.collector._runlog import JOURNAL_FILE, ClusterLog

    log = ClusterLog(tmp_path)
    log.journal([dataclasses.replace(span(step=3, rank=r), exposed_communication_seconds=0.01 * (r + 1))
                 for r in range(2)])
    log.close()
    (journal,) = tmp_path.rglob(JOURNAL_FILE)
    lines = journal.read_text().splitlines()
    # The second rank's line as a collector before the field (and the fields after it) wrote it.
    from steptrace.collector._runlog import _SPAN_FIELDS

    at = _SPAN_FIELDS.index("exposed_communication_seconds")
    old = json.loads(lines[-1])
    assert old[at] == pytest.approx(0.02) and old[at + 1] is None
    journal.write_text("\n".join(lines[:-1] + [json.dumps(old[:at])]) + "\n")
    replayed = sorted(ClusterLog(tmp_path).replay(), key=lambda s: s.rank)
    assert [(s.rank, s.exposed_communication_seconds) for s in replayed] == [(0, 0.01), (1, None)]
