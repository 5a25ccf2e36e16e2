"""Hostile input, round 2 (issue 25): nothing acknowledged is lost, nothing written is written twice,
one peer cannot grow memory, series or descriptors, no forgery replaces a record, lengths are unambiguous.

Each test is one defect of the second security review and failed on the collector as it
was before the fix (run against it first); the numbers in the names are the review's. The
rank side is in test_otlp_sender_told.py and test_prometheus.py, the CLI in
test_cli_hostile_names.py.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.proto",
                    reason="the collector needs opentelemetry-proto (pip install 'steptrace[otlp]')")
pytest.importorskip("prometheus_client",
                    reason="the collector needs prometheus_client (pip install 'steptrace[prometheus]')")

from collector_helpers import body, collectors, post, read_records, scrape, step_span, value, wait_for

from steptrace.collector._runlog import CLUSTER_FILE, JOURNAL_FILE, ClusterLog

TRACES = "/v1/traces"


@pytest.fixture
def make_collector(tmp_path):
    with collectors(tmp_path / "runs") as make:
        yield make


def fail_writes(monkeypatch, name: str) -> list[int]:
    """Every write to ``name`` files raises ENOSPC (a full disk) until the returned list is cleared."""
    active = [1]
    original = ClusterLog._file

    def broken(self, run_id, which=CLUSTER_FILE):
        if active and which == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, run_id, which)

    monkeypatch.setattr(ClusterLog, "_file", broken)
    return active


def cluster_steps(path: Path) -> list[tuple[int, bool]]:
    return [(r["step"], r["complete"]) for r in read_records(path) if r["type"] == "cluster_step"]


# -- 1. acknowledge only what is durable --------------------------------------------------------------------


def test_a_failed_journal_append_is_answered_503_not_200_50_of_50_lost(make_collector, monkeypatch):
    """Defect 1: the journal append failed, the error was swallowed and the request answered 200."""
    c = make_collector(world_size=2)
    broken = fail_writes(monkeypatch, JOURNAL_FILE)
    status, headers, _ = post(c.port, TRACES, body(step_span(step=0, rank=0, world_size=2)))
    assert status == 503, "a span that is not in the journal must not be acknowledged"
    assert headers.get("retry-after") == "1"
    assert value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason="journal_failed") == 1
    assert c.joiner.open_steps == 0  # not taken either: the retry is the one that counts
    broken.clear()
    assert post(c.port, TRACES, body(*[step_span(step=0, rank=r, world_size=2) for r in range(2)]))[0] == 200
    c.close()
    assert cluster_steps(Path(c.config.run_dir) / "run" / CLUSTER_FILE) == [(0, True)]


def test_records_that_cannot_be_written_stay_in_the_journal_until_they_are(make_collector, monkeypatch, tmp_path):
    """Defect 1: publishing emptied the journal without checking that cluster.jsonl was written."""
    c = make_collector(world_size=1)
    broken = fail_writes(monkeypatch, CLUSTER_FILE)
    for step in range(50):
        assert post(c.port, TRACES, body(step_span(step=step, world_size=1)))[0] == 200
    assert value(scrape(c.metrics_url), "steptrace_collector_write_errors_total") == 50
    c.close()  # the disk is still full: the 50 steps can only be in the journal now
    broken.clear()
    again = make_collector(world_size=1)  # the restarted collector replays them
    again.close()
    assert cluster_steps(tmp_path / "runs" / "run" / CLUSTER_FILE) == [(s, True) for s in range(50)]
    assert (tmp_path / "runs" / "run" / JOURNAL_FILE).stat().st_size == 0


def test_records_are_written_once_the_disk_has_room_again(make_collector, monkeypatch, tmp_path):
    c = make_collector(world_size=1)
    broken = fail_writes(monkeypatch, CLUSTER_FILE)
    assert post(c.port, TRACES, body(step_span(step=0, world_size=1)))[0] == 200
    broken.clear()
    assert post(c.port, TRACES, body(step_span(step=1, world_size=1)))[0] == 200
    assert cluster_steps(tmp_path / "runs" / "run" / CLUSTER_FILE) == [(0, True), (1, True)]
    assert (tmp_path / "runs" / "run" / JOURNAL_FILE).stat().st_size == 0


def start_collector(run_dir, *extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "steptrace.collector", "--port", "0", "--metrics-port", "0",
                             "--world-size", "3", "--window-s", "60", "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("steptrace collector: otlp_http=127.0.0.1:"), line + proc.stderr.read()
    return proc, int(line.split("otlp_http=127.0.0.1:")[1].split()[0])


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


def test_a_restart_replays_only_what_was_not_written_300_of_300_written_again(tmp_path):
    """Defect 2: SIGKILL with a step open, restart: every step already in cluster.jsonl was written again."""
    run_dir = tmp_path / "runs"
    proc, port = start_collector(run_dir, "--max-emitted-steps", "100")
    try:
        assert post(port, TRACES, body(step_span(step=300, rank=0)))[0] == 200  # keeps the journal from emptying
        for first in range(0, 300, 50):
            assert post(port, TRACES, body(*[step_span(step=s, rank=r) for s in range(first, first + 50)
                                             for r in range(3)]))[0] == 200
    finally:
        kill(proc)
    proc, port = start_collector(run_dir, "--max-emitted-steps", "100")
    try:
        assert post(port, TRACES, body(step_span(step=300, rank=1), step_span(step=300, rank=2)))[0] == 200
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdout.close()
        proc.stderr.close()
    steps = [s for s, _ in cluster_steps(run_dir / "run" / CLUSTER_FILE)]
    assert len(steps) - len(set(steps)) == 0, f"{len(steps) - len(set(steps))} steps written twice"
    assert steps == list(range(301))


@pytest.mark.parametrize("line", ['["run",0,"zero",1,"",0.1,0.2,0.1,"ok",null,{}]', "[" * 100_000 + "]" * 100_000,
                                  '{"not": "a span"}', '["w", "x"]'])
def test_a_corrupt_journal_line_is_skipped_and_counted_never_fatal(tmp_path, line):
    """Defect 4: a string rank or deeply nested JSON in the journal and the collector exited 1 at every start."""
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    good = json.dumps(["run", 0, 0, 1, "", 0.1, 0.2, 0.1, "ok", None, {}])
    (run / JOURNAL_FILE).write_text(line + "\n" + good + "\n")
    with collectors(tmp_path / "runs") as make:
        c = make(world_size=1)
        text = scrape(c.metrics_url)
        assert value(text, "steptrace_collector_journal_skipped_lines_total") == 1
        c.close()
    assert cluster_steps(run / CLUSTER_FILE) == [(0, True)]


def test_the_same_span_sent_4000_times_is_journaled_once(make_collector, tmp_path):
    """Defect 3: the same span 4,000 times a request made a 27 MiB journal for one open step."""
    c = make_collector(world_size=2)
    for _ in range(3):
        assert post(c.port, TRACES, body(*[step_span(step=0, rank=0, world_size=2)] * 4000))[0] == 200
    lines = (tmp_path / "runs" / "run" / JOURNAL_FILE).read_text().splitlines()
    assert len(lines) == 1
    assert value(scrape(c.metrics_url), "steptrace_collector_duplicate_spans_total", run_id="run") == 11999


def test_the_journal_is_bounded_per_run_beyond_it_503(make_collector, tmp_path):
    """Defect 3: one open step's journal grew without bound; now a full journal refuses (retryable)."""
    c = make_collector(world_size=4096, max_journal_bytes_per_run=64 << 10)
    answers = [post(c.port, TRACES, body(*[step_span(step=s, rank=r, world_size=4096) for r in range(100)]))[0]
               for s in range(20)]
    assert answers[0] == 200 and answers[-1] == 503
    assert (tmp_path / "runs" / "run" / JOURNAL_FILE).stat().st_size <= 64 << 10
    assert value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason="journal_full") >= 1


