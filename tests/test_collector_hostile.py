"""The collector against hostile and broken peers: every bound holds, every refusal is counted.

Each test is one finding of the collector's security review, and failed on the
collector as it was before the fix (memory that grew with a rank's number, a
header phase without a deadline, a shared emitted-step memory, uncounted
refusals, forged spans that won, no TLS, a crash that lost open steps).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import tracemalloc
import urllib.error
import urllib.request

import pytest

pytest.importorskip("opentelemetry.proto",
                    reason="the collector needs opentelemetry-proto (pip install 'steptrace[otlp]')")
pytest.importorskip("prometheus_client",
                    reason="the collector needs prometheus_client (pip install 'steptrace[prometheus]')")

from collector_helpers import (
    PROTOBUF,
    FakeClock,
    body,
    collectors,
    post,
    raw_exchange,
    read_records,
    request,
    scrape,
    self_signed_cert,
    span,
    step_span,
    value,
    wait_for,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steptrace.collector import Collector, CollectorConfig
from steptrace.collector._decode import extract_steps
from steptrace.collector._join import Joiner
from steptrace.collector._ratelog import RateLimitedLog

TRACES = "/v1/traces"


@pytest.fixture
def make_collector(tmp_path):
    with collectors(tmp_path / "runs") as make:
        yield make


def cluster(c: Collector, run_id: str = "run", name: str = "cluster.jsonl"):
    from pathlib import Path

    return Path(c.config.run_dir) / run_id / name


def rejected(c: Collector, reason: str) -> float | None:
    return value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason=reason)


def invalid(c: Collector, reason: str) -> float | None:
    return value(scrape(c.metrics_url), "steptrace_collector_invalid_spans_total", reason=reason)


def send(c: Collector, *spans, headers=None) -> int:
    return post(c.port, TRACES, body(*spans), headers=headers)[0]


# -- what one span can make the collector hold --------------------------------------------------------------


def test_world_size_rank_and_step_beyond_their_caps_are_skipped_not_joined(make_collector):
    """A forged train.world_size of 5e7 once made a 439 MB line; a forged step 2**63-1 pinned last_step."""
    c = make_collector(max_world_size=1024)
    status, _, _ = post(c.port, TRACES, body(
        step_span(run_id="w", world_size=50_000_000),
        step_span(run_id="w", rank=(1 << 20) - 1, world_size=None),
        step_span(run_id="w", step=(1 << 63) - 1, world_size=1)))
    assert status == 200
    assert invalid(c, "world_size_out_of_range") == 1
    assert invalid(c, "rank_out_of_range") == 1
    assert invalid(c, "step_out_of_range") == 1
    assert value(scrape(c.metrics_url), "steptrace_cluster_last_step", run_id="w") is None
    c.close()
    assert not cluster(c, "w").exists()
    # Within the caps, the largest world size still joins.
    parsed = extract_steps(request(step_span(world_size=65536, rank=65535)))
    assert [(s.rank, s.world_size) for s in parsed.steps] == [(65535, 65536)]
    assert extract_steps(request(step_span(world_size=65537))).invalid == {"world_size_out_of_range": 1}
    assert extract_steps(request(step_span(step=(1 << 53) + 1))).invalid == {"step_out_of_range": 1}


def test_memory_per_remembered_step_does_not_grow_with_the_rank_number():
    """Rank 1,048,575 once cost 141 KiB per remembered step (a bitmask); rank 3, 4.4 KiB."""

    def cost(rank: int) -> int:
        joiner = Joiner(world_size=None, window_s=1.0, max_emitted=1000, clock=FakeClock())
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for step in range(300):
                joiner.add([span(step=step, rank=rank, world_size=None)])
            joiner.flush()
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    low, high = cost(3), cost(65535)
    assert high < 1.5 * low + 64 * 1024, (low, high)


def test_one_run_cannot_push_another_runs_emitted_steps_out():
    """A burst of 100k spans of one run once made another run's late span start its step again."""
    clock = FakeClock()
    joiner = Joiner(world_size=2, window_s=1.0, max_emitted=100, clock=clock)
    joiner.add([span(run_id="quiet", step=0, rank=0, world_size=2)])
    clock.now += 2
    [first] = joiner.expire().records
    assert (first["run_id"], first["complete"]) == ("quiet", False)
    for step in range(1000):
        joiner.add([span(run_id="busy", step=step, rank=r, world_size=2) for r in range(2)])
    result = joiner.add([span(run_id="quiet", step=0, rank=1, world_size=2)])
    assert [(r["type"], r["run_id"], r["step"]) for r in result.records] == [("late", "quiet", 0)]
    assert joiner.open_steps == 0


