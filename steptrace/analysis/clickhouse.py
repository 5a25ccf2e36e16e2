"""steptrace runs in ClickHouse: the OpenTelemetry Collector's ``otel_traces`` table, read with SQL.

At thousands of ranks the cross-rank join belongs to a distributed engine, not to one collector
process (docs/scale.md). The path is: ranks → OpenTelemetry Collector (contrib distribution) → its
``clickhouse`` exporter → table ``otel_traces`` → the per-step cross-rank views of this module.
docs/clickhouse.md has the setup, the views and the limits.

=======================  ======================================================================
:data:`OTEL_TRACES_DDL`   the exporter's ``otel_traces`` table, column for column
:func:`rows_from_otlp`    OTLP spans as the exporter's rows (a stand-in for the exporter in tests)
:func:`connect`           a small client: ``http(s)://`` (the HTTP interface, stdlib only) or
                          ``chdb://`` (chDB, the embedded ClickHouse engine, ``pip install chdb``)
=======================  ======================================================================

Nothing here is imported by the training-time code. ``opentelemetry-proto`` (the ``otlp`` extra) is
imported only by :func:`rows_from_otlp` when handed bytes, and ``chdb`` only by a ``chdb://`` URL.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from decimal import Decimal
from typing import Any, Iterable, Mapping, Protocol
from urllib import error as urlerror
from urllib import parse as urlparse
from urllib import request as urlrequest

from steptrace._schema import (
    ATTR_BEFORE_STEP_PREFIX,
    ATTR_COLLECTIVE_WAIT_IDLE_PREFIX,
    ATTR_HEALTH_PREFIX,
    ATTR_PROCESS_START_TIME,
)

__all__ = [
    "OTEL_TRACES_DDL",
    "ClickHouseError",
    "Client",
    "HttpClient",
    "ChdbClient",
    "connect",
    "otel_traces_ddl",
    "rows_from_otlp",
    "insert_rows",
    "attribute_string",
]

#: The exporter's default table name (``traces_table_name``).
DEFAULT_TABLE = "otel_traces"

# The traces table of the OpenTelemetry Collector contrib ``clickhouse`` exporter, column for column:
# open-telemetry/opentelemetry-collector-contrib, exporter/clickhouseexporter/internal/sqltemplates/
# traces_table.sql at commit f92a5763be13aeb59ecf6f8b47e31d54109191bb (the template the exporter's
# ``create_schema: true`` runs; exporter_traces.go ``renderCreateTracesTableSQL`` fills database,
# table, cluster clause, engine ``MergeTree()`` and an empty TTL). Older exporter releases
# (exporter_traces.go with the DDL inline) lacked ScopeName/ScopeVersion and had ``Duration Int64``;
# the views below read neither. Only the placeholders are ours: ``{database}``, ``{table}``.
_OTEL_TRACES_TEMPLATE = """\
CREATE TABLE IF NOT EXISTS "{database}"."{table}" (
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))
SETTINGS index_granularity=8192, ttl_only_drop_parts = 1
"""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _identifier(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} must be a plain ClickHouse identifier ([A-Za-z_][A-Za-z0-9_]*), got {name!r}")
    return name


def otel_traces_ddl(database: str = "default", table: str = DEFAULT_TABLE) -> str:
    """The exporter's ``CREATE TABLE IF NOT EXISTS`` for ``database.table``."""
    return _OTEL_TRACES_TEMPLATE.format(database=_identifier(database, "database"),
                                        table=_identifier(table, "table"))


#: ``default.otel_traces``, as the exporter creates it with its default configuration.
OTEL_TRACES_DDL = otel_traces_ddl()


# --- OTLP spans → otel_traces rows -------------------------------------------------------------

# pdata's SpanKind.String() and StatusCode.String() (go.opentelemetry.io/collector/pdata/ptrace),
# indexed by the OTLP enum value.
_SPAN_KINDS = ("Unspecified", "Internal", "Server", "Client", "Producer", "Consumer")
_STATUS_CODES = ("Unset", "Ok", "Error")


def _go_float(f: float) -> str:
    """pcommon ``float64AsString``: Go's ``encoding/json`` number text (ES6 rules), NaN/Inf as Go says them."""
    if math.isnan(f) or math.isinf(f):
        text = "NaN" if math.isnan(f) else ("+Inf" if f > 0 else "-Inf")
        return "json: unsupported value: " + text
    if f == 0:
        return "-0" if math.copysign(1.0, f) < 0 else "0"
    # repr is the shortest text that round-trips, as strconv's precision -1 is.
    sign, digits, exponent = Decimal(repr(f)).normalize().as_tuple()
    text = "".join(map(str, digits))
    point = len(text) + int(exponent)  # the decimal point's position in the digits
    minus = "-" if sign else ""
    if 1e-6 <= abs(f) < 1e21:
        if point <= 0:
            return f"{minus}0.{'0' * -point}{text}"
        if point >= len(text):
            return f"{minus}{text}{'0' * (point - len(text))}"
        return f"{minus}{text[:point]}.{text[point:]}"
    # strconv 'e' with precision -1: d[.ddd]e±dd (two exponent digits at least); then e-0d → e-d.
    e = point - 1
    mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
    out = f"{minus}{mantissa}e{'-' if e < 0 else '+'}{abs(e):02d}"
    return re.sub(r"e-0(\d)$", r"e-\1", out)


def _go_json(value: Any) -> str:
    """Go's ``json.Marshal`` of a pcommon ``AsRaw()`` value: compact, sorted keys, HTML-escaped."""
    def encode(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            return _go_float(v)
        if isinstance(v, bytes):
            return json.dumps(base64.b64encode(v).decode("ascii"))
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, dict):
            return "{" + ",".join(f"{encode(str(k))}:{encode(v[k])}" for k in sorted(v)) + "}"
        return "[" + ",".join(encode(x) for x in v) + "]"

    text = encode(value)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def _raw(any_value: Any) -> Any:
    """pcommon ``Value.AsRaw()`` of an OTLP ``AnyValue``."""
    which = any_value.WhichOneof("value")
    if which is None:
        return None
    if which == "kvlist_value":
        return {kv.key: _raw(kv.value) for kv in any_value.kvlist_value.values}
    if which == "array_value":
        return [_raw(v) for v in any_value.array_value.values]
    return getattr(any_value, which)


def attribute_string(any_value: Any) -> str:
    """An OTLP ``AnyValue`` as the exporter stores it in a ``Map(..., String)``: pcommon ``Value.AsString()``.

    string as is; bool ``true``/``false``; int in decimal; double as Go's JSON number text
    (``1``, ``0.25``, ``1e-7``, ``1e+21``: no ``.0``); bytes base64; arrays and maps as Go's
    ``json.Marshal`` of their raw values (``[1,2]``, ``["a","b"]``, keys sorted); empty ``""``.
    """
    which = any_value.WhichOneof("value")
    if which is None:
        return ""
    if which == "string_value":
        return any_value.string_value
    if which == "bool_value":
        return "true" if any_value.bool_value else "false"
    if which == "int_value":
        return str(any_value.int_value)
    if which == "double_value":
        return _go_float(any_value.double_value)
    if which == "bytes_value":
        return base64.b64encode(any_value.bytes_value).decode("ascii")
    return _go_json(_raw(any_value))


def _attributes(key_values: Iterable[Any]) -> dict[str, str]:
    # internal.AttributesToMap: every key, value.AsString(); a repeated key keeps the last.
    return {kv.key: attribute_string(kv.value) for kv in key_values}


def _hex(raw: bytes) -> str:
    # traceutil.TraceIDToHexOrEmptyString / SpanIDToHexOrEmptyString: "" for the all-zero (empty) id.
    return raw.hex() if raw and any(raw) else ""


