"""What a hard exit loses over OTLP, and the boundaries that bound it (issue 32 #8a).

The OTLP sink waits ``otlp_batch_delay_s`` (0.5 s by default) for more records before an export, so a
process killed with ``os._exit`` or SIGKILL loses what waited (bench/otlp_hard_exit.py measures it; the
JSONL file is the durable copy). At a checkpoint and when the stall watch reports a stall the batch goes
out at once: a process that dies right after a checkpoint, or is killed as hung, has sent every step
before it. The sink here waits an hour for its batches, so nothing but those boundaries (and flush or
shutdown, which a killed process never reaches) can send them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="OTLP export needs opentelemetry-exporter-otlp (pip install 'steptrace[otlp]')")

from otlp_receiver import OtlpHttpReceiver  # noqa: E402

from steptrace._sinks import SinkWorker  # noqa: E402


class _BoundaryRecorder:
    """A sink that gathers for a minute and, like the OTLP sink, sends at once after ``flush_at`` records."""

    name = "recorder"
    flush_at = frozenset(("checkpoint", "stall"))

    def __init__(self, batch_delay_s: float = 60.0):
        self.batch_delay_s = batch_delay_s
        self.batches: list[list[dict]] = []

    def export(self, records):
        self.batches.append([dict(r) for r in records])

    def force_flush(self, timeout_s):
        return True

    def shutdown(self, timeout_s):
        pass


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("boundary", ["checkpoint", "stall"])
def test_a_checkpoint_or_a_stall_sends_the_batch_without_waiting_out_the_delay(boundary):
    """Steps 0-2 then a checkpoint (or a stall) with a 60 s batch delay: all four go in one export within
    the 30 s deadline, which the delay alone could not meet; the step after it waits for its batch again."""
    sink = _BoundaryRecorder(60.0)
    drops: dict[str, int] = {}
    worker = SinkWorker(sink, 1000, lambda reason, n: drops.__setitem__(reason, drops.get(reason, 0) + n))
    try:
        for n in range(3):
            worker.offer([{"type": "step", "step": n}])
        worker.offer([{"type": boundary, "step": 2}])
        assert _wait_for(lambda: sink.batches)
        assert [[(r["type"], r["step"]) for r in b] for b in sink.batches] == \
            [[("step", 0), ("step", 1), ("step", 2), (boundary, 2)]]
        worker.offer([{"type": "step", "step": 3}])
        worker.offer([{"type": "stall_end", "step": 3}])  # not a boundary: a rank that moved on is not at risk
        time.sleep(0.3)
        assert len(sink.batches) == 1  # gathering again
    finally:
        assert worker.stop(time.monotonic() + 10)
    assert [r["step"] for r in sink.batches[-1]] == [3, 3] and drops == {}


def test_a_sink_without_a_delay_or_boundaries_is_unchanged():
    """JSONL and custom sinks (no ``batch_delay_s``) export each offer as it comes, whatever its type."""
    sink = _BoundaryRecorder(0.0)
    worker = SinkWorker(sink, 1000, lambda reason, n: None)
    try:
        for kind in ("step", "checkpoint", "step"):
            worker.offer([{"type": kind, "step": 0}])
            n = len(sink.batches) + 1
            assert _wait_for(lambda n=n: len(sink.batches) >= n)
    finally:
        worker.stop(time.monotonic() + 10)
    assert [[r["type"] for r in b] for b in sink.batches] == [["step"], ["checkpoint"], ["step"]]


RANK_SCRIPT = r'''
import os, sys, time
import steptrace
from steptrace.otlp import OtlpSink

endpoint, run_dir, boundary, ready = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]


class HourLongBatches(OtlpSink):
    """The OTLP sink with batches that wait an hour: only a boundary can send them before the kill."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_delay_s = 3600.0


sink = HourLongBatches(endpoint, run_id="hardexit", metrics_interval_s=3600, timeout_s=5)
steptrace.init(run_id="hardexit", jsonl=True, run_dir=run_dir, sinks=[sink], stall_min_s=0.3, stall_factor=1.0)
for n in range(10):
    with steptrace.step(n):
        time.sleep(0.01)
if boundary == "checkpoint":
    with steptrace.checkpoint(9):
        time.sleep(0.02)
open(ready, "w").close()
n = 10
while True:  # trains on (or, for "stall", hangs in step 10) until it is killed; too slowly to fill a
    with steptrace.step(n):  # batch (1,024 records) within the test's 60 s, which would send it
        time.sleep(0.1 if boundary == "checkpoint" else 3600)
    n += 1
'''


@pytest.mark.parametrize("boundary", ["checkpoint", "stall"])
def test_a_process_killed_right_after_a_checkpoint_or_a_stall_has_sent_every_step_before_it(tmp_path, boundary):
    """SIGKILL once the checkpoint (or the stall) span arrived: steps 0-9 arrived before or with it, though
    the sink's batches wait an hour; the JSONL file has them too (and, after a checkpoint, the steps the
    rank ran on to, which the kill cost the OTLP copy)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ready = tmp_path / "ready"
    with OtlpHttpReceiver() as receiver:
        proc = subprocess.Popen([sys.executable, str(script), receiver.url, str(tmp_path / "runs"), boundary,
                                 str(ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            name = "train.checkpoint" if boundary == "checkpoint" else "train.stall"
            arrived = _wait_for(lambda: any(s.name == name for s in receiver.spans()) or proc.poll() is not None,
                                timeout_s=60)
            assert proc.poll() is None, proc.communicate()[1]
            assert arrived, f"no {name} span within 60 s (the batch delay is an hour)"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        steps = sorted(s.attributes["train.step"] for s in receiver.spans() if s.name == "train.step")
    assert steps[:10] == list(range(10)), steps
    assert len(steps) == 10 or boundary == "checkpoint"
    lines = (tmp_path / "runs" / "hardexit" / "rank-0.jsonl").read_text().splitlines()
    jsonl_steps = [r["step"] for r in map(json.loads, lines) if r.get("type") == "step"]
    assert jsonl_steps[:10] == list(range(10))
