"""The tracker sinks (steptrace.trackers, issue 36): TensorBoard, MLflow and W&B, each read back with
the tracker's own reader and compared with the rank's JSONL records at the same steps.

What the trackers' documented rules require of a writer, and what these tests hold the sinks to:

* TensorBoard: event files read by ``EventAccumulator``; an event carries its own ``step``; a
  writer needs a directory of its own, since TensorBoard follows only the newest event file of a
  directory (tensorflow/tensorboard#1011). With ``brain.Event:2`` files (``EventFileWriter``'s)
  the reader keeps an out-of-order step (it purges only at a ``SessionLog.START``,
  ``event_accumulator._CheckForRestartAndMaybePurge``).
* MLflow: ``log_batch`` takes explicit steps and millisecond timestamps, at most 1000 metrics a
  request (``MlflowClient.log_batch``); MLflow 3 refuses the file store unless
  ``MLFLOW_ALLOW_FILE_STORE=true`` (mlflow-skinny has no SQL store), so the tests opt in to it.
* W&B: ``log()`` without ``step=`` never hits "Tried to log to step N that is less than the current
  step"; the x axis is ``steptrace/step`` by ``define_metric``; offline mode writes the run's
  transaction log, read here with W&B's own protobuf records (tests/wandb_log.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import steptrace
from steptrace import trackers
from steptrace.trackers import MlflowSink, TensorBoardSink, WandbSink, tracker_points


TESTS_DIR = str(Path(__file__).parent)  # child scripts import fake_mlflow_server from here
REPO = Path(__file__).resolve().parents[1]


def _records(run_dir: Path, run_id: str, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (run_dir / run_id / f"rank-{rank}.jsonl").open()]


def _train(run_dir: Path, run_id: str, **settings) -> list[dict]:
    """Eight steps with tokens, a data span, a checkpoint after step 3 and a stall in step 5."""
    steptrace.init(run_dir=str(run_dir), run_id=run_id, backend="host", stall_min_s=0.15, stall_factor=1.0,
                   **settings)
    try:
        for n in range(8):
            with steptrace.step(n, tokens=256, flops=1e9) as s:
                with steptrace.span("data"):
                    time.sleep(0.002)
                time.sleep(0.6 if n == 5 else 0.01)
                s.log(loss=1.0 / (n + 1))
            if n == 3:
                with steptrace.checkpoint(n):
                    time.sleep(0.02)
    finally:
        steptrace.shutdown()
    return _records(run_dir, run_id)


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """key (namespaced) -> step -> value, as the sinks map the records."""
    out: dict[str, dict[int, float]] = {}
    for point in tracker_points(records):
        for key, value in point.values.items():
            out.setdefault("steptrace/" + key, {})[point.step] = value
    return out


def _logged_loss(records: list[dict]) -> dict[int, float]:
    """step -> the loss _train logged with s.log, from the JSONL records (issue 48: it reaches the trackers)."""
    loss = {r["step"]: r["scalars"]["loss"] for r in records if r.get("type") == "step"}
    assert loss == pytest.approx({n: 1.0 / (n + 1) for n in range(8)})
    return loss


def test_the_points_are_the_records_own_numbers_at_their_own_steps():
    records = [
        {"type": "attempt", "start_time": 100.0},
        {"type": "step", "step": 7, "status": "ok", "host_start_time": 101.0, "end_time": 102.0,
         "interval_seconds": 1.0, "compute_seconds": 0.6, "idle_breakdown": {"data": 0.3, "other": 0.1},
         "collective_wait_seconds": 0.25, "own_seconds": 0.75, "own_compute_seconds": 0.45,
         "collective_wait_idle_breakdown": {"other": 0.1}, "tokens_per_second": 512.0, "mfu": 0.4,
         "device_memory": {"in_use_bytes": 10, "peak_bytes": 20}, "before_step_seconds": 0.5},
        {"type": "checkpoint", "step": 7, "after_step": 7, "end_time": 103.0, "blocking_seconds": 0.2,
         "host_seconds": 0.3, "async_seconds": None},
        {"type": "stall", "step": 8, "start_time": 103.0, "open_seconds": 60.0},
        {"type": "stall_end", "step": 8, "start_time": 103.0, "lasted_seconds": 75.0},
        {"type": "step", "step": "bad", "interval_seconds": 1.0},  # malformed: nothing written
    ]
    step, checkpoint, stall, stall_end = tracker_points(records)
    assert step.step == 7 and step.wall_time == 102.0
    # Waiting shown as waiting: own compute + wait + idle by reason (less the wait in it) = interval.
    assert step.values == pytest.approx({
        "interval_seconds": 1.0, "compute_seconds": 0.45, "collective_wait_seconds": 0.25,
        "idle/data_seconds": 0.3, "idle/other_seconds": 0.0, "tokens_per_second": 512.0, "mfu": 0.4,
        "device_memory_in_use_bytes": 10.0, "device_memory_peak_bytes": 20.0, "before_step_seconds": 0.5,
        "goodput": 0.45 / 2.0})  # own compute over the wall from the process start (100) to the step's end
    assert checkpoint == (7, 103.0, {"checkpoint/blocking_seconds": 0.2, "checkpoint/host_seconds": 0.3})
    assert stall == (8, 163.0, {"stall/open_seconds": 60.0})
    assert stall_end == (8, 178.0, {"stall/lasted_seconds": 75.0})


def test_tensorboard_reads_back_every_value_at_its_step_in_a_directory_per_rank(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = _train(tmp_path, "tb", trackers="tensorboard")
    rank_dir = tmp_path / "tb" / "tensorboard" / "rank_0"
    (event_file,) = os.listdir(rank_dir)  # one writer, one file, in the rank's own directory
    assert event_file.endswith(".steptrace-rank0")
    reader = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
    reader.Reload()
    expected = _expected(records)
    assert set(reader.Tags()["scalars"]) == set(expected)
    assert {"steptrace/checkpoint/blocking_seconds", "steptrace/stall/open_seconds",
            "steptrace/idle/data_seconds", "steptrace/goodput", "steptrace/tflops_per_second"} <= set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in reader.Scalars(tag)}
        assert got == pytest.approx(by_step, rel=1e-6), tag  # TensorBoard scalars are 32-bit floats
    assert {e.step: e.value for e in reader.Scalars("steptrace/scalars/loss")} == \
        pytest.approx(_logged_loss(records), rel=1e-6)
    steps = {r["step"]: r for r in records if r.get("type") == "step"}
    assert {e.step: e.value for e in reader.Scalars("steptrace/interval_seconds")} == \
        pytest.approx({n: r["interval_seconds"] for n, r in steps.items()}, rel=1e-6)
    assert reader.Scalars("steptrace/stall/open_seconds")[0].step == 5


def _bound(sink, tmp_path, rank=0, world_size=1, run_id="late"):
    sink.bind(SimpleNamespace(rank=rank, world_size=world_size, run_id=run_id, run_dir=str(tmp_path),
                              tensorboard_dir=None))
    return sink


def _late_records() -> list[dict]:
    """Steps 4 and 5 finalized, then step 3's values and a checkpoint of step 2: they arrive late."""
    def step(n):
        return {"type": "step", "step": n, "status": "ok", "end_time": 1000.0 + n, "interval_seconds": 0.1 * n,
                "compute_seconds": 0.05 * n, "idle_breakdown": {"other": 0.05 * n}}
    return [step(4), step(5), step(3), {"type": "checkpoint", "step": 2, "end_time": 1001.5, "blocking_seconds": 0.7}]