def rows_from_otlp(request: Any) -> list[dict[str, Any]]:
    """The ``otel_traces`` rows the contrib ClickHouse exporter writes for one OTLP traces export.

    ``request`` is an ``ExportTraceServiceRequest`` or its protobuf bytes (what a rank POSTs to
    ``/v1/traces``). This stands in for the exporter where no ``otelcol-contrib`` binary is at hand
    (none is installed here, nor can one be downloaded): the tests feed the SDK's own requests
    through it. Each rule and where it comes from (open-telemetry/opentelemetry-collector-contrib,
    ``exporter/clickhouseexporter/exporter_traces.go`` ``pushTraceData``, the version that writes
    through ``internal/sqltemplates/traces_insert.sql``):

    * one row per span, for every resource and scope;
    * ``Timestamp`` = the span's start (``span.StartTimestamp().AsTime()``): here integer unix
      nanoseconds, which :func:`insert_rows` writes as ``DateTime64(9)``;
    * ``TraceId``/``SpanId``/``ParentSpanId``: lowercase hex, ``""`` for an empty id
      (``traceutil.TraceIDToHexOrEmptyString``); ``TraceState`` as sent;
    * ``SpanKind`` = pdata ``SpanKind.String()``: ``Unspecified``, ``Internal``, ``Server``,
      ``Client``, ``Producer``, ``Consumer``;
    * ``ServiceName`` = the resource's ``service.name`` (``internal.GetServiceName``), else ``""``;
    * ``ResourceAttributes``/``SpanAttributes``/event and link ``Attributes``: every attribute as
      a string (``internal.AttributesToMap`` → pcommon ``Value.AsString()``, see
      :func:`attribute_string`), so SQL casts them back (``toFloat64OrNull``, ``toInt64OrNull``);
    * ``ScopeName``/``ScopeVersion`` = the instrumentation scope's (``steptrace`` and its version);
    * ``Duration`` = end − start in nanoseconds (``span.EndTimestamp() - span.StartTimestamp()``,
      unsigned);
    * ``StatusCode`` = pdata ``StatusCode.String()``: ``Unset``, ``Ok``, ``Error``;
      ``StatusMessage`` as sent;
    * ``Events.*`` (Timestamp in unix nanoseconds, Name, Attributes) and ``Links.*`` (TraceId,
      SpanId, TraceState, Attributes): parallel arrays, one element per event or link.
    """
    if isinstance(request, (bytes, bytearray, memoryview)):
        try:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        except ImportError as exc:  # pragma: no cover - the otlp extra brings it
            raise ImportError("rows_from_otlp needs opentelemetry-proto: pip install 'steptrace[otlp]'") from exc
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(bytes(request))
        request = parsed
    rows: list[dict[str, Any]] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = resource.get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            scope_name, scope_version = scope_spans.scope.name, scope_spans.scope.version
            for span in scope_spans.spans:
                kind = span.kind if 0 <= span.kind < len(_SPAN_KINDS) else 0
                code = span.status.code if 0 <= span.status.code < len(_STATUS_CODES) else 0
                rows.append({
                    "Timestamp": span.start_time_unix_nano,
                    "TraceId": _hex(span.trace_id),
                    "SpanId": _hex(span.span_id),
                    "ParentSpanId": _hex(span.parent_span_id),
                    "TraceState": span.trace_state,
                    "SpanName": span.name,
                    "SpanKind": _SPAN_KINDS[kind],
                    "ServiceName": service,
                    "ResourceAttributes": dict(resource),
                    "ScopeName": scope_name,
                    "ScopeVersion": scope_version,
                    "SpanAttributes": _attributes(span.attributes),
                    "Duration": max(0, span.end_time_unix_nano - span.start_time_unix_nano),
                    "StatusCode": _STATUS_CODES[code],
                    "StatusMessage": span.status.message,
                    "Events.Timestamp": [e.time_unix_nano for e in span.events],
                    "Events.Name": [e.name for e in span.events],
                    "Events.Attributes": [_attributes(e.attributes) for e in span.events],
                    "Links.TraceId": [_hex(link.trace_id) for link in span.links],
                    "Links.SpanId": [_hex(link.span_id) for link in span.links],
                    "Links.TraceState": [link.trace_state for link in span.links],
                    "Links.Attributes": [_attributes(link.attributes) for link in span.links],
                })
    return rows


def _datetime64(unix_ns: int) -> str:
    # DateTime64(9) from JSONEachRow: a bare JSON number of unix seconds with a 9-digit fraction, which
    # ClickHouse reads exactly and with no time zone (quoted, a short one is misread as a date).
    seconds, nanos = divmod(int(unix_ns), 1_000_000_000)
    return f"{seconds}.{nanos:09d}"


_TIMES = ("Timestamp", "Events.Timestamp")


def _json_row(row: Mapping[str, Any]) -> str:
    parts = [f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in row.items() if k not in _TIMES]
    if "Timestamp" in row:
        parts.append(f'"Timestamp":{_datetime64(row["Timestamp"])}')
    if "Events.Timestamp" in row:
        parts.append('"Events.Timestamp":[' + ",".join(_datetime64(t) for t in row["Events.Timestamp"]) + "]")
    return "{" + ",".join(parts) + "}"


def insert_rows(client: "Client", rows: Iterable[Mapping[str, Any]], table: str = DEFAULT_TABLE,
                database: str | None = None, batch_rows: int = 50_000) -> int:
    """Insert :func:`rows_from_otlp` rows (``FORMAT JSONEachRow``), ``batch_rows`` per statement, into
    ``database.table`` (the client's database by default)."""
    db = _identifier(client.database if database is None else database, "database")
    name = f"{db}.{_identifier(table, 'table')}"
    count, batch = 0, []
    for row in rows:
        batch.append(_json_row(row))
        if len(batch) >= batch_rows:
            client.insert(name, batch)
            count += len(batch)
            batch = []
    if batch:
        client.insert(name, batch)
        count += len(batch)
    return count


# --- clients -------------------------------------------------------------------------------------

