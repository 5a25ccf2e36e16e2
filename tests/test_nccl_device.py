"""NCCL collectives timed on the device, on the simulated GPU (tests/fake_cuda.py + tests/fake_nccl.py).

Each rank's records carry its collectives' device durations (arrival -> completion, two CUDA events on
its current stream); joined across ranks by (group, sequence number) they split into the wait for the
latest peer and the transfer, and name the rank that waited least. Exposed communication is the part
of a collective the waiting stream had no work to overlap. Expected values come from the fake's
script (device time), so they are exact up to float32 milliseconds, never a wall-clock threshold.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

import steptrace
from steptrace.analysis.collectives import SOURCE_NCCL_DEVICE, join_device_collectives
from steptrace.analysis.stragglers import straggler_sentence, straggler_steps, summarize_stragglers
from steptrace.testing import capture

torch = pytest.importorskip("torch", reason="the CUDA path is torch's: pip install steptrace[torch]")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fake_cuda import FakeCuda  # noqa: E402
from fake_nccl import FakeNccl  # noqa: E402

from steptrace.adapters import torch_distributed  # noqa: E402

pytestmark = pytest.mark.integration

MS = 1e-3
EXACT = 1e-6  # float32 milliseconds of a few tens of ms: sub-microsecond


@pytest.fixture(autouse=True)
def _untrack(monkeypatch):
    """Take steptrace's wrappers off before monkeypatch puts the real torch.distributed back (this fixture
    asks for monkeypatch, so it is torn down first): untracking later would put the fake's functions,
    which the wrappers were made around, back onto torch.distributed for every later test."""
    yield
    torch_distributed.untrack_collectives()


def _rank_and_peer(patch, transfer_s: float, peer_late_s: float = 0.0) -> tuple[FakeCuda, FakeNccl]:
    """Rank 0 of two on the simulated GPU (no drift: the script's seconds are the device's); its peer
    arrives at every collective ``peer_late_s`` after it."""
    fake = FakeCuda(patch, drift_ppm=0.0)
    return fake, FakeNccl(patch, fake, rank=0, world_size=2, transfer_s=transfer_s,
                          peer_arrivals=lambda group, seq: {1: peer_late_s})


def _run_rank(monkeypatch, rank: int, compute_s: dict[int, float], *, steps: int = 4,
              transfer_s: float = 5 * MS, **settings) -> list[dict]:
    """One rank of a synchronous job: compute, then a synchronous all-reduce, per step. Peers arrive
    at each collective when their compute (the script) is done."""
    with monkeypatch.context() as patch:
        fake = FakeCuda(patch, drift_ppm=0.0)  # the script's seconds are the device's
        FakeNccl(patch, fake, rank=rank, world_size=len(compute_s), transfer_s=transfer_s,
                 peer_arrivals=lambda group, seq: {p: compute_s[p] - compute_s[rank]
                                                   for p in compute_s if p != rank})
        with capture(rank=rank, world_size=len(compute_s), **settings) as sink:
            for n in range(steps):
                with steptrace.step(n):
                    fake.run(compute_s[rank])
                    torch.distributed.all_reduce(object())
        return sink.steps()


def test_a_rank_slowed_by_25_ms_waits_least_and_the_others_wait_25_ms(monkeypatch):
    compute = {0: 20 * MS, 1: 20 * MS, 2: 45 * MS, 3: 20 * MS}  # rank 2 slowed by 25 ms
    by_rank = {rank: _run_rank(monkeypatch, rank, compute) for rank in compute}
    for rank, steps in by_rank.items():
        assert len(steps) == 4
        for step in steps:
            (group, seq, device_seconds, exposed_seconds), = step["collectives"]
            assert group == "0" and seq == step["step"] + 1
            # On the device: the wait for the latest peer + the 5 ms transfer.
            expected = (45 * MS - compute[rank]) + 5 * MS
            assert device_seconds == pytest.approx(expected, abs=EXACT), (rank, step["step"])
            # A synchronous collective: the stream had nothing to overlap it with.
            assert exposed_seconds == pytest.approx(expected, abs=EXACT)
            assert step["exposed_communication_seconds"] == pytest.approx(expected, abs=EXACT)
            assert "collective_wait_seconds" not in step  # one rank alone cannot know its wait
    assert join_device_collectives(by_rank) == 16
    for rank, steps in by_rank.items():
        for step in steps:
            assert step["collective_wait_source"] == SOURCE_NCCL_DEVICE
            wait = 0.0 if rank == 2 else 25 * MS
            assert step["collective_wait_seconds"] == pytest.approx(wait, abs=EXACT), (rank, step["step"])
            assert step["own_seconds"] == pytest.approx(step["interval_seconds"] - wait, abs=EXACT)
            assert step["own_compute_seconds"] == pytest.approx(step["compute_seconds"] - wait, abs=EXACT)
            assert step["collective_wait_idle_breakdown"] == {}
    verdicts = straggler_steps(by_rank, 4)
    assert [v["straggler_rank"] for v in verdicts] == [2, 2, 2, 2]
    for v in verdicts:
        assert v["straggler_cost_seconds"] == pytest.approx(25 * MS, abs=EXACT)
    summary = summarize_stragglers(verdicts)
    assert summary["top"] == "2" and summary["ranks"]["2"]["share_of_steps"] == 1.0
    assert straggler_sentence(summary).startswith("rank 2 cost the job 25 ms per step")


def _exposed(monkeypatch, overlap_s: float, transfer_s: float = 10 * MS) -> tuple[dict, tuple]:
    """A rank alone (its peers arrive with it): an async all-reduce, ``overlap_s`` of compute on the
    current stream while it runs, then ``wait()``."""
    with monkeypatch.context() as patch:
        fake, nccl = _rank_and_peer(patch, transfer_s)
        with capture(rank=0, world_size=2) as sink:
            with steptrace.step(0):
                fake.run(50 * MS)  # keeps the host ahead of the device: the events mark device time
                work = torch.distributed.all_reduce(object(), async_op=True)
                fake.run(overlap_s)  # compute that does not need the result
                work.wait()
                fake.run(1 * MS)  # the optimizer, on the reduced gradients
        (step,) = sink.steps()
        return step, nccl.kernels[0]


@pytest.mark.parametrize("overlap_ms, exposed_ms", [(10.0, 0.0), (15.0, 0.0), (5.0, 5.0), (0.0, 10.0)])
def test_exposed_communication_is_the_collective_time_no_compute_overlapped(monkeypatch, overlap_ms, exposed_ms):
    """HolisticTraceAnalysis: communication kernel time not overlapped by compute. A 10 ms all-reduce
    fully overlapped by 10 (or 15) ms of compute on the current stream exposes 0; half-overlapped, 5 ms."""
    step, (_, _, start, end) = _exposed(monkeypatch, overlap_ms * MS)
    assert end - start == pytest.approx(10 * MS, abs=EXACT)  # the fake ran it for its transfer
    (_, _, device_seconds, exposed_seconds), = step["collectives"]
    assert exposed_seconds == pytest.approx(exposed_ms * MS, abs=EXACT)
    assert step["exposed_communication_seconds"] == pytest.approx(exposed_ms * MS, abs=EXACT)
    # From arrival to the point the stream resumed would hold the overlapped compute too: not measured.
    assert device_seconds is None
    assert step.get("collectives_dropped", 0) == 0


def test_collectives_are_not_device_timed_on_gloo(monkeypatch):
    """The device path installs on NCCL only; gloo's waits are the host's (the CPU path)."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, MS)
        patch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
        assert torch_distributed.track_device_collectives() == []
        patch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
        assert "all_reduce" in torch_distributed.track_device_collectives()
        torch_distributed.untrack_collectives()  # inside the fake: the wrappers are around its functions


