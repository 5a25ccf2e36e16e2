"""A stand-in MLflow tracking server for the tracker tests' child scripts: it answers MLflow's REST API only as
far as the sink's calls need, and records the paths it was asked.

What MLflow's client relies on (mlflow/utils/rest_utils.py and the REST API reference): ``runs/create`` answers
``{"run": {"info": ..., "data": ...}}``; the other calls the sink makes (``runs/log-batch``, ``runs/update``,
``experiments/get-by-name``) are satisfied by ``{}``. ``create_delay_s`` holds the answer to ``runs/create``
(a hung or far-away server: MLflow waits 120 s a request and retries).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(run_name: str, create_delay_s: float = 0.0) -> tuple[ThreadingHTTPServer, list[str], str]:
    """Start the server on a free port in a daemon thread: (server, the paths asked so far, its tracking URI)."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            paths.append(self.path)
            out: dict = {}
            if self.path.endswith("/runs/create"):
                time.sleep(create_delay_s)
                out = {"run": {"info": {"run_id": "r1", "run_uuid": "r1", "experiment_id": "0", "user_id": "u",
                                        "status": "RUNNING", "start_time": 1, "artifact_uri": "",
                                        "lifecycle_stage": "active", "run_name": run_name}, "data": {}}}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, paths, f"http://127.0.0.1:{server.server_address[1]}"