# -- 2. every per-peer and per-run structure bounded ----------------------------------------------------------


def test_missing_ranks_of_a_world_size_65536_step_are_a_count_and_ranges():
    """Defect 6: one-rank steps claiming world_size=65536 were each written with a 65,535-entry list."""
    from collector_helpers import FakeClock, span

    from steptrace.collector._join import MAX_MISSING_LISTED, Joiner

    clock = FakeClock()
    joiner = Joiner(world_size=None, window_s=1.0, clock=clock)
    joiner.add([span(step=0, rank=5, world_size=65536), span(step=0, rank=7, world_size=65536)])
    clock.now += 2
    [record] = joiner.expire().records
    assert record["missing_rank_count"] == 65534
    assert record["missing_rank_ranges"] == [[0, 4], [6, 6], [8, 65535]]
    assert record["missing_ranks"] == [0, 1, 2, 3, 4, 6, *range(8, 8 + MAX_MISSING_LISTED - 6)]
    assert len(json.dumps(record)) < 4096, "a record's size grows with the ranks that reported, not the claim"


def test_expiry_emits_in_bounded_batches():
    """Defect 6: every expired step was built at once under the collector lock."""
    from collector_helpers import FakeClock, span

    from steptrace.collector._join import Joiner

    clock = FakeClock()
    joiner = Joiner(world_size=None, window_s=1.0, clock=clock)
    joiner.add([span(step=s, rank=0, world_size=8) for s in range(100)])
    clock.now += 2
    assert [len(joiner.expire(max_steps=40).records) for _ in range(4)] == [40, 40, 20, 0]


