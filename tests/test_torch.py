"""PyTorch: synchronous CPU steps are host-timed; CUDA steps by events resolved off the training thread."""

import time

import pytest

import steptrace
from steptrace.testing import capture

torch = pytest.importorskip("torch", reason="torch tests need `pip install steptrace[torch]`")

pytestmark = pytest.mark.integration


def test_cpu_torch_steps_are_host_timed_exactly():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(512, 256)
    with capture() as sink:
        for n in range(4):
            t0 = time.perf_counter()
            with steptrace.step(n, samples=512) as s:
                with steptrace.span("data"):
                    time.sleep(0.01)
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                s.wait_for(loss)
            host = time.perf_counter() - t0
            assert host > 0.01
    steps = sink.steps()
    data_spans = {s["step"]: s for s in sink.spans() if s["name"] == "data"}
    assert [r["backend"] for r in steps] == ["host"] * 4
    for r in steps:
        # Synchronous: the device is the host, so it waited through the whole data span, and
        # compute is the step's host time outside that span.
        data = data_spans[r["step"]]["seconds"]
        assert r["idle_breakdown"]["data"] == pytest.approx(data, abs=1e-5)
        assert r["dispatch_time"] == r["host_start_time"]
        assert r["compute_seconds"] == pytest.approx(r["host_end_time"] - r["host_start_time"] - data, abs=2e-6)


def test_torch_profiler_sees_step_ranges():
    with capture() as sink:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for n in range(2):
                with steptrace.step(n):
                    torch.ones(8).sum()
    names = {e.name for e in prof.events()}
    assert {"steptrace.step.0", "steptrace.step.1"} <= names
    assert len(sink.steps()) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_heavy_step_is_attributed_to_itself():
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with capture() as sink:
        for n, reps in enumerate([4, 4, 12, 4]):
            with steptrace.step(n):
                for _ in range(reps):
                    x = torch.tanh(x @ x)
    steps = sink.steps()
    assert all(r["backend"] == "torch-cuda" for r in steps)
    assert steps[2]["compute_seconds"] / steps[1]["compute_seconds"] == pytest.approx(3, rel=0.3)
