"""``steptrace-clickhouse{,-typed}.json``: a run across ranks from ClickHouse, past one steptrace collector.

Built by collector/dashboards/generate.py (this module only builds the dashboards), twice: over
``otel_traces`` as the exporter writes it, and over the typed table of ``steptrace clickhouse views
--typed`` (:class:`Source`). Panels reading the same rows share one query (Grafana's
"-- Dashboard --" data source): 6 queries a refresh. Every query is
SQL for the official Grafana ClickHouse plugin (``grafana-clickhouse-datasource``, v4) over the
OpenTelemetry Collector ClickHouse exporter's ``otel_traces`` table (collector/otelcol-clickhouse.yaml
writes it). The per-step cross-rank join is not written here: each panel wraps the SQL of
:mod:`steptrace.analysis.clickhouse` (``cluster_steps_sql``: min/median/max, skew, the straggler
and its cost, bubble, goodput, missing ranks; ``step_ranks_sql``: one row per rank and step), the
same SQL ``steptrace report --clickhouse`` runs, restricted to the dashboard's run and time range.

Query model of the plugin (grafana/clickhouse-datasource at 1d04063a, src/types/sql.ts
``CHSqlQuery``; ``format`` per src/data/utils.ts ``mapQueryTypeToGrafanaFormat``: 0 time series,
1 table). The plugin's backend expands the macros (pkg/macros/macros.go) after Grafana has
substituted the variables; tests/test_dashboards_clickhouse.py expands them the same way and runs
every panel's query in chDB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import bargauge, common as common_b, dashboard as dash_b
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder, variants as cogvariants
from grafana_foundation_sdk.models import common, dashboard as dash_m

from steptrace._schema import ATTR_RUN_ID
from steptrace.analysis import clickhouse as ch

__all__ = ["OTEL_TRACES", "PLUGIN", "PLUGIN_VERSION", "SETTLE_SECONDS", "SOURCES", "TOP_K_DEFAULT", "TYPED",
           "Source", "clickhouse"]

#: The Grafana plugin id of the official ClickHouse data source.
PLUGIN = "grafana-clickhouse-datasource"
#: Stored with every query: the plugin migrates queries without a v4 ``pluginVersion`` as v3 ones.
PLUGIN_VERSION = "4.20.0"
DATASOURCE = dash_m.DataSourceRef(type_val=PLUGIN, uid="${datasource}")
TAG = "steptrace"

#: A step is shown once it ended this long before the end of the time range: a newer one may
#: still have ranks in flight (the rank's export, otelcol's batch, ClickHouse's async insert), and
#: would show as missing ranks that are only late.
SETTLE_SECONDS = 15
#: Rank tables show the k worst ranks (variable ``topk``), never every rank.
TOP_K_CHOICES = (5, 10, 20, 50)
TOP_K_DEFAULT = 10

SETTLED = f"end_time <= toUnixTimestamp($__toTime) - {SETTLE_SECONDS}"


@dataclass(frozen=True)
class Source:
    """Where the dashboard reads the ranks' ``train.step`` spans, and how it keeps to the run and time range.

    The condition sits inside the per-step SQL, so that ClickHouse reads only the run's spans of the
    time range. ``singlequote`` quotes the run id and escapes a quote in it with a backslash; a
    steptrace run id holds no backslash (steptrace/_ids.py).
    """

    file: str
    uid: str
    title: str
    typed_table: str | None   # None: the exporter's otel_traces, its attribute maps parsed per query
    where: str                # on the rows of otel_traces, or of the typed table
    runs: str                 # the run variable's query

    def steps_sql(self) -> str:
        """The run's per-step cross-rank rows in the time range (``cluster_steps_sql``), settled."""
        inner = ch.cluster_steps_sql(None, ch.DEFAULT_TABLE, None, typed_table=self.typed_table, where=self.where)
        return f"SELECT *, toDateTime64(end_time, 3) AS time FROM (\n{inner}\n) WHERE {SETTLED}"

    def ranks_sql(self) -> str:
        """The run's rows per (step, rank) in the time range (``step_ranks_sql``), settled."""
        inner = ch.step_ranks_sql(None, ch.DEFAULT_TABLE, None, typed_table=self.typed_table, where=self.where)
        return f"SELECT * FROM (\n{inner}\n) WHERE {SETTLED}"

    def from_steps(self, select: str, tail: str = "") -> str:
        return f"{select}\nFROM (\n{self.steps_sql()}\n)" + (f"\n{tail}" if tail else "")

    def from_ranks(self, select: str, tail: str = "") -> str:
        return f"{select}\nFROM (\n{self.ranks_sql()}\n)" + (f"\n{tail}" if tail else "")


