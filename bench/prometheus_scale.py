"""A real Prometheus scraping thousands of synthetic ranks: rule evaluation time and dashboard query samples.

    python bench/prometheus_scale.py                       # 1,024 and 4,096 ranks, plain and pipeline (~9 min)
    python bench/prometheus_scale.py --ranks 4096 --kinds pipeline
    python bench/prometheus_scale.py --dashboards DIR      # the dashboards in DIR instead (e.g. an older set)

What a rank serves is taken from a real rank: a short steptrace run (simulated device; tokens, FLOPs
with a peak, a data span, an async checkpoint; ``pipeline`` adds 32 microbatches x 4 chunks x
forward/backward on one stage per step) with the Prometheus exporter, whose ``/metrics`` text is
captured once. One in-process HTTP server (port 0) then serves that text for ranks 0..N-1 at
``/rank/<i>/metrics``, changing only the ``rank`` label and moving the values at each scrape
(counters, ``_sum`` and ``_count`` grow with a rank's own pace, gauges jitter by a few percent,
the last rank is 20 % slower), and ``/collector/metrics`` serves a real steptrace collector's
series (``collector._metrics.ClusterMetrics``) fed one N-rank ``cluster_step`` record per scrape.

The Prometheus server (``prometheus`` on PATH, Debian package ``prometheus``) scrapes every rank as
its own target with ``honor_labels: true``, loads ``collector/rules.yml`` and ``collector/alerts.yml``,
and scrapes and evaluates at the intervals of ``collector/prometheus.yml`` (15 s and 30 s). After
``--evaluations`` evaluations of every rule group on data it reads, from Prometheus's own metrics,
each group's ``prometheus_rule_group_last_duration_seconds`` (the largest seen) against
``prometheus_rule_group_interval_seconds``, and runs every dashboard panel query as Grafana sends it
(variables at their defaults, ``$__rate_interval`` = 1m, 241 points as a 1 h range at a 15 s step) with
``stats=all``: ``peakSamples`` against the default ``--query.max-samples`` (50,000,000; Prometheus
answers an error past it) and the query's wall time. The synthetic job has run only a few minutes,
so each query asks for the span with data at a step giving it the 241 points of 1 h at 15 s: a range
query's peak is about its series x its points, so that is the peak the 1 h dashboard would reach.

Memory: at 4,096 pipeline ranks Prometheus holds ~295k series in ~1.1 GiB of heap (1.5 GiB resident
after the queries). 16,384 ranks (``--ranks 16384``) would need ~4.5 GiB of heap and ~1,100
scrapes/s from this one Python process: not run on the 2-core development VM (bench/RESULTS.md).
``--quick``: 256 ranks scraped and evaluated every second (tests/test_prometheus_scale.py's setup).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import yaml  # noqa: E402

from prometheus_server import PrometheusProcess  # noqa: E402  (tests/prometheus_server.py)

COLLECTOR_DIR = ROOT / "collector"
RUN_ID = "scale-bench"
MAX_SAMPLES = 50_000_000   # Prometheus's default --query.max-samples
RANGE_S = 3600             # the dashboards' default time range (now-1h)
STEP_S = 15                # Grafana's step for it: the scrape interval
RATE_INTERVAL = "1m"       # Grafana's $__rate_interval at a 15 s scrape interval (4 x 15 s)
#: Ranks a per-rank query may name (top-k + bottom-k + the pinned default); more is one per rank.
MAX_RANKS_PER_QUERY = 11


# -- what one rank serves ----------------------------------------------------------------------------

def capture(kind: str) -> str:
    """The /metrics text of a real rank after a short run (``plain`` or ``pipeline``), rank 0."""
    import steptrace
    from steptrace.testing import SimulatedDevice

    device = SimulatedDevice()
    steptrace.init(prometheus_port=0, jsonl=False, run_id=RUN_ID, peak_tflops=100.0)
    try:
        endpoint = steptrace.stats()["endpoints"]["prometheus"]
        for n in range(3):
            with steptrace.span("data"):
                time.sleep(0.05)   # longer than the queued device work: idle time, by reason
            with steptrace.step(n, tokens=1000, flops=1e12) as s:
                if kind == "pipeline":
                    for mb_kind in ("forward", "backward"):
                        for chunk in range(4):
                            for i in range(32):
                                with steptrace.microbatch(i, stage=0, chunk=chunk, kind=mb_kind) as mb:
                                    mb.wait_for(device.run(0.0001))
                s.wait_for(device.run(0.002))
                # What steptrace.adapters.torch_distributed records for a data-parallel rank's gradient
                # all-reduce: the wait series a real DDP rank serves (and the dashboards' wait panels read).
                s.collective_wait += 0.0005
                s.collective_source = "torch.distributed"
            if n == 1:
                with steptrace.checkpoint(n, async_save=True) as ckpt:
                    time.sleep(0.001)
                ckpt.async_done()
        steptrace.flush(10)
        with urllib.request.urlopen(endpoint, timeout=10) as response:
            return response.read().decode()
    finally:
        steptrace.shutdown()
        device.close()


class RankTemplate:
    """A captured exposition, re-served for any rank with values that move like a training rank's."""

    GROWING = ("_total", "_sum", "_count")
    STEPS = ("steptrace_last_step", "steptrace_current_step")

    def __init__(self, text: str):
        self.lines: list[tuple[str, str, float]] = []   # (line up to the value, how it moves, value)
        types: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                types[name] = kind
            if not line or line.startswith("#"):
                self.lines.append((line, "text", 0.0))
                continue
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0]
            if name.endswith("_created"):
                how = "const"
            elif name in self.STEPS:
                how = "step"
            elif name.endswith(self.GROWING) and types.get(name) != "gauge":
                how = "grow"
            else:
                how = "jitter"
            assert 'rank="0"' in head, head
            self.lines.append((head, how, float(value)))
        self.series = sum(1 for _, how, _ in self.lines if how != "text")

    def render(self, rank: int, steps: float, rng: random.Random, slow: bool) -> bytes:
        """Rank ``rank``'s exposition after ``steps`` steps (the captured run made 3)."""
        pace = 1.2 if slow else 1.0 + (rank % 7) * 0.01
        out = []
        for head, how, value in self.lines:
            if how == "text":
                out.append(head)
                continue
            if how == "grow":
                # Counts grow with the steps; sums of seconds as well, a slow rank's faster.
                v = value * (1 + steps / 3) * (pace if "seconds" in head.split("{", 1)[0] else 1)
            elif how == "step":
                v = float(int(steps))
            elif how == "jitter":
                v = value * (1 + rng.uniform(-0.05, 0.05)) * (pace if "seconds" in head else 1)
            else:
                v = value
            before, after = head.split('rank="0"', 1)
            out.append(f'{before}rank="{rank}"{after} {v!r}')
        return ("\n".join(out) + "\n").encode()


