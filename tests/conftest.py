import importlib.util

import pytest

import steptrace
from steptrace.testing import SimulatedDevice


@pytest.fixture(autouse=True)
def _no_leftover_run():
    """Every test starts and ends with steptrace shut down, whatever the test did."""
    steptrace.shutdown(timeout_s=5)
    yield
    steptrace.shutdown(timeout_s=5)


@pytest.fixture
def device():
    dev = SimulatedDevice()
    yield dev
    dev.close()


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
