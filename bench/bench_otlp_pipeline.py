"""Background CPU and wire bytes of the OTLP exporter per pipeline-parallel step.

Usage::

    .venv/bin/python bench/bench_otlp_pipeline.py            # 5 rounds x 40 steps per variant
    .venv/bin/python bench/bench_otlp_pipeline.py --quick    # 3 rounds x 15

What is timed
-------------
One real pipeline step is recorded through the public API (``steptrace.microbatch`` on a
:class:`steptrace.testing.SimulatedDevice`: 32 microbatches x 4 chunks x forward/backward = 256
microbatch records, plus the step record), then its records are replayed, step after step with
the step number changed, into :meth:`steptrace.otlp.OtlpSink.export`: the work the sink's
thread does per step (building spans and metrics, protobuf encoding, compression, the HTTP
request to an in-process receiver on 127.0.0.1 that reads the body and answers 200).
**cpu ms/step** is ``time.thread_time()`` of the exporting thread per step (the receiver's
thread is not counted); **wire KB/step** the request bodies the receiver read, traces only.

Variants, interleaved within each round:

* ``before``  ``otlp_microbatch_spans="all"``, ``otlp_compression="none"`` (the old defaults)
* ``spans+gzip``  ``all``, ``gzip``
* ``after``   ``none`` (a summary on the step span), ``gzip`` (the new defaults)
* ``summary, none``  ``none``, no compression
* ``after, batched``  the new defaults, records handed over as the SinkWorker does at 10 steps/s
  with ``otlp_batch_delay_s=0.5``: 5 steps gather, sent as batches of at most 1,024 records (one
  request per batch; the other variants send one request per step, as at 1 step/s)

The receiver answers HTTP/1.1 with keep-alive, as the steptrace collector and the OpenTelemetry
Collector do (an HTTP/1.0 receiver costs a TCP connection per request, ~0.3 ms here).
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl  # noqa: E402

import steptrace  # noqa: E402
from steptrace._sinks import _BATCH_RECORDS  # noqa: E402
from steptrace.otlp import OtlpSink  # noqa: E402
from steptrace.testing import MemorySink, SimulatedDevice  # noqa: E402

MICROBATCHES, CHUNKS = 32, 4
VARIANTS = (("before", "all", "none", 1), ("spans+gzip", "all", "gzip", 1),
            ("after", "none", "gzip", 1), ("summary, none", "none", "none", 1), ("after, batched", "none", "gzip", 5))


class _Count(wl.AcceptOtlp):
    protocol_version = "HTTP/1.1"  # keep-alive, as the steptrace collector and otelcol answer
    bodies: list[tuple[str, bytes]] | None = []


def one_pipeline_step() -> list[dict]:
    """The records of one real pipeline step (microbatches first, then the step), from the public API."""
    memory = MemorySink()
    device = SimulatedDevice(report_end_times=True)
    steptrace.init(sinks=[memory], jsonl=False, run_id="bench", stall_watch=False)
    for n in range(2):
        with steptrace.step(n) as s:
            for kind in ("forward", "backward"):
                for chunk in range(CHUNKS):
                    for i in range(MICROBATCHES):
                        with steptrace.microbatch(i, stage=0, chunk=chunk, kind=kind) as mb:
                            mb.wait_for(device.run(0.0001))
            s.wait_for(device.run(0.0005))
    assert steptrace.shutdown(timeout_s=30)
    records = [r for r in memory.records if r.get("step") == 1 and r["type"] in ("microbatch", "step")]
    assert len(records) == MICROBATCHES * CHUNKS * 2 + 1, len(records)
    return sorted(records, key=lambda r: r["type"] == "step")  # microbatches, then their step


def run_variant(url: str, records: list[dict], steps: int, spans: str, compression: str,
                first_step: int, steps_gathered: int = 1) -> tuple[float, float]:
    sink = OtlpSink(url, run_id="bench", microbatch_spans=spans, compression=compression,
                    metrics_interval_s=3600)
    try:
        per_step = [[{**r, "step": n} for r in records] for n in range(first_step, first_step + steps)]
        batches = []
        for k in range(0, steps, steps_gathered):  # what gathered, cut as the SinkWorker cuts it
            gathered = [r for step_records in per_step[k:k + steps_gathered] for r in step_records]
            batches += [gathered[i:i + _BATCH_RECORDS] for i in range(0, len(gathered), _BATCH_RECORDS)]
        assert _Count.bodies is not None
        _Count.bodies.clear()
        start = time.thread_time()
        for batch in batches:
            sink.export(batch)
        cpu = time.thread_time() - start
        wire = sum(len(body) for path, body in _Count.bodies if path.endswith("/v1/traces"))
    finally:
        sink.shutdown(5)
    return cpu / steps * 1e3, wire / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, steps = (3, 15) if args.quick else (5, 40)
    records = one_pipeline_step()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cpu: dict[str, list[float]] = {name: [] for name, *_ in VARIANTS}
    wire: dict[str, float] = {}
    step = 0
    for _ in range(rounds):
        for name, spans, compression, gathered in VARIANTS:
            ms, kb = run_variant(url, records, steps, spans, compression, step, gathered)
            step += steps
            cpu[name].append(ms)
            wire[name] = kb
    server.shutdown()
    print(wl.header(f"OTLP export per pipeline step ({MICROBATCHES} microbatches x {CHUNKS} chunks x 2 kinds, "
                    f"{rounds} rounds x {steps} steps)"))
    before = statistics.median(cpu["before"])
    rows = [[name, f"{statistics.median(cpu[name]):.2f}", f"{min(cpu[name]):.2f}..{max(cpu[name]):.2f}",
             f"{statistics.median(cpu[name]) / before:.3f}", f"{wire[name]:.1f}"] for name, *_ in VARIANTS]
    print(wl.fmt_table(["variant", "cpu ms/step", "range", "x before", "wire KB/step"], rows))


if __name__ == "__main__":
    main()
