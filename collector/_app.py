"""The collector: OTLP receivers → decoder → cross-rank join → ``cluster.jsonl`` and ``/metrics``.

Threads: the HTTP server runs one thread per connection (bounded), gRPC a
small pool; each decodes its request without any lock, then takes the
collector's lock only to journal a chunk of step spans, hand it to the
:class:`Joiner` and publish what it emitted (a file append and a few gauge
updates). A large request takes the lock once per ``_CHUNK`` spans, so the
other senders get in between. A ticker thread expires join windows.
:meth:`Collector.start` replays the journals a killed collector left;
:meth:`Collector.close` stops the receivers, emits every step still open
(``reason: "shutdown"``), and closes the files.
"""

from __future__ import annotations

import logging
import math
import os
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.exposition import MetricsHandler

from steptrace._attribution import STRAGGLER_MIN_RATIO, STRAGGLER_MIN_SECONDS
from steptrace._config import TRACKERS, parse_names
from steptrace.collector._auth import ANY_RUN, Grant, Tokens, read_token_file
from steptrace.collector._decode import (
    DEFAULT_MAX_STEP,
    DEFAULT_MAX_WORLD_SIZE,
    MAX_RANK,
    Rejected,
    count_data_points,
    count_items,
    extract_steps,
    span_fingerprint,
)
from steptrace.collector._join import Joiner, JoinResult
from steptrace.collector._http import ByteBudget
from steptrace.collector._metrics import ClusterMetrics, served_registry
from steptrace.collector._stalls import StallBoard
from steptrace.collector._runlog import ClusterLog, JournalError
from steptrace.collector._captures import CaptureRequests
from steptrace.collector._trackers import ClusterTrackers, require_trackers

__all__ = ["ENV_TOKEN", "Collector", "CollectorConfig"]

log = logging.getLogger("steptrace.collector")

#: The bearer token, when neither ``--token-file`` nor ``--token`` is given.
ENV_TOKEN = "STEPTRACE_COLLECTOR_TOKEN"

_CHUNK = 512  # step spans joined per hold of the lock