class ClickHouseError(RuntimeError):
    """A query ClickHouse refused or could not run: ``code`` is its exception code when it gave one."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class Client(Protocol):
    """What the views and ``report``/``compare --clickhouse`` need from a connection."""

    database: str

    def query(self, sql: str) -> list[dict[str, Any]]:
        """Run a SELECT; its rows as dicts (``FORMAT JSONEachRow``)."""

    def command(self, sql: str) -> None:
        """Run a statement that returns nothing (DDL, ``INSERT ... VALUES``)."""

    def insert(self, table: str, json_rows: list[str]) -> None:
        """``INSERT INTO table FORMAT JSONEachRow`` with one JSON object per string."""


# Integers as JSON numbers, not strings: the rows are read by Python, which has big integers.
_SETTINGS = {"output_format_json_quote_64bit_integers": "0", "output_format_json_quote_denormals": "1"}


def _parse_rows(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _with_format(sql: str) -> str:
    return sql.rstrip().rstrip(";") + "\nFORMAT JSONEachRow"


class HttpClient:
    """The ClickHouse HTTP interface (port 8123, 8443 for https) with the standard library.

    Each call POSTs its statement; the database, credentials and the 64-bit-integers-as-numbers
    setting go with it. A refusal raises :class:`ClickHouseError` with ClickHouse's exception code
    (the ``X-ClickHouse-Exception-Code`` header) and message (the body).
    """

    def __init__(self, url: str, *, database: str = "default", user: str | None = None,
                 password: str | None = None, timeout_s: float = 30.0):
        self.url = url
        self.database = _identifier(database, "database")
        self.user = user
        self.password = password
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)

    def _post(self, body: bytes, params: dict[str, str]) -> str:
        query = dict(_SETTINGS, database=self.database, **params)
        url = self.url + ("&" if "?" in self.url else "?") + urlparse.urlencode(query)
        headers = {"Content-Type": "text/plain; charset=utf-8"}
        if self.user is not None:
            headers["X-ClickHouse-User"] = self.user
        if self.password is not None:
            headers["X-ClickHouse-Key"] = self.password
        req = urlrequest.Request(url, data=body, headers=headers, method="POST")
        try:
            with urlrequest.urlopen(req, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8")
                code = response.headers.get("X-ClickHouse-Exception-Code")
        except urlerror.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace").strip()
            code_text = exc.headers.get("X-ClickHouse-Exception-Code") if exc.headers else None
            code_int = int(code_text) if code_text and code_text.isdigit() else None
            raise ClickHouseError(f"ClickHouse at {self.url} answered HTTP {exc.code}"
                                  f"{f' (code {code_int})' if code_int is not None else ''}: "
                                  f"{detail[:2000] or exc.reason}", code_int) from None
        except (urlerror.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClickHouseError(f"cannot reach ClickHouse at {self.url}: {reason}") from None
        if code:
            # An error after the answer started (status 200 already sent): the body ends with it.
            raise ClickHouseError(f"ClickHouse at {self.url} failed mid-answer (code {code}): "
                                  f"{text.strip()[-2000:]}", int(code) if code.isdigit() else None)
        return text

    def query(self, sql: str) -> list[dict[str, Any]]:
        return _parse_rows(self._post(_with_format(sql).encode("utf-8"), {}))

    def command(self, sql: str) -> None:
        self._post(sql.encode("utf-8"), {})

    def insert(self, table: str, json_rows: list[str]) -> None:
        self._post("\n".join(json_rows).encode("utf-8"), {"query": f"INSERT INTO {table} FORMAT JSONEachRow"})


class ChdbClient:
    """chDB (ClickHouse as a library): ``chdb://`` in memory, ``chdb:///path`` kept in a folder.

    chDB runs one engine per process: every ``chdb://`` client of a process sees the same in-memory
    databases, and once a process opened one path (or memory) it cannot open another.
    """

    def __init__(self, path: str | None = None, *, database: str = "default"):
        try:
            from chdb import session as chdb_session
        except ImportError as exc:
            raise ImportError("chdb:// URLs need chDB, the embedded ClickHouse engine: "
                              "pip install 'steptrace[clickhouse]' (or pip install chdb)") from exc
        self.path = path
        self.database = _identifier(database, "database")
        self._session = chdb_session.Session(path) if path else chdb_session.Session()
        if self.database != "default":
            self.command(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        self.command(f"USE {self.database}")

    def _run(self, sql: str, fmt: str) -> str:
        try:
            result = self._session.query(sql, fmt) if fmt else self._session.query(sql)
        except Exception as exc:  # chDB raises RuntimeError/ChdbError with ClickHouse's message
            message = str(exc)
            match = re.search(r"Code: (\d+)", message)
            raise ClickHouseError(f"chDB: {message.strip()[:2000]}", int(match.group(1)) if match else None) from None
        error = getattr(result, "error_message", None)
        if callable(error):
            error = error()
        if error:
            match = re.search(r"Code: (\d+)", str(error))
            raise ClickHouseError(f"chDB: {str(error).strip()[:2000]}", int(match.group(1)) if match else None)
        data = result.bytes() if hasattr(result, "bytes") else bytes(result)
        return data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else str(data)

    def query(self, sql: str) -> list[dict[str, Any]]:
        body = sql.rstrip().rstrip(";")
        settings = ", ".join(f"{k} = {v}" for k, v in _SETTINGS.items())
        return _parse_rows(self._run(f"{body}\nSETTINGS {settings}", "JSONEachRow"))

    def command(self, sql: str) -> None:
        self._run(sql, "")

    def insert(self, table: str, json_rows: list[str]) -> None:
        self._run(f"INSERT INTO {table} FORMAT JSONEachRow\n" + "\n".join(json_rows), "")

    def close(self) -> None:
        close = getattr(self._session, "close", None)
        if callable(close):
            close()


def connect(url: str, *, timeout_s: float = 30.0) -> HttpClient | ChdbClient:
    """A client for ``url``.

    * ``http://host:8123`` or ``https://host:8443``, optionally ``user:password@`` and
      ``?database=NAME`` (default ``default``); the user and password may also come from
      ``CLICKHOUSE_USER`` and ``CLICKHOUSE_PASSWORD``.
    * ``chdb://`` (an in-memory chDB session) or ``chdb:///path/to/dir`` (a chDB data folder),
      optionally ``?database=NAME``; needs ``pip install chdb``.

    Anything else raises ValueError naming the accepted forms.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"ClickHouse URL must be http(s)://host:port[/?database=NAME] or chdb://[/path], got {url!r}")
    parts = urlparse.urlsplit(url)
    query = dict(urlparse.parse_qsl(parts.query))
    unknown = set(query) - {"database"}
    if unknown:
        raise ValueError(f"ClickHouse URL {url!r}: unknown parameter(s) {sorted(unknown)} (only database=)")
    database = query.get("database") or "default"
    if parts.scheme == "chdb":
        path = (parts.netloc + parts.path) or None
        return ChdbClient(path, database=database)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"ClickHouse URL must be http(s)://host:port[/?database=NAME] or chdb://[/path], got {url!r}")
    user = urlparse.unquote(parts.username) if parts.username else os.environ.get("CLICKHOUSE_USER")
    password = urlparse.unquote(parts.password) if parts.password else os.environ.get("CLICKHOUSE_PASSWORD")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    base = urlparse.urlunsplit((parts.scheme, netloc, parts.path or "/", "", ""))
    return HttpClient(base, database=database, user=user, password=password, timeout_s=timeout_s)


# --- the per-step cross-rank views ---------------------------------------------------------------

