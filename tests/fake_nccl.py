"""NCCL collectives for the simulated GPU (tests/fake_cuda.py): ``torch.distributed`` on a fake NCCL
process group, for one rank of a job whose peers are scripted.

The rules steptrace relies on, each with its source, and enforced here:

* a collective runs on the process group's own NCCL stream, which first waits on an event recorded on
  the caller's current stream: it starts no earlier than the work queued before the call, and no
  earlier than the NCCL stream's previous collective (PyTorch
  ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``: ``syncStream`` records ``ncclEvent`` on
  ``getCurrentCUDAStream`` and ``ncclEvent.block(ncclStream)`` -- "Communications on ncclStreams
  cannot start before pending input tensor ops on current streams finish");
* the call returns at once (the kernel is enqueued); ``Work.wait()`` makes the *current stream* wait
  on the collective's end event and does not block the host (``WorkNCCL::wait`` ->
  ``synchronizeStream``: ``ncclEndEvent_->block(currentStream)``; the host blocks only with
  ``TORCH_NCCL_BLOCKING_WAIT``); a synchronous call (``async_op=False``) is the same call followed by
  ``work.wait()`` (``torch/distributed/distributed_c10d.py``, e.g. ``all_reduce``);
* a collective kernel cannot finish on any rank before the last rank's kernel has started (NCCL's
  ring/tree algorithms move every rank's data through every other: NCCL user guide, "Collective
  Operations"): on each rank its device duration is its wait for the latest peer + the transfer, and
  every rank finishes with the last transfer. A collective some peer never joins never completes:
  its end, and everything queued behind it on a stream that waits on it, is never reached (what the
  NCCL watchdog then times out; ``Work.is_completed()`` stays False);
* the n-th collective on a group is the same collective on every rank (torch.distributed: every rank
  of a group must call its collectives in the same order); the script says when each peer arrives
  at it, relative to this rank.

Time is the simulated GPU's (exact per event), not the host's: durations read from events are the
script's values to float32 precision.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fake_cuda import FakeCuda  # noqa: E402

from steptrace.testing import SimulatedWork  # noqa: E402


class FakeProcessGroup:
    """A process group: its name (``ProcessGroup.group_name``) and its ranks."""

    def __init__(self, name: str, ranks: list[int]):
        self.group_name = name
        self.ranks = ranks


class FakeNccl:
    """``torch.distributed`` with a fake NCCL backend, seen from ``rank``.

    ``peer_arrivals(group_name, seq)`` returns, for each peer, when its kernel starts relative to this
    rank's (seconds, may be negative) or None for a peer that never arrives. ``transfer_s`` is the
    transfer once all ranks are in."""

    COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")

    def __init__(self, monkeypatch: Any, fake: FakeCuda, *, rank: int, world_size: int, transfer_s: float,
                 peer_arrivals: Callable[[str, int], dict[int, float | None]]):
        torch = pytest.importorskip("torch")
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        self.fake, self.rank, self.world_size = fake, rank, world_size
        self.transfer_s = transfer_s
        self.peer_arrivals = peer_arrivals
        self.world = FakeProcessGroup("0", list(range(world_size)))
        self._seq: dict[str, int] = {}
        #: (group, seq, start, end) of every collective kernel, on the host perf_counter clock.
        self.kernels: list[tuple[str, int, float, float]] = []
        self.waits = 0
        nccl = self

        class Work:
            def __init__(self, end: float, device: int):
                self.end, self.device = end, device

            def wait(self, timeout: Any = None) -> bool:
                # synchronizeStream: the current stream waits on the collective's end event.
                nccl.waits += 1
                stream = nccl.fake.current_stream(self.device)
                gpu = nccl.fake.gpus[self.device]
                with gpu._lock:
                    gpu._occupy(stream.key, max(gpu._floor(stream.key), self.end))
                return True

            def is_completed(self) -> bool:
                import time

                return time.perf_counter() >= self.end

        self.Work = Work
        monkeypatch.setattr(distributed_c10d, "Work", Work)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(distributed_c10d, "_get_default_group", lambda: nccl.world)

        def make(name: str) -> Callable[..., Any]:
            def collective(tensor: Any = None, *args: Any, group: Any = None, async_op: bool = False,
                           **kwargs: Any) -> Any:
                work = nccl.enqueue(group or nccl.world)
                if async_op:
                    return work
                work.wait()  # distributed_c10d: a synchronous call waits on its Work
                return None

            collective.__name__ = name
            return collective

        for name in self.COLLECTIVES:
            function = make(name)
            monkeypatch.setattr(distributed_c10d, name, function)
            monkeypatch.setattr(dist, name, function)
        del torch

    def enqueue(self, group: FakeProcessGroup) -> Any:
        """ProcessGroupNCCL's collective: syncStream, then the kernel on the group's NCCL stream."""
        fake = self.fake
        current = fake.current_stream()
        device = current.device_index
        gpu = fake.gpus[device]
        nccl_stream = ("nccl", group.group_name)
        seq = self._seq[group.group_name] = self._seq.get(group.group_name, 0) + 1
        with gpu._lock:
            ready = max(gpu._floor(current.key), 0.0)  # ncclEvent recorded on the current stream
            import time

            start = max(time.perf_counter(), ready, gpu._floor(nccl_stream))  # ncclEvent.block(ncclStream)
            arrivals = self.peer_arrivals(group.group_name, seq)
            if any(offset is None for offset in arrivals.values()):
                end = math.inf  # a peer never arrives: never completes
            else:
                latest = max([start] + [start + offset for offset in arrivals.values() if offset is not None])
                end = latest + self.transfer_s
            work = SimulatedWork(gpu, 0.0, f"nccl {group.group_name}#{seq}", start)
            work.end_time = end
            gpu.dispatched.append(work)
            gpu._occupy(nccl_stream, end)
        self.kernels.append((group.group_name, seq, start, end))
        return self.Work(end, device)
