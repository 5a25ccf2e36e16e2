"""Public API behaviour: configuration, misuse, disabled mode, drops, import cost."""

import json
import os
import subprocess
import sys
import time

import pytest

import steptrace
from steptrace import SteptraceWarning
from steptrace._config import resolve_config
from steptrace.testing import MemorySink, capture


# -- configuration ------------------------------------------------------------------------
def test_code_wins_over_steptrace_env_which_wins_over_launcher_env():
    env = {"STEPTRACE_RANK": "2", "RANK": "3", "WORLD_SIZE": "4", "STEPTRACE_RUN_ID": "from-env"}
    assert resolve_config(env).rank == 2
    assert resolve_config(env).world_size == 4
    assert resolve_config(env).run_id == "from-env"
    assert resolve_config(env, rank=1).rank == 1
    assert resolve_config({"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job"}).rank == 3


def test_several_ranks_without_a_shared_run_id_warn():
    with pytest.warns(SteptraceWarning, match="ranks share one trace"):
        cfg = resolve_config({"RANK": "1", "WORLD_SIZE": "2"})
    assert cfg.run_id


def test_otlp_settings_from_standard_variables_code_wins():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t,x-team=ml", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
           "OTEL_SERVICE_NAME": "trainer"}
    cfg = resolve_config(env)
    assert cfg.otlp_endpoint == "http://127.0.0.1:4318" and cfg.otlp_protocol == "grpc"
    assert cfg.otlp_headers == (("authorization", "Bearer t"), ("x-team", "ml"))
    assert cfg.otlp_compression == "gzip" and cfg.service_name == "trainer"
    cfg = resolve_config(env, otlp_endpoint="http://10.0.0.1:4318", otlp_headers={"a": "b"},
                         otlp_protocol="http/protobuf")
    assert cfg.otlp_endpoint == "http://10.0.0.1:4318" and cfg.otlp_headers == (("a", "b"),)
    assert cfg.otlp_protocol == "http/protobuf"
    assert resolve_config({}).otlp_endpoint is None  # off unless asked for


def test_defaults_single_process_and_generated_run_id():
    cfg = resolve_config({})
    assert (cfg.rank, cfg.world_size, cfg.enabled, cfg.backend) == (0, 1, True, "auto")
    assert cfg.run_id and cfg.run_id != resolve_config({}).run_id


def test_disabled_by_environment():
    assert resolve_config({"STEPTRACE_DISABLED": "1"}).enabled is False
    assert resolve_config({"STEPTRACE_DISABLED": "1"}, enabled=True).enabled is True


