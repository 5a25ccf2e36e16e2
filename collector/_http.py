"""OTLP/HTTP: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf or JSON, optionally gzip.

A ``ThreadingHTTPServer`` with bounds, so that no client can stop the others:

* at most ``max_connections`` connections are served at once, and at most
  ``max_connections_per_peer`` from one IP address (beyond it: ``503``,
  retryable for OTLP exporters, and closed), so a few slow peers cannot take
  every slot;
* when the server is full (fewer than a sixteenth of its slots free, as nginx
  reuses connections in advance), each new connection takes back one held by a
  connection that has gone longest without completing a request: those that
  never completed one first, oldest first, then those that did, least recently
  first. So many peers each under their cap (a distributed slow-loris: header
  or body bytes trickled, idle keep-alive connections) cannot keep a new
  honest request out. A connection whose request is being made durable and
  answered is never taken back. One taken back is shut down at once (reads
  and writes alike, so its thread lets go of it within milliseconds whatever
  it was blocked in) and closed; a half-sent request on it is counted as
  ``evicted`` (the OTLP exporters retry a closed connection), an idle
  keep-alive connection is no refusal (HTTP/1.1 clients retry on a fresh
  one). Only when every slot is answering a request is a new connection
  refused (``overloaded``);
* a whole request, request line and headers included, must arrive within
  ``request_timeout_s`` of the connection starting to wait for it (every
  socket read is given only what is left of that deadline, and at most
  ``read_timeout_s``), so a client trickling one header byte at a time holds
  a thread for a bounded time; past it the request is ``408`` and closed;
* body bytes in flight are bounded across all connections
  (``--max-inflight-body-bytes``) and per peer address (a quarter of it, at
  least ``--max-body-bytes``): a body that would pass either is ``503``
  (``memory_limited``, with ``Retry-After``) before it is read;
* when the process is out of file descriptors the accept loop pauses 50 ms
  instead of spinning (the collector sizes its connection caps below
  ``RLIMIT_NOFILE`` so that this is rare);
* ``Content-Length`` is checked before anything is read (``413``); a body
  without one is ``411``; two of them, or one that is not plain decimal
  digits (``+308``, ``3_0_8``), is ``400`` and the connection closed; A refused body is read and discarded (up to
  ``_DRAIN_LIMIT`` bytes and the deadline) after the answer is sent, so a
  client that writes its whole body before reading (urllib, requests, the
  OTLP exporters) gets the ``413`` instead of a broken pipe;
* with a TLS context, the handshake happens in the connection's thread under
  the same deadline.

Checks run in this order: path (``404``), method (``405``), bearer token
(``401``), content type (``415``), length (``411``/``413``), then the body is
read, decompressed (``413`` for a gzip bomb, ``400`` for a broken stream) and
decoded (``400``); more than ``--max-spans-per-request`` spans is ``413``
(``too_many_spans``); a step span of a run the token does not cover is ``403``;
a request arriving while the collector shuts down is ``503`` with
``Retry-After`` (the exporter retries against the restarted collector).
What the standard library refuses before us (a request line over 64 KiB:
``414``; too many or too long headers: ``431``; a bad request line or an
HTTP/2 preface: ``400``/``505``) is counted too. Every refusal is counted in
``steptrace_collector_rejected_requests_total{reason}`` and logged without a
traceback, once per reason per 10 s; an unexpected exception while handling
one request is logged and answered ``500`` (``reason="internal"``) and the
server carries on.
"""

from __future__ import annotations

import errno
import json
import io
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from steptrace._capture import CAPTURE_PATH  # the ranks' capture requests (collector/_captures.py): GET only
from steptrace.collector._auth import Tokens, authorized_grant
from steptrace.collector._decode import (
    Rejected,
    decompress,
    encode_error,
    encode_response,
    media_type,
    parse_request,
)
from steptrace.collector._ratelog import RateLimitedLog

if TYPE_CHECKING:  # pragma: no cover
    from steptrace.collector._app import Collector

__all__ = ["ByteBudget", "OtlpHttpServer", "refusal_log"]

