import ast
import importlib.util
import sys
import threading

import pytest

import steptrace
from steptrace.testing import SimulatedDevice


def _serialize_ast_parse() -> None:
    """CPython 3.11 keeps the AST builder's recursion depth in interpreter-wide state (see
    python/cpython#106905): an ``ast.parse`` in one thread that another thread's ``ast.parse`` interleaves
    with (a garbage collection runs Python code mid-build, and the GIL changes hands) fails with
    "SystemError: AST constructor recursion depth mismatch". pytest parses in the main thread (assertion
    rewriting, traceback sources) while libraries' threads format tracebacks (CPython 3.11 parses each
    line for its carets): CI saw the session end in an INTERNALERROR. One lock around ``ast.parse`` in the
    test process; the thread that holds it never waits for another, so it cannot deadlock."""
    lock = threading.RLock()
    parse = ast.parse

    def serialized_parse(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    ast.parse = serialized_parse


_serialize_ast_parse()


@pytest.fixture(autouse=True)
def _no_leftover_run():
    """Every test starts and ends with steptrace shut down, whatever the test did."""
    steptrace.shutdown(timeout_s=5)
    yield
    steptrace.shutdown(timeout_s=5)


def _reset_mlflow_globals() -> None:
    """MLflow keeps a process-wide tracking URI, active experiment and run stack: the HF Trainer's
    MLflowCallback sets the URI (``mlflow.set_tracking_uri``) and it outlives the test, so a later test's
    ``MLFLOW_TRACKING_URI`` would be ignored. Private names, in tests only; MLflow has no public reset."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    try:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.tracking._tracking_service.utils._tracking_uri = None
        mlflow.tracking.fluent._active_experiment_id = None
    except Exception:  # a future MLflow without these names: the tests say what broke
        pass


@pytest.fixture(autouse=True)
def _no_leftover_mlflow_state():
    _reset_mlflow_globals()
    yield
    _reset_mlflow_globals()


@pytest.fixture
def device():
    dev = SimulatedDevice()
    yield dev
    dev.close()


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(params=["compiled", "python"])
def hot_path(request):
    """Run the test with the per-step calls compiled (steptrace/_hotpath.c) and in Python: they must do
    the same. The compiled run skips where the extension is not built."""
    from steptrace import _handles, _runtime

    if request.param == "compiled" and _handles._hotpath is None:
        pytest.skip("the C extension steptrace._hotpath is not built here (no C compiler at install, or "
                    "STEPTRACE_PURE_PYTHON=1): the Python calls run alone")
    _runtime.compiled_hot_path(request.param == "compiled")
    yield request.param
    _runtime.compiled_hot_path(True)