@pytest.mark.parametrize(
    "env, code, field",
    [
        ({"STEPTRACE_RANK": "abc"}, {}, "STEPTRACE_RANK"),
        ({}, {"rank": 4, "world_size": 4, "run_id": "r"}, "rank"),
        ({}, {"world_size": 0}, "world_size"),
        ({}, {"backend": "tpu"}, "backend"),
        ({}, {"peak_tflops": -1.0}, "peak_tflops"),
        ({"STEPTRACE_DISABLED": "maybe"}, {}, "STEPTRACE_DISABLED"),
        ({}, {"run_id": "a/b"}, "run_id"),
        # What the collector would refuse is refused here, so no rank sends spans that are all rejected.
        ({}, {"run_id": "x" * 250}, "run_id"),
        ({}, {"run_id": "a\tb"}, "run_id"),
        ({}, {"run_id": "a\x00b"}, "run_id"),
        ({"STEPTRACE_RUN_ID": "a\\b"}, {}, "run_id"),
        ({}, {"max_queue": 1}, "max_queue"),
        ({}, {"colour": "blue"}, "colour"),
        ({"STEPTRACE_PROMETHEUS_PORT": "http"}, {}, "STEPTRACE_PROMETHEUS_PORT"),
        ({}, {"prometheus_port": 70000}, "STEPTRACE_PROMETHEUS_PORT"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"}, {}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, {}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, {}, "OTEL_EXPORTER_OTLP_COMPRESSION"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, {}, "OTEL_EXPORTER_OTLP_HEADERS"),
        ({}, {"goodput_window_steps": 0}, "goodput_window_steps"),
        # Infinities and NaNs fail here, not in shutdown() (where inf raised OverflowError).
        ({"STEPTRACE_SHUTDOWN_TIMEOUT_S": "inf"}, {}, "STEPTRACE_SHUTDOWN_TIMEOUT_S"),
        ({"STEPTRACE_PEAK_TFLOPS": "nan"}, {}, "STEPTRACE_PEAK_TFLOPS"),
        ({}, {"shutdown_timeout_s": float("inf")}, "shutdown_timeout_s"),
        ({}, {"shutdown_timeout_s": 1e20}, "shutdown_timeout_s"),
        ({}, {"otlp_timeout_s": float("nan")}, "otlp_timeout_s"),
        ({}, {"peak_tflops": float("inf")}, "peak_tflops"),
        # Malformed endpoints: no host, a port out of range, port 0, spaces.
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://"}, {}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:99999"}, {}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({}, {"otlp_endpoint": "http://host:0"}, "otlp_endpoint"),
        ({}, {"otlp_endpoint": "http://ho st:4318"}, "otlp_endpoint"),
    ],
)
def test_bad_configuration_fails_at_init_naming_the_field(env, code, field):
    with pytest.raises(ValueError, match=field):
        resolve_config(env, **code)


def test_unwritable_run_dir_is_a_clear_error_at_init(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="run_dir"):
        steptrace.init(run_dir=str(blocker), run_id="r")


def test_sink_without_the_protocol_is_rejected_at_init():
    with pytest.raises(ValueError, match="sinks"):
        steptrace.init(jsonl=False, sinks=[object()])


# -- misuse inside the loop: warn (or raise when strict), never crash ------------------------
def run_misuse(action, strict):
    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], strict=strict, run_id="m")
    try:
        action()
    finally:
        steptrace.shutdown()
    return sink


def nested_step():
    with steptrace.step(0):
        with steptrace.step(1):
            pass


def decreasing_steps():
    with steptrace.step(5):
        pass
    with steptrace.step(5):
        pass


def negative_tokens():
    with steptrace.step(0, tokens=-3):
        pass


def unknown_kind():
    with steptrace.step(0):
        with steptrace.microbatch(0, kind="sideways"):
            pass


def wait_for_outside_step():
    with steptrace.step(0) as s:
        pass
    s.wait_for(1.0)


def microbatch_outside_step():
    with steptrace.microbatch(0):
        pass


@pytest.mark.parametrize(
    "action, fix",
    [
        (nested_step, "steps cannot nest"),
        (decreasing_steps, "step numbers must increase"),
        (negative_tokens, "non-negative number"),
        (unknown_kind, "use one of forward, backward, backward_input, backward_weight"),
        (wait_for_outside_step, "inside `with steptrace.step"),
        (microbatch_outside_step, "outside a step"),
    ],
)
def test_misuse_warns_with_the_fix_and_training_goes_on(action, fix):
    with pytest.warns(SteptraceWarning, match=fix):
        run_misuse(action, strict=False)


@pytest.mark.parametrize("action", [nested_step, decreasing_steps, negative_tokens, unknown_kind,
                                    wait_for_outside_step, microbatch_outside_step])
def test_misuse_raises_value_error_in_strict_mode(action):
    with pytest.raises(ValueError):
        run_misuse(action, strict=True)


def test_misused_calls_are_counted_and_good_steps_still_recorded():
    with pytest.warns(SteptraceWarning):
        sink = MemorySink()
        steptrace.init(jsonl=False, sinks=[sink], run_id="m")
        with steptrace.step(0):
            pass
        with steptrace.step(0):  # repeated number: dropped
            pass
        with steptrace.step(1, tokens=-1):  # bad value dropped, the step kept
            pass
        counts = steptrace.stats()
        steptrace.shutdown()
    assert [r["step"] for r in sink.steps()] == [0, 1]
    assert sink.steps()[1]["tokens"] is None
    assert counts["dropped"]["misuse"] == 2
    (run,) = sink.of_type("run")
    assert run["dropped"]["misuse"] == 2 and run["steps"] == 2


