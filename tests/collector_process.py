"""A real ``steptrace collector`` process for end-to-end tests (stdlib only, so tests whose collector
part is optional can import it without the OTLP packages)."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path


class CollectorProcess:
    """``python -m steptrace.collector`` for ``world_size`` ranks, with ports read from its start line."""

    def __init__(self, run_dir: Path, world_size: int, port: int = 0, window_s: float = 5.0,
                 extra: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steptrace.collector", "--port", str(port), "--metrics-port", "0",
             "--world-size", str(world_size), "--run-dir", str(run_dir), "--window-s", str(window_s), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.line = self.proc.stdout.readline()
        match = re.search(r"otlp_http=127\.0\.0\.1:(\d+) .*metrics=127\.0\.0\.1:(\d+)", self.line)
        if match is None:
            self.proc.kill()
            raise AssertionError(f"no start line: {self.line!r} {self.proc.stderr.read()}")
        self.port, self.metrics_port = int(match.group(1)), int(match.group(2))
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            try:
                return self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # never leave a collector behind a failed test
                self.proc.wait(5)
                raise
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


def collector_if_installed(run_dir: Path, world_size: int, window_s: float = 3.0) -> CollectorProcess | None:
    """A collector for a test whose cross-rank part is optional: None where the ranks cannot export
    OTLP or the collector cannot serve (the OTLP exporter or prometheus_client is not installed)."""
    for module in ("opentelemetry.exporter.otlp.proto.http", "prometheus_client"):
        try:
            if importlib.util.find_spec(module) is None:
                return None
        except ImportError:
            return None
    return CollectorProcess(run_dir, world_size, window_s=window_s)