#: The exporter's table as it is: nothing to set up, every query parses the spans' attribute maps.
OTEL_TRACES = Source(
    "steptrace-clickhouse.json", "steptrace-clickhouse", "steptrace: cluster (ClickHouse)", None,
    f"SpanAttributes['{ATTR_RUN_ID}'] = ${{run_id:singlequote}} AND $__timeFilter(Timestamp)",
    f"SELECT DISTINCT SpanAttributes['{ATTR_RUN_ID}'] AS run_id FROM {ch.DEFAULT_TABLE} "
    "WHERE SpanName = 'train.step' AND $__timeFilter(Timestamp) ORDER BY run_id")
# The typed table has no Timestamp: a span starts at s_end - s_interval (a step span covers its interval).
_TYPED_RANGE = ("s_end - s_interval >= toUnixTimestamp($__fromTime) "
                "AND s_end - s_interval <= toUnixTimestamp($__toTime)")
#: ``steptrace clickhouse views --typed``'s table, filled by a materialized view as spans arrive:
#: numbers, ordered by run and step; the queries skip the map parsing (thousands of ranks).
TYPED = Source(
    "steptrace-clickhouse-typed.json", "steptrace-clickhouse-typed", "steptrace: cluster (ClickHouse, typed)",
    ch.TYPED_TABLE, f"run_id = ${{run_id:singlequote}} AND {_TYPED_RANGE}",
    f"SELECT DISTINCT run_id FROM {ch.TYPED_TABLE} WHERE {_TYPED_RANGE} ORDER BY run_id")
SOURCES = (OTEL_TRACES, TYPED)


# -- the plugin's query model ------------------------------------------------------------------------

class ClickHouseQuery(cogvariants.Dataquery):
    """A raw-SQL query of the ClickHouse plugin (``CHSqlQuery``), as saved in a dashboard."""

    def __init__(self, raw_sql: str, ref_id: str, fmt: int):
        self.raw_sql, self.ref_id, self.fmt = raw_sql, ref_id, fmt

    def to_json(self) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "editorType": "sql",
            "format": self.fmt,
            "pluginVersion": PLUGIN_VERSION,
            "queryType": {0: "timeseries", 1: "table"}[self.fmt],
            "rawSql": self.raw_sql,
            "refId": self.ref_id,
        }


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    """grafana-foundation-sdk has no ClickHouse builder (11.6 build): this one plugs into ``with_target``."""

    TIME_SERIES, TABLE = 0, 1

    def __init__(self, raw_sql: str, ref_id: str = "A", fmt: int = TIME_SERIES):
        self._query = ClickHouseQuery(raw_sql, ref_id, fmt)

    def build(self) -> ClickHouseQuery:
        return self._query


def sql(raw_sql: str, ref: str = "A", *, fmt: int = ClickHouseQueryBuilder.TIME_SERIES) -> ClickHouseQueryBuilder:
    return ClickHouseQueryBuilder(raw_sql, ref, fmt)


#: Grafana's "-- Dashboard --" data source: a panel shows another panel's query result
#: (public/app/plugins/datasource/dashboard/types.ts: SHARED_DASHBOARD_QUERY, DashboardQuery.panelId).
SHARED = dash_m.DataSourceRef(type_val="datasource", uid="-- Dashboard --")


class SharedQuery(cogvariants.Dataquery):
    """Another panel's result: the per-step join is costly, so panels reading the same rows share one query."""

    def __init__(self, source: cogbuilder.Builder[dash_m.Panel]):
        self.source = source

    def to_json(self) -> dict[str, Any]:
        # The source's id is read when the JSON is written, after generate.py numbered the panels.
        return {"datasource": SHARED, "panelId": self.source.build().id_val, "refId": "A", "withTransforms": False}


class SharedQueryBuilder(cogbuilder.Builder[SharedQuery]):
    def __init__(self, source: cogbuilder.Builder[dash_m.Panel]):
        self._query = SharedQuery(source)

    def build(self) -> SharedQuery:
        return self._query


Query = ClickHouseQueryBuilder | SharedQueryBuilder


def _datasource(query: Query) -> dash_m.DataSourceRef:
    return SHARED if isinstance(query, SharedQueryBuilder) else DATASOURCE


