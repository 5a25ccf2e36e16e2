"""The collector: OTLP receivers → decoder → cross-rank join → ``cluster.jsonl`` and ``/metrics``.

Threads: the HTTP server runs one thread per connection (bounded), gRPC a
small pool; each decodes its request without any lock, then takes the
collector's lock only to hand the step spans to the :class:`Joiner` and
publish what it emitted (a file append and a few gauge updates). A ticker
thread expires join windows. :meth:`Collector.close` stops the receivers,
emits every step still open (``reason: "shutdown"``), and closes the files.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import MetricsHandler

from steptrace.collector._decode import Rejected, count_data_points, extract_steps
from steptrace.collector._join import JoinResult, Joiner
from steptrace.collector._metrics import ClusterMetrics, served_registry
from steptrace.collector._runlog import ClusterLog

__all__ = ["Collector", "CollectorConfig", "ENV_TOKEN"]

log = logging.getLogger("steptrace.collector")

#: The bearer token, when ``--token`` is not given.
ENV_TOKEN = "STEPTRACE_COLLECTOR_TOKEN"


@dataclass(frozen=True)
class CollectorConfig:
    """Settings of a :class:`Collector`; a bad value raises ``ValueError`` naming the field.

    Ports may be 0 (any free port; read the bound ones from the collector).
    ``grpc_port=None`` serves no gRPC. ``world_size=None`` takes each step's
    world size from its first span's ``train.world_size``.
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
    max_runs: int = 64
    read_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    max_connections: int = 1024

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
        integer("world_size", 1, 1 << 20, optional=True)
        for name in ("max_body_bytes", "max_open_steps", "goodput_window_steps", "max_runs", "max_connections"):
            integer(name, 1)
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


class Collector:
    """Receives OTLP from every rank, joins each step across ranks, serves and writes the result.

    ::

        with Collector(CollectorConfig(port=0, metrics_port=0, world_size=8, run_dir="runs")) as c:
            ...  # ranks export to c.endpoint; Prometheus scrapes c.metrics_url
    """

    def __init__(self, config: CollectorConfig | None = None, **settings: Any):
        self.config = config = config if config is not None else CollectorConfig(**settings)
        self._lock = threading.Lock()
        self.joiner = Joiner(world_size=config.world_size, window_s=config.window_s,
                             max_open_steps=config.max_open_steps, history=self._history)
        self.metrics = ClusterMetrics(goodput_window_steps=config.goodput_window_steps, max_runs=config.max_runs,
                                      open_steps=lambda: self.joiner.open_steps)
        self.log = ClusterLog(config.run_dir, max_open=config.max_runs,
                              on_error=lambda n: self.metrics.write_errors.inc(n))
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

    def start(self) -> "Collector":
        """Bind and serve. A port that cannot be bound raises ``ValueError`` naming the setting."""
        from steptrace.collector._http import OtlpHttpServer

        c = self.config
        os.makedirs(c.run_dir, exist_ok=True)
        try:
            try:
                self._http = OtlpHttpServer((c.host, c.port), self, token=c.token, max_body_bytes=c.max_body_bytes,
                                            read_timeout_s=min(c.read_timeout_s, c.request_timeout_s),
                                            request_timeout_s=c.request_timeout_s,
                                            max_connections=c.max_connections)
            except OSError as exc:
                raise ValueError(f"port: cannot serve OTLP/HTTP on {c.host}:{c.port}: {exc.strerror or exc}") from exc
            self.port = self._http.server_address[1]
            metrics_host = c.metrics_host or c.host
            try:
                self._metrics_server = _MetricsServer((metrics_host, c.metrics_port),
                                                      MetricsHandler.factory(served_registry(self.metrics)))
            except OSError as exc:
                raise ValueError(f"metrics_port: cannot serve /metrics on {metrics_host}:{c.metrics_port}: "
                                 f"{exc.strerror or exc}") from exc
            self.metrics_port = self._metrics_server.server_address[1]
            if c.grpc_port is not None:
                from steptrace.collector._grpc import start_grpc_server

                try:
                    self._grpc, self.grpc_port = start_grpc_server(self, c.host, c.grpc_port, c.max_body_bytes)
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
        if self._metrics_server is not None:
            if self._metrics_thread is not None:
                self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """The OTLP/HTTP base URL ranks export to (``otlp_endpoint``)."""
        return f"http://{_url_host(self.config.host)}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.config.metrics_host or self.config.host)}:{self.metrics_port}/metrics"

    # -- the data path -----------------------------------------------------------------------------

    def accept(self, signal: str, message: Any, transport: str) -> tuple[int, str]:
        """Take one decoded export request; returns (items rejected, why) for ``partial_success``.

        Raises :class:`Rejected` (503, retryable for OTLP exporters) once :meth:`close` began.
        """
        if self._closed:
            raise Rejected(503, "shutting_down", "the collector is shutting down; retry")
        self.metrics.request(signal, transport)
        if signal == "metrics":
            self.metrics.data_points.inc(count_data_points(message))
            return 0, ""
        extracted = extract_steps(message, self.config.world_size)
        self.metrics.spans_received(extracted.spans_by_run)
        if extracted.invalid:
            self.metrics.invalid_spans(extracted.invalid)
        if extracted.steps:
            with self._lock:
                if self._closed:  # close() flushed the joiner already
                    raise Rejected(503, "shutting_down", "the collector is shutting down; retry")
                self._publish(self.joiner.add(extracted.steps))
        rejected = extracted.invalid_total
        note = ""
        if rejected:
            note = "train.step spans skipped: " + ", ".join(f"{n} {reason}"
                                                            for reason, n in sorted(extracted.invalid.items()))
        return rejected, note

    def expire(self) -> None:
        """Emit the steps whose window has passed (the ticker calls this; tests may too)."""
        with self._lock:
            self._publish(self.joiner.expire())

    def _publish(self, result: JoinResult) -> None:
        if result.records:
            self.log.write(result.records)
            self.metrics.publish(result.records)
        if result.duplicates:
            self.metrics.duplicate_spans(result.duplicates)

    def _history(self, run_id: str) -> list[tuple[int, list[int], float | None]]:
        return self.log.history(run_id)

    def _tick(self) -> None:
        interval = min(0.5, self.config.window_s / 4)
        while not self._stop.wait(interval):
            try:
                self.expire()
            except Exception:
                log.exception("steptrace collector: expiring join windows failed")


class _MetricsServer(ThreadingHTTPServer):
    """``/metrics`` (prometheus_client's handler on a server whose shutdown does not take 0.5 s)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: Any):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
