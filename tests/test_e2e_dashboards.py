"""The dashboards end to end (issue 4, "Dashboards: End-to-end test"): real training, real collector, real
Prometheus, and every dashboard query returns data.

Three rank processes train a small JAX model on the CPU (jitted matmul layers, four pipeline microbatches of
forward and backward per step, a ``data`` span, a checkpoint every 5 steps alternating blocking and
asynchronous saves, tokens and FLOPs with ``peak_tflops`` so MFU exists). Rank 2 does three times the work
per step: it is the straggler. Every rank serves its own Prometheus ``/metrics`` and exports OTLP to a real
``python -m steptrace.collector`` process. A real Prometheus server, configured from the shipped
collector/prometheus.yml (``live_config``: local targets, 1 s scrapes) with collector/rules.yml (every group
evaluated each second), scrapes the three ranks and the collector.

Once the ranks are past ``MIN_STEPS``, every panel query and every template-variable query of both
dashboards is evaluated through Prometheus's HTTP API, with Grafana's variables substituted as
tests/test_dashboards.py does, and must come back ``success`` with at least one finite value. Panels that a
healthy run leaves empty get their data from the run itself: one rank misuses the API twice (a counted
drop: "Dropped records"), one step fails with a data-loading error ("Failed steps by rank"), and the test
sends the collector one malformed request ("Rejected requests by reason"). The otelcol target is down, as
``live_config`` sets it up ("Scrape targets down" shows 1 for it). No query is allowed to be empty.

The ranks run in lockstep, as synchronous data parallelism makes them: a barrier (a socket server in the
test, standing in for the collective) holds every rank at step ``n`` until all finished step ``n - 1``, and
steps start no faster than one per ``PERIOD_S``, which leaves CPU to the collector and Prometheus. Without
the barrier the fast ranks run ahead of rank 2: the collector closes their steps incomplete after its
window, and on a loaded machine step ``n`` of different ranks runs at different times, under different
contention, so their compute times stop being comparable.
"""

from __future__ import annotations


import collections
import glob
import http.client
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: Series this run cannot produce, each said with why; everything else must have data. The ranks here
#: synchronise through the test's socket barrier, not torch.distributed collectives, so no rank measures a
#: wait in collectives (issue 33's panels), and the persistent-straggler verdict needs more steps than
#: MIN_STEPS gives. tests/test_dashboards.py checks these queries against promtool instead. A follow-up
#: (issue 33's note) gives the e2e ranks a measured wait so that no query is exempt again.
NOT_FILLED_BY_THIS_RUN = ("steptrace_step_collective_wait", "steptrace_cluster_step_collective_wait",
                          "steptrace_cluster_persistent_straggler",
                          # GPU health (health="nvml") and NCCL's exposed communication: a JAX run on
                          # CPU has no GPU; the synthetic run of tests/test_dashboards.py fills these panels.
                          "steptrace_gpu_", "steptrace_step_exposed_communication")

yaml = pytest.importorskip("yaml", reason="reading the configs needs PyYAML (installed with steptrace[test])")
pytest.importorskip("prometheus_client", reason="the exporter and collector need `pip install 'steptrace[prometheus]'`")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="the ranks export with opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")

from collector_helpers import PROTOBUF, post, read_records  # noqa: E402
from collector_process import CollectorProcess  # noqa: E402
from test_dashboards import FILES, all_queries, load, substitute  # noqa: E402
from test_deploy_configs import RULES_YML, PrometheusServer, live_config, load_yaml  # noqa: E402

RUN_ID = "e2e-dash"
WORLD = 3
SLOW_RANK = 2
WORK = {0: 1, 1: 1, 2: 3}   # jitted forward/backward passes per microbatch: rank 2 does 3x the work
PERIOD_S = 0.25             # at most one step per period (~2x rank 2's step): CPU left for Prometheus
MIN_STEPS = 40              # every rank past this step before the dashboards are read
MAX_STEPS = 400             # the ranks stop by themselves here if the test never says stop
MISUSE_RANK, MISUSE_STEPS = 0, (5, 25)   # twice, seconds apart: the drop counter is seen growing
FAIL_RANK, FAIL_STEP = 1, 15             # a data-loading error fails this step
CAPTURE_RANK = SLOW_RANK                 # asked for a profiler trace over HTTP (slower still: still the straggler)
CAPTURE_TOKEN = "e2e-capture-token-0123456789"
RANK_SELECTOR = f'run_id="{RUN_ID}"'

