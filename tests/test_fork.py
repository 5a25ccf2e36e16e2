"""A process forked from a recording rank (issue 32, item 3): its copy of steptrace is off.

``os.fork()`` copies the parent's memory, including steptrace's runtime, its queues and its open run
file, but only the forking thread: the resolver and sink threads do not exist in the child. A child
that finalized that copy at exit would wait for threads that are not there (8 s by default) and
write a second ``run`` record into the parent's file while the parent trains. The documented
behaviour relied on: ``os.register_at_fork(after_in_child=...)`` runs in the child of every
``os.fork()`` (Python docs, os.register_at_fork), which ``multiprocessing``'s fork start method and
so PyTorch's DataLoader workers use; ``multiprocessing`` children end with ``os._exit`` and never run
``atexit`` (Lib/multiprocessing/popen_fork.py), a plain ``os.fork()`` child that returns through
``sys.exit`` does.

Each scenario runs in a fresh interpreter (a fork inside pytest would copy pytest's threads too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import have

_PARENT = textwrap.dedent("""
    import json, os, sys, time
    import steptrace

    run_dir = sys.argv[1]
    steptrace.init(run_dir=run_dir, run_id="parent", rank=0, world_size=1, backend="host")
    for n in range(3):
        with steptrace.step(n):
            time.sleep(0.005)

    def child(body):
        read, write = os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, json.dumps(body()).encode())
            os.close(write)
            sys.exit(0)  # atexit runs in this child, as in any Python program that exits
        os.close(write)
        with os.fdopen(read) as pipe:
            seen = json.loads(pipe.read() or "null")
        _, status = os.waitpid(pid, 0)
        return {"seen": seen, "exit_status": status, "exit_seconds": time.monotonic() - started}

    def idle_child():
        return {"enabled": steptrace.enabled(), "current": steptrace.current_step() is not None}

    def misusing_child():
        # A child that calls steptrace as if it were the rank: nothing is recorded, nothing waits.
        with steptrace.step(3):
            pass
        with steptrace.span("data"):
            pass
        return {"flushed": steptrace.flush(timeout_s=30), "stats_steps": steptrace.stats()["steps"]}

    def recording_child():
        # The documented way to record in a child: init() again, into a run of its own.
        parent = steptrace.config()
        steptrace.init(run_dir=parent.run_dir, run_id=f"{parent.run_id}-child", rank=0, world_size=1,
                       backend="host")
        for n in range(2):
            with steptrace.step(n):
                pass
        return {"enabled": steptrace.enabled()}

    results = {"idle": child(idle_child), "misusing": child(misusing_child)}
    with steptrace.step(3):  # a fork from inside a step: the child exits, the parent's step goes on
        results["inside_step"] = child(idle_child)
    results["recording"] = child(recording_child)
    for n in range(4, 6):
        with steptrace.step(n):
            time.sleep(0.005)
    steptrace.shutdown()
    print(json.dumps(results))
""")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_forked_child_never_finalizes_or_writes_the_parents_run(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _PARENT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for name in ("idle", "misusing", "inside_step", "recording"):
        assert results[name]["exit_status"] == 0, name
    # The child's steptrace is off: no runtime, no open step, and a flush has nothing to wait for.
    assert results["idle"]["seen"] == {"enabled": False, "current": False}
    assert results["inside_step"]["seen"] == {"enabled": False, "current": False}
    assert results["misusing"]["seen"] == {"flushed": True, "stats_steps": 0}
    # The parent's file: its own six steps and one run record, with nothing dropped.
    parent = _records(tmp_path / "parent" / "rank-0.jsonl")
    assert [r["step"] for r in parent if r["type"] == "step"] == [0, 1, 2, 3, 4, 5]
    (run,) = [r for r in parent if r["type"] == "run"]
    assert run["steps"] == 6 and run["dropped"] == {}
    assert len([r for r in parent if r["type"] == "attempt"]) == 1
    # A child that called init() again recorded into its own run.
    assert results["recording"]["seen"] == {"enabled": True}
    child = _records(tmp_path / "parent-child" / "rank-0.jsonl")
    assert [r["step"] for r in child if r["type"] == "step"] == [0, 1]
    (child_run,) = [r for r in child if r["type"] == "run"]
    assert child_run["dropped"] == {}
    print({name: round(results[name]["exit_seconds"], 3) for name in results})


_LOADER = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader, Dataset
    import steptrace

    class Items(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            # Code a dataset shares with the training process may call steptrace: in a worker it is off.
            with steptrace.span("decode"):
                pass
            return torch.tensor([i, int(steptrace.enabled()), int(steptrace.flush(timeout_s=30))])

    steptrace.init(run_dir=sys.argv[1], run_id="loader", rank=0, world_size=1, backend="host")
    loader = DataLoader(Items(), batch_size=2, num_workers=2, multiprocessing_context=mp.get_context("fork"))
    seen = []
    for n, batch in steptrace.steps(loader):
        seen.extend(batch.tolist())
        time.sleep(0.002)
    steptrace.shutdown()
    print(json.dumps(seen))
""")


@pytest.mark.skipif(not have("torch"), reason="the DataLoader case needs torch")
def test_dataloader_fork_workers_see_steptrace_off_and_the_rank_file_is_the_parents(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(item[0] for item in seen) == list(range(16))
    assert {(item[1], item[2]) for item in seen} == {(0, 1)}  # off in every worker; flush returned at once
    records = _records(tmp_path / "loader" / "rank-0.jsonl")
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(8))
    assert not [r for r in records if r["type"] == "span" and r["name"] == "decode"]
    (run,) = [r for r in records if r["type"] == "run"]
    assert run["dropped"] == {}
