"""The rank side against a collector that refuses spans or answers too much (issue 25, defects 5 and 13).

A collector refusing spans in ``partial_success`` once left the rank reporting
``dropped={}`` and ``flush()`` True; an endpoint answering 3 GiB drove the
training process to 2 GiB RSS. Both failed before the fix.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("opentelemetry.sdk", reason="OTLP export needs opentelemetry-sdk (pip install 'steptrace[otlp]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="OTLP export needs opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")
pytest.importorskip("prometheus_client", reason="the collector needs prometheus_client")

import steptrace  # noqa: E402
from collector_helpers import collectors  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
                 "STEPTRACE_RANK", "RANK", "STEPTRACE_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_the_collector_refuses_are_counted_as_drops_and_flush_says_so(tmp_path, protocol):
    """The collector takes one rank (world size 1); rank 3's step spans come back in partial_success."""
    if protocol == "grpc":
        pytest.importorskip("grpc", reason="OTLP/gRPC needs grpcio")
        pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="needs the OTLP gRPC exporter")
    with collectors(tmp_path / "runs") as make:
        c = make(world_size=1, grpc_port=0 if protocol == "grpc" else None)
        endpoint = c.endpoint if protocol != "grpc" else f"http://127.0.0.1:{c.grpc_port}"
        memory = MemorySink()
        steptrace.init(sinks=[memory], otlp_endpoint=endpoint, otlp_protocol=protocol, jsonl=False, run_id="r",
                       rank=3, world_size=4, otlp_metrics_interval_s=30, otlp_timeout_s=5)
        for n in range(3):
            with steptrace.step(n):
                pass
        assert steptrace.flush(timeout_s=10) is False, "flush() must say that spans were refused"
        assert steptrace.stats()["dropped"] == {"rejected:otlp:rank_out_of_range": 3}
        assert steptrace.flush(timeout_s=10) is True  # nothing refused since
        steptrace.shutdown(timeout_s=10)
    (run,) = memory.of_type("run")
    assert run["dropped"] == {"rejected:otlp:rank_out_of_range": 3}


def test_rejected_spans_are_on_the_ranks_metrics():
    from steptrace.prometheus import PrometheusSink  # noqa: F401  (the mapping below is what it serves)
    from steptrace.prometheus import _drop_labels

    assert _drop_labels("rejected:otlp:too_many_runs") == ("otlp", "rejected:too_many_runs")
    assert _drop_labels("sink:otlp") == ("otlp", "queue_full_or_error")


HUGE_RESPONSE = textwrap.dedent("""
    import resource, socket, threading, steptrace

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sent = [0]

    def serve():
        while True:
            conn, _ = server.accept()
            try:
                data = b""
                while b"\\r\\n\\r\\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\\r\\n\\r\\n")
                length = int([l for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")][0]
                             .split(b":")[1])
                while len(rest) < length:
                    rest += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/x-protobuf\\r\\n"
                             b"Content-Length: 3221225472\\r\\n\\r\\n")
                chunk = b"\\0" * (1 << 20)
                for _ in range(512):  # 512 MiB of the 3 GiB announced, then hang up
                    conn.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steptrace.init(otlp_endpoint=f"http://127.0.0.1:{port}", jsonl=False, run_id="r", otlp_timeout_s=20,
                   otlp_metrics_interval_s=300)
    with steptrace.step(0):
        pass
    steptrace.flush(timeout_s=30)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) // 1024, sent[0] >> 20)
    steptrace.shutdown(timeout_s=5)
""")


def test_a_huge_otlp_response_does_not_grow_the_training_process():
    """Defect 13: a 3 GiB answer drove the training process to 2 GiB RSS; it now reads a bounded prefix."""
    out = subprocess.run([sys.executable, "-c", HUGE_RESPONSE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib, _sent_mib = (int(x) for x in out.stdout.split()[:2])
    assert grown_mib < 64, f"the training process grew {grown_mib} MiB reading an OTLP response"
