"""What a hard exit loses over OTLP: steps delivered when a rank dies at step 40 without shutdown.

Usage::

    .venv/bin/python bench/otlp_hard_exit.py            # 5 trials per case
    .venv/bin/python bench/otlp_hard_exit.py --quick    # 2 trials
    .venv/bin/python bench/otlp_hard_exit.py --json out.json

What is measured
----------------
A rank process runs 40 steps of ``--step-ms`` (20 ms of host sleep each) with JSONL on and OTLP to
a receiver on 127.0.0.1 (OTLP/HTTP, default settings: ``otlp_batch_delay_s=0.5``), then dies without
``steptrace.shutdown()``: ``os._exit(0)`` right after step 40's block, or SIGKILL from this script
once the rank says it finished step 40. Counted: distinct ``train.step`` spans the receiver got,
and step records in the rank's JSONL file. Cases:

* ``no checkpoint``: the loop alone (issue 32 #8 saw 22 and 24 of 40 over OTLP, 40 in JSONL);
* ``checkpoint every 10, not at 39``: ``steptrace.checkpoint(n)`` (a 20 ms save) after steps 9, 19
  and 29, each of which sends the OTLP batch at once (``OtlpSink.flush_at``): the steps after the
  last checkpoint are what the hard exit costs;
* ``checkpoint at 39, dies at once``: checkpoints after 9, 19, 29 and 39, and the exit right after
  the last one: what is still on its way (the resolver, the sink's thread, the request) is lost;
* ``checkpoint at 39, dies 100 ms on``: the same, the exit 100 ms after the last checkpoint (a killed
  job dies during the steps after a save, not within microseconds of it);
* ``stall``: step 39 hangs (the stall watch at ``stall_min_s=0.5``, ``stall_factor=1``) and is
  killed 50 ms after its stall record reached the JSONL file (SIGKILL only), as a launcher that
  acts on the stall would: the steps before it went out while it hung; the stall record itself
  (``train.stall``, the column ``stall``) is what the boundary sends.

A trial's numbers depend on how long the export in flight takes against how soon the process dies,
so they vary from trial to trial; min / median / max are printed.
"""

from __future__ import annotations

import argparse
import gzip
import http.server
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib

RANK = r'''
import os, sys, time
import steptrace
endpoint, run_dir, case, exit_mode, step_s, done = sys.argv[1:7]
step_s = float(step_s)
last_checkpoint = 39 if case.startswith("checkpoint at 39") else 29 if case.startswith("checkpoint") else -1
steptrace.init(run_id="hardexit", jsonl=True, run_dir=run_dir, otlp_endpoint=endpoint, otlp_metrics_interval_s=3600,
               stall_min_s=0.5, stall_factor=1.0)
for n in range(40):
    with steptrace.step(n):
        time.sleep(3600 if case == "stall" and n == 39 else step_s)
    if n % 10 == 9 and n <= last_checkpoint:
        with steptrace.checkpoint(n):
            time.sleep(0.02)
if case.endswith("100 ms on"):
    time.sleep(0.1)
if exit_mode == "os._exit":
    os._exit(0)
open(done, "w").close()
time.sleep(3600)
'''

CASES = ("no checkpoint", "checkpoint every 10, not at 39", "checkpoint at 39, dies at once",
         "checkpoint at 39, dies 100 ms on", "stall")


class _Receiver(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    steps: set[int] = set()
    stalls = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - the http.server method name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        elif self.headers.get("Content-Encoding") == "deflate":
            body = zlib.decompress(body)
        if self.path.endswith("/v1/traces"):
            request = ExportTraceServiceRequest.FromString(body)
            with self.lock:
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            if span.name == "train.step":
                                step = next(kv.value.int_value for kv in span.attributes if kv.key == "train.step")
                                type(self).steps.add(step)
                            elif span.name == "train.stall":
                                type(self).stalls += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def trial(case: str, exit_mode: str, step_s: float) -> tuple[int, int, int]:
    """(steps the receiver got, steps in the JSONL file, stall spans received) for one rank dying at step 40."""
    _Receiver.steps, _Receiver.stalls = set(), 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory() as tmp:
        script, done = os.path.join(tmp, "rank.py"), os.path.join(tmp, "done")
        with open(script, "w") as handle:
            handle.write(RANK)
        proc = subprocess.Popen([sys.executable, script, f"http://127.0.0.1:{server.server_address[1]}",
                                 os.path.join(tmp, "runs"), case, exit_mode, str(step_s), done],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        if exit_mode == "SIGKILL":
            def ready() -> bool:
                if case == "stall":
                    path = os.path.join(tmp, "runs", "hardexit", "rank-0.jsonl")
                    return os.path.exists(path) and '"type":"stall"' in open(path).read()
                return os.path.exists(done)
            while not ready() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            if case == "stall":
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
        time.sleep(0.2)  # requests still being read by the receiver
        with open(os.path.join(tmp, "runs", "hardexit", "rank-0.jsonl")) as handle:
            jsonl = sum(1 for line in handle if json.loads(line).get("type") == "step")
    server.shutdown()
    server.server_close()
    return len(_Receiver.steps), jsonl, _Receiver.stalls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", default=None, help="comma-separated case numbers (1-based) to run")
    args = parser.parse_args()
    cases = [CASES[int(i) - 1] for i in args.cases.split(",")] if args.cases else list(CASES)
    trials = args.trials or (2 if args.quick else 5)
    results: dict[str, dict[str, list[tuple[int, int, int]]]] = {}
    for _ in range(trials):  # interleaved: the machine's load drifts
        for case in cases:
            for exit_mode in ("os._exit", "SIGKILL"):
                if case == "stall" and exit_mode == "os._exit":
                    continue
                results.setdefault(case, {}).setdefault(exit_mode, []).append(trial(case, exit_mode,
                                                                                    args.step_ms / 1000))
    print(f"OTLP steps delivered of 40 ({args.step_ms:g} ms steps, otlp_batch_delay_s=0.5, {trials} trials; "
          f"JSONL in brackets; the stall case runs 39 steps and hangs in the 40th)")
    print(f"{'case':34s} {'exit':9s} {'min':>5s} {'median':>7s} {'max':>5s}  {'jsonl':9s} stall")
    for case, by_exit in results.items():
        for exit_mode, got in by_exit.items():
            delivered = [d for d, _, _ in got]
            jsonl = sorted({j for _, j, _ in got})
            stalls = f"{sum(1 for *_, n in got if n)}/{len(got)}" if case == "stall" else ""
            print(f"{case:34s} {exit_mode:9s} {min(delivered):5d} {statistics.median(delivered):7g} "
                  f"{max(delivered):5d}  {str(jsonl):9s} {stalls}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"step_ms": args.step_ms, "trials": trials, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
