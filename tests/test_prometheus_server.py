"""End to end: a real Prometheus server scrapes a real JAX training loop's /metrics.

Needs the `prometheus` binary (Debian package `prometheus`; .ci/run installs it) and JAX;
skips with the reason when either is missing or the server cannot start.
"""

import bisect
import json
import shutil
import statistics
import time

import pytest

pytest.importorskip("prometheus_client", reason="the Prometheus exporter needs `pip install 'steptrace[prometheus]'`")
jax = pytest.importorskip("jax", reason="the end-to-end test trains with JAX: `pip install steptrace[jax]`")
jnp = pytest.importorskip("jax.numpy")

import steptrace  # noqa: E402
from prometheus_server import PrometheusProcess  # noqa: E402
from steptrace._buckets import STEP_BUCKETS_S as SECONDS_BUCKETS  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 20
RUN_ID = "prom-e2e"


class PrometheusServer(PrometheusProcess):
    """A Prometheus server on 127.0.0.1 scraping ``target`` every second, with exemplar storage."""

    def __init__(self, binary, target, tmp_path):
        super().__init__(binary, (
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: steptrace\n"
            "    scrape_interval: 1s\n"
            "    scrape_timeout: 1s\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"), tmp_path)

    def query(self, promql):
        """The instant vector of ``promql``: a list of (labels, float value)."""
        body = self.api("/api/v1/query", {"query": promql})
        assert body["status"] == "success", body
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def scalar(self, promql):
        result = self.query(promql)
        return result[0][1] if len(result) == 1 else None

    def wait_for(self, promql, expected, timeout_s=15.0):
        """Poll until ``promql`` evaluates to ``expected`` (a scrape after the run's final values)."""
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            seen = self.scalar(promql)
            if seen == expected:
                return
            time.sleep(0.2)
        pytest.fail(f"{promql} was {seen}, expected {expected}, after {timeout_s} s; log:\n{self.log_tail()}")

    def exemplars(self, metric, start, end):
        body = self.api("/api/v1/query_exemplars", {"query": metric, "start": start, "end": end})
        assert body["status"] == "success", body
        return [e for series in body["data"] for e in series["exemplars"]]


@pytest.fixture
def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` server binary is not installed (Debian package `prometheus`; .ci/run "
                    "installs it)")
    return binary


@jax.jit
def train_step(w, x):
    """A small matmul 'training step': real asynchronous dispatch on the CPU backend."""
    y = jnp.tanh(x @ w)
    return w - 0.01 * (x.T @ y) / x.shape[0], jnp.mean(y * y)


def bucket_index(seconds):
    """Index of the histogram bucket that holds ``seconds`` (le = SECONDS_BUCKETS[i], or +Inf)."""
    return bisect.bisect_left(SECONDS_BUCKETS, seconds)


def test_a_real_prometheus_scrapes_a_jax_run(prometheus_binary, tmp_path):
    # prometheus_histograms: this test reads the buckets and their exemplars (off by default).
    steptrace.init(prometheus_port=0, run_dir=str(tmp_path / "runs"), run_id=RUN_ID, prometheus_histograms=True)
    endpoint = steptrace.stats()["endpoints"]["prometheus"]
    target = endpoint.split("//")[1].split("/")[0]
    server = PrometheusServer(prometheus_binary, target, tmp_path)
    try:
        if not server.wait_ready():
            pytest.skip(f"the Prometheus server at {prometheus_binary} did not start:\n{server.log_tail()}")
        started = time.time()

        key = jax.random.PRNGKey(0)
        w = jax.random.normal(key, (512, 512), jnp.float32) * 0.01
        x = jax.random.normal(key, (256, 512), jnp.float32)
        for n in range(STEPS):
            with steptrace.step(n, tokens=256) as s:
                w, loss = train_step(w, x)
                s.wait_for(loss)
        assert steptrace.flush(10)
        records = [json.loads(line) for line in (tmp_path / "runs" / RUN_ID / "rank-0.jsonl").read_text().splitlines()]
        steps = [r for r in records if r["type"] == "step"]
        assert len(steps) == STEPS

        selector = f'{{job="steptrace", run_id="{RUN_ID}", rank="0"}}'
        # Counters reach their final values only in a scrape after the flush: wait for it.
        server.wait_for(f"sum(steptrace_steps_total{selector})", STEPS)
        server.wait_for(f"sum(steptrace_step_compute_seconds_count{selector})", STEPS)
        assert server.scalar('up{job="steptrace"}') == 1
        assert server.scalar(f"steptrace_last_step{selector}") == STEPS - 1
        assert server.scalar(f"steptrace_tokens_total{selector}") == 256 * STEPS

        median = server.scalar(
            f"histogram_quantile(0.5, sum by (le) (steptrace_step_compute_seconds_bucket{selector}))")
        true_median = statistics.median(r["compute_seconds"] for r in steps)
        assert median is not None
        # histogram_quantile interpolates inside a bucket: it can only be as good as the buckets.
        assert abs(bucket_index(median) - bucket_index(true_median)) <= 1, (median, true_median)

        # Prometheus negotiated OpenMetrics, so it stored the trace ids as exemplars.
        exemplars = server.exemplars(f"steptrace_step_compute_seconds_bucket{selector}", started - 5,
                                     time.time() + 5)
        trace_ids = {r["trace_id"] for r in steps}
        assert exemplars and {e["labels"]["trace_id"] for e in exemplars} <= trace_ids
    finally:
        server.stop()
        steptrace.shutdown()
