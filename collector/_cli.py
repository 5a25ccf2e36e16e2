"""``steptrace collector ...`` and ``python -m steptrace.collector ...``.

Only argparse is imported until the collector actually starts, so
``steptrace --help`` and ``steptrace report`` do not pay for protobuf,
prometheus_client or gRPC.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from steptrace._attribution import STRAGGLER_MIN_RATIO, STRAGGLER_MIN_SECONDS

__all__ = ["add_collector_arguments", "main", "run_collector"]

ENV_TOKEN = "STEPTRACE_COLLECTOR_TOKEN"  # the same constant as steptrace.collector._app.ENV_TOKEN

DESCRIPTION = ("Receive OTLP from every rank, join each step's spans across ranks (min/median/max, skew, the "
               "straggler rank, pipeline bubble), serve the result on /metrics and append it to "
               "<run-dir>/<run_id>/cluster.jsonl.")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def add_collector_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``collector`` arguments (shared by ``steptrace collector`` and ``python -m steptrace.collector``)."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind OTLP (and, unless --metrics-host, /metrics) on (default: 127.0.0.1; "
                             "0.0.0.0 to receive from other hosts)")
    parser.add_argument("--port", type=_port, default=4318, help="OTLP/HTTP port (default: 4318; 0: any free port)")
    parser.add_argument("--grpc-port", type=_port, default=None,
                        help="also serve OTLP/gRPC on this port (e.g. 4317; default: off)")
    parser.add_argument("--metrics-host", default=None, help="address for /metrics (default: --host)")
    parser.add_argument("--metrics-port", type=_port, default=9464,
                        help="Prometheus /metrics port (default: 9464; 0: any free port)")
    parser.add_argument("--world-size", type=_positive_int, default=None,
                        help="ranks per step; a step is complete when ranks 0..N-1 reported "
                             "(default: each step's train.world_size attribute)")
    parser.add_argument("--run-dir", default="steptrace-runs",
                        help="where <run_id>/cluster.jsonl is written (default: steptrace-runs)")
    parser.add_argument("--token-file", default=None,
                        help="accepted bearer tokens, one per line, each optionally followed by the run id globs it "
                             "may write ('TOKEN llama-*'); default: $" + ENV_TOKEN + ", else anyone may send")
    parser.add_argument("--token", default=None,
                        help="INSECURE (the token shows in the process list): one accepted bearer token; use "
                             "--token-file or $" + ENV_TOKEN)
    parser.add_argument("--metrics-token-file", default=None,
                        help="require a bearer token from this file on /metrics (default: open)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve OTLP/HTTP, gRPC and /metrics "
                                                          "over TLS only (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=16 << 20,
                        help="largest request body, compressed or not (default: 16 MiB)")
    parser.add_argument("--window-s", type=_seconds, default=10.0,
                        help="emit a step this long after its first span even if ranks are missing (default: 10)")
    parser.add_argument("--max-open-steps", type=_positive_int, default=4096,
                        help="steps waiting for ranks at once; beyond, the oldest is emitted early (default: 4096)")
    parser.add_argument("--goodput-window-steps", type=_positive_int, default=100,
                        help="steps in steptrace_cluster_compute_share_ratio's sliding window (default: 100)")
    parser.add_argument("--straggler-min-seconds", type=_non_negative_seconds, default=STRAGGLER_MIN_SECONDS,
                        help="a rank is named the straggler of a step when its time on its own exceeds the other "
                             "ranks' median by at least this much (default: %(default)s) ...")
    parser.add_argument("--straggler-min-ratio", type=_non_negative_seconds, default=STRAGGLER_MIN_RATIO,
                        help="... and by at least this fraction of the step's median interval, and by more than the "
                             "run's noise floor (default: %(default)s)")
    parser.add_argument("--straggler-window-steps", type=_positive_int, default=100,
                        help="complete steps of a run in its straggler noise floor, its persistent-straggler verdict "
                             "and the per-rank straggler scores (default: 100)")
    parser.add_argument("--straggler-score-ranks", type=_positive_int, default=10,
                        help="ranks per run and kind with a straggler score series on /metrics: the lowest "
                             "scores (default: 10)")
    parser.add_argument("--cluster-per-rank", action="store_true",
                        help="keep each rank's compute, interval, wait and time on its own in cluster_step "
                             "records (default: aggregates and the slowest ranks only)")
    parser.add_argument("--max-runs", type=_positive_int, default=64,
                        help="runs kept in /metrics at once; the least recently active is dropped (default: 64)")
    parser.add_argument("--max-runs-per-token", type=_positive_int, default=None,
                        help="runs one --token-file line may hold at once (default: --max-runs / 4)")
    parser.add_argument("--run-idle-s", type=_non_negative_seconds, default=300.0,
                        help="with --max-runs runs admitted, a new run replaces the least recently active one only "
                             "if it has no open step and was idle this long; else its spans are refused (default: 300)")
    parser.add_argument("--max-connections", type=_positive_int, default=16384,
                        help="OTLP/HTTP connections served at once, below what the file-descriptor limit allows "
                             "(docs/collector.md); more get 503 (default: 16384)")
    parser.add_argument("--max-connections-per-peer", type=_positive_int, default=128,
                        help="OTLP/HTTP connections from one IP address at once; more get 503 (default: 128)")
    parser.add_argument("--request-timeout-s", type=_seconds, default=30.0,
                        help="a whole request, headers included, must arrive within this time (default: 30)")
    parser.add_argument("--max-world-size", type=_positive_int, default=65536,
                        help="largest train.world_size and rank accepted (default: 65536)")
    parser.add_argument("--max-step", type=_positive_int, default=1 << 53,
                        help="largest step number accepted (default: 2**53)")
    parser.add_argument("--max-spans-per-request", type=_positive_int, default=16384,
                        help="spans (or metric points) in one request; more is 413 (default: 16384)")
    parser.add_argument("--max-emitted-steps", type=_positive_int, default=8192,
                        help="emitted steps remembered per run to tell late spans and retries apart (default: 8192)")
    parser.add_argument("--max-journal-bytes-per-run", type=_positive_int, default=64 << 20,
                        help="journal bytes of one run; beyond, its spans are answered 503 (default: 64 MiB)")
    parser.add_argument("--max-journal-bytes", type=_positive_int, default=1 << 30,
                        help="journal bytes of all runs together; beyond, spans are answered 503 (default: 1 GiB)")
    parser.add_argument("--max-inflight-body-bytes", type=_positive_int, default=256 << 20,
                        help="request body bytes held at once across all peers (a quarter of it per peer); beyond, "
                             "503 (default: 256 MiB)")
    parser.add_argument("--max-clock-skew-s", type=_seconds, default=300.0,
                        help="refuse step spans that end this far after the collector's clock (default: 300)")
    parser.add_argument("--max-span-age-s", type=_seconds, default=86400.0,
                        help="refuse step spans that ended this far before the collector's clock (default: 86400)")
    parser.add_argument("--no-journal", action="store_true",
                        help="do not journal open steps' spans (a killed collector then loses them)")
    parser.add_argument("--trackers", default="",
                        help="write each run's joined steps (min/median/max across ranks, the straggler and its "
                             "cost, the slowest ranks) to these trackers, comma-separated: tensorboard, mlflow, wandb "
                             "(docs/trackers.md; default: none)")
    parser.add_argument("--tensorboard-dir", default=None,
                        help="where the TensorBoard tracker writes <run_id>/... (default: "
                             "<run-dir>/<run_id>/tensorboard/cluster)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log level on stderr (default: INFO)")
    return parser


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (``M_ARENA_MAX``) for the collector process.

    glibc gives threads their own arenas (up to 8 per core) and the HTTP server runs a thread
    per connection, so memory freed after large requests (a 15 MiB body, a 100,000-span
    request) stays spread over many arenas: in ``bench/collector_soak.py`` the collector's RSS
    peaked at 400-550 MiB with the default and 140 MiB with two arenas. A no-op where
    ``MALLOC_ARENA_MAX`` is set or libc has no ``mallopt`` (e.g. macOS).
    """
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def run_collector(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code (2 for bad settings or a taken port)."""
    _limit_malloc_arenas()
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        from steptrace.collector._app import Collector, CollectorConfig
    except ImportError as exc:
        print(f"steptrace collector: {exc}", file=sys.stderr)
        return 2
    if args.token is not None:
        logging.getLogger("steptrace.collector").warning(
            "steptrace collector: --token puts the secret in the process list; use --token-file or $%s", ENV_TOKEN)
    token = args.token if args.token is not None else (
        os.environ.get(ENV_TOKEN) or None if args.token_file is None else None)
    try:
        config = CollectorConfig(
            host=args.host, port=args.port, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
            grpc_port=args.grpc_port, world_size=args.world_size, run_dir=args.run_dir, token=token,
            token_file=args.token_file, metrics_token_file=args.metrics_token_file, tls_cert=args.tls_cert,
            tls_key=args.tls_key, max_body_bytes=args.max_body_bytes, window_s=args.window_s,
            max_open_steps=args.max_open_steps, goodput_window_steps=args.goodput_window_steps,
            straggler_min_seconds=args.straggler_min_seconds, straggler_min_ratio=args.straggler_min_ratio,
            straggler_window_steps=args.straggler_window_steps, cluster_per_rank=args.cluster_per_rank,
            straggler_score_ranks=args.straggler_score_ranks,
            max_runs=args.max_runs, max_runs_per_token=args.max_runs_per_token, run_idle_s=args.run_idle_s,
            max_connections=args.max_connections,
            max_connections_per_peer=args.max_connections_per_peer, request_timeout_s=args.request_timeout_s,
            max_world_size=args.max_world_size, max_step=args.max_step,
            max_spans_per_request=args.max_spans_per_request, max_emitted_steps=args.max_emitted_steps,
            max_journal_bytes_per_run=args.max_journal_bytes_per_run, max_journal_bytes=args.max_journal_bytes,
            max_inflight_body_bytes=args.max_inflight_body_bytes, max_clock_skew_s=args.max_clock_skew_s,
            max_span_age_s=args.max_span_age_s, journal=not args.no_journal, trackers=args.trackers,
            tensorboard_dir=args.tensorboard_dir)
        collector = Collector(config).start()
    except (ValueError, OSError) as exc:
        print(f"steptrace collector: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    grpc = f"{_addr(args.host)}:{collector.grpc_port}" if collector.grpc_port is not None else "off"
    # One line, flushed at once: tests and scripts that ask for port 0 read the bound ports from it.
    print(f"steptrace collector: otlp_http={_addr(args.host)}:{collector.port} otlp_grpc={grpc} "
          f"metrics={_addr(args.metrics_host or args.host)}:{collector.metrics_port} run_dir={config.run_dir} "
          f"world_size={config.world_size if config.world_size is not None else 'from-spans'} "
          f"auth={'bearer' if collector.tokens else 'off'} tls={'on' if config.tls_cert else 'off'}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # a second signal during close() acts as usual
        collector.close()
    logging.getLogger("steptrace.collector").info("steptrace collector: stopped; open steps flushed")
    return 0


def _addr(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptrace collector", description=DESCRIPTION)
    add_collector_arguments(parser)
    return run_collector(parser.parse_args(argv))