def _literal(value: str) -> str:
    """A ClickHouse string literal."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _number(value: float, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return repr(float(value))


#: ``missing_ranks`` lists at most this many ranks, as the collector's cluster records
#: (collector/_join.py ``MAX_MISSING_LISTED``; tests/test_dashboards_clickhouse.py checks they agree).
MAX_MISSING_LISTED = 64

#: The view names :func:`views_sql` creates.
STEP_RANKS_VIEW = "steptrace_step_ranks"
CLUSTER_STEPS_VIEW = "steptrace_cluster_steps"


def _source(database: str | None, table: str) -> str:
    """``database.table``; ``table`` alone when ``database`` is None (the connection's database)."""
    name = _identifier(table, "table")
    return name if database is None else f"{_identifier(database, 'database')}.{name}"


def _and(conditions: Iterable[str | None]) -> str:
    return "".join(f"\n      AND {c}" for c in conditions if c)


def step_spans_sql(database: str | None = "default", table: str = DEFAULT_TABLE, run_id: str | None = None, *,
                   where: str | None = None) -> str:
    """The ranks' ``train.step`` spans as typed columns, one row per stored span (retries included).

    ``database`` None reads ``table`` in the connection's database (a Grafana data source's default
    database). ``where``: an extra condition on the exporter's rows, AND-ed as given (SQL written
    by steptrace, never user input: collector/dashboards/clickhouse.py passes the dashboard's run
    and ``$__timeFilter(Timestamp)``, so ClickHouse reads only the time range's spans).

    Attribute values are strings in the exporter's map (see :func:`rows_from_otlp`): numbers are cast
    back with ``toFloat64OrNull``/``toInt64OrNull``, so an absent or unreadable one is NULL. What the
    collector's decoder skips (no usable step, rank, compute or interval) is left out. This is the
    expensive part of every view (string maps read and parsed per row); :func:`typed_table_sql`
    stores its result once, at insert time.
    """
    source = _source(database, table)
    conditions = _and([f"SpanAttributes['train.run_id'] = {_literal(run_id)}" if run_id is not None else None,
                       f"({where})" if where else None])
    # The columns are prefixed: ClickHouse lets an outer alias shadow a column of the same name.
    return f"""\
SELECT run_id, attempt, step, rank, s_world, s_compute, s_interval, s_idle, s_wait, s_status, s_end, s_trace, s_bubble
FROM (
    SELECT
        SpanAttributes['train.run_id'] AS run_id,
        toUInt32OrZero(SpanAttributes['train.attempt']) AS attempt,
        toInt64OrNull(SpanAttributes['train.step']) AS step,
        toInt64OrNull(SpanAttributes['train.rank']) AS rank,
        toInt64OrNull(SpanAttributes['train.world_size']) AS s_world,
        toFloat64OrNull(SpanAttributes['train.compute_seconds']) AS s_compute,
        toFloat64OrNull(SpanAttributes['train.interval_seconds']) AS s_interval,
        toFloat64OrNull(SpanAttributes['train.idle_seconds']) AS s_idle,
        toFloat64OrNull(SpanAttributes['train.collective_wait_seconds']) AS s_wait_sent,
        -- least() skips a NULL argument in recent ClickHouse: an unmeasured wait must stay NULL.
        if(s_wait_sent IS NULL OR NOT (s_wait_sent >= 0 AND isFinite(s_wait_sent)), NULL,
           least(s_wait_sent, s_interval)) AS s_wait,
        if(SpanAttributes['train.status'] = '', 'ok', SpanAttributes['train.status']) AS s_status,
        (toUnixTimestamp64Nano(Timestamp) + Duration) / 1e9 AS s_end,
        TraceId AS s_trace,
        mapApply((k, v) -> (substring(k, {len(_BUBBLE) + 1}), toFloat64OrZero(v)),
                 mapFilter((k, v) -> startsWith(k, {_literal(_BUBBLE)}) AND isFinite(toFloat64OrNull(v)) = 1,
                           SpanAttributes)) AS s_bubble
    FROM {source}
    WHERE SpanName = 'train.step'{conditions}
)
-- As the collector's decoder: a span without a usable step, rank, compute or interval is skipped.
WHERE step >= 0 AND rank >= 0 AND s_compute >= 0 AND isFinite(s_compute) AND s_interval >= 0
      AND isFinite(s_interval)"""


def step_ranks_sql(database: str | None = "default", table: str = DEFAULT_TABLE, run_id: str | None = None, *,
                   typed_table: str | None = None, where: str | None = None) -> str:
    """One row per (run, attempt, step, rank) from the ranks' ``train.step`` spans, typed.

    A span the exporter stored twice (an OTLP retry; ClickHouse keeps both rows) counts once; a rank
    that sent two different spans for one step (``versions`` 2, else 1) is a conflict, which
    :func:`cluster_steps_sql` leaves out and counts as missing, as the steptrace collector does.
    ``own_seconds`` follows the collector: interval − min(wait, interval) where the rank measured
    its wait in collectives, its compute otherwise. ``typed_table``: read the typed columns from
    that table (:func:`typed_table_sql`) instead of parsing ``table``'s attribute maps. ``database``
    and ``where`` as for :func:`step_spans_sql`; with ``typed_table``, ``where`` is on its columns.
    """
    if typed_table is not None:
        conditions = [c for c in (f"run_id = {_literal(run_id)}" if run_id is not None else None,
                                  f"({where})" if where else None) if c]
        spans = f"SELECT * FROM {_source(database, typed_table)}" + (
            f" WHERE {' AND '.join(conditions)}" if conditions else "")
    else:
        spans = step_spans_sql(database, table, run_id, where=where)
    return f"""\
SELECT
    run_id, attempt, step, rank,
    any(s_world) AS world_size,
    any(s_compute) AS compute_seconds,
    any(s_interval) AS interval_seconds,
    any(s_idle) AS idle_seconds,
    any(s_wait) AS collective_wait_seconds,
    any(if(s_wait IS NULL, s_compute, greatest(0., s_interval - s_wait))) AS own_seconds,
    any(s_status) AS status,
    max(s_end) AS end_time,
    any(s_trace) AS trace_id,
    any(mapKeys(s_bubble)) AS bubble_keys,
    any(mapValues(s_bubble)) AS bubble_values,
    -- 1, or 2 when the rank sent different spans (min/max per column cost less than a set per rank)
    if(min(s_compute) = max(s_compute) AND min(s_interval) = max(s_interval), 1, 2) AS versions
FROM ({spans})
GROUP BY run_id, attempt, step, rank"""


#: The typed table :func:`typed_table_sql` creates, and its materialized view.
TYPED_TABLE = "steptrace_step_spans"


def typed_table_sql(database: str = "default", table: str = DEFAULT_TABLE) -> list[str]:
    """A typed copy of the ``train.step`` spans, kept by a materialized view as the exporter inserts.

    ``CREATE TABLE`` :data:`TYPED_TABLE` (MergeTree ordered by run, attempt, step, rank), ``CREATE
    MATERIALIZED VIEW ... TO`` it from ``table`` (it sees rows inserted after it exists), and the
    ``INSERT ... SELECT`` that copies what ``table`` already holds (run it once, before spans
    arrive or while none do, or rows inserted meanwhile are copied twice: a retry, which the views
    count once). The views then read numbers, not string maps.
    """
    db = _identifier(database, "database")
    spans = step_spans_sql(database, table)
    return [
        f"""CREATE TABLE IF NOT EXISTS {db}.{TYPED_TABLE} (
    run_id String, attempt UInt32, step Int64, rank Int64, s_world Nullable(Int64), s_compute Float64,
    s_interval Float64, s_idle Nullable(Float64), s_wait Nullable(Float64), s_status LowCardinality(String),
    s_end Float64, s_trace String, s_bubble Map(String, Float64)
) ENGINE = MergeTree ORDER BY (run_id, attempt, step, rank)""",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{TYPED_TABLE}_mv TO {db}.{TYPED_TABLE} AS\n{spans}",
        f"INSERT INTO {db}.{TYPED_TABLE}\n{spans}",
    ]


_BUBBLE = "train.pipeline.bubble_ratio."


def _median_sql(sorted_array: str) -> str:
    # statistics.median of a sorted array: the middle element, or the mean of the two middle ones.
    n = f"length({sorted_array})"
    return (f"if({n} = 0, NULL, if({n} % 2 = 1, {sorted_array}[intDiv({n}, 2) + 1], "
            f"({sorted_array}[intDiv({n}, 2)] + {sorted_array}[intDiv({n}, 2) + 1]) / 2))")


def cluster_steps_sql(database: str | None = "default", table: str = DEFAULT_TABLE, run_id: str | None = None, *,
                      world_size: int | None = None, straggler_min_seconds: float | None = None,
                      straggler_min_ratio: float | None = None, typed_table: str | None = None,
                      where: str | None = None, noise_window_steps: int | None = None) -> str:
    """One row per (run, attempt, step): the steptrace collector's ``cluster_step`` aggregates, in SQL.

    Columns, each as ``collector/_join.py`` ``cluster_record`` computes it: ``world_size`` (the
    argument, like the collector's ``--world-size``, else the largest ``train.world_size`` the
    step's spans carry; a rank at or beyond it is left out, as the collector with ``--world-size``
    refuses it), ``ranks_reporting``, ``missing_rank_count`` (ranks below the world size
    that sent no usable span, or two different ones), ``complete``, ``compute_*`` and
    ``interval_*`` min/median/max (exact medians, as ``statistics.median``), ``skew_seconds`` (max −
    min compute), ``own_*``, ``straggler_rank``/``straggler_cost_seconds``/
    ``straggler_excess_seconds``/``straggler_threshold_seconds``/``straggler_noise_seconds``
    (``steptrace._attribution.StragglerRule``: the candidate is the rank with most time on its own,
    the lowest on a tie, named only on a complete step of two ranks or more whose excess over the
    other ranks' median reaches max(min_seconds, min_ratio × the median interval, or median compute
    where a rank did not measure its wait, the run's noise floor) and, where the waits are measured,
    whose cost, the other ranks' median wait less its own, is above 0; the noise floor comes from the
    run's previous ``noise_window_steps`` such steps in (attempt, step) order, as the collector's
    from the steps it joined before), ``compute_sum_seconds``,
    ``interval_sum_seconds``, ``goodput_ratio`` (Σcompute / Σinterval), ``pipeline_bubble_ratio``
    (per stage, the mean over the ranks that report it), ``status`` (ranks per status),
    ``end_time``, ``trace_id``. ``typed_table``, ``where``: see :func:`step_ranks_sql`.
    """
    from steptrace._attribution import (MAD_TO_SIGMA, STRAGGLER_MIN_RATIO, STRAGGLER_MIN_SECONDS, STRAGGLER_NOISE_K,
                                        STRAGGLER_NOISE_MIN_SAMPLES, STRAGGLER_NOISE_WINDOW)

    min_s = _number(STRAGGLER_MIN_SECONDS if straggler_min_seconds is None else straggler_min_seconds,
                    "straggler_min_seconds")
    ratio = _number(STRAGGLER_MIN_RATIO if straggler_min_ratio is None else straggler_min_ratio,
                    "straggler_min_ratio")
    window = STRAGGLER_NOISE_WINDOW if noise_window_steps is None else noise_window_steps
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"noise_window_steps must be an integer >= 1, got {window!r}")
    noise_k = _number(STRAGGLER_NOISE_K, "noise k")
    mad_to_sigma = _number(MAD_TO_SIGMA, "mad to sigma")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    world = f"toNullable(toInt64({world_size}))" if world_size is not None else "max(world_size)"
    in_world = str(world_size) if world_size is not None else "ifNull(world_size, rank + 1)"
    ranks_sql = step_ranks_sql(database, table, run_id, typed_table=typed_table, where=where)
    MAX_LISTED = MAX_MISSING_LISTED  # noqa: N806
    step_seconds = "coalesce(if(measured, interval_median_seconds, compute_median_seconds), 0.)"
    threshold = f"greatest({min_s}, {ratio} * greatest(0., {step_seconds}), ifNull(noise_floor, 0.))"
    # The middle query's aggregates are prefixed m_ (an alias may not shadow a column it aggregates).
    # The straggler rule needs the run's earlier steps (steptrace._attribution.StragglerRule): a window
    # over the judged steps (complete, two ranks or more) of each run, in (attempt, step) order, holds
    # each one's candidate, excess and runner-up excess; the noise floor of a step's candidate is the
    # median + k x 1.4826 x MAD of the other ranks' excess in them (noise_floor).
    return f"""\
SELECT * EXCEPT (gaps, named, candidate_excess_seconds, candidate_threshold_seconds, stages, names, others_own,
                 others_waits, candidate_rank, candidate_wait, candidate_runner_up_seconds, below_runner_up,
                 judged, history, noise_samples, noise_sorted, noise_middle, noise_deviations, noise_floor,
                 candidate_cost, measured)
FROM (
SELECT
    *,
    -- The other ranks' excess in the window's steps: the candidate's where another rank led, the
    -- runner-up's where this one did (none with two ranks).
    arrayFilter(x -> x IS NOT NULL,
                arrayMap(t -> if(t.1 != candidate_rank, toNullable(t.2), t.3), history)) AS noise_samples,
    arraySort(noise_samples) AS noise_sorted,
    {_median_sql('noise_sorted')} AS noise_middle,
    arraySort(arrayMap(x -> abs(x - noise_middle), noise_samples)) AS noise_deviations,
    if(judged AND length(noise_samples) >= {STRAGGLER_NOISE_MIN_SAMPLES},
       noise_middle + {noise_k} * {mad_to_sigma} * {_median_sql('noise_deviations')}, NULL) AS noise_floor,
    {threshold} AS candidate_threshold_seconds,
    if(judged AND measured,
       {_median_sql('others_waits')} - candidate_wait, NULL) AS candidate_cost,
    judged AND candidate_excess_seconds >= candidate_threshold_seconds
        AND (NOT measured OR candidate_cost > 0) AS named,
    if(named, candidate_rank, NULL) AS straggler_rank,
    if(named, candidate_excess_seconds, NULL) AS straggler_excess_seconds,
    if(named AND measured, candidate_cost, NULL) AS straggler_cost_seconds,
    if(complete, candidate_threshold_seconds, NULL) AS straggler_threshold_seconds,
    if(complete, noise_floor, NULL) AS straggler_noise_seconds
FROM (
SELECT
    *,
    groupArray(tuple(candidate_rank, candidate_excess_seconds, candidate_runner_up_seconds)) OVER (
        PARTITION BY run_id, judged ORDER BY attempt, step ROWS BETWEEN {window} PRECEDING AND 1 PRECEDING) AS history
FROM (
SELECT
    run_id, attempt, step,
    m_trace AS trace_id,
    m_world AS world_size,
    m_ranks AS ranks_reporting,
    if(m_world IS NULL, 0, toInt64(m_world) - toInt64(arrayCount(r -> r < m_world, ranks))) AS missing_rank_count,
    m_world IS NOT NULL AND missing_rank_count = 0 AS complete,
    -- The missing ranks as ranges between the reported ones (the collector's missing_rank_ranges),
    -- the first {MAX_LISTED} ranges and ranks listed: O(ranks log ranks) per step, whatever the gaps.
    arrayFilter(g -> g.2 - g.1 > 1,
                arrayZip(arrayPushFront(present, -1), arrayPushBack(present, ifNull(m_world, 0)))) AS gaps,
    arrayMap(g -> [g.1 + 1, g.2 - 1], arraySlice(gaps, 1, {MAX_LISTED})) AS missing_rank_ranges,
    arraySlice(arrayFlatten(arrayMap(g -> arrayMap(i -> g.1 + 1 + toInt64(i), range(toUInt64(least(g.2 - g.1 - 1,
                                                                                              {MAX_LISTED})))),
                                     arraySlice(gaps, 1, {MAX_LISTED}))), 1, {MAX_LISTED}) AS missing_ranks,
    m_conflicting AS conflicting_rank_count,
    m_end AS end_time,
    compute_sorted[1] AS compute_min_seconds,
    {_median_sql('compute_sorted')} AS compute_median_seconds,
    compute_sorted[-1] AS compute_max_seconds,
    interval_sorted[1] AS interval_min_seconds,
    {_median_sql('interval_sorted')} AS interval_median_seconds,
    interval_sorted[-1] AS interval_max_seconds,
    compute_max_seconds - compute_min_seconds AS skew_seconds,
    own_sorted[1] AS own_min_seconds,
    {_median_sql('own_sorted')} AS own_median_seconds,
    own_sorted[-1] AS own_max_seconds,
    -- The rank with most time on its own, the lowest on a tie (argMax over a tuple is slow at 4k ranks).
    arrayMin(arrayFilter((r, o) -> o = own_sorted[-1], ranks, owns)) AS candidate_rank,
    waits[indexOf(ranks, candidate_rank)] AS candidate_wait,
    -- Named once (an alias), so the median's five uses do not copy or sort the array five times.
    arrayPopBack(own_sorted) AS others_own,
    own_sorted[-1] - {_median_sql('others_own')} AS candidate_excess_seconds,
    arrayPopBack(others_own) AS below_runner_up,
    if(ranks_reporting >= 3, own_sorted[-2] - {_median_sql('below_runner_up')}, NULL) AS candidate_runner_up_seconds,
    complete AND ranks_reporting >= 2 AS judged,
    measured,
    if(judged AND measured, arraySort(arrayFilter((w, r) -> r != candidate_rank, waits, ranks)), [])
        AS others_waits,
    compute_sum_seconds, interval_sum_seconds,
    if(interval_sum_seconds > 0, compute_sum_seconds / interval_sum_seconds, NULL) AS goodput_ratio,
    -- per stage, the mean over the ranks that report it; ranks per status
    mapFromArrays(arraySort(arrayDistinct(bubble_stages)) AS stages,
                  arrayMap(st -> arrayAvg(arrayFilter((v, k) -> k = st, bubble_ratios, bubble_stages)), stages))
        AS pipeline_bubble_ratio,
    mapFromArrays(arraySort(arrayDistinct(statuses)) AS names,
                  arrayMap(name -> toUInt64(countEqual(statuses, name)), names)) AS status
FROM (
    SELECT
        *,
        if(m_world IS NULL, [], arraySort(arrayFilter(r -> r < m_world, ranks))) AS present
    FROM (
    SELECT
        run_id, attempt, step,
        any(trace_id) AS m_trace,
        {world} AS m_world,
        countIf(versions = 1) AS m_ranks,
        countIf(versions > 1) AS m_conflicting,
        max(end_time) AS m_end,
        arraySort(groupArrayIf(compute_seconds, versions = 1)) AS compute_sorted,
        arraySort(groupArrayIf(interval_seconds, versions = 1)) AS interval_sorted,
        arraySort(groupArrayIf(own_seconds, versions = 1)) AS own_sorted,
        groupArrayIf(rank, versions = 1) AS ranks,
        groupArrayIf(collective_wait_seconds, versions = 1) AS waits,
        countIf(versions = 1 AND collective_wait_seconds IS NULL) = 0 AND m_ranks > 0 AS measured,
        groupArrayIf(own_seconds, versions = 1) AS owns,
        sumIf(compute_seconds, versions = 1) AS compute_sum_seconds,
        sumIf(interval_seconds, versions = 1) AS interval_sum_seconds,
        -- Maps aggregated with -Map combinators are slow at thousands of ranks: flat arrays instead.
        arrayFlatten(groupArrayIf(bubble_keys, versions = 1)) AS bubble_stages,
        arrayFlatten(groupArrayIf(bubble_values, versions = 1)) AS bubble_ratios,
        groupArrayIf(status, versions = 1) AS statuses
    FROM ({ranks_sql})
    -- Ranks at or beyond the world size are not the job's (the collector refuses them with --world-size).
    WHERE rank < {in_world}
    GROUP BY run_id, attempt, step
    )
)
)
)
)
ORDER BY run_id, attempt, step"""