# -- the fake's own rules ---------------------------------------------------------------------------

def test_fake_nccl_a_collective_a_peer_never_joins_never_completes(monkeypatch):
    fake = FakeCuda(monkeypatch, drift_ppm=0.0)
    nccl = FakeNccl(monkeypatch, fake, rank=0, world_size=3, transfer_s=MS,
                    peer_arrivals=lambda group, seq: {1: 0.0, 2: None})
    work = torch.distributed.all_reduce(object(), async_op=True)
    work.wait()
    after = torch.cuda.Event(enable_timing=True)
    after.record()  # queued behind the stream's wait on the collective
    before = torch.cuda.Event(enable_timing=True)
    time.sleep(0.005)
    assert not work.is_completed() and not after.query()
    with pytest.raises(RuntimeError, match="recorded"):
        before.elapsed_time(after)  # never recorded
    before.record(fake.Stream())  # another stream is not held
    with pytest.raises(RuntimeError, match="completed"):
        before.elapsed_time(after)
    assert nccl.kernels[0][3] == float("inf")


def test_fake_nccl_the_collective_waits_for_the_current_stream_and_the_latest_peer(monkeypatch):
    fake = FakeCuda(monkeypatch, drift_ppm=0.0)
    nccl = FakeNccl(monkeypatch, fake, rank=0, world_size=2, transfer_s=3 * MS,
                    peer_arrivals=lambda group, seq: {1: 7 * MS})
    kernel = fake.run(20 * MS)
    torch.distributed.all_reduce(object(), async_op=True)
    (_, seq, start, end), = nccl.kernels
    assert seq == 1
    assert start == pytest.approx(kernel.end_time, abs=EXACT)  # syncStream: after the queued kernel
    assert end - start == pytest.approx(7 * MS + 3 * MS, abs=EXACT)  # latest peer + transfer
    # The host did not wait: the call returned long before the collective ended.
    assert time.perf_counter() < end


