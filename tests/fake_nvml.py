"""A fake NVML, installed in place of ``pynvml`` (nvidia-ml-py) by the health tests.

It keeps the real bindings' constants and error class (``pynvml.NVMLError(value)`` maps a code to
its subclass), and models the GPUs' counters on the real clock, so a sampler reading it sees what it
would see on a GPU. Each semantic the sampler relies on is enforced here, with its source:

* Units. Power in **mW** (``nvmlDeviceGetPowerUsage``: "power usage for this GPU in milliwatts";
  on Ampere and later a 1 s average, NVML API reference, Device Queries). Energy in **mJ**, a
  monotonic counter since the driver loaded (``nvmlDeviceGetTotalEnergyConsumption``: "total energy
  consumption for this GPU in millijoules (mJ) since the driver was last reloaded"). Violation time in
  **ns**, cumulative, per policy (``nvmlDeviceGetViolationStatus`` fills ``nvmlViolationTime_t``:
  ``referenceTime`` "CPU timestamp in microseconds", ``violationTime`` "violation time in ns").
  Clocks in **MHz** (``nvmlDeviceGetClockInfo``), temperature in **°C** (``nvmlDeviceGetTemperature``).
* Clocks-event reasons: a bitmask, several bits at once (``nvmlClocksEventReason*``, NVML API
  reference, "Clocks Event Reasons": GpuIdle 0x1 ... DisplayClockSetting 0x100; "new reasons may be
  added", so a reader must keep unknown bits). HwSlowdown may show briefly during a P-state change
  (DCGM field docs, DCGM_FI_DEV_CLOCKS_EVENT_REASONS; the NVML reference: "this is an indicator of
  ... HW Slowdown"): :meth:`FakeGpu.pstate_change` sets it for one read.
  ``nvmlDeviceGetCurrentClocksEventReasons`` appeared in driver 535 (the old
  ``...ClocksThrottleReasons`` name is kept as an alias); an older driver has no such function:
  ``NVML_ERROR_FUNCTION_NOT_FOUND``.
* NOT_SUPPORTED per field and per GPU/driver (every query's reference: "NVML_ERROR_NOT_SUPPORTED if
  the device does not support this feature"): ``FakeGpu(unsupported={...})``.
* Xid coalescing: ``nvmlEventSetWait`` returns one event; "if there are multiple events ... only the
  latest is returned" for Xids (NVML API reference, nvmlEventSetWait_v2: "Some events are not
  queued and only the latest can be retrieved"): several Xids between two waits give the last one.
  No event within the timeout: ``NVML_ERROR_TIMEOUT``.
* Init: ``nvmlInit`` is reference counted and costly (it enumerates every GPU); a call before it or
  after the matching ``nvmlShutdown`` raises ``NVML_ERROR_UNINITIALIZED``. ``init_calls`` counts
  the inits, so a test fails if a sampler inits per sample.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pynvml as _real

#: The clocks-event reason bits the NVML reference documents (nvml.h).
GPU_IDLE, APPLICATIONS_CLOCKS, SW_POWER_CAP, HW_SLOWDOWN = 0x1, 0x2, 0x4, 0x8
SYNC_BOOST, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE, DISPLAY_CLOCK = 0x10, 0x20, 0x40, 0x80, 0x100

POLICIES = {_real.NVML_PERF_POLICY_POWER: "power", _real.NVML_PERF_POLICY_THERMAL: "thermal",
            _real.NVML_PERF_POLICY_SYNC_BOOST: "sync_boost", _real.NVML_PERF_POLICY_BOARD_LIMIT: "board_limit",
            _real.NVML_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
            _real.NVML_PERF_POLICY_RELIABILITY: "reliability"}


def _error(code: int) -> Exception:
    return _real.NVMLError(code)


class FakeGpu:
    """One GPU's state. Rates apply from the moment they are set (the counters integrate them over
    the real clock): ``power_mw`` drives energy, ``violation_rate[policy]`` (the fraction of wall
    time the policy held the clocks down) drives that policy's ns counter."""

    def __init__(self, uuid: str, pci_bus_id: str, *, name: str = "NVIDIA H100 80GB HBM3", power_mw: int = 350_000,
                 sm_clock_mhz: int = 1980, memory_clock_mhz: int = 2619, temperature_c: int = 55,
                 unsupported: set[str] | None = None, nvlinks: int = 4):
        self.uuid, self.pci_bus_id, self.name = uuid, pci_bus_id, name
        self.power_mw = power_mw
        self.sm_clock_mhz, self.memory_clock_mhz, self.temperature_c = sm_clock_mhz, memory_clock_mhz, temperature_c
        self.reasons = 0
        self.violation_rate = {policy: 0.0 for policy in POLICIES.values()}
        self.violation_ns = {policy: 0 for policy in POLICIES.values()}
        self.energy_mj = 1_000_000_000  # since the driver loaded: never 0 at the first read
        self.ecc_uncorrected_volatile = 0
        self.remapped_rows = [0, 0, 0, 0]  # corrected, uncorrected, pending, failure
        self.nvlink_errors = [[0, 0, 0, 0] for _ in range(nvlinks)]  # per link: replay, recovery, crc flit, crc data
        #: Fields this GPU (or driver) does not support: "power", "energy", "violation:<policy>",
        #: "reasons", "sm_clock", "memory_clock", "temperature", "ecc", "remapped_rows", "nvlink", "xid",
        #: "nvlink_counters" (links up, their error counters not given).
        self.unsupported = set(unsupported or ())
        self._transient_hw_slowdown = False
        self._pending_xids: list[int] = []
        self._registered = False
        self._last = time.perf_counter()
        self._lock = threading.Lock()

    def _advance(self) -> None:
        with self._lock:
            now = time.perf_counter()
            elapsed, self._last = now - self._last, now
            self.energy_mj += int(self.power_mw * elapsed)  # mW x s = mJ
            for policy, rate in self.violation_rate.items():
                self.violation_ns[policy] += int(rate * elapsed * 1e9)

    # -- what a test does to the GPU ------------------------------------------------------------
    def set_violation(self, policy: str, fraction: float) -> None:
        self._advance()
        self.violation_rate[policy] = fraction

    def set_power(self, milliwatts: int) -> None:
        self._advance()
        self.power_mw = milliwatts

    def pstate_change(self) -> None:
        """A P-state change: HwSlowdown shows in the next reasons read only."""
        self._transient_hw_slowdown = True

    def xid(self, code: int) -> None:
        """An Xid error: delivered to the event sets registered for it before it happened, else lost."""
        if self._registered:
            self._pending_xids.append(code)

    def check(self, field: str) -> None:
        if field in self.unsupported:
            raise _error(_real.NVML_ERROR_NOT_SUPPORTED)


