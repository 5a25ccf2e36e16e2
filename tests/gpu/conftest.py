"""The GPU suite: steptrace's CUDA and JAX-on-GPU times checked against the device timeline of the
same run. Each module skips with the reason where there is no CUDA GPU (CI, the 2-core dev
machines). Run it on a CUDA machine with ``python -m pytest tests/gpu -v``; bench/RESULTS.md says
where and when it last ran.
"""

import contextlib
import statistics

import pytest


class Profiled:
    """``torch.profiler`` with CUDA activity around a block; ``.timeline`` is its kernel timeline."""

    def __init__(self, path):
        self.path = path
        self.timeline = None

    @contextlib.contextmanager
    def run(self):
        import torch

        from kernel_timeline import KernelTimeline

        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            yield
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(self.path))
        self.timeline = KernelTimeline.load(self.path)


@pytest.fixture
def profiled(tmp_path):
    return Profiled(tmp_path / "kernels.json")


def median_and_p95(errors):
    ordered = sorted(errors)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def by_step(sink):
    return {r["step"]: r for r in sink.steps()}
