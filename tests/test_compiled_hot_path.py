"""The compiled hot path (steptrace/_hotpath.c): the per-step calls ``step()``, a step's ``__enter__``,
``wait_for`` and ``__exit__`` in C, for a plain step, against the Python methods they stand in for.

The same records both ways is tests/test_hot_path.py's golden test, run both ways (the ``hot_path``
fixture); here: the handle's defaults, the clock, drops, what goes to the Python methods, and the
whole package with the extension switched off (STEPTRACE_PURE_PYTHON=1), as where it was not built."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import steptrace
from steptrace import _handles, _runtime
from steptrace._handles import (
    SPAN_BASE_DEFAULTS,
    STEP_BASE_DEFAULTS,
    MicrobatchHandle,
    SpanHandle,
    StepHandle,
    TimedUnit,
)
from steptrace.testing import MemorySink

ROOT = Path(__file__).resolve().parent.parent
compiled_only = pytest.mark.skipif(_handles._hotpath is None, reason=(
    "the C extension steptrace._hotpath is not built here (no C compiler at install, or STEPTRACE_PURE_PYTHON=1)"))


@compiled_only
@pytest.mark.parametrize("kind", ["step", "span", "microbatch"])
def test_a_compiled_handle_starts_with_the_defaults_the_python_classes_declare(kind):
    """StepBase's fields shadow the class attributes of StepHandle and TimedUnit (SpanBase's, SpanHandle's);
    it must start a handle with the same values, or a step would read another default with the extension
    than without."""
    if kind == "step":
        base, cls, made_per_step = _handles._hotpath.StepBase, StepHandle, {"_rt", "step", "attrs"}
        declared = {**{name: value for name, value in vars(TimedUnit).items() if not name.startswith("__")},
                    **STEP_BASE_DEFAULTS}
    elif kind == "span":
        base, cls, made_per_step = _handles._hotpath.SpanBase, SpanHandle, {"_rt", "name", "attrs"}
        declared = dict(SPAN_BASE_DEFAULTS)
    else:
        base, cls = _handles._hotpath.MicrobatchBase, MicrobatchHandle
        made_per_step = {"_rt", "_step", "index", "stage", "chunk", "kind"}
        declared = {name: value for name, value in vars(TimedUnit).items() if not name.startswith("__")}
    fields = sorted(name for name, value in vars(base).items() if isinstance(value, types.MemberDescriptorType))
    handle = cls.__new__(cls)  # made_per_step: set by Runtime.step / Runtime.span on every handle
    assert set(fields) - made_per_step <= set(declared), "a compiled field with no Python default"
    for name in sorted(set(fields) - made_per_step):
        assert getattr(handle, name) == declared[name], name
        assert type(getattr(handle, name)) is type(declared[name]), name
    for name in made_per_step:
        with pytest.raises(AttributeError):
            getattr(handle, name)
    # And the Python class no longer hides them (a class attribute of the same name would).
    assert not set(fields) & set(vars(cls))


@compiled_only
def test_the_compiled_calls_are_the_ones_bound_and_can_be_switched():
    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="bound")
    try:
        assert type(steptrace.step).__name__ == "builtin_function_or_method"
        assert StepHandle.__enter__ is _handles._hotpath.StepBase.__enter__
        assert _runtime.compiled_hot_path(False) is False
        assert StepHandle.__enter__ is _handles.PYTHON_STEP_METHODS["__enter__"]
        assert steptrace._active.step.__func__ is _runtime.PYTHON_STEP
    finally:
        assert _runtime.compiled_hot_path(True) is True
        steptrace.shutdown()


def test_host_times_come_from_the_handles_clock(hot_path, monkeypatch):
    """The compiled calls read the same `_perf` as the Python ones (tests and tools replace it)."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=f"clock-{hot_path}", stall_watch=False)
    with steptrace.step(0) as s:  # the first step's setup, on the real clock
        s.wait_for(1.0)
    t0 = float(int(_handles._perf()) + 500)  # after step 0, on the real clock: times only go forward
    ticks = iter([t0, t0 + 0.25, t0 + 1.0, t0 + 1.5])
    monkeypatch.setattr(_handles, "_perf", lambda: next(ticks))
    handles = []
    for n in (1, 2):
        with steptrace.step(n) as s:
            s.wait_for(1.0)
        handles.append(s)
    monkeypatch.undo()
    assert [(h.host_start, h.dispatch, h.host_end) for h in handles] == [(t0, t0, t0 + 0.25),
                                                                         (t0 + 1.0, t0 + 1.0, t0 + 1.5)]
    assert steptrace._active.last_step == 2 and steptrace._active.last_step_end == t0 + 1.5
    assert steptrace.flush(30.0)
    steps = {r["step"]: r for r in sink.steps()}
    steptrace.shutdown()
    assert steps[2]["interval_seconds"] == pytest.approx(1.25)


