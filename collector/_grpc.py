"""OTLP/gRPC on ``--grpc-port``: the trace and metrics services of opentelemetry-proto.

gRPC itself decodes the messages, handles gzip and enforces the size limit
(``grpc.max_receive_message_length`` = ``--max-body-bytes``; such refusals
happen inside gRPC and are not counted). The bearer token is checked from the
``authorization`` metadata; a refusal is ``UNAUTHENTICATED`` and counted.
"""

from __future__ import annotations

from concurrent import futures
from typing import TYPE_CHECKING, Any

try:
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
except ImportError as _exc:  # pragma: no cover - exercised by users without grpcio
    raise ImportError(f"--grpc-port needs grpcio ({_exc}): pip install grpcio 'steptrace[otlp]'") from _exc

from steptrace.collector._decode import Rejected
from steptrace.collector._http import _authorized

if TYPE_CHECKING:  # pragma: no cover
    from steptrace.collector._app import Collector

__all__ = ["start_grpc_server"]


def _check(collector: "Collector", context: Any) -> None:
    token = collector.config.token
    if token is None:
        return
    metadata = dict(context.invocation_metadata())
    if not _authorized(metadata.get("authorization"), token):
        collector.metrics.reject("unauthorized")
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _accept(collector: "Collector", signal: str, request: Any, context: Any) -> tuple[int, str]:
    try:
        return collector.accept(signal, request, "grpc")
    except Rejected as exc:  # shutting down: UNAVAILABLE is retryable for OTLP exporters
        collector.metrics.reject(exc.reason)
        context.abort(grpc.StatusCode.UNAVAILABLE, exc.message)
        raise  # not reached: abort raises


def start_grpc_server(collector: "Collector", host: str, port: int, max_body_bytes: int) -> tuple[Any, int]:
    """Start the gRPC server; returns (server, bound port). Raises ``OSError`` when the port is taken."""

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
            _check(collector, context)
            rejected, note = _accept(collector, "traces", request, context)
            response = trace_service_pb2.ExportTraceServiceResponse()
            if rejected:
                response.partial_success.rejected_spans = rejected
                response.partial_success.error_message = note
            return response

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            _check(collector, context)
            _accept(collector, "metrics", request, context)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="steptrace-collector-grpc"),
                         options=[("grpc.max_receive_message_length", max_body_bytes),
                                  ("grpc.so_reuseport", 0)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError for a port it cannot bind
        raise OSError(f"cannot bind {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server, bound