def _fields(panel: Any, fields: dict[str, str] | None, time: str | None = "t") -> Any:
    """Show only ``fields`` (query column -> name shown) of a query with more columns."""
    if not fields:
        return panel
    names = ([time] if time else []) + list(fields)
    panel = panel.with_transformation(dash_m.DataTransformerConfig(
        id_val="filterFieldsByName", options={"include": {"names": names}}))
    renames = {column: shown for column, shown in fields.items() if column != shown}
    if renames:
        panel = panel.with_transformation(dash_m.DataTransformerConfig(
            id_val="organize", options={"renameByName": renames, "excludeByName": {}, "indexByName": {}}))
    return panel


# -- panels ------------------------------------------------------------------------------------------

def series(title: str, description: str, query: Query, fields: dict[str, str] | None = None, *, unit: str = "s",
           w: int = 12, h: int = 8, points: bool = False, min_val: float | None = 0,
           max_val: float | None = None, decimals: float | None = None) -> timeseries.Panel:
    """A time series panel: ``query``'s time column and ``fields`` (all columns when None)."""
    p = (timeseries.Panel().title(title).description(description).datasource(_datasource(query))
         .unit(unit).span(w).height(h).line_width(1).fill_opacity(10).span_nulls(False)
         .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                  .sort(common.SortOrder.DESCENDING))
         .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                 .placement(common.LegendPlacement.BOTTOM).show_legend(True)))
    if points:
        p = p.draw_style(common.GraphDrawStyle.POINTS).point_size(6)
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if decimals is not None:
        p = p.decimals(decimals)
    return _fields(p.with_target(query), fields)


def single(title: str, description: str, query: Query, field: str, *, unit: str = "none", w: int = 4,
           h: int = 4, decimals: float | None = None, thresholds: list[tuple[float | None, str]] | None = None,
           no_value: str | None = None) -> stat.Panel:
    """A stat panel showing column ``field`` of a one-row table query."""
    steps = [dash_m.Threshold(value=v, color=c) for v, c in (thresholds or [(None, "blue")])]
    p = (stat.Panel().title(title).description(description).datasource(_datasource(query)).unit(unit)
         .span(w).height(h).graph_mode(common.BigValueGraphMode.NONE)
         .color_mode(common.BigValueColorMode.VALUE if thresholds else common.BigValueColorMode.NONE)
         .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
                         .fields(f"/^{field}$/"))
         .thresholds(dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE).steps(steps)))
    if decimals is not None:
        p = p.decimals(decimals)
    if no_value is not None:
        p = p.no_value(no_value)
    return p.with_target(query)


def rank_table(title: str, description: str, raw_sql: str, *, w: int = 12, h: int = 8) -> table.Panel:
    return (table.Panel().title(title).description(description).datasource(DATASOURCE).span(w).height(h)
            .with_target(sql(raw_sql, fmt=ClickHouseQueryBuilder.TABLE)))


GOODPUT_THRESHOLDS: list[tuple[float | None, str]] = [(None, "red"), (0.7, "orange"), (0.9, "green")]


def last(column: str) -> str:
    """``column`` of the latest settled step. argMax skips a NULL value (it would show an older
    step's straggler when the last step has none): a tuple is never NULL."""
    return f"argMax(tuple({column}), step).1"


def overview_sql(src: Source) -> str:
    """One row: the overview's stat panels each show one column."""
    return src.from_steps(
        f"SELECT max(step) AS last_step, {last('ranks_reporting')} AS ranks, {last('missing_rank_count')} AS missing, "
        f"{last('straggler_rank')} AS straggler, {last('skew_seconds')} AS skew, "
        "sum(compute_sum_seconds) / sum(interval_sum_seconds) AS goodput")


def buckets_sql(src: Source) -> str:
    """One row per time bucket ($__timeInterval): every per-step time series panel shows some columns.
    Per bucket, the min of the steps' min, the median of their medians, the max of their max."""
    return src.from_steps(
        "SELECT $__timeInterval(time) AS t,\n"
        + ",\n".join(f"min({c}_min_seconds) AS {c}_min, quantile(0.5)({c}_median_seconds) AS {c}_median, "
                     f"max({c}_max_seconds) AS {c}_max" for c in ("interval", "compute", "own"))
        + ",\navg(skew_seconds) AS skew_mean, max(skew_seconds) AS skew_worst,\n"
        "argMaxIf(tuple(straggler_rank), straggler_excess_seconds, straggler_rank IS NOT NULL).1 AS straggler,\n"
        "avg(coalesce(straggler_cost_seconds, 0)) AS cost_mean, "
        "max(coalesce(straggler_cost_seconds, 0)) AS cost_worst,\n"
        "sum(compute_sum_seconds) / sum(interval_sum_seconds) AS goodput,\n"
        "count() / $__interval_s AS steps_per_second,\n"
        "max(world_size) AS world, min(ranks_reporting) AS reporting, max(missing_rank_count) AS missing",
        "GROUP BY t ORDER BY t")


