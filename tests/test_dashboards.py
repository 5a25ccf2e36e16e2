"""The Grafana dashboards (collector/dashboards/): generated, complete, and every query valid.

The committed JSON must be byte-equal to what collector/dashboards/generate.py writes; the
panels, variables and data source references are the documented ones; every metric a query
reads is one that the rank exporter, the collector or collector/rules.yml defines; and every
query, with Grafana's variables substituted, is evaluated by a real Prometheus server (loaded
with collector/prometheus.yml and rules.yml, scraping real rank exporters and stand-in
collectors; see tests/test_deploy_configs.py): it must parse and return data.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_deploy_configs import RUN_ID, live, load_yaml, recorded_names  # noqa: F401 (live: the shared fixture)

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "collector" / "dashboards"
GENERATOR = DASHBOARDS / "generate.py"
PROVISIONING = DASHBOARDS / "provisioning"
FILES = ("steptrace-training.json", "steptrace-cluster.json")   # the Prometheus dashboards
# Every file generate.py writes: the ClickHouse one has its own tests (tests/test_dashboards_clickhouse.py).
GENERATED = FILES + ("steptrace-clickhouse.json", "steptrace-clickhouse-typed.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# What the rank exporter serves (docs/prometheus.md, steptrace/prometheus.py).
RANK_HISTOGRAMS = {
    "steptrace_step_interval_seconds", "steptrace_step_compute_seconds", "steptrace_microbatch_seconds",
    "steptrace_checkpoint_blocking_seconds", "steptrace_checkpoint_async_seconds",
}
RANK_METRICS = {
    "steptrace_step_idle_seconds_total", "steptrace_steps_total", "steptrace_last_step",
    "steptrace_tokens_total", "steptrace_tokens_per_second", "steptrace_tflops_per_second", "steptrace_mfu",
    "steptrace_pipeline_bubble_ratio", "steptrace_checkpoints_total",
    "steptrace_gpu_violation_seconds_total", "steptrace_gpu_sm_clock_hertz", "steptrace_gpu_errors_total",
    "steptrace_dropped_records_total", "steptrace_info",
    "steptrace_step_collective_wait_seconds_total", "steptrace_step_own_seconds_total",
    "steptrace_step_exposed_communication_seconds_total",
    "steptrace_productive_seconds_total", "steptrace_wall_seconds_total", "steptrace_captures_total",
} | {h + suffix for h in RANK_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
# What the steptrace collector serves (issue "Collector and dashboards", collector/_metrics.py).
COLLECTOR_METRICS = {
    "steptrace_cluster_last_complete_step", "steptrace_cluster_incomplete_steps_total",
    "steptrace_cluster_join_lag_seconds_bucket",
    "steptrace_cluster_step_compute_seconds", "steptrace_cluster_step_interval_seconds",
    "steptrace_cluster_step_skew_seconds", "steptrace_cluster_straggler_rank",
    "steptrace_cluster_straggler_steps_total", "steptrace_cluster_ranks_reporting",
    "steptrace_cluster_pipeline_bubble_ratio", "steptrace_cluster_compute_share_ratio", "steptrace_cluster_last_step",
    "steptrace_collector_received_spans_total", "steptrace_collector_rejected_requests_total",
    "steptrace_collector_late_spans_total", "steptrace_cluster_step_own_seconds",
    "steptrace_cluster_step_straggler_cost_seconds", "steptrace_cluster_straggler_cost_seconds_total",
    "steptrace_cluster_straggler_score", "steptrace_cluster_step_straggler_threshold_seconds",
    "steptrace_cluster_persistent_straggler_steps_ratio", "steptrace_cluster_step_collective_wait_seconds",
    "steptrace_cluster_capture_requests_total",
}
PROMETHEUS_BUILTIN = {"up"}

# PromQL words that look like metric names: functions, aggregations, operators, keywords.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "group", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "rate", "irate", "increase", "delta", "idelta", "changes", "resets", "deriv", "predict_linear",
    "histogram_quantile", "vector", "scalar", "time", "timestamp", "abs", "clamp", "clamp_min", "clamp_max",
    "label_replace", "label_join", "absent", "absent_over_time", "avg_over_time", "max_over_time",
    "min_over_time", "sum_over_time", "count_over_time", "last_over_time", "round", "sort", "sort_desc",
}


def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included, rows excluded."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def all_queries() -> list[tuple[str, str, str]]:
    return [(name, title, expr) for name in FILES for title, expr in queries(load(name))]


def substitute(expr: str, rank: str = ".*") -> str:
    """``expr`` as Grafana sends it: template variables replaced by concrete values.

    ``$__rate_interval`` is at least four scrape intervals in Grafana (1m at 15 s); 5m here keeps
    the synthetic run's increases in range however long the tests before take.
    """
    for variable, value in (("$__rate_interval", "5m"), ("$__interval", "15s"), ("$__range", "1h"),
                            ("$run_id", RUN_ID), ("$rank", rank)):
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (names only: strings, matchers, label lists gone)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\$?\w+", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    words = set(re.findall(r"(?<![\w.])[A-Za-z_:][\w:]*", text))
    return words - PROMQL_WORDS


def defined_metrics() -> set[str]:
    return RANK_METRICS | COLLECTOR_METRICS | PROMETHEUS_BUILTIN | set(recorded_names())


# -- generated and committed JSON ---------------------------------------------------------------------

def run_generator(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("grafana_foundation_sdk",
                        reason="the generator needs grafana-foundation-sdk: pip install 'steptrace[dashboards]'")
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=120)


def test_committed_json_is_byte_equal_to_a_fresh_generation(tmp_path):
    result = run_generator("--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(GENERATED)
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(GENERATED)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (DASHBOARDS / name).read_bytes(), (
            f"collector/dashboards/{name} differs from the generator's output: run "
            f"python collector/dashboards/generate.py and commit the result")


def test_check_flag_passes_on_the_committed_json_and_fails_on_a_stale_copy(tmp_path):
    assert run_generator("--check").returncode == 0
    assert run_generator("--out", str(tmp_path)).returncode == 0
    assert run_generator("--check", "--out", str(tmp_path)).returncode == 0
    stale = tmp_path / FILES[0]
    stale.write_text(stale.read_text().replace("Goodput", "Goodness", 1))
    result = run_generator("--check", "--out", str(tmp_path))
    assert result.returncode == 1 and FILES[0] in result.stderr, result.stderr
    stale.unlink()
    assert run_generator("--check", "--out", str(tmp_path)).returncode == 1


# -- what the dashboards contain ---------------------------------------------------------------------

EXPECTED_PANELS = {
    "steptrace-training.json": {
        "Last step", "Goodput (5m)", "Tokens/s (5m)", "TFLOP/s per device, mean", "MFU, mean",
        "Ranks reporting", "Stalled ranks", "Failed steps",
        "Step compute vs interval, all ranks (p50, p90)", "Step interval, slowest and fastest ranks (5m)",
        "Mean compute per step, per rank (5m)", "Mean interval per step, pinned ranks vs the run (5m)",
        "Goodput, waiting and idle time by reason (all ranks, 5m)", "Goodput per rank",
        "Tokens/s, all ranks (5m)", "Tokens/s per rank (last step)", "TFLOP/s per device", "MFU",
        "Checkpoint blocking time per save", "Checkpoint saves by status", "Blocked by checkpoints, per rank",
        "Pipeline bubble per stage", "Microbatch compute by stage and chunk, mean (5m)",
        "Microbatch compute by stage and chunk, p90 (5m)",
        "Dropped records", "Failed steps by rank", "Ranks by backend and version",
        "Profiler captures by rank, time range", "Profiler captures over time",
        "GPU throttled time by policy (5m)", "GPU SM clock, slowest and fastest ranks",
        "GPU errors by rank and kind (5m)", "Exposed communication per rank (5m)",
    },
    "steptrace-cluster.json": {
        "Last joined step", "Ranks in the last joined step", "Straggler rank", "Cross-rank skew",
        "Own compute share (joined steps)", "Late spans",
        "Step compute across ranks (min, median, max)", "Step interval across ranks (min, median, max)",
        "Cross-rank skew (max - min compute)", "Compute relative to the median rank (5m)",
        "The run's straggler", "Straggler rank over time", "Steps each rank was the straggler",
        "Top stragglers, time range", "Captures asked of the ranks, time range",
        "Time on its own across ranks (min, median, max)", "What the straggler cost the job per step",
        "Cost to the job by rank", "Straggler score per rank, relative", "Straggler score per rank, individual",
        "Pipeline bubble per stage (joined steps)", "Own compute share (collectors) and goodput (ranks)",
        "Waiting in collectives across ranks (min, median, max)",
        "Spans received per second, by collector", "Join lag (p50, p90)",
        "Incomplete steps and late spans per second", "Rejected requests by reason", "Scrape targets down",
    },
}


@pytest.mark.parametrize("name", FILES)
def test_dashboard_has_the_expected_panels(name):
    dashboard = load(name)
    titles = [p["title"] for p in panels(dashboard)]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    assert set(titles) == EXPECTED_PANELS[name]
    assert all(p.get("description") for p in panels(dashboard)), "every panel says what it shows"
    assert dashboard["uid"] == name.removesuffix(".json") and "steptrace" in dashboard["tags"]


@pytest.mark.parametrize("name", FILES)
def test_panels_have_unique_ids_and_do_not_overlap(name):
    dashboard = load(name)
    ids = [p["id"] for p in dashboard["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area


@pytest.mark.parametrize("name", FILES)
def test_variables_are_datasource_run_and_multi_rank(name):
    variables = {v["name"]: v for v in load(name)["templating"]["list"]}
    assert list(variables) == ["datasource", "run_id", "rank"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run = variables["run_id"]
    assert run["type"] == "query" and run["datasource"] == DATASOURCE
    assert re.fullmatch(r"label_values\(steptrace_\w+, run_id\)", run["query"]), run["query"]
    rank = variables["rank"]
    assert rank["type"] == "query" and rank["datasource"] == DATASOURCE
    assert rank["query"] == 'label_values(steptrace_steps_total{run_id="$run_id"}, rank)'
    # Pinned ranks: any rank can be picked, rank 0 by default, no "All" (issue 28: a 4,096-rank run).
    assert rank["multi"] and not rank.get("includeAll") and "allValue" not in rank
    assert rank["current"]["value"] == ["0"]


# -- top-k ranks by default, never "All" (issue 28) -----------------------------------------------------
#
# A query is *unbounded in ranks* when its result can hold one series per rank of the run: it reads a
# series that has a `rank` label without restricting rank to the pinned ones (`rank=~"$rank"`, a
# variable without "All"), and no operation on the way out bounds it: neither topk/bottomk nor an
# aggregation whose `by` drops rank. rank_extent() works that out on the query's syntax tree:
# BOUNDED (no rank, or k ranks), PINNED (the picked ranks), ALL (every rank of the run). A vector
# matched one-to-one with another keeps only the ranks both have; `or` keeps either side's; a
# group_left/group_right match keeps the "many" side's. tests/test_prometheus_scale.py checks the same
# on a real Prometheus holding 256 ranks, by counting the ranks in each query's answer.

BOUNDED, PINNED, ALL = 0, 1, 2
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "quantile", "count_values", "group"}
BINARY = re.compile(r"(==|!=|>=|<=|>|<|\+|-|\*|/|%|\^|\band\b|\bor\b|\bunless\b)")


def rank_labelled() -> set[str]:
    """Series names that carry a `rank` label: the ranks' own, the per-rank rules, the collector's per-rank."""
    rules = {n for n in recorded_names() if "rank" in n.split(":")[0].split("_")}
    return RANK_METRICS | rules | {"steptrace_cluster_straggler_steps_total", "steptrace_cluster_straggler_score",
                                   "steptrace_cluster_straggler_cost_seconds_total",
                                   "steptrace_cluster_persistent_straggler_steps_ratio"}


def _split_top(expr: str) -> list[str]:
    """``expr`` cut at its top-level binary operators (outside parentheses, braces, brackets, strings):
    [operand, operator(+modifiers), operand, ...]."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(expr):
        c = expr[i]
        if c == '"':
            i = expr.index('"', i + 1) + 1
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0:
            m = BINARY.match(expr, i)
            # a leading sign, or an exponent in a number, is not an operator
            if m and expr[start:i].strip() and not re.search(r"\d[eE]$", expr[start:i]):
                parts.append(expr[start:i])
                j = m.end()
                mod = re.match(r"\s*(bool\s*)?((on|ignoring)\s*\([^)]*\)\s*)?((group_left|group_right)"
                               r"\s*(\([^)]*\))?)?", expr[j:])
                parts.append(m.group(0) + " " + mod.group(0))
                start = i = j + mod.end()
                continue
        i += 1
    parts.append(expr[start:])
    return parts


