"""The cross-rank join on ClickHouse (steptrace.analysis.clickhouse), checked against the steptrace collector.

Four real rank processes run the SDK and export OTLP to a receiver on 127.0.0.1 (as they would to an
OpenTelemetry Collector); rank 2 is slower (the straggler: the others wait for it in a simulated
collective, and record that wait as the torch.distributed adapter does) and rank 3 stops after half
the steps. The same export requests then go (a) through the steptrace collector's decoder and join
(collector/_decode.py extract_steps, collector/_join.py Joiner) and (b) through ``rows_from_otlp``
(the contrib ClickHouse exporter's mapping; no otelcol binary here) into chDB, the embedded
ClickHouse engine, in the exporter's ``otel_traces`` schema. The per-step SQL must give what the
collector's ``cluster_step`` records give.

chDB runs one engine per process, shared by every session: each test uses a database of its own.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pytest

chdb = pytest.importorskip("chdb", reason="the ClickHouse tests run on chDB: pip install 'steptrace[clickhouse]'")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="the ranks export with opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")

from chdb_http_server import ChdbHttpServer  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList  # noqa: E402
from opentelemetry.proto.resource.v1.resource_pb2 import Resource  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status  # noqa: E402
from otlp_receiver import OtlpHttpReceiver  # noqa: E402

from steptrace.analysis import clickhouse as ch  # noqa: E402
from steptrace.collector._decode import extract_steps  # noqa: E402
from steptrace.collector._join import Joiner  # noqa: E402

RUN_ID = "chrun"
WORLD = 4
STEPS = 6
RANK3_STEPS = 3  # rank 3 stops reporting after this many steps
COMPUTE_S = (0.01, 0.01, 0.06, 0.01)
PERIOD_S = 0.1

_databases = itertools.count()


def fresh_client(url: str = "chdb://") -> ch.ChdbClient:
    """A chDB client on a database of its own, holding an empty ``otel_traces``."""
    database = f"t{os.getpid()}_{next(_databases)}"
    sep = "&" if "?" in url else "?"
    client = ch.connect(f"{url}{sep}database={database}")
    client.command(ch.otel_traces_ddl(database))
    return client


RANK_SCRIPT = r'''
import json, os, sys, time
import steptrace
from steptrace.testing import SimulatedDevice

rank, endpoint, run_dir, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
compute, slowest, period, max_steps = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8])
steptrace.init(run_id="chrun", rank=rank, world_size=4, otlp_endpoint=endpoint, otlp_timeout_s=2,
               otlp_metrics_interval_s=60, jsonl=True, run_dir=run_dir)
device = SimulatedDevice()
open(os.path.join(workdir, f"ready-{rank}"), "w").close()
go = os.path.join(workdir, "go")
while not os.path.exists(go):
    time.sleep(0.01)
time.sleep(0.01)
t0 = float(open(go).read())
for n in range(max_steps):
    wait = t0 + n * period - time.time()
    if wait > 0:
        time.sleep(wait)
    with steptrace.step(n, tokens=1024) as s:
        with steptrace.microbatch(0, stage=rank % 2) as mb:
            mb.wait_for(device.run(compute / 2))
        with steptrace.microbatch(1, stage=rank % 2) as mb:
            mb.wait_for(device.run(compute / 2))
        s.wait_for(device.run(0.001))
        # A simulated all-reduce: the faster ranks wait for the slowest, and say so as
        # steptrace.adapters.torch_distributed does.
        waited = max(0.0, slowest - compute)
        time.sleep(waited)
        s.collective_wait += waited
        s.collective_source = "simulated"
steptrace.shutdown(timeout_s=10)
device.close()
print(json.dumps({"rank": rank, "dropped": steptrace.stats().get("dropped", {})}))
'''


@pytest.fixture(scope="module")
def sdk_run(tmp_path_factory):
    """The four ranks' OTLP trace requests (as received) and their run directory (JSONL)."""
    tmp = tmp_path_factory.mktemp("chrun")
    run_dir = tmp / "runs"
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    with OtlpHttpReceiver() as receiver:
        procs = [subprocess.Popen([sys.executable, str(script), str(rank), receiver.url, str(run_dir), str(tmp),
                                   str(COMPUTE_S[rank]), str(max(COMPUTE_S)), str(PERIOD_S),
                                   str(RANK3_STEPS if rank == 3 else STEPS)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(WORLD)]
        deadline = time.monotonic() + 120
        while not all((tmp / f"ready-{r}").exists() for r in range(WORLD)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                raise AssertionError("ranks did not start: " + " | ".join(p.communicate()[1] for p in procs))
            time.sleep(0.05)
        (tmp / "go.tmp").write_text(repr(time.time() + 0.2))
        os.replace(tmp / "go.tmp", tmp / "go")
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            assert not any(k.startswith("sink:") for k in json.loads(stdout.splitlines()[-1])["dropped"]), stdout
        requests = receiver.trace_requests()
    assert requests
    return requests, run_dir


def collector_join(requests: list[ExportTraceServiceRequest], world_size: int | None = None) -> list[dict]:
    """The steptrace collector's cluster_step records for these requests: its decoder, its join."""
    joiner = Joiner(world_size=world_size, window_s=3600)
    records = []
    for request in requests:
        records += joiner.add(extract_steps(request, world_size).steps).records
    records += joiner.flush().records
    return sorted((r for r in records if r["type"] == "cluster_step"), key=lambda r: r["step"])


def load(client: ch.ChdbClient, requests: list[ExportTraceServiceRequest], *, as_bytes: bool = False) -> int:
    rows = [row for request in requests
            for row in ch.rows_from_otlp(request.SerializeToString() if as_bytes else request)]
    return ch.insert_rows(client, rows)


#: The collector record's aggregate fields the SQL view must reproduce.
AGGREGATES = ("world_size", "ranks_reporting", "missing_rank_count", "missing_ranks", "missing_rank_ranges",
              "complete", "trace_id",
              "compute_min_seconds", "compute_median_seconds", "compute_max_seconds",
              "interval_min_seconds", "interval_median_seconds", "interval_max_seconds", "skew_seconds",
              "own_min_seconds", "own_median_seconds", "own_max_seconds",
              "straggler_rank", "straggler_cost_seconds", "straggler_excess_seconds", "straggler_threshold_seconds",
              "straggler_noise_seconds",
              "compute_sum_seconds", "interval_sum_seconds", "pipeline_bubble_ratio", "status", "end_time")


def assert_same_steps(sql_rows: list[dict], records: list[dict]) -> None:
    assert [(r["run_id"], r["attempt"], r["step"]) for r in sql_rows] == \
        [(r["run_id"], r["attempt"], r["step"]) for r in records]
    for row, record in zip(sql_rows, records):
        for key in AGGREGATES:
            want, got = record[key], row[key]
            if isinstance(want, float) and got is not None:
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (record["step"], key, got, want)
            elif isinstance(want, dict):
                assert got.keys() == want.keys(), (record["step"], key, got, want)
                for k in want:
                    assert got[k] == pytest.approx(want[k], rel=1e-12), (record["step"], key, got, want)
            else:
                assert got == want, (record["step"], key, got, want)
        # The collector's goodput for a step is its Σcompute / Σinterval.
        assert row["goodput_ratio"] == (pytest.approx(record["compute_sum_seconds"] / record["interval_sum_seconds"])
                                        if record["interval_sum_seconds"] else None)


def test_chdb_views_equal_the_collector_join_on_the_same_sdk_run(sdk_run):
    requests, _ = sdk_run
    records = collector_join(requests)
    client = fresh_client()
    assert load(client, requests) == sum(len(rs.spans) for r in requests for res in r.resource_spans
                                         for rs in res.scope_spans)
    rows = ch.cluster_steps(client, RUN_ID)
    assert_same_steps(rows, records)

    # What the run was: rank 2 the straggler of the complete steps, rank 3 gone after RANK3_STEPS.
    assert [r["step"] for r in rows] == list(range(STEPS))
    complete = [r for r in rows if r["complete"]]
    assert [r["step"] for r in complete] == list(range(RANK3_STEPS))
    assert all(r["missing_rank_count"] == 1 and r["straggler_rank"] is None for r in rows[RANK3_STEPS:])
    assert {r["straggler_rank"] for r in complete} <= {2, None}
    assert any(r["straggler_rank"] == 2 for r in complete), complete
    named = [r for r in complete if r["straggler_rank"] == 2]
    assert all(r["straggler_cost_seconds"] is not None and r["straggler_cost_seconds"] > 0 for r in named)
    assert all(set(r["pipeline_bubble_ratio"]) == {"0", "1"} for r in rows[:RANK3_STEPS])


def test_a_rank_that_never_reports_is_missing_in_both(sdk_run):
    """With a world of 5 (a fifth rank that never sent a span), every step misses rank 4 in both."""
    requests, _ = sdk_run
    records = collector_join(requests, world_size=5)
    client = fresh_client()
    load(client, requests, as_bytes=True)
    rows = ch.cluster_steps(client, RUN_ID, world_size=5)
    assert_same_steps(rows, records)
    assert [r["missing_rank_count"] for r in rows] == [1] * RANK3_STEPS + [2] * (STEPS - RANK3_STEPS)
    assert all(r["missing_ranks"][-1] == 4 for r in records)
    assert not any(r["complete"] for r in rows) and all(r["straggler_rank"] is None for r in rows)


def test_an_exporter_retry_counts_once_and_a_conflicting_rank_counts_as_missing(sdk_run):
    requests, _ = sdk_run
    client = fresh_client()
    load(client, requests)
    load(client, requests)  # the exporter retried everything: ClickHouse keeps both copies
    assert_same_steps(ch.cluster_steps(client, RUN_ID), collector_join(requests))

    # Rank 1 sends step 0 again with another compute time: the collector trusts neither version.
    original = next(r for r in requests if any(
        s.name == "train.step" and _attr(s, "train.rank") == 1 and _attr(s, "train.step") == 0
        for res in r.resource_spans for ss in res.scope_spans for s in ss.spans))
    forged = ExportTraceServiceRequest()
    forged.CopyFrom(original)
    for res in forged.resource_spans:
        for ss in res.scope_spans:
            for s in ss.spans:
                for kv in s.attributes:
                    if kv.key == "train.compute_seconds":
                        kv.value.double_value += 0.5
    load(client, [forged])
    # Both versions reach the collector while the step is open (once it wrote the step, the written
    # record would stand: ClickHouse has no such moment, so every version counts there).
    rows = ch.cluster_steps(client, RUN_ID)
    records = collector_join([forged, original, *(r for r in requests if r is not original)])
    assert_same_steps(rows, records)
    row, record = rows[0], records[0]
    assert record["conflicting_ranks"] == [1]
    assert row["conflicting_rank_count"] == 1
    assert row["missing_rank_count"] == record["missing_rank_count"] == 1
    assert row["ranks_reporting"] == record["ranks_reporting"] == 3
    assert row["straggler_rank"] is None and not row["complete"]


def _attr(span: Span, key: str):
    for kv in span.attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return None


# --- the exporter's schema and mapping ------------------------------------------------------------

def test_otel_traces_ddl_is_the_exporters_table():
    client = fresh_client()
    columns = {r["name"]: r["type"] for r in client.query(f"DESCRIBE TABLE {client.database}.otel_traces")}
    assert columns == {
        "Timestamp": "DateTime64(9)", "TraceId": "String", "SpanId": "String", "ParentSpanId": "String",
        "TraceState": "String", "SpanName": "LowCardinality(String)", "SpanKind": "LowCardinality(String)",
        "ServiceName": "LowCardinality(String)", "ResourceAttributes": "Map(LowCardinality(String), String)",
        "ScopeName": "String", "ScopeVersion": "String",
        "SpanAttributes": "Map(LowCardinality(String), String)", "Duration": "UInt64",
        "StatusCode": "LowCardinality(String)", "StatusMessage": "String",
        "Events.Timestamp": "Array(DateTime64(9))", "Events.Name": "Array(LowCardinality(String))",
        "Events.Attributes": "Array(Map(LowCardinality(String), String))",
        "Links.TraceId": "Array(String)", "Links.SpanId": "Array(String)", "Links.TraceState": "Array(String)",
        "Links.Attributes": "Array(Map(LowCardinality(String), String))",
    }
    engine = client.query(f"SELECT engine, sorting_key FROM system.tables WHERE database = '{client.database}' "
                          "AND name = 'otel_traces'")
    assert engine == [{"engine": "MergeTree", "sorting_key": "ServiceName, SpanName, toDateTime(Timestamp)"}]


def _kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def test_rows_from_otlp_maps_spans_as_the_exporter_does():
    span = Span(trace_id=bytes(range(16)), span_id=bytes(range(8)), parent_span_id=b"", name="train.step",
                kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=1_700_000_000_123_456_789,
                end_time_unix_nano=1_700_000_000_623_456_789, trace_state="k=v",
                status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
                attributes=[_kv("i", AnyValue(int_value=-42)), _kv("d", AnyValue(double_value=1.0)),
                            _kv("d2", AnyValue(double_value=0.1 + 0.2)), _kv("tiny", AnyValue(double_value=1e-7)),
                            _kv("huge", AnyValue(double_value=1.5e21)), _kv("b", AnyValue(bool_value=True)),
                            _kv("s", AnyValue(string_value="a<b")), _kv("bytes", AnyValue(bytes_value=b"\x00\xff")),
                            _kv("arr", AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1),
                                                                               AnyValue(double_value=2.5)]))),
                            _kv("strs", AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="x&y")]))),
                            _kv("kv", AnyValue(kvlist_value=KeyValueList(values=[
                                _kv("z", AnyValue(bool_value=False)), _kv("a", AnyValue(double_value=3.0))]))),
                            _kv("empty", AnyValue())],
                events=[Span.Event(time_unix_nano=1_700_000_000_200_000_000, name="e",
                                   attributes=[_kv("n", AnyValue(int_value=7))])],
                links=[Span.Link(trace_id=bytes(16), span_id=b"\x01" * 8, trace_state="",
                                 attributes=[_kv("l", AnyValue(string_value="v"))])])
    server = Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, parent_span_id=b"\x03" * 8, name="other",
                  kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=5, end_time_unix_nano=5,
                  status=Status(code=Status.STATUS_CODE_OK))
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=[_kv("service.name", AnyValue(string_value="trainer")),
                                      _kv("host.cpus", AnyValue(int_value=8))]),
        scope_spans=[ScopeSpans(scope={"name": "steptrace", "version": "0.1.0"}, spans=[span, server])])])
    first, second = ch.rows_from_otlp(request.SerializeToString())
    assert first == {
        "Timestamp": 1_700_000_000_123_456_789, "TraceId": bytes(range(16)).hex(), "SpanId": bytes(range(8)).hex(),
        "ParentSpanId": "", "TraceState": "k=v", "SpanName": "train.step", "SpanKind": "Internal",
        "ServiceName": "trainer", "ResourceAttributes": {"service.name": "trainer", "host.cpus": "8"},
        "ScopeName": "steptrace", "ScopeVersion": "0.1.0",
        "SpanAttributes": {"i": "-42", "d": "1", "d2": "0.30000000000000004", "tiny": "1e-7", "huge": "1.5e+21",
                           "b": "true", "s": "a<b", "bytes": "AP8=", "arr": "[1,2.5]", "strs": '["x\\u0026y"]',
                           "kv": '{"a":3,"z":false}', "empty": ""},
        "Duration": 500_000_000, "StatusCode": "Error", "StatusMessage": "boom",
        "Events.Timestamp": [1_700_000_000_200_000_000], "Events.Name": ["e"], "Events.Attributes": [{"n": "7"}],
        "Links.TraceId": [""], "Links.SpanId": ["01" * 8], "Links.TraceState": [""],
        "Links.Attributes": [{"l": "v"}],
    }
    assert (second["SpanKind"], second["StatusCode"], second["ParentSpanId"], second["Duration"]) == \
        ("Server", "Ok", "03" * 8, 0)

    client = fresh_client()
    ch.insert_rows(client, [first, second])
    got = client.query(f"SELECT toUnixTimestamp64Nano(Timestamp) AS ns, Duration, SpanAttributes['arr'] AS arr, "
                       f"arrayMap(t -> toUnixTimestamp64Nano(t), Events.Timestamp) AS events "
                       f"FROM {client.database}.otel_traces ORDER BY Timestamp DESC")
    assert got[0] == {"ns": 1_700_000_000_123_456_789, "Duration": 500_000_000, "arr": "[1,2.5]",
                      "events": [1_700_000_000_200_000_000]}


