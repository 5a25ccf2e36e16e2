"""Generate steptrace's Grafana dashboards with grafana-foundation-sdk (the Grafana 11.6 build).

    python collector/dashboards/generate.py            # rewrite the JSON files next to this script
    python collector/dashboards/generate.py --check    # exit 1 when a committed file differs
    python collector/dashboards/generate.py --out DIR  # write (or --check) DIR instead

Four dashboards, linked to each other (keeping the time range and the variables):

- ``steptrace-training.json``: a run as the ranks see it (their own /metrics): step compute vs
  interval, goodput and the idle breakdown, throughput, checkpoints, pipeline microbatches,
  dropped records.
- ``steptrace-cluster.json``: a run across ranks, from the steptrace collectors (skew, the
  straggler rank, bubble per stage) next to the same signals computed from the ranks' metrics,
  and the collectors' own health.
- ``steptrace-clickhouse.json``, ``steptrace-clickhouse-typed.json``: a run across ranks from
  ClickHouse (the OpenTelemetry Collector's ``otel_traces``, or the typed table of
  ``steptrace clickhouse views --typed``), for jobs past one steptrace collector: built by
  ``clickhouse.py`` beside this script, SQL for the ClickHouse data source.

In the first two every query is PromQL against the Prometheus data source chosen by ``$datasource``. The
heavier ones (percentiles and means over all ranks) read the recording rules of
``collector/rules.yml``, which must be loaded. Edit this script, never the JSON: the test
suite regenerates the JSON and fails when it differs from the committed files.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

try:
    from grafana_foundation_sdk.builders import bargauge, common as common_b, dashboard as dash_b
    from grafana_foundation_sdk.builders import prometheus as prom_b, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common, dashboard as dash_m, prometheus as prom_m
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise SystemExit(
        "collector/dashboards/generate.py needs grafana-foundation-sdk (the Grafana 11.6 build): "
        "pip install 'steptrace[dashboards]'") from _exc

# collector/dashboards/clickhouse.py, beside this script; it wraps steptrace.analysis.clickhouse's
# SQL, found in this checkout when steptrace is not installed.
sys.path.append(str(Path(__file__).resolve().parents[2]))
import clickhouse  # noqa: E402

__all__ = ["DASHBOARDS", "build_all", "render", "main"]

HERE = Path(__file__).resolve().parent

#: Every panel and query reads the data source picked by the ``datasource`` variable.
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Tag shared by the dashboards; their links list every dashboard with it.
TAG = "steptrace"

RUN = 'run_id="$run_id"'
#: The ranks picked in the ``rank`` variable ("Pinned ranks"; rank 0 by default, never "All").
RANKS = 'run_id="$run_id", rank=~"$rank"'
#: Ranks a per-rank panel shows by default: the ``TOP_K`` highest and the ``TOP_K`` lowest. A panel
#: plotting every rank would draw thousands of lines at scale and read ranks x points samples
#: (docs/scale.md); the pinned ranks are added to these.
TOP_K = 5


def ranked(expr: Any, high: str = "highest", low: str = "lowest") -> list[tuple[str, str]]:
    """A per-rank panel's queries: ``expr(selector)`` for the top-k and bottom-k ranks of the run,
    and for the pinned ranks. ``expr`` returns one series per rank for a label selector."""
    return [(f"topk({TOP_K}, {expr(RUN)})", f"{high}: rank {{{{rank}}}}"),
            (f"bottomk({TOP_K}, {expr(RUN)})", f"{low}: rank {{{{rank}}}}"),
            (expr(RANKS), "pinned: rank {{rank}}")]

# The steptrace collector's gauges describe the last step *that instance* joined. Behind the
# load balancer every collector joins a different subset of steps, so "now" is the collector
# whose last step is the highest; counters (straggler steps, spans) are summed instead. The
# per-step statistics (compute, interval, skew, straggler, bubble) describe the last *complete*
# step (steptrace_cluster_last_complete_step); ranks_reporting the last step joined at all.
COMPLETE = "steptrace_cluster_last_complete_step"
JOINED = "steptrace_cluster_last_step"


STRAGGLER_STEPS = "steptrace_cluster_straggler_steps_total"
STRAGGLER_COST = "steptrace_cluster_straggler_cost_seconds_total"
#: Deep capture (docs/capture.md): the ranks' profiler traces, and what the collectors asked of them.
CAPTURES = "steptrace_captures_total"
CAPTURE_REQUESTS = "steptrace_cluster_capture_requests_total"


def born_increase(counter: str, window: str) -> str:
    """``increase(counter[window])`` that also counts a series born inside the window.

    The collector creates a rank's straggler counters when the rank is first named, at their
    first value, which ``increase()`` never sees; a series with no sample ``window`` ago counts
    its whole value instead (the form of collector/alerts.yml and docs/alerts.md).
    """
    sel = f"{counter}{{{RUN}}}"
    return (f"(increase({sel}[{window}]) and {sel} offset {window}) "
            f"or ({sel} unless {sel} offset {window})")


def latest(metric: str, by: str = "", marker: str = COMPLETE) -> str:
    """``metric`` from the collector whose ``marker`` step is the run's highest (one series per ``by``)."""
    newest = (f"{marker}{{{RUN}}} == on (run_id) group_left max by (run_id) ({marker}{{{RUN}}})")
    aggregate = f"max by ({by}) " if by else "max"
    return f"{aggregate}({metric}{{{RUN}}} and on (instance) ({newest}))"


