"""A tiny stand-in for the ClickHouse HTTP interface on 127.0.0.1, executing on chDB.

Enough of the protocol for ``steptrace.analysis.clickhouse.HttpClient``: POST ``/?query=...&database=...
&<setting>=<value>`` with the statement (or an INSERT's data) as the body; the answer is the query's
output; a failure is HTTP 500 with ``X-ClickHouse-Exception-Code`` and ClickHouse's message, as a
ClickHouse server answers. ``user``/``password`` make it check the ``X-ClickHouse-User``/``-Key``
headers (401 and code 516 otherwise, as ClickHouse does).
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from chdb import session as chdb_session


class ChdbHttpServer:
    def __init__(self, *, user: str | None = None, password: str | None = None):
        self.session = chdb_session.Session()
        self.lock = threading.Lock()  # one chDB session: one statement at a time
        self.seen: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode("utf-8")
                params = dict(parse_qsl(urlsplit(self.path).query))
                server.seen.append({"params": dict(params), "headers": {k.lower(): v for k, v in self.headers.items()},
                                    "body": body})
                if user is not None and (self.headers.get("X-ClickHouse-User") != user
                                         or self.headers.get("X-ClickHouse-Key") != password):
                    self._reply(401, "Code: 516. DB::Exception: default: Authentication failed. "
                                     "(AUTHENTICATION_FAILED)\n", "516")
                    return
                sql = params.pop("query", "")
                sql = f"{sql}\n{body}" if sql else body
                database = params.pop("database", "default")
                try:
                    with server.lock:
                        for key, value in params.items():
                            server.session.query(f"SET {key} = {value}")
                        server.session.query(f"USE {database}")
                        result = server.session.query(sql)
                        text = result.bytes().decode("utf-8") if result is not None else ""
                except Exception as exc:
                    message = str(exc)
                    match = re.search(r"Code: (\d+)", message)
                    self._reply(500, message + "\n", match.group(1) if match else "1000")
                    return
                self._reply(200, text, None)

            def _reply(self, status: int, text: str, code: str | None) -> None:
                data = text.encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                if code is not None:
                    self.send_header("X-ClickHouse-Exception-Code", code)
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "ChdbHttpServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        # The session is left open: chDB runs one engine per process, which other sessions share.
        self._server.shutdown()
        self._server.server_close()