def test_a_full_resolver_queue_drops_the_step_and_counts_it(hot_path):
    """Resolver.submit's bound, kept by the compiled exit (which appends without the call): a step that
    does not fit is counted as a ``resolver_queue`` drop, never queued past the bound."""
    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id=f"full-{hot_path}", max_queue=16, stall_watch=False)
    resolver = steptrace._active.resolver
    with steptrace.step(0) as s:
        s.wait_for(1.0)
    assert steptrace.flush(30.0)
    queue = resolver._queue
    held = resolver._queue = type(queue)()  # the resolver thread keeps its own: these stay here
    for n in range(1, 19):
        with steptrace.step(n) as s:
            s.wait_for(1.0)
    resolver._queue = queue
    assert [h.step for h in held] == list(range(1, 17))
    assert steptrace.stats()["dropped"].get("resolver_queue") == 2
    steptrace.shutdown()


def test_a_stopped_resolver_gets_no_step_and_counts_it(hot_path):
    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id=f"stopped-{hot_path}", stall_watch=False)
    resolver = steptrace._active.resolver
    with steptrace.step(0) as s:
        s.wait_for(1.0)
    assert steptrace.flush(30.0)
    queue = resolver._queue
    held = resolver._queue = type(queue)()
    resolver._stopping = True
    try:
        with steptrace.step(1) as s:
            s.wait_for(1.0)
    finally:
        resolver._stopping = False
        resolver._queue = queue
    assert not held
    assert steptrace.stats()["dropped"].get("resolver_queue") == 1
    steptrace.shutdown()