class SyntheticCollector:
    """A real ClusterMetrics fed one N-rank cluster_step record per scrape."""

    def __init__(self, ranks: int):
        from prometheus_client import generate_latest

        from steptrace.collector._metrics import ClusterMetrics

        self.ranks = ranks
        self.metrics = ClusterMetrics()
        self.generate = generate_latest
        self.step = 0
        self.lock = threading.Lock()

    def render(self) -> bytes:
        with self.lock:
            own = {str(r): 0.1 * (1.2 if r == self.ranks - 1 else 1 + random.uniform(0, 0.02))
                   for r in range(self.ranks)}
            stats = {"min": 0.1, "median": 0.101, "max": 0.12}
            record: dict[str, Any] = {
                "type": "cluster_step", "run_id": RUN_ID, "step": self.step, "join_seconds": 0.5,
                "complete": True, "reason": "complete", "compute_sum_seconds": 0.1 * self.ranks,
                "interval_sum_seconds": 0.125 * self.ranks, "ranks_reporting": self.ranks,
                "world_size": self.ranks, "straggler_rank": self.ranks - 1, "straggler_cost_seconds": 0.02,
                "rank_own_seconds": own, "skew_seconds": 0.02, "pipeline_bubble_ratio": {"0": 0.1},
                # The others waited for the slow last rank in the all-reduce (issue 33's fields).
                "straggler_excess_seconds": 0.02, "straggler_threshold_seconds": 0.005,
                "collective_wait_min_seconds": 0.0, "collective_wait_median_seconds": 0.019,
                "collective_wait_max_seconds": 0.02,
            }
            for stat, v in stats.items():
                record[f"compute_{stat}_seconds"] = v
                record[f"interval_{stat}_seconds"] = v * 1.25
                record[f"own_{stat}_seconds"] = v
            self.metrics.publish([record])
            self.step += 1
            return self.generate(self.metrics.registry)


