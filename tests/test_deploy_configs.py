"""The deployment configs: collector/prometheus.yml, collector/rules.yml, collector/otelcol*.yaml.

promtool checks the Prometheus config and the recording rules; a real Prometheus server then
loads both (the shipped prometheus.yml with local targets), scrapes two real rank exporters fed
known step records, and the recording rules must evaluate without error to the values the
timing model gives. otelcol-contrib cannot be installed here (no registry ships it), so the
OpenTelemetry Collector config is checked structurally; ``otelcol-contrib validate`` runs when
the binary is on PATH.

The live-server helpers (:class:`PrometheusServer`, :class:`SyntheticRun`, :func:`start_live`)
are shared with tests/test_dashboards.py.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from prometheus_server import PrometheusProcess, free_port  # noqa: E402

yaml = pytest.importorskip("yaml", reason="reading the configs needs PyYAML (installed with steptrace[test])")

REPO = Path(__file__).resolve().parents[1]
COLLECTOR = REPO / "collector"
PROMETHEUS_YML = COLLECTOR / "prometheus.yml"
RULES_YML = COLLECTOR / "rules.yml"
OTELCOL_YAML = COLLECTOR / "otelcol.yaml"
OTELCOL_CLICKHOUSE_YAML = COLLECTOR / "otelcol-clickhouse.yaml"

RUN_ID = "r"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def recorded_names() -> list[str]:
    """Every series name collector/rules.yml records."""
    return [rule["record"] for group in load_yaml(RULES_YML)["groups"] for rule in group["rules"]
            if "record" in rule]


# -- promtool ----------------------------------------------------------------------------------------

@pytest.fixture
def promtool():
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    return binary


def run_promtool(promtool, *args, cwd=None):
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_accepts_the_prometheus_config_and_its_rule_file(promtool):
    result = run_promtool(promtool, "check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    # check config also loads every rule_files entry: rules.yml and alerts.yml must be found next to it.
    assert "SUCCESS: 2 rule files found" in result.stdout, result.stdout


def test_promtool_accepts_the_recording_rules(promtool):
    result = run_promtool(promtool, "check", "rules", str(RULES_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recorded_names())} rules found" in result.stdout, result.stdout


def test_the_documented_file_sd_format_is_accepted(promtool, tmp_path):
    """prometheus.yml's comment shows a targets/ranks-<job>.json: promtool validates such a file."""
    shutil.copy(PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copy(RULES_YML, tmp_path / "rules.yml")
    shutil.copy(COLLECTOR / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "ranks-llama.json").write_text(
        json.dumps([{"targets": ["node0:9464", "node0:9465"], "labels": {"cluster": "a"}}]))
    result = run_promtool(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "does not exist" not in result.stdout + result.stderr

    (tmp_path / "targets" / "ranks-llama.json").write_text(json.dumps([{"targets": "node0:9464"}]))
    result = run_promtool(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode != 0, "a malformed file_sd file must fail the check"


# -- prometheus.yml and rules.yml, read as data ------------------------------------------------------

def scrape_jobs() -> dict[str, dict]:
    return {job["job_name"]: job for job in load_yaml(PROMETHEUS_YML)["scrape_configs"]}


def test_prometheus_config_scrapes_ranks_collectors_and_otelcol_and_loads_the_rules():
    config = load_yaml(PROMETHEUS_YML)
    assert config["rule_files"] == ["rules.yml", "alerts.yml"]
    jobs = scrape_jobs()
    assert set(jobs) == {"steptrace", "steptrace-collector", "otelcol"}
    # One target per rank port (prometheus_port + local_rank): the README's example layout.
    ranks = [t for sc in jobs["steptrace"]["static_configs"] for t in sc["targets"]]
    assert "node0:9464" in ranks and "node0:9467" in ranks and len(ranks) == len(set(ranks))
    assert jobs["steptrace"]["file_sd_configs"][0]["files"] == ["targets/ranks-*.json"]


def test_prometheus_scrapes_the_collectors_the_load_balancer_sends_to():
    collectors = [t for sc in scrape_jobs()["steptrace-collector"]["static_configs"] for t in sc["targets"]]
    backends = load_yaml(OTELCOL_YAML)["exporters"]["loadbalancing"]["resolver"]["static"]["hostnames"]
    assert sorted(t.rsplit(":", 1)[0] for t in collectors) == sorted(b.rsplit(":", 1)[0] for b in backends)


def level_labels(name: str) -> set[str]:
    """The labels a rule's level promises: run_id_kind_stage_chunk -> {run_id, kind, stage, chunk}."""
    level = name.split(":")[0]
    assert level.startswith("run_id"), name
    return {"run_id", *[label for label in level[len("run_id"):].split("_") if label]}


def test_recording_rule_names_follow_the_level_metric_operations_convention():
    names = recorded_names()
    assert len(names) == len(set(names))
    for group in load_yaml(RULES_YML)["groups"]:
        for rule in group["rules"]:
            name = rule["record"]
            level, metric, operations = name.split(":")
            assert level_labels(name) <= {"run_id", "rank", "le", "reason", "kind", "stage", "chunk", "sink"}, name
            # rate() of a counter drops `_total` from the name.
            assert metric.startswith("steptrace_") and not metric.endswith("_total") and operations, name
            # Every rule reads a 5-minute window, directly or through an earlier rule.
            assert "[5m]" in rule["expr"] or any(other in rule["expr"] for other in names if other != name), name


# -- otelcol.yaml ------------------------------------------------------------------------------------

# Component types of otelcol-contrib this config may use (a typo would fail `validate`).
OTELCOL_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch"},
    "exporters": {"loadbalancing", "load_balancing"},
    "extensions": {"health_check"},
}


def component_type(name: str) -> str:
    return name.split("/", 1)[0]


@pytest.fixture(scope="module")
def otelcol():
    return load_yaml(OTELCOL_YAML)


def test_otelcol_receives_otlp_over_grpc_and_http(otelcol):
    protocols = otelcol["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def assert_pipelines_consistent(config: dict, types: dict[str, set[str]]) -> None:
    """Pipelines use only defined components, every defined one is used, of a known type."""
    service = config["service"]
    used = {kind: set() for kind in ("receivers", "processors", "exporters")}
    assert service["pipelines"], "no pipelines"
    for name, pipeline in service["pipelines"].items():
        assert component_type(name) in ("traces", "metrics", "logs"), name
        assert pipeline["receivers"] and pipeline["exporters"], name
        for kind in used:
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"pipeline {name} uses undefined {kind[:-1]} {component}"
                used[kind].add(component)
    for kind, names in used.items():
        assert set(config[kind]) == names, f"{kind} defined but not used: {set(config[kind]) - names}"
    for extension in service.get("extensions", []):
        assert extension in config["extensions"], extension
    assert set(config["extensions"]) == set(service.get("extensions", []))
    for kind, allowed in types.items():
        for component in config[kind]:
            assert component_type(component) in allowed, f"unexpected {kind[:-1]} type {component}"


def test_otelcol_pipelines_use_only_defined_components_and_every_defined_one_is_used(otelcol):
    assert_pipelines_consistent(otelcol, OTELCOL_TYPES)


def test_otelcol_processors_limit_memory_first_then_batch(otelcol):
    for name, pipeline in otelcol["service"]["pipelines"].items():
        processors = [component_type(p) for p in pipeline["processors"]]
        assert processors[0] == "memory_limiter", name      # refuse before anything buffers
        assert "batch" in processors, name


def test_otelcol_routes_every_span_of_a_step_to_one_steptrace_collector(otelcol):
    """Spans go only to loadbalancing exporters keyed by trace id (= one step, every rank)."""
    traces = otelcol["service"]["pipelines"]["traces"]
    for name in traces["exporters"]:
        exporter = otelcol["exporters"][name]
        assert component_type(name) in ("loadbalancing", "load_balancing"), name
        assert exporter["routing_key"] == "traceID", name
        # The loadbalancing exporter speaks OTLP/gRPC to its backends: `otlp` is its only protocol.
        assert set(exporter["protocol"]) == {"otlp"}, name
        assert "endpoint" not in exporter["protocol"]["otlp"], "the resolver sets each backend's endpoint"
        resolver = exporter["resolver"]
        hosts = resolver["static"]["hostnames"]
        assert len(hosts) >= 2 and len(set(hosts)) == len(hosts)
        assert all(h.startswith("steptrace-collector-") and h.endswith(":4317") for h in hosts), hosts


def test_otelcol_never_routes_metrics_by_trace_id(otelcol):
    for name, pipeline in otelcol["service"]["pipelines"].items():
        if component_type(name) != "metrics":
            continue
        for exporter in pipeline["exporters"]:
            config = otelcol["exporters"][exporter]
            # Metrics carry no trace id; per rank (resource) keeps cumulative counters on one backend.
            assert config.get("routing_key") == "resource", exporter


# -- otelcol-clickhouse.yaml --------------------------------------------------------------------------

# The contrib ClickHouse exporter's documented options, written down from
# open-telemetry/opentelemetry-collector-contrib exporter/clickhouseexporter/README.md at commit
# 000d4c7c4b7769e2d7d1b00ee41d5868add14e06 ("Configuration options", "TLS", "Experimental JSON
# support"), cross-checked with config.schema.yaml at fff7223ebcd897edbace6f83a72a776867a971f4.
# A key outside these would be refused by `otelcol-contrib validate` (unknown mapstructure key).
CLICKHOUSE_EXPORTER_KEYS = {
    "endpoint", "username", "password", "database", "connection_params", "ttl", "create_schema",
    "compress", "async_insert", "tls", "json",
    "logs_table_name", "traces_table_name", "profiles_table_name", "metrics_tables",
    "metrics_table_name",  # deprecated for metrics_tables, still accepted
    "cluster_name", "table_engine",
    "timeout", "sending_queue", "retry_on_failure",   # exporterhelper's, listed under "Processing"
}
CLICKHOUSE_SENDING_QUEUE_KEYS = {"enabled", "num_consumers", "queue_size", "sizer", "block_on_overflow",
                                 "storage", "batch"}
CLICKHOUSE_BATCH_KEYS = {"flush_timeout", "min_size", "max_size", "sizer"}
CLICKHOUSE_RETRY_KEYS = {"enabled", "initial_interval", "max_interval", "max_elapsed_time"}
CLICKHOUSE_COMPRESS = {"none", "zstd", "lz4", "gzip", "deflate", "br", "true"}
# The endpoint schemes the README lists (clickhouse-go's DSN).
CLICKHOUSE_SCHEMES = {"tcp", "http", "https", "clickhouse"}

OTELCOL_CLICKHOUSE_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch"},
    "exporters": {"clickhouse"},
    "extensions": {"health_check"},
}

# A Go time.Duration as the collector's config parses it ("720h", "1m30s", "200ms").
GO_DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")


@pytest.fixture(scope="module")
def otelcol_clickhouse():
    return load_yaml(OTELCOL_CLICKHOUSE_YAML)


def test_otelcol_clickhouse_pipelines_are_consistent(otelcol_clickhouse):
    assert_pipelines_consistent(otelcol_clickhouse, OTELCOL_CLICKHOUSE_TYPES)
    receivers = otelcol_clickhouse["receivers"]["otlp"]["protocols"]
    assert receivers["grpc"]["endpoint"].endswith(":4317") and receivers["http"]["endpoint"].endswith(":4318")


def test_otelcol_clickhouse_sends_every_span_to_the_clickhouse_exporter(otelcol_clickhouse):
    """Spans (and the ranks' metrics, so the receiver does not refuse them) go to ClickHouse,
    after the memory limiter; no trace-id routing: the join is SQL, any instance takes any span."""
    pipelines = otelcol_clickhouse["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    for name, pipeline in pipelines.items():
        assert [component_type(e) for e in pipeline["exporters"]] == ["clickhouse"], name
        assert component_type(pipeline["processors"][0]) == "memory_limiter", name
    assert "loadbalancing" not in otelcol_clickhouse["exporters"]


def test_otelcol_clickhouse_exporter_uses_only_documented_options(otelcol_clickhouse):
    exporter = otelcol_clickhouse["exporters"]["clickhouse"]
    assert set(exporter) <= CLICKHOUSE_EXPORTER_KEYS, set(exporter) - CLICKHOUSE_EXPORTER_KEYS
    queue = exporter["sending_queue"]
    assert set(queue) <= CLICKHOUSE_SENDING_QUEUE_KEYS, set(queue) - CLICKHOUSE_SENDING_QUEUE_KEYS
    assert set(queue.get("batch") or {}) <= CLICKHOUSE_BATCH_KEYS
    assert set(exporter["retry_on_failure"]) <= CLICKHOUSE_RETRY_KEYS
    assert exporter["compress"] in CLICKHOUSE_COMPRESS
    for key in ("ttl", "timeout"):
        assert GO_DURATION.fullmatch(str(exporter[key])), (key, exporter[key])
    for key in ("flush_timeout",):
        assert GO_DURATION.fullmatch(str(queue["batch"][key])), key
    for key in ("initial_interval", "max_interval", "max_elapsed_time"):
        assert GO_DURATION.fullmatch(str(exporter["retry_on_failure"][key])), key
    assert isinstance(exporter["create_schema"], bool) and isinstance(exporter["async_insert"], bool)


def test_otelcol_clickhouse_writes_the_table_steptrace_reads(otelcol_clickhouse):
    exporter = otelcol_clickhouse["exporters"]["clickhouse"]
    scheme, _, rest = exporter["endpoint"].partition("://")
    assert scheme in CLICKHOUSE_SCHEMES and rest, exporter["endpoint"]
    assert exporter["traces_table_name"] == "otel_traces"
    assert exporter["database"]
    # The README: batch inside the exporter's queue, not with the batch processor as well.
    assert exporter["sending_queue"]["enabled"] and exporter["sending_queue"]["batch"]["min_size"] >= 1000
    for pipeline in otelcol_clickhouse["service"]["pipelines"].values():
        assert not any(component_type(p) == "batch" for p in pipeline["processors"])


def test_otelcol_clickhouse_cites_the_exporter_source_it_was_checked_against():
    text = OTELCOL_CLICKHOUSE_YAML.read_text()
    assert "exporter/clickhouseexporter/README.md" in text
    assert "000d4c7c4b7769e2d7d1b00ee41d5868add14e06" in text


@pytest.mark.parametrize("config", [OTELCOL_YAML, OTELCOL_CLICKHOUSE_YAML], ids=lambda p: p.name)
def test_otelcol_contrib_validates_the_config_when_installed(config):
    binary = shutil.which("otelcol-contrib")
    if binary is None:
        pytest.skip("otelcol-contrib is not installed (no package registry here ships it); the real "
                    f"check is `otelcol-contrib validate --config collector/{config.name}`")
    result = subprocess.run([binary, "validate", f"--config={config}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- a live Prometheus server (shared with test_dashboards.py) ---------------------------------------

class PrometheusServer(PrometheusProcess):
    """A Prometheus server on 127.0.0.1 with its own storage under ``tmp_path``."""

    def __init__(self, binary: str, config: dict, tmp_path: Path):
        super().__init__(binary, yaml.safe_dump(config, sort_keys=False), tmp_path)

    def query(self, promql: str) -> dict:
        """POST /api/v1/query, as Grafana does: the raw answer (status, errorType, data)."""
        return self.api("/api/v1/query", {"query": promql}, post=True)

    def vector(self, promql: str) -> list[tuple[dict, float]]:
        body = self.query(promql)
        assert body["status"] == "success", (promql, body)
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            return [({}, float(result[1]))]
        return [(r["metric"], float(r["value"][1])) for r in result]

    def values(self, promql: str, key: str) -> dict[str, float]:
        """``promql``'s result as {value of label ``key``: sample value}."""
        return {labels.get(key, ""): value for labels, value in self.vector(promql)}

    def wait_until(self, promql: str, predicate, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            seen = self.vector(promql)
            if predicate(seen):
                return seen
            time.sleep(0.2)
        pytest.fail(f"{promql} never satisfied the condition (last: {seen}) in {timeout_s} s; "
                    f"log:\n{self.log_tail()}")

    def wait_for_rule_evaluation(self, after: float, timeout_s: float = 30.0) -> None:
        """Wait until every rule group has been evaluated at a unix time later than ``after``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            groups = self.api("/api/v1/rules", {"type": "record"})["data"]["groups"]
            if groups and all(_rfc3339(g.get("lastEvaluation")) > after for g in groups):
                return
            time.sleep(0.2)
        pytest.fail(f"the recording rules were not evaluated after {after} within {timeout_s} s; "
                    f"log:\n{self.log_tail()}")



def _rfc3339(value: str | None) -> float:
    """Unix seconds of Prometheus's RFC 3339 timestamps (nanosecond fractions, `Z` or an offset)."""
    if not value or value.startswith("0001-"):    # Go's zero time: never evaluated
        return 0.0
    match = re.fullmatch(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", value)
    assert match, value
    base = datetime.datetime.fromisoformat(match[1] + ("+00:00" if match[3] == "Z" else match[3]))
    return base.timestamp() + float(match[2] or 0)


class StandInCollector:
    """A /metrics with the steptrace collector's metric names (collector/_metrics.py), set to known values.

    It stands in for `steptrace collector` so the cluster dashboard's queries can be evaluated
    here; the end-to-end test runs the real collector. Two instances split a run's steps, as
    behind the load balancer: ``ahead`` has joined the latest *complete* step; the other has
    joined a later, incomplete step (one rank missing) but its last complete step is old, with
    other values. A query that reads "now" from the wrong instance gives a wrong answer.
    """

    def __init__(self, ahead: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.ahead = ahead
        reg = CollectorRegistry()
        run = ("run_id",)
        self.compute = Gauge("steptrace_cluster_step_compute_seconds", "", run + ("stat",), registry=reg)
        self.interval = Gauge("steptrace_cluster_step_interval_seconds", "", run + ("stat",), registry=reg)
        self.skew = Gauge("steptrace_cluster_step_skew_seconds", "", run, registry=reg)
        self.straggler = Gauge("steptrace_cluster_straggler_rank", "", run, registry=reg)
        self.straggler_steps = Counter("steptrace_cluster_straggler_steps", "", run + ("rank",), registry=reg)
        self.ranks = Gauge("steptrace_cluster_ranks_reporting", "", run, registry=reg)
        self.bubble = Gauge("steptrace_cluster_pipeline_bubble_ratio", "", run + ("stage",), registry=reg)
        self.compute_share = Gauge("steptrace_cluster_compute_share_ratio", "", run, registry=reg)
        self.collective_wait = Gauge("steptrace_cluster_step_collective_wait_seconds", "", run + ("stat",),
                                     registry=reg)
        self.last_step = Gauge("steptrace_cluster_last_step", "", run, registry=reg)
        self.last_complete = Gauge("steptrace_cluster_last_complete_step", "", run, registry=reg)
        self.incomplete = Counter("steptrace_cluster_incomplete_steps", "", run, registry=reg)
        self.join_lag = Histogram("steptrace_cluster_join_lag_seconds", "", run, registry=reg,
                                  buckets=(0.01, 0.1, 1.0, 10.0))
        self.spans = Counter("steptrace_collector_received_spans", "", run, registry=reg)
        self.rejected = Counter("steptrace_collector_rejected_requests", "", ("reason",), registry=reg)
        self.late = Counter("steptrace_collector_late_spans", "", run, registry=reg)
        self.own = Gauge("steptrace_cluster_step_own_seconds", "", run + ("stat",), registry=reg)
        self.cost = Gauge("steptrace_cluster_step_straggler_cost_seconds", "", run, registry=reg)
        self.cost_total = Counter("steptrace_cluster_straggler_cost_seconds", "", run + ("rank",), registry=reg)
        self.score = Gauge("steptrace_cluster_straggler_score", "", run + ("rank", "kind"), registry=reg)
        self.threshold = Gauge("steptrace_cluster_step_straggler_threshold_seconds", "", run, registry=reg)
        self.persistent = Gauge("steptrace_cluster_persistent_straggler_steps_ratio", "", run + ("rank",),
                                registry=reg)
        self.persistent_own = Gauge("steptrace_cluster_persistent_straggler_own_ratio", "", run + ("rank",),
                                    registry=reg)
        self.capture_requests = Counter("steptrace_cluster_capture_requests", "", run + ("state",), registry=reg)
        self._server, self._thread = start_http_server(0, "127.0.0.1", registry=reg)
        self.target = f"127.0.0.1:{self._server.server_port}"

    def joined(self, step: int) -> None:
        """Report the run's steps up to ``step`` joined."""
        r = RUN_ID
        if self.ahead:
            complete, values, straggler, bubble = step, (0.08, 0.12, 0.16), "1", (0.1, 0.2)
            self.last_step.labels(r).set(step)
            self.ranks.labels(r).set(2)
        else:
            complete, values, straggler, bubble = step // 2, (1.0, 2.0, 3.0), "0", (0.9, 0.9)
            self.last_step.labels(r).set(step + 1)
            self.ranks.labels(r).set(1)
            self.incomplete.labels(r).inc()
        self.last_complete.labels(r).set(complete)
        for stat, value in zip(("min", "median", "max"), values):
            self.compute.labels(r, stat).set(value)
            self.interval.labels(r, stat).set(value * 1.25)
        self.skew.labels(r).set(values[2] - values[0])
        self.straggler.labels(r).set(int(straggler))
        self.straggler_steps.labels(r, straggler).inc()
        for stat, value in zip(("min", "median", "max"), values):
            self.own.labels(r, stat).set(value * 0.5)
        self.cost.labels(r).set(values[2] - values[1])
        self.threshold.labels(r).set((values[2] - values[1]) / 2)
        # The run's straggler, as each instance sees it over its own window of steps.
        self.persistent.labels(r, straggler).set(0.9)
        self.persistent_own.labels(r, straggler).set(2.0)
        self.cost_total.labels(r, straggler).inc(values[2] - values[1])
        # The verdict's capture requests: the culprit's and the reference rank's, the culprit fetching its own.
        self.capture_requests.labels(r, "issued").inc(2)
        self.capture_requests.labels(r, "fetched").inc()
        for rank in ("0", "1"):
            self.score.labels(r, rank, "relative").set(1.0 if rank == "0" else 0.5)
            self.score.labels(r, rank, "individual").set(1.0)
        for stage, ratio in enumerate(bubble):
            self.bubble.labels(r, str(stage)).set(ratio)
        self.compute_share.labels(r).set(0.8 if self.ahead else 0.5)
        for stat, value in zip(("min", "median", "max"), values):
            self.collective_wait.labels(r, stat).set(value * 0.2)
        self.join_lag.labels(r).observe(0.05)
        self.spans.labels(r).inc(12)
        self.late.labels(r).inc(1)
        self.rejected.labels("malformed").inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SyntheticRun:
    """Two ranks' real ``PrometheusSink``s and two stand-in collectors, fed known records.

    Per step, rank 0 computes 0.08 s in a 0.1 s interval and rank 1 0.16 s in 0.2 s, a fifth of the
    interval of which is waiting in collectives; both idle 15% on `data` and 5% on `checkpoint`, so
    goodput (own compute / wall) is 0.6, the wait 0.2, and goodput + wait + idle ratios is 1. Each
    rank's steps run back to back from its process start (no start-up: a run this short would
    otherwise have its first wall sample out of proportion, and rate()'s extrapolation with it).
    Rank 0 is pipeline stage 0 (microbatches: forward 0.01 s, backward 0.02 s), rank 1 stage 1
    (0.015 s, 0.03 s). Every 5th step saves a checkpoint, every 10th step fails, steps 7, 27, ...
    are followed by a deep capture (the slow trigger), and the resolver drops a record every step.
    """

    RANKS = {
        0: {"compute": 0.08, "interval": 0.1, "data": 0.015, "checkpoint": 0.005, "forward": 0.01,
            "backward": 0.02, "blocking": 0.5},
        1: {"compute": 0.16, "interval": 0.2, "data": 0.03, "checkpoint": 0.01, "forward": 0.015,
            "backward": 0.03, "blocking": 1.0},
    }
    PEAK_TFLOPS = 400.0

    def __init__(self):
        from steptrace.prometheus import PrometheusSink

        self.step = 0
        self.dropped = 0
        self.process_start = time.time() - 3600.0
        self.sinks = {}
        for rank in self.RANKS:
            sink = PrometheusSink(0, run_id=RUN_ID, rank=rank, peak_tflops=self.PEAK_TFLOPS,
                                  capture_triggers=("slow", "request"))
            sink.attach_drop_counter(lambda: {"resolver_queue": self.dropped})
            self.sinks[rank] = sink
        self.collectors = [StandInCollector(ahead=True), StandInCollector(ahead=False)]

    def rank_targets(self) -> list[str]:
        return [sink.endpoint.split("//")[1].split("/")[0] for sink in self.sinks.values()]

    def collector_targets(self) -> list[str]:
        return [c.target for c in self.collectors]

    def records(self, rank: int, n: int) -> list[dict]:
        from steptrace._ids import trace_id_hex

        t = self.RANKS[rank]
        stage = str(rank)
        start = self.process_start + n * t["interval"]
        records = [] if n else [{"type": "attempt", "run_id": RUN_ID, "rank": rank, "attempt": 0, "world_size": 2,
                                 "start_time": self.process_start, "init_time": self.process_start}]
        records += [{
            "type": "step", "run_id": RUN_ID, "rank": rank, "world_size": 2, "step": n,
            "trace_id": trace_id_hex(RUN_ID, n), "status": "error" if n % 10 == 9 else "ok",
            "backend": "simulated", "interval_seconds": t["interval"], "compute_seconds": t["compute"],
            "host_start_time": start, "end_time": start + t["interval"],
            "idle_seconds": t["interval"] - t["compute"],
            "idle_breakdown": {"data": t["data"], "checkpoint": t["checkpoint"]},
            "tokens": 1000, "tokens_per_second": 1000 / t["interval"],
            "tflops_per_second": 100.0 * (rank + 1), "mfu": 100.0 * (rank + 1) / self.PEAK_TFLOPS,
            "pipeline_bubble_ratio": {stage: 0.1 * (rank + 1)},
            # The wait in collectives, as torch.distributed ranks measure it: a fifth of the interval.
            "collective_wait_seconds": t["interval"] / 5, "own_seconds": t["interval"] * 4 / 5,
            "collective_wait_source": "process_group",
            # NCCL's device-timed exposed communication (the "Exposed communication per rank" panel):
            # the wait above plus a 1 ms transfer no compute overlapped.
            "exposed_communication_seconds": t["interval"] / 5 + 0.001,
            # A GPU health window per step (docs/health.md): rank 1's GPU is thermally throttled a
            # tenth of the step at a lower SM clock, and shows one Xid every 10 steps.
            "health": {"window_steps": 1, "violation_ms": {"thermal": 100.0 * rank * t["interval"], "power": 0.0},
                       "sm_clock_mhz_mean": 1980.0 - 570.0 * rank, "temperature_c_max": 70.0 + 15 * rank,
                       "xid_events": 1 if rank and n % 10 == 0 else 0},
        }]
        for i in range(2):
            for kind in ("forward", "backward"):
                records.append({"type": "microbatch", "run_id": RUN_ID, "rank": rank, "step": n,
                                "microbatch": i, "stage": rank, "chunk": 0, "kind": kind,
                                "compute_seconds": t[kind]})
        if n % 5 == 0:
            records.append({"type": "checkpoint", "run_id": RUN_ID, "rank": rank, "step": n, "status": "ok",
                            "blocking_seconds": t["blocking"], "async_seconds": 2.0})
        if n % 20 == 7:  # a deep capture now and then (the "Deep capture" panels)
            records.append({"type": "capture", "run_id": RUN_ID, "rank": rank, "attempt": 0, "status": "ok",
                            "trigger": "slow", "trigger_step": n, "reason": f"step {n} was slow",
                            "first_step": n + 1, "last_step": n + 3, "path": f"/runs/step-{n + 1}/trace.json",
                            "profiler": "torch", "bytes": 1 << 20, "start_time": start, "end_time": start,
                            "triggers_skipped": 0})
        return records

    def feed(self, steps: int) -> None:
        for _ in range(steps):
            for rank, sink in self.sinks.items():
                sink.export(self.records(rank, self.step))
            for collector in self.collectors:
                collector.joined(self.step)
            self.dropped += 1
            self.step += 1

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.shutdown(5)
        for collector in self.collectors:
            collector.close()


def live_config(run: SyntheticRun, rules_path: Path) -> dict:
    """collector/prometheus.yml as shipped, pointed at the local targets, scraping every second."""
    config = load_yaml(PROMETHEUS_YML)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(rules_path)]
    config.pop("alerting", None)  # no Alertmanager here (tests/test_alerts_e2e.py has one)
    targets = {
        "steptrace": run.rank_targets(),
        "steptrace-collector": run.collector_targets(),
        # Nothing listens there: the otelcol target is down, as the "targets down" panel should show.
        "otelcol": [f"127.0.0.1:{free_port()}"],
    }
    for job in config["scrape_configs"]:
        job.pop("file_sd_configs", None)
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


def start_live(tmp_path: Path):
    """A Prometheus server with collector/prometheus.yml and rules.yml, after a SyntheticRun.

    Returns (server, run, fed_until): the server has scraped every record, and every
    recording rule has been evaluated after the last scrape (``fed_until`` is when feeding
    stopped). Skips when the prometheus binary is missing or does not start.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` server binary is not installed (Debian package `prometheus`; "
                    ".ci/run installs it)")
    pytest.importorskip("prometheus_client", reason="the exporter needs `pip install 'steptrace[prometheus]'`")

    rules = load_yaml(RULES_YML)
    for group in rules["groups"]:
        group["interval"] = "1s"   # the shipped 30 s would make the test wait minutes
    rules_path = tmp_path / "rules.yml"
    rules_path.write_text(yaml.safe_dump(rules, sort_keys=False))

    run = SyntheticRun()
    server = None
    try:
        # The first scrape must see every series already created (rate() counts increases from
        # a series' first sample), and no export running: feed one step before Prometheus starts.
        run.feed(1)
        server = PrometheusServer(binary, live_config(run, rules_path), tmp_path)
        if not server.wait_ready():
            pytest.skip(f"the Prometheus server at {binary} did not start:\n{server.log_tail()}")
        sel = f'{{job="steptrace", run_id="{RUN_ID}"}}'
        server.wait_until(f"count(steptrace_steps_total{sel}) by (rank)", lambda v: len(v) == 2)
        server.wait_until('up{job="steptrace-collector"} == 1', lambda v: len(v) == 2)
        for _ in range(8):        # ~2 s of steps: several scrapes see the counters grow
            run.feed(5)
            time.sleep(0.25)
        fed_until = time.time()
        ok = run.step - run.step // 10
        server.wait_until(f'sum(steptrace_steps_total{{{sel[1:-1]}, status="ok"}})',
                          lambda v: v and v[0][1] == 2 * ok)
        # Every rule group evaluated at least once after both ranks' post-feed scrape.
        server.wait_for_rule_evaluation(after=fed_until + 1.5)
        return server, run, fed_until
    except BaseException:
        if server is not None:
            server.stop()
        run.close()
        raise


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server, run, _ = start_live(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()
    run.close()


def test_every_recording_rule_evaluates_without_error_on_a_real_prometheus(live):
    groups = live.api("/api/v1/rules")["data"]["groups"]
    rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
    assert set(rules) == set(recorded_names())
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        # Each one produced series for the run (the data covers every metric they read), with
        # exactly the labels its level names: no job/instance left to split a run in two.
        result = live.vector(f'{name}{{run_id="{RUN_ID}"}}')
        assert result, f"{name} recorded nothing"
        for labels, _ in result:
            assert set(labels) - {"__name__"} == level_labels(name), (name, labels)


def test_goodput_rule_is_own_compute_over_the_wall(live):
    """Goodput as docs/goodput.md defines it, over 5 minutes: Σ own compute (compute less the wait in
    collectives) / Σ wall, all ranks: (0.06 + 0.12) / (0.1 + 0.2) per step. (The wall counts differences
    of unix times, ~2e-7 s apart as doubles: exact to 1e-6.)"""
    assert live.values(f'run_id:steptrace_goodput:ratio_rate5m{{run_id="{RUN_ID}"}}', "run_id") == {
        RUN_ID: pytest.approx(0.6, abs=1e-6)}


def test_goodput_the_wait_and_the_idle_ratios_add_up_to_the_wall_time(live):
    idle = live.values(f'run_id_reason:steptrace_step_idle:ratio_rate5m{{run_id="{RUN_ID}"}}', "reason")
    assert idle == {"data": pytest.approx(0.15, abs=1e-6), "checkpoint": pytest.approx(0.05, abs=1e-6)}
    wait = live.vector(f'run_id:steptrace_step_collective_wait:ratio_rate5m{{run_id="{RUN_ID}"}}')[0][1]
    assert wait == pytest.approx(0.2, abs=1e-6)
    goodput = live.vector(f'run_id:steptrace_goodput:ratio_rate5m{{run_id="{RUN_ID}"}}')[0][1]
    assert goodput + wait + sum(idle.values()) == pytest.approx(1.0, abs=1e-6)


def test_per_rank_means_are_exact_and_the_slow_rank_is_above_the_median(live):
    compute = live.values(f'run_id_rank:steptrace_step_compute_seconds:mean_rate5m{{run_id="{RUN_ID}"}}', "rank")
    interval = live.values(f'run_id_rank:steptrace_step_interval_seconds:mean_rate5m{{run_id="{RUN_ID}"}}', "rank")
    assert compute == {"0": pytest.approx(0.08), "1": pytest.approx(0.16)}
    assert interval == {"0": pytest.approx(0.1), "1": pytest.approx(0.2)}
    ratio = live.values(
        f'run_id_rank:steptrace_step_compute_seconds:ratio_to_median_rate5m{{run_id="{RUN_ID}"}}', "rank")
    # The median of two ranks is their mean, 0.12 s.
    assert ratio == {"0": pytest.approx(0.08 / 0.12), "1": pytest.approx(0.16 / 0.12)}


def test_step_percentiles_are_across_the_ranks_means(live):
    """No rule reads buckets (ranks serve _sum/_count by default): p50/p90 are across each rank's exact mean."""
    p = {name: live.vector(f'run_id:steptrace_step_{name}{{run_id="{RUN_ID}"}}')[0][1] for name in (
        "compute_seconds:p50_rate5m", "compute_seconds:p90_rate5m",
        "interval_seconds:p50_rate5m", "interval_seconds:p90_rate5m")}
    # Rank 0 computes 0.08 s in 0.1 s steps, rank 1 0.16 s in 0.2 s: quantile() interpolates between them.
    assert p["compute_seconds:p50_rate5m"] == pytest.approx(0.12)
    assert p["compute_seconds:p90_rate5m"] == pytest.approx(0.08 + 0.9 * 0.08)
    assert p["interval_seconds:p50_rate5m"] == pytest.approx(0.15)
    assert p["interval_seconds:p90_rate5m"] == pytest.approx(0.1 + 0.9 * 0.1)


def test_microbatch_rules_keep_kind_stage_and_chunk(live):
    mean = {(m["kind"], m["stage"], m["chunk"]): v for m, v in live.vector(
        f'run_id_kind_stage_chunk:steptrace_microbatch_seconds:mean_rate5m{{run_id="{RUN_ID}"}}')}
    assert mean == {("forward", "0", "0"): pytest.approx(0.01), ("backward", "0", "0"): pytest.approx(0.02),
                    ("forward", "1", "0"): pytest.approx(0.015), ("backward", "1", "0"): pytest.approx(0.03)}
    p90 = {(m["kind"], m["stage"]): v for m, v in live.vector(
        f'run_id_kind_stage_chunk:steptrace_microbatch_seconds:p90_rate5m{{run_id="{RUN_ID}"}}')}
    # Stage 0 is rank 0 alone, every forward microbatch 0.01 s: the p90 of one mean is that mean.
    assert p90[("forward", "0")] == pytest.approx(0.01)


def test_tokens_rule_sums_the_ranks(live):
    tokens = live.values(f'run_id:steptrace_tokens:rate5m{{run_id="{RUN_ID}"}}', "run_id")
    assert set(tokens) == {RUN_ID} and tokens[RUN_ID] > 0
