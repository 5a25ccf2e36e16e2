"""GPU health per step window: a background NVML reader whose per-window deltas join the step records.

The sampler reads the rank's GPU through NVML (``nvidia-ml-py``, imported as ``pynvml``) on its own
thread, once per ``period_s`` (1 s by default and at the fastest): NVML's power reading is itself a
1 s average on Ampere and later, utilization covers a 1/6-1 s window, and the counters that matter
(violation ns, energy mJ) are cumulative, so reading faster adds calls, not information. The
training thread never calls NVML.

A **window** runs from one sample to a later one. When the resolver finalizes a step it asks for
the window that ends at the newest sample taken before the step's end (device time, on the host
clock): that window joins the step's record as ``health``, with ``window_steps``, the steps that
ended since the previous window (the steps that share it; each gets ``1 / window_steps`` of its
energy). A step that ends before any new sample was taken gets no ``health``: its share is in the
next window's record. Steps longer than the period get a window spanning several samples.

Counters give deltas over the window: violation time per policy (ns -> ms and % of the window),
energy (mJ -> J), ECC uncorrected (volatile), remapped rows, NVLink errors, Xid events. Gauges give
the window's samples' min/mean/max: SM clock, memory clock, temperature, power (mW -> W). Clocks-
event reasons are OR-ed over the window, ``GpuIdle`` masked, ``HwSlowdown`` kept only where it
persists across two consecutive samples (it flickers on during P-state changes); unknown bits are
kept. A field the GPU or driver does not support is null, its NVML error named in ``unsupported``,
never 0. See docs/health.md.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("steptrace")

_perf = time.perf_counter

#: The shortest sampling period accepted (seconds): see the module docstring.
MIN_PERIOD_S = 1.0
#: Samples kept between two windows (a run idle between steps for long keeps the newest ones; the
#: counters' deltas still run from the previous window's last sample).
MAX_SAMPLES = 600
#: NVML's perf policies (nvmlPerfPolicyType_t) and the record's names for them.
POLICIES = (("power", "NVML_PERF_POLICY_POWER"), ("thermal", "NVML_PERF_POLICY_THERMAL"),
            ("sync_boost", "NVML_PERF_POLICY_SYNC_BOOST"), ("board_limit", "NVML_PERF_POLICY_BOARD_LIMIT"),
            ("low_utilization", "NVML_PERF_POLICY_LOW_UTILIZATION"),
            ("reliability", "NVML_PERF_POLICY_RELIABILITY"))
#: The policies that hold the clocks down (low_utilization is the GPU idling, not slowing work).
SLOWING_POLICIES = ("power", "thermal", "board_limit", "reliability", "sync_boost")
#: Clocks-event reason bits (nvml.h nvmlClocksEventReason*; the old ThrottleReason names are aliases).
GPU_IDLE, HW_SLOWDOWN = 0x1, 0x8
REASON_NAMES = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                0x100: "display_clock"}
#: The reasons that mean the clocks were held below what the work asked for.
SLOWING_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
#: NVLink error counters summed (nvmlNvLinkErrorCounter_t: DL replay, DL recovery, CRC flit, CRC data).
NVLINK_COUNTERS = 4
#: Process-wide NVML init: pid -> the module initialised in it (one nvmlInit per process; a forked
#: child has the parent's memory but must init its own).
_INITIALISED: dict[int, Any] = {}
_INIT_LOCK = threading.Lock()


def import_nvml() -> Any:
    """``pynvml``, or an ImportError that says which ``pip install`` provides it (a setup error)."""
    try:
        import pynvml
    except ImportError as exc:
        raise ImportError("health='nvml' needs NVIDIA's NVML bindings: pip install 'steptrace[nvml]' "
                          "(the nvidia-ml-py package, imported as pynvml)") from exc
    return pynvml


def init_nvml(nvml: Any) -> None:
    """``nvmlInit`` once per process (it enumerates every GPU: costly); a RuntimeError naming NVML's
    error when it fails (no driver, no GPU)."""
    pid = os.getpid()
    with _INIT_LOCK:
        if _INITIALISED.get(pid) is nvml:
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError(f"health='nvml': nvmlInit failed ({error_name(nvml, exc)}): no NVIDIA driver or "
                               "GPU visible to this process; set health='off' (STEPTRACE_HEALTH=off)") from exc
        _INITIALISED.clear()  # a forked parent's entry is not this process's
        _INITIALISED[pid] = nvml


def error_name(nvml: Any, exc: BaseException) -> str:
    """``NVML_ERROR_NOT_SUPPORTED`` and the like for an NVMLError; the exception's type otherwise."""
    value = getattr(exc, "value", None)
    if isinstance(value, int):
        for key in dir(nvml):
            if key.startswith("NVML_ERROR_") and getattr(nvml, key) == value:
                return key
        return f"NVML_ERROR_{value}"
    return type(exc).__name__