RANK_SCRIPT = r'''
import concurrent.futures, json, os, socket, sys, time

import numpy as np
import jax
import jax.numpy as jnp
import steptrace

cfg = json.loads(sys.argv[1])
rank, work, period, workdir = cfg["rank"], cfg["work"], cfg["period"], cfg["workdir"]
D, B, LAYERS, MICROBATCHES, CKPT_EVERY = 384, 128, 4, 4, 5


def layers(w, x):
    for _ in range(LAYERS):
        x = jnp.tanh(x @ w)
    return x


def loss_fn(w, x):
    return jnp.mean(layers(w, x) ** 2)


forward = jax.jit(loss_fn)
backward = jax.jit(jax.grad(loss_fn))
update = jax.jit(lambda w, g: w - 0.01 * g)

# FLOPs this rank's device executes per step: per microbatch pass 2*B*D*D per layer forward, and the
# backward pass recomputes the forward and does two matmuls per layer.
FLOPS = work * MICROBATCHES * 4 * LAYERS * 2 * B * D * D
TOKENS = MICROBATCHES * B

steptrace.init(run_id=cfg["run_id"], rank=rank, world_size=cfg["world"], prometheus_port=0,
               otlp_endpoint=cfg["otlp_endpoint"], otlp_metrics_interval_s=1, otlp_timeout_s=2, jsonl=True,
               run_dir=cfg["run_dir"], peak_tflops=0.5, capture="request", capture_steps=2,
               capture_token=cfg["capture_token"])


def publish(name, text):
    tmp = os.path.join(workdir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(workdir, name))


publish(f"endpoint-{rank}", steptrace.stats()["endpoints"]["prometheus"])
barrier = socket.create_connection(("127.0.0.1", cfg["barrier_port"]))
replies = barrier.makefile("rb")


def all_ranks_at(n):
    """The collective: returns when every rank is at step n (the release time), None when the run is over."""
    barrier.sendall(b"%d\n" % n)
    line = replies.readline()
    return float(line) if line else None


rng = np.random.default_rng(rank)
w = jnp.asarray(rng.standard_normal((D, D), dtype=np.float32) / np.sqrt(D))
committer = concurrent.futures.ThreadPoolExecutor(1)
checkpoint_path = os.path.join(workdir, f"checkpoint-{rank}.npy")
n = 0
while n < cfg["max_steps"]:
    released = all_ranks_at(n)
    if released is None:
        break
    if n == 0:
        t0 = released
    delay = t0 + n * period - time.time()   # at most one step per period
    if delay > 0:
        time.sleep(delay)
    if rank == cfg["misuse_rank"] and n in cfg["misuse_steps"]:
        with steptrace.span(""):   # misuse: warned, dropped and counted (steptrace_dropped_records_total)
            pass
    try:
        with steptrace.step(n, tokens=TOKENS, flops=FLOPS) as s:
            with steptrace.span("data"):
                if rank == cfg["fail_rank"] and n == cfg["fail_step"]:
                    raise OSError("injected: data shard unreadable")
                batch = jnp.asarray(rng.standard_normal((MICROBATCHES, B, D), dtype=np.float32))
            grad = jnp.zeros_like(w)
            for i in range(MICROBATCHES):
                x = batch[i]
                with steptrace.microbatch(i, stage=rank % 2, chunk=0, kind="forward") as mb:
                    for _ in range(work):   # rank 2 repeats every pass: a device three times slower
                        loss = forward(w, x)
                    mb.wait_for(loss)
                with steptrace.microbatch(i, stage=rank % 2, chunk=0, kind="backward") as mb:
                    for _ in range(work):
                        g = backward(w, x)
                    grad = grad + g
                    mb.wait_for(grad)
            w = update(w, grad)
            s.wait_for(w, loss)
    except OSError as exc:
        if "injected" not in str(exc):
            raise
    if n % CKPT_EVERY == CKPT_EVERY - 1:
        if (n // CKPT_EVERY) % 2 == 0:
            with steptrace.checkpoint(n):
                np.save(checkpoint_path, np.asarray(w))
        else:
            with steptrace.checkpoint(n, async_save=True) as ckpt:
                host = np.asarray(w)   # the blocking part: the copy to host; the write runs behind
                ckpt.track(committer.submit(np.save, checkpoint_path, host))
    n += 1
committer.shutdown(wait=True)
ok = steptrace.shutdown(timeout_s=10)
print(json.dumps({"rank": rank, "steps": n, "shutdown_ok": ok}))
'''


