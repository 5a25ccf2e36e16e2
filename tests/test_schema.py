"""Every record written matches the schema module, and the docs name every drop reason."""

import sys
import time
import typing
from pathlib import Path

import steptrace
from steptrace import _schema
from steptrace.testing import SimulatedDevice, capture

ROOT = Path(__file__).resolve().parent.parent


def _check(record):
    cls = {"metadata": _schema.MetadataRecord, "step": _schema.StepRecord, "microbatch": _schema.MicrobatchRecord,
           "checkpoint": _schema.CheckpointRecord, "span": _schema.SpanRecord, "run": _schema.RunRecord,
           "attempt": _schema.AttemptRecord, "stall": _schema.StallRecord,
           "stall_end": _schema.StallEndRecord, "capture": _schema.CaptureRecord}[record["type"]]
    hints = typing.get_type_hints(cls, include_extras=True)
    optional = {k for k, v in hints.items() if typing.get_origin(v) is typing.NotRequired}
    assert set(record) <= set(hints), set(record) - set(hints)
    assert set(hints) - optional <= set(record), set(hints) - optional - set(record)


def test_every_record_type_matches_its_typed_definition():
    device = SimulatedDevice()
    # A capture that finds no profiler still writes its record (skipped, and why).
    with capture(backend=device, stall_min_s=0.2, stall_factor=2.0, capture="request",
                 capture_profiler="jax" if "jax" in sys.modules else "torch") as sink:
        steptrace.request_capture()
        for n in range(4):
            with steptrace.step(n, tokens=100, flops=1e9) as s:
                with steptrace.span("data"):
                    time.sleep(0.6 if n == 3 else 0.0)  # a stall (and its end) in the last step
                with steptrace.microbatch(0, stage=0):
                    device.run(0.001)
                s.wait_for(device.run(0.002))
            with steptrace.checkpoint(n):
                pass
    kinds = {r["type"] for r in sink.records}
    assert set(_schema.RECORD_TYPES) <= kinds
    for record in sink.records:
        _check(record)


def test_the_docs_name_every_drop_reason():
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = [r for r in _schema.KNOWN_DROP_REASONS if r not in docs]
    assert not missing, f"document these drop reasons: {missing}"