def variables(src: Source) -> list[Any]:
    """Data source (ClickHouse), run (from otel_traces in the time range), k for the rank tables.

    No rank variable: at thousands of ranks a panel per rank (or an "All ranks" default) is what
    the Prometheus dashboards had to give up; the rank tables list the k worst instead.
    """
    runs = src.runs
    k = [dash_m.VariableOption(selected=v == TOP_K_DEFAULT, text=str(v), value=str(v)) for v in TOP_K_CHOICES]
    return [
        dash_b.DatasourceVariable("datasource").label("Data source").type(PLUGIN),
        dash_b.QueryVariable("run_id").label("Run").datasource(DATASOURCE)
        .query({"refId": "run_id", "queryType": "sql", "rawSql": runs})
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC),
        dash_b.CustomVariable("topk").label("Ranks listed").values(",".join(str(v) for v in TOP_K_CHOICES))
        .current(dash_m.VariableOption(selected=True, text=str(TOP_K_DEFAULT), value=str(TOP_K_DEFAULT)))
        .options(k),
    ]


def clickhouse(src: Source = OTEL_TRACES) -> dash_b.Dashboard:
    # Every refresh joins the time range's spans afresh (no per-step table is kept): a 15-minute
    # default reads 900 rows per rank at one step a second, per query, once a minute.
    d = (dash_b.Dashboard(src.title).uid(src.uid)
         .description("A run across ranks from ClickHouse (otel_traces, written by the OpenTelemetry "
                      "Collector's clickhouse exporter): steptrace's per-step cross-rank join in SQL "
                      "(steptrace/analysis/clickhouse.py), for jobs past one steptrace collector. "
                      + ("Reads otel_traces as the exporter writes it: nothing to set up." if src.typed_table is None
                         else f"Reads {src.typed_table}, which `steptrace clickhouse views --typed` creates "
                              "and a materialized view fills: the queries skip parsing the attribute maps."))
         .tags([TAG]).time("now-15m", "now").refresh("1m").timezone("browser")
         .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
         .link(dash_b.DashboardLink("steptrace").type(dash_m.DashboardLinkType.DASHBOARDS).tags([TAG])
               .as_dropdown(False).include_vars(True).keep_time(True)))
    for v in variables(src):
        d = d.with_variable(v)

    d = d.with_row(dash_b.Row("Overview"))
    overview = single("Last step", f"Highest step joined across ranks (steps that ended at least {SETTLE_SECONDS} s "
                      "before the end of the time range).", sql(overview_sql(src), fmt=ClickHouseQueryBuilder.TABLE),
                      "last_step", decimals=0)
    shared = SharedQueryBuilder(overview)
    for panel in [
        overview,
        single("Ranks in the last step", "Ranks whose train.step span of the last step is in ClickHouse.",
               shared, "ranks", decimals=0),
        single("Missing ranks, last step", "World size minus the ranks that reported the last step "
               "(0 when every rank did).", shared, "missing", decimals=0, thresholds=[(None, "green"), (1, "red")]),
        single("Straggler rank, last step", "The rank that slowed the last step (most time on its own, "
               "standing out from the others' median); none when no rank did.", shared, "straggler",
               decimals=0, no_value="none"),
        single("Cross-rank skew, last step", "Max - min compute over the ranks in the last step.", shared, "skew",
               unit="s"),
        single("Goodput (time range)", "Sum of compute over sum of interval, every rank and step in the "
               "time range.", shared, "goodput", unit="percentunit", thresholds=GOODPUT_THRESHOLDS),
    ]:
        d = d.with_panel(panel)

    spread = {"min": "min", "median": "median", "max": "max"}
    d = d.with_row(dash_b.Row("Across ranks"))
    buckets = series(
        "Step interval across ranks (min, median, max)", "Per step, the fastest, median and slowest rank's "
        "interval; per time bucket the min of the steps' min, the median of their medians, the max of their max.",
        sql(buckets_sql(src)), {f"interval_{k}": v for k, v in spread.items()})
    shared = SharedQueryBuilder(buckets)
    d = d.with_panel(buckets)
    d = d.with_panel(series(
        "Step compute across ranks (min, median, max)", "Per step, the fastest, median and slowest rank's "
        "compute (per time bucket as the interval's).", shared, {f"compute_{k}": v for k, v in spread.items()}))
    d = d.with_panel(series(
        "Cross-rank skew (max - min compute)", "Per step, max - min compute over ranks; per time bucket "
        "the mean and the worst step.", shared, {"skew_mean": "mean", "skew_worst": "worst"}))
    d = d.with_panel(series(
        "Time on its own across ranks (min, median, max)", "Per step, each rank's interval minus its wait "
        "in collectives (its compute where the wait is not measured): the straggler is the max rank "
        "when it stands out.", shared, {f"own_{k}": v for k, v in spread.items()}))

    d = d.with_row(dash_b.Row("Stragglers"))
    d = d.with_panel(series(
        "Straggler rank per step", "The rank named the straggler (per time bucket, the one that stood "
        "out most); no point where no rank did. A rank that keeps coming back is a straggler.",
        shared, {"straggler": "straggler"}, unit="none", decimals=0, points=True, w=8))
    d = d.with_panel(series(
        "What the straggler cost per step", "The other ranks' median wait in collectives less the "
        "straggler's own wait (0 when no rank stood out or the ranks do not measure their wait): "
        "per time bucket, the mean over steps and the worst step.",
        shared, {"cost_mean": "mean", "cost_worst": "worst"}, w=8))
    d = d.with_panel(
        bargauge.Panel().title("Top stragglers (time range)")
        .description("The $topk ranks that cost the job most as the straggler over the time range "
                     "(seconds the others waited for them), with how many steps each was named.")
        .datasource(DATASOURCE).span(8).height(8).unit("s")
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_b.ReduceDataOptions().values(True).calcs([]).fields("/^cost$/"))
        .with_target(sql(src.from_steps(
            "SELECT toString(straggler_rank) AS rank, sum(coalesce(straggler_cost_seconds, 0)) AS cost, "
            "count() AS steps", "WHERE straggler_rank IS NOT NULL GROUP BY straggler_rank "
            "ORDER BY cost DESC, steps DESC, straggler_rank LIMIT $topk"), fmt=ClickHouseQueryBuilder.TABLE)))
    d = d.with_panel(rank_table(
        "Slowest ranks (time range)", "The $topk ranks with the most time on their own per step "
        "(mean over the time range's steps), with their mean interval and compute: never every rank.",
        src.from_ranks("SELECT rank, avg(own_seconds) AS own_seconds, avg(interval_seconds) AS interval_seconds, "
                   "avg(compute_seconds) AS compute_seconds, count() AS steps",
                   "GROUP BY rank ORDER BY own_seconds DESC, rank LIMIT $topk"), w=24))

    d = d.with_row(dash_b.Row("Pipeline, goodput and missing ranks"))
    d = d.with_panel(series(
        "Pipeline bubble per stage", "1 - microbatch compute / pipeline window, per stage (mean over the "
        "stage's ranks and the bucket's steps).",
        sql(src.from_steps("SELECT $__timeInterval(time) AS t, stage, avg(ratio) AS bubble",
                       "ARRAY JOIN mapKeys(pipeline_bubble_ratio) AS stage, mapValues(pipeline_bubble_ratio) AS ratio "
                       "GROUP BY t, stage ORDER BY t, stage")),
        unit="percentunit", max_val=1, w=8))
    d = d.with_panel(series(
        "Goodput per step", "Sum of compute over sum of interval across ranks (per time bucket, over its "
        "steps).", shared, {"goodput": "goodput"}, unit="percentunit", max_val=1, w=8))
    d = d.with_panel(series(
        "Step rate", "Steps joined per second of wall time.", shared, {"steps_per_second": "steps/s"},
        unit="short", w=8))
    d = d.with_panel(series(
        "Ranks reporting and missing per step", "Per time bucket: the world size, the fewest ranks that "
        "reported a step, and the most ranks missing from one (late, dead or not started).",
        shared, {"world": "world size", "reporting": "reporting", "missing": "missing"},
        unit="none", decimals=0, w=12))
    d = d.with_panel(rank_table(
        "Steps with missing ranks (latest)", "The latest $topk steps in which ranks are missing, and "
        f"which (the lowest {ch.MAX_MISSING_LISTED}): a rank that never reports shows in every one.",
        src.from_steps("SELECT step, world_size, ranks_reporting, missing_rank_count, missing_ranks",
                   "WHERE missing_rank_count > 0 ORDER BY step DESC LIMIT $topk"), w=12))
    return d
