"""Collective waits on NCCL (issue 20): what steptrace does and does not claim there.

On NCCL a collective's call returns once its kernel is enqueued and the wait happens inside the NCCL
kernel on the device, so the host-side wrappers would read ~0 wait for every rank. steptrace does not
install them on an NCCL process group, and its step records carry no ``collective_wait_seconds``
(docs/collector.md, "Who slowed the job"): the collector then falls back to compute and, with every
rank's compute equal, names no rank rather than a wrong one. Skips without CUDA and NCCL.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the NCCL collective checks need one", allow_module_level=True)
dist = pytest.importorskip("torch.distributed", reason="needs torch.distributed")
if not (dist.is_available() and dist.is_nccl_available()):
    pytest.skip("this torch build has no NCCL", allow_module_level=True)

import steptrace  # noqa: E402
from steptrace.adapters import torch_distributed  # noqa: E402
from steptrace.testing import capture  # noqa: E402


@pytest.fixture
def nccl_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        torch_distributed.untrack_collectives()
        dist.destroy_process_group()


def test_on_nccl_no_wrapper_is_installed_and_steps_claim_no_wait(nccl_group):
    original = dist.all_reduce
    assert torch_distributed.track_collectives() == []
    tensor = torch.ones(1024, device="cuda")
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                dist.all_reduce(tensor)
                s.wait_for(tensor)
    assert dist.all_reduce is original
    for step in sink.steps():
        assert "collective_wait_seconds" not in step and "own_seconds" not in step, step


def test_a_device_timed_collective_matches_the_kernel_timeline(nccl_group, profiled):
    """One GPU (world size 1: NCCL refuses two ranks on one GPU): a synchronous all-gather queued behind
    matmuls. Its device time, arrival to end, is from the end of the work queued before the call to
    the end of the device work the call launched (kernel timeline of the same run); an async one
    overlapped by longer compute exposes nothing and has no duration (issue 38)."""
    assert "all_gather_into_tensor" in torch_distributed.track_device_collectives()
    a = torch.randn(4096, 4096, device="cuda")
    source = torch.randn(64 * 1024 * 1024, device="cuda")  # 256 MB: a copy of ~0.1-0.5 ms
    gathered = torch.empty_like(source)
    for _ in range(2):
        dist.all_gather_into_tensor(gathered, source)
    torch.cuda.synchronize()
    steps = 6
    with capture() as sink, profiled.run():
        for n in range(steps):
            with steptrace.step(n) as s:
                for _ in range(8):  # the host is ahead: the collective is queued behind these
                    a = torch.tanh(a @ a)
                with torch.profiler.record_function(f"truth.collective.{n}"):
                    if n % 2:
                        work = dist.all_gather_into_tensor(gathered, source, async_op=True)
                    else:
                        dist.all_gather_into_tensor(gathered, source)
                if n % 2:
                    for _ in range(4):  # compute that does not need the result, longer than the copy
                        a = torch.tanh(a @ a)
                    work.wait()
                a = a + gathered[: a.numel()].view_as(a) * 0
                s.wait_for(a)
    timeline = profiled.timeline
    records = {r["step"]: r for r in sink.steps()}
    errors = []
    for n in range(steps):
        (group, seq, device_seconds, exposed_seconds), = records[n]["collectives"]
        window = timeline.window(f"truth.collective.{n}")
        if n % 2:
            assert device_seconds is None
            assert exposed_seconds < 50e-6, (n, exposed_seconds)  # the copy ended under the matmuls
            continue
        arrival = timeline.last_device_end_before(window.start)
        truth = window.end - arrival
        errors.append((n, device_seconds, truth))
        assert abs(device_seconds - truth) <= 20e-6 + 0.05 * truth, errors
    print("\nsynchronous all-gather, steptrace vs kernel timeline (ms):",
          [(n, round(d * 1e3, 4), round(t * 1e3, 4)) for n, d, t in errors])