def query(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False,
          fmt: prom_m.PromQueryFormat | None = None, exemplar: bool = False) -> prom_b.Dataquery:
    q = prom_b.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE).legend_format(legend or "__auto")
    if instant:
        q = q.instant()
    else:
        q = q.range()
    if fmt is not None:
        q = q.format(fmt)
    if exemplar:
        q = q.exemplar(True)
    return q


def _targets(panel: Any, queries: list[tuple[str, str]]) -> Any:
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(query(expr, legend, ref=chr(ord("A") + i)))
    return panel


def series(title: str, description: str, queries: list[tuple[str, str]], *, unit: str = "s",
           w: int = 12, h: int = 8, stacked: bool = False, bars: bool = False, points: bool = False,
           table_legend: bool = False, min_val: float | None = 0, max_val: float | None = None,
           decimals: float | None = None, axis_label: str | None = None,
           dashed: str | None = None) -> timeseries.Panel:
    """A time series panel; ``queries`` are (PromQL, legend) pairs."""
    p = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
         .unit(unit).span(w).height(h).line_width(1).fill_opacity(10)
         .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                  .sort(common.SortOrder.DESCENDING)))
    if table_legend:
        # Per-rank panels: a sortable table of mean / max / last finds the outlier rank.
        p = p.legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                     .placement(common.LegendPlacement.RIGHT).show_legend(True)
                     .calcs(["mean", "max", "lastNotNull"]).sort_by("Mean").sort_desc(True))
    else:
        p = p.legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
    if stacked:
        p = p.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(70)
    if bars:
        p = p.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    if points:
        p = p.draw_style(common.GraphDrawStyle.POINTS).point_size(6)
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if decimals is not None:
        p = p.decimals(decimals)
    if axis_label is not None:
        p = p.axis_label(axis_label)
    if dashed is not None:
        p = p.override_by_regexp(dashed, [dash_m.DynamicConfigValue(
            id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})])
    return _targets(p, queries)


def single(title: str, description: str, expr: str, *, unit: str = "none", w: int = 3, h: int = 4,
           decimals: float | None = None, thresholds: list[tuple[float | None, str]] | None = None,
           legend: str = "") -> stat.Panel:
    """A stat panel showing the latest value of ``expr``."""
    steps = [dash_m.Threshold(value=v, color=c) for v, c in (thresholds or [(None, "blue")])]
    p = (stat.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
         .span(w).height(h)
         .graph_mode(common.BigValueGraphMode.AREA)
         .color_mode(common.BigValueColorMode.VALUE if thresholds else common.BigValueColorMode.NONE)
         .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .thresholds(dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE).steps(steps)))
    if decimals is not None:
        p = p.decimals(decimals)
    return p.with_target(query(expr, legend))


GOODPUT_THRESHOLDS: list[tuple[float | None, str]] = [(None, "red"), (0.7, "orange"), (0.9, "green")]


# -- variables and links ---------------------------------------------------------------------------

def variables(run_metric: str) -> list[Any]:
    """Data source, run (from ``run_metric``'s run_id values) and the pinned ranks (multi, rank 0 by
    default, no "All": per-rank panels show the top-k and bottom-k ranks and these)."""
    refresh = dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED
    return [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        dash_b.QueryVariable("run_id").label("Run").datasource(DATASOURCE)
        .query(f"label_values({run_metric}, run_id)").refresh(refresh)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC),
        dash_b.QueryVariable("rank").label("Pinned ranks").datasource(DATASOURCE)
        .query(f'label_values(steptrace_steps_total{{{RUN}}}, rank)').refresh(refresh)
        .sort(dash_m.VariableSort.NUMERICAL_ASC).multi(True).include_all(False)
        .current(dash_m.VariableOption(selected=True, text=["0"], value=["0"])),
    ]


def base(title: str, uid: str, description: str, run_metric: str) -> dash_b.Dashboard:
    d = (dash_b.Dashboard(title).uid(uid).description(description).tags([TAG])
         .time("now-1h", "now").refresh("30s").timezone("browser")
         .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
         .link(dash_b.DashboardLink("steptrace").type(dash_m.DashboardLinkType.DASHBOARDS).tags([TAG])
               .as_dropdown(False).include_vars(True).keep_time(True)))
    for v in variables(run_metric):
        d = d.with_variable(v)
    return d