def test_stage_names_cannot_grow_the_series_200_spans_made_51200(make_collector):
    """Defect 7: each complete step added its stage names to the bubble gauge and the set was never pruned."""
    from steptrace.collector._metrics import MAX_STAGES_PER_RUN

    c = make_collector(world_size=1)
    for first in range(0, 200, 50):
        spans = [step_span(step=s, world_size=1, bubble={f"s{s}-{i}": 0.1 for i in range(256)})
                 for s in range(first, first + 50)]
        assert post(c.port, TRACES, body(*spans))[0] == 200
    text = scrape(c.metrics_url)
    series = [line for line in text.splitlines() if line.startswith("steptrace_cluster_pipeline_bubble_ratio{")]
    assert len(series) == MAX_STAGES_PER_RUN, f"{len(series)} bubble series for one run"
    assert all('stage="s199-' in line for line in series)  # the last complete step's stages
    assert value(text, "steptrace_collector_dropped_label_values_total", label="stage") == 200 * (256 - 64)


def test_body_bytes_in_flight_are_bounded_across_peers_beyond_503(make_collector):
    """Defect 8: 128 half-sent 16 MiB bodies from one peer held 2.09 GiB."""
    import socket

    c = make_collector(max_inflight_body_bytes=1 << 20)
    held = []
    try:
        for _ in range(3):  # each claims 400 KiB and sends half
            sock = socket.create_connection(("127.0.0.1", c.port), timeout=10)
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: 409600\r\n\r\n" + b"\0" * 204800)
            held.append(sock)
        assert c.budget.used <= 1 << 20
        status, headers, _ = post(c.port, TRACES, b"\0" * 409600)
        assert status == 503 and headers.get("retry-after") == "1"
        assert value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total",
                     reason="memory_limited") >= 1
    finally:
        for sock in held:
            sock.close()
    assert wait_for(lambda: c.budget.used == 0)
    assert post(c.port, TRACES, body(step_span(world_size=1)))[0] == 200


FD_COLLECTOR = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
from steptrace.collector._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_idle_sockets_cannot_exhaust_descriptors_honest_posts_answered_4_of_4(tmp_path):
    """Defect 9: at a low ulimit -n, idle sockets took every descriptor and honest posts timed out."""
    import socket

    proc = subprocess.Popen([sys.executable, "-c", FD_COLLECTOR, "--port", "0", "--metrics-port", "0",
                             "--world-size", "1", "--run-dir", str(tmp_path / "runs"), "--request-timeout-s", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    idle = []
    try:
        line = proc.stdout.readline()
        port = int(line.split("otlp_http=127.0.0.1:")[1].split()[0])
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):  # 300 idle sockets from three addresses
            for _ in range(100):
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=5,
                                                         source_address=(source, 0)))
                except OSError:
                    break
        # Every honest post is answered at once (200, or 503 and closed while the idle ones hold every
        # slot; the close may reach the client first), none times out.

        def answer(step: int) -> object:
            try:
                return post(port, TRACES, body(step_span(step=step, world_size=1)), timeout=5)[0]
            except TimeoutError:
                return "timeout"
            except OSError:
                return "closed"

        answers = [answer(s) for s in range(4)]
        assert set(answers) <= {200, 503, "closed"}, answers
        for sock in idle:
            sock.close()
        for s in range(4):  # the exporter's retry, once the idle sockets are gone
            assert wait_for(lambda s=s: post(port, TRACES, body(step_span(step=s, world_size=1)), timeout=5)[0] == 200)
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()
    assert cluster_steps(tmp_path / "runs" / "run" / CLUSTER_FILE) == [(s, True) for s in range(4)]


# -- 3. a written step is never replaced ----------------------------------------------------------------------