def test_a_value_that_arrives_after_later_steps_is_written_at_its_own_step(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tb, ml = _bound(TensorBoardSink(), tmp_path), _bound(MlflowSink(), tmp_path)
    for sink in (tb, ml):
        for record in _late_records():
            sink.export([record])
        sink.force_flush(5)
        sink.shutdown(5)
    reader = EventAccumulator(tb.rank_dir)
    reader.Reload()
    assert {e.step: e.value for e in reader.Scalars("steptrace/interval_seconds")} == \
        pytest.approx({3: 0.3, 4: 0.4, 5: 0.5})
    history = MlflowClient().get_metric_history(ml.mlflow_run_id, "steptrace/interval_seconds")
    assert {m.step: m.value for m in history} == pytest.approx({3: 0.3, 4: 0.4, 5: 0.5})
    assert {m.step: m.timestamp for m in history} == {3: 1003000, 4: 1004000, 5: 1005000}
    (checkpoint,) = MlflowClient().get_metric_history(ml.mlflow_run_id, "steptrace/checkpoint/blocking_seconds")
    assert (checkpoint.step, checkpoint.value) == (2, 0.7)


def test_mlflow_reads_back_every_value_in_the_ranks_own_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    records = _train(tmp_path, "ml", trackers="mlflow")
    client = MlflowClient()
    (run,) = client.search_runs(experiment_ids=["0"])
    assert run.info.run_name == "ml/rank-0" and run.info.status == "FINISHED"
    assert run.data.tags["steptrace.run_id"] == "ml" and run.data.tags["steptrace.rank"] == "0"
    expected = _expected(records)
    assert set(run.data.metrics) == set(expected)
    for key, by_step in expected.items():
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == \
            pytest.approx(by_step, rel=1e-12), key
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "steptrace/scalars/loss")} == \
        pytest.approx(_logged_loss(records), rel=1e-12)


def test_mlflow_writes_beside_the_users_metrics_in_the_run_they_opened(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with mlflow.start_run(run_name="users") as users:
        mlflow.log_metric("loss", 2.5, step=0)
        _train(tmp_path, "beside", trackers="mlflow")
        mlflow.log_metric("loss", 1.5, step=8)
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs(experiment_ids=["0"])
    assert run.info.run_id == users.info.run_id and run.info.status == "FINISHED"  # ended by the user, once
    assert "loss" in run.data.metrics and "steptrace/interval_seconds" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "steptrace/interval_seconds")) == 8