def _call(expr: str) -> tuple[str, str, str] | None:
    """(name, by/without clause, arguments) when ``expr`` is ``name [clause] (args) [clause]``."""
    m = re.fullmatch(r"(\w+)\s*((?:by|without)\s*\([^)]*\))?\s*\((.*)\)\s*((?:by|without)\s*\([^)]*\))?",
                     expr, re.S)
    if not m:
        return None
    body, depth = m.group(3), 0
    for c in body:  # the parentheses must be the call's own: f(a) + g(b) is not a call
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return None
    return m.group(1), (m.group(2) or m.group(4) or ""), body


def _args(body: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, c in enumerate(body):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append(body[start:i])
            start = i + 1
    return out + [body[start:]]


def rank_extent(expr: str, labelled: set[str] | None = None, *, rank_all: bool = False) -> int:
    """BOUNDED, PINNED or ALL: how many ranks the result of the PromQL ``expr`` can hold. With
    ``rank_all`` (a rank variable that offers "All"), `rank=~"$rank"` can be every rank too."""
    labelled = rank_labelled() if labelled is None else labelled
    expr = expr.strip()
    if expr[:1] in "+-" and len(_split_top(expr)) == 1:
        return rank_extent(expr[1:], labelled, rank_all=rank_all)  # a unary sign
    parts = _split_top(expr)
    if len(parts) > 1:
        extent = rank_extent(parts[0], labelled, rank_all=rank_all)
        for op, operand in zip(parts[1::2], parts[2::2]):
            right = rank_extent(operand, labelled, rank_all=rank_all)
            if op.startswith("or"):
                extent = max(extent, right)
            elif op.startswith("unless") or "group_left" in op:
                pass
            elif "group_right" in op:
                extent = right
            elif re.fullmatch(r"[\d.eE+-]+", operand.strip()) or re.fullmatch(r"[\d.eE+-]+", parts[0].strip()):
                extent = max(extent, right)   # a number on one side: the vector's
            else:
                extent = min(extent, right)   # one-to-one: the ranks both sides have
        return extent
    if expr.startswith("(") and expr.endswith(")") and _call("f" + expr):
        return rank_extent(expr[1:-1], labelled, rank_all=rank_all)
    call = _call(expr)
    if call:
        name, clause, body = call
        args = _args(body)
        if name in ("topk", "bottomk"):
            return BOUNDED
        if name in AGGREGATIONS:
            inner = rank_extent(args[-1], labelled, rank_all=rank_all)
            keeps = re.search(r"\brank\b", clause) if clause.startswith("by") else (
                clause.startswith("without") and not re.search(r"\brank\b", clause))
            return inner if keeps else BOUNDED
        return max((rank_extent(a, labelled, rank_all=rank_all) for a in args), default=BOUNDED)
    m = re.fullmatch(r"([A-Za-z_:][\w:]*)?\s*(\{[^}]*\})?\s*(\[[^\]]*\])?", expr)
    if m and (m.group(1) or m.group(2)):
        if m.group(1) not in labelled:
            return BOUNDED
        return PINNED if 'rank=~"$rank"' in (m.group(2) or "") and not rank_all else ALL
    return BOUNDED  # a number, a string


def test_rank_extent():
    sel = 'x{run_id="$run_id"}'
    pinned = 'x{run_id="$run_id", rank=~"$rank"}'
    labelled = {"x"}
    cases = {
        sel: ALL, pinned: PINNED, "y{}": BOUNDED, "1": BOUNDED,
        f"topk(5, {sel})": BOUNDED, f"bottomk(5, sum by (rank) (rate({sel}[5m])))": BOUNDED,
        f"sum(rate({sel}[5m]))": BOUNDED, f"sum by (rank, sink) (increase({sel}[5m])) > 0": ALL,
        f"sum without (sink) ({sel})": ALL, f"sum without (rank) ({sel})": BOUNDED,
        f"avg by (stage) ({sel})": BOUNDED, f"max({sel}) - min({sel})": BOUNDED,
        f"({sel})": ALL, f"rate({sel}[5m]) / rate({pinned}[5m])": PINNED,
        f"{sel} or {pinned}": ALL, f"{pinned} / on (run_id) group_left sum({sel})": PINNED,
        f"sum by (rank) ({sel}) and on (rank) topk(3, {sel})": BOUNDED,
        f"clamp_min({sel}, 0)": ALL, f"-{sel}": ALL, f"{sel} * 1e-3": ALL,
    }
    assert {e: rank_extent(e, labelled) for e in cases} == cases
    assert rank_extent(pinned, labelled, rank_all=True) == ALL
    assert rank_extent(f"topk(5, {pinned})", labelled, rank_all=True) == BOUNDED


@pytest.mark.parametrize("name", FILES)
def test_no_variable_defaults_to_all_and_no_query_reads_every_rank_unbounded(name):
    """Per-rank panels show the top-k and bottom-k ranks and the pinned ones: a 4,096-rank run draws
    ~10 lines, not 4,096, and a range query does not hold ranks x points samples in its answer."""
    variables = load(name)["templating"]["list"]
    rank_all = any(v["name"] == "rank" and v.get("includeAll") for v in variables)
    unbounded = [(title, expr) for title, expr in queries(load(name)) if rank_extent(expr, rank_all=rank_all) == ALL]
    assert not unbounded, "queries with one series per rank of the run:\n" + "\n".join(map(str, unbounded))
    for variable in variables:
        current = variable.get("current", {})
        values = current.get("value") if isinstance(current.get("value"), list) else [current.get("value")]
        texts = current.get("text") if isinstance(current.get("text"), list) else [current.get("text")]
        assert "$__all" not in values and "All" not in texts, (variable["name"], current)
        if variable["name"] == "rank":
            assert not variable.get("includeAll"), "the rank variable offers All"
    # topk/bottomk take a small k.
    for title, expr in queries(load(name)):
        assert all(int(k) <= 10 for k in re.findall(r"\b(?:topk|bottomk)\s*\(\s*(\d+)", expr)), (title, expr)


@pytest.mark.parametrize("name", FILES)
def test_every_panel_and_query_reads_the_datasource_variable(name):
    for panel in panels(load(name)):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_the_dashboards_link_to_each_other_keeping_time_and_variables():
    for name in FILES:
        (link,) = load(name)["links"]
        assert link["type"] == "dashboards" and link["tags"] == ["steptrace"]
        assert link["includeVars"] and link["keepTime"]


def test_every_query_filters_by_run_except_scrape_health_and_rejected_requests():
    # `up` has no run_id; a rejected request may not say which run it was for.
    unfiltered = {"Scrape targets down", "Rejected requests by reason"}
    for name, title, expr in all_queries():
        assert ('run_id="$run_id"' in expr) != (title in unfiltered), (name, title, expr)


def test_every_metric_a_query_reads_is_defined_by_an_exporter_the_collector_or_a_rule():
    defined = defined_metrics()
    read = set()
    for name, title, expr in all_queries():
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= defined, f"{name} / {title}: undefined {names - defined} in {expr}"
        read |= names
    # The rules read only the exporters' metrics and earlier rules.
    for group in load_yaml(REPO / "collector" / "rules.yml")["groups"]:
        for rule in group["rules"]:
            assert metric_names(rule["expr"]) <= defined, rule["record"]
    # Every recording rule is used by some panel (or it would cost Prometheus for nothing),
    # apart from the bucket sums that only feed the percentile rules.
    unused = set(recorded_names()) - read
    assert all(":" in n and n.split(":")[0].endswith("_le") for n in unused), unused


def test_the_rank_metric_list_is_the_readmes():
    readme = (REPO / "docs" / "prometheus.md").read_text()
    for metric in RANK_METRICS:
        histogram = re.sub(r"_(bucket|sum|count)$", "", metric)
        name = histogram if histogram in RANK_HISTOGRAMS else metric
        assert f"| `{name}` |" in readme, metric


def test_the_collector_metric_list_is_what_the_collector_serves():
    """Catches a rename in collector/_metrics.py that the dashboards would not survive."""
    try:
        from steptrace.collector._metrics import ClusterMetrics
    except ImportError as exc:
        pytest.skip(f"the steptrace collector is not importable here: {exc}")
    served = set()
    for family in ClusterMetrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        served |= {family.name + suffix for suffix in suffixes}
    assert COLLECTOR_METRICS <= served, COLLECTOR_METRICS - served


def test_metric_names_extraction():
    expr = ('max by (stage) (steptrace_cluster_pipeline_bubble_ratio{run_id="r"} and on (instance) '
            '(steptrace_cluster_last_step{run_id="r"} == on (run_id) group_left max by (run_id) '
            '(steptrace_cluster_last_step{run_id="r"})))')
    assert metric_names(expr) == {"steptrace_cluster_pipeline_bubble_ratio", "steptrace_cluster_last_step"}
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(a_bucket{x=~"b|c"}[5m]))) > 0.5e-3') == {"a_bucket"}
    assert metric_names("run_id:steptrace_tokens:rate5m{}") == {"run_id:steptrace_tokens:rate5m"}