def test_what_is_not_a_plain_step_goes_to_the_python_calls(hot_path, monkeypatch):
    """Step arguments, misuse, an exception, several values, spans open at the end: the records and
    the warnings are the Python methods' (the compiled calls hand them over before doing anything)."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=f"slow-{hot_path}", stall_watch=False, strict=False)
    with steptrace.step(0, tokens=128, lr=0.1) as s:
        s.wait_for(1.0, 2.0)
    with pytest.warns(UserWarning, match=r"step\(0\) after step\(0\)"):
        again = steptrace.step(0)
    assert again is _handles.NULL_STEP
    with pytest.raises(KeyError):
        with steptrace.step(1) as s:
            raise KeyError("no batch")
    with pytest.warns(UserWarning, match="entered while step"):
        with steptrace.step(2) as s:
            s.__enter__()
            s.wait_for(3.0)
            s.wait_for(4.0)  # a second call adds nothing here (host values)
    with pytest.warns(UserWarning, match="wait_for\\(\\) called outside its step"):
        s.wait_for(5.0)
    steptrace.begin_span("data")
    with pytest.warns(UserWarning, match="still open"):
        with steptrace.step(3):
            steptrace.begin_span("inner")
    steptrace.end_span("inner")
    steptrace.end_span("data")
    with pytest.warns(UserWarning, match="must be an int"):
        steptrace.step(True)
    assert steptrace.flush(30.0)
    steps = {r["step"]: r for r in sink.steps()}
    steptrace.shutdown()
    assert steps[0]["tokens"] == 128 and steps[0]["attrs"] == {"lr": 0.1}
    assert steps[1]["status"] == "error" and steps[1]["error"] == "KeyError: 'no batch'"
    assert steps[2]["status"] == "ok" and sorted(steps) == [0, 1, 2, 3]


def test_the_package_without_the_extension_passes_the_hot_path_tests():
    """STEPTRACE_PURE_PYTHON=1: what an install without a C compiler runs (no compiled base at all,
    the class attributes as the defaults). The hot-path tests, this file's included, pass there too."""
    env = {**os.environ, "STEPTRACE_PURE_PYTHON": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", "import steptrace._handles as h, steptrace._runtime as r; "
         "print(h._hotpath, [c.__name__ for c in h.StepHandle.__mro__], 'step' in vars(r.Runtime))"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["None", "['StepHandle',", "'_PurePython',", "'TimedUnit',", "'object']", "True"]
    tests = ["tests/test_hot_path.py", "tests/test_compiled_hot_path.py", "tests/test_steps_loop.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-k", "not the_package_without_the_extension", *tests],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_a_step_is_annotated_while_a_profiler_runs_and_not_otherwise(hot_path):
    """The annotator's cheap check (``annotate.enabled``; JAX's ``StepTraceAnnotation.is_enabled``) stands
    in for the call to ``annotate(n)`` only while it says no profiler runs; then the annotation opens at
    the step's entry and closes at its exit, as in Python."""
    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id=f"annotate-{hot_path}", stall_watch=False)
    with steptrace.step(0) as s:
        s.wait_for(1.0)
    profiling = [False]
    calls = []

    class Annotation:
        def __init__(self, n):
            self.n = n

        def __exit__(self, *exc):
            calls.append(("close", self.n))

    def annotate(n):
        calls.append(("annotate", n))
        return Annotation(n) if profiling[0] else None

    annotate.enabled = lambda: profiling[0]
    runtime = steptrace._active
    runtime.annotate, runtime.annotate_enabled = annotate, annotate.enabled
    with steptrace.step(1) as s:
        s.wait_for(1.0)
    profiling[0] = True
    with steptrace.step(2) as s:
        s.wait_for(1.0)
        calls.append(("inside", 2))
    steptrace.shutdown()
    opened = [("annotate", 2), ("inside", 2), ("close", 2)]
    assert calls == (opened if hot_path == "compiled" else [("annotate", 1)] + opened)


def test_logged_scalars_are_the_same_both_ways(hot_path):
    """s.log: host floats are kept by the compiled call; anything else (a device scalar, a bad value, a
    call outside the step) goes, with all its arguments, to the Python method."""
    import jax.numpy as jnp

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=f"log-{hot_path}", stall_watch=False, strict=False)
    with steptrace.step(0) as s:
        s.log(loss=0.5, grad_norm=2.0)
        s.log(loss=0.25)  # a second call overwrites
        s.wait_for(1.0)
    with steptrace.step(1) as s:
        s.log()
        assert s.scalars == {}
        s.wait_for(1.0)
    with steptrace.step(2) as s:
        with pytest.warns(UserWarning, match="is not a scalar"):
            s.log(loss=0.75, tokens="many")
        s.log(lr=jnp.float32(0.125), loss=1.5)
        s.wait_for(1.0)
    with pytest.warns(UserWarning, match="log\\(\\) called outside its step"):
        s.log(loss=9.0)
    assert steptrace.flush(30.0)
    steps = {r["step"]: r for r in sink.steps()}
    steptrace.shutdown()
    assert steps[0]["scalars"] == {"loss": 0.25, "grad_norm": 2.0}
    assert "scalars" not in steps[1]
    assert steps[2]["scalars"] == {"loss": 1.5, "lr": 0.125}


