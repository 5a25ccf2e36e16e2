"""A CUDA stand-in for tests on machines without a GPU: ``torch.cuda`` patched onto a SimulatedDevice.

It keeps the CUDA semantics steptrace depends on, so the real
``steptrace.adapters.torch.TorchCudaDevice`` code runs unchanged:

* an event is stamped when the stream reaches it (after the work queued before
  it), on the device's own clock, which drifts against the host's;
* ``elapsed_time`` returns float32 milliseconds and fails unless both events
  completed; ``query`` never blocks;
* a side stream (``torch.cuda.Stream()``) is idle, unless the device was made
  with ``side_stream_blocked`` (``CUDA_DEVICE_MAX_CONNECTIONS=1``);
* ``torch.cuda.synchronize`` fails the test, and ``Event.synchronize`` calls
  are counted: steptrace must never call either.

Kernel launches are ``fake.run(seconds)``; the device keeps executing while
the training thread holds the GIL (``steptrace.testing.hold_gil``).
"""

from __future__ import annotations

from typing import Any

import pytest

from steptrace.testing import SimulatedDevice, SimulatedMarker, SimulatedWork


class FakeCudaTensor:
    """Looks like a CUDA ``torch.Tensor`` to steptrace's backend choice (module ``torch``, ``is_cuda``)."""

    is_cuda = True


FakeCudaTensor.__module__ = "torch"


class FakeCuda:
    def __init__(self, monkeypatch: Any, device: SimulatedDevice | None = None, *, initialized: bool = True):
        torch = pytest.importorskip("torch", reason="the fake CUDA patches torch.cuda")
        self.device = device if device is not None else SimulatedDevice(clock_drift_ppm=80.0)
        self.events_created = 0
        self.event_synchronize_calls = 0
        self.query_calls = 0
        self.capturing = False
        self.initialized = initialized
        fake = self

        class Stream:
            def __init__(self, device: Any = None, priority: int = 0):
                self.side = True

        self.main_stream = Stream()
        self.main_stream.side = False

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                         external: bool = False):
                assert enable_timing, "steptrace must ask for timing events"
                self._marker: SimulatedMarker | None = None
                fake.events_created += 1

            def record(self, stream: Any = None) -> None:
                stream = fake.main_stream if stream is None else stream
                if self._marker is None:
                    self._marker = SimulatedMarker()
                fake.device.stamp(self._marker, side=stream.side)

            def query(self) -> bool:
                fake.query_calls += 1
                return self._marker is None or fake.device.query(self._marker)

            def elapsed_time(self, end: "Event") -> float:
                if self._marker is None or end._marker is None:
                    raise RuntimeError("both events must be recorded (CUDA_ERROR_INVALID_HANDLE)")
                return fake.device.elapsed(self._marker, end._marker) * 1000.0

            def synchronize(self) -> None:
                fake.event_synchronize_calls += 1
                if self._marker is not None:
                    SimulatedWork(fake.device, 0.0, None, self._marker.done_at).block_until_ready()

        def synchronize(*_args: Any) -> None:
            pytest.fail("torch.cuda.synchronize() was called: steptrace must never synchronise")

        nvtx = type("nvtx", (), {"range_push": staticmethod(lambda msg: 0), "range_pop": staticmethod(lambda: 0)})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: fake.initialized)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.main_stream)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "nvtx", nvtx)

    def run(self, seconds: float, label: str | None = None) -> SimulatedWork:
        """A kernel launch on the current stream: ``seconds`` of device work, queued."""
        return self.device.run(seconds, label)