# -- provisioning --------------------------------------------------------------------------------------

def test_datasource_provisioning_defines_a_default_prometheus():
    config = load_yaml(PROVISIONING / "datasources.yaml")
    assert config["apiVersion"] == 1
    (datasource,) = config["datasources"]
    assert datasource["type"] == "prometheus" and datasource["access"] == "proxy"
    assert datasource["url"].startswith("http") and datasource["isDefault"] is True
    assert datasource["uid"]


def test_dashboard_provisioning_loads_the_json_folder():
    config = load_yaml(PROVISIONING / "dashboards.yaml")
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert provider["allowUiUpdates"] is False     # generated JSON: edit generate.py instead
    # The documented mount puts this folder at the provider's path.
    assert f"collector/dashboards:{provider['options']['path']}" in (PROVISIONING / "dashboards.yaml").read_text()


# -- every query through a real Prometheus -------------------------------------------------------------

@pytest.mark.parametrize("rank", [".*", "(0|1)", "1"], ids=["all", "multi", "one"])
def test_every_query_parses_and_evaluates_on_a_real_prometheus(live, rank):
    """Grafana sends `All` as the allValue `.*`, several ranks as a regex alternation."""
    for name, title, expr in all_queries():
        body = live.query(substitute(expr, rank))
        assert body["status"] == "success", f"{name} / {title}: {body.get('errorType')}: {body.get('error')}"