def test_the_report_over_jsonl_joins_the_ranks_and_names_the_slowed_rank(monkeypatch, tmp_path, capsys):
    """``steptrace report`` loads the ranks' files, joins their device-timed collectives and gives the
    verdict the gloo path gives: rank 1, slowed by 25 ms, cost the job 25 ms per step."""
    from steptrace.analysis.report import main

    compute = {0: 20 * MS, 1: 45 * MS, 2: 20 * MS}
    for rank in compute:
        _run_rank(monkeypatch, rank, compute, steps=5, jsonl=True, run_dir=str(tmp_path), run_id="nccl")
    assert main([str(tmp_path / "nccl"), "--json"]) == 0
    stragglers = json.loads(capsys.readouterr().out)["stragglers"]
    assert stragglers["top"] == "1"
    assert stragglers["sentence"].startswith("rank 1 cost the job 25 ms per step")


def test_a_collective_only_one_rank_reported_gives_no_wait():
    """Its peers' files are missing: nothing says how long it waited, so no wait is claimed (not 0)."""
    step = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1,
            "collectives": [["0", 1, 0.03, 0.03]]}
    alone = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1,
             "collectives": [["0", 2, 0.03, 0.03]]}
    peer = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1,
            "collectives": [["0", 1, 0.01, 0.01]]}
    assert join_device_collectives({0: [step, alone], 1: [peer]}) == 2
    assert step["collective_wait_seconds"] == pytest.approx(0.02) and peer["collective_wait_seconds"] == 0.0
    assert "collective_wait_seconds" not in alone


def test_a_step_with_an_async_collective_of_unknown_duration_gets_no_wait():
    """An async collective's duration is null (its arrival-to-wait time holds overlapped compute): the
    step's wait is unknown, so none is claimed, even for the synchronous collective beside it."""
    mixed = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1,
             "collectives": [["0", 1, 0.03, 0.03], ["0", 2, None, 0.002]]}
    peer_mixed = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1,
                  "collectives": [["0", 1, 0.01, 0.01], ["0", 2, None, 0.0]]}
    sync = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1, "collectives": [["0", 3, 0.03, 0.03]]}
    peer_sync = {"type": "step", "interval_seconds": 0.1, "compute_seconds": 0.1, "collectives": [["0", 3, 0.01, 0.01]]}
    assert join_device_collectives({0: [mixed, sync], 1: [peer_mixed, peer_sync]}) == 2
    assert "collective_wait_seconds" not in mixed and "collective_wait_seconds" not in peer_mixed
    assert sync["collective_wait_seconds"] == pytest.approx(0.02) and peer_sync["collective_wait_seconds"] == 0.0


def test_collectives_past_the_bound_are_counted_in_the_step(monkeypatch):
    """Thousands of collectives in a step: past MAX_DEVICE_COLLECTIVES they are not timed, and the
    record says how many (collectives_dropped), never silently fewer."""
    monkeypatch.setattr(torch_distributed, "MAX_DEVICE_COLLECTIVES", 3)
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, MS)
        with capture(rank=0, world_size=2) as sink:
            with steptrace.step(0):
                for _ in range(5):
                    torch.distributed.all_reduce(object())
    (step,) = sink.steps()
    assert [entry[1] for entry in step["collectives"]] == [1, 2, 3]
    assert step["collectives_dropped"] == 2