@pytest.mark.parametrize("value, text", [
    (0.0, "0"), (1.0, "1"), (-2.5, "-2.5"), (100.0, "100"), (123456789.125, "123456789.125"),
    (1e20, "100000000000000000000"), (1e21, "1e+21"), (1e-6, "0.000001"), (9.5e-7, "9.5e-7"),
    (1.25e-10, "1.25e-10"), (float("inf"), "json: unsupported value: +Inf"),
])
def test_doubles_are_written_as_go_writes_them(value, text):
    """pcommon float64AsString: Go's JSON number text, the rule the exporter's attribute strings follow."""
    assert ch.attribute_string(AnyValue(double_value=value)) == text


def test_every_double_attribute_reads_back_to_the_same_float():
    values = [0.1 + 0.2, 1 / 3, 2.0 ** -30, 6.02214076e23, 1e-300, 123.456e-9, 0.04000000000000001]
    client = fresh_client()
    literals = ", ".join(f"'{ch.attribute_string(AnyValue(double_value=v))}'" for v in values)
    got = client.query(f"SELECT arrayMap(x -> toFloat64OrNull(x), [{literals}]) AS back")
    assert got[0]["back"] == values


# --- the clients ----------------------------------------------------------------------------------

def test_http_client_runs_queries_inserts_and_reports_errors_through_the_http_interface():
    with ChdbHttpServer(user="alice", password="s3cret") as server:
        database = f"h{os.getpid()}_{next(_databases)}"
        ch.connect("chdb://").command(f"CREATE DATABASE IF NOT EXISTS {database}")
        client = ch.connect(f"{server.url}/?database={database}".replace("http://", "http://alice:s3cret@"))
        assert isinstance(client, ch.HttpClient) and client.database == database
        client.command(ch.otel_traces_ddl(database))
        ch.insert_rows(client, [{"Timestamp": 1_700_000_000_000_000_001, "SpanName": "train.step",
                                 "SpanAttributes": {"train.rank": "3"}, "Duration": 2 ** 63}])
        assert client.query(f"SELECT SpanAttributes['train.rank'] AS rank, Duration, "
                            f"toUnixTimestamp64Nano(Timestamp) AS ns FROM {database}.otel_traces") == \
            [{"rank": "3", "Duration": 2 ** 63, "ns": 1_700_000_000_000_000_001}]
        # What went over the wire: credentials as ClickHouse headers, the database and settings as parameters.
        last = server.seen[-1]
        assert last["headers"]["x-clickhouse-user"] == "alice" and last["headers"]["x-clickhouse-key"] == "s3cret"
        assert last["params"]["database"] == database
        assert last["params"]["output_format_json_quote_64bit_integers"] == "0"
        assert last["body"].rstrip().endswith("FORMAT JSONEachRow")

        with pytest.raises(ch.ClickHouseError) as error:
            client.query(f"SELECT no_such_column FROM {database}.otel_traces")
        assert error.value.code == 47 and "HTTP 500" in str(error.value) and "no_such_column" in str(error.value)

        wrong = ch.connect(f"{server.url}/?database={database}")
        with pytest.raises(ch.ClickHouseError) as error:
            wrong.query("SELECT 1")
        assert error.value.code == 516 and "Authentication failed" in str(error.value)