class Barrier:
    """The ranks' collective: each rank sends ``n`` before step ``n`` and gets the release time back once every
    rank sent it. The first release waits for :meth:`go`; after :meth:`stop`, the next crossing closes every
    connection instead (the ranks end their loops at the same step), as does a rank leaving."""

    def __init__(self, parties: int):
        self.parties = parties
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._go = threading.Event()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="rank-barrier", daemon=True)
        self._thread.start()

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()

    def close(self) -> None:
        self.stop()
        for sock in [self._server, *self._conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(5)

    def _serve(self) -> None:
        try:
            while len(self._conns) < self.parties:
                self._conns.append(self._server.accept()[0])
            readers = [conn.makefile("rb") for conn in self._conns]
            while True:
                arrived = [reader.readline() for reader in readers]
                self._go.wait()
                if self._stop.is_set() or not all(arrived):
                    break
                released = f"{time.time()!r}\n".encode()
                for conn in self._conns:
                    conn.sendall(released)
        except (OSError, ValueError):
            pass  # closed under us
        finally:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Ranks:
    """The rank processes, their logs and the endpoints they published."""

    def __init__(self, workdir: Path, otlp_endpoint: str, run_dir: Path):
        self.workdir = workdir
        self.barrier = Barrier(WORLD)
        script = workdir / "rank.py"
        script.write_text(RANK_SCRIPT)
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   # One thread each: three ranks share two cores with the collector and Prometheus.
                   XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        for rank in range(WORLD):
            out = open(workdir / f"rank-{rank}.out", "wb")
            err = open(workdir / f"rank-{rank}.err", "wb")
            self.logs += [out, err]
            cfg = {"rank": rank, "world": WORLD, "run_id": RUN_ID, "otlp_endpoint": otlp_endpoint,
                   "run_dir": str(run_dir), "workdir": str(workdir), "work": WORK[rank], "period": PERIOD_S,
                   "max_steps": MAX_STEPS, "barrier_port": self.barrier.port, "misuse_rank": MISUSE_RANK,
                   "misuse_steps": list(MISUSE_STEPS), "fail_rank": FAIL_RANK, "fail_step": FAIL_STEP,
                   "capture_token": CAPTURE_TOKEN}
            self.procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], stdout=out,
                                               stderr=err, stdin=subprocess.DEVNULL, env=env))

    def stderr(self, rank: int) -> str:
        return (self.workdir / f"rank-{rank}.err").read_text(errors="replace")

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise AssertionError(f"rank {rank} exited early ({proc.returncode}):\n{self.stderr(rank)[-3000:]}")

    def endpoints(self, timeout_s: float = 90.0) -> list[str]:
        """host:port of every rank's /metrics, once all ranks have initialised steptrace."""
        files = [self.workdir / f"endpoint-{rank}" for rank in range(WORLD)]
        deadline = time.monotonic() + timeout_s
        while not all(f.exists() for f in files):
            self.check_alive()
            assert time.monotonic() < deadline, "the ranks did not start in time"
            time.sleep(0.05)
        urls = [f.read_text() for f in files]
        assert all(u.startswith("http://127.0.0.1:") and u.endswith("/metrics") for u in urls), urls
        return [u.split("//", 1)[1].split("/", 1)[0] for u in urls]

    def go(self) -> None:
        self.barrier.go()

    def finish(self, timeout_s: float = 30.0) -> list[dict]:
        """Stop the loops; the summary line of each rank (all must exit 0)."""
        self.barrier.stop()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
        summaries = []
        for rank, proc in enumerate(self.procs):
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{self.stderr(rank)[-3000:]}"
            stderr = self.stderr(rank)
            assert "Traceback" not in stderr and "Failed to export" not in stderr, stderr[-3000:]
            lines = (self.workdir / f"rank-{rank}.out").read_text().strip().splitlines()
            summaries.append(json.loads(lines[-1]))
        return summaries

    def kill(self) -> None:
        """Terminate, then kill, whatever is still running; close the logs."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.barrier.close()
        for log in self.logs:
            log.close()


def wait_until(server: PrometheusServer, ranks: Ranks, promql: str, predicate, what: str,
               timeout_s: float = 60.0) -> list:
    """Poll ``promql`` until ``predicate(vector)``; fail early, with the rank's stderr, if a rank died."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        ranks.check_alive()
        seen = server.vector(promql)
        if predicate(seen):
            return seen
        time.sleep(0.25)
    pytest.fail(f"{what}: {promql} never satisfied the condition in {timeout_s} s (last: {seen}); "
                f"prometheus log:\n{server.log_tail()}")