def test_every_query_returns_data_for_a_run(live):
    empty = [(name, title, expr) for name, title, expr in all_queries() if not live.vector(substitute(expr))]
    assert not empty, "queries without data: " + "; ".join(f"{n} / {t}: {e}" for n, t, e in empty)


def test_variable_queries_list_the_run_and_its_ranks(live):
    for name in FILES:
        for variable in load(name)["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable.get("query", ""))
            if not match:
                continue
            selector, label = substitute(match[1]), match[2]
            body = live.api(f"/api/v1/label/{label}/values", {"match[]": selector})
            assert body["status"] == "success", body
            assert body["data"] == {"run_id": [RUN_ID], "rank": ["0", "1"]}[label], (name, variable["name"])


def panel_query(name: str, title: str, ref: str = "A") -> str:
    (target,) = [t for p in panels(load(name)) if p["title"] == title for t in p["targets"] if t["refId"] == ref]
    return substitute(target["expr"])


def test_cluster_gauges_come_from_the_collector_that_joined_the_latest_step(live):
    """Two collectors split the steps: "now" is the newest complete step for the per-step
    statistics and the newest joined step (here incomplete, on the other collector) for the
    ranks reporting."""
    c = "steptrace-cluster.json"
    assert live.vector(panel_query(c, "Ranks in the last joined step"))[0][1] == 1
    assert live.vector(panel_query(c, "Straggler rank"))[0][1] == 1
    assert live.vector(panel_query(c, "Cross-rank skew"))[0][1] == pytest.approx(0.08)
    assert live.values(panel_query(c, "Step compute across ranks (min, median, max)"), "stat") == {
        "min": pytest.approx(0.08), "median": pytest.approx(0.12), "max": pytest.approx(0.16)}
    assert live.values(panel_query(c, "Pipeline bubble per stage (joined steps)"), "stage") == {
        "0": pytest.approx(0.1), "1": pytest.approx(0.2)}
    # Counters add up over collectors: each instance saw its own straggler.
    assert set(live.values(panel_query(c, "Top stragglers, time range"), "rank")) == {"0", "1"}
    # The skew from the ranks' own 5-minute means agrees with the collector's.
    assert live.vector(panel_query(c, "Cross-rank skew (max - min compute)", "B"))[0][1] == pytest.approx(0.08)


def test_training_panels_show_the_run_as_recorded(live):
    t = "steptrace-training.json"
    # Own compute (goodput), waiting in collectives and idle by reason fill the wall time.
    stacked = [live.vector(panel_query(t, "Goodput, waiting and idle time by reason (all ranks, 5m)", ref))
               for ref in "ABC"]
    assert [v for _, v in stacked[0]] == [pytest.approx(0.6)] and [v for _, v in stacked[1]] == [pytest.approx(0.2)]
    assert sum(v for part in stacked for _, v in part) == pytest.approx(1.0)
    assert live.vector(panel_query(t, "MFU, mean"))[0][1] == pytest.approx((100 + 200) / 2 / 400)
    assert live.vector(panel_query(t, "Ranks reporting"))[0][1] == 2
    assert live.vector(panel_query(t, "Stalled ranks"))[0][1] == 0
    blocking = live.vector(panel_query(t, "Checkpoint blocking time per save", "A"))
    assert blocking[0][1] == pytest.approx(1.0)        # the slowest rank blocks 1 s per save
    assert live.values(panel_query(t, "Ranks by backend and version"), "backend") == {"simulated": 2}


def test_capture_panels_count_the_ranks_traces_and_the_collectors_requests(live):
    """Each synthetic rank took a trace after steps 7 and 27 of its 41 (the slow trigger); every stand-in
    collector step issues two requests (culprit and reference) of which the culprit fetches one."""
    t = "steptrace-training.json"
    by_rank = {(m["rank"], m["trigger"], m["status"]): v
               for m, v in live.vector(panel_query(t, "Profiler captures by rank, time range"))}
    assert by_rank == {("0", "slow", "ok"): 2, ("1", "slow", "ok"): 2}
    # Over time: the configured triggers' series exist at 0 before their first capture.
    assert set(live.values(panel_query(t, "Profiler captures over time"), "trigger")) == {"slow", "request"}
    asked = live.values(panel_query("steptrace-cluster.json", "Captures asked of the ranks, time range"), "state")
    assert set(asked) == {"issued", "fetched"} and asked["issued"] == 2 * asked["fetched"] > 0


def test_scrape_health_panel_shows_a_down_target(live):
    down = live.values(panel_query("steptrace-cluster.json", "Scrape targets down"), "job")
    assert down == {"steptrace": 0, "steptrace-collector": 0, "otelcol": 1}


STRAGGLER_PANELS = ("Steps each rank was the straggler", "Top stragglers, time range", "Cost to the job by rank")


def test_straggler_panels_count_a_rank_named_for_the_first_time(tmp_path):
    """The collector creates a rank's straggler counters when it first names the rank, at their first
    value; plain increase() reads nothing for such a series. promtool evaluates each panel's query:
    rank 2 is born at 9m with 1 and gains 1 a minute, rank 5 is born at 11m at 3 and stays."""
    import shutil

    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    found = {title: expr for title, expr in queries(load("steptrace-cluster.json")) if title in STRAGGLER_PANELS}
    assert set(found) == set(STRAGGLER_PANELS)
    labels = f'run_id="{RUN_ID}"'
    series = []
    for counter in ("steptrace_cluster_straggler_steps_total", "steptrace_cluster_straggler_cost_seconds_total"):
        series += [{"series": f'{counter}{{instance="c0:9464", {labels}, rank="2"}}', "values": "_x9 1+1x20"},
                   {"series": f'{counter}{{instance="c0:9464", {labels}, rank="5"}}', "values": "_x11 3x20"}]
    # At 13m over 5m: rank 2 has 5 (1 at birth + 4), rank 5 its 3; over 1h (the $__range) the same.
    expected = [{"labels": '{rank="2"}', "value": 5}, {"labels": '{rank="5"}', "value": 3}]
    tests = [{"expr": substitute(expr), "eval_time": "13m", "exp_samples": expected} for expr in found.values()]
    (tmp_path / "empty.yml").write_text("groups: []\n")
    (tmp_path / "panels_test.yml").write_text(yaml.safe_dump({
        "rule_files": ["empty.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}))
    result = subprocess.run([promtool, "test", "rules", "panels_test.yml"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