def test_http_client_takes_credentials_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLICKHOUSE_USER", "bob")
    monkeypatch.setenv("CLICKHOUSE_PASSWORD", "pw")
    with ChdbHttpServer(user="bob", password="pw") as server:
        assert ch.connect(server.url).query("SELECT 1 AS one") == [{"one": 1}]


def test_http_client_says_when_clickhouse_cannot_be_reached():
    with ChdbHttpServer() as server:
        url = server.url
    with pytest.raises(ch.ClickHouseError, match="cannot reach ClickHouse"):
        ch.connect(url, timeout_s=2).query("SELECT 1")


@pytest.mark.parametrize("url", ["localhost:8123", "ftp://host/", "http://", "http://h:8123/?db=x",
                                 "http://h:8123/?database=bad-name", "chdb://?database=1x"])
def test_connect_refuses_bad_urls(url):
    with pytest.raises(ValueError):
        ch.connect(url)


def test_chdb_errors_carry_clickhouse_codes():
    client = fresh_client()
    with pytest.raises(ch.ClickHouseError) as error:
        client.query("SELECT * FROM no_such_table_anywhere")
    assert error.value.code == 60


def test_views_install_on_chdb_and_give_the_query_results(sdk_run):
    requests, _ = sdk_run
    client = fresh_client()
    load(client, requests)
    for statement in ch.views_sql(client.database):
        client.command(statement)
    via_view = client.query(f"SELECT * FROM {client.database}.{ch.CLUSTER_STEPS_VIEW} "
                            f"WHERE run_id = '{RUN_ID}' ORDER BY step")
    direct = ch.cluster_steps(client, RUN_ID)
    assert [r["straggler_rank"] for r in via_view] == [r["straggler_rank"] for r in direct]
    assert [r["missing_rank_count"] for r in via_view] == [r["missing_rank_count"] for r in direct]
    ranks = client.query(f"SELECT rank, count() AS steps FROM {client.database}.{ch.STEP_RANKS_VIEW} "
                         f"GROUP BY rank ORDER BY rank")
    assert ranks == [{"rank": 0, "steps": STEPS}, {"rank": 1, "steps": STEPS}, {"rank": 2, "steps": STEPS},
                     {"rank": 3, "steps": RANK3_STEPS}]