class _Sample:
    __slots__ = ("time", "power_mw", "energy_mj", "violation_ns", "reasons", "sm_mhz", "mem_mhz", "temp_c",
                 "ecc", "remapped", "pending", "nvlink", "xid_events", "last_xid", "errors")

    def __init__(self, now: float):
        self.time = now
        self.power_mw: int | None = None
        self.energy_mj: int | None = None
        self.violation_ns: dict[str, int | None] = {}
        self.reasons: int | None = None  # effective: GpuIdle masked, a lone HwSlowdown dropped
        self.sm_mhz: int | None = None
        self.mem_mhz: int | None = None
        self.temp_c: int | None = None
        self.ecc: int | None = None
        self.remapped: int | None = None
        self.pending: bool | None = None
        self.nvlink: int | None = None
        self.xid_events = 0
        self.last_xid: int | None = None
        #: field -> NVML error name, for what this sample could not read
        self.errors: dict[str, str] = {}


class HealthSampler:
    """Reads one GPU on a background thread every ``period_s``; :meth:`window` (the resolver's
    thread) turns the samples since the previous window into the ``health`` of a step record.

    ``device``: the GPU, by NVML UUID (``GPU-...``/``MIG-...``) or PCI bus id; ``nvml``: the
    initialised ``pynvml``; ``unix_offset``: added to ``perf_counter`` times for the record."""

    def __init__(self, nvml: Any, device: str, *, period_s: float = 1.0, unix_offset: float = 0.0):
        self.nvml = nvml
        self.device = device
        self.period_s = period_s
        self.unix_offset = unix_offset
        self.pid = os.getpid()
        self._handle: Any = None
        self._events: Any = None
        self._lock = threading.Lock()
        self._samples: collections.deque[_Sample] = collections.deque(maxlen=MAX_SAMPLES)
        self._base: _Sample | None = None  # the previous window's last sample (or the first one)
        self._steps = 0  # steps finalized since the previous window
        self._unsupported: dict[str, str] = {}  # fields never read again (NOT_SUPPORTED, FUNCTION_NOT_FOUND)
        self._raw_reasons_prev: int | None = None
        self._reasons_fn: Any = None
        self._stop = threading.Event()
        self.samples_taken = 0
        self._first_window_taken = False
        self.cpu_seconds = 0.0
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="steptrace-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the sampler's thread --------------------------------------------------------------------
    def _open(self) -> None:
        nvml = self.nvml
        by_uuid = self.device.startswith(("GPU-", "MIG-"))
        self._handle = (nvml.nvmlDeviceGetHandleByUUID(self.device) if by_uuid
                        else nvml.nvmlDeviceGetHandleByPciBusId(self.device))
        self._reasons_fn = nvml.nvmlDeviceGetCurrentClocksEventReasons
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self._handle, nvml.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except Exception as exc:
            self._unsupported["xid"] = error_name(nvml, exc)

    def _run(self) -> None:
        cpu = time.thread_time
        try:
            self._open()
        except Exception as exc:
            self.failed = f"cannot open GPU {self.device!r} in NVML: {error_name(self.nvml, exc)}"
            log.warning("steptrace: health sampling is off: %s", self.failed)
            return
        while True:
            started = cpu()
            try:
                self.sample()
            except Exception:  # a bug, never the loop's: logged, and the next period tries again
                log.debug("steptrace: a health sample failed", exc_info=True)
            self.cpu_seconds += cpu() - started
            if self._stop.wait(self.period_s):
                return

    def _read(self, sample: _Sample, field: str, read: Any, *args: Any) -> Any:
        if field in self._unsupported:
            sample.errors[field] = self._unsupported[field]
            return None
        try:
            return read(self._handle, *args)
        except Exception as exc:
            name = error_name(self.nvml, exc)
            if name in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                self._unsupported[field] = name  # per GPU and driver: it will not start working
            sample.errors[field] = name
            return None

    def sample(self) -> None:
        """Read every field once (the sampler's thread; tests call it directly)."""
        nvml = self.nvml
        sample = _Sample(_perf())
        sample.power_mw = self._read(sample, "power", nvml.nvmlDeviceGetPowerUsage)
        sample.energy_mj = self._read(sample, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption)
        for name, constant in POLICIES:
            status = self._read(sample, f"violation:{name}", nvml.nvmlDeviceGetViolationStatus,
                                getattr(nvml, constant))
            sample.violation_ns[name] = None if status is None else int(status.violationTime)
        raw = self._read(sample, "reasons", self._reasons_fn)
        if raw is None and self._unsupported.get("reasons") == "NVML_ERROR_FUNCTION_NOT_FOUND" \
                and self._reasons_fn is not nvml.nvmlDeviceGetCurrentClocksThrottleReasons:
            # A driver before 535: the same query under its old name.
            del self._unsupported["reasons"]
            sample.errors.pop("reasons", None)
            self._reasons_fn = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            raw = self._read(sample, "reasons", self._reasons_fn)
        if raw is not None:
            raw = int(raw)
            effective = raw & ~GPU_IDLE
            if raw & HW_SLOWDOWN and not (self._raw_reasons_prev or 0) & HW_SLOWDOWN:
                effective &= ~HW_SLOWDOWN  # one sample of it is a P-state change, not a slowdown
            sample.reasons = effective
        self._raw_reasons_prev = raw
        sample.sm_mhz = self._read(sample, "sm_clock", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        sample.mem_mhz = self._read(sample, "memory_clock", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_MEM)
        sample.temp_c = self._read(sample, "temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        sample.ecc = self._read(sample, "ecc", nvml.nvmlDeviceGetTotalEccErrors,
                                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        rows = self._read(sample, "remapped_rows", nvml.nvmlDeviceGetRemappedRows)
        if rows is not None:
            sample.remapped, sample.pending = int(rows[1]), bool(rows[2])
        sample.nvlink = self._nvlink(sample)
        self._xids(sample)
        with self._lock:
            self._samples.append(sample)
            if self._base is None:
                self._base = sample
        self.samples_taken += 1

    def _nvlink(self, sample: _Sample) -> int | None:
        if "nvlink" in self._unsupported:
            sample.errors["nvlink"] = self._unsupported["nvlink"]
            return None
        nvml, total, links, read, failure = self.nvml, 0, 0, 0, None
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                nvml.nvmlDeviceGetNvLinkState(self._handle, link)
            except Exception as exc:
                name = error_name(nvml, exc)
                if link == 0 and name == "NVML_ERROR_NOT_SUPPORTED":
                    self._unsupported["nvlink"] = name
                    sample.errors["nvlink"] = name
                    return None
                break  # past the GPU's last link
            links += 1
            for counter in range(NVLINK_COUNTERS):
                try:
                    total += int(nvml.nvmlDeviceGetNvLinkErrorCounter(self._handle, link, counter))
                    read += 1
                except Exception as exc:
                    failure = error_name(nvml, exc)
        if links and not read:
            # Links, but no counter NVML will give (newer GPUs report them as field values): unknown, not 0.
            sample.errors["nvlink"] = failure or "NVML_ERROR_NOT_SUPPORTED"
            if failure in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                self._unsupported["nvlink"] = failure
            return None
        return total if links else None

    def _xids(self, sample: _Sample) -> None:
        if self._events is None:
            sample.errors["xid"] = self._unsupported.get("xid", "NVML_ERROR_NOT_SUPPORTED")
            sample.xid_events = -1
            return
        for _ in range(8):  # Xids are not queued: each wait returns the latest one, if any
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:
                return  # NVML_ERROR_TIMEOUT: none since the last wait
            if data.eventType == self.nvml.nvmlEventTypeXidCriticalError:
                sample.xid_events += 1
                sample.last_xid = int(data.eventData)

    # -- the resolver's thread -------------------------------------------------------------------
    def window(self, end: float) -> dict[str, Any] | None:
        """The health of the window ending at the newest sample taken at or before ``end``
        (``perf_counter``), if one was taken since the previous window; else None (the step's share
        is in the next window). Counts the step either way."""
        self._steps += 1
        with self._lock:
            base = self._base
            if base is None:
                return None
            taken = [s for s in self._samples if base.time < s.time <= end]
            if not taken:
                return None
            self._base = taken[-1]
            while self._samples and self._samples[0].time <= taken[-1].time:
                self._samples.popleft()
        steps, self._steps = self._steps, 0
        # The first sample's events (Xids since registration) were seen before any window: the first has them.
        first, self._first_window_taken = not self._first_window_taken, True
        return window_record(base, taken, steps, self.unix_offset, self.device, base_events=first)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self.pid == os.getpid():
            self._thread.join(5.0)  # the stop wakes its wait at once; only a sample in flight is waited for
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:
                pass
            self._events = None

    def forked(self) -> None:
        """A forked child's copy: its thread is the parent's; the child reads nothing."""
        self._stop.set()
        self._events = None


def _delta(first: int | None, last: int | None) -> int | None:
    """A counter's increase; None when either end is unknown or it went back (a driver reload)."""
    if first is None or last is None or last < first:
        return None
    return last - first


def reason_names(mask: int) -> list[str]:
    """The names of ``mask``'s bits, unknown ones as ``unknown_0x...`` (new reasons may appear)."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(REASON_NAMES.get(bit, f"unknown_{bit:#x}"))
        bit <<= 1
    return names


def window_record(base: _Sample, samples: list[_Sample], steps: int, unix_offset: float,
                  device: str, base_events: bool = False) -> dict[str, Any]:
    """The ``health`` of a step record: the window from ``base`` to ``samples[-1]`` (docs/records.md).
    ``base_events``: the events ``base`` saw count too (the run's first window)."""
    last = samples[-1]
    seconds = last.time - base.time
    unsupported: dict[str, str] = {}
    for sample in samples:
        unsupported.update(sample.errors)

    def gauge(values: list[Any]) -> list[float]:
        return [float(v) for v in values if v is not None]

    violation_ms: dict[str, float | None] = {}
    violation_percent: dict[str, float | None] = {}
    for name, _ in POLICIES:
        ns = _delta(base.violation_ns.get(name), last.violation_ns.get(name))
        violation_ms[name] = None if ns is None else ns / 1e6
        violation_percent[name] = None if ns is None or seconds <= 0 else min(100.0, ns / 1e9 / seconds * 100.0)
    energy_mj = _delta(base.energy_mj, last.energy_mj)
    power = gauge([s.power_mw for s in samples])
    sm = gauge([s.sm_mhz for s in samples])
    mem = gauge([s.mem_mhz for s in samples])
    temp = gauge([s.temp_c for s in samples])
    reasons_seen = [s.reasons for s in samples if s.reasons is not None]
    mask = 0
    for value in reasons_seen:
        mask |= value
    with_events = [base, *samples] if base_events else samples
    xid_known = all(s.xid_events >= 0 for s in with_events)
    last_xids = [s.last_xid for s in with_events if s.last_xid is not None]
    pending = [s.pending for s in samples if s.pending is not None]
    return {
        "source": "nvml",
        "device": device,
        "window_start_time": base.time + unix_offset,
        "window_end_time": last.time + unix_offset,
        "window_seconds": seconds,
        "window_steps": steps,
        "samples": len(samples),
        "violation_ms": violation_ms,
        "violation_percent": violation_percent,
        "energy_joules": None if energy_mj is None else energy_mj / 1e3,
        "energy_joules_per_step": None if energy_mj is None or steps <= 0 else energy_mj / 1e3 / steps,
        "power_watts_mean": sum(power) / len(power) / 1e3 if power else None,
        "clocks_event_reasons": mask if reasons_seen else None,
        "clocks_event_reason_names": reason_names(mask) if reasons_seen else None,
        "sm_clock_mhz_min": min(sm) if sm else None,
        "sm_clock_mhz_mean": sum(sm) / len(sm) if sm else None,
        "memory_clock_mhz_mean": sum(mem) / len(mem) if mem else None,
        "temperature_c_max": max(temp) if temp else None,
        "xid_events": sum(s.xid_events for s in with_events) if xid_known else None,
        "last_xid": last_xids[-1] if last_xids else None,
        "ecc_uncorrected_volatile_errors": _delta(base.ecc, last.ecc),
        "remapped_rows_uncorrectable": _delta(base.remapped, last.remapped),
        "remapped_rows_pending": pending[-1] if pending else None,
        "nvlink_errors": _delta(base.nvlink, last.nvlink),
        "unsupported": unsupported,
    }


#: A window counts as throttled when a clock-reducing policy held the clocks this much of it (%).
THROTTLED_PERCENT = 1.0
_ERROR_FIELDS = ("xid_events", "ecc_uncorrected_volatile_errors", "remapped_rows_uncorrectable", "nvlink_errors")


def window_throttled(window: dict[str, Any]) -> bool | None:
    """Whether a health window's clocks were held down: a clock-reducing policy's violation time
    reached ``THROTTLED_PERCENT`` of it, or a slowing clocks-event reason showed; None when the GPU
    reported neither. The one rule the report and the collector use."""
    known = False
    for policy in SLOWING_POLICIES:
        value = (window.get("violation_percent") or {}).get(policy)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            known = True
            if value >= THROTTLED_PERCENT:
                return True
    mask = window.get("clocks_event_reasons")
    if isinstance(mask, int) and not isinstance(mask, bool):
        known = True
        if mask & SLOWING_REASONS:
            return True
    return False if known else None


def window_errors(window: dict[str, Any]) -> int:
    """The GPU errors a health window counted (Xid events, uncorrected ECC, remapped rows, NVLink)."""
    total = 0
    for field in _ERROR_FIELDS:
        value = window.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            total += int(value)
    return total


def start(config: Any, cuda_device: str | None, unix_offset: float) -> HealthSampler | None:
    """The rank's sampler, started, on the configured device or the GPU its steps are timed on
    (``cuda_device``: that GPU's NVML UUID); None (said once) when there is neither."""
    device = config.health_device or cuda_device
    if device is None:
        from steptrace._config import warn_once

        warn_once("health='nvml' but this rank's steps are not timed on a CUDA GPU and no health_device is set: "
                  "no GPU health is sampled (set health_device=<NVML UUID or PCI bus id>, docs/health.md)")
        return None
    nvml = import_nvml()
    init_nvml(nvml)
    sampler = HealthSampler(nvml, device, period_s=config.health_period_s, unix_offset=unix_offset)
    sampler.start()
    return sampler