def views_sql(database: str = "default", table: str = DEFAULT_TABLE, *, typed: bool = False) -> list[str]:
    """``CREATE OR REPLACE VIEW`` statements for :data:`STEP_RANKS_VIEW` and :data:`CLUSTER_STEPS_VIEW`.

    Plain (not materialized) views: a query reads the spans it needs when it runs (filter on
    ``run_id``; ClickHouse pushes the condition into the view's grouping). ``typed``: first the
    :func:`typed_table_sql` statements, and the views read that table (thousands of ranks: the
    attribute maps are parsed once, at insert time). The straggler thresholds are the collector's
    defaults.
    """
    db = _identifier(database, "database")
    typed_table = TYPED_TABLE if typed else None
    return [*(typed_table_sql(database, table) if typed else []),
            f"CREATE OR REPLACE VIEW {db}.{STEP_RANKS_VIEW} AS\n"
            f"{step_ranks_sql(database, table, typed_table=typed_table)}",
            f"CREATE OR REPLACE VIEW {db}.{CLUSTER_STEPS_VIEW} AS\n"
            f"{cluster_steps_sql(database, table, typed_table=typed_table)}"]


def cluster_steps(client: Client, run_id: str | None = None, *, table: str = DEFAULT_TABLE,
                  world_size: int | None = None, straggler_min_seconds: float | None = None,
                  straggler_min_ratio: float | None = None, typed_table: str | None = None,
                  noise_window_steps: int | None = None) -> list[dict[str, Any]]:
    """The per-step cross-rank rows of ``run_id`` (all runs when None), as dicts (see :func:`cluster_steps_sql`)."""
    rows = client.query(cluster_steps_sql(client.database, table, run_id, world_size=world_size,
                                          straggler_min_seconds=straggler_min_seconds,
                                          straggler_min_ratio=straggler_min_ratio, typed_table=typed_table,
                                          noise_window_steps=noise_window_steps))
    for row in rows:
        row["complete"] = bool(row.get("complete"))
    return rows