def test_steptrace_clickhouse_views_prints_statements_chdb_accepts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "steptrace", "clickhouse", "views", "--database", "steptrace_db",
                          "--table", "traces"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CREATE OR REPLACE VIEW steptrace_db.steptrace_cluster_steps" in out.stdout
    assert "FROM steptrace_db.traces" in out.stdout
    client = ch.connect("chdb://")
    client.command("CREATE DATABASE IF NOT EXISTS steptrace_db")
    client.command(ch.otel_traces_ddl("steptrace_db", "traces"))
    for statement in out.stdout.split(";\n"):
        if statement.strip():
            client.command(statement)
    assert client.query("SELECT count() AS n FROM steptrace_db.steptrace_cluster_steps") == [{"n": 0}]


def _load_folder(tmp_path, data, requests: list[ExportTraceServiceRequest]) -> None:
    """The requests as otel_traces rows in a chDB data folder, written by a process of its own (chDB
    opens one folder per process, as a ClickHouse server would be apart from the reader)."""
    loader = tmp_path / "load.py"
    dump = tmp_path / "requests.bin"
    dump.write_bytes(b"".join(len(b).to_bytes(8, "big") + b for b in (r.SerializeToString() for r in requests)))
    loader.write_text(
        "import sys\nfrom steptrace.analysis import clickhouse as ch\n"
        "client = ch.connect('chdb://' + sys.argv[1])\nclient.command(ch.OTEL_TRACES_DDL)\n"
        "raw = open(sys.argv[2], 'rb').read()\nrows, i = [], 0\n"
        "while i < len(raw):\n    n = int.from_bytes(raw[i:i + 8], 'big')\n"
        "    rows += ch.rows_from_otlp(raw[i + 8:i + 8 + n])\n    i += 8 + n\n"
        "ch.insert_rows(client, rows)\n")
    done = subprocess.run([sys.executable, str(loader), str(data), str(dump)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_report_from_clickhouse_shows_the_step_figures_of_the_jsonl_report(sdk_run, tmp_path):
    """``steptrace report --clickhouse`` on a chDB folder holding the run's spans, against the JSONL report."""
    requests, run_dir = sdk_run
    data = tmp_path / "chdb-data"
    _load_folder(tmp_path, data, requests)

    def report(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "steptrace", "report", *args, "--rank", "2", "--max-rows", "0",
                              "--width", "150"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def step_table(text: str) -> str:
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("Steps (rank 2)"))
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
        return "\n".join(lines[start:end + 1])

    source = ("--clickhouse", f"chdb://{data}", "--run", RUN_ID)
    jsonl_text, clickhouse_text = report(str(run_dir / RUN_ID)), report(*source)
    assert step_table(clickhouse_text) == step_table(jsonl_text)
    assert step_table(jsonl_text).count("│ ok ") == STEPS
    # The cluster view comes from the SQL view (no collector joined this run: the JSONL has none).
    assert "Cluster view: each step across ranks (ClickHouse)" in clickhouse_text and "Cluster view" not in jsonl_text

    from_jsonl = json.loads(report(str(run_dir / RUN_ID), "--json"))
    from_clickhouse = json.loads(report(*source, "--json"))
    assert from_clickhouse["run_id"] == from_jsonl["run_id"] == RUN_ID
    assert from_clickhouse["ranks"] == from_jsonl["ranks"] == list(range(WORLD))
    for key in ("steps", "error_steps", "compute_seconds", "idle_seconds", "compute_p50", "compute_p90",
                "interval_p50", "tokens_per_second", "checkpoints"):
        assert from_clickhouse[key] == pytest.approx(from_jsonl[key], rel=1e-12), key
    # The time before the first step travels on the first step's span (train.before_step_seconds and
    # its breakdown): wall, goodput and idle by reason equal the JSONL report's.
    assert from_jsonl["before_steps_seconds"] > 0
    # ... and so does each attempt's process start (train.process_start_time): the wall and the goodput
    # start there.
    assert from_clickhouse["before_steps_seconds"] == pytest.approx(from_jsonl["before_steps_seconds"], rel=1e-12)
    for key in ("wall_seconds", "productive_seconds", "goodput"):  # differences of unix times: to a microsecond
        assert from_clickhouse[key] == pytest.approx(from_jsonl[key], abs=1e-6), key
    assert from_clickhouse["idle_breakdown_totals"] == pytest.approx(from_jsonl["idle_breakdown_totals"], rel=1e-12)
    assert "startup" in from_clickhouse["idle_breakdown_totals"]
    assert set(from_clickhouse["cluster"]["straggler_steps"]) <= {"2"}
    assert from_clickhouse["cluster"]["missing_rank_steps"] == {"3": STEPS - RANK3_STEPS}


def test_compare_reads_two_runs_from_clickhouse(sdk_run, tmp_path):
    requests, _ = sdk_run
    data = tmp_path / "chdb-data"
    renamed = []
    for request in requests:
        copy = ExportTraceServiceRequest()
        copy.CopyFrom(request)
        for res in copy.resource_spans:
            for ss in res.scope_spans:
                for s in ss.spans:
                    for kv in s.attributes:
                        if kv.key == "train.run_id":
                            kv.value.string_value = "chrun_b"
        renamed.append(copy)
    _load_folder(tmp_path, data, requests + renamed)
    out = subprocess.run([sys.executable, "-m", "steptrace", "compare", "--clickhouse", f"chdb://{data}",
                          RUN_ID, "chrun_b", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {r["metric"]: r for r in json.loads(out.stdout)["rows"]}
    # The same spans under two names: every metric the same on both sides.
    assert rows, out.stdout
    for row in rows.values():
        assert row["a"] == row["b"], row
    missing = subprocess.run([sys.executable, "-m", "steptrace", "compare", "--clickhouse", f"chdb://{data}",
                              RUN_ID, "no_such_run"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no train.step spans of run 'no_such_run'" in missing.stderr


# --- hostile rows: what one row may cost report/compare --clickhouse ------------------------------

HOSTILE_T0 = 1_700_000_000.0
HOSTILE_STEPS = 20  # per rank, 2 ranks: 0.1 s compute in a 0.12 s interval


def _any(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=value)


def _hostile_span(run_id: str, rank: int, step: int, compute: float, interval: float, end: float, *,
                  span: int | None = None, **attrs) -> Span:
    """A train.step span as steptrace/otlp.py writes it; ``attrs`` replace or add attributes."""
    from steptrace._ids import span_id, trace_id

    values = {"train.run_id": run_id, "train.rank": rank, "train.step": step, "train.world_size": 2,
              "train.attempt": 0, "train.compute_seconds": compute, "train.interval_seconds": interval,
              "train.idle_seconds": interval - compute, "train.tokens": 1024}
    values.update({k.replace("__", "."): v for k, v in attrs.items()})
    end_ns = round(end * 1e9)
    return Span(trace_id=trace_id(run_id, step, 0).to_bytes(16, "big"),
                span_id=(span_id(run_id, step, rank, "step", 0) if span is None else span).to_bytes(8, "big"),
                name="train.step", kind=Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=end_ns - round(interval * 1e9), end_time_unix_nano=end_ns,
                attributes=[_kv(k, _any(v)) for k, v in values.items()])


def _hostile_run(run_id: str, *extra: Span) -> ExportTraceServiceRequest:
    """Two ranks' 20 real steps, then the extra spans."""
    spans = [_hostile_span(run_id, rank, n, 0.1, 0.12, HOSTILE_T0 + 0.12 * (n + 1))
             for rank in (0, 1) for n in range(HOSTILE_STEPS)]
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=[_kv("service.name", AnyValue(string_value="steptrace"))]),
        scope_spans=[ScopeSpans(scope={"name": "steptrace"}, spans=spans + list(extra))])])


def _report_json(client: ch.ChdbClient, run_id: str, capsys, *more: str) -> dict:
    from steptrace.analysis import report

    capsys.readouterr()
    code = report.main(["--clickhouse", f"chdb://?database={client.database}", "--run", run_id, "--json", *more])
    out = capsys.readouterr()
    assert code == 0, out.err
    return {**json.loads(out.out), "stderr": out.err}


def _compare_json(client: ch.ChdbClient, run_a: str, run_b: str, capsys) -> dict:
    from steptrace.analysis import compare

    capsys.readouterr()
    code = compare.main(["--clickhouse", f"chdb://?database={client.database}", run_a, run_b, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize("attempt", ["1e400", "nan", "inf", "-1", "abc", "99999999999999999999", "1.5", " 3"])
def test_an_unreadable_attempt_costs_its_row_alone_in_report_and_compare(attempt, capsys):
    """issue 32 #1: ``train.attempt`` of "1e400" made report/compare --clickhouse exit 1 (OverflowError), "nan"
    exit 2 for the whole run. The views read such an attempt as 0 (toUInt32OrZero); so does the report, and
    says so. The row here is rank 0's step 3 sent again under another span id: read as attempt 0 it is the
    same step, counted once, as in the cluster view."""
    client = fresh_client()
    copy = _hostile_span("hr", 0, 3, 0.1, 0.12, HOSTILE_T0 + 0.12 * 4, span=999, train__attempt=attempt)
    odd_step = _hostile_span("hr", 1, 25, 0.1, 0.12, HOSTILE_T0 + 0.12 * 26, span=998, train__attempt=attempt)
    load(client, [_hostile_run("hr", copy, odd_step)])
    load(client, [_hostile_run("hr_b")])
    got = _report_json(client, "hr", capsys)
    # The headline goodput (productive over the wall, docs/goodput.md): a number, from the rows read.
    assert (got["steps"], got["compute_seconds"]) == (HOSTILE_STEPS, pytest.approx(2.0))
    assert 0 < got["goodput"] <= 1
    assert "unreadable train.attempt reads as 0" in got["stderr"] and "train.attempt x2" in got["stderr"]
    rank1 = _report_json(client, "hr", capsys, "--rank", "1")
    assert rank1["steps"] == HOSTILE_STEPS + 1  # its step 25, as attempt 0
    # The per-step view reads the same rows the same way: the run's steps, attempt 0 only.
    rows = ch.cluster_steps(client, "hr")
    assert {r["attempt"] for r in rows} == {0} and [r["step"] for r in rows] == [*range(HOSTILE_STEPS), 25]
    assert rows[3]["ranks_reporting"] == 2 and rows[3]["conflicting_rank_count"] == 0
    compared = _compare_json(client, "hr", "hr_b", capsys)
    assert {r["metric"] for r in compared["rows"]} >= {"goodput"}


@pytest.mark.parametrize("field, text", [
    ("train__compute_seconds", "nan"), ("train__compute_seconds", "1e400"), ("train__interval_seconds", "-0.5"),
    ("train__interval_seconds", "abc"), ("train__step", "1e400"), ("train__step", "-3"), ("train__rank", "nan"),
    ("train__rank", "99999999999999999999"),
])
def test_a_span_the_views_cannot_read_is_left_out_of_the_report_too(field, text, capsys):
    """A step span whose step, rank, compute or interval is unreadable is skipped by the views (as by the
    collector's decoder): the report leaves out that span alone, and says it did."""
    client = fresh_client()
    bad = _hostile_span("hs", 0, 25, 0.1, 0.12, HOSTILE_T0 + 0.12 * 26, span=997, **{field: text})
    load(client, [_hostile_run("hs", bad)])
    got = _report_json(client, "hs", capsys)
    assert (got["steps"], got["compute_seconds"]) == (HOSTILE_STEPS, pytest.approx(2.0))
    assert "1 span(s) of run 'hs' left out" in got["stderr"]
    assert [r["step"] for r in ch.cluster_steps(client, "hs")] == list(range(HOSTILE_STEPS))


def test_unreadable_values_cost_only_themselves(capsys):
    """tokens, MFU, scalars, idle reasons, memory that are not finite numbers: each value is left out, its step kept."""
    client = fresh_client()
    odd = _hostile_span("hv", 0, 25, 0.1, 0.12, HOSTILE_T0 + 0.12 * 26, span=996, train__tokens="1e400",
                        train__mfu="nan", train__scalar__loss="inf", train__idle__data_seconds="-inf",
                        train__device_memory__peak_bytes="x", train__world_size="nan",
                        **{"train__pipeline__bubble_ratio__0": "NaN"})
    load(client, [_hostile_run("hv", odd)])
    got = _report_json(client, "hv", capsys)
    assert got["steps"] == HOSTILE_STEPS + 1
    assert got["tokens_per_second"] == pytest.approx(1024 * HOSTILE_STEPS / (0.12 * HOSTILE_STEPS))
    assert "7 attribute value(s) of run 'hv' are not finite numbers" in got["stderr"], got["stderr"]
    run = ch.load_clickhouse_run(client, "hv")
    step = run.steps(0)[-1]
    assert step["step"] == 25 and "tokens" not in step and "mfu" not in step and "scalars" not in step
    assert step["idle_breakdown"] == {} and step["world_size"] is None


def test_report_applies_the_views_conflict_rule_to_a_forged_span(capsys):
    """issue 32 #2: a forged 50 s span for rank 0 step 3 made rank 0 show 21 steps, 52.0 s compute, 98.3 %
    goodput while the cluster view called rank 0 missing at step 3. A rank-step with two different spans is
    a conflict in every table: in no rank's steps, missing in the cluster view, said in a warning."""
    client = fresh_client()
    forged = _hostile_span("hf", 0, 3, 50.0, 50.5, HOSTILE_T0 + 100, span=12345)
    load(client, [_hostile_run("hf", forged)])
    got = _report_json(client, "hf", capsys)
    # The headline goodput is productive / wall (docs/goodput.md); the forged 50 s is in neither.
    assert (got["steps"], got["compute_seconds"]) == (HOSTILE_STEPS - 1, pytest.approx(1.9))
    assert 0 < got["goodput"] < 0.9  # the forged 50 s of "compute" made it 98.3 %
    assert "rank 0 step 3" in got["stderr"] and "conflicts" in got["stderr"]
    run = ch.load_clickhouse_run(client, "hf")
    assert 3 not in [s["step"] for s in run.steps(0)] and 3 in [s["step"] for s in run.steps(1)]
    assert got["cluster"]["missing_rank_steps"] == {"0": 1}
    view = ch.cluster_steps(client, "hf")[3]
    assert (view["conflicting_rank_count"], view["missing_ranks"]) == (1, [0])
    # The per-rank table and the cluster view agree step by step: a rank is in a step's row exactly when the
    # step is in its table.
    for row in ch.cluster_steps(client, "hf"):
        for rank in (0, 1):
            in_table = row["step"] in [s["step"] for s in run.steps(rank)]
            assert in_table == (rank not in row["missing_ranks"]), (row["step"], rank)


def test_reusing_the_real_span_id_with_an_earlier_start_replaces_nothing(capsys):
    """The real span id is derivable from the run id: a copy with an earlier start used to win the
    ``LIMIT 1 BY SpanId`` and stand in for the real step. Now both versions are seen: a conflict."""
    client = fresh_client()
    forged = _hostile_span("hi", 0, 3, 50.0, 50.5, HOSTILE_T0 - 100)  # the real step's span id
    load(client, [_hostile_run("hi", forged)])
    run = ch.load_clickhouse_run(client, "hi")
    steps = run.steps(0)
    assert all(s["compute_seconds"] == pytest.approx(0.1) for s in steps)
    assert [s["step"] for s in steps] == [n for n in range(HOSTILE_STEPS) if n != 3]
    got = _report_json(client, "hi", capsys)
    assert got["compute_seconds"] == pytest.approx(1.9) and got["cluster"]["missing_rank_steps"] == {"0": 1}


def test_an_exporter_retry_and_an_agreeing_copy_count_once_in_the_report(capsys):
    """ClickHouse keeps a retried row twice; a copy under another span id that says the same (compute,
    interval) is the same step for the views (``versions`` 1): once in the report too, at the latest end."""
    client = fresh_client()
    request = _hostile_run("hd", _hostile_span("hd", 1, 4, 0.1, 0.12, HOSTILE_T0 + 0.12 * 5 + 0.001, span=55))
    load(client, [request])
    load(client, [request])
    got = _report_json(client, "hd", capsys)
    assert got["steps"] == HOSTILE_STEPS and "left out" not in got["stderr"]
    run = ch.load_clickhouse_run(client, "hd")
    step4 = next(s for s in run.steps(1) if s["step"] == 4)
    assert step4["end_time"] == pytest.approx(HOSTILE_T0 + 0.12 * 5 + 0.001)
    assert step4["end_time"] == pytest.approx(ch.cluster_steps(client, "hd")[4]["end_time"])


def _restart_spans(run_id: str, attempt: int, first_step: int, steps: int, t0: float) -> list[Span]:
    """Both ranks' steps of a later attempt that resumed at *first_step*, its first step ending after *t0*."""
    return [_hostile_span(run_id, rank, first_step + n, 0.1, 0.12, t0 + 0.12 * (n + 1),
                          span=(attempt << 20) + n * 2 + rank, train__attempt=attempt)
            for rank in (0, 1) for n in range(steps)]


@pytest.mark.parametrize("attempt", [1, 7, 1_000_000])
def test_a_forged_later_attempt_inside_the_run_is_not_believed_and_leaves_the_goodput_alone(attempt, capsys):
    """issue 32 #8: one row claiming a later attempt was taken as a restart: the real steps after its step
    became wasted progress and the job's goodput dropped. Two process starts of one rank cannot overlap,
    so an attempt whose times fall inside another attempt of the rank is left out of every table and of
    the goodput, and the warning says so; the real restart next to it is still believed."""
    client = fresh_client()
    forged = _hostile_span("fa", 0, 3, 0.1, 0.12, HOSTILE_T0 + 0.12 * 10, span=4242, train__attempt=attempt)
    load(client, [_hostile_run("fa", forged)])
    load(client, [_hostile_run("fa_clean")])
    got, clean = _report_json(client, "fa", capsys), _report_json(client, "fa_clean", capsys)
    assert got["job"]["wasted_steps"] == clean["job"]["wasted_steps"] == 0
    assert got["goodput"] == pytest.approx(clean["goodput"])
    assert got["job"]["badput"] == pytest.approx(clean["job"]["badput"])
    assert [a["attempt"] for a in got["job"]["attempts"]] == [0]
    assert f"rank 0 attempt {attempt} (1 step(s)) overlaps" in got["stderr"] and "not believed" in got["stderr"]
    run = ch.load_clickhouse_run(client, "fa")
    assert [s["step"] for s in run.steps(0)] == list(range(HOSTILE_STEPS))


def test_a_real_restart_is_believed_and_a_forged_attempt_inside_it_is_not(capsys):
    """A restart that resumed from step 10 after the first attempt died at step 19: steps 10-19 of attempt 0
    are wasted, as before. A forged attempt-0 row in the middle of attempt 1 (fewer steps than either real
    attempt) is the one left out, whatever its number says."""
    client = fresh_client()
    later = HOSTILE_T0 + 0.12 * HOSTILE_STEPS + 5.0
    restart = _restart_spans("fr", 1, 10, 15, later)
    forged = _hostile_span("fr", 0, 30, 0.1, 0.12, later + 0.12 * 8, span=4343, train__attempt=2)
    load(client, [_hostile_run("fr", *restart, forged)])
    got = _report_json(client, "fr", capsys)
    attempts = got["job"]["attempts"]
    assert [(a["attempt"], a["steps"], a["wasted_steps"]) for a in attempts] == [(0, 20, 10), (1, 15, 0)]
    assert attempts[1]["badput"]["downtime"] == pytest.approx(5.0, abs=1e-6)
    assert "rank 0 attempt 2 (1 step(s)) overlaps" in got["stderr"]
    assert "rank 1 attempt" not in got["stderr"]


def test_the_first_step_after_a_restore_reads_back_from_clickhouse_with_its_one_off_cost(capsys):
    """A restart's first step, exported with train.first_after_restore (a bool: "true" in otel_traces),
    is read back marked: report --clickhouse separates its one-off cost as the JSONL report does."""
    client = fresh_client()
    t = HOSTILE_T0 + 0.12 * HOSTILE_STEPS + 5.0
    restart = []
    for n in range(15):
        first = n == 0
        compute, interval = (0.5, 0.52) if first else (0.1, 0.12)
        t += interval
        extra = {"train__first_after_restore": True} if first else {}
        restart += [_hostile_span("ar", rank, 10 + n, compute, interval, t, span=(1 << 20) + n * 2 + rank,
                                  train__attempt=1, **extra) for rank in (0, 1)]
    load(client, [_hostile_run("ar", *restart)])
    got = _report_json(client, "ar", capsys)
    (cost,) = got["job"]["after_restore"]
    assert (cost["attempt"], cost["step"]) == (1, 10)
    assert cost["typical_step_interval_seconds"] == pytest.approx(0.12, abs=1e-9)
    assert cost["one_off_seconds"] == pytest.approx(0.4, abs=1e-9)
    assert cost["one_off_compute_seconds"] == pytest.approx(0.38, abs=1e-9)


def test_attempt_numbers_that_skip_are_believed_and_named(capsys):
    """An attempt that crashed before its first step sent nothing: attempt 0, then attempt 3, is a real
    restart sequence. It is believed, and the warning names the attempts that sent no step."""
    client = fresh_client()
    later = HOSTILE_T0 + 0.12 * HOSTILE_STEPS + 30.0
    load(client, [_hostile_run("fs", *_restart_spans("fs", 3, HOSTILE_STEPS, 5, later))])
    got = _report_json(client, "fs", capsys)
    assert [a["attempt"] for a in got["job"]["attempts"]] == [0, 3]
    assert "not believed" not in got["stderr"]
    assert "rank 0: attempt 3 follows attempt 0; attempts 1-2 sent no step" in got["stderr"]


# --- the rule, case by case: generated steps through both joins -------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

_cases = itertools.count()
# Few distinct values, so ties (the lowest rank wins), equal medians and exact thresholds come up.
_SECONDS = st.sampled_from([0.0, 0.004, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25])


@st.composite
def steps_of_a_run(draw):
    world = draw(st.integers(1, 6))
    measured = draw(st.sampled_from(["all", "none", "some"]))
    spans = []
    # Up to 8 steps: from the sixth complete step on, the run's noise floor is in the threshold.
    for step in range(draw(st.integers(1, 8))):
        for rank in range(world + 1):  # rank == world: beyond the world size
            if not draw(st.booleans() if rank == world else st.sampled_from([True, True, True, False])):
                continue
            compute = draw(_SECONDS)
            interval = compute + draw(_SECONDS)
            wait = None
            if measured == "all" or (measured == "some" and draw(st.booleans())):
                wait = draw(_SECONDS) * draw(st.sampled_from([1, 1, 3]))  # now and then above the interval
            bubble = {str(s): draw(st.sampled_from([0.0, 0.125, 0.5])) for s in range(draw(st.integers(0, 2)))}
            status = draw(st.sampled_from(["ok", "ok", "error"]))
            spans.append((step, rank, world, compute, interval, wait, bubble, status))
    return spans


def _step_request(run_id: str, spans) -> ExportTraceServiceRequest:
    from steptrace._ids import span_id, trace_id

    out = []
    for step, rank, world, compute, interval, wait, bubble, status in spans:
        attrs = [_kv("train.run_id", AnyValue(string_value=run_id)), _kv("train.rank", AnyValue(int_value=rank)),
                 _kv("train.step", AnyValue(int_value=step)), _kv("train.world_size", AnyValue(int_value=world)),
                 _kv("train.attempt", AnyValue(int_value=0)), _kv("train.status", AnyValue(string_value=status)),
                 _kv("train.compute_seconds", AnyValue(double_value=compute)),
                 _kv("train.interval_seconds", AnyValue(double_value=interval))]
        if wait is not None:
            attrs.append(_kv("train.collective_wait_seconds", AnyValue(double_value=wait)))
        attrs += [_kv(f"train.pipeline.bubble_ratio.{s}", AnyValue(double_value=v)) for s, v in bubble.items()]
        end = 1_700_000_000_000_000_000 + step * 1_000_000_000 + rank
        out.append(Span(trace_id=trace_id(run_id, step, 0).to_bytes(16, "big"),
                        span_id=span_id(run_id, step, rank, "step", 0).to_bytes(8, "big"), name="train.step",
                        kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=end - round(interval * 1e9),
                        end_time_unix_nano=end, attributes=attrs))
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=[_kv("service.name", AnyValue(string_value="steptrace"))]),
        scope_spans=[ScopeSpans(scope={"name": "steptrace"}, spans=out)])])


