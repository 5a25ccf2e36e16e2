"""OTLP export: spans per step joined across ranks by trace id, resource, metrics, failure handling.

Everything runs through the public API against in-test OTLP receivers
(``tests/otlp_receiver.py``) and compares what arrived with the records a
:class:`MemorySink` got from the same run.
"""

import bisect
import math
import subprocess
import sys
import time

import pytest

pytest.importorskip("opentelemetry.sdk", reason="OTLP export needs opentelemetry-sdk (pip install 'steptrace[otlp]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="OTLP export needs opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")

import steptrace  # noqa: E402
from otlp_receiver import OtlpHttpReceiver  # noqa: E402
from prometheus_server import free_port  # noqa: E402
from steptrace import _ids  # noqa: E402
from steptrace._buckets import CHECKPOINT_BUCKETS_S, STEP_BUCKETS_S  # noqa: E402
from steptrace.otlp import OtlpSink, signal_endpoints  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

RUN = "r"
STATUS_UNSET, STATUS_ERROR = 0, 2
KIND_INTERNAL = 1  # OTLP's SPAN_KIND_INTERNAL


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    """The tests set the OTEL_* variables they need; the caller's environment must not leak in."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
                 "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
                 "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
                 "STEPTRACE_OTLP_TIMEOUT_S", "STEPTRACE_OTLP_METRICS_INTERVAL_S", "STEPTRACE_RANK", "RANK",
                 "STEPTRACE_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver():
    with OtlpHttpReceiver() as rx:
        yield rx


def ns(unix_seconds):
    """A record time (unix seconds) in integer nanoseconds, as documented in steptrace.otlp."""
    return round(unix_seconds * 1e9)


def train(device, *, steps=3, checkpoint_at=1, tail_span=True, **settings):
    """A small loop through the public API; returns the MemorySink that saw the same records."""
    memory = MemorySink()
    settings.setdefault("jsonl", False)
    settings.setdefault("run_id", RUN)
    settings.setdefault("otlp_metrics_interval_s", 0.2)
    steptrace.init(sinks=[memory], **settings)
    for n in range(steps):
        with steptrace.span("data", source="synthetic"):
            time.sleep(0.003)
        with steptrace.step(n, tokens=1000, flops=2e12, lr=0.1) as s:
            for kind in ("forward", "backward"):
                with steptrace.microbatch(0, stage=0, kind=kind) as mb:
                    mb.wait_for(device.run(0.002))
            s.wait_for(device.run(0.01))
        if n == checkpoint_at:
            with steptrace.checkpoint(n):
                time.sleep(0.02)
    if tail_span:
        with steptrace.span("eval"):
            time.sleep(0.002)
    assert steptrace.shutdown(timeout_s=10)
    return memory


def by_name(spans, name, rank=None):
    return [s for s in spans if s.name == name and (rank is None or s.attributes.get("train.rank") == rank)]


# -- traces ----------------------------------------------------------------------------------
SUMMARY = "train.microbatch_summary."


def pipeline(device, *, steps=3, **settings):
    """Steps of 3 microbatches x 2 chunks x forward/backward on stage 1, through the public API."""
    memory = MemorySink()
    steptrace.init(sinks=[memory], jsonl=False, run_id=RUN, **settings)
    for n in range(steps):
        with steptrace.step(n) as s:
            for kind in ("forward", "backward"):
                for chunk in (0, 1):
                    for i in range(3):
                        with steptrace.microbatch(i, stage=1, chunk=chunk, kind=kind) as mb:
                            mb.wait_for(device.run(0.001 * (i + 1)))
            s.wait_for(device.run(0.002))
    assert steptrace.shutdown(timeout_s=10)
    return memory


def summary_of(step_span):
    """{(stage, chunk, kind): {field: value}} from a train.step span's summary attributes."""
    out = {}
    for key, value in step_span.attributes.items():
        if key.startswith(SUMMARY):
            stage, chunk, kind, field = key[len(SUMMARY):].split(".")
            out.setdefault((stage, chunk, kind), {})[field] = value
    return out


def test_microbatch_summary_equals_the_spans_it_replaces(receiver, device):
    """Per (stage, chunk, kind): count, Σ/min/max compute, first start, last end of the step's microbatch spans."""
    memory = pipeline(device, otlp_endpoint=receiver.url, otlp_microbatch_spans="all")
    spans = receiver.spans()
    assert len(by_name(spans, "train.microbatch")) == len(memory.microbatches()) == 3 * 12
    for n in range(3):
        (step,) = [s for s in by_name(spans, "train.step") if s.attributes["train.step"] == n]
        expected = {}
        for mb in by_name(spans, "train.microbatch"):
            if mb.attributes["train.step"] != n:
                continue
            a = mb.attributes
            expected.setdefault((str(a["train.stage"]), str(a["train.chunk"]), a["train.kind"]), []).append(mb)
        summary = summary_of(step)
        assert set(summary) == set(expected) == {("1", str(c), k) for c in (0, 1) for k in ("forward", "backward")}
        for key, group in expected.items():
            computes = [m.attributes["train.compute_seconds"] for m in group]
            got = summary[key]
            assert got["count"] == len(group) == 3
            assert got["compute_seconds_sum"] == pytest.approx(sum(computes), rel=1e-12)
            assert got["compute_seconds_min"] == min(computes) and got["compute_seconds_max"] == max(computes)
            assert ns(got["first_start_time"]) == min(m.start_ns for m in group)
            assert ns(got["last_end_time"]) == max(m.end_ns for m in group)


def test_microbatch_spans_are_opt_in_and_sampled_every_n_steps(receiver, device):
    """Default: no train.microbatch span, the summary only; every:2 sends spans of steps 0 and 2."""
    pipeline(device, otlp_endpoint=receiver.url)
    spans = receiver.spans()
    assert by_name(spans, "train.microbatch") == []
    steps = by_name(spans, "train.step")
    assert len(steps) == 3 and all(sum(v["count"] for v in summary_of(s).values()) == 12 for s in steps)
    receiver.requests.clear()
    pipeline(device, otlp_endpoint=receiver.url, otlp_microbatch_spans="every:2")
    sent = by_name(receiver.spans(), "train.microbatch")
    assert sorted({s.attributes["train.step"] for s in sent}) == [0, 2] and len(sent) == 24


def test_microbatch_summary_keys_per_step_are_bounded(receiver, device):
    """40 distinct chunks in one step: 32 summarised by name, the other 8 summed under other.other.other."""
    steptrace.init(jsonl=False, run_id=RUN, otlp_endpoint=receiver.url)
    with steptrace.step(0) as s:
        for chunk in range(40):
            with steptrace.microbatch(0, stage=0, chunk=chunk) as mb:
                mb.wait_for(device.run(0.0005))
        s.wait_for(device.run(0.001))
    assert steptrace.shutdown(timeout_s=10)
    (step,) = by_name(receiver.spans(), "train.step")
    summary = summary_of(step)
    assert len(summary) == 33 and summary[("other", "other", "other")]["count"] == 8
    assert sum(v["count"] for v in summary.values()) == 40


@pytest.mark.parametrize("value", ["some", "every:0", "every:x", "every:"])
def test_bad_microbatch_spans_setting_fails_at_init(value, monkeypatch):
    with pytest.raises(ValueError, match="otlp_microbatch_spans"):
        steptrace.init(jsonl=False, run_id=RUN, otlp_microbatch_spans=value)
    monkeypatch.setenv("STEPTRACE_OTLP_MICROBATCH_SPANS", value)
    with pytest.raises(ValueError, match="STEPTRACE_OTLP_MICROBATCH_SPANS"):
        steptrace.init(jsonl=False, run_id=RUN)


def test_ranks_share_the_step_trace_id_and_have_distinct_span_ids(receiver, device):
    """Two ranks of one run: trace id = _ids.trace_id(run_id, step) on both, span ids differ."""
    records = {rank: train(device, otlp_endpoint=receiver.url, rank=rank, world_size=2) for rank in (0, 1)}
    spans = receiver.spans()
    for n in range(3):
        steps = {rank: by_name(spans, "train.step", rank)[n] for rank in (0, 1)}
        for rank, span in steps.items():
            assert span.attributes["train.step"] == n
            assert span.trace_id == _ids.trace_id(RUN, n)
            assert f"{span.trace_id:032x}" == records[rank].steps()[n]["trace_id"]
            assert span.span_id == _ids.span_id(RUN, n, rank, "step")
        assert steps[0].trace_id == steps[1].trace_id
        assert steps[0].span_id != steps[1].span_id
        compute = {rank: [s for s in by_name(spans, "train.compute", rank) if s.attributes["train.step"] == n][0]
                   for rank in (0, 1)}
        assert compute[0].span_id != compute[1].span_id
    assert len({s.span_id for s in spans}) == len(spans)  # no span id used twice across ranks and roles


def test_span_tree_parentage_and_record_times(receiver, device):
    """Step span covers [end - interval, end]; compute/idle/microbatch/checkpoint/user spans are its children."""
    memory = train(device, otlp_endpoint=receiver.url, rank=0, otlp_microbatch_spans="all")
    spans = receiver.spans()
    step_records = memory.steps()
    assert len(by_name(spans, "train.step")) == 3
    for r in step_records:
        n = r["step"]
        trace = _ids.trace_id(RUN, n)
        in_trace = [s for s in spans if s.trace_id == trace]
        (step,) = by_name(in_trace, "train.step")
        assert step.parent_span_id is None
        assert step.end_ns == ns(r["end_time"])
        assert step.start_ns == ns(r["end_time"] - r["interval_seconds"])
        (compute,) = by_name(in_trace, "train.compute")
        assert compute.parent_span_id == step.span_id
        assert (compute.start_ns, compute.end_ns) == (ns(r["start_time"]), ns(r["end_time"]))
        idle = sorted(by_name(in_trace, "train.idle"), key=lambda s: s.start_ns)
        assert [(s.attributes["train.idle.reason"], s.start_ns, s.end_ns) for s in idle] == [
            (reason, ns(start), ns(end)) for reason, start, end in r["idle_segments"]]
        assert all(s.parent_span_id == step.span_id for s in idle)
        microbatches = by_name(in_trace, "train.microbatch")
        mb_records = [m for m in memory.microbatches() if m["step"] == n]
        assert len(microbatches) == len(mb_records) == 2
        for span, rec in zip(sorted(microbatches, key=lambda s: s.start_ns), mb_records):
            assert span.parent_span_id == step.span_id
            assert (span.start_ns, span.end_ns) == (ns(rec["start_time"]), ns(rec["end_time"]))
            assert span.attributes["train.kind"] == rec["kind"] and span.attributes["train.stage"] == 0
            assert span.attributes["train.microbatch"] == 0
        for s in in_trace:
            assert s.kind == KIND_INTERNAL and s.scope == "steptrace" and s.scope_version == steptrace.__version__
    # Steps tile the run: each step span starts where the previous one ended (to float precision).
    step_spans = sorted(by_name(spans, "train.step"), key=lambda s: s.start_ns)
    for before, after in zip(step_spans, step_spans[1:]):
        assert abs(after.start_ns - before.end_ns) <= 1000

    # `data` closes before `with step(n)`: a step-less span record, exported as a child of step n.
    data_records = [s for s in memory.spans() if s["name"] == "data"]
    assert [s["step"] for s in data_records] == [None, None, None]
    for n, rec in enumerate(data_records):
        (span,) = [s for s in by_name(spans, "data") if s.start_ns == ns(rec["start_time"])]
        assert span.trace_id == _ids.trace_id(RUN, n)
        assert span.parent_span_id == _ids.span_id(RUN, n, 0, "step")
        assert span.end_ns == ns(rec["end_time"])
        assert span.attributes["train.attrs.source"] == "synthetic"

    (ckpt_record,) = memory.checkpoints()
    (ckpt,) = by_name(spans, "train.checkpoint")
    assert ckpt.trace_id == _ids.trace_id(RUN, 1) and ckpt.parent_span_id == _ids.span_id(RUN, 1, 0, "step")
    assert (ckpt.start_ns, ckpt.end_ns) == (ns(ckpt_record["start_time"]), ns(ckpt_record["end_time"]))
    assert ckpt.attributes["train.checkpoint.blocking_seconds"] == ckpt_record["blocking_seconds"]
    assert ckpt.attributes["train.checkpoint.host_seconds"] == ckpt_record["host_seconds"]
    assert ckpt.attributes["train.checkpoint.after_step"] == ckpt_record["after_step"] == 1
    assert "train.checkpoint.async_seconds" not in ckpt.attributes  # None values are left out

    # `eval` closes after the last step: a root span in a trace of its own.
    (tail,) = by_name(spans, "eval")
    assert tail.parent_span_id is None
    assert tail.trace_id not in {_ids.trace_id(RUN, n) for n in range(4)}


def test_step_span_attributes_and_error_status(receiver, device):
    """train.* attributes equal the record's fields; a failed step's span has status ERROR with the text."""
    memory = MemorySink()
    steptrace.init(sinks=[memory], otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, rank=1, world_size=4,
                   peak_tflops=500.0)
    with steptrace.step(0, tokens=4096, flops=3 * 10**19, lr=0.5, tag="warmup") as s:  # flops beyond int64
        s.log(loss=2.5)
        s.wait_for(device.run(0.01))
    with pytest.raises(RuntimeError, match="boom"):
        with steptrace.step(1) as s:
            s.wait_for(device.run(0.005))
            raise RuntimeError("boom")
    steptrace.shutdown(timeout_s=10)
    ok, failed = memory.steps()
    spans = by_name(receiver.spans(), "train.step")
    (span,) = [s for s in spans if s.attributes["train.step"] == 0]
    a = span.attributes
    assert (a["train.run_id"], a["train.rank"], a["train.world_size"]) == (RUN, 1, 4)
    assert (a["train.status"], a["train.backend"]) == ("ok", "simulated")
    for field in ("interval_seconds", "compute_seconds", "idle_seconds", "tokens_per_second", "tflops_per_second",
                  "mfu"):
        assert a[f"train.{field}"] == pytest.approx(ok[field], rel=1e-12), field
    assert a["train.tokens"] == 4096 and a["train.flops"] == pytest.approx(3e19)
    assert a["train.mfu"] == pytest.approx(ok["tflops_per_second"] / 500.0)
    # the parts travel with the ratio
    assert a["train.model_flops"] == pytest.approx(3e19) and a["train.peak_flops"] == 500e12
    assert "train.hardware_flops" not in a and "train.flops_source" not in a and "train.hfu" not in a
    assert a["train.attrs.lr"] == 0.5 and a["train.attrs.tag"] == "warmup"
    assert a["train.scalar.loss"] == 2.5
    for reason, seconds in ok["idle_breakdown"].items():
        assert a[f"train.idle.{reason}_seconds"] == seconds
    assert "train.samples" not in a and "train.samples_per_second" not in a  # None is skipped
    assert span.status_code == STATUS_UNSET

    (bad,) = [s for s in spans if s.attributes["train.step"] == 1]
    assert bad.status_code == STATUS_ERROR and bad.status_message == failed["error"] == "RuntimeError: boom"
    assert bad.attributes["train.status"] == "error" and bad.attributes["train.error"] == "RuntimeError: boom"


def test_same_records_exported_twice_give_the_same_span_ids(receiver, device):
    """Span ids are deterministic, so a retried or replayed batch does not create new spans."""
    memory = train(device, otlp_endpoint=receiver.url, rank=0, tail_span=False)
    records = [r for r in memory.records if r["type"] != "run"]
    first = {(s.trace_id, s.span_id) for s in receiver.spans()}
    sink = OtlpSink(receiver.url, run_id=RUN, rank=0)
    try:
        sink.export(records)
        sink.export(records)
    finally:
        sink.shutdown(5)
    requests = receiver.trace_requests()
    replayed = [{(int.from_bytes(s.trace_id, "big"), int.from_bytes(s.span_id, "big"))
                 for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans} for req in requests[-2:]]
    assert replayed[0] == replayed[1] == first


# -- resource --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, code, service_name",
    [
        ({}, {}, "steptrace"),
        ({"OTEL_SERVICE_NAME": "trainer"}, {}, "trainer"),
        ({"OTEL_SERVICE_NAME": "trainer"}, {"service_name": "coded"}, "coded"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs"}, {}, "from-attrs"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs", "OTEL_SERVICE_NAME": "trainer"}, {}, "trainer"),
    ],
)
def test_resource_service_name(receiver, device, monkeypatch, env, code, service_name):
    """service.name: code, else OTEL_SERVICE_NAME, else OTEL_RESOURCE_ATTRIBUTES, else 'steptrace'."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, rank=0, **code)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.shutdown(timeout_s=10)
    (span,) = receiver.spans()[:1]
    assert span.resource["service.name"] == service_name


def test_resource_keeps_otel_resource_attributes_but_sets_its_instance_id(receiver, device, monkeypatch):
    """All ranks share OTEL_RESOURCE_ATTRIBUTES, so service.instance.id is always <run_id>/rank-<rank>.

    Also: OTEL_EXPORTER_OTLP_ENDPOINT alone turns the exporter on.
    """
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml,service.instance.id=bogus")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    steptrace.init(jsonl=False, run_id=RUN, rank=3, world_size=8, otlp_metrics_interval_s=0.2)
    assert steptrace.stats()["endpoints"]["otlp"] == receiver.url + "/v1/traces"
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.shutdown(timeout_s=10)
    spans = receiver.spans()
    assert spans
    for span in spans:
        assert span.resource["service.instance.id"] == f"{RUN}/rank-3"
        assert span.resource["deployment.environment"] == "test" and span.resource["team"] == "ml"
        assert span.resource["service.name"] == "steptrace"
    (resource, _metric) = receiver.metrics("steptrace.steps")[-1]
    assert resource["service.instance.id"] == f"{RUN}/rank-3" and resource["team"] == "ml"


# -- transport settings ------------------------------------------------------------------------
def test_headers_and_gzip_compression_arrive(receiver, device):
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, otlp_compression="gzip",
                   otlp_headers={"Authorization": "Bearer t0k", "x-team": "ml"}, otlp_metrics_interval_s=0.2)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.shutdown(timeout_s=10)
    for path in ("/v1/traces", "/v1/metrics"):
        received = receiver.of(path)
        assert received, path
        for request in received:
            assert request.headers["content-encoding"] == "gzip"
            assert request.body[:2] == b"\x1f\x8b"  # gzip magic: the body really is compressed
            assert request.headers["authorization"] == "Bearer t0k" and request.headers["x-team"] == "ml"
            assert request.headers["content-type"] == "application/x-protobuf"
    assert by_name(receiver.spans(), "train.step")[0].trace_id == _ids.trace_id(RUN, 0)


def test_headers_from_the_environment_and_gzip_by_default(receiver, device, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=env%20team")
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.shutdown(timeout_s=10)
    (request,) = receiver.of("/v1/traces")
    assert request.headers["x-team"] == "env team"
    assert request.headers["content-encoding"] == "gzip" and request.body[:2] == b"\x1f\x8b"


def test_compression_none_sends_plain_protobuf(receiver, device, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "none")
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.shutdown(timeout_s=10)
    (request,) = receiver.of("/v1/traces")
    assert "content-encoding" not in request.headers and request.body[:2] != b"\x1f\x8b"


@pytest.mark.parametrize(
    "endpoint, traces, metrics",
    [
        ("http://h:4318", "http://h:4318/v1/traces", "http://h:4318/v1/metrics"),
        ("http://h:4318/", "http://h:4318/v1/traces", "http://h:4318/v1/metrics"),
        ("https://h/otlp", "https://h/otlp/v1/traces", "https://h/otlp/v1/metrics"),
        ("http://h:4318/v1/traces", "http://h:4318/v1/traces", "http://h:4318/v1/metrics"),
        ("http://h:4318/v1/metrics", "http://h:4318/v1/traces", "http://h:4318/v1/metrics"),
    ],
)
def test_http_signal_endpoints(endpoint, traces, metrics):
    assert signal_endpoints(endpoint) == (traces, metrics)


def test_grpc_endpoint_is_scheme_host_port():
    assert signal_endpoints("http://h:4317/anything", "grpc") == ("http://h:4317", "http://h:4317")


def test_bad_settings_fail_at_construction_naming_the_field():
    with pytest.raises(ValueError, match="otlp_endpoint"):
        OtlpSink("127.0.0.1:4318", run_id=RUN)
    with pytest.raises(ValueError, match="otlp_protocol"):
        OtlpSink("http://127.0.0.1:4318", run_id=RUN, protocol="http/json")
    with pytest.raises(ValueError, match="otlp_compression"):
        OtlpSink("http://127.0.0.1:4318", run_id=RUN, compression="zstd")
    with pytest.raises(ValueError, match="otlp_timeout_s"):
        OtlpSink("http://127.0.0.1:4318", run_id=RUN, timeout_s=0)


def test_grpc_protocol(device):
    """otlp_protocol='grpc' sends the same spans and metrics over OTLP/gRPC, with headers as metadata."""
    pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="needs opentelemetry-exporter-otlp-proto-grpc")
    from otlp_receiver import OtlpGrpcReceiver

    with OtlpGrpcReceiver() as rx:
        steptrace.init(otlp_endpoint=rx.url, otlp_protocol="grpc", otlp_headers={"X-Team": "ml"},
                       otlp_compression="gzip", jsonl=False, run_id=RUN, rank=2, world_size=4,
                       otlp_metrics_interval_s=0.2)
        for n in range(2):
            with steptrace.step(n, tokens=10) as s:
                s.wait_for(device.run(0.002))
        steptrace.shutdown(timeout_s=10)
        steps = by_name(rx.spans(), "train.step")
        assert [s.trace_id for s in steps] == [_ids.trace_id(RUN, 0), _ids.trace_id(RUN, 1)]
        assert [s.span_id for s in steps] == [_ids.span_id(RUN, n, 2, "step") for n in range(2)]
        assert steps[0].resource["service.instance.id"] == f"{RUN}/rank-2"
        assert rx.of("/v1/traces")[0].headers["x-team"] == "ml"
        assert rx.last_metric("steptrace.steps").sum.data_points[0].as_int == 2


# -- metrics ---------------------------------------------------------------------------------
def point_attrs(point):
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in point.attributes}


def test_metrics_values_and_second_buckets(receiver, device):
    """Histograms use second bounds; counts, sums and gauges equal what the records say."""
    with pytest.warns(steptrace.SteptraceWarning):
        memory = MemorySink()
        steptrace.init(sinks=[memory], otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, rank=1, world_size=2,
                       peak_tflops=100.0, goodput_window_steps=2, otlp_metrics_interval_s=0.2)
        for n in range(4):
            with steptrace.span("data"):
                time.sleep(0.015)  # longer than the device work: the device waits, idle charged to data
            with steptrace.step(n, tokens=1000, flops=1e11) as s:
                for kind in ("forward", "backward"):
                    with steptrace.microbatch(n, stage=0, kind=kind) as mb:
                        mb.wait_for(device.run(0.002))
                s.wait_for(device.run(0.005))
            if n == 2:
                with steptrace.checkpoint(n):
                    time.sleep(0.01)
        steptrace.step(1)  # misuse: not increasing; dropped and counted under "misuse"
        assert steptrace.shutdown(timeout_s=10)
    steps = memory.steps()

    def histogram(name):
        metric = receiver.last_metric(name)
        assert metric is not None and metric.unit == "s", name
        return metric.histogram.data_points

    (interval,) = histogram("steptrace.step.interval")
    assert list(interval.explicit_bounds) == list(STEP_BUCKETS_S)  # seconds, not the SDK's millisecond defaults
    assert interval.count == 4
    assert interval.sum == pytest.approx(sum(r["interval_seconds"] for r in steps), rel=1e-9)
    expected = [0] * (len(STEP_BUCKETS_S) + 1)
    for r in steps:
        expected[bisect.bisect_left(STEP_BUCKETS_S, r["interval_seconds"])] += 1
    assert list(interval.bucket_counts) == expected
    assert point_attrs(interval) == {"train.run_id": RUN, "train.rank": 1}
    (compute,) = histogram("steptrace.step.compute")
    assert compute.count == 4 and compute.sum == pytest.approx(sum(r["compute_seconds"] for r in steps), rel=1e-9)
    (blocking,) = histogram("steptrace.checkpoint.blocking")
    assert list(blocking.explicit_bounds) == list(CHECKPOINT_BUCKETS_S)
    assert blocking.count == 1 and blocking.sum == pytest.approx(memory.checkpoints()[0]["blocking_seconds"])
    # Microbatches: a sum and a count per (stage, kind), not a histogram point per microbatch.
    mb_sum = {point_attrs(p)["train.kind"]: p.as_double
              for p in receiver.last_metric("steptrace.microbatch.compute").sum.data_points}
    mb_count = {point_attrs(p)["train.kind"]: p.as_int
                for p in receiver.last_metric("steptrace.microbatches").sum.data_points}
    assert mb_count == {"forward": 4, "backward": 4}
    for kind in ("forward", "backward"):
        assert mb_sum[kind] == pytest.approx(
            math.fsum(m["compute_seconds"] for m in memory.microbatches() if m["kind"] == kind), rel=1e-9)
    assert {point_attrs(p)["train.stage"] for p in receiver.last_metric("steptrace.microbatches").sum.data_points} \
        == {"0"}

    (steps_point,) = receiver.last_metric("steptrace.steps").sum.data_points
    assert steps_point.as_int == 4 and point_attrs(steps_point)["train.status"] == "ok"
    (tokens,) = receiver.last_metric("steptrace.tokens").sum.data_points
    assert tokens.as_int == 4000
    idle = {point_attrs(p)["train.idle.reason"]: p.as_double
            for p in receiver.last_metric("steptrace.step.idle").sum.data_points}
    expected_idle = {}
    for r in steps:
        for reason, seconds in r["idle_breakdown"].items():
            if seconds > 0:
                expected_idle[reason] = expected_idle.get(reason, 0.0) + seconds
    assert "data" in expected_idle and idle.keys() == expected_idle.keys()
    for reason, seconds in expected_idle.items():
        assert idle[reason] == pytest.approx(seconds, rel=1e-9)

    def gauge(name):
        (point,) = receiver.last_metric(name).gauge.data_points
        return point.as_double

    last = steps[-1]
    assert gauge("steptrace.tokens_per_second") == pytest.approx(last["tokens_per_second"])
    assert gauge("steptrace.tflops_per_second") == pytest.approx(last["tflops_per_second"])
    assert gauge("steptrace.mfu") == pytest.approx(last["mfu"])
    assert gauge("steptrace.peak_flops") == pytest.approx(last["peak_flops"])
    # Goodput (docs/goodput.md): the report's own figure for this process, and its two parts.
    from steptrace.analysis.goodput import job_accounting

    job = job_accounting(memory.records)
    assert gauge("steptrace.goodput_ratio") == pytest.approx(job["goodput"], rel=1e-9)
    (productive,) = receiver.last_metric("steptrace.productive").sum.data_points
    (wall,) = receiver.last_metric("steptrace.wall").sum.data_points
    assert productive.as_double == pytest.approx(job["productive_seconds"], rel=1e-9)
    assert wall.as_double == pytest.approx(job["total_seconds"], rel=1e-9)
    (bubble,) = receiver.last_metric("steptrace.pipeline.bubble_ratio").gauge.data_points
    assert point_attrs(bubble)["train.stage"] == "0"
    assert bubble.as_double == pytest.approx(last["pipeline_bubble_ratio"]["0"])
    dropped = {point_attrs(p)["train.drop.reason"]: p.as_int
               for p in receiver.last_metric("steptrace.dropped_records").sum.data_points}
    assert dropped == {"misuse": 1}
    # Every point of every metric carries the run and the rank.
    for request in receiver.metric_requests():
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    data = getattr(m, m.WhichOneof("data"))
                    for p in data.data_points:
                        attrs = point_attrs(p)
                        assert (attrs["train.run_id"], attrs["train.rank"]) == (RUN, 1), m.name


def test_metrics_are_exported_periodically_while_training(receiver, device):
    """With otlp_metrics_interval_s=0.2, metrics arrive during the run, not only at shutdown."""
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, otlp_metrics_interval_s=0.2)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    assert receiver.wait_for(lambda: receiver.last_metric("steptrace.steps") is not None, timeout_s=10)
    steptrace.shutdown(timeout_s=10)


# -- failure -----------------------------------------------------------------------------------
def timed_loop(device, steps=200):
    start = time.perf_counter()
    for n in range(steps):
        with steptrace.step(n) as s:
            time.sleep(0.002)  # host work of the step
            s.wait_for(device.run(0.0005))
    return time.perf_counter() - start


def test_hanging_endpoint_does_not_slow_training_and_shutdown_keeps_its_timeout(device):
    """The endpoint sleeps 30 s per request: the loop keeps its speed, drops are counted, shutdown is bounded."""
    settings = dict(jsonl=False, run_id=RUN, max_queue=64, otlp_metrics_interval_s=0.2)
    steptrace.init(**settings)
    baseline = timed_loop(device)
    steptrace.shutdown(timeout_s=10)

    with OtlpHttpReceiver(hang_s=30) as rx:
        memory = MemorySink()
        steptrace.init(sinks=[memory], otlp_endpoint=rx.url, **settings)
        with_hang = timed_loop(device)
        start = time.monotonic()
        steptrace.shutdown(timeout_s=2)
        shutdown_s = time.monotonic() - start
    assert with_hang < 3 * baseline, f"loop {with_hang:.3f} s with a hanging endpoint, {baseline:.3f} s without OTLP"
    assert shutdown_s < 4.0
    (run,) = memory.of_type("run")
    assert run["dropped"].get("sink:otlp", 0) > 0  # the queue filled behind the hanging export
    assert len(memory.steps()) == 200  # other sinks are not affected


def test_flush_keeps_its_timeout_while_the_endpoint_hangs(device):
    with OtlpHttpReceiver(hang_s=30) as rx:
        steptrace.init(otlp_endpoint=rx.url, jsonl=False, run_id=RUN, otlp_metrics_interval_s=0.2)
        with steptrace.step(0) as s:
            s.wait_for(device.run(0.001))
        with steptrace.span("eval"):
            pass
        start = time.monotonic()
        assert steptrace.flush(timeout_s=1) is False
        assert time.monotonic() - start < 3.0
        start = time.monotonic()
        steptrace.shutdown(timeout_s=1)
        assert time.monotonic() - start < 3.0


def test_endpoint_down_counts_drops_and_raises_nothing(device):
    """Nothing listens: every record sent to OTLP is counted under sink:otlp; training is unaffected.
    (The metadata and attempt records are not sent over OTLP: their facts are the resource's.)"""
    memory = MemorySink()
    steptrace.init(sinks=[memory], otlp_endpoint=f"http://127.0.0.1:{free_port()}", otlp_timeout_s=1,
                   jsonl=False, run_id=RUN, otlp_metrics_interval_s=0.2)
    for n in range(3):
        with steptrace.span("data"):
            pass
        with steptrace.step(n) as s:
            s.wait_for(device.run(0.002))
    steptrace.flush(timeout_s=10)
    # The attempt record is not sent either: its attempt number is on the resource.
    exported = len([r for r in memory.records if r["type"] not in ("metadata", "attempt")])
    assert steptrace.stats()["dropped"] == {"sink:otlp": exported}
    start = time.monotonic()
    steptrace.shutdown(timeout_s=5)
    assert time.monotonic() - start < 7.0
    (run,) = memory.of_type("run")
    assert run["dropped"] == {"sink:otlp": exported}
    assert run["steps"] == 3


def test_refusing_endpoint_counts_drops(device):
    """503 (retryable) until the export timeout: the batch is counted as dropped."""
    with OtlpHttpReceiver(status=503) as rx:
        memory = MemorySink()
        steptrace.init(sinks=[memory], otlp_endpoint=rx.url, otlp_timeout_s=1, jsonl=False, run_id=RUN,
                       otlp_metrics_interval_s=30)
        with steptrace.step(0) as s:
            s.wait_for(device.run(0.002))
        steptrace.flush(timeout_s=10)
        assert steptrace.stats()["dropped"] == {"sink:otlp": 1}
        steptrace.shutdown(timeout_s=5)
        assert any(r.path == "/v1/traces" for r in rx.requests)


# -- packaging -----------------------------------------------------------------------------
def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_import_steptrace_does_not_import_opentelemetry():
    result = run_python(
        "import sys, steptrace\n"
        "steptrace.init(jsonl=False, run_id='r')\n"
        "with steptrace.step(0):\n    pass\n"
        "steptrace.shutdown()\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_missing_opentelemetry_says_which_pip_install_fixes_it():
    result = run_python(
        "import sys\n"
        "sys.modules['opentelemetry'] = None\n"
        "import steptrace\n"
        "try:\n"
        "    steptrace.init(otlp_endpoint='http://127.0.0.1:4318', jsonl=False, run_id='r')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    assert result.returncode == 0, result.stderr
    assert "pip install 'steptrace[otlp]'" in result.stdout


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
# JAX (imported by other tests in this process) warns about fork; the child only sleeps and
# calls os._exit, touching no lock another thread could hold.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_forked_children_do_not_export_metrics(receiver, device):
    """A forked child (a DataLoader worker) must not export frozen copies of this rank's metrics."""
    import os

    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, otlp_metrics_interval_s=0.05)
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    steptrace.flush(timeout_s=10)
    pid = os.fork()
    if pid == 0:  # the child: idle for many metric intervals, then leave without cleanup
        time.sleep(1.0)
        os._exit(0)
    steptrace.shutdown(timeout_s=10)
    after_shutdown = len(receiver.of("/v1/metrics"))
    os.waitpid(pid, 0)
    assert len(receiver.of("/v1/metrics")) == after_shutdown


def test_a_record_the_otlp_sink_cannot_encode_costs_that_record_alone(receiver):
    """One bad record used to fail its whole batch (20 steps lost for one circular value)."""
    from steptrace._sinks import SinkWorker

    counts = {}
    sink = OtlpSink(receiver.url, run_id=RUN, metrics_interval_s=30)
    worker = SinkWorker(sink, 1024, lambda reason, n=1: counts.__setitem__(reason, counts.get(reason, 0) + n))
    good = {"type": "step", "step": 0, "status": "ok", "start_time": 1.0, "end_time": 2.0,
            "interval_seconds": 1.0, "compute_seconds": 1.0, "attrs": {}}
    broken = dict(good, step=1)
    del broken["end_time"]
    worker.offer([good, broken, dict(good, step=2)])
    assert worker.flush(time.monotonic() + 10)
    worker.stop(time.monotonic() + 5)
    assert counts == {"invalid:otlp": 1}
    assert sorted({s.attributes["train.step"] for s in by_name(receiver.spans(), "train.step")}) == [0, 2]


def test_circular_and_nested_attrs_are_exported_as_text(receiver, device):
    cycle = []
    cycle.append(cycle)
    steptrace.init(otlp_endpoint=receiver.url, jsonl=False, run_id=RUN, otlp_metrics_interval_s=30)
    with steptrace.step(0, cycle=cycle, nested=[[1, 2], [3]], mixed=[1, "a"], flat=[1, 2]) as s:
        s.wait_for(device.run(0.0001))
    assert steptrace.shutdown(timeout_s=10)
    assert steptrace.stats()["dropped"] == {}
    (step,) = by_name(receiver.spans(), "train.step")
    assert step.attributes["train.attrs.cycle"] == "[[...]]"
    assert step.attributes["train.attrs.nested"] == "[[1, 2], [3]]"
    assert step.attributes["train.attrs.mixed"] == "[1, 'a']"
    assert tuple(step.attributes["train.attrs.flat"]) == (1, 2)


class _BatchRecorder:
    """A sink that keeps each batch it is handed and asks the worker to gather for ``batch_delay_s``."""

    name = "recorder"

    def __init__(self, batch_delay_s):
        self.batch_delay_s = batch_delay_s
        self.batches = []

    def export(self, records):
        self.batches.append(list(records))

    def force_flush(self, timeout_s):
        return True


def _worker(sink):
    from steptrace._sinks import SinkWorker

    drops = {}
    return SinkWorker(sink, 100_000, lambda reason, n: drops.__setitem__(reason, drops.get(reason, 0) + n)), drops


def test_a_batching_sink_gets_several_steps_in_one_export_and_a_flush_does_not_wait_for_the_delay():
    """A 60 s delay: three offers stay queued until flush(), which exports them as one batch at once."""
    sink = _BatchRecorder(60.0)
    worker, drops = _worker(sink)
    for n in range(3):
        worker.offer([{"type": "step", "step": n}])
    time.sleep(0.3)
    assert sink.batches == []  # gathering
    assert worker.flush(time.monotonic() + 10)  # a 10 s deadline: it cannot have waited the 60 s delay
    assert [[r["step"] for r in batch] for batch in sink.batches] == [[0, 1, 2]]
    assert worker.stop(time.monotonic() + 10) and drops == {}


def test_a_batching_sink_gets_a_full_batch_without_waiting_and_the_rest_at_stop():
    from steptrace._sinks import _BATCH_RECORDS

    sink = _BatchRecorder(60.0)
    worker, drops = _worker(sink)
    worker.offer([{"type": "microbatch", "step": 0, "i": i} for i in range(_BATCH_RECORDS + 5)])
    deadline = time.monotonic() + 10
    while not sink.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [len(b) for b in sink.batches] == [_BATCH_RECORDS]  # a full batch goes; the 5 left wait
    assert worker.stop(time.monotonic() + 10)
    assert [len(b) for b in sink.batches] == [_BATCH_RECORDS, 5] and drops == {}


def test_without_a_batch_delay_each_offer_is_exported_as_it_comes():
    sink = _BatchRecorder(0.0)
    worker, _ = _worker(sink)
    for n in range(3):
        worker.offer([{"type": "step", "step": n}])
        deadline = time.monotonic() + 10
        while len(sink.batches) <= n and time.monotonic() < deadline:
            time.sleep(0.005)
    assert [[r["step"] for r in batch] for batch in sink.batches] == [[0], [1], [2]]
    worker.stop(time.monotonic() + 10)


def test_the_otlp_sink_asks_for_its_configured_batch_delay(monkeypatch):
    assert OtlpSink("http://127.0.0.1:9", run_id=RUN, batch_delay_s=0.25).batch_delay_s == 0.25
    for bad in (-0.1, 5.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="otlp_batch_delay_s"):
            OtlpSink("http://127.0.0.1:9", run_id=RUN, batch_delay_s=bad)
        with pytest.raises(ValueError, match="otlp_batch_delay_s"):
            steptrace.init(jsonl=False, run_id=RUN, otlp_batch_delay_s=bad)
    monkeypatch.setenv("STEPTRACE_OTLP_BATCH_DELAY_S", "9")
    with pytest.raises(ValueError, match="STEPTRACE_OTLP_BATCH_DELAY_S"):
        steptrace.init(jsonl=False, run_id=RUN)


def test_span_exports_reuse_one_connection(receiver):
    """The bounded answer reader reads a short answer to its end, so the connection is kept alive."""
    sink = OtlpSink(receiver.url, run_id=RUN, metrics_interval_s=3600)
    try:
        for n in range(5):
            sink.export([{"type": "step", "step": n, "status": "ok", "start_time": 1000.0 + n,
                          "end_time": 1000.5 + n, "interval_seconds": 1.0, "compute_seconds": 0.5}])
        assert len([r for r in receiver.requests if r.path == "/v1/traces"]) == 5
        assert receiver.connections == 1
    finally:
        sink.shutdown(5)


def test_a_record_that_is_not_a_mapping_costs_itself_alone(receiver):
    """A custom sink's stray value in a batch is one invalid record; the batch's step still goes out."""
    sink = OtlpSink(receiver.url, run_id=RUN, metrics_interval_s=3600)
    try:
        sink.export(["not a record", {"type": "metadata"}, {
            "type": "step", "step": 3, "status": "ok", "start_time": 1000.0, "end_time": 1000.5,
            "interval_seconds": 1.0, "compute_seconds": 0.5}])
        assert sink.invalid_records == 1
        assert [s.attributes["train.step"] for s in receiver.spans() if s.name == "train.step"] == [3]
    finally:
        sink.shutdown(5)


def test_a_bounded_export_that_fails_logs_one_line_and_nothing_once_its_caller_stopped_waiting(caplog):
    """``_run_bounded``: a failure is one warning line without a traceback (an endpoint that is down is the
    usual cause); a failure after the caller gave up waiting (``shutdown`` has returned) is at debug level
    only. It used to log a traceback from a thread that outlived shutdown(), which crashed a CI session."""
    import logging
    import threading

    from steptrace.otlp import _run_bounded

    def fails():
        raise RuntimeError("endpoint down")

    with caplog.at_level(logging.WARNING, logger="steptrace"):
        assert _run_bounded(fails, time.monotonic() + 10, "flush") is False
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.getMessage() == "steptrace OTLP flush failed: RuntimeError('endpoint down')"
    assert line.exc_info is None

    caplog.clear()
    release, done = threading.Event(), threading.Event()

    def fails_late():
        release.wait(10)
        try:
            raise RuntimeError("deadline already exceeded")
        finally:
            done.set()

    with caplog.at_level(logging.DEBUG, logger="steptrace"):
        assert _run_bounded(fails_late, time.monotonic() + 0.05, "metrics-shutdown") is False
        release.set()
        assert done.wait(10)
        waited = time.monotonic() + 10
        while not caplog.records and time.monotonic() < waited:  # the thread logs just after raising
            time.sleep(0.001)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "after its caller stopped waiting" in caplog.records[0].getMessage()