# --- a run read back from ClickHouse (report / compare --clickhouse) -------------------------------

class ClickHouseSource(str):
    """Where a run read from ClickHouse came from (``Run.path``): the URL without its password."""

    run_id: str = ""
    #: Who joined the run's steps across ranks (the report's cluster view says it).
    joined_by = "ClickHouse"

    @property
    def name(self) -> str:
        return self.run_id


def redacted(url: str) -> str:
    """``url`` without the password in it."""
    parts = urlparse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlparse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# --- one rule for the numbers in a row -------------------------------------------------------------
#
# The exporter stores every attribute as text (pcommon ``AsString``: an int as its decimal digits, a
# double as Go's number text), and anyone holding a token may send any text. The views parse it with
# ClickHouse's functions; the rows read back here are parsed by the same rules, so a value either reads
# as the same number in both or costs the same row in both, and never an exception:
#
# * an integer (``train.step``, ``train.rank``, ``train.world_size``) is ``toInt64OrNull``: an optional
#   sign and decimal digits, within Int64; anything else is unreadable;
# * a number is ``toFloat64OrNull`` then ``isFinite``: decimal text (an exponent allowed), finite;
#   ``nan``, ``inf``, ``1e400`` and words are unreadable (integers stay ints);
# * ``train.attempt`` is ``toUInt32OrZero``: an integer in [0, 2^32), else 0 (the first attempt).
#
# A span whose step, rank, compute or interval is unreadable (or negative) is left out, as the views
# leave it out; any other unreadable number leaves out that value alone. Both are counted and said.

_INTEGER_TEXT = re.compile(r"^[+-]?[0-9]{1,19}$")
_DECIMAL_TEXT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$")
_INT64 = 1 << 63
_UINT32 = 1 << 32


def _integer(text: Any) -> int | None:
    """``toInt64OrNull``: the text as an Int64, or None."""
    if not isinstance(text, str) or not _INTEGER_TEXT.match(text):
        return None
    value = int(text)
    return value if -_INT64 <= value < _INT64 else None


def _number_of(text: Any) -> int | float | None:
    """An attribute's text back as the finite number the SDK sent (ints stay ints), or None."""
    value = _integer(text)
    if value is not None:
        return value
    if not isinstance(text, str) or not _DECIMAL_TEXT.match(text):
        return None
    number = float(text)  # the pattern leaves nothing float() refuses; past the range it is inf
    return number if math.isfinite(number) else None


def _attempt_of(text: Any) -> int:
    """``toUInt32OrZero``: the attempt, 0 when absent or unreadable."""
    value = _integer(text)
    return value if value is not None and 0 <= value < _UINT32 else 0


def _unit_of(attrs: Mapping[str, str], skipped: "_Skipped") -> tuple[int, int, int] | None:
    """(attempt, step, rank) of a span, None when its step or rank is unreadable or negative."""
    step, rank = _integer(attrs.get("train.step")), _integer(attrs.get("train.rank"))
    if step is None or rank is None or step < 0 or rank < 0:
        return None
    text = attrs.get("train.attempt")
    attempt = _attempt_of(text)
    if attempt == 0 and text not in (None, "") and _integer(text) != 0:
        skipped.value("train.attempt", text)
    return attempt, step, rank


class _Skipped:
    """What reading a run's rows left out, by reason, for the run's warnings."""

    def __init__(self) -> None:
        self.spans: dict[str, int] = {}
        self.values: dict[str, int] = {}
        self.conflicts: list[tuple[int, int, int]] = []
        self.child_conflicts = 0
        #: Lines from :func:`~steptrace.analysis.runs.believed_attempts`: attempts left out or skipped.
        self.attempts: list[str] = []

    def span(self, reason: str) -> None:
        self.spans[reason] = self.spans.get(reason, 0) + 1

    def value(self, key: str, text: Any) -> None:
        if text not in (None, ""):
            # Keyed by the attribute, not by user-chosen suffixes beyond it: the warning stays short.
            name = key if not key.startswith(("train.attrs.", "train.scalar.")) else key.split(".", 2)[1]
            self.values[name] = self.values.get(name, 0) + 1

    def warnings(self, run_id: str) -> list[str]:
        out = []
        if self.spans:
            out.append(f"ClickHouse: {sum(self.spans.values())} span(s) of run {run_id!r} left out, as the views "
                       "leave them out: " + ", ".join(f"{n} {why}" for why, n in sorted(self.spans.items())))
        if self.conflicts:
            listed = ", ".join(f"rank {r} step {s}" + (f" (attempt {a})" if a else "")
                               for a, s, r in sorted(self.conflicts)[:10])
            more = f" and {len(self.conflicts) - 10} more" if len(self.conflicts) > 10 else ""
            out.append(f"ClickHouse: {len(self.conflicts)} rank-step(s) of run {run_id!r} have two different "
                       f"train.step spans: left out of every table as conflicts (the cluster view counts them "
                       f"missing; docs/clickhouse.md): {listed}{more}")
        if self.child_conflicts:
            out.append(f"ClickHouse: {self.child_conflicts} train.compute/train.idle/train.checkpoint span(s) of run "
                       f"{run_id!r} sent with two different contents under one span id: left out")
        out.extend(f"ClickHouse: run {run_id!r}: {line}" for line in self.attempts)
        if self.values:
            out.append(f"ClickHouse: {sum(self.values.values())} attribute value(s) of run {run_id!r} are not "
                       "finite numbers: each left out alone, its span kept (an unreadable train.attempt reads as 0, "
                       "as in the views): " + ", ".join(f"{key} x{n}" for key, n in sorted(self.values.items())))
        return out


