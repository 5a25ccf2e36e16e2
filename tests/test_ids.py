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


def test_the_per_run_trace_id_function_gives_the_documented_ids():
    """What the record builder calls per step (the key's prefix hashed once) gives trace_id_hex's digits,
    in the first attempt and a later one, and for a step number that is not a plain int."""
    from steptrace._ids import trace_id_hex_of_run

    class Step(int):
        pass

    for run_id, attempt in (("llama-8b-0419", 0), ("r/ü", 3), ("x", 0)):
        of_step = trace_id_hex_of_run(run_id, attempt)
        for step in (0, 1, 9, 10, 1234, 10**12, -1, Step(5)):
            assert of_step(step) == trace_id_hex(run_id, step, attempt)
    assert trace_id_hex_of_run("llama-8b-0419")(1234) == f"{trace_id('llama-8b-0419', 1234):032x}"
