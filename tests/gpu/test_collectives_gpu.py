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