def test_the_noise_floor_of_a_noisy_run_is_the_collectors(shared_client):
    """Issue 33: 4 ranks, 40 steps, every rank's time on its own noisy (seeded), rank 1 slowed by 25 ms
    from step 20. The SQL view's noise floor, thresholds and stragglers equal the collector's step by
    step, and the floor does its work: steps the fixed bounds alone would name are left unnamed."""
    import random

    rng = random.Random(33)
    spans = []
    excess = []
    for step in range(40):
        own = [0.005 + rng.expovariate(200.0) + (0.025 if rank == 1 and step >= 20 else 0.0) for rank in range(4)]
        interval = max(own) + 0.002
        spans += [(step, rank, 4, interval, interval, interval - own[rank], {}, "ok") for rank in range(4)]
        ordered = sorted(own)
        excess.append(ordered[-1] - ordered[1])  # over the median of the other three
    request = _step_request("noisy", spans)
    load(shared_client, [request])
    records = collector_join([request])
    rows = ch.cluster_steps(shared_client, "noisy")
    assert_same_steps(rows, records)
    assert all(r["straggler_noise_seconds"] is None for r in rows[:5])
    assert all(r["straggler_noise_seconds"] > 0 for r in rows[6:])
    held = [r["step"] for r in rows[6:20] if r["straggler_rank"] is None
            and excess[r["step"]] >= max(0.005, 0.05 * r["interval_median_seconds"])]
    assert held, "the noise floor never held back a step the fixed bounds would name"
    assert [r["straggler_rank"] for r in rows[20:]].count(1) >= 18