class SyntheticJob:
    """One HTTP server for N ranks and a collector; call close() to stop it."""

    def __init__(self, template: RankTemplate, ranks: int, steps_per_second: float = 1.0):
        self.template, self.ranks, self.rate = template, ranks, steps_per_second
        self.collector = SyntheticCollector(ranks)
        self.started = time.monotonic()
        self.scrapes = 0
        job = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                m = re.fullmatch(r"/rank/(\d+)/metrics", self.path)
                if m and int(m.group(1)) < job.ranks:
                    rank = int(m.group(1))
                    steps = (time.monotonic() - job.started) * job.rate
                    body = job.template.render(rank, steps, random.Random(), rank == job.ranks - 1)
                elif self.path == "/collector/metrics":
                    body = job.collector.render()
                else:
                    self.send_error(404)
                    return
                job.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # Prometheus gave up on the scrape (timeout) or is stopping

            def log_message(self, *args: Any) -> None:
                pass

        http.server.ThreadingHTTPServer.request_queue_size = 1024
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- Prometheus --------------------------------------------------------------------------------------

def prometheus_config(port: int, ranks: int, rule_files: list[Path], scrape: str, evaluation: str) -> str:
    groups = [{"targets": [f"127.0.0.1:{port}"],
               "labels": {"__metrics_path__": f"/rank/{r}/metrics", "instance": f"node{r // 8}:{9464 + r % 8}"}}
              for r in range(ranks)]
    config = {
        "global": {"scrape_interval": scrape, "scrape_timeout": "10s" if scrape == "15s" else scrape,
                   "evaluation_interval": evaluation},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": "steptrace", "honor_labels": True, "static_configs": groups},
            {"job_name": "steptrace-collector", "honor_labels": True, "metrics_path": "/collector/metrics",
             "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def rule_files(out: Path, interval: str | None) -> list[Path]:
    """collector/rules.yml and alerts.yml, as shipped, or with every group's interval set to ``interval``."""
    paths = []
    for name in ("rules.yml", "alerts.yml"):
        path = COLLECTOR_DIR / name
        if interval is not None:
            rules = yaml.safe_load(path.read_text())
            for group in rules["groups"]:
                group["interval"] = interval
            path = out / name
            path.write_text(yaml.safe_dump(rules, sort_keys=False))
        paths.append(path)
    return paths


def api(server: PrometheusProcess, path: str, params: dict[str, str]) -> dict[str, Any]:
    """A POST to Prometheus's HTTP API, waiting up to its own --query.timeout (2 min) for the answer."""
    request = urllib.request.Request(server.base + path, data=urllib.parse.urlencode(params).encode(),
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.urlopen(request, timeout=150) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read().decode())


def vector(server: PrometheusProcess, promql: str) -> list[tuple[dict, float]]:
    body = api(server, "/api/v1/query", {"query": promql})
    if body.get("status") != "success":
        raise RuntimeError(f"{promql}: {body}")
    return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]


def own_metrics(server: PrometheusProcess) -> list[Any]:
    """Prometheus's own /metrics (nobody scrapes it here), as prometheus_client samples."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def own_value(samples: list[Any], name: str) -> float | None:
    return next((s.value for s in samples if s.name == name), None)


def rule_groups(server: PrometheusProcess) -> dict[str, dict[str, float]]:
    """Each rule group's last duration, interval, evaluations, missed evaluations and failed rule
    evaluations, from Prometheus's own metrics."""
    fields = {"prometheus_rule_group_last_duration_seconds": "last_s",
              "prometheus_rule_group_interval_seconds": "interval_s",
              "prometheus_rule_group_iterations_total": "evaluations",
              "prometheus_rule_group_iterations_missed_total": "missed",
              "prometheus_rule_evaluation_failures_total": "failures"}
    out: dict[str, dict[str, float]] = {}
    for sample in own_metrics(server):
        if sample.name in fields and "rule_group" in sample.labels:
            name = sample.labels["rule_group"].rsplit(";", 1)[-1]
            out.setdefault(name, {})[fields[sample.name]] = sample.value
    return out


# -- the dashboards' queries ---------------------------------------------------------------------------

def dashboard_queries(directory: Path) -> list[tuple[str, str, str, str]]:
    """(dashboard, panel, refId, PromQL as Grafana sends it) for every panel query of every dashboard."""
    out = []
    for path in sorted(directory.glob("steptrace-*.json")):
        dashboard = json.loads(path.read_text())
        if any(p.get("datasource", {}).get("type") not in (None, "prometheus") for p in dashboard["panels"]):
            continue  # another data source's dashboard (ClickHouse)
        rank = ".*"
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable["name"] == "rank":
                value = variable.get("current", {}).get("value")
                values = value if isinstance(value, list) else [value]
                rank = ".*" if "$__all" in values else "|".join(values)
        panels = []
        for panel in dashboard["panels"]:
            panels.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in (("$__rate_interval", RATE_INTERVAL), ("$__interval", f"{STEP_S}s"),
                                        ("$__range", "1h"), ("$run_id", RUN_ID), ("$rank", rank)):
                    expr = expr.replace(variable, value)
                out.append((path.name, panel["title"], target["refId"], expr))
    return out


def run_query(server: PrometheusProcess, expr: str, start: float, end: float) -> dict[str, Any]:
    """A range query with as many points as Grafana's 1 h at a 15 s step (241), over ``start``..``end``
    (the span with data), with stats: peak samples, samples read, wall time, error; and the distinct
    ranks of the instant answer at ``end``."""
    step = (end - start) / (RANGE_S // STEP_S)
    started = time.perf_counter()
    body = api(server, "/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                               "step": f"{step:.3f}", "stats": "all"})
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {"seconds": seconds, "status": body.get("status"), "error": body.get("error")}
    if body.get("status") == "success":
        samples = body["data"].get("stats", {}).get("samples", {})
        result["peak"] = samples.get("peakSamples", 0)
        result["total"] = samples.get("totalQueryableSamples", 0)
        result["series"] = len(body["data"]["result"])
        instant = api(server, "/api/v1/query", {"query": expr, "time": f"{end:.3f}"})
        result["ranks"] = len({r["metric"].get("rank") for r in instant.get("data", {}).get("result", [])
                               if "rank" in r["metric"]})
    return result


# -- one measurement --------------------------------------------------------------------------------

def measure(kind: str, ranks: int, template: RankTemplate, *, dashboards: Path, evaluations: int,
            scrape: str, evaluation: str, rule_interval: str | None, binary: str, log=print) -> dict[str, Any]:
    """Serve ``ranks`` synthetic ranks of ``kind`` to a fresh Prometheus; measure rules and queries."""
    workdir = Path(tempfile.mkdtemp(prefix=f"prom-scale-{kind}-{ranks}-"))
    job = SyntheticJob(template, ranks)
    server = None
    try:
        config = prometheus_config(job.port, ranks, rule_files(workdir, rule_interval), scrape, evaluation)
        server = PrometheusProcess(binary, config, workdir)
        if not server.wait_ready(60):
            raise RuntimeError(f"Prometheus did not start:\n{server.log_tail()}")
        started = time.time()
        deadline = time.monotonic() + 120
        while True:   # every target scraped once
            up = vector(server, 'count(up{job="steptrace"} == 1)')
            if up and up[0][1] >= ranks:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {up} of {ranks} targets up after 120 s")
            time.sleep(2)
        first_scraped = time.time()
        log(f"  {kind} {ranks}: every target up {first_scraped - started:.0f} s after start")
        # Evaluations on data: rate() needs two scrapes, so count from one scrape interval on.
        base = {g: v.get("evaluations", 0) for g, v in rule_groups(server).items()}
        worst: dict[str, float] = {}
        while True:
            time.sleep(2)
            groups = rule_groups(server)
            for name, v in groups.items():
                worst[name] = max(worst.get(name, 0.0), v.get("last_s", 0.0))
            done = min(v.get("evaluations", 0) - base.get(name, 0) for name, v in groups.items())
            if done >= evaluations + 1:
                break
        own = own_metrics(server)
        head = own_value(own, "prometheus_tsdb_head_series")
        rss = own_value(own, "process_resident_memory_bytes")
        heap = own_value(own, "go_memstats_heap_inuse_bytes")
        rank_series = vector(server, f'count({{job="steptrace", rank="0", run_id="{RUN_ID}"}})')[0][1]
        end = time.time()
        covered = end - first_scraped
        queries = []
        for name, title, ref, expr in dashboard_queries(dashboards):
            q = run_query(server, expr, first_scraped, end)
            q.update(dashboard=name, panel=title, ref=ref, expr=expr)
            queries.append(q)
        return {
            "kind": kind, "ranks": ranks, "series_per_rank": rank_series, "series_total": head,
            "prometheus_rss_bytes": max(rss or 0, own_value(own_metrics(server), "process_resident_memory_bytes") or 0),
            "heap_inuse_bytes": heap,
            "groups": {n: {**v, "worst_last_s": worst.get(n, v.get("last_s", 0.0))} for n, v in groups.items()},
            "covered_s": covered, "queries": queries, "scrapes_served": job.scrapes,
        }
    finally:
        if server is not None:
            server.stop()
        job.close()
        shutil.rmtree(workdir, ignore_errors=True)


# -- report ----------------------------------------------------------------------------------------

def report(results: list[dict[str, Any]]) -> str:
    lines = ["| ranks | kind | series/rank | series total | Prometheus RSS | rule group: worst last / interval "
             "| worst query: peak samples (241 points) | its time | queries failed or over max-samples |",
             "| ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for r in results:
        groups = "; ".join(f"{n} {v['worst_last_s']:.2f} s / {v['interval_s']:.0f} s "
                           f"{'PASS' if v['worst_last_s'] < v['interval_s'] else 'FAIL'}"
                           for n, v in sorted(r["groups"].items()))
        ok = [q for q in r["queries"] if q["status"] == "success"]
        worst = max(ok, key=lambda q: q["peak"]) if ok else None
        over = [q for q in r["queries"] if q["status"] != "success" or q["peak"] > MAX_SAMPLES]
        worst_text = f"{worst['peak']:,}: {worst['panel']} {worst['ref']}" if worst else "-"
        lines.append(f"| {r['ranks']:,} | {r['kind']} | {r['series_per_rank']:.0f} | {r['series_total']:,.0f} | "
                     f"{(r['prometheus_rss_bytes'] or 0) / 2**30:.2f} GiB | {groups} | {worst_text} | "
                     f"{worst['seconds'] if worst else 0:.2f} s | {len(over)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1024,4096", help="comma-separated rank counts (default 1024,4096)")
    parser.add_argument("--kinds", default="plain,pipeline", help="plain, pipeline or both (default both)")
    parser.add_argument("--evaluations", type=int, default=2,
                        help="evaluations of every rule group on data before reading (default 2)")
    parser.add_argument("--dashboards", type=Path, default=COLLECTOR_DIR / "dashboards",
                        help="directory of steptrace-*.json dashboards (default collector/dashboards)")
    parser.add_argument("--json", type=Path, help="also write every figure, per query, to this file")
    parser.add_argument("--quick", action="store_true",
                        help="256 ranks, scraped and evaluated every second (the test's setup; ~1 min)")
    args = parser.parse_args(argv)

    binary = shutil.which("prometheus")
    if binary is None:
        print("needs the `prometheus` server on PATH (Debian package `prometheus`)", file=sys.stderr)
        return 2
    shipped = yaml.safe_load((COLLECTOR_DIR / "prometheus.yml").read_text())["global"]
    rule_interval = None
    if args.quick:
        args.ranks, rule_interval = "256", "1s"
        shipped = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    results = []
    for kind in args.kinds.split(","):
        template = RankTemplate(capture(kind))
        for ranks in (int(n) for n in args.ranks.split(",")):
            started = time.monotonic()
            r = measure(kind, ranks, template, dashboards=args.dashboards, evaluations=args.evaluations,
                        scrape=shipped["scrape_interval"], evaluation=shipped["evaluation_interval"],
                        rule_interval=rule_interval, binary=binary)
            r["bench_seconds"] = time.monotonic() - started
            results.append(r)
            print(report([r]).splitlines()[-1], flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print(f"\nPrometheus {binary}; scrape {shipped['scrape_interval']}, evaluation "
          f"{shipped['evaluation_interval']}; max-samples {MAX_SAMPLES:,}; every query as a range query of "
          f"{RANGE_S // STEP_S + 1} points (Grafana's 1 h at {STEP_S} s) over the minutes with data")
    print(report(results))
    for r in results:
        top = sorted((q for q in r["queries"] if q["status"] == "success"), key=lambda q: -q["peak"])[:3]
        print(f"{r['kind']} {r['ranks']}: largest queries " + "; ".join(
            f"{q['panel']} {q['ref']} {q['peak']:,} peak, {q['total']:,} read, {q['seconds']:.2f} s" for q in top))
        failed = [q for q in r["queries"] if q["status"] != "success"]
        for q in failed:
            print(f"  FAILED {q['panel']} {q['ref']}: {q['error']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    over = any(v["worst_last_s"] >= v["interval_s"] for r in results for v in r["groups"].values())
    failed = any(q["status"] != "success" for r in results for q in r["queries"])
    return 1 if over or failed else 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