class _ViolationTime:
    def __init__(self, reference_us: int, violation_ns: int):
        self.referenceTime = reference_us
        self.violationTime = violation_ns


class _EventData:
    def __init__(self, gpu: FakeGpu, event_type: int, data: int):
        self.device, self.eventType, self.eventData = gpu, event_type, data


class _EventSet:
    def __init__(self) -> None:
        self.gpus: list[FakeGpu] = []


class FakeNvml(types.ModuleType):
    """The ``pynvml`` module as the sampler uses it."""

    def __init__(self, gpus: list[FakeGpu], *, driver_version: str = "580.159.04"):
        super().__init__("pynvml")
        for key in dir(_real):
            if key.startswith(("NVML_", "nvmlClocks", "nvmlEventType")) or key == "NVMLError":
                setattr(self, key, getattr(_real, key))
        self.gpus = gpus
        self.driver_version = driver_version
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls = 0  # every device query (the sampler's cost is counted in calls)
        self._refs = 0
        if int(driver_version.split(".")[0]) < 535:
            # The function appeared in driver 535: the bindings raise FUNCTION_NOT_FOUND without it.
            def missing(handle: Any) -> int:
                self._query(handle)
                raise _error(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
            self.nvmlDeviceGetCurrentClocksEventReasons = missing  # type: ignore[method-assign]

    # -- init ------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        self._refs += 1

    def nvmlShutdown(self) -> None:
        if self._refs == 0:
            raise _error(_real.NVML_ERROR_UNINITIALIZED)
        self.shutdown_calls += 1
        self._refs -= 1

    def _initialised(self) -> None:
        if self._refs == 0:
            raise _error(_real.NVML_ERROR_UNINITIALIZED)

    def _query(self, handle: Any) -> FakeGpu:
        self._initialised()
        if not isinstance(handle, FakeGpu) or handle not in self.gpus:
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        self.calls += 1
        handle._advance()
        return handle

    # -- device lookup ---------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        self._initialised()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._initialised()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._initialised()
        if not 0 <= index < len(self.gpus):
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._initialised()
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise _error(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeGpu:
        self._initialised()
        for gpu in self.gpus:
            if gpu.pci_bus_id.lower() == bus_id.lower():
                return gpu
        raise _error(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._query(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._query(handle).name

    # -- the fields ------------------------------------------------------------------------------
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        gpu = self._query(handle)
        gpu.check("power")
        return int(gpu.power_mw)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu = self._query(handle)
        gpu.check("energy")
        return gpu.energy_mj

    def nvmlDeviceGetViolationStatus(self, handle: Any, policy: int) -> _ViolationTime:
        gpu = self._query(handle)
        if policy not in POLICIES:
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu.check(f"violation:{POLICIES[policy]}")
        return _ViolationTime(int(time.time() * 1e6), gpu.violation_ns[POLICIES[policy]])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._query(handle)
        gpu.check("reasons")
        reasons = gpu.reasons
        if gpu._transient_hw_slowdown:
            gpu._transient_hw_slowdown = False
            reasons |= HW_SLOWDOWN
        return reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        # The pre-535 name of the same query (an alias since).
        return FakeNvml.nvmlDeviceGetCurrentClocksEventReasons(self, handle)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        gpu = self._query(handle)
        if clock == _real.NVML_CLOCK_SM:
            gpu.check("sm_clock")
            return gpu.sm_clock_mhz
        if clock == _real.NVML_CLOCK_MEM:
            gpu.check("memory_clock")
            return gpu.memory_clock_mhz
        raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._query(handle)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu.check("temperature")
        return gpu.temperature_c

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._query(handle)
        gpu.check("ecc")
        if error_type != _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED or counter_type != _real.NVML_VOLATILE_ECC:
            return 0
        return gpu.ecc_uncorrected_volatile

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._query(handle)
        gpu.check("remapped_rows")  # Ampere and later only
        return tuple(gpu.remapped_rows)  # type: ignore[return-value]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._query(handle)
        gpu.check("nvlink")
        if not 0 <= link < len(gpu.nvlink_errors):
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return _real.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._query(handle)
        gpu.check("nvlink")
        gpu.check("nvlink_counters")  # links up, counters not given (newer GPUs: field values instead)
        if not 0 <= link < len(gpu.nvlink_errors) or not 0 <= counter < 4:
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_errors[link][counter]

    # -- events (Xid) ----------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> _EventSet:
        self._initialised()
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: _EventSet) -> None:
        gpu = self._query(handle)
        gpu.check("xid")
        event_set.gpus.append(gpu)
        gpu._registered = True

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        self._initialised()
        for gpu in event_set.gpus:
            if gpu._pending_xids:
                latest = gpu._pending_xids[-1]  # Xids are not queued: only the latest is returned
                gpu._pending_xids.clear()
                return _EventData(gpu, _real.nvmlEventTypeXidCriticalError, latest)
        raise _error(_real.NVML_ERROR_TIMEOUT)

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._initialised()
        event_set.gpus.clear()


def install(monkeypatch: Any, gpus: list[FakeGpu], **kwargs: Any) -> FakeNvml:
    """Put a fake NVML with ``gpus`` where ``import pynvml`` finds it, and forget the process's init."""
    import sys

    from steptrace import _health

    fake = FakeNvml(gpus, **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(_health, "_INITIALISED", {})
    return fake


def gpu(index: int, **kwargs: Any) -> FakeGpu:
    """GPU ``index`` of a fake node: uuid ``GPU-fake-<index>``, bus id ``00000000:<index+1>0:00.0``."""
    return FakeGpu(f"GPU-fake-{index}", f"00000000:{index + 1:X}0:00.0", **kwargs)