@pytest.fixture(scope="module")
def shared_client():
    return fresh_client()


@settings(max_examples=60, deadline=None)
@given(spans=steps_of_a_run())
def test_generated_steps_give_the_collectors_aggregates(shared_client, spans):
    """Ties, even rank counts, unmeasured waits, waits above the interval, ranks beyond the world."""
    run_id = f"gen{next(_cases)}"
    request = _step_request(run_id, spans)
    load(shared_client, [request])
    if not spans:
        return
    world = spans[0][2]
    # The collector with --world-size refuses a rank beyond it; without, it joins such a rank only
    # when it arrives before the step is complete (arrival order, which SQL does not have).
    assert_same_steps(ch.cluster_steps(shared_client, run_id, world_size=world), collector_join([request], world))
    in_world = _step_request(run_id + "w", [s for s in spans if s[1] < world])
    load(shared_client, [in_world])
    assert_same_steps(ch.cluster_steps(shared_client, run_id + "w"), collector_join([in_world]))


def test_the_typed_table_gives_the_same_steps_whether_fed_live_or_backfilled(sdk_run):
    requests, _ = sdk_run
    create_table, create_view, backfill = ch.typed_table_sql(fresh_client().database)  # the statements' shape
    assert create_table.startswith("CREATE TABLE") and "MATERIALIZED VIEW" in create_view
    assert backfill.startswith("INSERT INTO")

    live = fresh_client()
    create_table, create_view, _ = ch.typed_table_sql(live.database)
    live.command(create_table)
    live.command(create_view)  # before the spans arrive: the view types them as they are inserted
    load(live, requests)
    expected = ch.cluster_steps(live, RUN_ID)
    assert_same_steps(ch.cluster_steps(live, RUN_ID, typed_table=ch.TYPED_TABLE), collector_join(requests))

    later = fresh_client()
    load(later, requests)
    for statement in ch.views_sql(later.database, typed=True):  # table, view, backfill, then the views
        later.command(statement)
    rows = later.query(f"SELECT * FROM {later.database}.{ch.CLUSTER_STEPS_VIEW} WHERE run_id = '{RUN_ID}' "
                       "ORDER BY step")
    assert [(r["step"], r["straggler_rank"], r["missing_rank_count"], r["skew_seconds"]) for r in rows] == \
        [(r["step"], r["straggler_rank"], r["missing_rank_count"], r["skew_seconds"]) for r in expected]


def test_steptrace_clickhouse_steps_and_ddl(sdk_run, tmp_path):
    requests, _ = sdk_run
    data = tmp_path / "chdb-data"
    _load_folder(tmp_path, data, requests)
    out = subprocess.run([sys.executable, "-m", "steptrace", "clickhouse", "steps", f"chdb://{data}", "--run", RUN_ID],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert_same_steps(rows, collector_join(requests))
    bad = subprocess.run([sys.executable, "-m", "steptrace", "clickhouse", "steps", "ftp://x", "--run", RUN_ID],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "ClickHouse URL must be" in bad.stderr

    ddl = subprocess.run([sys.executable, "-m", "steptrace", "clickhouse", "ddl", "--database", "ddl_db"],
                         capture_output=True, text=True, timeout=120)
    assert ddl.returncode == 0 and ddl.stdout.startswith('CREATE TABLE IF NOT EXISTS "ddl_db"."otel_traces"')
    client = ch.connect("chdb://")
    client.command("CREATE DATABASE IF NOT EXISTS ddl_db")
    client.command(ddl.stdout.strip().rstrip(";"))
    assert client.query("SELECT count() AS n FROM ddl_db.otel_traces") == [{"n": 0}]