@dataclass(frozen=True)
class CollectorConfig:
    """Settings of a :class:`Collector`; a bad value raises ``ValueError`` naming the field.

    Ports may be 0 (any free port; read the bound ones from the collector).
    ``grpc_port=None`` serves no gRPC. ``world_size=None`` takes each step's
    world size from its first span's ``train.world_size`` (at most
    ``max_world_size``). ``token`` and the lines of ``token_file`` are the
    accepted bearer tokens (see :mod:`._auth` for run-scoped lines);
    ``metrics_token_file`` guards ``/metrics``. ``tls_cert``/``tls_key`` (PEM
    files) make every port serve TLS only.
    """

    host: str = "127.0.0.1"
    port: int = 4318
    metrics_host: str | None = None  # default: host
    metrics_port: int = 9464
    grpc_port: int | None = None
    world_size: int | None = None
    run_dir: str = "steptrace-runs"
    token: str | None = None
    max_body_bytes: int = 16 << 20
    window_s: float = 10.0
    max_open_steps: int = 4096
    goodput_window_steps: int = 100
    straggler_min_seconds: float = STRAGGLER_MIN_SECONDS
    straggler_min_ratio: float = STRAGGLER_MIN_RATIO
    straggler_window_steps: int = 100
    #: ranks per run and kind with a straggler score series: the lowest scores (--straggler-score-ranks)
    straggler_score_ranks: int = 10
    #: keep per-rank maps (rank_compute_seconds, ...) in cluster_step records (--cluster-per-rank)
    cluster_per_rank: bool = False
    max_runs: int = 64
    max_runs_per_token: int | None = None  # default: max_runs // 4, for each --token-file line
    read_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    #: an upper bound: the file-descriptor limit sets the cap below it (descriptor_limits); one thread each
    max_connections: int = 16384
    max_connections_per_peer: int = 128
    max_world_size: int = DEFAULT_MAX_WORLD_SIZE
    max_step: int = DEFAULT_MAX_STEP
    max_spans_per_request: int = 16384
    max_emitted_steps: int = 8192
    run_idle_s: float = 300.0
    max_conflicts_per_run: int = 1000
    max_inflight_body_bytes: int = 256 << 20
    max_clock_skew_s: float | None = 300.0  # a step span may end this far after the collector's clock (None: any)
    max_span_age_s: float | None = 86400.0  # ... and this far before it
    journal: bool = True
    max_journal_bytes_per_run: int = 64 << 20
    max_journal_bytes: int = 1 << 30
    token_file: str | None = None
    metrics_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: write each run's joined steps to these trackers (tensorboard, mlflow, wandb: steptrace.trackers'
    #: aggregate mode; --trackers)
    trackers: tuple[str, ...] = ()
    #: where the TensorBoard tracker writes <run_id>/cluster/ (default: <run_dir>/<run_id>/tensorboard/cluster)
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        def integer(name: str, minimum: int, maximum: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
                    (maximum is not None and value > maximum):
                bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
                raise ValueError(f"{name} must be an integer {bound}, got {value!r}")

        for name in ("port", "metrics_port"):
            integer(name, 0, 65535)
        integer("grpc_port", 0, 65535, optional=True)
        integer("max_world_size", 1, MAX_RANK)
        integer("world_size", 1, self.max_world_size, optional=True)
        integer("max_step", 0, (1 << 63) - 1)
        for name in ("straggler_min_seconds", "straggler_min_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        integer("straggler_window_steps", 1)
        integer("straggler_score_ranks", 1)
        for name in ("max_body_bytes", "max_open_steps", "goodput_window_steps", "max_runs", "max_connections",
                     "max_connections_per_peer", "max_spans_per_request", "max_emitted_steps",
                     "max_journal_bytes_per_run", "max_journal_bytes", "max_inflight_body_bytes"):
            integer(name, 1)
        integer("max_conflicts_per_run", 0)
        integer("max_runs_per_token", 1, optional=True)
        if not isinstance(self.run_idle_s, (int, float)) or isinstance(self.run_idle_s, bool) or \
                not 0 <= self.run_idle_s < math.inf:
            raise ValueError(f"run_idle_s must be a number of seconds >= 0, got {self.run_idle_s!r}")
        for name in ("max_clock_skew_s", "max_span_age_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a number of seconds > 0 (or None for no bound), got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both PEM files or neither")
        for name in ("window_s", "read_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an address to bind, got {self.host!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("token must be a non-empty string (or None for no authentication)")
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ValueError(f"run_dir must be a directory path, got {self.run_dir!r}")
        # "tensorboard,mlflow" as --trackers gives it, or a list of names.
        object.__setattr__(self, "trackers", parse_names(self.trackers, "trackers", tuple(TRACKERS), "--trackers"))

    def tokens(self) -> Tokens | None:
        """The accepted tokens (``token`` and ``token_file``'s lines), or None when anyone may send."""
        entries: list[tuple[str, Grant]] = []
        if self.token is not None:
            entries.append((self.token, ANY_RUN))
        if self.token_file is not None:
            entries += read_token_file(self.token_file, "token_file")
        return Tokens(entries) if entries else None

    def metrics_tokens(self) -> Tokens | None:
        if self.metrics_token_file is None:
            return None
        return Tokens(read_token_file(self.metrics_token_file, "metrics_token_file"))

    def tls_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_cert/tls_key: cannot load {self.tls_cert!r} and {self.tls_key!r}: {exc}") from None
        return context


class Collector:
    """Receives OTLP from every rank, joins each step across ranks, serves and writes the result.

    ::

        with Collector(CollectorConfig(port=0, metrics_port=0, world_size=8, run_dir="runs")) as c:
            ...  # ranks export to c.endpoint; Prometheus scrapes c.metrics_url
    """

    def __init__(self, config: CollectorConfig | None = None, **settings: Any):
        self.config = config = config if config is not None else CollectorConfig(**settings)
        self._lock = threading.Lock()
        # Read now, so a bad token file or certificate fails at construction, naming the setting.
        self.tokens = config.tokens()
        self._metrics_tokens = config.metrics_tokens()
        self._tls = config.tls_context()
        self.joiner = Joiner(world_size=config.world_size, window_s=config.window_s,
                             max_open_steps=config.max_open_steps, max_emitted=config.max_emitted_steps,
                             max_runs=config.max_runs, run_idle_s=config.run_idle_s, history=self._history,
                             straggler_min_seconds=config.straggler_min_seconds,
                             straggler_min_ratio=config.straggler_min_ratio,
                             straggler_noise_window_steps=config.straggler_window_steps,
                             per_rank=config.cluster_per_rank,
                             max_runs_per_owner=config.max_runs_per_token if config.max_runs_per_token is not None
                             else max(1, config.max_runs // 4))
        self.metrics = ClusterMetrics(goodput_window_steps=config.goodput_window_steps, max_runs=config.max_runs,
                                      straggler_window_steps=config.straggler_window_steps,
                                      straggler_score_ranks=config.straggler_score_ranks,
                                      open_steps=lambda: self.joiner.open_steps)
        self.limits = descriptor_limits(config)
        self.budget = ByteBudget(config.max_inflight_body_bytes,
                                 min(config.max_inflight_body_bytes,
                                     max(config.max_body_bytes, config.max_inflight_body_bytes // 4)))
        self.log = ClusterLog(config.run_dir, max_open=self.limits.open_files,
                              on_error=lambda n: self.metrics.write_errors.inc(n),
                              max_conflicts=config.max_conflicts_per_run, journal=config.journal,
                              max_journal_bytes_per_run=config.max_journal_bytes_per_run,
                              max_journal_bytes=config.max_journal_bytes, open_spans=self.joiner.open_spans)
        #: The ranks' stalls, per run: which rank is the cause of a hang (cluster_stall records).
        self.stalls = StallBoard(max_runs=config.max_runs)
        #: Capture requests for the ranks a new straggler verdict names (GET /v1/steptrace/capture).
        self.captures = CaptureRequests(max_runs=config.max_runs)
        self.metrics.on_verdict = self.captures.verdict
        self.captures.count = self.metrics.capture_requests_counted
        #: Each run's joined steps in the trackers (--trackers), written off the join.
        self.trackers: ClusterTrackers | None = None
        if config.trackers:
            require_trackers(config.trackers)  # a tracker that does not import fails here, naming the extra
            self.trackers = ClusterTrackers(config.trackers, run_dir=config.run_dir,
                                            tensorboard_dir=config.tensorboard_dir, max_runs=config.max_runs,
                                            count_drop=self.metrics.tracker_dropped_records)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None
        self._grpc: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._closed = False
        #: Bound ports (the real ones when 0 was asked for); set by :meth:`start`.
        self.port = self.metrics_port = 0
        self.grpc_port: int | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Collector:
        """Bind and serve. A port that cannot be bound raises ``ValueError`` naming the setting."""
        from steptrace.collector._http import OtlpHttpServer

        c = self.config
        os.makedirs(c.run_dir, exist_ok=True)
        if c.journal:
            self._replay()
        try:
            try:
                self._http = OtlpHttpServer((c.host, c.port), self, tokens=self.tokens,
                                            max_body_bytes=c.max_body_bytes,
                                            read_timeout_s=min(c.read_timeout_s, c.request_timeout_s),
                                            request_timeout_s=c.request_timeout_s,
                                            max_connections=self.limits.http,
                                            max_connections_per_peer=self.limits.http_per_peer,
                                            tls=self._tls, budget=self.budget)
            except OSError as exc:
                raise ValueError(f"port: cannot serve OTLP/HTTP on {c.host}:{c.port}: {exc.strerror or exc}") from exc
            self.port = self._http.server_address[1]
            metrics_host = c.metrics_host or c.host
            try:
                self._metrics_server = _metrics_server((metrics_host, c.metrics_port), self)
            except OSError as exc:
                raise ValueError(f"metrics_port: cannot serve /metrics on {metrics_host}:{c.metrics_port}: "
                                 f"{exc.strerror or exc}") from exc
            self.metrics_port = self._metrics_server.server_address[1]
            if c.grpc_port is not None:
                from steptrace.collector._grpc import start_grpc_server

                try:
                    tls = None
                    if c.tls_cert is not None and c.tls_key is not None:
                        with open(c.tls_key, "rb") as key, open(c.tls_cert, "rb") as cert:
                            tls = (key.read(), cert.read())
                    self._grpc, self.grpc_port = start_grpc_server(self, c.host, c.grpc_port, c.max_body_bytes,
                                                                   tls, max_connections=self.limits.grpc,
                                                                   idle_s=c.request_timeout_s)
                except OSError as exc:
                    raise ValueError(f"grpc_port: cannot serve OTLP/gRPC on {c.host}:{c.grpc_port}: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self._http_thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1},
                                             name="steptrace-collector-http", daemon=True)
        self._http_thread.start()
        self._metrics_thread = threading.Thread(target=self._metrics_server.serve_forever,
                                                kwargs={"poll_interval": 0.1}, name="steptrace-collector-metrics",
                                                daemon=True)
        self._metrics_thread.start()
        self._ticker = threading.Thread(target=self._tick, name="steptrace-collector-window", daemon=True)
        self._ticker.start()
        lim = self.limits
        log.info("steptrace collector: file descriptor limit %s: at most %d OTLP/HTTP connections%s, %d /metrics, "
                 "%d open run files", lim.nofile or "unlimited", lim.http,
                 f", {lim.grpc} gRPC" if c.grpc_port is not None else "", lim.metrics, lim.open_files)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop receiving, emit every open step (``reason: "shutdown"``), close the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._http is not None:
            if self._http_thread is not None:
                self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=min(1.0, timeout_s)).wait(timeout_s)
        if self._ticker is not None:
            self._ticker.join(timeout_s)
        with self._lock:
            self._publish(self.joiner.flush())
            self.log.close()
        if self.trackers is not None:
            self.trackers.close(timeout_s)
        if self._metrics_server is not None:
            if self._metrics_thread is not None:
                self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """The OTLP/HTTP base URL ranks export to (``otlp_endpoint``)."""
        return f"{self._scheme}://{_url_host(self.config.host)}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self._scheme}://{_url_host(self.config.metrics_host or self.config.host)}:{self.metrics_port}/metrics"

    @property
    def _scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    # -- the data path -----------------------------------------------------------------------------

    def accept(self, signal: str, message: Any, transport: str, grant: Grant = ANY_RUN) -> tuple[int, str]:
        """Take one decoded export request; returns (items rejected, why) for ``partial_success``.

        Raises :class:`Rejected`: 503 (retryable for OTLP exporters) once :meth:`close` began,
        413 beyond ``max_spans_per_request``, 403 for a run ``grant`` does not cover.
        """
        c = self.config
        if self._closed:
            raise Rejected(503, "shutting_down", "the collector is shutting down; retry")
        items = count_items(signal, message)
        if items > c.max_spans_per_request:
            raise Rejected(413, "too_many_spans", f"{items} {'data points' if signal == 'metrics' else 'spans'} in "
                                                  f"one request; at most {c.max_spans_per_request}")
        if signal == "metrics":
            self.metrics.request(signal, transport)
            self.metrics.data_points.inc(count_data_points(message))
            return 0, ""
        now = time.time()
        ends = (now - c.max_span_age_s if c.max_span_age_s is not None else -math.inf,
                now + c.max_clock_skew_s if c.max_clock_skew_s is not None else math.inf)
        extracted = extract_steps(message, c.world_size, max_world_size=c.max_world_size, max_step=c.max_step,
                                  ends=ends)
        if grant.runs is not None:
            runs = {s.run_id for s in extracted.steps} | {r for r in extracted.spans_by_run if r}
            denied = sorted(r for r in runs if not grant.allows(r))
            if denied:
                raise Rejected(403, "forbidden", f"this token may not write run(s) {', '.join(denied[:5])[:300]}")
        self.metrics.request(signal, transport)
        refused = mismatched = 0
        if extracted.stalls:
            with self._lock:
                # Only runs the joiner took (a run it refused cannot fill the board either).
                self.stalls.add([s for s in extracted.stalls if self.joiner.known(s["run_id"])])
        steps = extracted.steps
        for start in range(0, len(steps), _CHUNK):
            chunk = steps[start:start + _CHUNK]
            with self._lock:
                if self._closed:  # close() flushed the joiner already
                    raise Rejected(503, "shutting_down", "the collector is shutting down; retry")
                admitted = {run: self.joiner.admitted(run, grant.owner) for run in {s.run_id for s in chunk}}
                taken = [s for s in chunk if admitted[s.run_id]]
                refused += len(chunk) - len(taken)
                # Journal first: once we answer 200 the spans must survive a crash. A retry of a
                # span the joiner holds or wrote is journaled no more (the joiner counts it).
                fresh: dict[tuple[str, int, int, int, int], Any] = {}
                for s in taken:
                    key = (s.run_id, s.attempt, s.step, s.rank, span_fingerprint(s.compute_seconds, s.interval_seconds))
                    if key not in fresh and not self.joiner.seen(s) and not self.joiner.mismatched(s):
                        fresh[key] = s
                try:
                    self.log.journal(fresh.values())
                except JournalError as exc:
                    raise Rejected(503, exc.reason, f"{exc.message}; retry") from None
                result = self.joiner.add(taken, grant.owner)
                mismatched += result.mismatched
                self._publish(result)
        if refused:
            extracted.invalid["too_many_runs"] = extracted.invalid.get("too_many_runs", 0) + refused
        if mismatched:
            extracted.invalid["world_size_mismatch"] = extracted.invalid.get("world_size_mismatch", 0) + mismatched
        # Spans of runs that were not admitted are counted without their run id: no series for them.
        by_run: dict[str, int] = {}
        for run, n in extracted.spans_by_run.items():
            key = run if run and self.joiner.known(run) else ""
            by_run[key] = by_run.get(key, 0) + n
        self.metrics.spans_received(by_run)
        if extracted.skipped:
            self.metrics.skipped.inc(extracted.skipped)
        if extracted.invalid:
            self.metrics.invalid_spans(extracted.invalid)
        rejected = extracted.invalid_total
        note = ""
        if rejected:
            note = "train.step spans skipped: " + ", ".join(f"{n} {reason}"
                                                            for reason, n in sorted(extracted.invalid.items()))
        return rejected, note

    def expire(self) -> None:
        """Emit the steps whose window has passed (the ticker calls this; tests may too).

        At most ``_CHUNK`` steps per hold of the lock, so a burst of expiring steps does not
        keep the senders out.
        """
        while True:
            with self._lock:
                result = self.joiner.expire(max_steps=_CHUNK)
                self._publish(result)
            if len(result.records) < _CHUNK:
                break
        with self._lock:
            stalls = self.stalls.due()
            if stalls:
                # Advice, not acknowledged data: written once, never journaled or retried.
                self.log.write_advice(stalls)

    def _publish(self, result: JoinResult) -> None:
        # Journal entries go only once their records are written (a failed write keeps them, and
        # the records, for the next try).
        # The ranks' time on their own feeds the scores; it is written only with --cluster-per-rank.
        own = {id(r): r.pop("_own") for r in result.records if "_own" in r}
        written = self.log.write(result.records) if result.records else self.log.retry()
        if result.records:
            self.metrics.publish(result.records, own)
            if self.trackers is not None:
                self.trackers.offer(result.records)
        for run_id in written:
            if self.joiner.open_in(run_id) == 0:
                self.log.reset_journal(run_id)
            elif self.log.journal_needs_compaction(run_id):
                self.log.reset_journal(run_id, self.joiner.open_spans(run_id))
        if result.conflicts:
            self.log.write_conflicts(result.conflicts)
            after: dict[str, set[tuple[int, int]]] = {}
            for record in result.conflicts:
                if record.get("when") == "after_emit":
                    after.setdefault(record["run_id"], set()).add((record.get("attempt", 0), record["step"]))
            for run_id, steps in after.items():
                self.log.mark(run_id, steps)
            by_run: dict[str, int] = {}
            for record in result.conflicts:
                by_run[record["run_id"]] = by_run.get(record["run_id"], 0) + 1
            self.metrics.conflicting_spans(by_run)
        if result.duplicates:
            self.metrics.duplicate_spans(result.duplicates)

    def _replay(self) -> None:
        """Join again what a killed collector had accepted but not emitted (its journals)."""
        spans = self.log.replay()
        if self.log.skipped_lines:
            self.metrics.journal_skipped.inc(self.log.skipped_lines)
        if not spans:
            return
        with self._lock:
            for start in range(0, len(spans), _CHUNK):
                self._publish(self.joiner.add(spans[start:start + _CHUNK]))
            for run_id in {s.run_id for s in spans}:
                if self.joiner.open_in(run_id) == 0:
                    self.log.reset_journal(run_id)
        log.info("steptrace collector: replayed %d journaled spans; %d steps open again", len(spans),
                 self.joiner.open_steps)

    def _history(self, run_id: str) -> list[tuple[int, list[tuple[int, int | None]], float | None, int]]:
        return self.log.history(run_id)

    def _tick(self) -> None:
        interval = min(0.5, self.config.window_s / 4)
        while not self._stop.wait(interval):
            try:
                self.expire()
            except Exception:
                log.exception("steptrace collector: expiring join windows failed")


@dataclass(frozen=True)
class DescriptorLimits:
    """Connections and open files the collector allows itself under ``RLIMIT_NOFILE``."""

    nofile: int | None  # the soft limit read at construction (None: unlimited)
    http: int
    http_per_peer: int
    grpc: int
    metrics: int
    open_files: int


def descriptor_limits(c: CollectorConfig) -> DescriptorLimits:
    """Split the process's file descriptors between open run files, /metrics, HTTP and gRPC connections.

    32 are kept for the interpreter, listening sockets and gRPC's own; a quarter at most for
    open run files; a sixteenth (at most 64) for /metrics. What is left caps OTLP/HTTP
    connections (and ``--max-connections`` caps it further), shared half and half with gRPC
    when it is on: excess connections are refused at accept, never left to exhaust the
    descriptors and fail the journal's writes.
    """
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return DescriptorLimits(None, c.max_connections, c.max_connections_per_peer, c.max_connections, 64,
                                3 * c.max_runs)
    files = min(3 * c.max_runs, max(8, soft // 4))
    metrics = min(64, max(2, soft // 16))
    room = max(8, soft - 32 - files - metrics)
    share = room // 2 if c.grpc_port is not None else room
    http = min(c.max_connections, share)
    # When the descriptors cap HTTP below --max-connections, one peer gets at most half of them.
    per_peer = c.max_connections_per_peer if http == c.max_connections else \
        min(c.max_connections_per_peer, max(1, http // 2))
    return DescriptorLimits(soft, http, per_peer, max(4, room - share), metrics, files)


def _metrics_server(address: tuple[str, int], collector: Collector) -> Any:
    """``/metrics``: prometheus_client's handler behind the same connection bounds, deadline, TLS, and a token."""
    from steptrace.collector._http import BoundedServer, DeadlineHandler, count_refusal

    c = collector.config
    tokens = collector._metrics_tokens
    class Handler(DeadlineHandler):
        registry = served_registry(collector.metrics)
        timeout = min(c.read_timeout_s, c.request_timeout_s)
        request_timeout_s = c.request_timeout_s
        protocol_version = "HTTP/1.0"  # one scrape per connection, as prometheus_client serves it

        def do_GET(self) -> None:
            self._hold()  # a scrape being answered is never taken back for a new connection
            try:
                if tokens is not None and tokens.check(self.headers.get("Authorization")) is None:
                    count_refusal(collector, "unauthorized", "/metrics without a valid token", self.client_address)
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="steptrace-collector-metrics"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                MetricsHandler.do_GET(self)  # type: ignore[arg-type]
                self._progressed()
            finally:
                self._unhold()

        def _refused(self, reason: str, detail: str) -> None:
            count_refusal(collector, reason, f"/metrics: {detail}", self.client_address)

    return BoundedServer(address, Handler, max_connections=collector.limits.metrics,
                         max_connections_per_peer=max(1, min(16, collector.limits.metrics // 2)), tls=collector._tls,
                  on_refuse=lambda reason, peer: count_refusal(collector, reason, "/metrics: no free slot", peer))


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