def test_wandb_offline_run_holds_every_value_on_the_steptrace_step_axis(tmp_path, monkeypatch):
    from wandb_log import history, run_config, transaction_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # W&B's service is a process of its own: on a loaded CI machine its start and finish() can outlast
    # the default 10 s shutdown, and what the sink had not handed over would be dropped (counted).
    records = _train(tmp_path, "wb", sinks=[WandbSink(dir=tmp_path, project="steptrace-test")],
                     shutdown_timeout_s=120.0)
    (run_record,) = [r for r in records if r["type"] == "run"]
    assert not run_record.get("dropped"), run_record["dropped"]
    log_file = transaction_log(tmp_path)
    assert run_config(log_file) == {"name": "rank-0", "group": "wb", "job_type": "steptrace"}
    got: dict[str, dict[int, float]] = {}
    for row in history(log_file):
        for key, value in row.items():
            if key.startswith("steptrace/") and key != "steptrace/step":
                got.setdefault(key, {})[row["steptrace/step"]] = value
    expected = _expected(records)
    assert set(got) == set(expected)
    for key, by_step in expected.items():
        assert got[key] == pytest.approx(by_step, rel=1e-12), key
    assert got["steptrace/scalars/loss"] == pytest.approx(_logged_loss(records), rel=1e-12)


def test_wandb_writes_late_values_at_their_own_step(tmp_path, monkeypatch):
    from wandb_log import history, transaction_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = _bound(WandbSink(dir=tmp_path), tmp_path)
    for record in _late_records():
        sink.export([record])
    sink.shutdown(10)
    log_file = transaction_log(tmp_path)
    rows = [r for r in history(log_file) if "steptrace/step" in r]
    assert [r["steptrace/step"] for r in rows] == [4, 5, 3, 2]  # logged in arrival order ...
    by_step = {r["steptrace/step"]: r for r in rows}  # ... each at its own step on the axis
    assert by_step[3]["steptrace/interval_seconds"] == pytest.approx(0.3)
    assert by_step[2]["steptrace/checkpoint/blocking_seconds"] == 0.7


def test_unknown_or_uninstalled_trackers_fail_at_init_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'neptune'.*known: tensorboard, mlflow, wandb"):
        steptrace.init(run_dir=str(tmp_path), trackers="tensorboard,neptune")
    monkeypatch.setenv("STEPTRACE_TRACKERS", "comet")
    with pytest.raises(ValueError, match="STEPTRACE_TRACKERS"):
        steptrace.init(run_dir=str(tmp_path))
    monkeypatch.delenv("STEPTRACE_TRACKERS")
    for module in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    try:
        with pytest.raises(ValueError, match=r"pip install 'steptrace\[tensorboard\]'"):
            steptrace.init(run_dir=str(tmp_path), run_id="missing", trackers=["tensorboard"])
    finally:
        steptrace.shutdown()
    # A failed init leaves nothing behind: no run file, no attempt recorded.
    assert not (tmp_path / "missing").exists() or not any((tmp_path / "missing").glob("rank-*.jsonl"))


def test_a_wandb_mode_wandb_does_not_have_fails_where_the_sink_is_made():
    with pytest.raises(ValueError, match="'online', 'offline', 'disabled' or 'shared'"):
        WandbSink(mode="ofline")


def test_mlflow_naming_a_run_that_does_not_exist_fails_at_init(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with pytest.raises(ValueError, match="trackers: mlflow cannot open its run"):
        steptrace.init(run_dir=str(tmp_path), sinks=[MlflowSink(run_id="0" * 32)])


class _Blocking(TensorBoardSink):
    """A tracker whose writes block until released (a hung server)."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def _write(self, points):
        self.release.wait()
        super()._write(points)


class _Failing(TensorBoardSink):
    def _write(self, points):
        raise ConnectionError("tracker unreachable")


def test_a_hung_or_failing_tracker_never_holds_a_step_and_its_losses_are_counted(tmp_path):
    release = threading.Event()
    hung = _Blocking(release)
    steptrace.init(run_dir=str(tmp_path), run_id="hung", backend="host", sinks=[hung], max_queue=16)
    try:
        for n in range(200):  # would never finish if a step waited for the tracker
            with steptrace.step(n):
                time.sleep(0.005)  # the resolver keeps up (but for a stall of this machine); the tracker's queue fills
        steptrace.flush(timeout_s=1.0)
        dropped = steptrace.stats()["dropped"]
    finally:
        release.set()
        steptrace.shutdown()
    assert dropped.get("sink:tensorboard", 0) > 100, dropped
    steps = [r for r in _records(tmp_path, "hung") if r.get("type") == "step"]
    assert len(steps) + dropped.get("resolver_queue", 0) == 200  # nothing lost silently; the JSONL has the rest

    steptrace.init(run_dir=str(tmp_path), run_id="failing", backend="host", sinks=[_Failing()])
    for n in range(5):
        with steptrace.step(n):
            pass
    steptrace.flush()
    dropped = steptrace.stats()["dropped"]
    steptrace.shutdown()
    assert dropped["sink:tensorboard"] >= 5  # every record it was given (steps, attempt, metadata)
    run = [r for r in _records(tmp_path, "failing") if r.get("type") == "run"][0]
    assert run["dropped"]["sink:tensorboard"] >= dropped["sink:tensorboard"]


def test_ranks_sharing_an_mlflow_run_write_under_their_rank(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    shared = MlflowClient().create_run("0").info.run_id
    for rank in (0, 1):
        sink = _bound(MlflowSink(run_id=shared), tmp_path, rank=rank, world_size=2)
        sink.export(_late_records()[:1])
        sink.shutdown(5)
    metrics = MlflowClient().get_run(shared).data.metrics
    assert {"steptrace/rank_0/interval_seconds", "steptrace/rank_1/interval_seconds"} <= set(metrics)
    assert MlflowClient().get_run(shared).info.status == "RUNNING"  # not ours to end


TORCHRUN_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import steptrace
dist.init_process_group("gloo")
steptrace.init(run_dir=sys.argv[1], run_id=sys.argv[2], backend="host", trackers=sys.argv[3])
rank = dist.get_rank()
for n in range(int(sys.argv[4])):
    with steptrace.step(n):
        time.sleep(0.01 * (1 + rank) + (float(sys.argv[5]) if rank == 1 else 0.0))
        dist.all_reduce(torch.ones(1))
steptrace.shutdown()
dist.destroy_process_group()
"""


def _torchrun(tmp_path, run_id, trackers, steps=6, slow_s=0.0, env=None):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path), run_id, trackers, str(steps), str(slow_s)],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]