log = logging.getLogger("steptrace.collector")
#: Refusals are counted; the log says so once per reason per 10 s.
refusal_log = RateLimitedLog(log, 10.0)

_PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics"}

_DRAIN_SMALL = 1 << 20  # a refused body this small is read before answering, and the connection kept
_DRAIN_LIMIT = 64 << 20  # a larger one is read (after answering) up to this, then the connection closed
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
         b"Connection: close\r\n\r\n")
#: How long a new connection waits for connections taken back to let go of their slots (their threads
#: close them, usually within a millisecond) when none is free; then it is refused.
_TAKE_BACK_WAIT_S = 1.0
# Statuses the standard library's request parsing answers with, and their reasons.
_STDLIB_REASONS = {400: "malformed", 408: "timeout", 414: "uri_too_long", 431: "headers_too_large",
                   501: "method_not_allowed", 505: "unsupported_version"}


def count_refusal(collector: Collector, reason: str, detail: str, peer: Any = None) -> None:
    collector.metrics.reject(reason)
    who = peer[0] if isinstance(peer, tuple) and peer else "a client"
    refusal_log.warning(reason, "steptrace collector: refused a request from %s (%s): %s; counted in "
                                "steptrace_collector_rejected_requests_total{reason=%r}", who, reason, detail, reason)


class ByteBudget:
    """Body bytes in flight across all connections (``total``) and from one peer address (``per_peer``).

    Like the OpenTelemetry Collector's memory limiter: a request whose body would pass
    either bound is refused (503, retryable) before it is read.
    """

    def __init__(self, total: int, per_peer: int):
        self.total = total
        self.per_peer = per_peer
        self.used = 0
        self._by_peer: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, peer: str, n: int) -> bool:
        with self._lock:
            mine = self._by_peer.get(peer, 0)
            if n and (self.used + n > self.total or mine + n > self.per_peer):
                return False
            self.used += n
            self._by_peer[peer] = mine + n
            return True

    def release(self, peer: str, n: int) -> None:
        with self._lock:
            self.used -= n
            left = self._by_peer.get(peer, n) - n
            if left > 0:
                self._by_peer[peer] = left
            else:
                self._by_peer.pop(peer, None)


class ConnectionEvicted(ConnectionAbortedError):
    """The server took this connection back to serve a new one (see :class:`BoundedServer`)."""


