"""In-test OTLP receivers: OTLP/HTTP (protobuf, gzip-aware) and OTLP/gRPC on 127.0.0.1.

They keep every decoded request so tests can assert on what an exporter sent::

    with OtlpHttpReceiver() as receiver:
        steptrace.init(otlp_endpoint=receiver.url, ...)
        ...
        steptrace.shutdown()
        spans = receiver.spans()

``hang_s`` makes the HTTP receiver sleep before answering (an endpoint that
hangs); ``status`` makes it answer with that HTTP status (503: retryable).
Stopping the receiver releases hanging handlers at once.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Received:
    """One request as it arrived: path, headers (lowercase keys), raw body and the decoded message."""

    path: str
    headers: dict[str, str]
    body: bytes
    message: Any = None


@dataclass
class ReceivedSpan:
    """A span flattened out of a request, with python values for attributes and resource attributes."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    status_message: str
    kind: int
    scope: str
    scope_version: str
    raw: Any = field(repr=False, default=None)


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as a python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return None if kind is None else getattr(value, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


class _Store:
    """What both receivers keep; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[Received] = []

    def add(self, received: Received) -> None:
        with self._lock:
            self.requests.append(received)

    def of(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if r.path == path and r.message is not None]

    def trace_requests(self) -> list[ExportTraceServiceRequest]:
        return [r.message for r in self.of("/v1/traces")]

    def metric_requests(self) -> list[ExportMetricsServiceRequest]:
        return [r.message for r in self.of("/v1/metrics")]

    def spans(self) -> list[ReceivedSpan]:
        out = []
        for request in self.trace_requests():
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(ReceivedSpan(
                            name=s.name, trace_id=int.from_bytes(s.trace_id, "big"),
                            span_id=int.from_bytes(s.span_id, "big"),
                            parent_span_id=int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else None,
                            start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                            attributes=attributes(s.attributes), resource=resource,
                            status_code=s.status.code, status_message=s.status.message, kind=s.kind,
                            scope=ss.scope.name, scope_version=ss.scope.version, raw=s))
        return out

    def metrics(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, Metric) for every exported instance of metric ``name``, in arrival order."""
        out = []
        for request in self.metric_requests():
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            out.append((resource, m))
        return out

    def last_metric(self, name: str) -> Any:
        """The most recent export of metric ``name`` (cumulative temporality: the totals), or None."""
        found = self.metrics(name)
        return found[-1][1] if found else None

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()


class OtlpHttpReceiver(_Store):
    """An OTLP/HTTP receiver on a free port of 127.0.0.1 (``url`` is the base endpoint)."""

    def __init__(self, *, hang_s: float = 0.0, status: int = 200):
        super().__init__()
        self.hang_s = hang_s
        self.status = status
        self._release = threading.Event()
        #: TCP connections accepted (HTTP/1.1 keep-alive: a client that reuses one makes one).
        self.connections = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                receiver.connections += 1
                super().setup()

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                received = Received(self.path, headers, body)
                if receiver.hang_s and receiver._release.wait(receiver.hang_s):
                    return  # stopped while hanging: drop the connection
                if receiver.status != 200:
                    receiver.add(received)
                    self._reply(receiver.status, b"unavailable", "text/plain")
                    return
                data = body
                encoding = headers.get("content-encoding", "")
                if encoding == "gzip":
                    data = gzip.decompress(body)
                elif encoding == "deflate":
                    data = zlib.decompress(body)
                if self.path == "/v1/traces":
                    received.message = ExportTraceServiceRequest.FromString(data)
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    received.message = ExportMetricsServiceRequest.FromString(data)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    receiver.add(received)
                    self._reply(404, b"not found", "text/plain")
                    return
                receiver.add(received)
                self._reply(200, reply, "application/x-protobuf")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.port = self._server.server_address[1]
        #: The base endpoint, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes it.
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="otlp-http-receiver", daemon=True)

    def start(self) -> "OtlpHttpReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "OtlpHttpReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class OtlpGrpcReceiver(_Store):
    """An OTLP/gRPC receiver (traces and metrics services) on a free port of 127.0.0.1.

    Requests are stored under the paths ``/v1/traces`` and ``/v1/metrics`` like the
    HTTP receiver's, with the call's metadata as headers.
    """

    def __init__(self) -> None:
        super().__init__()
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        store = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.add(Received("/v1/traces", dict(context.invocation_metadata()), b"", request))
                return ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                store.add(Received("/v1/metrics", dict(context.invocation_metadata()), b"", request))
                return ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpGrpcReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)

    def __enter__(self) -> "OtlpGrpcReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
