"""A real Prometheus server for tests: on 127.0.0.1, its own storage under ``tmp_path``, stopped cleanly.

Shared by the exporter, deployment-config and dashboard tests (the binary comes from the
Debian package ``prometheus``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A Prometheus-family server (Prometheus, Alertmanager) on a free loopback port: started with
    its log in ``tmp_path``, ready once ``/-/ready`` answers, stopped without leaving it behind."""

    def __init__(self, argv: list[str], tmp_path: Path, name: str, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=tmp_path)

    def wait_ready(self, timeout_s: float = 20.0) -> bool:
        """True once /-/ready answers; False if the server exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.base + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return False

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class PrometheusProcess(ServerProcess):
    """Starts ``binary`` with ``config_text`` as prometheus.yml and exemplar storage on."""

    def __init__(self, binary: str, config_text: str, tmp_path: Path):
        port = free_port()
        path = tmp_path / "prometheus.yml"
        path.write_text(config_text)
        super().__init__([binary, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
                         tmp_path, "prometheus", port)

    def api(self, path: str, params: dict | None = None, post: bool = False) -> dict:
        """The JSON body of an API call; error answers (400, 422) are returned, not raised."""
        data = urllib.parse.urlencode(params or {})
        if post:
            request = urllib.request.Request(self.base + path, data=data.encode(),
                                             headers={"Content-Type": "application/x-www-form-urlencoded"})
        else:
            request = urllib.request.Request(self.base + path + ("?" + data if data else ""))
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read().decode())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read().decode())