class Slot:
    """One admitted connection: what the server needs to choose which one to take back."""

    __slots__ = ("busy", "evicted", "peer", "request")

    def __init__(self, request: Any, peer: str):
        self.request = request
        self.peer = peer
        self.busy = False  # its request is being made durable and answered: never taken back
        self.evicted = False  # taken back: its thread closes it and gives the slot up


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server with a cap on connections, overall and per peer address, and optional TLS.

    Full, it takes back the connection that has gone longest without completing a request
    (see the module's docstring); the handler marks the request it is answering
    (:meth:`hold`) and the requests it completed (:meth:`progressed`).
    """

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, *, max_connections: int,
                 max_connections_per_peer: int, tls: ssl.SSLContext | None, on_refuse: Any):
        self.max_connections = max_connections
        # Taken back before the server is quite full, so that a burst of new connections finds free
        # slots while the connections taken back close (nginx keeps 1/16 of worker_connections free
        # the same way: "Core: reusing connections in advance", 1.19.2).
        self._reserve = max_connections // 16
        self._per_peer = max_connections_per_peer
        self._slots: dict[int, Slot] = {}  # id(request) -> its slot, until its thread closed it
        # The order to take connections back in: those that never completed a request by age, then
        # those that did by their last one. Insertion-ordered; busy ones are skipped.
        self._fresh: dict[int, Slot] = {}
        self._served: dict[int, Slot] = {}
        self._leaving = 0  # taken back, their descriptors not yet closed
        self._peers: dict[str, int] = {}
        self._cond = threading.Condition()
        self.tls = tls
        self._on_refuse = on_refuse
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        try:
            sock, address = super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: the pending connection stays in the backlog and select()
                # reports it again at once. Pause instead of spinning the accept loop.
                self._on_refuse("overloaded", None)
                time.sleep(0.05)
            raise
        if self.tls is not None:  # the handshake runs in the connection's thread, under its deadline
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = client_address[0] if isinstance(client_address, tuple) else ""
        refused = self._admit(request, peer)
        if refused:
            self._on_refuse(refused, client_address)
            if self.tls is None:  # under TLS the client would read our bytes as a broken handshake
                try:
                    request.setblocking(False)
                    request.send(_BUSY)
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # closes the socket
        finally:
            self._release(request)

    def _admit(self, request: Any, peer: str) -> str:
        """Give ``request`` a slot, taking one back if need be; the refusal reason, or "" when admitted."""
        with self._cond:
            if self._peers.get(peer, 0) >= self._per_peer:
                return "peer_overloaded"
            deadline = None
            while True:
                free = self.max_connections - len(self._slots)
                if free <= self._reserve:
                    self._take_back_one()
                if free > 0:
                    break
                if not self._leaving:
                    return "overloaded"  # every slot is answering a request: nothing to take back
                if deadline is None:
                    deadline = time.monotonic() + _TAKE_BACK_WAIT_S
                left = deadline - time.monotonic()
                if left <= 0:
                    return "overloaded"
                self._cond.wait(left)
            slot = Slot(request, peer)
            self._slots[id(request)] = self._fresh[id(request)] = slot
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return ""

    def _take_back_one(self) -> bool:
        """Take back the connection that has gone longest without completing a request (lock held)."""
        for order in (self._fresh, self._served):
            for key, slot in order.items():
                if slot.busy:
                    continue
                del order[key]
                slot.evicted = True
                self._leaving += 1
                try:
                    # Wakes its thread out of a read (end of stream) or a write (EPIPE) to a peer that
                    # does not read; the thread then closes it (closing it here could hand its
                    # descriptor number to the next accept while that thread still uses it). Not
                    # SSLSocket.shutdown: that drops the TLS state the thread is using.
                    socket.socket.shutdown(slot.request, socket.SHUT_RDWR)
                except OSError:
                    pass
                return True
        return False

    def slot_of(self, request: Any) -> Slot | None:
        with self._cond:
            return self._slots.get(id(request))

    def hold(self, slot: Slot) -> bool:
        """Mark ``slot``'s request as being answered (never taken back); False when it was taken back already."""
        with self._cond:
            if slot.evicted:
                return False
            slot.busy = True
            return True

    def unhold(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False

    def progressed(self, slot: Slot) -> None:
        """``slot`` completed a request: it goes to the end of the order, after every connection that has not."""
        with self._cond:
            key = id(slot.request)
            if slot.evicted or key not in self._slots:
                return
            self._fresh.pop(key, None)
            self._served.pop(key, None)
            self._served[key] = slot

    def _release(self, request: Any) -> None:
        with self._cond:
            key = id(request)
            slot = self._slots.pop(key, None)
            if slot is None:
                return
            self._fresh.pop(key, None)
            self._served.pop(key, None)
            if slot.evicted:
                self._leaving -= 1
            left = self._peers.get(slot.peer, 1) - 1
            if left > 0:
                self._peers[slot.peer] = left
            else:
                self._peers.pop(slot.peer, None)
            self._cond.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished mid-request is routine; anything else is worth a log line.
        log.debug("steptrace collector: error serving %s", client_address, exc_info=True)


class _DeadlineReader(io.RawIOBase):
    """The connection's socket, read with what is left of the handler's request deadline as timeout."""

    def __init__(self, sock: socket.socket, handler: DeadlineHandler):
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        h = self._handler
        left = h.deadline - time.monotonic()
        if left <= 0:
            h.timed_out = True
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(min(left, h.timeout or left))
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            h.timed_out = True
            raise
        if not n and h.slot is not None and h.slot.evicted:
            raise ConnectionEvicted("the server took this connection back")
        h.request_bytes += n
        return n


class DeadlineHandler(BaseHTTPRequestHandler):
    """A request handler whose every request (line, headers, body) must arrive within ``request_timeout_s``.

    A subclass calls :meth:`_hold` once a request is complete and about to be answered (the
    server then never takes the connection back) and :meth:`_progressed` once it took one.
    """

    server: BoundedServer
    protocol_version = "HTTP/1.1"
    request_timeout_s = 30.0
    deadline = 0.0
    timed_out = False
    request_bytes = 0
    replied = False  # a response to the current request was started
    slot: Slot | None = None
    _held = False

    def setup(self) -> None:
        super().setup()
        self.slot = self.server.slot_of(self.request)
        self.deadline = time.monotonic() + self.request_timeout_s
        tls = getattr(self.server, "tls", None)
        if tls is not None:
            try:
                self.connection.settimeout(max(0.01, self.deadline - time.monotonic()))
                self.connection.do_handshake()
            except (OSError, ssl.SSLError) as exc:
                if self.slot is not None and self.slot.evicted:
                    self._refused("evicted", "taken back during its TLS handshake: the collector was full")
                else:
                    self._refused("tls", f"TLS handshake failed: {exc}")
                self.close_connection = True
                self.rfile = io.BytesIO()  # handle() then sees no request and returns
                return
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self), 1 << 16)

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.request_timeout_s
        self.timed_out = False
        self.request_bytes = 0
        self.replied = False
        try:
            super().handle_one_request()
        except OSError:
            # Taken back: a plain socket reads an end of stream (ConnectionEvicted), a TLS one may
            # raise its own error for the shut-down transport instead.
            if self.slot is None or not self.slot.evicted:
                raise
        if self.slot is not None and self.slot.evicted:
            self.close_connection = True
            if self.request_bytes and not self.replied:  # between requests, closing refuses nothing
                self._refused("evicted", "the collector was full and this connection had gone longest without "
                                         "completing a request; closed, retry")
            return
        if self.timed_out:
            self.close_connection = True
            if self.request_bytes:  # an idle keep-alive connection timing out is no refusal
                self._refused("timeout", f"request not received within {self.request_timeout_s:g} s")

    def _hold(self) -> None:
        """The request is complete: from here until :meth:`_unhold` the server does not take the connection back."""
        if self.slot is not None:
            if not self.server.hold(self.slot):
                raise ConnectionEvicted("taken back before its request was answered")
            self._held = True

    def _unhold(self) -> None:
        if self._held and self.slot is not None:
            self.server.unhold(self.slot)
        self._held = False

    def _progressed(self) -> None:
        if self.slot is not None:
            self.server.progressed(self.slot)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.replied = True
        super().send_response(code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Only the standard library's parsing calls this (our answers go through _reply).
        self._refused(_STDLIB_REASONS.get(code, "malformed"), f"{code} {message or ''}".strip())
        try:
            self.connection.settimeout(1.0)
            super().send_error(code, message, explain)
        except OSError:
            pass
        self.close_connection = True

    def _refused(self, reason: str, detail: str) -> None:
        raise NotImplementedError

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("steptrace collector http: " + format, *args)


class OtlpHttpServer(BoundedServer):
    """The OTLP/HTTP receiver of one :class:`~steptrace.collector._app.Collector`."""

    def __init__(self, address: tuple[str, int], collector: Collector, *, tokens: Tokens | None,
                 max_body_bytes: int, read_timeout_s: float, request_timeout_s: float, max_connections: int,
                 max_connections_per_peer: int | None = None, tls: ssl.SSLContext | None = None,
                 budget: ByteBudget | None = None):
        self.collector = collector
        self.budget = budget if budget is not None else ByteBudget(1 << 62, 1 << 62)
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        handler = type("_BoundHandler", (_Handler,), {"timeout": read_timeout_s,
                                                      "request_timeout_s": request_timeout_s})
        super().__init__(address, handler, max_connections=max_connections,
                         max_connections_per_peer=max_connections_per_peer or max_connections, tls=tls,
                         on_refuse=lambda reason, peer: count_refusal(collector, reason, "no free connection slot",
                                                                      peer))


def _declared_length(headers: Any) -> int | None:
    """The one ``Content-Length`` of a request, None without one; 400 for two, or for anything but digits.

    ``int()`` takes ``+308``, ``3_0_8`` and ``-0``, and ``headers.get`` the first of two
    conflicting lengths: behind a proxy that reads them differently, that is request
    smuggling (nginx answers 400 too).
    """
    values = headers.get_all("Content-Length") or []
    if not values:
        return None
    if len(values) > 1:
        raise Rejected(400, "malformed", f"{len(values)} Content-Length headers; send one")
    raw = values[0].strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        raise Rejected(400, "malformed", f"Content-Length must be decimal digits, got {raw[:40]!r}")
    return int(raw)


class _Handler(DeadlineHandler):
    server_version = "steptrace-collector"
    server: OtlpHttpServer

    def _refused(self, reason: str, detail: str) -> None:
        count_refusal(self.server.collector, reason, detail, self.client_address)

    def do_POST(self) -> None:
        self._serve(post=True)

    def do_GET(self) -> None:
        self._serve(post=False)

    do_PUT = do_DELETE = do_PATCH = do_GET

    def _serve(self, post: bool) -> None:
        self._reserved = 0
        try:
            self._serve_one(post)
        finally:
            self._unhold()
            if self._reserved:
                self.server.budget.release(self._peer(), self._reserved)
                self._reserved = 0

    def _peer(self) -> str:
        return self.client_address[0] if isinstance(self.client_address, tuple) else ""

    def _reserve(self, n: int) -> None:
        if not self.server.budget.acquire(self._peer(), n):
            raise Rejected(503, "memory_limited", f"{n} more body bytes would pass the in-flight body budget; retry")
        self._reserved += n

    def _serve_one(self, post: bool) -> None:
        server = self.server
        media: str | None = None
        body_read = False
        grant = None
        try:
            if urlsplit(self.path).path == CAPTURE_PATH:
                self._capture_request(post)
                return
            signal = _PATHS.get(urlsplit(self.path).path)
            if signal is None:
                raise Rejected(404, "not_found", f"no such path: {self.path[:200]!r} (POST /v1/traces or /v1/metrics)")
            if not post:
                raise Rejected(405, "method_not_allowed", f"{self.command} {signal}: use POST")
            grant = authorized_grant(server.tokens, self.headers.get("Authorization"))
            if grant is None:
                raise Rejected(401, "unauthorized", "missing or wrong bearer token")
            media = media_type(self.headers.get("Content-Type"))
            length = self._content_length()
            self._reserve(length)
            body = self._read_body(length)
            body_read = True
            self._hold()  # from here the request is answered: the connection is not taken back
            data = decompress(body, self.headers.get("Content-Encoding"), server.max_body_bytes)
            if data is not body:
                self._reserve(len(data))
            del body
            message = parse_request(signal, data, media)
            rejected, note = server.collector.accept(signal, message, "http", grant)
            self._progressed()  # before the answer: a client that read its 200 finds it recorded
            self._reply(200, encode_response(signal, media, rejected, note), media)
        except Rejected as exc:
            self._refused(exc.reason, f"{exc.status} {exc.message}")
            large = False
            if not body_read and exc.status != 411:
                body_read = self._drain(_DRAIN_SMALL)
                large = not body_read
            payload, content_type = encode_error(media, exc.status, exc.message)
            extra = {"WWW-Authenticate": 'Bearer realm="steptrace-collector"'} if exc.status == 401 else {}
            if exc.status == 503:
                extra["Retry-After"] = "1"
            self._reply(exc.status, payload, content_type, close=not body_read, headers=extra)
            if large:
                # Answer first, then read what the client still sends: closing on unread data
                # resets the connection and the client sees a broken pipe, not our answer.
                self._drain(_DRAIN_LIMIT)
        except (OSError, TimeoutError):
            self.close_connection = True  # the client went away or stalled; nobody to answer
        except Exception:
            log.exception("steptrace collector: unexpected error handling %s %s", self.command, self.path[:200])
            server.collector.metrics.reject("internal")
            payload, content_type = encode_error(media, 500, "internal error")
            self._reply(500, payload, content_type, close=True)

    def _capture_request(self, post: bool) -> None:
        """``GET /v1/steptrace/capture?run_id=<run>&rank=<r>``: this rank's pending capture request (the
        collector's straggler verdict, collector/_captures.py), once. Same bearer token and run scope
        as the rank's OTLP export; no body is read."""
        server = self.server
        if post:
            raise Rejected(405, "method_not_allowed", f"{self.command} {CAPTURE_PATH}: use GET")
        grant = authorized_grant(server.tokens, self.headers.get("Authorization"))
        if grant is None:
            raise Rejected(401, "unauthorized", "missing or wrong bearer token")
        try:
            query = parse_qs(urlsplit(self.path).query, max_num_fields=4)
        except ValueError:  # parse_qs's answer to a fifth field
            raise Rejected(400, "malformed", f"{CAPTURE_PATH} takes at most 4 query fields: "
                                             "run_id=<run>&rank=<integer>") from None
        run_id = (query.get("run_id") or [""])[0]
        rank_text = (query.get("rank") or [""])[0]
        if not run_id or len(run_id) > 256:
            raise Rejected(400, "malformed", f"{CAPTURE_PATH} needs run_id=<run> and rank=<integer>")
        # str.isdigit() takes Arabic-Indic digits (which int() reads) and "²" (which int() refuses):
        # a rank is ASCII digits, as every sender writes it.
        if not (rank_text.isascii() and rank_text.isdigit()) or len(rank_text) > 9:
            raise Rejected(400, "malformed", f"{CAPTURE_PATH}: rank must be ASCII digits 0-9 (at most 9), "
                                             f"got {rank_text[:20]!r}")
        if not grant.allows(run_id):
            raise Rejected(403, "forbidden", "this token may not read that run")
        self._hold()  # answered from here: the connection is not taken back between the take and the reply
        request = server.collector.captures.take(run_id, int(rank_text))
        payload = json.dumps({"capture": request is not None, **(request or {})}).encode()
        self._progressed()
        self._reply(200, payload, "application/json")

    def _content_length(self) -> int:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise Rejected(411, "length_required", "chunked bodies are not accepted: send Content-Length")
        length = _declared_length(self.headers)
        if length is None:
            raise Rejected(411, "length_required", "Content-Length is required")
        if length > self.server.max_body_bytes:
            raise Rejected(413, "too_large", f"body of {length} bytes exceeds {self.server.max_body_bytes}")
        return length

    def _read_body(self, length: int, keep: bool = True) -> bytes:
        chunks = []
        remaining = length
        try:
            while remaining:
                chunk = self.rfile.read1(min(remaining, 1 << 16))
                if not chunk:
                    raise Rejected(400, "malformed", "connection closed before the body ended")
                if keep:
                    chunks.append(chunk)
                remaining -= len(chunk)
        except TimeoutError:
            self.timed_out = False  # answered here as 408, not counted again by handle_one_request
            raise Rejected(408, "timeout", f"body not received within {self.server.request_timeout_s:g} s") from None
        return b"".join(chunks)

    def _drain(self, limit: int) -> bool:
        """Read and discard a refused request's body, up to ``limit`` bytes and the deadline.

        Closing with unread data makes the kernel reset the connection, and the
        client may never see our answer. True when the whole body was read.
        """
        try:
            length = _declared_length(self.headers) or 0
        except Rejected:
            return False  # an ambiguous length: nothing to drain, the connection is closed
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return False
        try:
            if length > limit:
                self._read_body(limit, keep=False)
                return False
            self._read_body(length, keep=False)
        except (Rejected, OSError):
            self.timed_out = False
            return False
        return True

    def _reply(self, status: int, body: bytes, content_type: str, *, close: bool = False,
               headers: dict[str, str] | None = None) -> None:
        try:
            self.connection.settimeout(self.timeout)
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