def test_a_collective_inside_a_cuda_graph_capture_is_not_timed_and_is_counted(monkeypatch):
    """An event recorded into a stream being captured becomes a node of the user's graph (fake_cuda's
    capture rule): the wrapper leaves the capture alone and counts the collective as not timed."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, MS)
        with capture(rank=0, world_size=2) as sink:
            with steptrace.step(0):
                fake.run(20 * MS)
                torch.distributed.all_reduce(object())
                with fake.graph_capture():
                    torch.distributed.all_reduce(object())
    assert fake.records_on_capturing_stream == 0
    (step,) = sink.steps()
    assert [entry[1] for entry in step["collectives"]] == [1]
    assert step["collectives_dropped"] == 1


def test_a_collective_between_steps_counts_in_the_next_step(monkeypatch):
    """A loss all-reduce after ``with step(n)`` closed ends within the next step's interval: it is
    given to the next step's first collective, as the gloo path gives its wait."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, 4 * MS)
        with capture(rank=0, world_size=2) as sink:
            with steptrace.step(0):
                fake.run(20 * MS)
            torch.distributed.all_reduce(object())
            with steptrace.step(1):
                fake.run(20 * MS)
                torch.distributed.all_reduce(object())
    first, second = sink.steps()
    assert "collectives" not in first
    between, inside = second["collectives"]
    assert between[1] == 1 and between[2] == pytest.approx(4 * MS, abs=EXACT)
    assert inside[1] == 2 and inside[2] == pytest.approx(4 * MS, abs=EXACT)


def test_collectives_after_the_last_step_are_counted_at_the_runs_end(monkeypatch):
    """A collective that completes after the last step is held for a next step that never comes, and
    an async one never waited for is never timed: at the run's end both are counted in the run
    record's drops (collectives_after_last_step), not lost silently; the steps keep only their own."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, 4 * MS)
        with capture(rank=0, world_size=2) as sink:
            with steptrace.step(0):
                fake.run(20 * MS)
                torch.distributed.all_reduce(object())
            torch.distributed.all_reduce(object())  # a loss all-reduce after the last step
            torch.distributed.all_reduce(object(), async_op=True)  # its Work never waited for
            before_the_end = steptrace.stats()["dropped"]
    (step,) = sink.steps()
    assert [entry[1] for entry in step["collectives"]] == [1]
    assert "collectives_after_last_step" not in before_the_end  # still held for a next step until the end
    (run,) = sink.of_type("run")
    assert run["dropped"]["collectives_after_last_step"] == 2


def test_a_run_after_a_run_does_not_inherit_its_collectives_after_the_last_step(monkeypatch):
    """What the first run counted at its end is gone: the next run's first step holds only its own."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, 4 * MS)
        with capture(rank=0, world_size=2, run_id="first") as first:
            with steptrace.step(0):
                fake.run(20 * MS)
            torch.distributed.all_reduce(object())
        with capture(rank=0, world_size=2, run_id="second") as second:
            with steptrace.step(0):
                fake.run(20 * MS)
                torch.distributed.all_reduce(object())
    assert first.of_type("run")[0]["dropped"]["collectives_after_last_step"] == 1
    (step,) = second.steps()
    assert len(step["collectives"]) == 1
    assert "collectives_after_last_step" not in second.of_type("run")[0]["dropped"]


def test_exposed_communication_is_served_to_prometheus_as_the_steps_sum(monkeypatch):
    """steptrace_step_exposed_communication_seconds_total adds the steps' exposed communication: here
    a peer arriving 10 ms late and a 5 ms transfer, 15 ms a step, 45 ms over three."""
    pytest.importorskip("prometheus_client", reason="pip install 'steptrace[prometheus]'")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, 5 * MS, 10 * MS)
        with capture(rank=0, world_size=2, prometheus_port=0) as sink:
            for n in range(3):
                with steptrace.step(n):
                    fake.run(20 * MS)
                    torch.distributed.all_reduce(object())
            assert steptrace.flush(10)
            with urllib.request.urlopen(steptrace.stats()["endpoints"]["prometheus"], timeout=5) as response:
                text = response.read().decode()
    served = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == "steptrace_step_exposed_communication_seconds_total"]
    assert served == [pytest.approx(45 * MS, abs=3 * EXACT)]
    assert served[0] == pytest.approx(sum(s["exposed_communication_seconds"] for s in sink.steps()), rel=1e-12)


def test_exposed_communication_travels_over_otlp_into_clickhouse(monkeypatch):
    """``train.exposed_communication_seconds`` on the step span: ``report --clickhouse`` reads the
    figure the JSONL record holds."""
    pytest.importorskip("chdb", reason="the ClickHouse path runs on chDB: pip install 'steptrace[clickhouse]'")
    from otlp_receiver import OtlpHttpReceiver

    from steptrace.analysis import clickhouse as ch

    with OtlpHttpReceiver() as receiver:
        (step,) = _run_rank(monkeypatch, 0, {0: 20 * MS, 1: 30 * MS}, steps=1, otlp_endpoint=receiver.url,
                            otlp_timeout_s=2, run_id="nccl-otlp")
        requests = receiver.trace_requests()
    database = f"nccl_{int(time.time() * 1e6)}"
    ch.connect("chdb://").command(f"CREATE DATABASE {database}")
    client = ch.connect(f"chdb://?database={database}")
    client.command(ch.otel_traces_ddl(database))
    ch.insert_rows(client, [row for request in requests for row in ch.rows_from_otlp(request)])
    run = ch.load_clickhouse_run(client, "nccl-otlp")
    (loaded,) = [r for r in run.records_by_rank[0] if r.get("type") == "step"]
    assert step["exposed_communication_seconds"] == pytest.approx(15 * MS, abs=EXACT)  # 10 ms wait + 5 ms
    assert loaded["exposed_communication_seconds"] == pytest.approx(step["exposed_communication_seconds"], rel=1e-12)