def test_spans_open_and_close_the_same_both_ways(hot_path):
    """Spans between and inside steps, nested, with attrs, begun by begin_span, as a decorator, one that
    crosses into a step (misuse, said once) and one closed out of order: the records are the Python
    methods' (tests/test_hot_path.py's golden test checks the common ones field by field)."""
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=f"spans-{hot_path}", stall_watch=False, strict=False)

    @steptrace.span("eval")
    def evaluate():
        return 7

    with steptrace.span("data", shard=3):
        pass
    assert evaluate() == 7
    with steptrace.step(0) as s:
        with steptrace.span("data"):
            with steptrace.span("h2d"):
                pass
        s.wait_for(1.0)
    outer = steptrace.span("outer").__enter__()
    with pytest.warns(UserWarning, match="ended inside step"):
        with steptrace.step(1) as s:
            inner = steptrace.span("inner").__enter__()
            outer.__exit__(None, None, None)  # not the innermost: the Python method closes it
            inner.__exit__(None, None, None)
            s.wait_for(1.0)
    steptrace.begin_span("save")
    steptrace.end_span("save")
    with pytest.warns(UserWarning, match="non-empty string"):
        steptrace.span("")
    assert steptrace.flush(30.0)
    spans = [(r["name"], r.get("step"), r.get("attrs")) for r in sink.spans()]
    steptrace.shutdown()
    assert spans == [("data", None, {"shard": 3}), ("eval", None, {}), ("h2d", 0, {}), ("data", 0, {}),
                     ("outer", 1, {}), ("inner", 1, {}), ("save", None, {})]


def test_steptrace_off_accepts_what_it_accepts_in_python():
    """init(enabled=False): ``steptrace.step`` (compiled where built) takes n once, by position or by name,
    with any step arguments, and returns the shared no-op, whose calls do nothing and swallow nothing."""
    steptrace.init(enabled=False)
    try:
        null = steptrace.step(3, tokens=5, lr=0.1)
        assert steptrace.step(n=4) is null
        for bad in ((), (1, 2)):
            with pytest.raises(TypeError):
                steptrace.step(*bad)
        with pytest.raises(TypeError):
            steptrace.step(1, n=2)
        with pytest.raises(TypeError):
            steptrace.step(tokens=5)
        with null as s:
            assert s is null
            assert s.wait_for(1.0, 2.0) is None and s.log(loss=0.5) is None
            assert s.async_done() is None and s.track(object()) is None
        with pytest.raises(KeyError):
            with null:
                raise KeyError("kept")
    finally:
        steptrace.shutdown()


def test_microbatches_are_the_same_both_ways(hot_path):
    """Pipeline microbatches (the hot path of a pipeline rank: hundreds a step): arguments, kinds, JAX
    values, misuse; the records are the Python methods'."""
    import jax.numpy as jnp

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id=f"mb-{hot_path}", stall_watch=False, strict=False)
    value = jnp.ones(())
    with pytest.warns(UserWarning, match="outside a step"):
        steptrace.microbatch(0)
    with steptrace.step(0) as s:
        for index in range(3):
            with steptrace.microbatch(index, stage=1, chunk=0):
                pass
            with steptrace.microbatch(index, stage=1, chunk=0, kind="backward") as mb:
                mb.wait_for(value)
        with pytest.warns(UserWarning, match="unknown"):
            steptrace.microbatch(9, kind="sideways")
        with pytest.raises(TypeError):
            steptrace.microbatch(9, colour="red")
        s.wait_for(value)
    assert steptrace.flush(30.0)
    units = [(r["microbatch"], r["stage"], r["chunk"], r["kind"]) for r in sink.microbatches()]
    steptrace.shutdown()
    assert units == [(i, 1, 0, kind) for i in range(3) for kind in ("forward", "backward")]


def test_a_binary_built_from_another_source_is_not_used(tmp_path):
    """An in-place build that fails after an edit of _hotpath.c leaves the previous binary behind: it is
    not used (the Python calls run, with a warning), where the source is there to compare."""
    import hashlib

    from steptrace._errors import SteptraceWarning

    source = tmp_path / "_hotpath.c"
    source.write_text("/* version 1 */")
    module = types.SimpleNamespace(SOURCE_SHA256=hashlib.sha256(b"/* version 1 */").hexdigest(),
                                   __file__="_hotpath.so")
    assert _handles.compiled_matching_source(module, source) is module
    source.write_text("/* version 2 */")
    with pytest.warns(SteptraceWarning, match="built from another _hotpath.c"):
        assert _handles.compiled_matching_source(module, source) is None
    assert _handles.compiled_matching_source(module, tmp_path / "not-shipped.c") is module


@compiled_only
def test_the_extension_here_was_built_from_its_source():
    import hashlib

    source = (ROOT / "steptrace" / "_hotpath.c").read_bytes()
    assert _handles._hotpath.SOURCE_SHA256 == hashlib.sha256(source).hexdigest()