def test_two_gloo_ranks_under_torchrun_each_write_their_own_numbers(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pytest.importorskip("torch.distributed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    _torchrun(tmp_path, "ddp", "tensorboard,mlflow")
    tb_dirs = sorted(os.listdir(tmp_path / "ddp" / "tensorboard"))
    assert tb_dirs == ["rank_0", "rank_1"]
    client = MlflowClient()
    runs = {r.data.tags["steptrace.rank"]: r for r in client.search_runs(experiment_ids=["0"])}
    assert sorted(runs) == ["0", "1"]
    for rank in (0, 1):
        records = _records(tmp_path, "ddp", rank)
        waits = {r["step"]: r["collective_wait_seconds"] for r in records if r.get("type") == "step"}
        assert sorted(waits) == list(range(6))
        # Each writer holds only its own rank's files: one event file per directory.
        assert len(os.listdir(tmp_path / "ddp" / "tensorboard" / f"rank_{rank}")) == 1
        reader = EventAccumulator(str(tmp_path / "ddp" / "tensorboard" / f"rank_{rank}"))
        reader.Reload()
        assert {e.step: e.value for e in reader.Scalars("steptrace/collective_wait_seconds")} == \
            pytest.approx(waits, rel=1e-6, abs=1e-9)
        history = client.get_metric_history(runs[str(rank)].info.run_id, "steptrace/collective_wait_seconds")
        assert {m.step: m.value for m in history} == pytest.approx(waits, rel=1e-12, abs=1e-12)
    # Rank 0 is faster: it waits for rank 1 in the all-reduce, and the trackers show that wait.
    rank0 = _records(tmp_path, "ddp", 0)
    assert sum(r["collective_wait_seconds"] for r in rank0 if r.get("type") == "step" and r["step"] > 0) > 0.03


def test_the_tracker_registry_names_an_extra_per_tracker():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, extra in trackers.TRACKERS.items():
        assert extra in extras, name


# -- aggregate mode: the collector's joined steps, one writer for the job ---------------------------------


def _joined_job(tmp_path, **config):
    """A 3-rank job through a real collector: rank 2 spends 30 ms more on its own in steps 5..19, the others
    wait for it in collectives. Returns the collector's cluster_step records."""
    pytest.importorskip("opentelemetry.proto", reason="the collector needs steptrace[collector]")
    from collector_helpers import PROTOBUF, body, post, read_records, step_span
    from steptrace.collector import Collector, CollectorConfig

    collector = Collector(CollectorConfig(port=0, metrics_port=0, world_size=3, window_s=60.0,
                                          run_dir=str(tmp_path / "collector"), **config)).start()
    try:
        for step in range(20):
            spans = []
            for rank in range(3):
                slow = rank == 2 and step >= 5
                wait = 0.002 if slow else (0.032 if step >= 5 else 0.002 + 0.0005 * rank)
                spans.append(step_span(run_id="job", step=step, rank=rank, compute=0.08, interval=0.1,
                                       **{"train.collective_wait_seconds": wait,
                                          "train.own_seconds": 0.1 - wait}))
            status, _, _ = post(collector.port, "/v1/traces", body(*spans), PROTOBUF)
            assert status == 200
    finally:
        collector.close()
    return [r for r in read_records(tmp_path / "collector" / "job" / "cluster.jsonl")
            if r.get("type") == "cluster_step"], collector


def test_the_collector_writes_the_jobs_aggregates_and_its_straggler_to_tensorboard_and_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from steptrace.trackers import cluster_tracker_points
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    records, collector = _joined_job(tmp_path, trackers=("tensorboard", "mlflow"))
    assert sorted(r["step"] for r in records) == list(range(20))
    expected: dict[str, dict[int, float]] = {}
    for point in cluster_tracker_points(records):
        for key, value in point.values.items():
            expected.setdefault("steptrace/" + key, {})[point.step] = value
    # The straggler is named from step 5 on (once the run's noise floor is known), with its cost.
    named = expected["steptrace/cluster/straggler_rank"]
    assert set(named.values()) == {2.0} and min(named) >= 5 and len(named) >= 12
    assert all(v == pytest.approx(0.03) for v in expected["steptrace/cluster/straggler_cost_seconds"].values())
    assert expected["steptrace/cluster/slowest/1_rank"][10] == 2.0
    assert {"steptrace/cluster/interval_seconds/median", "steptrace/cluster/own_seconds/max",
            "steptrace/cluster/collective_wait_seconds/min", "steptrace/cluster/compute_share"} <= set(expected)

    reader = EventAccumulator(str(tmp_path / "collector" / "job" / "tensorboard" / "cluster"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        assert {e.step: e.value for e in reader.Scalars(tag)} == pytest.approx(by_step, rel=1e-6), tag

    client = MlflowClient()
    (run,) = client.search_runs(experiment_ids=["0"])
    assert run.info.run_name == "job/cluster" and run.data.tags["steptrace.role"] == "cluster"
    for key, by_step in expected.items():
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == \
            pytest.approx(by_step, rel=1e-12), key
    assert run.info.status == "FINISHED"  # closed with the collector


def test_a_collector_tracker_that_cannot_open_drops_and_counts_and_the_join_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "no-sqlalchemy-here.db"))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    records, collector = _joined_job(tmp_path, trackers=("mlflow",))
    assert len(records) == 20  # the join and cluster.jsonl are untouched
    samples = collector.metrics.tracker_dropped.labels("mlflow", "open_failed")._value.get()
    try:
        import sqlalchemy  # noqa: F401  (full mlflow: the sqlite store opens, nothing is dropped)
        assert samples == 0
    except ImportError:
        assert samples == 20


def test_the_collector_refuses_an_unknown_or_missing_tracker_at_setup(tmp_path, monkeypatch):
    from steptrace.collector import CollectorConfig

    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        CollectorConfig(trackers=("comet",))
    assert CollectorConfig(trackers="tensorboard, wandb").trackers == ("tensorboard", "wandb")
    from steptrace.collector import Collector

    for module in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")] + ["wandb"]:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ValueError, match=r"pip install 'steptrace\[wandb\]'"):
        Collector(CollectorConfig(port=0, metrics_port=0, run_dir=str(tmp_path), trackers=("wandb",)))


def test_the_collectors_tracker_queue_is_bounded_and_a_hung_tracker_never_holds_the_join():
    from steptrace.collector._trackers import ClusterTrackers

    release, drops, written = threading.Event(), [], []

    class Hung:
        def bind(self, config):
            pass

        def export(self, records):
            release.wait()
            written.extend(records)

        def force_flush(self, timeout_s):
            return True

        def shutdown(self, timeout_s):
            pass

    trackers = ClusterTrackers(["tensorboard"], run_dir="unused", max_queue=10,
                               count_drop=lambda *drop: drops.append(drop), make_sink=lambda name: Hung())
    for step in range(40):  # returns at once every time: the join never waits for a tracker
        trackers.offer([{"type": "cluster_step", "run_id": "r", "step": step}, {"type": "late", "run_id": "r"}])
    assert sum(n for _, reason, n in drops if reason == "queue_full") >= 29
    release.set()
    assert trackers.close(10)
    assert len(written) + sum(n for _, _, n in drops) == 40  # nothing lost silently


def test_the_collector_writes_the_jobs_aggregates_to_a_wandb_run_of_its_own(tmp_path, monkeypatch):
    from steptrace.trackers import cluster_tracker_points
    from wandb_log import history, run_config, transaction_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    records, _ = _joined_job(tmp_path, trackers="wandb")
    log_file = transaction_log(tmp_path)
    assert run_config(log_file) == {"name": "cluster", "group": "job", "job_type": "steptrace"}
    rows = {r["steptrace/step"]: r for r in history(log_file) if "steptrace/step" in r}
    for point in cluster_tracker_points(records):
        for key, value in point.values.items():
            assert rows[point.step]["steptrace/" + key] == pytest.approx(value, rel=1e-12), (point.step, key)
    assert rows[12]["steptrace/cluster/straggler_rank"] == 2


@pytest.mark.parametrize(("world_size", "rank", "setting", "writes"), [
    (8, 5, None, True),            # a small job: every rank writes its own numbers
    (64, 63, None, True),
    (128, 0, None, True),          # past 64 ranks: rank 0 alone (the collector writes the job's view)
    (128, 37, None, False),
    (128, 37, "all", True),
    (128, 37, "0,37", True),
    (8, 5, [0, 3], False),
])
def test_which_ranks_write_to_the_trackers(tmp_path, world_size, rank, setting, writes):
    from steptrace.testing import MemorySink

    settings = {} if setting is None else {"tracker_ranks": setting}
    with warnings_caught() as caught:
        config = steptrace.init(run_dir=str(tmp_path), run_id="ranks", rank=rank, world_size=world_size,
                                trackers="tensorboard", jsonl=False, sinks=[MemorySink()], **settings)
    steptrace.shutdown()
    assert (tmp_path / "ranks" / "tensorboard" / f"rank_{rank}").exists() == writes
    warned = [w for w in caught if "rank 0 alone writes" in str(w.message)]
    assert bool(warned) == (world_size > 64 and rank == 0 and setting is None)
    assert config.tracker_ranks == {None: "auto", "all": "all", "0,37": "0,37"}.get(
        setting if isinstance(setting, str) or setting is None else "list", "0,3")


def warnings_caught():
    import warnings

    class _Catch(warnings.catch_warnings):
        def __enter__(self):
            caught = super().__enter__()
            warnings.simplefilter("always")
            return caught

    return _Catch(record=True)


def test_a_bad_tracker_ranks_setting_fails_at_init(tmp_path):
    with pytest.raises(ValueError, match="tracker_ranks must be 'auto', 'all' or ranks"):
        steptrace.init(run_dir=str(tmp_path), trackers="tensorboard", tracker_ranks="rank0")


def test_the_step_offset_moves_every_value_onto_the_frameworks_axis(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sink = MlflowSink()
    sink.bind(SimpleNamespace(rank=0, world_size=1, run_id="offset", run_dir=str(tmp_path), tensorboard_dir=None,
                              tracker_step_offset=1))
    sink.export(_late_records())
    sink.shutdown(5)
    history = MlflowClient().get_metric_history(sink.mlflow_run_id, "steptrace/interval_seconds")
    assert {m.step: m.value for m in history} == pytest.approx({4: 0.3, 5: 0.4, 6: 0.5})
    with pytest.raises(ValueError, match="tracker_step_offset must be an integer"):
        steptrace.init(run_dir=str(tmp_path), tracker_step_offset=0.5)


def test_two_gloo_ranks_under_torchrun_in_aggregate_mode_show_the_job_and_its_straggler(tmp_path):
    """The ranks export OTLP to a real collector with --trackers tensorboard; no rank writes a tracker of its
    own. Rank 1 spends 60 ms more per step on its own; rank 0 waits for it in the all-reduce."""
    pytest.importorskip("torch.distributed")
    pytest.importorskip("opentelemetry.exporter.otlp", reason="the ranks export OTLP: steptrace[otlp]")
    from steptrace.collector import Collector, CollectorConfig
    from steptrace.trackers import cluster_tracker_points
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from collector_helpers import read_records

    collector = Collector(CollectorConfig(port=0, metrics_port=0, world_size=2, window_s=60.0,
                                          run_dir=str(tmp_path / "collector"), trackers=("tensorboard",))).start()
    try:
        _torchrun(tmp_path, "agg", "", steps=14, slow_s=0.06,
                  env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "STEPTRACE_OTLP_BATCH_DELAY_S": "0.1"})
    finally:
        collector.close()
    assert not (tmp_path / "agg" / "tensorboard").exists()  # no per-rank writer
    joined = [r for r in read_records(tmp_path / "collector" / "agg" / "cluster.jsonl")
              if r.get("type") == "cluster_step"]
    assert sorted(r["step"] for r in joined) == list(range(14)) and all(r["complete"] for r in joined)
    reader = EventAccumulator(str(tmp_path / "collector" / "agg" / "tensorboard" / "cluster"))
    reader.Reload()
    expected: dict[str, dict[int, float]] = {}
    for point in cluster_tracker_points(joined):
        for key, value in point.values.items():
            expected.setdefault("steptrace/" + key, {})[point.step] = value
    assert set(reader.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        assert {e.step: e.value for e in reader.Scalars(tag)} == pytest.approx(by_step, rel=1e-6), tag
    named = {e.step: e.value for e in reader.Scalars("steptrace/cluster/straggler_rank")}
    steady = list(range(2, 14))
    assert sum(named.get(step) == 1.0 for step in steady) >= 0.9 * len(steady), named
    costs = [e.value for e in reader.Scalars("steptrace/cluster/straggler_cost_seconds")]
    assert statistics.median(costs) == pytest.approx(0.07, rel=0.4)  # 60 ms more, and 10 ms less of rank 0's own


class _HangsAtFlushAndShutdown(TensorBoardSink):
    """A tracker whose own force_flush and shutdown never return, as MLflow's do with its server gone after
    init() (its HTTP client retries for minutes), W&B's finish() with its service stuck, TensorBoard's close()
    behind a stuck writer. Its exports work; nothing it was given is ever confirmed written."""

    def __init__(self, hang: threading.Event):
        super().__init__()
        self.hang = hang
        self.entered: list[str] = []

    def force_flush(self, timeout_s):
        self.entered.append("force_flush")
        self.hang.wait()
        return True

    def shutdown(self, timeout_s):
        self.entered.append("shutdown")
        self.hang.wait()


def test_flush_and_shutdown_return_within_their_timeout_whatever_a_tracker_does(tmp_path):
    """Issue 48: each sink's own force_flush/shutdown runs off the caller's thread with a bound. flush(1.0)
    and shutdown(2.0) return (False: not everything finished) though the tracker never does, and what the
    tracker had not confirmed written is counted as dropped under sink:tensorboard, in the run record too."""
    hang = threading.Event()
    hung = _HangsAtFlushAndShutdown(hang)
    steptrace.init(run_dir=str(tmp_path), run_id="hangs", backend="host", sinks=[hung])
    try:
        for n in range(5):
            with steptrace.step(n):
                pass
        started = time.monotonic()
        flushed = steptrace.flush(timeout_s=1.0)
        flush_s = time.monotonic() - started
        started = time.monotonic()
        complete = steptrace.shutdown(timeout_s=2.0)
        shutdown_s = time.monotonic() - started
        dropped = steptrace.stats()["dropped"] if steptrace.enabled() else None
    finally:
        hang.set()
    assert flushed is False and complete is False
    # Bounded: without the bound either call waits forever (the hang is released only after both returned).
    assert flush_s < 60 and shutdown_s < 60, (flush_s, shutdown_s)
    assert dropped is None  # shut down
    records = _records(tmp_path, "hangs")
    (run,) = [r for r in records if r["type"] == "run"]
    given = len(records) - 1  # every record but the run record reached the tracker's export ...
    assert run["dropped"]["sink:tensorboard"] == given  # ... and none was confirmed written: counted
    assert hung.entered == ["force_flush"]  # stuck in its flush: no second call piled on it


_ATEXIT_SCRIPT = r"""
import sys, threading
import steptrace
from steptrace.trackers import TensorBoardSink

class Hangs(TensorBoardSink):
    def shutdown(self, timeout_s):
        threading.Event().wait()  # never returns, like MLflow's set_terminated with the server gone

steptrace.init(run_dir=sys.argv[1], run_id="atexit", backend="host", sinks=[Hangs()], shutdown_timeout_s=2.0)
for n in range(3):
    with steptrace.step(n):
        pass
print("loop done", flush=True)
# no shutdown(): the atexit one runs
"""


def test_the_atexit_shutdown_is_bounded_too(tmp_path):
    script = tmp_path / "atexit_hang.py"
    script.write_text(_ATEXIT_SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: the atexit shutdown waited on the tracker's shutdown()")
    assert done.returncode == 0 and "loop done" in done.stdout, done.stderr[-2000:]
    assert "steptrace sink tensorboard: its shutdown did not return within the shutdown timeout" in done.stderr
    records = _records(tmp_path, "atexit")
    assert [r["step"] for r in records if r["type"] == "step"] == [0, 1, 2]
    assert any(r["type"] == "run" for r in records)  # the JSONL sink finished beside the hung one


def test_mlflow_with_default_settings_works_as_the_extra_installs_it(tmp_path, monkeypatch):
    """Issue 48: with no MLflow setting at all, MLflow 3's default store is sqlite:///mlflow.db in the working
    directory. mlflow-skinny registers that SQL store only where sqlalchemy imports (and creates its tables with
    alembic: mlflow/tracking/_tracking_service/utils.py, _register_tracking_stores); without them init() raised
    MLflow's own UnsupportedModelRegistryStoreURIException. The [mlflow] extra installs both: the default works,
    and the logged loss is read back from the database."""
    import tomllib

    from mlflow.tracking import MlflowClient

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {req.split(">")[0].split("=")[0] for req in extras["mlflow"]} >= {"mlflow-skinny", "sqlalchemy", "alembic"}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    records = _train(tmp_path, "default", trackers="mlflow")
    (run_record,) = [r for r in records if r["type"] == "run"]
    assert not run_record.get("dropped"), run_record["dropped"]
    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(experiment_ids=["0"])
    assert run.info.run_name == "default/rank-0" and run.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "steptrace/scalars/loss")} == \
        pytest.approx(_logged_loss(records), rel=1e-12)


def test_an_mlflow_store_that_does_not_open_fails_soft_in_one_line_naming_the_fix(tmp_path, monkeypatch, caplog):
    """A store MLflow itself refuses (here MLflow 3's file store without MLFLOW_ALLOW_FILE_STORE, its real
    MlflowException) fails neither init() nor a step: the job trains, the JSONL has every record, the tracker's
    records are dropped and counted, and one log line says why and names the fix."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with caplog.at_level("WARNING", logger="steptrace"):
        records = _train(tmp_path, "refused", trackers="mlflow")
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(8))
    (run_record,) = [r for r in records if r["type"] == "run"]
    assert run_record["dropped"]["sink:mlflow"] == len(records) - 1  # all it was given before the run record
    said = [r.getMessage() for r in caplog.records if "mlflow" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(f"steptrace trackers: mlflow cannot open its store {(tmp_path / 'mlruns').as_uri()} "
                              "(MlflowException: ")
    assert "set MLFLOW_TRACKING_URI to your tracking server" in said[0] and "steptrace[mlflow]" in said[0]
    assert "Training goes on; its records are dropped and counted (sink:mlflow)" in said[0]


class _FinishHangs(_HangsAtFlushAndShutdown):
    """As W&B's run: force_flush returns at once (W&B's service holds what log() was given), finish() hangs."""

    flush_confirms = False

    def force_flush(self, timeout_s):
        return True


def test_a_tracker_whose_records_are_written_only_at_its_shutdown_counts_them_all_when_it_hangs(tmp_path):
    from steptrace._sinks import SinkWorker

    hang = threading.Event()
    sink = _bound(_FinishHangs(hang), tmp_path)
    drops: dict[str, int] = {}
    worker = SinkWorker(sink, 1000, lambda reason, n=1: drops.__setitem__(reason, drops.get(reason, 0) + n))
    try:
        worker.offer(_late_records())
        assert worker.flush(time.monotonic() + 30)  # its flush returned: nothing is confirmed by it
        assert worker.stop(time.monotonic() + 30) and drops == {}
        worker.deliver_last([{"type": "run"}], time.monotonic() + 30)
        assert not worker.close(time.monotonic() + 0.5)
    finally:
        hang.set()
    assert drops == {"sink:tensorboard": len(_late_records()) + 1}  # every record, the last one too


# MLflow's REST client against a tracking server that answers init() and then goes away (the case). What
# MLflow does then, relied on here (mlflow/utils/rest_utils.py, http_request): each request is retried on a refused
# connection with exponential backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7; backoff factor 2; up to 120 s a
# request), so its log_batch and set_terminated hold their caller for minutes.
_MLFLOW_GONE_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from fake_mlflow_server import serve

server, paths, os.environ["MLFLOW_TRACKING_URI"] = serve("gone/rank-0")
import steptrace

steptrace.init(run_dir=sys.argv[1], run_id="gone", backend="host", trackers="mlflow")
for n in range(3):
    with steptrace.step(n) as s:
        s.log(loss=1.0)
steptrace.flush(30)
server.shutdown()
server.server_close()  # the server is gone: MLflow's requests are refused and retried
for n in range(3, 6):
    with steptrace.step(n):
        pass
started = time.monotonic()
complete = steptrace.shutdown(2.0)
print(json.dumps({"paths": paths, "complete": complete, "shutdown_s": time.monotonic() - started}), flush=True)
os._exit(0)  # MLflow's retries go on in daemon threads: nothing to wait for
"""


def test_mlflow_with_its_server_gone_after_init_holds_neither_the_loop_nor_shutdown(tmp_path):
    script = tmp_path / "mlflow_gone.py"
    script.write_text(_MLFLOW_GONE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path), TESTS_DIR], capture_output=True,
                              text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("shutdown(2.0) waited on MLflow's retries to a server that is gone")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["paths"][:2] == ["/api/2.0/mlflow/runs/create", "/api/2.0/mlflow/runs/log-batch"]
    assert result["complete"] is False and result["shutdown_s"] < 60  # 2 s asked; never minutes
    assert "steptrace sink mlflow: its shutdown did not return within the shutdown timeout" in done.stderr
    records = _records(tmp_path, "gone")
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(6))  # the JSONL has every step
    (run,) = [r for r in records if r["type"] == "run"]
    assert run["dropped"].get("sink:mlflow", 0) >= 1 and "sink:jsonl" not in run["dropped"]  # the stuck batch