def finite(body: dict) -> bool:
    """Whether a successful /api/v1/query answer holds at least one finite sample."""
    data = body["data"]
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return any(math.isfinite(float(r["value"][1])) for r in data["result"])


def dashboard_query(expr: str) -> str:
    """``expr`` as Grafana sends it for this run with every rank selected (``$rank`` = ``.*``)."""
    return substitute(expr.replace("$run_id", RUN_ID))


def panel_query(dashboard: str, title: str) -> str:
    """The first query of the panel ``title`` (a per-rank panel's top-k ranks), as Grafana sends it."""
    expr, *_ = [e for name, t, e in all_queries() if name == dashboard and t == title]
    return dashboard_query(expr)


def variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, selector, label) of every ``label_values(selector, label)`` variable."""
    out = []
    for name in FILES:
        for variable in load(name)["templating"]["list"]:
            if variable["type"] == "datasource":
                continue  # its query is a data source type ("prometheus"), not PromQL
            query = variable["query"]
            assert query.startswith("label_values(") and query.endswith(")"), (name, variable["name"], query)
            selector, label = query[len("label_values("):-1].rsplit(",", 1)
            out.append((name, variable["name"], dashboard_query(selector.strip()), label.strip()))
    return out


def test_every_dashboard_query_returns_data_from_a_real_jax_run_and_the_slow_rank_is_the_straggler(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` server binary is not installed (Debian package `prometheus`; "
                    ".ci/run installs it)")
    if importlib.util.find_spec("jax") is None:
        pytest.skip("the ranks train with JAX on the CPU: pip install 'steptrace[jax]'")

    started = time.monotonic()
    run_dir = tmp_path / "runs"
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    rules = load_yaml(RULES_YML)
    for group in rules["groups"]:
        group["interval"] = "1s"   # the shipped 30 s would make the test wait minutes
    rules_path = prom_dir / "rules.yml"
    rules_path.write_text(yaml.safe_dump(rules, sort_keys=False))

    collector = ranks = server = None
    passed = False
    try:
        collector = CollectorProcess(run_dir, WORLD, window_s=10.0)
        ranks = Ranks(tmp_path, f"http://127.0.0.1:{collector.port}", run_dir)
        rank_targets = ranks.endpoints()
        # What live_config reads from a run: the scrape targets of the ranks and of the collectors.
        targets = types.SimpleNamespace(rank_targets=lambda: rank_targets,
                                        collector_targets=lambda: [f"127.0.0.1:{collector.metrics_port}"])
        server = PrometheusServer(binary, live_config(targets, rules_path), prom_dir)
        if not server.wait_ready():
            pytest.fail(f"the Prometheus server at {binary} did not start:\n{server.log_tail()}")

        # Every rank's series and the collector scraped once before training starts, so the run's counters
        # are seen from 0 and every increase() covers the whole run.
        wait_until(server, ranks, f'count by (rank) (steptrace_steps_total{{job="steptrace", {RANK_SELECTOR}}})',
                   lambda v: len(v) == WORLD, "every rank scraped")
        wait_until(server, ranks, 'up{job="steptrace-collector"} == 1', lambda v: len(v) == 1, "collector scraped")
        ranks.go()
        # A client sending garbage: the collector refuses it (400) and counts it; training is unaffected.
        status, _, _ = post(collector.port, "/v1/traces", b"\x0a\xff\xff\xff not OTLP", PROTOBUF)
        assert status == 400
        # Someone asks the slow rank for a profiler trace over HTTP, on its /metrics port ("Profiler captures").
        host, port = rank_targets[CAPTURE_RANK].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/steptrace/capture", body=json.dumps({"reason": "e2e"}),
                     headers={"Authorization": f"Bearer {CAPTURE_TOKEN}", "Content-Type": "application/json"})
        answer = conn.getresponse()
        assert (answer.status, json.loads(answer.read())) == (202, {"armed": True})
        conn.close()

        wait_until(server, ranks, f"min(steptrace_last_step{{{RANK_SELECTOR}}})", lambda v: v and v[0][1] >= MIN_STEPS,
                   f"every rank past step {MIN_STEPS}", timeout_s=90)
        wait_until(server, ranks, f"max(steptrace_cluster_last_complete_step{{{RANK_SELECTOR}}})",
                   lambda v: v and v[0][1] >= MIN_STEPS - 5, "the collector joining the ranks' steps")
        wait_until(server, ranks, f'sum by (rank) (steptrace_captures_total{{{RANK_SELECTOR}, status="ok"}}) > 0',
                   lambda v: [(m["rank"], x) for m, x in v] == [(str(CAPTURE_RANK), 1.0)], "the trace taken")
        # Every recording rule evaluated on what has been scraped so far.
        server.wait_for_rule_evaluation(after=time.time())

        # -- every panel query and every variable query, through the HTTP API, returns data ------------------
        pending = {(name, title, expr): dashboard_query(expr) for name, title, expr in all_queries()}
        assert len(pending) > 50, len(pending)
        results: dict[tuple[str, str, str], dict] = {}
        deadline = time.monotonic() + 10
        rounds = 0
        while True:  # a query whose data lands with the next scrape or rule evaluation gets a few seconds more
            rounds += 1
            for key, promql in pending.items():
                results[key] = server.query(promql)
            pending = {k: q for k, q in pending.items()
                       if results[k]["status"] != "success" or not finite(results[k])}
            if not pending or time.monotonic() > deadline:
                break
            ranks.check_alive()
            time.sleep(1)
        errors = [f"{n} / {t}: {results[(n, t, e)].get('error')}\n    {e}" for n, t, e in pending
                  if results[(n, t, e)]["status"] != "success"]
        empty = [f"{n} / {t}: {results[(n, t, e)]['data']['result']}\n    {e}" for n, t, e in pending
                 if results[(n, t, e)]["status"] == "success" and not any(x in e for x in NOT_FILLED_BY_THIS_RUN)]
        assert not errors, "queries that failed:\n" + "\n".join(errors)
        assert not empty, "queries without finite data:\n" + "\n".join(empty)

        for name, variable, selector, label in variable_queries():
            body = server.api(f"/api/v1/label/{label}/values", {"match[]": selector})
            assert body["status"] == "success", (name, variable, body)
            expected = {"run_id": [RUN_ID], "rank": [str(r) for r in range(WORLD)]}[label]
            assert body["data"] == expected, (name, variable, selector, body["data"])
            body = server.query(selector)
            assert body["status"] == "success" and body["data"]["result"], (name, variable, selector, body)

        # The data is this run's: every rank, both stages, both kinds, blocking and async saves, the failure.
        assert set(server.values(dashboard_query(
            'count by (rank) (steptrace_info{run_id="$run_id", backend="jax"})'), "rank")) == {"0", "1", "2"}
        assert set(server.values(dashboard_query(
            'avg by (stage) (steptrace_pipeline_bubble_ratio{run_id="$run_id"})'), "stage")) == {"0", "1"}
        assert {(m["kind"], m["stage"]) for m, _ in server.vector(
            f"run_id_kind_stage_chunk:steptrace_microbatch_seconds:mean_rate5m{{{RANK_SELECTOR}}}")} == {
            (k, s) for k in ("forward", "backward") for s in ("0", "1")}
        assert set(server.values(f"steptrace_checkpoint_async_seconds_count{{{RANK_SELECTOR}}}", "rank")) == {
            "0", "1", "2"}
        assert server.values(f'sum by (rank) (steptrace_steps_total{{{RANK_SELECTOR}, status="error"}}) > 0',
                             "rank") == {str(FAIL_RANK): 1}
        # Every rank exports its drop counters (at 0 until something drops); only the misusing rank drops.
        assert set(server.values(f"sum by (rank) (steptrace_dropped_records_total{{{RANK_SELECTOR}}}) > 0",
                                 "rank")) == {str(MISUSE_RANK)}
        down = server.values(dashboard_query(
            'sum by (job) (1 - up{job=~"steptrace|steptrace-collector|otelcol"})'), "job")
        assert down == {"steptrace": 0, "steptrace-collector": 0, "otelcol": 1}

        # -- the slowed rank is the straggler, through Prometheus's API ----------------------------------
        def instant(promql: str, at: float) -> list[tuple[dict, float]]:
            body = server.api("/api/v1/query", {"query": promql, "time": f"{at:.3f}"}, post=True)
            assert body["status"] == "success" and body["data"]["result"], (promql, body)
            return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

        # The gauge names the straggler of one step, the last complete one. On two shared cores a fast rank
        # is now and then descheduled for longer than rank 2's extra work (a few percent of the steps
        # here, more on a loaded machine: rank 2 cleared the noise in 22 of 60 steps), so a single step
        # can name another rank or none: look for up to 15 s for an evaluation at which it names rank 2.
        # The gauge is a step's fact, checked against that step's record in cluster.jsonl below; the
        # verdict, rank 2, is the counters' and the top-stragglers panel's, which must say it at once.
        deadline = time.monotonic() + 15
        while True:
            at = time.time()  # one evaluation time: the gauges and counters come from the same scrape
            [(_, straggler)] = instant(f"steptrace_cluster_straggler_rank{{{RANK_SELECTOR}}}", at)
            [(_, panel_straggler)] = instant(panel_query("steptrace-cluster.json", "Straggler rank"), at)
            [(_, last_complete)] = instant(f"steptrace_cluster_last_complete_step{{{RANK_SELECTOR}}}", at)
            if straggler == SLOW_RANK or time.monotonic() > deadline:
                break
            ranks.check_alive()
            time.sleep(0.5)
        assert straggler == panel_straggler, (straggler, panel_straggler, last_complete)
        counts = {m["rank"]: v for m, v in instant(
            f"steptrace_cluster_straggler_steps_total{{{RANK_SELECTOR}}}", at)}
        assert max(counts, key=counts.get) == str(SLOW_RANK), counts
        assert counts[str(SLOW_RANK)] > sum(counts.values()) / 2, counts
        top = instant(panel_query("steptrace-cluster.json", "Top stragglers, time range"), at)
        assert max(top, key=lambda mv: mv[1])[0]["rank"] == str(SLOW_RANK), top
        # The ranks' own metrics agree: rank 2's mean compute is the furthest above the median rank's.
        ratio = {m["rank"]: v for m, v in instant(panel_query(
            "steptrace-cluster.json", "Compute relative to the median rank (5m)"), at)}
        assert max(ratio, key=ratio.get) == str(SLOW_RANK) and ratio[str(SLOW_RANK)] > 1.2, ratio
        evaluated = time.monotonic() - started
        passed = True
    finally:
        summaries = None
        if ranks is not None:
            try:
                if passed:  # on a failure, keep its message: just end the processes
                    summaries = ranks.finish()
            finally:
                ranks.kill()
        if server is not None:
            server.stop()   # terminate, then kill
        collector_exit = None
        if collector is not None:
            try:
                collector_exit = collector.stop()   # SIGTERM: it flushes open steps to cluster.jsonl
            finally:
                if collector.proc.poll() is None:
                    collector.proc.kill()
                    collector.proc.wait(10)

    # -- the collector's cluster.jsonl agrees ---------------------------------------------------------------
    assert summaries is not None and collector_exit == 0, collector_exit
    steps = summaries[0]["steps"]
    assert steps >= MIN_STEPS and all(s["steps"] == steps and s["shutdown_ok"] for s in summaries), summaries
    # What each rank dropped (its JSONL run record): only the deliberate misuse.
    run_records = [[r for r in read_records(run_dir / RUN_ID / f"rank-{rank}.jsonl") if r["type"] == "run"]
                   for rank in range(WORLD)]
    assert [[r["dropped"] for r in rr] for rr in run_records] == [[{"misuse": len(MISUSE_STEPS)}], [{}], [{}]]
    # The HTTP request's trace: one capture, on the rank asked, of two steps, naming who asked.
    captures = [[r for r in read_records(run_dir / RUN_ID / f"rank-{rank}.jsonl") if r["type"] == "capture"]
                for rank in range(WORLD)]
    assert [len(c) for c in captures] == [int(rank == CAPTURE_RANK) for rank in range(WORLD)], captures
    (capture,) = captures[CAPTURE_RANK]
    assert (capture["status"], capture["trigger"], capture["profiler"]) == ("ok", "request", "jax"), capture
    assert capture["reason"] == "HTTP request from 127.0.0.1: e2e" and capture["last_step"] == capture["first_step"] + 1
    assert glob.glob(os.path.join(capture["path"], "**", "*.xplane.pb"), recursive=True), capture["path"]
    # In lockstep every step is joined whole: none incomplete, no late spans.
    records = read_records(run_dir / RUN_ID / "cluster.jsonl")
    assert [r["step"] for r in records if r["type"] == "cluster_step"] == list(range(steps)), records[-3:]
    assert all(r["type"] == "cluster_step" and r["complete"] for r in records), [
        (r["type"], r["step"], r.get("reason")) for r in records if r["type"] != "cluster_step" or not r["complete"]]
    straggler_of = {r["step"]: str(r["straggler_rank"]) for r in records}
    # The step the gauge described names the same rank in the log (-1 on the gauge: none stood out), and
    # the counter Prometheus scraped is the log's count over the steps up to that one.
    assert straggler_of[int(last_complete)] == ("None" if straggler == -1 else str(int(straggler))), \
        (straggler, records[int(last_complete)])
    # A step where no rank stood out names none ("None"), and counts for no rank.
    upto = collections.Counter(rank for step, rank in straggler_of.items()
                               if step <= last_complete and rank != "None")
    assert upto == {rank: int(v) for rank, v in counts.items() if v}, (upto, counts)
    overall = collections.Counter(straggler_of.values())
    # Since issue 33 a step names a rank only above the run's own noise: on a loaded 2-core machine the
    # 3x rank cleared it in 22 of 60 steps (in lockstep, without a measured wait, ranks are compared by
    # compute). Every step that names a rank names the slow one, but for a stray one in ten.
    named = collections.Counter({rank: n for rank, n in overall.items() if rank != "None"})
    assert named.most_common(1)[0][0] == str(SLOW_RANK) and named[str(SLOW_RANK)] >= 0.9 * sum(named.values()), \
        overall
    print(f"dashboards read {evaluated:.1f} s after start, in {rounds} round(s); {steps} steps joined; "
          f"stragglers {dict(overall)}")