def test_requests_with_more_spans_than_the_limit_are_413_and_counted(make_collector):
    c = make_collector(world_size=1, max_spans_per_request=100)
    status, _, _ = post(c.port, TRACES, body(*[step_span(step=n, world_size=1) for n in range(101)]))
    assert status == 413
    assert rejected(c, "too_many_spans") == 1
    assert send(c, *[step_span(step=n, world_size=1) for n in range(100)]) == 200
    assert len(read_records(cluster(c))) == 100


def test_one_request_naming_many_runs_creates_at_most_max_runs_directories(make_collector, tmp_path):
    """5,000 run ids in one request once made 5,000 directories."""
    c = make_collector(world_size=1, max_runs=4)
    assert send(c, *[step_span(run_id=f"r{i}", world_size=1) for i in range(50)]) == 200
    assert invalid(c, "too_many_runs") == 46
    c.close()
    assert len(os.listdir(c.config.run_dir)) == 4
    # An admitted run keeps being served; an idle run gives its place up only after run_idle_s.
    clock = FakeClock()
    joiner = Joiner(world_size=1, max_runs=1, run_idle_s=60, clock=clock)
    assert joiner.add([span(run_id="a", world_size=1)]).refused == 0
    assert joiner.add([span(run_id="b", world_size=1)]).refused == 1
    clock.now += 61
    assert joiner.add([span(run_id="b", world_size=1)]).refused == 0


def test_one_token_cannot_take_every_run_slot(make_collector, tmp_path):
    """With 5,000 run ids under a token of its own, an attacker once kept the real job's run out."""
    c = make_collector(world_size=1, max_runs=8, token_file=token_file(tmp_path, "evil-token-1 evil-*\n"
                                                                                  "honest-token honest-*\n"))
    evil = {"Authorization": "Bearer evil-token-1"}
    assert send(c, *[step_span(run_id=f"evil-{i}", world_size=1) for i in range(100)], headers=evil) == 200
    assert invalid(c, "too_many_runs") == 98  # 8 // 4 = 2 runs for that token
    assert send(c, step_span(run_id="honest-run", world_size=1), headers={"Authorization": "Bearer honest-token"}) \
        == 200
    assert len(read_records(cluster(c, "honest-run"))) == 1


# -- connections: slots, deadlines and answers ------------------------------------------------------------


def test_slow_peers_cannot_take_every_connection_slot(make_collector):
    """1,030 sockets trickling header bytes once left correct senders nothing but 503 for a minute."""
    c = make_collector(world_size=1, max_connections=8, max_connections_per_peer=4)
    slow = []
    try:
        for _ in range(6):  # from another loopback address: one "peer"
            s = socket.create_connection(("127.0.0.1", c.port), timeout=5, source_address=("127.0.0.2", 0))
            s.sendall(b"POST /v1/traces HTTP/1.1\r\n")
            slow.append(s)
        time.sleep(0.2)
        answers = []
        for s in slow[4:]:
            try:
                answers.append(s.recv(4096))
            except OSError as exc:
                answers.append(repr(exc).encode())
        assert all(a.startswith(b"HTTP/1.1 503") or b"Reset" in a for a in answers), answers
        assert send(c, step_span(world_size=1)) == 200  # the honest peer still gets in
    finally:
        for s in slow:
            s.close()
    assert rejected(c, "peer_overloaded") == 2


def test_the_request_deadline_covers_the_headers(make_collector):
    """--request-timeout-s was not applied while headers were read: one byte per read-timeout held a slot."""
    c = make_collector(world_size=1, request_timeout_s=1.0)
    sock = socket.create_connection(("127.0.0.1", c.port), timeout=10)
    started = time.monotonic()
    closed_after = None
    try:
        for byte in b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.25)
                data = sock.recv(4096)
                if data == b"" or data.startswith(b"HTTP/1.1 408"):
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - started
                break
    finally:
        sock.close()
    # The deadline is 1 s; 10 s is the generous bound (it hung as long as bytes kept coming before).
    assert closed_after is not None and closed_after < 10
    assert wait_for(lambda: rejected(c, "timeout") == 1, 5)


# -- a distributed slow-loris: the server is full, honest peers are still served -------------------------

#: Nine "peers": Linux routes all of 127.0.0.0/8 on lo, so each source address is its own peer.
LORIS_PEERS = [f"127.0.0.{i}" for i in range(2, 11)]


def loris_socket(port: int, source: str, mode: str) -> socket.socket:
    """A connection that holds a slot without ever completing a request (``mode``), or, for
    ``keepalive``, after completing one (answered 200) and then sending nothing more."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if mode == "headers":  # the request line and half a header, then nothing
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    elif mode == "body":  # complete headers, 3 of 1000 body bytes
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: 1000\r\n\r\nabc")
    elif mode == "keepalive":
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: 0\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                return s  # refused and closed (a full collector that takes nothing back)
            answer += chunk
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += s.recv(4096)
    elif mode == "metrics":  # half a scrape request to /metrics
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    else:
        raise ValueError(mode)
    return s


def is_open(s: socket.socket) -> bool:
    """True when the collector neither answered nor closed ``s`` (nothing to read yet)."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)
    return False