# -- steptrace-training.json -----------------------------------------------------------------------

def training() -> dash_b.Dashboard:
    d = base("steptrace: training run", "steptrace-training",
             "One training run as its ranks report it (per-rank /metrics and collector/rules.yml). "
             "Compute is the device busy with a step; interval is device end to device end, the "
             "wall time a step costs; idle = interval - compute, by the host activity covering it.",
             "steptrace_steps_total")

    d = d.with_row(dash_b.Row("Overview"))
    for panel in [
        single("Last step", "Highest finalized step number over the ranks.",
               f"max(steptrace_last_step{{{RUN}}})", decimals=0),
        single("Goodput (5m)", "Goodput (docs/goodput.md): own compute of the steps (waiting for other "
               "ranks in collectives excluded) / wall time from each process start, all ranks, last 5 "
               "minutes. The same definition as steptrace report's goodput.",
               f"run_id:steptrace_goodput:ratio_rate5m{{{RUN}}}", unit="percentunit",
               thresholds=GOODPUT_THRESHOLDS),
        single("Tokens/s (5m)", "Tokens per second of wall time, summed over ranks.",
               f"run_id:steptrace_tokens:rate5m{{{RUN}}}", unit="short"),
        single("TFLOP/s per device, mean", "Mean over the ranks of the last step's TFLOP/s per "
               "device (over compute time).", f"avg(steptrace_tflops_per_second{{{RUN}}})",
               unit="none", decimals=1),
        single("MFU, mean", "Mean over the ranks of the last step's model FLOPs utilization "
               "(needs a peak: peak_tflops or steptrace's table for the device kind).",
               f"avg(steptrace_mfu{{{RUN}}})", unit="percentunit"),
        single("Ranks reporting", "Ranks whose /metrics Prometheus has (a dead rank's series go "
               "stale after 5 minutes).", f"count(steptrace_last_step{{{RUN}}})", decimals=0),
        single("Stalled ranks", "Ranks whose last step has not changed in 5 minutes.",
               f"count(changes(steptrace_last_step{{{RUN}}}[5m]) == 0) or vector(0)", decimals=0,
               thresholds=[(None, "green"), (1, "red")]),
        single("Failed steps", "Steps that raised inside `with step(n)`, all ranks, time range.",
               f'sum(increase(steptrace_steps_total{{{RUN}, status="error"}}[$__range]))', decimals=0,
               thresholds=[(None, "green"), (1, "red")]),
    ]:
        d = d.with_panel(panel)

    d = d.with_row(dash_b.Row("Step time"))
    d = d.with_panel(series(
        "Step compute vs interval, all ranks (p50, p90)",
        "Median and 90th percentile across ranks of each rank's mean step in the last 5 minutes "
        "(recording rules over _sum/_count). The gap between interval and compute is idle device time.",
        [(f"run_id:steptrace_step_compute_seconds:p50_rate5m{{{RUN}}}", "compute p50"),
         (f"run_id:steptrace_step_compute_seconds:p90_rate5m{{{RUN}}}", "compute p90"),
         (f"run_id:steptrace_step_interval_seconds:p50_rate5m{{{RUN}}}", "interval p50"),
         (f"run_id:steptrace_step_interval_seconds:p90_rate5m{{{RUN}}}", "interval p90")],
        dashed="/p90$/"))
    d = d.with_panel(series(
        "Step interval, slowest and fastest ranks (5m)",
        "Mean interval per step of the 5 slowest and the 5 fastest ranks, and the pinned ranks "
        "(exact: sum / count). "
        "Ranks serve no buckets by default (a big job's Prometheus would hold ranks x buckets series); "
        "with prometheus_histograms=True, steptrace_step_interval_seconds_bucket has them, with each "
        "step's trace id as exemplar.",
        ranked(lambda sel: f"run_id_rank:steptrace_step_interval_seconds:mean_rate5m{{{sel}}}", "slow", "fast"),
        dashed="/^fast/"))
    d = d.with_panel(series(
        "Mean compute per step, per rank (5m)",
        "Exact mean (sum / count) of each rank's compute time: the 5 slowest, the 5 fastest and the "
        "pinned ranks. A rank above the rest is slow on the device itself.",
        ranked(lambda sel: f"run_id_rank:steptrace_step_compute_seconds:mean_rate5m{{{sel}}}", "slow", "fast"),
        table_legend=True))
    d = d.with_panel(series(
        "Mean interval per step, pinned ranks vs the run (5m)",
        "Exact mean of each pinned rank's step interval (the Pinned ranks variable), against the "
        "median and 90th percentile across the run's ranks. Ranks in lockstep share one interval: a "
        "rank whose compute is low but interval is not is waiting for the others.",
        [(f"run_id_rank:steptrace_step_interval_seconds:mean_rate5m{{{RANKS}}}", "rank {{rank}}"),
         (f"run_id:steptrace_step_interval_seconds:p50_rate5m{{{RUN}}}", "run p50"),
         (f"run_id:steptrace_step_interval_seconds:p90_rate5m{{{RUN}}}", "run p90")],
        table_legend=True, dashed="/^run/"))

    d = d.with_row(dash_b.Row("Where the wall time goes"))
    d = d.with_panel(series(
        "Goodput, waiting and idle time by reason (all ranks, 5m)",
        "Fractions of wall time, stacked: own compute (goodput), time waiting for other ranks in "
        "collectives (exposed communication, where the ranks measure it) and the idle time of each "
        "reason (data, checkpoint, compile, eval, your span names, other) add up to 100% in steady "
        "training.",
        [(f"run_id:steptrace_goodput:ratio_rate5m{{{RUN}}}", "own compute (goodput)"),
         (f"run_id:steptrace_step_collective_wait:ratio_rate5m{{{RUN}}}", "waiting in collectives"),
         (f"run_id_reason:steptrace_step_idle:ratio_rate5m{{{RUN}}}", "idle: {{reason}}")],
        unit="percentunit", stacked=True, max_val=1, w=16))
    d = d.with_panel(series(
        "Goodput per rank",
        "Each rank's goodput since its process start (own compute / wall; a rank waiting for "
        "others in collectives is not productive meanwhile): the 5 highest, the 5 lowest and the "
        "pinned ranks.",
        ranked(lambda sel: f"(steptrace_productive_seconds_total{{{sel}}} / steptrace_wall_seconds_total{{{sel}}})"),
        unit="percentunit", max_val=1, w=8, table_legend=True))

    d = d.with_row(dash_b.Row("Throughput"))
    d = d.with_panel(series(
        "Tokens/s, all ranks (5m)", "Tokens per second of wall time, summed over ranks (each "
        "rank counts its own share).",
        [(f"run_id:steptrace_tokens:rate5m{{{RUN}}}", "tokens/s")], unit="short", w=6,
        axis_label="tokens/s"))
    d = d.with_panel(series(
        "Tokens/s per rank (last step)", "Each rank's tokens over its last step's interval (5 highest, "
        "5 lowest, pinned ranks).",
        ranked(lambda sel: f"steptrace_tokens_per_second{{{sel}}}"), unit="short", w=6,
        axis_label="tokens/s"))
    d = d.with_panel(series(
        "TFLOP/s per device", "Last step's FLOPs over its compute time (device time, not wall "
        "time), per rank: 5 highest, 5 lowest, pinned ranks.",
        ranked(lambda sel: f"steptrace_tflops_per_second{{{sel}}}"), unit="none", w=6,
        axis_label="TFLOP/s"))
    d = d.with_panel(series(
        "MFU", "Last step's model FLOPs / compute / the device's peak (peak_tflops or steptrace's table), per "
        "rank: 5 highest, 5 lowest, pinned ranks.",
        ranked(lambda sel: f"steptrace_mfu{{{sel}}}"), unit="percentunit", w=6))

    d = d.with_row(dash_b.Row("Checkpoints"))
    blocking = "steptrace_checkpoint_blocking_seconds"
    d = d.with_panel(series(
        "Checkpoint blocking time per save",
        "Training time each save blocked: the host time after the saved step's device work "
        "ended. Gaps are windows without a save. Asynchronous commits run in the background and "
        "block nothing.",
        [(f"max(increase({blocking}_sum{{{RUN}}}[$__rate_interval]) / "
          f"increase({blocking}_count{{{RUN}}}[$__rate_interval]))", "blocking, slowest rank"),
         (f"sum(increase({blocking}_sum{{{RUN}}}[$__rate_interval])) / "
          f"sum(increase({blocking}_count{{{RUN}}}[$__rate_interval]))", "blocking, mean over ranks"),
         (f"sum(increase(steptrace_checkpoint_async_seconds_sum{{{RUN}}}[$__rate_interval])) / "
          f"sum(increase(steptrace_checkpoint_async_seconds_count{{{RUN}}}[$__rate_interval]))",
          "async commit, mean (not blocking)")],
        w=12, points=True))
    d = d.with_panel(series(
        "Checkpoint saves by status", "Saves finalized (each rank's save counts once).",
        [(f"sum by (status) (increase(steptrace_checkpoints_total{{{RUN}}}[$__rate_interval]))",
          "{{status}}")], unit="short", w=6, bars=True, decimals=0))
    d = d.with_panel(single(
        "Blocked by checkpoints, per rank", "Training time blocked by saves over the time range, "
        "mean over the ranks.",
        f"sum(increase({blocking}_sum{{{RUN}}}[$__range])) / count({blocking}_count{{{RUN}}})",
        unit="s", w=6, h=8))

    d = d.with_row(dash_b.Row("Pipeline"))
    d = d.with_panel(series(
        "Pipeline bubble per stage",
        "1 - microbatch compute / pipeline window (step start to the stage's last microbatch end) "
        "in the last step with microbatches, mean over the ranks of each stage.",
        [(f"avg by (stage) (steptrace_pipeline_bubble_ratio{{{RUN}}})", "stage {{stage}}")],
        unit="percentunit", max_val=1, w=8))
    d = d.with_panel(series(
        "Microbatch compute by stage and chunk, mean (5m)",
        "Device time per microbatch, all ranks. Forward solid, backward dashed; chunk is the "
        "virtual stage of an interleaved schedule.",
        [(f"run_id_kind_stage_chunk:steptrace_microbatch_seconds:mean_rate5m{{{RUN}}}",
          "{{kind}} stage {{stage}} chunk {{chunk}}")], w=8, dashed="/^backward/"))
    d = d.with_panel(series(
        "Microbatch compute by stage and chunk, p90 (5m)",
        "90th percentile across ranks of each rank's mean device time per microbatch (5m).",
        [(f"run_id_kind_stage_chunk:steptrace_microbatch_seconds:p90_rate5m{{{RUN}}}",
          "{{kind}} stage {{stage}} chunk {{chunk}}")], w=8, dashed="/^backward/"))

    d = d.with_row(dash_b.Row("Health"))
    d = d.with_panel(series(
        "Dropped records", "Records steptrace dropped instead of exporting (a full queue, a "
        "failing sink, misuse, malformed records) in the 5 minutes before each point, by rank, sink "
        "and reason: the 10 largest (recording rule, kept only where records were dropped). Empty "
        "is good.",
        [(f"topk(10, run_id_rank_sink_reason:steptrace_dropped_records:increase5m{{{RUN}}})",
          "rank {{rank}} {{sink}}: {{reason}}")],
        unit="short", w=8, bars=True, decimals=0))
    d = d.with_panel(series(
        "Failed steps by rank", "Steps recorded with status error in the 5 minutes before each point "
        "(recording rule, kept only where steps failed), the 10 ranks with the most. Empty is good.",
        [(f"topk(10, run_id_rank:steptrace_failed_steps:increase5m{{{RUN}}})", "rank {{rank}}")],
        unit="short", w=8, bars=True, decimals=0))
    d = d.with_panel(
        bargauge.Panel().title("Ranks by backend and version")
        .description("What times the steps on each rank (jax, torch-cuda, host) and the "
                     "steptrace version: a mixed fleet shows several bars.")
        .datasource(DATASOURCE).span(8).height(8).unit("none").decimals(0)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(f"count by (backend, version) (steptrace_info{{{RUN}}})",
                           "{{backend}} {{version}}", instant=True)))

    d = d.with_row(dash_b.Row("GPU health and collectives"))
    d = d.with_panel(series(
        "GPU throttled time by policy (5m)",
        "Share of wall time an NVML performance policy held each GPU's clocks down (health=\"nvml\", "
        "docs/health.md): NVML's cumulative violation time per policy (power, thermal, sync boost, board "
        "limit, low utilization, reliability...), the 10 largest rank and policy pairs. A straggler whose "
        "GPU shows thermal or power time here is slow on its device; empty is good.",
        [(f"topk(10, sum by (rank, policy) (rate(steptrace_gpu_violation_seconds_total{{{RUN}}}[5m])) > 0)",
          "rank {{rank}} {{policy}}")],
        unit="percentunit", w=8, max_val=1))
    d = d.with_panel(series(
        "GPU SM clock, slowest and fastest ranks",
        "Mean SM clock of each rank's last health window: the 5 lowest, the 5 highest and the pinned "
        "ranks. A rank below the rest while its throttled time rises is a throttled GPU.",
        ranked(lambda sel: f"steptrace_gpu_sm_clock_hertz{{{sel}}}", "fast", "slow"),
        unit="hertz", w=8, min_val=None, dashed="/^fast/"))
    d = d.with_panel(series(
        "GPU errors by rank and kind (5m)",
        "GPU errors the health sampler saw in the 5 minutes before each point (Xid, uncorrected ECC, "
        "remapped rows, NVLink), the 10 largest rank and kind pairs. Empty is good; see "
        "docs/alerts.md#steptracestragglergpu.",
        [(f"topk(10, sum by (rank, kind) (increase(steptrace_gpu_errors_total{{{RUN}}}[5m])) > 0)",
          "rank {{rank}} {{kind}}")],
        unit="short", w=8, bars=True, decimals=0))
    d = d.with_panel(series(
        "Exposed communication per rank (5m)",
        "Share of wall time each rank's stream stood waiting on NCCL collectives with no compute to "
        "overlap (exposed communication, HolisticTraceAnalysis's sense; collectives timed on the GPU, "
        "docs/collector.md#who-slowed-the-job): the 5 highest, the 5 lowest and the pinned ranks. In a "
        "synchronous job it holds the wait for the latest rank, so the rank the others wait for shows the "
        "least; high on every rank is communication the schedule does not hide. Empty without NCCL.",
        ranked(lambda sel: f"rate(steptrace_step_exposed_communication_seconds_total{{{sel}}}[5m])"),
        unit="percentunit", w=24, max_val=1, table_legend=True))

    d = d.with_row(dash_b.Row("Deep capture"))
    d = d.with_panel(
        bargauge.Panel().title("Profiler captures by rank, time range")
        .description("Deep captures (docs/capture.md) over the time range: the ranks (10 at most) that took "
                     "a profiler trace (ok), failed to (failed: the profiler did not start or stop) or "
                     "skipped one (cooldown, budget, your own profiler), by the trigger that armed it "
                     "(slow, stall, spike, straggler, request). Each trace's path and the step that "
                     "fired it are in `steptrace report` and the rank's capture records.")
        .datasource(DATASOURCE).span(12).height(8).unit("short").decimals(0)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(f"topk(10, sum by (rank, trigger, status) ({born_increase(CAPTURES, '$__range')}) > 0)",
                           "rank {{rank}} {{trigger}}: {{status}}", instant=True)))
    d = d.with_panel(series(
        "Profiler captures over time",
        "Capture records of all ranks per interval, by trigger and status: when traces were taken, and "
        "failures (status failed) that need a look. Every configured trigger reads 0 until its first.",
        [(f"sum by (trigger, status) (increase({CAPTURES}{{{RUN}}}[$__rate_interval]))", "{{trigger}}: {{status}}")],
        unit="short", w=12, bars=True, decimals=0))
    return d