def test_reading_the_collectives_never_breaks_a_global_mode_graph_capture(monkeypatch):
    """The resolver reads the collectives' events while the training thread captures a CUDA graph in
    'global' mode: a query from another thread would invalidate it (fake_cuda's capture rule,
    pytorch#104487) unless that thread is in thread-local capture mode, as the step's own reads are."""
    with monkeypatch.context() as patch:
        fake, _ = _rank_and_peer(patch, MS)
        with capture(rank=0, world_size=2) as sink:
            for n in range(3):
                with steptrace.step(n):
                    fake.run(5 * MS)
                    torch.distributed.all_reduce(object())
                with fake.graph_capture():
                    time.sleep(0.03)  # the resolver finalizes the step meanwhile
    assert fake.captures_invalidated == 0 and fake.unsafe_calls_during_capture == []
    assert [len(s["collectives"]) for s in sink.steps()] == [1, 1, 1]


def test_the_collector_joins_the_ranks_device_timed_collectives_from_their_spans(monkeypatch):
    """Each rank's step span carries its collectives (``train.collectives.*``); the collector's join of a
    step's spans gives each rank its wait (duration - the shortest rank's) and names the slowed rank,
    as the analysis over the ranks' files does."""
    pytest.importorskip("prometheus_client", reason="the collector needs prometheus_client")
    from otlp_receiver import OtlpHttpReceiver

    from steptrace.collector._decode import extract_steps
    from steptrace.collector._join import Joiner

    compute = {0: 20 * MS, 1: 20 * MS, 2: 45 * MS, 3: 20 * MS}  # rank 2 slowed by 25 ms
    spans = []
    with OtlpHttpReceiver() as receiver:
        for rank in compute:
            _run_rank(monkeypatch, rank, compute, otlp_endpoint=receiver.url, otlp_timeout_s=2, run_id="nccl-join")
        for request in receiver.trace_requests():
            spans += extract_steps(request).steps
    assert len(spans) == 16 and all(s.collectives and len(s.collectives) == 1 for s in spans)
    joiner = Joiner(world_size=4, per_rank=True)
    records = joiner.add(spans).records + joiner.flush().records
    steps = sorted((r for r in records if r["type"] == "cluster_step"), key=lambda r: r["step"])
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for record in steps:
        waits = record["rank_collective_wait_seconds"]
        assert waits["2"] == 0.0
        assert all(waits[r] == pytest.approx(25 * MS, abs=EXACT) for r in ("0", "1", "3"))
    for record in steps[1:]:  # step 0's interval also holds each rank's own start (its first step)
        assert record["straggler_rank"] == 2, repr(record)
        assert record["straggler_cost_seconds"] == pytest.approx(25 * MS, rel=0.2)


def test_the_collector_claims_no_wait_from_a_partial_or_untimed_view():
    """A missing rank (the shortest duration may be its), a collective not on every rank in this step,
    or an async one (null duration): the spans keep no wait."""
    from steptrace.collector._decode import StepSpan
    from steptrace.collector._join import with_device_waits

    def span(rank, collectives):
        return StepSpan(run_id="r", step=0, rank=rank, world_size=2, trace_id="", compute_seconds=0.1,
                        interval_seconds=0.1, collectives=collectives)

    full = [span(0, (("0", 1, 0.03),)), span(1, (("0", 1, 0.01),))]
    joined = with_device_waits(full, 2)
    assert [s.collective_wait_seconds for s in joined] == [pytest.approx(0.02), 0.0]
    assert joined[0].own_seconds == pytest.approx(0.08) and joined[0].own_compute_seconds == pytest.approx(0.08)
    for spans, world in ((full[:1], 2), (full, 3), ([span(0, (("0", 1, 0.03),)), span(1, (("0", 2, 0.01),))], 2),
                         ([span(0, (("0", 1, None),)), span(1, (("0", 1, 0.01),))], 2),
                         ([span(0, (("0", 1, 0.03),)), span(1, None)], 2)):
        assert all(s.collective_wait_seconds is None for s in with_device_waits(spans, world))
