"""OTLP/gRPC on ``--grpc-port``: the trace and metrics services of opentelemetry-proto.

The services are registered as generic handlers that receive the raw message
bytes, so decoding happens here: a body that does not decode is
``INVALID_ARGUMENT``, counted (``malformed``) and logged in one rate-limited
line, not the six-line traceback gRPC's own deserializer would log for each.
Every refusal is counted in ``steptrace_collector_rejected_requests_total``:
a missing or wrong token (``UNAUTHENTICATED``), a run the token does not cover
(``PERMISSION_DENIED``), too many spans (``RESOURCE_EXHAUSTED``), shutting
down (``UNAVAILABLE``, retryable). gRPC itself enforces the size limit
(``grpc.max_receive_message_length`` = ``--max-body-bytes``) and answers
``RESOURCE_EXHAUSTED`` before any of our code runs: those refusals cannot be
counted here. With ``--tls-cert``/``--tls-key`` the port serves TLS only.
"""

from __future__ import annotations

from concurrent import futures
from typing import TYPE_CHECKING, Any

try:
    import grpc
except ImportError as _exc:  # pragma: no cover - exercised by users without grpcio
    raise ImportError(f"--grpc-port needs grpcio ({_exc}): pip install grpcio 'steptrace[otlp]'") from _exc

from steptrace.collector._auth import authorized_grant
from steptrace.collector._decode import MEDIA_PROTOBUF, Rejected, parse_request, response_message
from steptrace.collector._http import count_refusal

if TYPE_CHECKING:  # pragma: no cover
    from steptrace.collector._app import Collector

__all__ = ["start_grpc_server"]

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}

_SERVICES = {
    "traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
}


def _export(collector: Collector, signal: str, data: bytes, context: Any) -> Any:
    peer = _peer(context)
    key = peer[0] if peer else ""
    reserved = 0
    try:
        if not collector.budget.acquire(key, len(data)):
            raise Rejected(503, "memory_limited", "the in-flight body budget is spent; retry")
        reserved = len(data)
        metadata = dict(context.invocation_metadata())
        grant = authorized_grant(collector.tokens, metadata.get("authorization"))
        if grant is None:
            raise Rejected(401, "unauthorized", "missing or wrong bearer token")
        message = parse_request(signal, data, MEDIA_PROTOBUF)
        rejected, note = collector.accept(signal, message, "grpc", grant)
    except Rejected as exc:
        count_refusal(collector, exc.reason, f"gRPC {exc.message}", peer)
        context.abort(_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), exc.message)
        raise  # not reached: abort raises
    finally:
        if reserved:
            collector.budget.release(key, reserved)
    return response_message(signal, rejected, note)


def _peer(context: Any) -> tuple[str, int] | None:
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5678", "ipv6:[::1]:5678"
    _, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]")
    return (host, 0) if host else None


#: gRPC calls in progress at once (8 run, the rest wait); more are RESOURCE_EXHAUSTED. With
#: ``--max-body-bytes`` this bounds what gRPC holds of bodies before our code sees them.
MAX_CONCURRENT_RPCS = 16


def start_grpc_server(collector: Collector, host: str, port: int, max_body_bytes: int,
                      tls: tuple[bytes, bytes] | None = None, *, max_connections: int = 1024,
                      idle_s: float = 30.0) -> tuple[Any, int]:
    """Start the gRPC server; returns (server, bound port). Raises ``OSError`` when the port is taken.

    ``tls`` is (private key PEM, certificate chain PEM). At most ``max_connections``
    connections are accepted (``grpc.max_allowed_incoming_connections``; gRPC closes the
    next ones at once), one that has not finished its HTTP/2 (and TLS) handshake within
    ``idle_s`` is closed (``grpc.server_handshake_timeout_ms``; gRPC's own default is
    minutes), and so is one idle for ``idle_s``. gRPC has no per-peer cap and takes no
    connection back when full (OTLP/HTTP does): docs/collector.md, *Limits*.
    """
    handlers = []
    for signal, service in _SERVICES.items():
        method = grpc.unary_unary_rpc_method_handler(
            lambda data, context, signal=signal: _export(collector, signal, data, context),
            request_deserializer=None, response_serializer=lambda message: message.SerializeToString())
        handlers.append(grpc.method_handlers_generic_handler(service, {"Export": method}))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="steptrace-collector-grpc"),
                         handlers=handlers, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                         options=[("grpc.max_receive_message_length", max_body_bytes),
                                  ("grpc.so_reuseport", 0),
                                  ("grpc.max_allowed_incoming_connections", max_connections),
                                  ("grpc.max_connection_idle_ms", int(idle_s * 1000)),
                                  ("grpc.server_handshake_timeout_ms", int(idle_s * 1000)),
                                  ("grpc.max_concurrent_streams", MAX_CONCURRENT_RPCS)])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None:
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError for a port it cannot bind
        raise OSError(f"cannot bind {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server, bound