# A tracking server that takes the connection and does not answer runs/create (hung, or far away): MLflow waits
# 120 s a request and retries (mlflow/utils/rest_utils.py), so init() once held the job that long. "late" answers
# after 4 s, past the 1 s the script gives init(); "never" never answers.
_MLFLOW_SLOW_OPEN_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
from fake_mlflow_server import serve

mode = sys.argv[2]
server, paths, os.environ["MLFLOW_TRACKING_URI"] = serve("slow/rank-0", 4.0 if mode == "late" else 3600)
import steptrace, steptrace.trackers

steptrace.trackers.MlflowSink.open_timeout_s = 1.0
started = time.monotonic()
steptrace.init(run_dir=sys.argv[1], run_id="slow", backend="host", trackers="mlflow")
init_s = time.monotonic() - started
for n in range(3):
    with steptrace.step(n) as s:
        s.log(loss=1.0)
steptrace.flush(30)
time.sleep(6.0 if mode == "late" else 0.0)  # "late": the run has opened by now
for n in range(3, 6):
    with steptrace.step(n) as s:
        s.log(loss=2.0)
steptrace.shutdown(10.0)
print(json.dumps({"paths": paths, "init_s": init_s}), flush=True)
os._exit(0)  # "never": the opener thread still waits on the server
"""


@pytest.mark.parametrize("mode", ["never", "late"])
def test_an_mlflow_server_that_does_not_answer_holds_init_only_for_the_open_timeout(tmp_path, mode):
    """Issue 48 (round-4 probe): a tracking server that takes the connection but does not answer held init()
    for MLflow's 120 s a request and its retries. init() now waits open_timeout_s; the job trains; the
    tracker's records are dropped and counted until its run opens, and written once it has ("late")."""
    script = tmp_path / "mlflow_slow.py"
    script.write_text(_MLFLOW_SLOW_OPEN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), mode, TESTS_DIR], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.9 < result["init_s"] < 30  # waited the open timeout (1 s), not MLflow's minutes
    assert "mlflow did not open its run at http://127.0.0.1:" in done.stderr and "within 1 s" in done.stderr
    records = _records(tmp_path, "slow")
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(6))  # the job trained
    (run,) = [r for r in records if r["type"] == "run"]
    batches = [p for p in result["paths"] if p.endswith("/runs/log-batch")]
    if mode == "never":
        assert batches == [] and run["dropped"]["sink:mlflow"] == len(records) - 1  # all it was given
    else:
        assert "mlflow opened its run r1 late" in done.stderr
        assert batches and 0 < run["dropped"]["sink:mlflow"] < len(records) - 1  # the early ones only
