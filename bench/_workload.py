"""Shared pieces of the JAX CPU benchmarks (bench_accuracy.py, bench_throughput.py).

The workload is one jitted function whose amount of work is a *runtime*
argument, so light and heavy steps share one compiled executable::

    step_fn(x, w, reps) = fori_loop(0, reps, lambda i, x: cos(x @ w), x), mean(result)

with ``x, w`` 256x256 float32 and ``reps`` a traced int32 scalar. One
repetition is one 256x256 matmul plus an elementwise ``cos`` (values stay in
[-1, 1], so there are no denormals or overflows to change the speed).
Steps are chained (step n consumes step n-1's ``x``), so the device executes
them strictly in order, like the steps of a training run.
"""

from __future__ import annotations

import http.server
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

perf = time.perf_counter

N = 256

SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"


def configure_xla() -> str:
    """Make the JAX CPU "device" a single core. Call before importing jax.

    On a 2-core machine a multi-threaded XLA CPU executable shares both cores with the host
    threads (the training thread, steptrace's resolver) and with whatever else runs there; a
    256x256 matmul step then takes 1x or 2x its time depending on whether the other core is
    free (measured here: bimodal 27 ms / 55 ms). One XLA thread models an accelerator better (the
    device does not compete with the host for cores) and makes step times far more stable.
    Set ``STEPTRACE_BENCH_XLA_MULTITHREAD=1`` to keep XLA's default.
    """
    if os.environ.get("STEPTRACE_BENCH_XLA_MULTITHREAD") == "1" or "jax" in sys.modules:
        return os.environ.get("XLA_FLAGS", "")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        flags = (flags + " " + SINGLE_THREAD_XLA).strip()
        os.environ["XLA_FLAGS"] = flags
    return flags


def make_step_fn() -> Any:
    """A fresh jitted step function. Each call returns a new function object, so
    its first call compiles again (that is how step 0 of a run gets its compile)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def train_step(x, w, reps):
        def body(_i, x):
            return jnp.cos(x @ w)

        x = lax.fori_loop(0, reps, body, x)
        return x, jnp.mean(x)

    return jax.jit(train_step)


def make_inputs() -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (N, N), jnp.float32)
    w = jax.random.normal(kw, (N, N), jnp.float32) / (N ** 0.5)
    jax.block_until_ready((x, w))
    return x, w


def reps_arg(reps: int) -> Any:
    """The runtime ``reps`` argument as a committed int32 device scalar (no recompile per value)."""
    import jax
    import jax.numpy as jnp

    r = jnp.asarray(reps, dtype=jnp.int32)
    jax.block_until_ready(r)
    return r


def isolated_seconds(fn: Any, x: Any, w: Any, reps: Any) -> float:
    """One step run alone on an idle device: dispatch + ``block_until_ready``, host clock around both."""
    import jax

    t0 = perf()
    out = fn(x, w, reps)
    jax.block_until_ready(out)
    return perf() - t0


def calibrate(fn: Any, x: Any, w: Any, target_s: float, trials: int = 3) -> tuple[int, float]:
    """``reps`` such that one step takes about ``target_s`` on this machine, and seconds per rep."""
    probe = 8
    r = reps_arg(probe)
    isolated_seconds(fn, x, w, r)  # warm-up / compile
    per_rep = statistics.median(isolated_seconds(fn, x, w, r) for _ in range(trials)) / probe
    reps = max(1, round(target_s / per_rep))
    # One refinement at the real size (the per-rep cost is not perfectly linear).
    r = reps_arg(reps)
    t = statistics.median(isolated_seconds(fn, x, w, r) for _ in range(trials))
    per_rep = t / reps
    return max(1, round(target_s / per_rep)), per_rep


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return ordered[k]


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "processor": platform.processor(),
        "machine": platform.machine(),
        "cpu_model": cpu,
        "python": platform.python_version(),
    }
    for mod in ("jax", "jaxlib", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        info["git_head"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, timeout=5, cwd=here).stdout.strip()
        # The core is edited concurrently: say whether the measured code differs from HEAD.
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "steptrace", "adapters"],
                               capture_output=True, text=True, timeout=5, cwd=os.path.dirname(here)).stdout
        if dirty.strip():
            info["git_head"] += "+dirty"
    except Exception:
        pass
    return info


def header(title: str) -> str:
    i = machine_info()
    return (f"{title}\n"
            f"  {i['date_utc']}  nproc={i['nproc']}  cpu={i['cpu_model'] or '?'} ({i['machine']})  "
            f"python {i['python']}" + (f"  jax {i['jax']}" if "jax" in i else "")
            + (f"  git {i['git_head']}" if i.get("git_head") else ""))


def fmt_table(headers: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """Plain-text table; ``align`` is one char per column ('l' or 'r', default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))
    out = []
    for j, row in enumerate(cells):
        parts = [c.ljust(widths[i]) if align[i] == "l" else c.rjust(widths[i]) for i, c in enumerate(row)]
        out.append("  ".join(parts).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class AcceptOtlp(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that answers every POST 200 with an empty (valid) protobuf response.

    Subclass it per use: ``requests`` counts the requests; set ``bodies`` to a list to also
    keep each request's ``(path, body)``.
    """

    requests = 0
    bodies: list[tuple[str, bytes]] | None = None

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).requests += 1
        if self.bodies is not None:
            self.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class ListSink:
    """A steptrace sink that keeps every record in ``records`` (a bench reads them after shutdown)."""

    def __init__(self, records: list[dict] | None = None) -> None:
        self.records: list[dict] = [] if records is None else records

    def export(self, batch: Any) -> None:
        self.records.extend(batch)

    def force_flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        pass
