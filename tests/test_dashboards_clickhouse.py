"""The ClickHouse dashboard (collector/dashboards/steptrace-clickhouse.json): every panel's SQL runs in chDB.

Spans come from the real SDK (``OtlpSink`` exporting step records over OTLP/HTTP to an in-test
receiver), become ``otel_traces`` rows as the contrib exporter writes them
(:func:`steptrace.analysis.clickhouse.rows_from_otlp`) and are inserted into the exporter's table
in chDB. Each panel's ``rawSql`` then goes through what Grafana and the ClickHouse plugin do to it
before ClickHouse sees it:

1. Grafana's frontend substitutes the template variables (``$topk``, ``${run_id:singlequote}``:
   the value in single quotes, a quote in it escaped with a backslash; grafana/scenes
   ``formatRegistry`` ``VariableFormatID.SingleQuote``);
2. the plugin's backend expands its macros, exactly as grafana/clickhouse-datasource
   ``pkg/macros/macros.go`` at commit 1d04063a31fb30f9582cd0b3aeaacb7d350b0dcf (plugin 4.20.0) does:
   ``$__timeFilter(c)`` → ``c >= toDateTime(FROM) AND c <= toDateTime(TO)``, ``$__fromTime`` /
   ``$__toTime`` → ``toDateTime(unix seconds)``, ``$__timeInterval(c)`` →
   ``toStartOfInterval(toDateTime(c), INTERVAL N second)`` and ``$__interval_s`` → ``N`` with
   N = max(whole seconds of the panel interval, 1). Any other macro fails the test.

The run is small and known: 4 ranks, 10 steps of 1 s in lockstep; rank 2 computes 0.9 s and
waits 0.05 s in collectives, the others compute 0.5 s and wait 0.45 s (rank 2 is the straggler,
costing the others 0.45 - 0.05 = 0.4 s per step); rank 3 never reports step 7; stage 0 (ranks
0, 1) has a 10 % bubble, stage 1 (ranks 2, 3) 30 %. A second run with other values shares the
table: no panel may mix it in.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("chdb", reason="the dashboard's SQL runs in chDB: pip install 'steptrace[clickhouse]'")
pytest.importorskip("opentelemetry.proto", reason="the SDK exports the spans: pip install 'steptrace[otlp]'")
yaml = pytest.importorskip("yaml", reason="reading the provisioning needs PyYAML (installed with steptrace[test])")

from otlp_receiver import OtlpHttpReceiver  # noqa: E402
from steptrace.analysis import clickhouse as ch  # noqa: E402
from steptrace.otlp import OtlpSink  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "collector" / "dashboards"
# Two builds of one dashboard: over otel_traces as the exporter writes it, and over the typed table
# that `steptrace clickhouse views --typed` keeps (the same panels; only the rows read differ).
NAMES = ("steptrace-clickhouse.json", "steptrace-clickhouse-typed.json")
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = {"type": PLUGIN, "uid": "${datasource}"}
SHARED = {"type": "datasource", "uid": "-- Dashboard --"}   # Grafana's "use another panel's result"
DATABASE = "steptrace_grafana"      # chDB is one engine per process: a database of our own

RUN = "it's-a-run"                  # a quote: ${run_id:singlequote} must keep the SQL valid
OTHER_RUN = "other"
WORLD = 4
STEPS = 10
SLOW, ABSENT, ABSENT_STEP = 2, 3, 7
T0 = 1_780_000_000                  # step n ends at T0 + n + 0.5 (a multiple of 5: buckets of 5 steps)
FROM_S, TO_S = T0 - 600, T0 + 3600  # the dashboard's time range in the tests


# -- the data: the real SDK's spans in the exporter's table ------------------------------------------

def step_record(run: str, rank: int, n: int, *, slow: float = 0.9) -> dict:
    compute, wait = (slow, 0.05) if rank == SLOW else (0.5, 0.45)
    end = T0 + n + 0.5
    return {
        "type": "step", "run_id": run, "rank": rank, "world_size": WORLD, "step": n, "status": "ok",
        "backend": "simulated", "start_time": end - compute, "end_time": end, "interval_seconds": 1.0,
        "compute_seconds": compute, "idle_seconds": 1.0 - compute, "collective_wait_seconds": wait,
        "pipeline_bubble_ratio": {str(rank // 2): 0.1 if rank < 2 else 0.3},
    }


def sdk_rows() -> list[dict]:
    """otel_traces rows of both runs, from the spans OtlpSink sent (one sink per rank, as ranks do)."""
    with OtlpHttpReceiver() as receiver:
        for run, slow in ((RUN, 0.9), (OTHER_RUN, 0.6)):
            for rank in range(WORLD):
                sink = OtlpSink(receiver.url, run_id=run, rank=rank, world_size=WORLD)
                try:
                    sink.export([step_record(run, rank, n, slow=slow) for n in range(STEPS)
                                 if not (run == RUN and rank == ABSENT and n == ABSENT_STEP)])
                finally:
                    sink.shutdown(5)
        requests = receiver.trace_requests()
    return [row for request in requests for row in ch.rows_from_otlp(request)]


@pytest.fixture(scope="module")
def client():
    c = ch.connect(f"chdb://?database={DATABASE}")
    c.command(ch.otel_traces_ddl(DATABASE))
    c.command(f"TRUNCATE TABLE {DATABASE}.{ch.DEFAULT_TABLE}")
    # The typed table and its materialized view, before the spans arrive (as documented).
    c.command(f"DROP TABLE IF EXISTS {DATABASE}.{ch.TYPED_TABLE}_mv")
    c.command(f"DROP TABLE IF EXISTS {DATABASE}.{ch.TYPED_TABLE}")
    for statement in ch.typed_table_sql(DATABASE):
        c.command(statement)
    rows = sdk_rows()
    assert {r["SpanName"] for r in rows} >= {"train.step", "train.compute"}
    ch.insert_rows(c, rows, database=DATABASE)
    return c


# -- what Grafana and the plugin do to a panel's SQL ---------------------------------------------------

# Grafana's variable syntax (public/app/features/variables/utils.ts variableRegex): $name,
# [[name:format]], ${name:format}.
VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")


def substitute(raw_sql: str, variables: dict[str, str]) -> str:
    """Grafana's frontend: known variables replaced (raw, or single-quoted), the rest (macros) kept."""
    def replace(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(6)
        if name not in variables:
            return m.group(0)
        value = variables[name]
        if fmt is None:
            return value
        assert fmt == "singlequote", f"unexpected variable format {fmt}"
        return "'" + value.replace("'", "\\'") + "'"
    return VARIABLE.sub(replace, raw_sql)


def _call_args(sql: str, open_at: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the call whose '(' is at ``open_at``, and the index after ')'."""
    depth, args, start = 0, [], open_at + 1
    for i in range(open_at, len(sql)):
        if sql[i] == "(":
            depth += 1
        elif sql[i] == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:i].strip())
                return args, i + 1
        elif sql[i] == "," and depth == 1:
            args.append(sql[start:i].strip())
            start = i + 1
    raise AssertionError(f"unbalanced macro call in {sql[open_at:open_at + 80]}")


def expand_macros(sql: str, *, start: int = FROM_S, end: int = TO_S, interval_s: float = 5.0) -> str:
    """The plugin backend's macro expansion (pkg/macros/macros.go at 1d04063a), for the macros used."""
    seconds = int(max(interval_s, 1))
    with_args = {
        "timeFilter": lambda c: f"{c} >= toDateTime({start}) AND {c} <= toDateTime({end})",
        "timeInterval": lambda c: f"toStartOfInterval(toDateTime({c}), INTERVAL {seconds} second)",
    }
    bare = {"fromTime": f"toDateTime({start})", "toTime": f"toDateTime({end})", "interval_s": str(seconds)}
    out, i = [], 0
    for m in re.finditer(r"\$__(\w+)", sql):
        if m.start() < i:
            continue
        out.append(sql[i:m.start()])
        name = m.group(1)
        if name in with_args:
            assert sql[m.end():m.end() + 1] == "(", f"$__{name} needs an argument"
            args, i = _call_args(sql, m.end())
            assert len(args) == 1, (name, args)
            # An argument may hold a macro ($__timeInterval($__fromTime)): expanded too.
            out.append(with_args[name](expand_macros(args[0], start=start, end=end, interval_s=interval_s)))
        else:
            assert name in bare, f"$__{name} is not a macro this test knows the plugin's expansion of"
            out.append(bare[name])
            i = m.end()
    out.append(sql[i:])
    return "".join(out)


def as_sent(raw_sql: str, *, run: str = RUN, topk: int = 10, **time) -> str:
    sql = expand_macros(substitute(raw_sql, {"run_id": run, "topk": str(topk)}), **time)
    assert "$" not in sql, f"unexpanded: {sql}"
    return sql


def test_macro_expansion_matches_the_plugins_go_code():
    """The plugin's own tests (pkg/plugin/driver_test.go) expect these strings."""
    assert expand_macros("SELECT $__timeInterval($__fromTime) AS from_time", start=1415792726, end=1447328726,
                         interval_s=60) == ("SELECT toStartOfInterval(toDateTime(toDateTime(1415792726)), "
                                            "INTERVAL 60 second) AS from_time")
    assert expand_macros("WHERE $__timeFilter(ts)", start=1, end=2) == \
        "WHERE ts >= toDateTime(1) AND ts <= toDateTime(2)"
    assert expand_macros("$__interval_s", interval_s=0.2) == "1"
    with pytest.raises(AssertionError):
        expand_macros("$__unknownMacro")
    assert substitute("a = ${run_id:singlequote} LIMIT $topk $__toTime", {"run_id": "x'y", "topk": "5"}) == \
        "a = 'x\\'y' LIMIT 5 $__toTime"


# -- the dashboard -------------------------------------------------------------------------------------

def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


@pytest.fixture(params=NAMES)
def dashboard(request) -> dict:
    return load(request.param)


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every ClickHouse query (not the panels showing another's result)."""
    return [(p["title"], t) for p in panels(dashboard) for t in p["targets"] if t["datasource"] != SHARED]


def panel(dashboard: dict, title: str) -> dict:
    (found,) = [p for p in panels(dashboard) if p["title"] == title]
    return found


def panel_sql(dashboard: dict, title: str) -> str:
    (target,) = panel(dashboard, title)["targets"]
    return target["rawSql"]


def source_of(p: dict, dashboard: dict) -> dict:
    """The panel whose query ``p`` shows: itself, or the one its "-- Dashboard --" query names."""
    (target,) = p["targets"]
    if target["datasource"] != SHARED:
        return p
    assert not target["withTransforms"], p["title"]
    (source,) = [s for s in panels(dashboard) if s["id"] == target["panelId"]]
    assert source["targets"][0]["datasource"] == DATASOURCE, f"{p['title']} shows a panel without a query"
    return source


def displayed(rows: list[dict], p: dict) -> list[dict]:
    """``rows`` as panel ``p`` shows them: its transformations (filterFieldsByName, organize) and,
    for a stat panel, the one field its reduceOptions.fields names."""
    for transformation in p.get("transformations") or []:
        options = transformation["options"]
        if transformation["id"] == "filterFieldsByName":
            names = options["include"]["names"]
            for row in rows:
                assert set(names) <= set(row), f"{p['title']}: {set(names) - set(row)} not in its query's columns"
            rows = [{k: row[k] for k in names} for row in rows]
        else:
            assert transformation["id"] == "organize", transformation["id"]
            rows = [{options["renameByName"].get(k, k): v for k, v in row.items()} for row in rows]
    fields = (p.get("options") or {}).get("reduceOptions", {}).get("fields")
    if p["type"] == "stat":
        match = re.fullmatch(r"/\^(\w+)\$/", fields)
        assert match, fields
        assert all(match[1] in row for row in rows), f"{p['title']}: no column {match[1]}"
        rows = [{match[1]: row[match[1]]} for row in rows]
    return rows


EXPECTED_PANELS = {
    "Last step", "Ranks in the last step", "Missing ranks, last step", "Straggler rank, last step",
    "Cross-rank skew, last step", "Goodput (time range)",
    "Step interval across ranks (min, median, max)", "Step compute across ranks (min, median, max)",
    "Cross-rank skew (max - min compute)", "Time on its own across ranks (min, median, max)",
    "Straggler rank per step", "What the straggler cost per step", "Top stragglers (time range)",
    "Slowest ranks (time range)", "Pipeline bubble per stage", "Goodput per step", "Step rate",
    "Ranks reporting and missing per step", "Steps with missing ranks (latest)",
}


def test_the_dashboard_has_the_expected_panels_each_described(dashboard):
    titles = [p["title"] for p in panels(dashboard)]
    assert len(titles) == len(set(titles)) and set(titles) == EXPECTED_PANELS
    assert all(p.get("description") for p in panels(dashboard))
    assert f"{dashboard['uid']}.json" in NAMES and "steptrace" in dashboard["tags"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area


def test_every_query_is_a_raw_sql_query_of_the_clickhouse_plugin_or_another_panels_result(dashboard):
    queries = 0
    for panel in panels(dashboard):
        (target,) = panel["targets"]
        assert panel["datasource"] == target["datasource"], panel["title"]
        if target["datasource"] == SHARED:
            # The per-step join is costly: panels reading the same rows show one panel's result.
            source = source_of(panel, dashboard)
            assert source["title"] in ("Last step", "Step interval across ranks (min, median, max)"), panel["title"]
            continue
        queries += 1
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["editorType"] == "sql", panel["title"]
            # A query without a v4 pluginVersion is migrated as a v3 one (src/data/migration.ts).
            assert target["pluginVersion"].startswith("4."), panel["title"]
            # format as the plugin maps its query types (src/data/utils.ts): 0 time series, 1 table.
            assert (target["format"], target["queryType"]) in ((0, "timeseries"), (1, "table")), panel["title"]
            assert (target["format"] == 0) == (panel["type"] == "timeseries"), panel["title"]
            assert ("otel_traces" in target["rawSql"]) != (ch.TYPED_TABLE in target["rawSql"]), panel["title"]
    assert queries == 6, "each query joins the run's steps: add one only where no panel's result will do"


def test_variables_are_a_clickhouse_datasource_a_run_and_k_never_all_ranks(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "run_id", "topk"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == PLUGIN
    run = variables["run_id"]
    assert run["type"] == "query" and run["datasource"] == DATASOURCE
    assert run["query"]["queryType"] == "sql"
    assert not run.get("includeAll") and not run.get("multi")
    topk = variables["topk"]
    assert topk["type"] == "custom" and topk["current"]["value"] == "10" and not topk.get("includeAll")
    assert "rank" not in variables


def test_rank_tables_list_the_top_k_ranks_not_every_rank(dashboard):
    for title in ("Top stragglers (time range)", "Slowest ranks (time range)", "Steps with missing ranks (latest)"):
        assert panel_sql(dashboard, title).rstrip().endswith("LIMIT $topk"), title


def test_panels_wrap_the_analysis_modules_per_step_sql_not_a_copy(dashboard):
    """The straggler, skew and missing-rank logic lives in steptrace/analysis/clickhouse.py only."""
    typed = ch.TYPED_TABLE if "typed" in dashboard["uid"] else None
    # The SQL up to where the rows are read (the where= condition follows).
    per_step = ch.cluster_steps_sql(None, ch.DEFAULT_TABLE, None, where="X", typed_table=typed).split("FROM (SELECT")[0]
    per_rank = ch.step_ranks_sql(None, ch.DEFAULT_TABLE, None, where="X", typed_table=typed).split("FROM (SELECT")[0]
    assert targets(dashboard)
    for title, target in targets(dashboard):
        assert per_step in target["rawSql"] or per_rank in target["rawSql"], title
    assert ch.MAX_MISSING_LISTED == __import__("steptrace.collector._join", fromlist=["x"]).MAX_MISSING_LISTED


# -- every query, run ----------------------------------------------------------------------------------

def run(client, dashboard: dict, title: str, **kw) -> list[dict]:
    """What panel ``title`` shows: its query (or the panel's whose result it shows), run, then transformed."""
    p = panel(dashboard, title)
    return displayed(client.query(as_sent(source_of(p, dashboard)["targets"][0]["rawSql"], **kw)), p)


def test_every_panel_and_variable_query_runs_in_chdb_and_returns_rows(client, dashboard):
    for p in panels(dashboard):
        assert run(client, dashboard, p["title"]), f"{p['title']}: shows nothing"
    for title, target in targets(dashboard):
        rows = client.query(as_sent(target["rawSql"]))
        assert rows, f"{title}: no rows"
        if target["format"] == 0:
            # A time series query: the time column first, ascending (the plugin pivots long to wide).
            columns = client.query(f"DESCRIBE ({as_sent(target['rawSql'])})")
            assert columns[0]["type"].startswith("DateTime"), (title, columns[0])
            times = [r[columns[0]["name"]] for r in rows]
            assert times == sorted(times), title
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run_id"]
    runs = client.query(as_sent(variable["query"]["rawSql"]))
    assert [r["run_id"] for r in runs] == sorted([RUN, OTHER_RUN])


def test_overview_shows_the_last_step_its_straggler_and_the_runs_goodput(client, dashboard):
    assert run(client, dashboard, "Last step") == [{"last_step": STEPS - 1}]
    assert run(client, dashboard, "Ranks in the last step") == [{"ranks": WORLD}]
    assert run(client, dashboard, "Missing ranks, last step") == [{"missing": 0}]
    assert run(client, dashboard, "Straggler rank, last step") == [{"straggler": SLOW}]
    (skew,) = run(client, dashboard, "Cross-rank skew, last step")
    assert skew["skew"] == pytest.approx(0.4)
    (goodput,) = run(client, dashboard, "Goodput (time range)")
    compute = (STEPS * (3 * 0.5 + 0.9) - 0.5) / (STEPS * WORLD - 1)   # rank 3's step 7 is missing
    assert goodput["goodput"] == pytest.approx(compute / 1.0)


def test_the_overview_of_a_last_step_with_a_missing_rank_names_no_straggler(client, dashboard):
    """A range ending at T0 + 23 shows steps that ended by T0 + 8: the last one is step 7, without rank 3."""
    end = T0 + 23
    assert run(client, dashboard, "Last step", end=end) == [{"last_step": ABSENT_STEP}]
    assert run(client, dashboard, "Ranks in the last step", end=end) == [{"ranks": WORLD - 1}]
    assert run(client, dashboard, "Missing ranks, last step", end=end) == [{"missing": 1}]
    # Not step 6's straggler: the last step named none.
    assert run(client, dashboard, "Straggler rank, last step", end=end) == [{"straggler": None}]


def test_the_straggler_panels_name_the_slowed_rank_and_its_cost(client, dashboard):
    points = run(client, dashboard, "Straggler rank per step")
    assert points and {p["straggler"] for p in points} == {SLOW}
    for row in run(client, dashboard, "What the straggler cost per step"):
        assert row["worst"] == pytest.approx(0.4)
    (top,) = run(client, dashboard, "Top stragglers (time range)")
    # Named on every complete step (step 7 lacks rank 3: no straggler is named on it).
    assert top == {"rank": str(SLOW), "cost": pytest.approx(0.4 * (STEPS - 1)), "steps": STEPS - 1}
    slowest = run(client, dashboard, "Slowest ranks (time range)", topk=2)
    assert [r["rank"] for r in slowest] == [SLOW, 0]
    assert slowest[0]["own_seconds"] == pytest.approx(0.95) and slowest[1]["own_seconds"] == pytest.approx(0.55)


def test_the_spread_panels_show_min_median_max_and_skew(client, dashboard):
    for row in run(client, dashboard, "Step compute across ranks (min, median, max)"):
        assert (row["min"], row["median"], row["max"]) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.9))
    for row in run(client, dashboard, "Step interval across ranks (min, median, max)"):
        assert (row["min"], row["max"]) == (pytest.approx(1.0), pytest.approx(1.0))
    for row in run(client, dashboard, "Cross-rank skew (max - min compute)"):
        assert row["worst"] == pytest.approx(0.4)
    for row in run(client, dashboard, "Time on its own across ranks (min, median, max)"):
        assert (row["min"], row["max"]) == (pytest.approx(0.55), pytest.approx(0.95))


def test_bubble_goodput_and_step_rate_per_bucket(client, dashboard):
    bubble = {(r["t"], r["stage"]): r["bubble"] for r in run(client, dashboard, "Pipeline bubble per stage")}
    assert {stage for _, stage in bubble} == {"0", "1"}
    assert all(v == pytest.approx(0.1 if stage == "0" else 0.3) for (_, stage), v in bubble.items())
    # Steps end at T0 + n + 0.5: two 5 s buckets of 5 steps each, one step a second.
    rate = run(client, dashboard, "Step rate", interval_s=5)
    assert [r["steps/s"] for r in rate] == [pytest.approx(1.0)] * 2
    goodput = run(client, dashboard, "Goodput per step", interval_s=5)
    assert goodput[0]["goodput"] == pytest.approx((3 * 0.5 + 0.9) / 4)


def test_a_rank_that_never_reports_a_step_shows_as_missing(client, dashboard):
    per_bucket = run(client, dashboard, "Ranks reporting and missing per step", interval_s=5)
    assert [(r["world size"], r["reporting"], r["missing"]) for r in per_bucket] == [(WORLD, WORLD, 0),
                                                                                      (WORLD, WORLD - 1, 1)]
    assert run(client, dashboard, "Steps with missing ranks (latest)") == [
        {"step": ABSENT_STEP, "world_size": WORLD, "ranks_reporting": WORLD - 1, "missing_rank_count": 1,
         "missing_ranks": [ABSENT]}]


def test_panels_read_only_the_chosen_run_and_time_range(client, dashboard):
    # The other run has no missing rank: its rank 2 is named on all 10 steps.
    (other,) = run(client, dashboard, "Top stragglers (time range)", run=OTHER_RUN)
    assert other["steps"] == STEPS
    # A range starting at T0 + 5 holds the spans of steps 6-9 (a step's span starts 1 s before it
    # ends): rank 2 is named on 6, 8 and 9 (step 7, without rank 3, names nobody).
    assert run(client, dashboard, "Top stragglers (time range)", start=T0 + 5)[0]["steps"] == 3
    assert run(client, dashboard, "Steps with missing ranks (latest)", start=T0 + 8) == []
    # A range ending at T0 + 20 shows only steps that ended 15 s before: steps 0-4.
    assert run(client, dashboard, "Last step", end=T0 + 20) == [{"last_step": 4}]
    # An unknown run: no rows, no error.
    assert run(client, dashboard, "Top stragglers (time range)", run="nobody") == []


# -- provisioning -------------------------------------------------------------------------------------

def test_datasource_provisioning_names_the_plugin_and_the_exporters_database():
    config = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources-clickhouse.yaml").read_text())
    assert config["apiVersion"] == 1
    (datasource,) = config["datasources"]
    assert datasource["type"] == PLUGIN and datasource["uid"]
    data = datasource["jsonData"]
    assert data["protocol"] in ("native", "http") and data["host"] and data["port"]
    otelcol = yaml.safe_load((REPO / "collector" / "otelcol-clickhouse.yaml").read_text())
    # The SQL names otel_traces without a database: the data source's default database is the exporter's.
    assert data["defaultDatabase"] == otelcol["exporters"]["clickhouse"]["database"]
    assert otelcol["exporters"]["clickhouse"]["traces_table_name"] == ch.DEFAULT_TABLE


def test_the_generator_writes_these_dashboards(tmp_path):
    pytest.importorskip("grafana_foundation_sdk", reason="pip install 'steptrace[dashboards]'")
    result = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in NAMES:
        assert (tmp_path / name).read_bytes() == (DASHBOARDS / name).read_bytes(), name
