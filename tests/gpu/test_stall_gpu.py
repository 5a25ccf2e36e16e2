"""A hang on one GPU (issue 32): the training thread is inside a synchronising CUDA call (or an allocator
call that synchronises) behind a kernel that runs for seconds. Every other Python thread keeps running:
steptrace's resolver and stall watch never freeze the process by holding the GIL in a CUDA or allocator
call, the stall watch writes its record while the hang lasts, and the step is recorded once the GPU is
free again. Skips without a CUDA GPU.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import steptrace  # noqa: E402
from steptrace.testing import capture  # noqa: E402

pytestmark = pytest.mark.integration

#: torch.cuda._sleep spins for a number of GPU clock cycles; calibrated below to seconds.
HANG_S = 3.0


class Heartbeat:
    """A Python thread that wakes every millisecond: its longest gap is how long the GIL was unavailable."""

    def __init__(self):
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.max_gap


def _cycles_per_second() -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1000.0)


@pytest.mark.parametrize("blocking_call", ["synchronize", "item", "empty_cache"])
def test_a_hung_gpu_never_freezes_the_other_python_threads(blocking_call):
    rate = _cycles_per_second()
    x = torch.randn(2048, 2048, device="cuda")
    with capture(stall_min_s=0.5, stall_factor=2.0) as sink:
        for n in range(6):  # steady steps: the resolver and the stall watch are busy with this GPU
            with steptrace.step(n):
                x = torch.tanh(x @ x)
        torch.cuda.synchronize()
        spare = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del spare  # a cached block: empty_cache has something to free (cudaFree synchronises)
        heartbeat = Heartbeat()
        hang_start = time.perf_counter()
        with steptrace.step(6):
            torch.cuda._sleep(int(HANG_S * rate))  # the GPU is busy for HANG_S seconds
            if blocking_call == "synchronize":
                torch.cuda.synchronize()
            elif blocking_call == "item":
                x.sum().item()
            else:
                torch.cuda.empty_cache()
        hang = time.perf_counter() - hang_start
        max_gap = heartbeat.stop()
    assert hang >= 0.8 * HANG_S, hang  # the call really waited for the GPU
    assert max_gap <= 0.05, (blocking_call, max_gap)
    stalls = sink.of_type("stall")
    assert [r["step"] for r in stalls] == [6], stalls
    assert stalls[0]["in_step"] is True
    steps = {r["step"]: r for r in sink.steps()}
    assert sorted(steps) == list(range(7))
    assert steps[6]["compute_seconds"] >= 0.8 * HANG_S, steps[6]
