"""GPU health on a real GPU (issue 38): the NVML fields steptrace samples, read on the device, with sane
units after conversion, the timed GPU found by UUID, and what a sample costs. Skips without CUDA or
without nvidia-ml-py. Run: ``python -m pytest tests/gpu/test_nvml.py -v -s`` (the costs are printed).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch with CUDA")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the NVML checks read a real one", allow_module_level=True)
pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py: pip install 'steptrace[nvml]'")

import steptrace  # noqa: E402
from steptrace import _health  # noqa: E402
from steptrace.adapters.torch import nvml_uuid  # noqa: E402
from steptrace.testing import capture  # noqa: E402


@pytest.fixture(scope="module")
def sampler():
    _health.init_nvml(pynvml)
    uuid = nvml_uuid(torch.cuda.current_device())
    assert uuid is not None and uuid.startswith(("GPU-", "MIG-"))
    found = _health.HealthSampler(pynvml, uuid)
    found._open()
    return found


def test_the_timed_gpu_is_found_by_uuid_and_is_the_same_pci_device(sampler):
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    assert pynvml.nvmlDeviceGetUUID(sampler._handle) == nvml_uuid(index)
    if not hasattr(props, "pci_bus_id"):
        pytest.skip("this torch's device properties have no PCI ids: the UUID alone was checked")
    pci = pynvml.nvmlDeviceGetPciInfo(sampler._handle)
    assert (pci.domain, pci.bus, pci.device) == (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)


def test_real_fields_have_sane_units_after_conversion(sampler):
    energy_first = pynvml.nvmlDeviceGetTotalEnergyConsumption(sampler._handle)
    sampler.sample()
    x = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + 1.2
    while time.perf_counter() < end:  # some work, so the clocks and power are not idle's
        x = x @ x
        x = x / x.norm()
    torch.cuda.synchronize()
    sampler.sample()
    window = sampler.window(time.perf_counter())
    print("\nNVML window:", {k: v for k, v in window.items() if k not in ("clocks_event_reason_names",)})
    assert window is not None and window["window_seconds"] >= 1.0
    assert 10.0 <= window["power_watts_mean"] <= 1500.0, "power is not in W (NVML reports mW)"
    energy_last = pynvml.nvmlDeviceGetTotalEnergyConsumption(sampler._handle)
    assert energy_last >= energy_first  # monotonic mJ
    if window["energy_joules"] is not None:  # a window of ~1.2 s at 10-1500 W
        assert 10.0 * 1.0 <= window["energy_joules"] <= 1500.0 * window["window_seconds"] * 1.5
    assert window["sm_clock_mhz_min"] > 0 and window["memory_clock_mhz_mean"] > 0
    assert 0 < window["temperature_c_max"] < 120
    for policy, percent in window["violation_percent"].items():
        assert percent is None or 0.0 <= percent <= 100.0, policy
        if percent is None:
            assert f"violation:{policy}" in window["unsupported"]
    assert all(reason.startswith("NVML_ERROR_") for reason in window["unsupported"].values())
    assert window["clocks_event_reasons"] is None or not window["clocks_event_reasons"] & _health.GPU_IDLE


def test_sampling_cost_per_call_and_per_sample(sampler, record_property):
    handle = sampler._handle
    calls = 1000
    t0 = time.perf_counter()
    for _ in range(calls):
        pynvml.nvmlDeviceGetPowerUsage(handle)
    per_call = (time.perf_counter() - t0) / calls
    samples = 100
    t0 = time.perf_counter()
    for _ in range(samples):
        sampler.sample()
    per_sample = (time.perf_counter() - t0) / samples
    print(f"\nnvmlDeviceGetPowerUsage {per_call * 1e6:.2f} µs per call; one sample of every field "
          f"{per_sample * 1e6:.0f} µs (at 1 Hz: {per_sample * 1e6:.0f} µs of the sampler's thread per second)")
    record_property("nvml_power_call_us", per_call * 1e6)
    record_property("health_sample_us", per_sample * 1e6)
    assert per_call > 0 and per_sample > per_call


def test_a_cuda_run_samples_the_gpu_its_steps_are_timed_on():
    x = torch.randn(2048, 2048, device="cuda")
    with capture(health="nvml") as sink:
        for n in range(40):
            with steptrace.step(n):
                for _ in range(20):
                    x = x @ x
                    x = x / x.norm()
            time.sleep(0.05)
    windows = [s["health"] for s in sink.steps() if "health" in s]
    assert windows, "no step took a health window in ~3 s of steps"
    assert {w["device"] for w in windows} == {nvml_uuid(torch.cuda.current_device())}
    assert sum(w["window_steps"] for w in windows) <= 40
    assert all(10.0 <= w["power_watts_mean"] <= 1500.0 for w in windows)
