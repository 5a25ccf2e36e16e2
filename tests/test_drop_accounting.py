"""Exact drop accounting and run files that survive anything (the hostile-input issue, rank side)."""

import errno
import json
import os

import pytest

import steptrace
from steptrace._sinks import JsonlSink
from steptrace.testing import MemorySink

from conftest import have


@pytest.mark.skipif(not have("opentelemetry.sdk"), reason="needs the otlp extra")
def test_a_batch_stuck_in_a_hanging_export_is_counted_and_the_run_record_has_the_final_counts(device):
    from otlp_receiver import OtlpHttpReceiver

    with OtlpHttpReceiver(hang_s=30) as rx:
        memory = MemorySink()
        steptrace.init(sinks=[memory], otlp_endpoint=rx.url, jsonl=False, run_id="hang", otlp_timeout_s=20,
                       otlp_metrics_interval_s=60)
        for n in range(50):
            with steptrace.step(n) as s:
                s.wait_for(device.run(0.0005))
        steptrace.shutdown(timeout_s=2)
    (run,) = memory.of_type("run")
    offered = len(memory.records) - 1  # every record but the run record went to the OTLP sink too
    # Nothing reached the hanging endpoint: every record offered to it is counted, in the run record too.
    # The attempt record makes no span: written at init, it may be "exported" alone, before the hang.
    assert run["dropped"]["sink:otlp"] in (offered, offered - 1)
    assert run["dropped"]["sink:otlp"] >= 51  # the 50 steps and the metadata record at least


def test_one_unencodable_record_costs_that_record_alone(tmp_path, device):
    loop = {}
    loop["self"] = loop  # a circular value in one step's attrs
    steptrace.init(run_dir=str(tmp_path), run_id="circ", backend=device)
    for n in range(20):
        with steptrace.step(n, **({"bad": loop} if n == 7 else {})) as s:
            s.wait_for(device.run(0.0002))
    steptrace.shutdown()
    lines = (tmp_path / "circ" / "rank-0.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"type":"step"' in line]
    assert sorted(s["step"] for s in steps) == [n for n in range(20) if n != 7]
    run = json.loads(lines[-1])
    assert run["dropped"] == {"invalid:jsonl": 1}


class _DiskFullOnce:
    """A file whose next write stores half the data, then fails as a full disk does."""

    def __init__(self, real):
        self.real = real
        self.failed = False

    def write(self, data):
        if not self.failed:
            self.failed = True
            self.real.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_failed_write_leaves_no_torn_line_behind(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    sink = JsonlSink(path)
    sink.export([{"type": "step", "step": 0}])
    sink._file = _DiskFullOnce(sink._file)
    with pytest.raises(OSError):
        sink.export([{"type": "step", "step": 1}, {"type": "step", "step": 2}])
    sink.export([{"type": "step", "step": 3}])  # the disk was freed
    sink.shutdown(1)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 3]


def test_a_failed_write_that_cannot_be_cut_back_starts_the_next_line_fresh(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    sink = JsonlSink(path)
    sink._file = _DiskFullOnce(sink._file)
    sink._file.truncate = lambda size: (_ for _ in ()).throw(OSError(errno.EIO, "io"))
    with pytest.raises(OSError):
        sink.export([{"type": "step", "step": 1, "pad": "x" * 50}])
    sink.export([{"type": "step", "step": 2}])
    sink.shutdown(1)
    from steptrace.analysis.runs import _read_rank_file

    warnings = []
    assert [r["step"] for r in _read_rank_file(path, warnings)] == [2]
    assert "skipped 1 unreadable line" in warnings[0]


def test_a_restart_with_the_same_run_id_after_a_crash_mid_line_keeps_every_record_readable(tmp_path):
    from steptrace.analysis.runs import load_run

    run_dir = tmp_path / "same"
    for attempt in range(3):
        steptrace.init(run_dir=str(tmp_path), run_id="same")
        for n in range(attempt * 10, attempt * 10 + 5):
            with steptrace.step(n):
                pass
        steptrace.shutdown()
        with open(run_dir / "rank-0.jsonl", "a") as f:
            f.write('{"type":"step","step":99')  # killed mid-line
    run = load_run(run_dir)
    assert [s["step"] for s in run.steps()] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    assert sum(run.skipped_lines.values()) == 3
    assert os.path.getsize(run_dir / "rank-0.jsonl") > 0
