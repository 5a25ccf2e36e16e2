"""Shared by the collector tests: OTLP requests built with opentelemetry-proto, HTTP and /metrics helpers."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from prometheus_client.parser import text_string_to_metric_families

from steptrace._ids import span_id, trace_id, trace_id_hex
from steptrace.collector import Collector, CollectorConfig
from steptrace.collector._decode import StepSpan

#: Step n of a test span ends at END_BASE_S + n: an hour ago, within the collector's clock bounds.
END_BASE_S = int(time.time()) - 3600

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


def any_value(value: Any) -> AnyValue:
    if isinstance(value, tuple):  # an OTLP array attribute
        from opentelemetry.proto.common.v1.common_pb2 import ArrayValue

        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def step_span(run_id: str = "run", step: int = 0, rank: int = 0, compute: float = 0.1, interval: float = 0.2, *,
              world_size: int | None = 3, status: str | None = "ok", bubble: dict[str, float] | None = None,
              name: str = "train.step", drop: tuple[str, ...] = (), end_s: float | None = None,
              **extra: Any) -> Span:
    """A span shaped like steptrace/otlp.py's ``train.step`` (or another ``name``) for one rank and step."""
    attrs: dict[str, Any] = {"train.run_id": run_id, "train.rank": rank, "train.step": step,
                             "train.world_size": world_size, "train.status": status,
                             "train.interval_seconds": interval, "train.compute_seconds": compute,
                             "train.idle_seconds": max(0.0, interval - compute)}
    for stage, ratio in (bubble or {}).items():
        attrs[f"train.pipeline.bubble_ratio.{stage}"] = ratio
    attrs.update(extra)
    end_ns = (END_BASE_S + min(step, 1 << 30)) * 1_000_000_000
    if end_s is not None:
        end_ns = round(end_s * 1e9)
    return Span(trace_id=trace_id(run_id, step).to_bytes(16, "big"),
                span_id=span_id(run_id, step, rank, "step" if name == "train.step" else name).to_bytes(8, "big"),
                name=name, kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=end_ns - round(interval * 1e9),
                end_time_unix_nano=end_ns,
                attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()
                            if v is not None and k not in drop])


def request(*spans: Span) -> ExportTraceServiceRequest:
    """One request; spans are grouped into one resource per (run, rank), like each rank's exporter does."""
    out = ExportTraceServiceRequest()
    groups: dict[tuple[str, int], list[Span]] = {}
    for span in spans:
        attrs = {kv.key: kv.value for kv in span.attributes}
        run = attrs["train.run_id"].string_value if "train.run_id" in attrs else ""
        rank = attrs["train.rank"].int_value if "train.rank" in attrs else -1
        groups.setdefault((run, rank), []).append(span)
    for (run, rank), group in groups.items():
        rs = ResourceSpans(resource=Resource(attributes=[
            KeyValue(key="service.instance.id", value=AnyValue(string_value=f"{run}/rank-{rank}"))]))
        rs.scope_spans.append(ScopeSpans(spans=group))
        out.resource_spans.append(rs)
    return out


def body(*spans: Span) -> bytes:
    return request(*spans).SerializeToString()


def otlp_json(message: Any) -> bytes:
    """OTLP/JSON as the spec writes it: protobuf JSON, but trace and span ids as hex strings."""
    document = json_format.MessageToDict(message)

    def fix(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                    node[key] = base64.b64decode(value).hex()
                else:
                    fix(value)
        elif isinstance(node, list):
            for item in node:
                fix(item)

    fix(document)
    return json.dumps(document).encode()


def post(port: int, path: str, data: bytes, content_type: str | None = PROTOBUF, *,
         headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        all_headers = dict(headers or {})
        if content_type is not None:
            all_headers["Content-Type"] = content_type
        conn.request("POST", path, body=data, headers=all_headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a torn line
    return out


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


# -- hostile peers and secure setups (test_collector_hostile.py, bench/collector_soak.py) ---------------------


def raw_exchange(port: int, data: bytes, *, timeout: float = 10.0, source: str | None = None) -> bytes:
    """Send raw bytes, half-close, return everything the server answers before closing."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                    source_address=(source, 0) if source else None)
    try:
        sock.sendall(data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        sock.close()


def self_signed_cert(directory: Path) -> tuple[Path, Path] | None:
    """(cert, key) PEM files for CN/SAN 127.0.0.1 and localhost, made with the openssl tool; None without it."""
    import shutil
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class FakeClock:
    """A clock the test moves by hand (``clock.now += 10``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def span(step: int = 0, rank: int = 0, compute: float = 0.1, interval: float = 0.2, *, run_id: str = "run",
         world_size: int | None = 3, status: str = "ok", bubble: dict[str, float] | None = None) -> StepSpan:
    """A decoded ``train.step`` span, as the joiner receives it."""
    return StepSpan(run_id=run_id, step=step, rank=rank, world_size=world_size, trace_id=trace_id_hex(run_id, step),
                    compute_seconds=compute, interval_seconds=interval, idle_seconds=interval - compute,
                    status=status, end_time=1.7e9 + step, bubble=bubble or {})


@contextlib.contextmanager
def collectors(run_dir: Path, **defaults: Any):
    """``make(**settings)`` starts a collector on free ports (closed on exit); ``defaults`` apply to each."""
    made: list[Collector] = []

    def make(**settings: Any) -> Collector:
        for key, value in {"port": 0, "metrics_port": 0, "run_dir": str(run_dir), "window_s": 30.0,
                           **defaults}.items():
            settings.setdefault(key, value)
        c = Collector(CollectorConfig(**settings)).start()
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
