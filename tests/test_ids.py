"""Trace ids are a documented function of (run_id, step): ranks agree without talking."""

import hashlib

from steptrace._ids import span_id, trace_id, trace_id_hex


def test_trace_id_is_the_documented_hash():
    expected = int.from_bytes(hashlib.sha256(b"steptrace/llama-8b-0419/1234").digest()[:16], "big")
    assert trace_id("llama-8b-0419", 1234) == expected
    assert trace_id_hex("llama-8b-0419", 1234) == f"{expected:032x}"
    assert len(trace_id_hex("r", 0)) == 32


def test_trace_id_depends_on_run_and_step_only():
    assert trace_id("r", 1) == trace_id("r", 1)
    assert len({trace_id("r", n) for n in range(1000)}) == 1000
    assert trace_id("r", 1) != trace_id("s", 1)


def test_span_ids_differ_by_rank_and_role_and_fit_64_bits():
    ids = {span_id("r", 1, rank, role) for rank in range(8) for role in ("step", "compute", "idle/0")}
    assert len(ids) == 24
    assert all(0 < i < 2**64 for i in ids)