# -- steptrace-cluster.json ------------------------------------------------------------------------

def cluster() -> dash_b.Dashboard:
    d = base("steptrace: cluster", "steptrace-cluster",
             "A run across ranks: the steptrace collectors join each step's spans from every rank "
             "(steptrace_cluster_*), next to the same questions answered from the ranks' own "
             "metrics, and the collectors' health.",
             "steptrace_cluster_last_step")

    d = d.with_row(dash_b.Row("Overview"))
    for panel in [
        single("Last joined step", "Highest step a collector has joined across ranks (complete "
               "or not).", f"max({JOINED}{{{RUN}}})", w=4, decimals=0),
        single("Ranks in the last joined step", "Ranks whose span of the latest joined step "
               "arrived in time (below the world size: ranks missing or late).",
               latest("steptrace_cluster_ranks_reporting", marker=JOINED), w=4, decimals=0),
        single("Straggler rank", "The rank that slowed the latest complete step: the most time on its own "
               "(its step less its wait in collectives), standing out from the others; -1 when no rank did.",
               latest("steptrace_cluster_straggler_rank"), w=4, decimals=0),
        single("Cross-rank skew", "Max - min compute over ranks in the latest complete step.",
               latest("steptrace_cluster_step_skew_seconds"), unit="s", w=4),
        single("Own compute share (joined steps)", "Σ own compute / Σ interval over the ranks of the "
               "steps the collectors joined (mean over collectors). Not goodput: no process start, no "
               "time outside steps (the training dashboard has goodput).",
               f"avg(steptrace_cluster_compute_share_ratio{{{RUN}}})",
               unit="percentunit", w=4, thresholds=GOODPUT_THRESHOLDS),
        single("Late spans", "Spans that arrived after their step was joined (counted, not "
               "lost), over the time range.",
               f"sum(increase(steptrace_collector_late_spans_total{{{RUN}}}[$__range]))", w=4,
               decimals=0, thresholds=[(None, "green"), (1, "orange")]),
    ]:
        d = d.with_panel(panel)

    d = d.with_row(dash_b.Row("Across ranks"))
    d = d.with_panel(series(
        "Step compute across ranks (min, median, max)",
        "Per complete step, the fastest, median and slowest rank's compute time.",
        [(latest("steptrace_cluster_step_compute_seconds", "stat"), "{{stat}}")]))
    d = d.with_panel(series(
        "Step interval across ranks (min, median, max)",
        "Per complete step, the spread of the ranks' intervals (ranks in lockstep agree).",
        [(latest("steptrace_cluster_step_interval_seconds", "stat"), "{{stat}}")]))
    mean = f"run_id_rank:steptrace_step_compute_seconds:mean_rate5m{{{RUN}}}"
    d = d.with_panel(series(
        "Cross-rank skew (max - min compute)",
        "From the collectors: the latest complete step. From the ranks: the spread of the ranks' "
        "5-minute mean compute, which needs no collector.",
        [(latest("steptrace_cluster_step_skew_seconds"), "last complete step (collectors)"),
         (f"max({mean}) - min({mean})", "5m mean per rank (ranks' metrics)")]))
    d = d.with_panel(series(
        "Compute relative to the median rank (5m)",
        "Each rank's mean compute over the median rank's: 100% is typical, a straggler sits "
        "above. The 5 highest, the 5 lowest and the pinned ranks.",
        ranked(lambda sel: f"run_id_rank:steptrace_step_compute_seconds:ratio_to_median_rate5m{{{sel}}}"),
        unit="percentunit", min_val=None, table_legend=True))

    d = d.with_row(dash_b.Row("Stragglers"))
    d = d.with_panel(single(
        "The run's straggler",
        "The verdict, not a step: the rank a collector named the straggler in at least half of its last "
        "--straggler-window-steps complete steps (each time above the run's noise), with that share; no "
        "value when no rank is (a job whose noise names each rank now and then has none). The same "
        "series SteptraceStraggler reads.",
        f"topk(3, max by (rank) (steptrace_cluster_persistent_straggler_steps_ratio{{{RUN}}}))",
        unit="percentunit", w=4, legend="rank {{rank}}"))
    d = d.with_panel(series(
        "Straggler rank over time",
        "The rank that slowed the latest complete step (-1: none stood out above the run's noise). A "
        "rank that keeps coming back is a straggler; one that moves around is noise.",
        [(latest("steptrace_cluster_straggler_rank"), "straggler rank")],
        unit="none", decimals=0, points=True, w=8))
    d = d.with_panel(series(
        "Steps each rank was the straggler",
        "Complete steps in which each rank was named the straggler (summed over collectors), the 10 "
        "ranks named most.",
        [(f"topk(10, sum by (rank) ({born_increase(STRAGGLER_STEPS, '$__rate_interval')})"
          f" > 0)", "rank {{rank}}")],
        unit="short", bars=True, stacked=True, decimals=0, w=8))
    d = d.with_panel(
        bargauge.Panel().title("Top stragglers, time range")
        .description("Ranks named the straggler most often over the whole time range.")
        .datasource(DATASOURCE).span(4).height(8).unit("short").decimals(0)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(f"topk(10, sum by (rank) ({born_increase(STRAGGLER_STEPS, '$__range')}))",
                           "rank {{rank}}", instant=True)))

    d = d.with_panel(
        bargauge.Panel().title("Captures asked of the ranks, time range")
        .description("When a run's straggler verdict changes, the collectors ask the culprit and a reference "
                     "rank for a profiler trace of their next steps (docs/capture.md, the straggler "
                     "trigger): issued, fetched by the rank named, expired (never fetched: the rank's "
                     "capture is off). Summed over collectors.")
        .datasource(DATASOURCE).span(24).height(4).unit("short").decimals(0)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(f"sum by (state) ({born_increase(CAPTURE_REQUESTS, '$__range')})", "{{state}}",
                           instant=True)))

    d = d.with_row(dash_b.Row("Who slowed the job"))
    d = d.with_panel(series(
        "Time on its own across ranks (min, median, max)",
        "Per complete step, each rank's interval minus its wait in collectives (its compute where "
        "the wait is not measured): in synchronous training every rank's step is as long as the "
        "slowest's, this is not. The max rank is the straggler when it stands out by more than the "
        "run's noise (docs/collector.md).",
        [(latest("steptrace_cluster_step_own_seconds", "stat"), "{{stat}}")], w=8))
    d = d.with_panel(series(
        "What the straggler cost the job per step",
        "The other ranks' median wait in collectives less the straggler's own wait, in the latest "
        "complete step (0 when no rank stood out or the ranks do not measure their wait), and the "
        "excess of time on its own a rank had to reach to be named: the run's noise floor or the "
        "fixed minimum, whichever is larger.",
        [(latest("steptrace_cluster_step_straggler_cost_seconds"), "cost per step"),
         (latest("steptrace_cluster_step_straggler_threshold_seconds"), "threshold (noise floor)")], w=8))
    d = d.with_panel(series(
        "Cost to the job by rank",
        "Seconds each rank cost the job as the straggler (the others' wait for it), per interval, "
        "summed over collectors: the 10 costliest ranks.",
        [(f"topk(10, sum by (rank) ({born_increase(STRAGGLER_COST, '$__rate_interval')}))", "rank {{rank}}")],
        bars=True, stacked=True, w=8))
    for kind, what in (("relative", "the median rank's mean time on its own over this rank's: 1 is "
                                    "typical, 0.5 needs twice the median rank's time"),
                       ("individual", "this rank's best windowed mean time on its own over its current "
                                      "one: 1 is as fast as it has been, lower is slower than its best")):
        d = d.with_panel(series(
            f"Straggler score per rank, {kind}",
            f"Over each collector's last --straggler-window-steps complete steps: {what} (NVIDIA "
            "resiliency-ext's scores; mean over collectors): the 5 lowest ranks and the pinned ranks.",
            ranked(lambda sel, kind=kind: (f"avg by (rank) (steptrace_cluster_straggler_score"
                                           f"{{{sel}, kind=\"{kind}\"}})"))[1:],
            unit="none", min_val=None, decimals=2, table_legend=True))

    d = d.with_row(dash_b.Row("Pipeline and goodput"))
    d = d.with_panel(series(
        "Pipeline bubble per stage (joined steps)",
        "1 - microbatch compute / pipeline window per stage (mean over the stage's ranks), in the "
        "latest complete step.",
        [(latest("steptrace_cluster_pipeline_bubble_ratio", "stage"), "stage {{stage}}")],
        unit="percentunit", max_val=1))
    d = d.with_panel(series(
        "Own compute share (collectors) and goodput (ranks)",
        "The collectors' Σ own compute / Σ interval over the steps they joined, and the ranks' "
        "goodput over 5 minutes (own compute / wall from the process start). The share is above "
        "goodput by the time outside steps (start-up, work between steps).",
        [(f"avg(steptrace_cluster_compute_share_ratio{{{RUN}}})", "own compute share, joined steps (collectors)"),
         (f"run_id:steptrace_goodput:ratio_rate5m{{{RUN}}}", "goodput, all ranks, 5m (recording rule)")],
        unit="percentunit", max_val=1))
    d = d.with_panel(series(
        "Waiting in collectives across ranks (min, median, max)",
        "Per complete step, each rank's time waiting for other ranks in collectives (exposed "
        "communication), where the ranks measure it: the ranks that wait for a slow one show it "
        "here, not as their own compute.",
        [(latest("steptrace_cluster_step_collective_wait_seconds", "stat"), "{{stat}}")], unit="s"))

    d = d.with_row(dash_b.Row("Collectors"))
    d = d.with_panel(series(
        "Spans received per second, by collector",
        "Even lines mean the load balancer spreads trace ids evenly over the collectors.",
        [(f"sum by (instance) (rate(steptrace_collector_received_spans_total{{{RUN}}}"
          f"[$__rate_interval]))", "{{instance}}")], unit="short", w=8))
    d = d.with_panel(series(
        "Join lag (p50, p90)",
        "From a step's first span arriving to its joined record: short when every rank reports "
        "promptly, up to the collector's --window-s when a rank is missing.",
        [(f"histogram_quantile({q}, sum by (le) (rate(steptrace_cluster_join_lag_seconds_bucket"
          f"{{{RUN}}}[$__rate_interval])))", f"p{round(q * 100)}") for q in (0.5, 0.9)], w=8))
    d = d.with_panel(series(
        "Incomplete steps and late spans per second",
        "Steps emitted without every rank (window expired), and spans that arrived after their "
        "step was emitted: ranks slower than the window, or a step split across collectors by a "
        "change of the load balancer's backends.",
        [(f"sum(rate(steptrace_cluster_incomplete_steps_total{{{RUN}}}[$__rate_interval]))",
          "incomplete steps"),
         (f"sum(rate(steptrace_collector_late_spans_total{{{RUN}}}[$__rate_interval]))", "late spans")],
        unit="short", w=8))
    d = d.with_panel(series(
        "Rejected requests by reason",
        "OTLP requests a collector refused (malformed body, too large, wrong content type, "
        "missing token), for every run: a rejected request has no run to trust.",
        [("sum by (instance, reason) (rate(steptrace_collector_rejected_requests_total"
          "[$__rate_interval])) > 0", "{{instance}} {{reason}}")], unit="reqps", w=12))
    d = d.with_panel(series(
        "Scrape targets down",
        "Targets Prometheus could not scrape, by job (job names from collector/prometheus.yml).",
        [('sum by (job) (1 - up{job=~"steptrace|steptrace-collector|otelcol"})', "{{job}}")],
        unit="short", w=12, decimals=0))
    return d


# -- output ------------------------------------------------------------------------------------------

#: File name -> the function building that dashboard.
DASHBOARDS = {
    "steptrace-training.json": training,
    "steptrace-cluster.json": cluster,
    **{src.file: functools.partial(clickhouse.clickhouse, src) for src in clickhouse.SOURCES},
}


def _number_panels(model: dash_m.Dashboard) -> None:
    """Stable panel ids (1, 2, ...) in layout order: links like ?viewPanel=N survive regeneration."""
    for i, panel in enumerate(model.panels or [], start=1):
        panel.id_val = i


def render(builder: dash_b.Dashboard) -> str:
    """The dashboard as committed: sorted keys, two-space indent, a final newline."""
    model = builder.build()
    _number_panels(model)
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def build_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE,
                        help="directory of the dashboard JSON files (default: next to this script)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file in --out differs from the generated one")
    args = parser.parse_args(argv)

    generated = build_all()
    if args.check:
        stale = [name for name, text in generated.items()
                 if not (args.out / name).is_file() or (args.out / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{args.out / name} is out of date: run python collector/dashboards/generate.py",
                  file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in generated.items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