def test_a_forged_rewrite_of_a_written_step_is_a_conflict_the_original_kept(make_collector, tmp_path):
    """Defect 10: all ranks of a written step re-sent with later ends wrote a second record, 0 conflicts."""
    from collector_helpers import END_BASE_S

    c = make_collector(world_size=3)
    assert post(c.port, TRACES, body(*[step_span(step=0, rank=r) for r in range(3)]))[0] == 200
    forged = [step_span(step=0, rank=r, compute=9.0, interval=9.5, end_s=END_BASE_S + 3600 + 120) for r in range(3)]
    assert post(c.port, TRACES, body(*forged))[0] == 200
    text = scrape(c.metrics_url)
    assert value(text, "steptrace_collector_conflicting_spans_total", run_id="run") == 3
    c.close()
    records = [r for r in read_records(tmp_path / "runs" / "run" / CLUSTER_FILE) if r["type"] == "cluster_step"]
    assert [(r["step"], r["compute_max_seconds"]) for r in records] == [(0, 0.1)]
    assert len(read_records(tmp_path / "runs" / "run" / "conflicts.jsonl")) == 3


def test_a_world_size_other_than_the_runs_is_refused_and_counted(make_collector):
    """Defect 11: spans claiming world_size=1 completed steps of a run of 3 on their own."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    c = make_collector()  # world size from the spans
    assert post(c.port, TRACES, body(step_span(step=0, rank=0, world_size=3)))[0] == 200
    status, _, data = post(c.port, TRACES, body(step_span(step=0, rank=1, world_size=1, compute=5.0)))
    assert status == 200
    assert ExportTraceServiceResponse.FromString(data).partial_success.rejected_spans == 1
    assert value(scrape(c.metrics_url), "steptrace_collector_invalid_spans_total", reason="world_size_mismatch") == 1
    assert post(c.port, TRACES, body(step_span(step=0, rank=1), step_span(step=0, rank=2)))[0] == 200
    c.close()
    [record] = [r for r in read_records(Path(c.config.run_dir) / "run" / CLUSTER_FILE)]
    assert (record["complete"], record["world_size"], record["compute_max_seconds"]) == (True, 3, 0.1)


def test_spans_sent_ahead_with_far_future_ends_are_refused_1000_of_1000(make_collector):
    """Defect 11: 1,000 forged steps sent ahead of a run with far-future ends took every step."""
    import time

    c = make_collector(max_clock_skew_s=60)
    future = time.time() + 86400
    forged = [step_span(step=s, world_size=3, compute=7.0, end_s=future + s) for s in range(1000)]
    for first in range(0, 1000, 250):
        assert post(c.port, TRACES, body(*[forged[s] for s in range(first, first + 250)]))[0] == 200
    assert value(scrape(c.metrics_url), "steptrace_collector_invalid_spans_total", reason="end_out_of_range") == 1000
    assert post(c.port, TRACES, body(*[step_span(step=s, rank=r) for s in range(3) for r in range(3)]))[0] == 200
    c.close()
    records = read_records(Path(c.config.run_dir) / "run" / CLUSTER_FILE)
    assert [(r["type"], r["step"], r["complete"], r["compute_max_seconds"]) for r in records] == \
        [("cluster_step", s, True, 0.1) for s in range(3)]


# -- 7. HTTP: one unambiguous Content-Length ----------------------------------------------------------------


@pytest.mark.parametrize("lengths", [("{n}", "{n}"), ("{n}", "{m}"), ("+{n}",), ("{n_}",), ("0x{h}",), ("-0",)])
def test_duplicate_or_non_digit_content_length_is_400(make_collector, lengths):
    """Defect 16: duplicate, conflicting and non-digit lengths (+308, 3_0_8) were accepted: request smuggling."""
    from collector_helpers import raw_exchange

    c = make_collector(world_size=1)
    data = body(step_span(world_size=1))
    n = len(data)
    fields = {"n": n, "m": n + 5, "n_": "_".join(str(n)), "h": format(n, "x")}
    headers = "".join(f"Content-Length: {x.format(**fields)}\r\n" for x in lengths)
    answer = raw_exchange(c.port, f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                                  f"{headers}\r\n".encode() + data)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert c.joiner.open_steps == 0 and not (Path(c.config.run_dir) / "run").exists()


def test_a_step_run_again_by_a_later_attempt_is_a_new_unit_not_a_conflict(make_collector, tmp_path):
    """A resumed run (train.attempt 1) executes step 0 again: written afresh, keyed by (run, attempt, step);
    the same attempt re-sending other numbers stays a conflict."""
    c = make_collector(world_size=2)
    assert post(c.port, TRACES, body(*[step_span(step=0, rank=r, world_size=2) for r in range(2)]))[0] == 200
    again = [step_span(step=0, rank=r, world_size=2, compute=0.3, **{"train.attempt": 1}) for r in range(2)]
    assert post(c.port, TRACES, body(*again))[0] == 200
    forged = [step_span(step=0, rank=r, world_size=2, compute=9.0, **{"train.attempt": 1}) for r in range(2)]
    assert post(c.port, TRACES, body(*forged))[0] == 200
    assert value(scrape(c.metrics_url), "steptrace_collector_conflicting_spans_total", run_id="run") == 2
    c.close()
    records = [r for r in read_records(tmp_path / "runs" / "run" / CLUSTER_FILE) if r["type"] == "cluster_step"]
    assert [(r["attempt"], r["step"], r["compute_max_seconds"]) for r in records] == [(0, 0, 0.1), (1, 0, 0.3)]
    # A restarted collector knows both units from cluster.jsonl: a retry of either is a duplicate.
    again_c = make_collector(world_size=2)
    assert post(again_c.port, TRACES, body(again[0], step_span(step=0, rank=0, world_size=2)))[0] == 200
    assert value(scrape(again_c.metrics_url), "steptrace_collector_duplicate_spans_total", run_id="run") == 2


def test_the_journal_marks_written_steps_per_attempt(tmp_path):
    import dataclasses

    from collector_helpers import span

    log = ClusterLog(tmp_path)
    first = [dataclasses.replace(span(step=5, rank=r), attempt=a) for a in (0, 1) for r in range(2)]
    log.journal(first)
    log.write([{"type": "cluster_step", "run_id": "run", "attempt": 1, "step": 5}])
    log.close()
    replayed = ClusterLog(tmp_path).replay()
    assert sorted((s.attempt, s.step, s.rank) for s in replayed) == [(0, 5, 0), (0, 5, 1)]


def test_grpc_bodies_count_against_the_same_budget(make_collector):
    grpc = pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
    c = make_collector(world_size=1, grpc_port=0, max_inflight_body_bytes=1000)
    with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as refused:
            export(body(*[step_span(step=s, world_size=1) for s in range(20)]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable
        export(body(step_span(step=0, world_size=1)), timeout=10)  # a small one fits
    assert value(scrape(c.metrics_url), "steptrace_collector_rejected_requests_total", reason="memory_limited") == 1
    assert c.budget.used == 0


def test_connection_caps_stay_below_the_descriptor_limit(monkeypatch):
    import resource

    from steptrace.collector import CollectorConfig
    from steptrace.collector._app import descriptor_limits

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    http_only = descriptor_limits(CollectorConfig())
    both = descriptor_limits(CollectorConfig(grpc_port=4317))
    for lim in (http_only, both):
        assert lim.http + lim.grpc * (lim is both) + lim.metrics + lim.open_files + 32 <= 1024
    assert http_only.http_per_peer <= http_only.http // 2
    assert both.grpc >= 4 and both.http == both.grpc

    # With room, the descriptors set the cap, not a fixed 1,024 (4,096 ranks may post directly):
    # nofile - 32 - min(3 x max_runs, nofile / 4) - min(64, nofile / 16).
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65536, 65536))
    lim = descriptor_limits(CollectorConfig())
    assert lim.http == 16384  # --max-connections bounds it there (a thread per connection)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8192, 8192))
    assert descriptor_limits(CollectorConfig()).http == 8192 - 32 - 192 - 64


def test_a_span_s_collectives_come_back_from_the_journal(tmp_path):
    """The device-timed collectives the join needs survive a restart (journal line, last field); a line
    whose collectives are not what the decoder makes is skipped, never half-read."""
    import dataclasses

    from collector_helpers import span

    log = ClusterLog(tmp_path)
    timed = dataclasses.replace(span(step=7, rank=0), collectives=(("0", 3, 0.025), ("tp", 1, None)))
    log.journal([timed, span(step=7, rank=1)])
    log.close()
    replayed = {s.rank: s for s in ClusterLog(tmp_path).replay()}
    assert replayed[0].collectives == (("0", 3, 0.025), ("tp", 1, None))
    assert replayed[1].collectives is None
    run = tmp_path / "run"
    bad = json.loads((run / JOURNAL_FILE).read_text().splitlines()[0])
    bad[-1] = [["0", "three", 0.025]]
    (run / JOURNAL_FILE).write_text(json.dumps(bad) + "\n")
    assert ClusterLog(tmp_path).replay() == []
