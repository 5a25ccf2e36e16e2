"""A bounded soak of one steptrace collector: honest ranks next to hostile peers.

Usage::

    .venv/bin/python bench/collector_soak.py                 # 30 s
    .venv/bin/python bench/collector_soak.py --seconds 10 --json out.json

What runs
---------
One real collector process (``python -m steptrace.collector``, defaults except ports 0,
``--world-size 8``, ``--window-s 5``, a ``--token-file`` with a token scoped to ``honest-*``, one
scoped to ``evil-*``, one to ``amp-*`` and nothing else) on 127.0.0.1. Against it, for ``--seconds``:

* **honest ranks** (this process): 8 threads, one per rank, each posting its ``train.step`` span
  of step ``k`` (OTLP/HTTP protobuf, its own keep-alive connection, the honest token) at
  ``--rate`` steps/s (10). Each request's latency and answer are recorded; a connection error
  is a failure, and the rank reconnects. They start once the slow-loris holds its sockets.
* **a newcomer** (this process): every 0.5 s a fresh connection posts one step of its own run
  (``honest-fresh``, world size 1), so every answer it gets went through admission while the
  collector was full: "is a new honest request served during the attack".
* **hostile peers** (a child process, threads), each from its own loopback address, so the
  per-peer connection cap applies to them and not to the honest ranks (127.0.0.1):

  - *distributed slow-loris* (``--loris-peers`` (9) peers, 127.0.1.2 and up, Linux routes all of
    127/8 on lo): each keeps ``--loris`` (120) sockets open, under the per-peer cap (128), 1,080 in
    all for the collector's 736 OTLP/HTTP slots at ``ulimit -n 1024``. A third trickle one header
    byte per second, a third send complete headers (with the forger's token) and then one body
    byte per second, a third complete one request (200, the forger's token, no spans) and then sit
    idle on the keep-alive connection; each one the collector closes is reopened the next second;
  - *huge* (127.0.0.3): in a loop, a 15 MiB body of garbage (under ``--max-body-bytes``, so
    it is read and decoded: 400), a 64 MiB ``Content-Length`` (413), and a request of 100,000
    ``train.step`` spans (413 too_many_spans): the 100k-span request that once stalled
    everyone for 10 s;
  - *forger* (127.0.0.4): with the ``evil-*`` token, spans of ``honest-run`` (403), spans of
    5,000 fresh run ids of its own (runs beyond --max-runs refused), world size 5e7 and step
    2**63-1 spans; and, as an insider holding the honest token, a rank-0 span with compute
    999 s for each step just ahead of the honest one (a conflict, never a straggler);
  - *garbage* (127.0.0.5): random bytes as protobuf, HTTP/2 prefaces, 70 KB request lines,
    150-header requests, wrong tokens, duplicate / conflicting / ``+N`` / ``3_0_8``
    ``Content-Length`` headers (400);
  - *amplifier* (127.0.0.6, a token of its own for ``amp-*``): one-rank steps claiming world size 65,536
    (once a 65,535-entry ``missing_ranks`` per step, built under the lock: 2.2 GiB; under
    ``--world-size`` the claim is ignored, so here it only adds open steps), and complete
    steps whose every rank names 256 fresh pipeline stages (once a series each; now at most
    64 per run, the rest counted in ``dropped_label_values_total``);
  - *half-bodies* (127.0.0.7): keeps ``--half-bodies`` (32) connections that announce a 15 MiB
    body and send 1 MiB of it (once 2 GiB held for 128 of them), reopening what is closed;
  - *idle* (127.0.0.8): keeps ``--idle`` (400) connections open that send nothing, against the
    collector's file descriptors (it runs under ``ulimit -n`` ``--nofile``, 1024);
  - the *forger* also re-sends all ranks of a written honest step with other numbers and ends
    two minutes on (once a second record that stood), and sends steps ahead of the run with
    ends a day in the future (``end_out_of_range``).

What is printed
---------------
The honest senders' success rate (HTTP 200 / requests), 503s, and latency p50/p99/max, the same
for the newcomer; acknowledged vs stored (every (step, rank) answered 200 must be in
``cluster.jsonl``, as a reporting rank or a late record, or in ``conflicts.jsonl``); the
share of honest steps written complete with no conflicting ranks and no rank-0 straggler
named from a forged span; honest steps written twice (must be 0); the collector's RSS
(sampled from ``/proc``, start and peak); how many requests each hostile peer got answered; the collector's
``rejected_requests_total`` and ``invalid_spans_total`` by reason, and conflicts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from steptrace._ids import span_id, trace_id

WORLD = 8
HONEST_TOKEN = "honest-token-0123456789"
EVIL_TOKEN = "evil-token-0123456789"
AMP_TOKEN = "amp-token-0123456789"  # the amplifier's own, so the forger's 5,000 runs do not crowd it out
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _attr(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return KeyValue(key=key, value=AnyValue(string_value=str(value)))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


def step_span(run_id: str, step: int, rank: int, compute: float, world_size: int = WORLD, *,
              end_offset_s: float = 0.0, stages: tuple[str, ...] = ()) -> Span:
    end_ns = time.time_ns() + int(end_offset_s * 1e9)
    attrs = {"train.run_id": run_id, "train.step": step, "train.rank": rank, "train.world_size": world_size,
             "train.compute_seconds": compute, "train.interval_seconds": 0.1, "train.idle_seconds": 0.1 - compute,
             "train.status": "ok", **{f"train.pipeline.bubble_ratio.{stage}": 0.1 for stage in stages}}
    return Span(trace_id=trace_id(run_id, min(step, 1 << 62)).to_bytes(16, "big"),
                span_id=span_id(run_id, min(step, 1 << 62), rank, "step").to_bytes(8, "big"), name="train.step",
                start_time_unix_nano=end_ns - 100_000_000, end_time_unix_nano=end_ns,
                attributes=[_attr(k, v) for k, v in attrs.items()])


def body(*spans: Span) -> bytes:
    request = ExportTraceServiceRequest()
    rs = ResourceSpans()
    rs.scope_spans.append(ScopeSpans(spans=list(spans)))
    request.resource_spans.append(rs)
    return request.SerializeToString()


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- honest ranks ---------------------------------------------------------------------------------


def honest_rank(port: int, rank: int, rate: float, go: float, stop: float, out: list[tuple[float, int, int]]) -> None:
    headers = {**PROTOBUF, "Authorization": f"Bearer {HONEST_TOKEN}"}
    conn = None
    step = 0
    while True:
        due = go + step / rate
        if due >= stop:
            break
        time.sleep(max(0.0, due - time.monotonic()))
        data = body(step_span("honest-run", step, rank, 0.05 + 0.001 * rank))
        started = time.monotonic()
        status = 0
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/traces", body=data, headers=headers)
            response = conn.getresponse()
            response.read()
            status = response.status
            if response.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = None
        except OSError:
            if conn is not None:
                conn.close()
            conn = None
        out.append((time.monotonic() - started, status, step))
        step += 1
    if conn is not None:
        conn.close()


def newcomer(port: int, interval_s: float, stop: float, out: list[tuple[float, int, int]]) -> None:
    """Every ``interval_s`` a fresh connection posts one step of ``honest-fresh``: (latency, status, step)."""
    headers = {**PROTOBUF, "Authorization": f"Bearer {HONEST_TOKEN}", "Connection": "close"}
    step = 0
    go = time.monotonic()
    while True:
        due = go + step * interval_s
        if due >= stop:
            break
        time.sleep(max(0.0, due - time.monotonic()))
        data = body(step_span("honest-fresh", step, 0, 0.05, world_size=1))
        started = time.monotonic()
        status = 0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("POST", "/v1/traces", body=data, headers=headers)
            response = conn.getresponse()
            response.read()
            status = response.status
        except OSError:
            pass
        finally:
            conn.close()
        out.append((time.monotonic() - started, status, step))
        step += 1


# -- hostile peers ----------------------------------------------------------------------------------


def _connect(port: int, source: str, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def _exchange(port: int, source: str, data: bytes) -> bytes:
    try:
        with _connect(port, source, 10.0) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
    except OSError:
        return b""


def _post(port: int, source: str, data: bytes, token: str | None = None, length: int | str | None = None,
          extra: str = "") -> bytes:
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(data) if length is None else length}\r\n{extra}"
            + (f"Authorization: Bearer {token}\r\n" if token else "") + "Connection: close\r\n\r\n").encode()
    return _exchange(port, source, head + data)


LORIS_MODES = ("headers", "body", "keepalive")


def _loris_open(port: int, source: str, mode: str, tally: dict[str, int]) -> socket.socket | None:
    """One slow-loris socket in ``mode`` (its first bytes sent); None when it could not connect."""
    try:
        s = _connect(port, source, 2.0)
    except OSError:
        tally["connect_failed"] = tally.get("connect_failed", 0) + 1
        return None
    try:
        if mode == "headers":
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        elif mode == "body":
            s.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                      f"Authorization: Bearer {EVIL_TOKEN}\r\nContent-Length: 100000\r\n\r\n".encode())
        else:  # one complete request (answered 200), then idle on the keep-alive connection
            s.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                      f"Authorization: Bearer {EVIL_TOKEN}\r\nContent-Length: 0\r\n\r\n".encode())
    except OSError:
        s.close()
        tally["connect_failed"] = tally.get("connect_failed", 0) + 1
        return None
    s.setblocking(False)
    tally[f"{mode}:opened"] = tally.get(f"{mode}:opened", 0) + 1
    return s


def distributed_loris(port: int, peers: list[str], per_peer: int, stop: float, tally: dict[str, int],
                      ready: Any) -> None:
    """``per_peer`` sockets from each of ``peers``, in the three modes in turn, reopened once closed.

    Headers and body sockets send one byte a second; a keep-alive socket reads its one 200 and then
    sends nothing. A socket that reads a 503, or the end of the stream, was closed by the collector.
    """
    slots = [(peer, LORIS_MODES[i % len(LORIS_MODES)]) for i in range(per_peer) for peer in peers]
    socks: list[socket.socket | None] = [None] * len(slots)
    answered = [False] * len(slots)  # a keep-alive socket got its 200
    first = True
    while time.monotonic() < stop:
        for i, (peer, mode) in enumerate(slots):
            s = socks[i]
            if s is None:
                socks[i] = _loris_open(port, peer, mode, tally)
                answered[i] = False
                continue
            try:
                seen = s.recv(65536)
            except BlockingIOError:
                seen = None
            except OSError:
                seen = b""
            if seen and mode == "keepalive" and not answered[i] and seen.startswith(b"HTTP/1.1 200"):
                answered[i] = True  # its request is done: from now on it only holds the connection
                tally["keepalive:answered_200"] = tally.get("keepalive:answered_200", 0) + 1
                continue
            if seen is not None:
                key = "answered_503" if seen.startswith(b"HTTP/1.1 503") else "closed"
                tally[f"{mode}:{key}"] = tally.get(f"{mode}:{key}", 0) + 1
                s.close()
                socks[i] = None
                continue
            if mode != "keepalive":
                try:
                    s.send(b"a")
                except OSError:
                    pass  # seen as closed next round
        if first:
            ready.set()
            first = False
        time.sleep(max(0.0, min(1.0, stop - time.monotonic())))
    for s in socks:
        if s is not None:
            s.close()


def huge(port: int, stop: float, tally: dict[str, int]) -> None:
    garbage = os.urandom(15 << 20)
    many = body(*[step_span("huge-run", n, 0, 0.05) for n in range(100_000)])
    cases = [("garbage_15MiB", lambda: _post(port, "127.0.0.3", garbage, HONEST_TOKEN)),
             ("claims_64MiB", lambda: _post(port, "127.0.0.3", b"\0" * (1 << 20), HONEST_TOKEN, length=64 << 20)),
             ("spans_100k", lambda: _post(port, "127.0.0.3", many, HONEST_TOKEN))]
    while time.monotonic() < stop:
        for name, send in cases:
            answer = send()
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
            tally[f"{name}:{status}"] = tally.get(f"{name}:{status}", 0) + 1


def forger(port: int, stop: float, tally: dict[str, int], rate: float, go: float) -> None:
    n = 0
    while time.monotonic() < stop:
        step = int((time.monotonic() - go) * rate) + 1  # just ahead of the honest ranks
        cases = [("other_run", body(step_span("honest-run", step, 3, 0.05)), EVIL_TOKEN),
                 ("many_runs", body(*[step_span(f"evil-{n}-{i}", 0, 0, 0.05, 1) for i in range(5000)]), EVIL_TOKEN),
                 ("world_5e7", body(step_span("evil-big", step, 0, 0.05, 50_000_000)), EVIL_TOKEN),
                 ("step_2e63", body(step_span("evil-big", (1 << 63) - 1, 0, 0.05)), EVIL_TOKEN),
                 ("insider_rank0", body(step_span("honest-run", step, 0, 999.0)), HONEST_TOKEN),
                 # All ranks of a step written a second ago, other numbers, ends two minutes on.
                 ("insider_rewrite", body(*[step_span("honest-run", max(0, step - 20), r, 7.0, end_offset_s=120)
                                            for r in range(WORLD)]), HONEST_TOKEN),
                 # The run's next steps, sent ahead with ends a day in the future.
                 ("insider_ahead", body(*[step_span("honest-run", step + 50 + i, r, 5.0, end_offset_s=86400)
                                          for i in range(10) for r in range(WORLD)]), HONEST_TOKEN)]
        for name, data, token in cases:
            answer = _post(port, "127.0.0.4", data, token)
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
            tally[f"{name}:{status}"] = tally.get(f"{name}:{status}", 0) + 1
        n += 1
        time.sleep(0.2)


def garbage(port: int, stop: float, tally: dict[str, int]) -> None:
    rng = random.Random(0)
    cases = [("random_body", lambda: _post(port, "127.0.0.5", rng.randbytes(rng.randrange(1, 4096)), HONEST_TOKEN)),
             ("http2_preface", lambda: _exchange(port, "127.0.0.5", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")),
             ("long_line", lambda: _exchange(port, "127.0.0.5", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")),
             ("many_headers", lambda: _exchange(port, "127.0.0.5", b"POST /v1/traces HTTP/1.1\r\n"
                                                + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n")),
             ("wrong_token", lambda: _post(port, "127.0.0.5", b"", "wrong-token-000")),
             ("duplicate_length", lambda: _post(port, "127.0.0.5", b"\0" * 10, HONEST_TOKEN, 10,
                                                "Content-Length: 15\r\n")),
             ("plus_length", lambda: _post(port, "127.0.0.5", b"\0" * 10, HONEST_TOKEN, "+10")),
             ("underscore_length", lambda: _post(port, "127.0.0.5", b"\0" * 10, HONEST_TOKEN, "1_0"))]
    while time.monotonic() < stop:
        for name, send in cases:
            answer = send()
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
            tally[f"{name}:{status}"] = tally.get(f"{name}:{status}", 0) + 1
        time.sleep(0.05)


def amplifier(port: int, stop: float, tally: dict[str, int]) -> None:
    n = 0
    while time.monotonic() < stop:
        cases = [("world_65536", body(*[step_span(f"amp-world-{n % 8}", n * 64 + i, 0, 0.05, 65536)
                                        for i in range(64)])),
                 ("stages_256", body(*[step_span(f"amp-stage-{n % 8}", n * 2 + i, r, 0.05,
                                                 stages=tuple(f"s{n}-{i}-{k}" for k in range(256)))
                                       for i in range(2) for r in range(WORLD)]))]
        for name, data in cases:
            answer = _post(port, "127.0.0.6", data, AMP_TOKEN)
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
            tally[f"{name}:{status}"] = tally.get(f"{name}:{status}", 0) + 1
        n += 1
        time.sleep(0.1)


def half_bodies(port: int, count: int, stop: float, tally: dict[str, int]) -> None:
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Authorization: Bearer {HONEST_TOKEN}\r\nContent-Length: {15 << 20}\r\n\r\n").encode()
    part = b"\0" * (1 << 20)
    socks: list[socket.socket | None] = [None] * count
    while time.monotonic() < stop:
        for i in range(count):
            if socks[i] is not None:
                try:  # closed by the collector (a 503, or its deadline)?
                    socks[i].setblocking(False)  # type: ignore[union-attr]
                    if socks[i].recv(1, socket.MSG_PEEK) == b"":  # type: ignore[union-attr]
                        raise OSError("closed")
                except BlockingIOError:
                    continue
                except OSError:
                    socks[i].close()  # type: ignore[union-attr]
                    socks[i] = None
                    tally["closed_by_collector"] = tally.get("closed_by_collector", 0) + 1
                    continue
                socks[i].close()  # type: ignore[union-attr]  # answered: start again
                socks[i] = None
                tally["answered"] = tally.get("answered", 0) + 1
                continue
            try:
                s = _connect(port, "127.0.0.7", 2.0)
                s.sendall(head + part)
                socks[i] = s
                tally["opened"] = tally.get("opened", 0) + 1
            except OSError:
                tally["refused"] = tally.get("refused", 0) + 1
        time.sleep(0.5)
    for s in socks:
        if s is not None:
            s.close()


def idle(port: int, count: int, stop: float, tally: dict[str, int]) -> None:
    socks: list[socket.socket | None] = [None] * count
    while time.monotonic() < stop:
        for i in range(count):
            if socks[i] is None:
                try:
                    socks[i] = _connect(port, "127.0.0.8", 2.0)
                    tally["opened"] = tally.get("opened", 0) + 1
                except OSError:
                    tally["refused"] = tally.get("refused", 0) + 1
        time.sleep(1.0)
        for i in range(count):
            s = socks[i]
            if s is None:
                continue
            try:
                s.setblocking(False)
                if s.recv(1, socket.MSG_PEEK) == b"":
                    raise OSError("closed")
            except BlockingIOError:
                continue
            except OSError:
                pass
            s.close()
            socks[i] = None
            tally["closed_by_collector"] = tally.get("closed_by_collector", 0) + 1
    for s in socks:
        if s is not None:
            s.close()


def _raise_files_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))


def hostile_main(port: int, seconds: float, loris_count: int, rate: float, result: Any, half_count: int = 32,
                 idle_count: int = 400, skip: tuple[str, ...] = (), loris_peers: int = 9, ready: Any = None) -> None:
    _raise_files_limit()  # the slow-loris alone holds 1,080 sockets
    go = time.monotonic()
    stop = go + seconds
    tallies: dict[str, dict[str, int]] = {"slow_loris": {}, "huge": {}, "forger": {}, "garbage": {}, "amplifier": {},
                                          "half_bodies": {}, "idle": {}}
    peers = [f"127.0.1.{2 + i}" for i in range(loris_peers)]
    if "slow_loris" in skip:
        ready.set()
    threads = [threading.Thread(target=distributed_loris, args=(port, peers, loris_count, stop,
                                                                tallies["slow_loris"], ready)),
               threading.Thread(target=huge, args=(port, stop, tallies["huge"])),
               threading.Thread(target=forger, args=(port, stop, tallies["forger"], rate, go)),
               threading.Thread(target=garbage, args=(port, stop, tallies["garbage"])),
               threading.Thread(target=amplifier, args=(port, stop, tallies["amplifier"])),
               threading.Thread(target=half_bodies, args=(port, half_count, stop, tallies["half_bodies"])),
               threading.Thread(target=idle, args=(port, idle_count, stop, tallies["idle"]))]
    threads = [t for t, name in zip(threads, tallies) if name not in skip]
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join(seconds + 30)
    result.put(tallies)


# -- the run --------------------------------------------------------------------------------------------


def _limit_files(nofile: int) -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard) if hard > 0 else nofile, hard))


def read_jsonl(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scrape(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            m = re.match(r"(steptrace_collector_(?:rejected_requests|invalid_spans|conflicting_spans|"
                         r"dropped_label_values|write_errors)_total)"
                         r"\{(\w+)=\"([^\"]*)\"\} (\S+)", line)
            if m and float(m.group(4)):
                out[f"{m.group(1)}{{{m.group(2)}={m.group(3)}}}"] = float(m.group(4))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="soak duration (default: 30)")
    parser.add_argument("--rate", type=float, default=10.0, help="honest steps/s per rank (default: 10)")
    parser.add_argument("--loris", type=int, default=120,
                        help="slow-loris sockets per peer, under the per-peer cap of 128 (default: 120)")
    parser.add_argument("--loris-peers", type=int, default=9, help="slow-loris peer addresses (default: 9)")
    parser.add_argument("--half-bodies", type=int, default=32, help="half-sent 15 MiB bodies held (default: 32)")
    parser.add_argument("--idle", type=int, default=400, help="idle connections held (default: 400)")
    parser.add_argument("--nofile", type=int, default=1024, help="the collector's ulimit -n (default: 1024)")
    parser.add_argument("--skip", action="append", default=[],
                        help="leave a hostile peer out (slow_loris, huge, forger, garbage, amplifier, half_bodies, "
                             "idle); repeatable")
    parser.add_argument("--verbose", action="store_true", help="print the collector's log")
    parser.add_argument("--json", metavar="PATH", help="also write every number measured")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="steptrace-soak-")
    tokens = os.path.join(workdir, "tokens")
    with open(tokens, "w") as f:
        f.write(f"{HONEST_TOKEN} honest-*\n{EVIL_TOKEN} evil-*\n{AMP_TOKEN} amp-*\n")
    run_dir = os.path.join(workdir, "runs")
    proc = subprocess.Popen([sys.executable, "-m", "steptrace.collector", "--port", "0", "--metrics-port", "0",
                             "--world-size", str(WORLD), "--window-s", "5", "--run-dir", run_dir,
                             "--token-file", tokens, "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: _limit_files(args.nofile))
    try:
        line = proc.stdout.readline()
        port = int(line.split("otlp_http=127.0.0.1:")[1].split()[0])
        metrics_port = int(line.split("metrics=127.0.0.1:")[1].split()[0])
        rss_start = rss_kib(proc.pid)
        spawn = mp.get_context("spawn")
        result: Any = spawn.Queue()
        ready: Any = spawn.Event()
        hostile = spawn.Process(target=hostile_main,
                                args=(port, args.seconds, args.loris, args.rate, result, args.half_bodies, args.idle,
                                      tuple(args.skip), args.loris_peers, ready))
        hostile.start()
        time.sleep(1.0)  # the hostile peers get going first
        loris_ready = ready.wait(30)  # ... and the slow-loris holds its sockets
        go = time.monotonic()
        stop = go + args.seconds - 1.0
        samples: list[list[tuple[float, int, int]]] = [[] for _ in range(WORLD)]
        fresh: list[tuple[float, int, int]] = []
        ranks = [threading.Thread(target=honest_rank, args=(port, r, args.rate, go, stop, samples[r]))
                 for r in range(WORLD)]
        ranks.append(threading.Thread(target=newcomer, args=(port, 0.5, stop, fresh)))
        for t in ranks:
            t.start()
        rss_peak = rss_start
        while any(t.is_alive() for t in ranks):
            rss_peak = max(rss_peak, rss_kib(proc.pid))
            time.sleep(0.2)
        tallies = result.get(timeout=120)
        hostile.join(30)
        rss_end = rss_kib(proc.pid)
        counters = scrape(metrics_port)
        proc.terminate()
        proc.wait(30)
        stderr_text = proc.stderr.read()
        stderr_lines = stderr_text.count("\n")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()

    answers = [s for rank in samples for s in rank]
    ok = [lat for lat, status, _ in answers if status == 200]
    fresh_ok = [lat for lat, status, _ in fresh if status == 200]
    records = read_jsonl(os.path.join(run_dir, "honest-run", "cluster.jsonl"))
    steps = [r for r in records if r["type"] == "cluster_step"]
    # Acknowledged vs stored: every (step, rank) answered 200 is in a record (a reporting rank, a late
    # record) or in conflicts.jsonl (a rank left out as conflicting: both versions are kept there).
    acknowledged = {(step, rank) for rank, rank_samples in enumerate(samples)
                    for _, status, step in rank_samples if status == 200}
    stored: set[tuple[int, int]] = set()
    for r in steps:
        stored |= {(r["step"], rank) for rank in range(r["world_size"]) if rank not in r["missing_ranks"]}
    stored |= {(r["step"], r["rank"]) for r in records if r["type"] == "late"}
    stored |= {(r["step"], r["rank"])
               for r in read_jsonl(os.path.join(run_dir, "honest-run", "conflicts.jsonl"))}
    fresh_acknowledged = {step for _, status, step in fresh if status == 200}
    fresh_stored = {r["step"] for r in read_jsonl(os.path.join(run_dir, "honest-fresh", "cluster.jsonl"))
                    if r["type"] == "cluster_step" and r["ranks_reporting"] == 1}
    sent_steps = len(answers) // WORLD
    clean = [r for r in steps if r["complete"] and not r.get("conflicting_ranks")]
    conflicted = [r for r in steps if r.get("conflicting_ranks")]
    # A forged span for a step the real rank never sends (past the end) cannot be told apart; what must
    # never happen is a forged value in a complete step, where it would name the straggler.
    forged_straggler = [r for r in steps if r["complete"] and r["compute_max_seconds"] > 1]
    written_twice = len(steps) - len({r["step"] for r in steps})
    figures = {
        "seconds": args.seconds, "loris_sockets": args.loris * args.loris_peers, "loris_ready": loris_ready,
        "honest_requests": len(answers), "honest_success_rate": len(ok) / max(1, len(answers)),
        "honest_503": sum(1 for _, status, _ in answers if status == 503),
        "honest_failed": sum(1 for _, status, _ in answers if status not in (200, 503)),
        "latency_p50_ms": percentile(ok, 0.5) * 1e3, "latency_p99_ms": percentile(ok, 0.99) * 1e3,
        "latency_max_ms": max(ok) * 1e3 if ok else float("nan"),
        "newcomer_requests": len(fresh), "newcomer_200": len(fresh_ok),
        "newcomer_503": sum(1 for _, status, _ in fresh if status == 503),
        "newcomer_failed": sum(1 for _, status, _ in fresh if status not in (200, 503)),
        "newcomer_latency_p50_ms": percentile(fresh_ok, 0.5) * 1e3,
        "newcomer_latency_max_ms": max(fresh_ok) * 1e3 if fresh_ok else float("nan"),
        "acknowledged": len(acknowledged) + len(fresh_acknowledged),
        "acknowledged_lost": len(acknowledged - stored) + len(fresh_acknowledged - fresh_stored),
        "honest_steps_sent": sent_steps, "steps_written": len(steps), "steps_complete_clean": len(clean),
        "steps_with_conflicting_rank0": len(conflicted), "steps_with_forged_value_joined": len(forged_straggler),
        "steps_written_twice": written_twice,
        "rss_start_mib": rss_start / 1024, "rss_peak_mib": rss_peak / 1024, "rss_end_mib": rss_end / 1024,
        "collector_stderr_lines": stderr_lines, "collector_log": stderr_text.splitlines(),
        "hostile": tallies, "collector_counters": counters,
    }
    attack = [f"{args.loris_peers} x {args.loris} slow-loris sockets"] if "slow_loris" not in args.skip else []
    attack += [name for name in ("huge", "forger", "garbage", "amplifier", "half_bodies", "idle")
               if name not in args.skip]
    print(f"collector soak: {args.seconds:g} s, {WORLD} honest ranks at {args.rate:g} steps/s, "
          f"against {', '.join(attack) or 'nothing'}"
          + ("" if loris_ready else " (the slow-loris was not ready in 30 s)"))
    print(f"honest senders:  {len(ok)}/{len(answers)} answered 200 ({100 * figures['honest_success_rate']:.2f} %), "
          f"{figures['honest_503']} 503, {figures['honest_failed']} failed; "
          f"latency p50 {figures['latency_p50_ms']:.1f} ms, p99 {figures['latency_p99_ms']:.1f} ms, "
          f"max {figures['latency_max_ms']:.1f} ms")
    print(f"newcomer:        {len(fresh_ok)}/{len(fresh)} fresh connections answered 200, "
          f"{figures['newcomer_503']} 503, {figures['newcomer_failed']} failed; latency p50 "
          f"{figures['newcomer_latency_p50_ms']:.1f} ms, max {figures['newcomer_latency_max_ms']:.1f} ms")
    print(f"acknowledged:    {figures['acknowledged']} rank-steps answered 200; "
          f"{figures['acknowledged_lost']} of them missing from cluster.jsonl/conflicts.jsonl")
    print(f"honest steps:    {len(steps)} written; {len(clean)} complete without conflict; {len(conflicted)} with "
          f"rank 0 conflicting (the insider's forgery, left out); {len(forged_straggler)} complete with a forged "
          f"value; {written_twice} written twice")
    print(f"collector RSS:   start {figures['rss_start_mib']:.0f} MiB, peak {figures['rss_peak_mib']:.0f} MiB, "
          f"end {figures['rss_end_mib']:.0f} MiB; {stderr_lines} log lines")
    for peer, tally in tallies.items():
        print(f"{peer + ':':16} " + ", ".join(f"{k} x{v}" for k, v in sorted(tally.items())))
    if args.verbose:
        print(stderr_text, end="")
    print("collector counters: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counters.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