def answer_of(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the collector sent on ``s`` before closing it (b"" for a close without an answer)."""
    s.settimeout(timeout_s)
    chunks = []
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def answered_within(call, deadline_s: float = 30.0):
    """``call()``'s first answer that is not a 503 or a connection error, retried until ``deadline_s``.

    The generous deadline is for "answered at all": while slow-loris sockets held every slot the
    answer was 503 for the whole attack (and past any deadline).
    """
    deadline = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = call()
        except (OSError, urllib.error.URLError) as exc:
            last = exc
            if isinstance(exc, urllib.error.HTTPError) and exc.code != 503:
                return exc.code
        else:
            if last != 503:
                return last
        time.sleep(0.2)
    return last


@pytest.mark.parametrize("mode", ["headers", "body", "keepalive"])
def test_a_distributed_slow_loris_does_not_keep_honest_peers_out(make_collector, mode):
    """Nine peers, each under its per-peer cap, once held every slot: honest ranks got 503 for the whole attack.

    Full, the collector takes back the connection that has gone longest without completing a
    request (those that never completed one first), oldest first, and closes it; a half-sent
    request on it is counted as ``evicted``, an idle keep-alive connection is no refusal.
    """
    c = make_collector(world_size=1, max_connections=12, max_connections_per_peer=3, request_timeout_s=120.0,
                       read_timeout_s=120.0)  # the sockets below stay quiet: no timeout frees a slot
    held = [loris_socket(c.port, peer, mode) for _ in range(2) for peer in LORIS_PEERS]  # 18 for 12 slots
    try:
        status = answered_within(lambda: send(c, step_span(world_size=1)))
        assert status == 200
        # The 6 sockets beyond the cap and the honest request each took back the oldest one.
        assert [answer_of(s) for s in held[:7]] == [b""] * 7  # closed (a retry goes to a fresh connection)
        assert wait_for(lambda: rejected(c, "evicted") == (0 if mode == "keepalive" else 7))
        assert [is_open(s) for s in held[7:]] == [True] * 11
        assert not rejected(c, "overloaded")
    finally:
        for s in held:
            s.close()
    # What was acknowledged is stored.
    [record] = read_records(cluster(c))
    assert (record["step"], record["ranks_reporting"]) == (0, 1)


def test_a_stalled_tls_handshake_is_taken_back_for_an_honest_https_request(make_collector, tmp_path):
    """Under TLS the handshake runs in the connection's thread: a stalled one is taken back like a stalled request."""
    made = self_signed_cert(tmp_path)
    if made is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = made
    c = make_collector(world_size=1, max_connections=2, max_connections_per_peer=2, tls_cert=str(cert),
                       tls_key=str(key), request_timeout_s=120.0, read_timeout_s=120.0)
    held = [socket.create_connection(("127.0.0.1", c.port), timeout=10, source_address=(peer, 0))
            for peer in LORIS_PEERS[:2]]
    try:
        held[0].sendall(b"\x16\x03\x01")  # the start of a TLS record, then nothing
        context = ssl.create_default_context(cafile=str(cert))

        def honest() -> int:
            req = urllib.request.Request(f"{c.endpoint}{TRACES}", data=body(step_span(world_size=1)),
                                         headers={"Content-Type": PROTOBUF}, method="POST")
            with urllib.request.urlopen(req, timeout=10, context=context) as response:
                return response.status

        assert answered_within(honest) == 200
        assert answer_of(held[0]) == b""  # the oldest was taken back
        assert is_open(held[1])

        def count(reason: str) -> float | None:
            return value(scrape_tls(c, context), "steptrace_collector_rejected_requests_total", reason=reason)

        # Before held[1] closes (a failed handshake then, counted as tls).
        assert wait_for(lambda: count("evicted") == 1)
        assert count("tls") == 0
    finally:
        for s in held:
            s.close()
    assert len(read_records(cluster(c))) == 1


def scrape_tls(c: Collector, context: ssl.SSLContext) -> str:
    with urllib.request.urlopen(c.metrics_url, timeout=10, context=context) as response:
        return response.read().decode()


def test_a_connection_that_completed_requests_outlives_slow_loris_sockets(make_collector):
    """Connections that never completed a request are taken back before one that did (an honest keep-alive)."""
    import http.client

    c = make_collector(world_size=1, max_connections=12, max_connections_per_peer=3, request_timeout_s=120.0,
                       read_timeout_s=120.0)  # the sockets below stay quiet: no timeout frees a slot
    honest = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
    held: list[socket.socket] = []
    try:
        honest.request("POST", TRACES, body=body(step_span(step=0, world_size=1)), headers={"Content-Type": PROTOBUF})
        assert honest.getresponse().read() is not None
        local = honest.sock.getsockname()
        held = [loris_socket(c.port, peer, "headers") for _ in range(2) for peer in LORIS_PEERS]
        assert wait_for(lambda: rejected(c, "evicted") == 7, 30)  # 18 + 1 for 12 slots
        # The honest connection, the oldest of all, is still there: same socket, answered 200.
        honest.request("POST", TRACES, body=body(step_span(step=1, world_size=1)), headers={"Content-Type": PROTOBUF})
        response = honest.getresponse()
        assert (response.status, honest.sock.getsockname()) == (200, local)
        response.read()
    finally:
        honest.close()
        for s in held:
            s.close()
    assert [r["step"] for r in read_records(cluster(c))] == [0, 1]


def test_a_request_being_answered_is_never_taken_back(make_collector):
    """A connection whose request is being made durable and answered keeps its slot: a newcomer gets 503 instead."""
    import threading

    c = make_collector(world_size=1, max_connections=2, max_connections_per_peer=2)
    inside = threading.Semaphore(0)
    release = threading.Event()
    accept = c.accept

    def slow_accept(*args, **kwargs):
        inside.release()
        release.wait(30)
        return accept(*args, **kwargs)

    c.accept = slow_accept  # type: ignore[method-assign]
    statuses: list[int] = []
    senders = [threading.Thread(target=lambda step=step: statuses.append(send(c, step_span(step=step, world_size=1))))
               for step in range(2)]
    for t in senders:
        t.start()
    try:
        for _ in senders:
            assert inside.acquire(timeout=30)
        # Both slots are busy answering: nothing may be taken back, the newcomer is refused.
        newcomer = raw_exchange(c.port, b"POST /v1/traces HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                                source="127.0.0.2")
        assert newcomer.startswith(b"HTTP/1.1 503"), newcomer
    finally:
        release.set()
        for t in senders:
            t.join(30)
    assert statuses == [200, 200]
    assert sorted(r["step"] for r in read_records(cluster(c))) == [0, 1]
    assert rejected(c, "overloaded") == 1 and not rejected(c, "evicted")


def test_metrics_scrapes_are_served_under_a_distributed_slow_loris(make_collector):
    """/metrics has the same bounded server: half-sent scrapes from nine peers once kept Prometheus out."""
    c = make_collector(world_size=1, request_timeout_s=120.0,
                       read_timeout_s=120.0)  # the sockets below stay quiet: no timeout frees a slot
    slots = c.limits.metrics
    per_peer = -(-(slots + 2) // len(LORIS_PEERS))  # enough to fill every slot, under the per-peer cap
    assert per_peer < max(1, min(16, slots // 2))
    held = [loris_socket(c.metrics_port, peer, "metrics") for _ in range(per_peer) for peer in LORIS_PEERS]
    try:
        def scrape_status() -> int:
            with urllib.request.urlopen(c.metrics_url, timeout=10) as response:
                return response.status

        assert answered_within(scrape_status) == 200
    finally:
        for s in held:
            s.close()


def test_grpc_connections_are_bounded_in_number_and_time(make_collector):
    """gRPC has no per-peer cap or eviction (see docs/collector.md), but every slot is held for a bounded time."""
    pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    c = make_collector(world_size=1, grpc_port=0, request_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", c.grpc_port), timeout=30)
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n")  # half a connection preface, then nothing
        started = time.monotonic()
        while s.recv(65536):  # the server's SETTINGS, then the close
            pass
        # Closed by the server's handshake/idle bound (--request-timeout-s); 30 s is only "closed at all".
        assert time.monotonic() - started < 30
    finally:
        s.close()


@pytest.mark.parametrize("client", ["urllib", "requests"])
def test_an_oversized_body_gets_its_413_through_standard_clients(make_collector, client):
    """The server once closed while the client was still sending: a broken pipe instead of the 413."""
    c = make_collector(world_size=1, max_body_bytes=64 * 1024)
    data = b"\0" * (8 << 20)
    url = f"{c.endpoint}{TRACES}"
    if client == "urllib":
        req = urllib.request.Request(url, data=data, headers={"Content-Type": PROTOBUF}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 413
    else:
        requests = pytest.importorskip("requests")
        response = requests.post(url, data=data, headers={"Content-Type": PROTOBUF}, timeout=30)
        assert response.status_code == 413
    assert rejected(c, "too_large") == 1


def test_refusals_the_standard_library_makes_are_counted(make_collector):
    """414, 431, malformed request lines and HTTP/2 prefaces once left rejected_requests_total unchanged."""
    c = make_collector(world_size=1)
    cases = [
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"414", "uri_too_long"),
        (b"POST /v1/traces HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n", b"431",
         "headers_too_large"),
        (b"POST /v1/traces HTTP/1.1 extra\r\n\r\n", b"400", "malformed"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"505", "unsupported_version"),
    ]
    for data, status, reason in cases:
        answer = raw_exchange(c.port, data)
        # A bad version line is answered HTTP/0.9 style (no status line): the code is in the body.
        assert answer.split(b" ", 2)[1] == status or b"Error code: " + status in answer, (reason, answer[:100])
        assert rejected(c, reason) >= 1, reason
    raw_exchange(c.port, b"GARBAGE\r\n\r\n")  # an HTTP/0.9 line: answered without a status line, still counted
    assert rejected(c, "malformed") == 2
    assert send(c, step_span(world_size=1)) == 200


def test_refusals_log_one_line_per_reason_not_one_per_request():
    clock = FakeClock()
    logger = logging.getLogger("steptrace.test.ratelog")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    try:
        limited = RateLimitedLog(logger, 10.0, clock=clock)
        assert limited.warning("malformed", "bad body from %s", "a")
        for _ in range(99):
            assert not limited.warning("malformed", "bad body from %s", "a")
        assert limited.warning("timeout", "slow")  # another reason has its own budget
        clock.now += 10
        assert limited.warning("malformed", "bad body from %s", "b")
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert messages == ["bad body from a", "slow", "bad body from b (99 more like it in the last 10s not logged)"]
    assert all(r.exc_info is None for r in records)


def test_grpc_refusals_are_counted_and_log_no_traceback(make_collector, caplog):
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    c = make_collector(world_size=1, grpc_port=0, max_spans_per_request=2)
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                export(b"\x12\x34garbage", timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            export(body(*[step_span(step=n, world_size=1) for n in range(3)]), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        export(body(step_span(world_size=1)), timeout=5)
    assert rejected(c, "malformed") == 3
    assert rejected(c, "too_many_spans") == 1
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert len(read_records(cluster(c))) == 1


# -- forged spans, tokens, TLS ------------------------------------------------------------------------------


def test_a_forged_span_hides_a_rank_but_never_stands_in_for_it(make_collector):
    """A forged rank-0 span arriving first once made the real one a duplicate: straggler 0, skew 999 s."""
    c = make_collector(world_size=2)
    assert send(c, step_span(rank=0, compute=999.0, world_size=2)) == 200  # the forgery, first
    assert send(c, step_span(rank=0, compute=0.1, world_size=2), step_span(rank=0, compute=0.1, world_size=2),
                step_span(rank=1, compute=0.2, world_size=2)) == 200
    [record] = read_records(cluster(c))
    assert record["conflicting_ranks"] == [0] and record["missing_ranks"] == [0]
    assert not record["complete"] and record["straggler_rank"] is None
    assert record["ranks_reporting"] == 1 and record["compute_max_seconds"] == 0.2 and record["skew_seconds"] == 0
    conflicts = read_records(cluster(c, name="conflicts.jsonl"))
    assert sorted(r["compute_seconds"] for r in conflicts) == [0.1, 0.1, 999.0]
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_collector_conflicting_spans_total", run_id="run") == 3
    assert value(text, "steptrace_cluster_straggler_rank", run_id="run") is None
    # An identical retry of an emitted step stays a harmless duplicate; a different one is a conflict.
    assert send(c, step_span(rank=1, compute=0.2, world_size=2)) == 200
    assert send(c, step_span(rank=1, compute=5.0, world_size=2)) == 200
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_collector_duplicate_spans_total", run_id="run") == 1
    assert value(text, "steptrace_collector_conflicting_spans_total", run_id="run") == 4
    assert len(read_records(cluster(c))) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.sampled_from([0.1, 0.5, 9.0])), max_size=40),
       st.integers(0, 39))
def test_fuzz_no_step_is_written_twice_and_no_conflicting_value_is_joined(events, expire_at):
    clock = FakeClock()
    joiner = Joiner(world_size=3, window_s=1.0, clock=clock, per_rank=True)
    records, conflicts = [], []
    seen: dict[tuple[int, int], set[float]] = {}
    for i, (step, rank, compute) in enumerate(events):
        seen.setdefault((step, rank), set()).add(compute)
        result = joiner.add([span(step=step, rank=rank, compute=compute)])
        records += result.records
        conflicts += result.conflicts
        if i == expire_at:
            clock.now += 2
            records += joiner.expire().records
    records += joiner.flush().records
    steps = [r["step"] for r in records if r["type"] == "cluster_step"]
    assert len(steps) == len(set(steps))
    for r in records:
        if r["type"] != "cluster_step":
            continue
        for rank in r["rank_compute_seconds"]:
            assert len(seen[(r["step"], int(rank))]) == 1 or int(rank) not in r["conflicting_ranks"]
        for rank in r["conflicting_ranks"]:
            assert str(rank) not in r["rank_compute_seconds"] and len(seen[(r["step"], rank)]) > 1
    assert all(len(seen[(c["step"], c["rank"])]) > 1 for c in conflicts)


def token_file(tmp_path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_scoped_tokens_write_only_their_runs(make_collector, tmp_path):
    c = make_collector(world_size=1, token_file=token_file(tmp_path, "# token runs\njob-a-token job-a-*\n"
                                                                      "admin-token-123\n"))
    job_a = {"Authorization": "Bearer job-a-token"}
    assert send(c, step_span(run_id="job-a-1", world_size=1), headers=job_a) == 200
    assert send(c, step_span(run_id="job-b-1", world_size=1), headers=job_a) == 403
    assert send(c, step_span(run_id="job-a-1", step=1, world_size=1), step_span(run_id="job-b-1", world_size=1),
                headers=job_a) == 403  # one foreign span refuses the whole request
    assert send(c, step_span(run_id="job-b-1", world_size=1), headers={"Authorization": "Bearer admin-token-123"}) \
        == 200
    assert send(c, step_span(run_id="job-a-1", world_size=1)) == 401
    assert rejected(c, "forbidden") == 2 and rejected(c, "unauthorized") == 1
    assert len(read_records(cluster(c, "job-a-1"))) == 1 and len(read_records(cluster(c, "job-b-1"))) == 1
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    g = make_collector(world_size=1, grpc_port=0, token_file=c.config.token_file, run_dir=str(tmp_path / "g"))
    with grpc.insecure_channel(f"127.0.0.1:{g.grpc_port}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as info:
            export(body(step_span(run_id="job-b-2", world_size=1)), timeout=5, metadata=[("authorization",
                                                                                         "Bearer job-a-token")])
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert rejected(g, "forbidden") == 1


def test_bad_token_files_fail_at_construction_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="token_file"):
        Collector(CollectorConfig(token_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="token_file.*no token"):
        Collector(CollectorConfig(token_file=token_file(tmp_path, "# nothing\n\n")))
    with pytest.raises(ValueError, match="tls_cert"):
        CollectorConfig(tls_cert="x.pem")


def test_metrics_can_require_a_token(make_collector, tmp_path):
    c = make_collector(world_size=1, metrics_token_file=token_file(tmp_path, "scrape-token-1\n"))
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(c.metrics_url, timeout=10)
    assert info.value.code == 401
    req = urllib.request.Request(c.metrics_url, headers={"Authorization": "Bearer scrape-token-1"})
    with urllib.request.urlopen(req, timeout=10) as response:
        text = response.read().decode()
    assert value(text, "steptrace_collector_rejected_requests_total", reason="unauthorized") == 1


def test_tls_on_http_grpc_and_metrics(make_collector, tmp_path):
    made = self_signed_cert(tmp_path)
    if made is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = made
    c = make_collector(world_size=1, tls_cert=str(cert), tls_key=str(key), grpc_port=0)
    assert c.endpoint.startswith("https://") and c.metrics_url.startswith("https://")
    context = ssl.create_default_context(cafile=str(cert))
    req = urllib.request.Request(f"{c.endpoint}{TRACES}", data=body(step_span(world_size=1)),
                                 headers={"Content-Type": PROTOBUF}, method="POST")
    with urllib.request.urlopen(req, timeout=10, context=context) as response:
        assert response.status == 200
    # Plain HTTP on the TLS port is refused and counted.
    raw_exchange(c.port, b"POST /v1/traces HTTP/1.1\r\nContent-Length: 0\r\n\r\n", timeout=5)
    with urllib.request.urlopen(c.metrics_url, timeout=10, context=context) as response:
        text = response.read().decode()
    assert value(text, "steptrace_collector_rejected_requests_total", reason="tls") == 1
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{c.grpc_port}", credentials) as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        export(body(step_span(step=1, world_size=1)), timeout=10)
    assert len(read_records(cluster(c))) == 2


# -- crashes ----------------------------------------------------------------------------------------------


def start_collector(run_dir, *extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "steptrace.collector", "--port", "0", "--metrics-port", "0",
                             "--world-size", "3", "--window-s", "60", "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert line.startswith("steptrace collector: otlp_http=127.0.0.1:"), line
    return proc, int(line.split("otlp_http=127.0.0.1:")[1].split()[0])


def test_a_killed_collector_loses_no_span_it_acknowledged(tmp_path):
    """Steps open at a SIGKILL once came back incomplete: their first ranks were gone."""
    run_dir = tmp_path / "runs"
    proc, port = start_collector(run_dir)
    try:
        assert post(port, TRACES, body(*[step_span(step=s, rank=r) for s in range(3) for r in range(3)]))[0] == 200
        assert post(port, TRACES, body(step_span(step=3, rank=0), step_span(step=3, rank=1)))[0] == 200
        assert post(port, TRACES, body(step_span(step=4, rank=2)))[0] == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    proc, port = start_collector(run_dir)
    try:
        # A retry of what the first one already wrote, and the ranks still missing.
        assert post(port, TRACES, body(step_span(step=2, rank=1), step_span(step=3, rank=2),
                                       step_span(step=4, rank=0), step_span(step=4, rank=1)))[0] == 200
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdout.close()
    records = [r for r in read_records(run_dir / "run" / "cluster.jsonl") if r["type"] == "cluster_step"]
    assert [(r["step"], r["complete"]) for r in records] == [(0, True), (1, True), (2, True), (3, True), (4, True)]
    assert (run_dir / "run" / "journal.jsonl").stat().st_size == 0  # every step emitted: nothing to replay


@pytest.mark.parametrize("arrays, expected", [
    ((("0", "0"), (1, 2), (0.01, -1.0)), (("0", 1, 0.01), ("0", 2, None))),
    ((("0",) * 65, tuple(range(1, 66)), (0.01,) * 65), None),  # past the bound a span may bring
    ((("0", "0"), (1,), (0.01, 0.02)), None),  # not one length
    ((("0",), (0,), (0.01,)), None),  # a sequence number starts at 1
    ((("",), (1,), (0.01,)), None),  # an empty group name
    ((("0",), ("1",), (0.01,)), None),  # a string where a number goes
])
def test_a_span_s_collectives_are_taken_only_as_the_exporter_sends_them(arrays, expected):
    """``train.collectives.*``: three arrays of one length, at most OTLP_MAX_COLLECTIVES; anything else
    leaves the span without collectives (the join claims no wait) and never rejects the span."""
    from collector_helpers import request, step_span

    from steptrace.collector._decode import extract_steps

    groups, seqs, seconds = arrays
    span = step_span(world_size=2, **{"train.collectives.group": groups, "train.collectives.seq": seqs,
                                      "train.collectives.device_seconds": seconds})
    (decoded,) = extract_steps(request(span)).steps
    assert decoded.collectives == expected


@pytest.mark.parametrize("seconds", [-0.5, 1e308, float("inf"), float("nan")])
def test_collective_seconds_that_cannot_be_a_duration_refuse_the_export(seconds):
    """Negative (but the -1 of "not measured"), huge, infinite or NaN device seconds are no duration: the
    decoder refuses the export (400, bad_duration) rather than let the join sum them."""
    from collector_helpers import request, step_span

    from steptrace.collector._decode import Rejected, extract_steps

    span = step_span(world_size=2, **{"train.collectives.group": ("0", "0"), "train.collectives.seq": (1, 2),
                                      "train.collectives.device_seconds": (0.01, seconds)})
    with pytest.raises(Rejected) as refused:
        extract_steps(request(span))
    assert (refused.value.status, refused.value.reason) == (400, "bad_duration")
    assert "train.collectives.device_seconds" in str(refused.value) and "rank 0, step 0" in str(refused.value)


# -- values that cannot be durations, queries that cannot be parsed (issue 48) -------------------------------


def _collectives(seconds):
    return {"train.collectives.group": ("0",) * len(seconds),
            "train.collectives.seq": tuple(range(1, len(seconds) + 1)),
            "train.collectives.device_seconds": tuple(seconds)}


def test_one_rank_s_huge_durations_are_refused_and_every_other_rank_keeps_its_step(make_collector, caplog):
    """Finite but huge collective device seconds (1e308) from one rank once overflowed the join's sum
    (math.fsum): the honest rank that completed the step got a 500 and the step was missing from
    cluster.jsonl for every rank. The decoder now refuses that export (400, bad_duration) and the honest
    ranks' step is joined and written (rank 1 missing), with finite figures."""
    c = make_collector(world_size=3)
    caplog.set_level(logging.DEBUG)
    honest = _collectives((0.010, 0.020))
    assert send(c, step_span(rank=1, world_size=3, **_collectives((1e308, 1e308)))) == 400
    assert send(c, step_span(rank=0, world_size=3, **honest)) == 200
    assert send(c, step_span(rank=2, world_size=3, **honest)) == 200
    assert rejected(c, "bad_duration") == 1
    assert rejected(c, "internal") in (None, 0)
    c.close()
    [record] = [r for r in read_records(cluster(c)) if r["type"] == "cluster_step"]
    assert (record["step"], record["ranks_reporting"], record["missing_ranks"]) == (0, 2, [1])
    assert record["compute_sum_seconds"] == pytest.approx(0.2)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


@pytest.mark.parametrize("attribute, number", [
    ("train.compute_seconds", 1e308), ("train.interval_seconds", -0.5), ("train.compute_seconds", float("nan")),
    ("train.collective_wait_seconds", float("inf")), ("train.exposed_communication_seconds", 2e7),
    ("train.own_compute_seconds", -1.0)])
def test_a_value_that_cannot_be_a_duration_refuses_the_export_naming_it(make_collector, attribute, number):
    c = make_collector(world_size=1)
    extra = {"train.collective_wait_seconds": 0.0} if attribute == "train.own_compute_seconds" else {}
    status, _, answer = post(c.port, TRACES, body(step_span(world_size=1, **{**extra, attribute: number})))
    assert status == 400 and attribute.encode() in answer
    assert send(c, step_span(step=1, world_size=1, compute=1e7, interval=1e7)) == 200  # the bound itself is a duration
    c.close()
    assert [r["step"] for r in read_records(cluster(c)) if r["type"] == "cluster_step"] == [1]


def test_the_join_s_sums_stay_finite_for_the_largest_durations_the_decoder_takes():
    """Bounded arithmetic: at the decoder's bound on every duration, the join's sums over the most ranks
    and collectives a step may have are finite (and fsum exact), far from overflow."""
    from steptrace.collector._decode import MAX_DURATION_SECONDS, OTLP_MAX_COLLECTIVES
    from steptrace.collector._join import cluster_record

    import dataclasses

    ranks = 64
    collectives = tuple(("0", n, MAX_DURATION_SECONDS) for n in range(1, OTLP_MAX_COLLECTIVES + 1))
    spans = [dataclasses.replace(span(rank=r, world_size=ranks, compute=MAX_DURATION_SECONDS,
                                      interval=MAX_DURATION_SECONDS),
                                 collectives=collectives if r else tuple((g, s, 0.0) for g, s, _ in collectives))
             for r in range(ranks)]
    record = cluster_record("run", 0, "", ranks, spans, reason="complete", first_seen_time=0.0, joined_time=0.0,
                            join_seconds=0.0)
    assert record["compute_sum_seconds"] == ranks * MAX_DURATION_SECONDS
    assert record["collective_wait_max_seconds"] == MAX_DURATION_SECONDS  # capped at the step's compute


@pytest.mark.parametrize("query, why", [
    ("run_id=run&rank=1&a=1&b=2&c=3", b"at most 4"),
    ("run_id=run&rank=\u0661", b"ASCII"),  # Arabic-Indic one: str.isdigit() and int() take it
    ("run_id=run&rank=%D9%A1%D9%A2", b"ASCII"),
    ("run_id=run&rank=\u00b2", b"ASCII"),  # superscript two: isdigit() True, int() raises
])
def test_capture_queries_that_cannot_be_parsed_answer_400_without_a_traceback(make_collector, caplog, query, why):
    import http.client
    import urllib.parse

    c = make_collector()
    caplog.set_level(logging.DEBUG)
    c.captures.verdict("run", culprit=1, reference=0, step=9, detail="")
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=10)
    conn.request("GET", "/v1/steptrace/capture?" + urllib.parse.quote(query, safe="=&%"))
    response = conn.getresponse()
    answer = response.read()
    conn.close()
    assert response.status == 400 and why in answer
    assert rejected(c, "malformed") == 1 and rejected(c, "internal") in (None, 0)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_a_stall_span_s_line_numbers_are_read_as_ascii_digits_only():
    """A stall span's stack line ``f.py:²³ in g`` passed str.isdigit() and failed int(): the whole
    export answered 500. Now a line number that is not ASCII digits reads as 0."""
    stack = "train.py:\u00b2\u00b3 in step\ntrain.py:" + "9" * 5000 + " in loop\ntrain.py:12 in main"
    stall = step_span(name="train.stall", world_size=1, **{"train.stall.stack": stack})
    (decoded,) = extract_steps(request(stall)).stalls
    assert [f[1] for f in decoded["threads"][0]["frames"]] == [0, 0, 12]


def test_a_bubble_ratio_outside_0_1_is_left_out_so_the_ranks_mean_stays_a_ratio():
    """Two ranks' finite 1e308 bubble ratios once summed to inf in the join's mean over ranks."""
    from steptrace.collector._join import cluster_record

    spans = extract_steps(request(*[step_span(rank=r, world_size=2, bubble={"0": 1e308, "1": 0.25 * (r + 1)})
                                    for r in range(2)])).steps
    assert [s.bubble for s in spans] == [{"1": 0.25}, {"1": 0.5}]
    record = cluster_record("run", 0, "", 2, spans, reason="complete", first_seen_time=0.0, joined_time=0.0,
                            join_seconds=0.0)
    assert record["pipeline_bubble_ratio"] == {"1": 0.375}