def _next_line() -> int:
    """The line after the caller's: where the call under test is."""
    return sys._getframe(1).f_lineno + 1


def test_a_bad_count_is_reported_at_the_users_line_whatever_the_form():
    """A bad tokens/flops/samples value (and a bad scalar) warns pointing at the caller's line in this
    file, not at steptrace's own code: the `with` form, begin_step/end_step, a steps() loop (its `for`
    line) and the module-level log() each reach the check through a different depth of steptrace's frames."""
    import warnings

    where = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="where", strict=False)
        try:
            where.append(_next_line())
            with steptrace.step(0, tokens=-5):
                pass
            where.append(_next_line())
            with steptrace.step(1, flops=-1.0, samples=2):
                pass
            where.append(_next_line())
            steptrace.begin_step(2, samples=-2)
            steptrace.end_step()
            where.append(_next_line())
            for _n, _item in steptrace.steps([0], start=3, tokens=-7):
                pass
            with steptrace.step(4):
                where.append(_next_line())
                steptrace.log(loss=object())
        finally:
            steptrace.shutdown()
    found = [(w.filename, w.lineno) for w in caught if issubclass(w.category, SteptraceWarning)]
    assert found == [(__file__, line) for line in where]


def test_device_arrays_are_refused_as_token_counts():
    class FakeDeviceArray:  # float() on a real one would synchronise the device
        def __float__(self):
            raise AssertionError("steptrace must not convert device values on the training thread")

    with pytest.warns(SteptraceWarning, match="not a device array"):
        run_misuse(lambda: steptrace.step(0, tokens=FakeDeviceArray()).__enter__().__exit__(None, None, None),
                   strict=False)


def test_numpy_scalars_are_accepted_as_counts():
    np = pytest.importorskip("numpy")
    with capture() as sink:
        with steptrace.step(0, tokens=np.int64(128), flops=np.float32(1e9)):
            pass
    assert sink.steps()[0]["tokens"] == 128 and isinstance(sink.steps()[0]["tokens"], int)


# -- disabled and uninitialised -------------------------------------------------------------
def test_disabled_every_call_is_a_shared_noop(tmp_path):
    steptrace.init(enabled=False, run_dir=str(tmp_path), run_id="off")
    assert not steptrace.enabled()
    handle = steptrace.step(0, tokens=1)
    assert handle is steptrace.step(1) is steptrace.checkpoint(0)
    assert handle is steptrace.microbatch(0, kind="anything")
    # A span keeps its name (a decorator applied while off times calls once a run starts), shared per
    # name so that the disabled path allocates nothing.
    assert steptrace.span("data") is steptrace.span("data") is steptrace.begin_span("data")
    with steptrace.span("data"):
        steptrace.end_span()
    with steptrace.step(0) as s:
        s.wait_for(object())
    assert steptrace.flush() is True
    assert list(tmp_path.iterdir()) == []


def test_disabled_by_env_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPTRACE_DISABLED", "1")
    steptrace.init(run_dir=str(tmp_path))
    assert not steptrace.enabled()