#: Step-record fields exported as ``train.<field>`` (steptrace/otlp.py ``_step_spans``) that are numbers.
_STEP_NUMBERS = ("interval_seconds", "compute_seconds", "idle_seconds", "tokens", "samples", "flops",
                 "model_flops", "hardware_flops", "peak_flops", "tokens_per_second", "samples_per_second",
                 "tflops_per_second", "mfu", "hfu", "collective_wait_seconds", "own_seconds", "own_compute_seconds",
                 "before_step_seconds", "exposed_communication_seconds", "collectives_dropped")
_STEP_TEXTS = ("status", "error", "backend", "flops_source", "collective_wait_source")


def _step_record(attrs: Mapping[str, str], unit: tuple[int, int, int], end_ns: int, trace_id: str,
                 status_message: str, skipped: _Skipped) -> dict[str, Any]:
    attempt, step, rank = unit
    world_size = _integer(attrs.get("train.world_size"))
    if world_size is None or world_size < 1:
        skipped.value("train.world_size", attrs.get("train.world_size"))
    record: dict[str, Any] = {"type": "step", "run_id": attrs.get("train.run_id"), "rank": rank,
                              "attempt": attempt, "step": step,
                              "world_size": world_size if world_size is not None and world_size >= 1 else None,
                              "trace_id": trace_id, "end_time": end_ns / 1e9}
    for key in _STEP_NUMBERS:
        value = _number_of(attrs.get("train." + key))
        if value is not None:
            record[key] = value
        else:
            skipped.value("train." + key, attrs.get("train." + key))
    for key in _STEP_TEXTS:
        if attrs.get("train." + key):
            record[key] = attrs["train." + key]
    record.setdefault("status", "ok")
    # A boolean attribute comes back as the exporter's text ("true"); absent on every other step.
    if str(attrs.get("train.first_after_restore", "")).lower() in ("true", "1"):
        record["first_after_restore"] = True
    if record["status"] == "error" and "error" not in record and status_message:
        record["error"] = status_message
    idle: dict[str, float] = {}
    before: dict[str, float] = {}
    wait_idle: dict[str, float] = {}
    groups: dict[str, dict[str, Any]] = {"pipeline_bubble_ratio": {}, "scalars": {}, "device_memory": {},
                                         "attrs": {}}
    prefixes = (("train.pipeline.bubble_ratio.", "pipeline_bubble_ratio"), ("train.scalar.", "scalars"),
                ("train.device_memory.", "device_memory"), ("train.attrs.", "attrs"))
    health: dict[str, Any] = {}
    for key, text in attrs.items():
        if key.startswith(ATTR_HEALTH_PREFIX):
            # The GPU's health window (otlp.py sends it flat: field, or field.key); numbers come back
            # as text, an unsupported field's reason stays text; a null field was never sent.
            field, _, inner = key[len(ATTR_HEALTH_PREFIX):].partition(".")
            number = _number_of(text)
            value = number if number is not None else text
            if inner:
                nested = health.setdefault(field, {})
                if isinstance(nested, dict):
                    nested[inner] = value
            else:
                health[field] = value
            continue
        for prefix, seconds_by in (("train.idle.", idle), (ATTR_BEFORE_STEP_PREFIX, before),
                                   (ATTR_COLLECTIVE_WAIT_IDLE_PREFIX, wait_idle)):
            if key.startswith(prefix) and key.endswith("_seconds"):
                value = _number_of(text)
                if value is not None:
                    seconds_by[key[len(prefix):-len("_seconds")]] = float(value)
                else:
                    skipped.value(prefix + "*", text)
                break
        else:
            for prefix, field in prefixes:
                if key.startswith(prefix):
                    # User attributes come back as the exporter's text: their types are not in otel_traces.
                    if field == "attrs":
                        groups[field][key[len(prefix):]] = text
                    else:
                        value = _number_of(text)
                        if value is None:
                            skipped.value(key if field != "pipeline_bubble_ratio" else prefix + "*", text)
                        groups[field][key[len(prefix):]] = value
                    break
    record["idle_breakdown"] = idle
    if "own_compute_seconds" in record:  # where the wait in collectives fell (records.md)
        record["collective_wait_idle_breakdown"] = wait_idle
    if "before_step_seconds" in record:  # a rank's first step (the time from init() to it)
        record["before_step_breakdown"] = before
        process_start = _number_of(attrs.get(ATTR_PROCESS_START_TIME))
        if process_start is not None:
            record["_process_start"] = float(process_start)  # becomes an attempt record (load_clickhouse_run)
    if health:
        record["health"] = health  # what the report's GPU health and straggler cause read
    record["attrs"] = groups.pop("attrs")
    for field, values in groups.items():
        values = {k: v for k, v in values.items() if v is not None}
        if values:
            record[field] = values
    if "interval_seconds" in record:
        record["start_time"] = record["end_time"] - float(record.get("compute_seconds") or 0.0)
    return record


def _one_version(rows: list[dict[str, Any]], skipped: _Skipped) -> dict[str, Any] | None:
    """The row of a child span (compute, idle, checkpoint) sent once or retried as it was; None (and
    counted) when one span id came with two different contents."""
    contents = {(r["start_ns"], r["ns"], json.dumps(r["attrs"], sort_keys=True)) for r in rows}
    if len(contents) > 1:
        skipped.child_conflicts += 1
        return None
    return rows[0]


