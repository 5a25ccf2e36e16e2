"""OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf or JSON, optionally gzip.

A ``ThreadingHTTPServer`` with bounds, so that no client can stop the others:

* at most ``max_connections`` connections are served at once; the next one
  gets ``503`` (retryable for OTLP exporters) and is closed;
* each socket read waits at most ``read_timeout_s``, and a whole body must
  arrive within ``request_timeout_s`` (else ``408``), so a slow client holds
  one thread for a bounded time;
* ``Content-Length`` is checked before anything is read (``413``); a body
  without one is ``411``.

Checks run in this order: path (``404``), method (``405``), bearer token
(``401``), content type (``415``), length (``411``/``413``), then the body is
read, decompressed (``413`` for a gzip bomb, ``400`` for a broken stream) and
decoded (``400``); a request arriving while the collector shuts down is
``503`` with ``Retry-After`` (the exporter retries against the restarted
collector). Every refusal is counted in
``steptrace_collector_rejected_requests_total{reason}``; an unexpected
exception while handling one request is logged and answered ``500``
(``reason="internal"``) and the server carries on.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from steptrace.collector._decode import (
    Rejected,
    decompress,
    encode_error,
    encode_response,
    media_type,
    parse_request,
)

if TYPE_CHECKING:  # pragma: no cover
    from steptrace.collector._app import Collector

__all__ = ["OtlpHttpServer"]

log = logging.getLogger("steptrace.collector")

_PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics"}
_DRAIN_LIMIT = 1 << 20  # bytes read and discarded from a refused body, so the client sees our answer


class OtlpHttpServer(ThreadingHTTPServer):
    """The OTLP/HTTP receiver of one :class:`~steptrace.collector._app.Collector`."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], collector: "Collector", *, token: str | None,
                 max_body_bytes: int, read_timeout_s: float, request_timeout_s: float, max_connections: int):
        self.collector = collector
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        handler = type("_BoundHandler", (_Handler,), {"timeout": read_timeout_s})
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.collector.metrics.reject("overloaded")
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished mid-request is routine; anything else is worth a log line.
        log.debug("steptrace collector: error serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "steptrace-collector"
    server: OtlpHttpServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("steptrace collector http: " + format, *args)

    def do_POST(self) -> None:
        self._serve(post=True)

    def do_GET(self) -> None:
        self._serve(post=False)

    do_PUT = do_DELETE = do_PATCH = do_GET

    def _serve(self, post: bool) -> None:
        server = self.server
        media: str | None = None
        body_read = False
        try:
            signal = _PATHS.get(urlsplit(self.path).path)
            if signal is None:
                raise Rejected(404, "not_found", f"no such path: {self.path[:200]!r} (POST /v1/traces or /v1/metrics)")
            if not post:
                raise Rejected(405, "method_not_allowed", f"{self.command} {signal}: use POST")
            if server.token is not None and not _authorized(self.headers.get("Authorization"), server.token):
                raise Rejected(401, "unauthorized", "missing or wrong bearer token")
            media = media_type(self.headers.get("Content-Type"))
            length = self._content_length()
            body = self._read_body(length)
            body_read = True
            data = decompress(body, self.headers.get("Content-Encoding"), server.max_body_bytes)
            message = parse_request(signal, data, media)
            rejected, note = server.collector.accept(signal, message, "http")
            self._reply(200, encode_response(signal, media, rejected, note), media)
        except Rejected as exc:
            server.collector.metrics.reject(exc.reason)
            if not body_read and exc.status != 411:
                body_read = self._drain()
            payload, content_type = encode_error(media, exc.status, exc.message)
            extra = {"WWW-Authenticate": 'Bearer realm="steptrace-collector"'} if exc.status == 401 else {}
            if exc.status == 503:
                extra["Retry-After"] = "1"
            self._reply(exc.status, payload, content_type, close=not body_read, headers=extra)
        except (OSError, TimeoutError):
            self.close_connection = True  # the client went away or stalled; nobody to answer
        except Exception:
            log.exception("steptrace collector: unexpected error handling %s %s", self.command, self.path[:200])
            server.collector.metrics.reject("internal")
            payload, content_type = encode_error(media, 500, "internal error")
            self._reply(500, payload, content_type, close=True)

    def _content_length(self) -> int:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise Rejected(411, "length_required", "chunked bodies are not accepted: send Content-Length")
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else -1
        except ValueError:
            length = -1
        if length < 0:
            raise Rejected(411, "length_required", "Content-Length is required")
        if length > self.server.max_body_bytes:
            raise Rejected(413, "too_large", f"body of {length} bytes exceeds {self.server.max_body_bytes}")
        return length

    def _read_body(self, length: int) -> bytes:
        deadline = time.monotonic() + self.server.request_timeout_s
        chunks = []
        remaining = length
        try:
            while remaining:
                if time.monotonic() > deadline:
                    raise Rejected(408, "timeout", f"body not received within {self.server.request_timeout_s:g} s")
                chunk = self.rfile.read1(min(remaining, 1 << 16))
                if not chunk:
                    raise Rejected(400, "malformed", "connection closed before the body ended")
                chunks.append(chunk)
                remaining -= len(chunk)
        except (TimeoutError, socket.timeout):
            raise Rejected(408, "timeout", "timed out reading the body") from None
        return b"".join(chunks)

    def _drain(self) -> bool:
        """Read and discard a refused request's body (if small), so the connection can go on.

        Closing with unread data makes the kernel reset the connection, and the
        client may never see our answer. True when the whole body was read.
        """
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return False
        if length < 0 or length > _DRAIN_LIMIT or "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return False
        try:
            self._read_body(length)
        except (Rejected, OSError):
            return False
        return True

    def _reply(self, status: int, body: bytes, content_type: str, *, close: bool = False,
               headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


def _authorized(header: str | None, token: str) -> bool:
    if not header:
        return False
    scheme, _, credentials = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode())