def test_step_before_init_warns_once_and_records_nothing():
    code = ("import warnings, steptrace\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    for n in range(3):\n"
            "        with steptrace.step(n): pass\n"
            "print(len(w), w[0].message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("1 steptrace.step() called before steptrace.init()")


# -- robustness of export -------------------------------------------------------------------
class FailingSink(MemorySink):
    name = "failing"

    def export(self, records):
        raise RuntimeError("collector down")


class SlowSink(MemorySink):
    name = "slow"

    def export(self, records):
        time.sleep(0.05)
        super().export(records)


def test_a_failing_sink_is_counted_and_does_not_stop_other_sinks():
    good = MemorySink()
    steptrace.init(jsonl=False, sinks=[FailingSink(), good], run_id="f")
    for n in range(5):
        with steptrace.step(n):
            pass
    steptrace.flush()
    dropped = steptrace.stats()["dropped"]
    steptrace.shutdown()
    assert len(good.steps()) == 5
    assert dropped["sink:failing"] == 7  # 5 steps, the attempt and the metadata record


def test_a_slow_sink_drops_and_counts_instead_of_blocking_the_loop():
    slow = SlowSink()
    steptrace.init(jsonl=False, sinks=[slow], run_id="s", max_queue=16)
    t0 = time.perf_counter()
    for n in range(400):
        with steptrace.step(n):
            pass
    loop_seconds = time.perf_counter() - t0
    steptrace.flush(timeout_s=10)
    dropped = steptrace.stats()["dropped"]
    steptrace.shutdown()
    # The small queue overflows in the resolver or in front of the sink; either way it is counted.
    lost = dropped.get("sink:slow", 0) + dropped.get("resolver_queue", 0)
    assert lost > 0
    assert len(slow.steps()) + lost == 400  # nothing lost silently
    assert loop_seconds < 400 * 0.05 / 4  # the loop never waited for the sink's 50 ms exports


def test_shutdown_returns_in_bounded_time_when_the_device_never_finishes():
    class StuckDevice:
        name = "stuck"
        uses_events = False

        def wait_values(self, values):
            time.sleep(3600)

    class Never:
        _steptrace_device = StuckDevice()

    sink = MemorySink()
    steptrace.init(jsonl=False, sinks=[sink], run_id="stuck")
    with steptrace.step(0) as s:
        s.wait_for(Never())
    t0 = time.perf_counter()
    complete = steptrace.shutdown(timeout_s=0.5)
    assert time.perf_counter() - t0 < 3
    assert complete is False
    (run,) = sink.of_type("run")
    assert run["dropped"]["unresolved_at_shutdown"] == 1


def test_import_steptrace_imports_no_framework_or_exporter():
    code = ("import sys, steptrace, steptrace.testing\n"
            "print(sorted(m for m in ('jax','torch','opentelemetry','prometheus_client','numpy','rich',"
            "'matplotlib','tensorboard','mlflow','wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


def test_reinit_shuts_down_the_previous_run(tmp_path):
    first = MemorySink()
    steptrace.init(jsonl=False, sinks=[first], run_id="a")
    with steptrace.step(0):
        pass
    steptrace.init(jsonl=False, sinks=[MemorySink()], run_id="b")
    assert first.shut_down and len(first.steps()) == 1
    with steptrace.step(0):  # step numbers restart with a new run
        pass


def test_flush_makes_records_visible_mid_run():
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n):
                pass
        assert steptrace.flush(timeout_s=5)
        assert [r["step"] for r in sink.steps()] == [0, 1, 2]
        assert os.environ.get("STEPTRACE_DISABLED") is None


def test_unknown_steptrace_variables_warn_with_the_nearest_name():
    with pytest.warns(SteptraceWarning, match="STEPTRACE_RUNID is not a steptrace setting.*STEPTRACE_RUN_ID"):
        resolve_config({"STEPTRACE_RUNID": "x"})
    with pytest.warns(SteptraceWarning, match="STEPTRACE_ZZZ is not a steptrace setting"):
        resolve_config({"STEPTRACE_ZZZ": "1"})


def test_the_shutdown_at_exit_with_a_finite_timeout_writes_every_step(tmp_path):
    code = ("import steptrace\n"
            f"steptrace.init(run_dir={str(tmp_path)!r}, run_id='exit')\n"
            "for n in range(3):\n"
            "    with steptrace.step(n):\n"
            "        pass\n")
    env = {**os.environ, "STEPTRACE_SHUTDOWN_TIMEOUT_S": "86400"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
    lines = (tmp_path / "exit" / "rank-0.jsonl").read_text().splitlines()
    assert sum('"type":"step"' in line for line in lines) == 3