def load_clickhouse_run(client: Client, run_id: str, *, table: str = DEFAULT_TABLE, source: str = "") -> Any:
    """The run ``run_id`` rebuilt from the ranks' spans in ``table``, as :func:`steptrace.analysis.runs.load_run`
    gives a run directory: a :class:`~steptrace.analysis.runs.Run` whose step and checkpoint records
    come from the ``train.step``, ``train.compute``, ``train.idle`` and ``train.checkpoint`` spans, and
    whose ``cluster_records`` are :func:`cluster_steps` (the per-step view). What the spans do not
    carry is missing (docs/clickhouse.md lists it). Raises ``RunDirError`` when the run has no spans.

    The rows follow the views' rules (the module's number rules above, and :func:`step_ranks_sql`'s
    conflict rule): a rank that sent two different ``train.step`` spans for one step (a forgery, or
    two processes claiming one rank) has that step in no table, its spans counted as a conflict, as
    the cluster view counts the rank missing there; an exporter retry counts once. What was left out
    is in the run's ``warnings``.
    """
    from steptrace.analysis.runs import Run, RunDirError, believed_attempts

    db = f"{_identifier(client.database, 'database')}.{_identifier(table, 'table')}"
    # DISTINCT: an exporter retry stores the same row twice; different rows under one span id stay.
    rows = client.query(f"""\
SELECT DISTINCT SpanName AS name, SpanAttributes AS attrs, toUnixTimestamp64Nano(Timestamp) AS start_ns,
       Duration AS ns, StatusMessage AS message, TraceId AS trace_id, SpanId AS span_id
FROM {db}
WHERE SpanAttributes['train.run_id'] = {_literal(run_id)}
  AND SpanName IN ('train.step', 'train.compute', 'train.idle', 'train.checkpoint')
ORDER BY start_ns, span_id, ns""")
    if not any(r["name"] == "train.step" for r in rows):
        raise RunDirError(f"{redacted(source) or 'ClickHouse'}: no train.step spans of run {run_id!r} in {db}")
    skipped = _Skipped()
    step_rows: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    # Per (attempt, step, rank), then per span id: the child spans.
    children: dict[str, dict[tuple[int, int, int], dict[str, list[dict[str, Any]]]]] = {
        "train.compute": {}, "train.idle": {}, "train.checkpoint": {}}
    for row in rows:
        attrs = row["attrs"]
        unit = _unit_of(attrs, skipped)
        if unit is None:
            skipped.span(f"{row['name']} without a usable train.step and train.rank")
            continue
        if row["name"] == "train.step":
            # As step_spans_sql: a span without a usable compute or interval is skipped.
            compute, interval = (_number_of(attrs.get("train.compute_seconds")),
                                 _number_of(attrs.get("train.interval_seconds")))
            if compute is None or interval is None or compute < 0 or interval < 0:
                skipped.span("train.step without a usable train.compute_seconds and train.interval_seconds")
                continue
            row["_versions"] = (float(compute), float(interval))
            step_rows.setdefault(unit, []).append(row)
        else:
            children[row["name"]].setdefault(unit, {}).setdefault(row["span_id"], []).append(row)
    steps: dict[int, list[dict[str, Any]]] = {}
    checkpoints: dict[int, list[dict[str, Any]]] = {}
    for unit, versions in step_rows.items():
        attempt, step, rank = unit
        # step_ranks_sql's ``versions``: two different computes or intervals are a conflict, and the
        # rank-step is in no table (whichever came first: ClickHouse has no arrival order).
        if len({v["_versions"][0] for v in versions}) > 1 or len({v["_versions"][1] for v in versions}) > 1:
            skipped.conflicts.append(unit)
            continue
        # One version (retries, or copies that agree): the latest end, as the views' max(end_time).
        row = max(versions, key=lambda r: r["start_ns"] + r["ns"])
        record = _step_record(row["attrs"], unit, row["start_ns"] + row["ns"], row["trace_id"], row["message"],
                              skipped)
        compute_rows = [r for span_rows in children["train.compute"].get(unit, {}).values()
                        if (r := _one_version(span_rows, skipped)) is not None]
        if len({r["start_ns"] for r in compute_rows}) == 1:
            record["start_time"] = compute_rows[0]["start_ns"] / 1e9
        segments = []
        for span_rows in children["train.idle"].get(unit, {}).values():
            idle_row = _one_version(span_rows, skipped)
            if idle_row is not None:
                start_ns = idle_row["start_ns"]
                segments.append([idle_row["attrs"].get("train.idle.reason", ""), start_ns / 1e9,
                                 (start_ns + idle_row["ns"]) / 1e9])
        record["idle_segments"] = sorted(segments, key=lambda s: s[1])
        steps.setdefault(rank, []).append(record)
    for unit, by_span in children["train.checkpoint"].items():
        attempt, step, rank = unit
        for span_rows in by_span.values():
            ckpt = _one_version(span_rows, skipped)
            if ckpt is None:
                continue
            attrs = ckpt["attrs"]
            record: dict[str, Any] = {"type": "checkpoint", "run_id": run_id, "rank": rank, "attempt": attempt,
                                      "step": step, "status": attrs.get("train.status") or "ok",
                                      "start_time": ckpt["start_ns"] / 1e9,
                                      "end_time": (ckpt["start_ns"] + ckpt["ns"]) / 1e9}
            if attrs.get("train.error"):
                record["error"] = attrs["train.error"]
            for field in ("host_seconds", "blocking_seconds", "async_seconds"):
                record[field] = _number_of(attrs.get(f"train.checkpoint.{field}"))
                if record[field] is None:
                    skipped.value(f"train.checkpoint.{field}", attrs.get(f"train.checkpoint.{field}"))
            after = _number_of(attrs.get("train.checkpoint.after_step"))
            record["after_step"] = None if after is None else int(after)
            checkpoints.setdefault(rank, []).append(record)
    records_by_rank = {rank: sorted(steps.get(rank, []) + checkpoints.get(rank, []),
                                    key=lambda r: (r["attempt"], r["end_time"]))
                       for rank in sorted(set(steps) | set(checkpoints))}
    for rank in records_by_rank:
        # Any holder of the ingest token can write a row claiming a later attempt: believe an attempt
        # only as far as its own times allow (two process starts of one rank cannot overlap).
        records_by_rank[rank], lines = believed_attempts(records_by_rank[rank])
        skipped.attempts.extend(lines)
    for rank, records in records_by_rank.items():
        # An attempt's first step carries its process start: the attempt record goodput's wall begins at.
        started = [(r["attempt"], r.pop("_process_start"), r) for r in records if "_process_start" in r]
        for attempt, process_start, first in reversed(started):
            init = first["end_time"] - float(first.get("interval_seconds") or 0.0) - float(
                first.get("before_step_seconds") or 0.0)
            records.insert(records.index(first), {"type": "attempt", "run_id": run_id, "rank": rank,
                                                  "attempt": attempt, "start_time": min(process_start, init),
                                                  "init_time": init})
    cluster = [{"type": "cluster_step", **row} for row in cluster_steps(client, run_id, table=table)]
    path = ClickHouseSource(f"{redacted(source)} {db}".strip())
    path.run_id = run_id
    return Run(path=path, records_by_rank=records_by_rank, cluster_records=cluster,  # type: ignore[arg-type]
               warnings=skipped.warnings(run_id))


def open_run(url: str, run_id: str, *, table: str = DEFAULT_TABLE, timeout_s: float = 60.0) -> Any:
    """``steptrace report/compare --clickhouse URL``: run ``run_id`` from the ClickHouse at ``url``.

    Raises ``RunDirError`` (with the reason) for a bad URL, a missing chDB, a ClickHouse error or
    a run with no spans, so the commands report it as they report an unreadable run directory.
    """
    from steptrace.analysis.runs import RunDirError

    if not run_id:
        raise RunDirError("--clickhouse needs the run's id (--run RUN_ID)")
    try:
        return load_clickhouse_run(connect(url, timeout_s=timeout_s), run_id, table=table, source=url)
    except (ValueError, ImportError, ClickHouseError) as exc:
        if isinstance(exc, RunDirError):
            raise
        raise RunDirError(f"{redacted(url)}: {exc}") from None


# --- `steptrace clickhouse` ----------------------------------------------------------------------

DESCRIPTION = ("SQL for the OpenTelemetry Collector's ClickHouse exporter table (otel_traces): the table's DDL, "
               "steptrace's per-step cross-rank views, and those views' rows for a run (docs/clickhouse.md).")


def add_clickhouse_arguments(parser: Any) -> Any:
    commands = parser.add_subparsers(dest="clickhouse_command", required=True, metavar="WHAT")
    views = commands.add_parser("views", help="print CREATE VIEW statements for the per-step views",
                                description="Print the CREATE OR REPLACE VIEW statements of steptrace's views "
                                            f"({STEP_RANKS_VIEW}, {CLUSTER_STEPS_VIEW}) over the exporter's "
                                            "table, ';'-separated, for clickhouse-client --multiquery.")
    ddl = commands.add_parser("ddl", help="print the exporter's otel_traces CREATE TABLE",
                              description="Print the contrib ClickHouse exporter's traces table DDL (what its "
                                          "create_schema makes), for a server where the exporter may not create it.")
    steps = commands.add_parser("steps", help="print a run's per-step cross-rank rows as JSON lines",
                                description="Run the per-step view for one run and print one JSON object a step.")
    views.add_argument("--typed", action="store_true",
                       help=f"also a typed table ({TYPED_TABLE}) kept by a materialized view, which the views "
                            "read: for thousands of ranks")
    for sub in (views, ddl):
        sub.add_argument("--database", default="default", help="the exporter's database (default: default)")
        sub.add_argument("--table", default=DEFAULT_TABLE,
                         help=f"the exporter's traces table (default {DEFAULT_TABLE})")
    steps.add_argument("url", metavar="URL", help="http(s)://host:8123[/?database=NAME] or chdb:///path")
    steps.add_argument("--run", required=True, metavar="RUN_ID", help="the run")
    steps.add_argument("--table", default=DEFAULT_TABLE, help=f"the exporter's traces table (default {DEFAULT_TABLE})")
    steps.add_argument("--world-size", type=int, default=None, metavar="N",
                       help="the job's world size (default: what the spans say), as the collector's --world-size")
    return parser


def run_clickhouse(args: Any) -> int:
    import sys

    try:
        if args.clickhouse_command == "views":
            print(";\n\n".join(views_sql(args.database, args.table, typed=args.typed)) + ";")
        elif args.clickhouse_command == "ddl":
            print(otel_traces_ddl(args.database, args.table).rstrip() + ";")
        else:
            client = connect(args.url)
            for row in cluster_steps(client, args.run, table=args.table, world_size=args.world_size):
                print(json.dumps(row))
    except (ValueError, ImportError, ClickHouseError) as exc:
        print(f"steptrace clickhouse: {exc}", file=sys.stderr)
        return 2
    return 0
