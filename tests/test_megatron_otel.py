"""Megatron-LM's own OpenTelemetry export and steptrace's in one picture (issue 39): one trace per step,
one resource per rank, no metric name exported twice.

Megatron's side is tests/megatron_scripts/megatron_otel_standin.py (nemo-lens needs Python >= 3.13 and
Megatron-LM's training loop its GPU stack; the stand-in names the source of each rule it models).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the OTLP join needs opentelemetry-sdk")
pytest.importorskip("megatron.core", reason="the Megatron hooks need megatron-core")

from otlp_receiver import OtlpHttpReceiver  # noqa: E402

import steptrace  # noqa: E402
from steptrace import SteptraceWarning  # noqa: E402
from steptrace._ids import span_id, trace_id  # noqa: E402
from steptrace.adapters import megatron_otel  # noqa: E402
from steptrace.otlp import nemo_lens_resource  # noqa: E402

SCRIPTS = Path(__file__).parent / "megatron_scripts"
RUN_ID = "megatron-run"
ITERATIONS = 5
SAVE_INTERVAL = 2
_IDENTITY = ("service.name", "service.instance.id", "nemo.run.id", "dl.rank", "dl.world_size")


def _megatron_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "STEPTRACE_")) and k != "SLURM_JOB_ID"}
    env.update({"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_SPAN_GROUPS": "per_step",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", **extra})
    return env


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks of one Megatron-style run, both exporters on, one receiver; Megatron exports from the
    last rank only (its default)."""
    run_dir = tmp_path_factory.mktemp("megatron-otel")
    with OtlpHttpReceiver() as receiver:
        procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "megatron_otel_run.py"), receiver.url, str(run_dir),
                                   str(rank), "2", str(ITERATIONS), str(SAVE_INTERVAL)],
                                  env=_megatron_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in (0, 1)]
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        metric_names: dict[str, set[str]] = {}
        for request in receiver.metric_requests():
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        metric_names.setdefault(scope_metrics.scope.name, set()).add(metric.name)
        yield receiver.spans(), metric_names, outputs


def test_each_step_is_one_trace_holding_every_ranks_steptrace_spans_and_megatrons_step_spans(two_ranks):
    spans, _, outputs = two_ranks
    assert all("megatron.training.training._otel_managed_span" in o["hooks"] for o in outputs)
    megatron_steps = [s for s in spans if s.name in ("megatron.train.iteration", "megatron.train.first_iteration")]
    assert sorted(s.attributes["megatron.iteration"] for s in megatron_steps if s.name == "megatron.train.iteration") \
        == list(range(ITERATIONS))
    for n in range(ITERATIONS):
        step_spans = [s for s in spans if s.name == "train.step" and s.attributes["train.step"] == n]
        mine = [s for s in megatron_steps if s.attributes["megatron.iteration"] == n]
        # One trace per step: steptrace's step on both ranks and Megatron's spans of that iteration.
        assert {s.trace_id for s in step_spans + mine} == {trace_id(RUN_ID, n)}
        assert sorted(s.attributes["train.rank"] for s in step_spans) == [0, 1]
        iteration = next(s for s in mine if s.name == "megatron.train.iteration")
        if n == 0:  # the first iteration this process ran: its own span, the iteration inside it
            first = next(s for s in mine if s.name == "megatron.train.first_iteration")
            assert first.parent_span_id == span_id(RUN_ID, n, 1, "step") and iteration.parent_span_id == first.span_id
        else:  # a child of the exporting (last) rank's step span
            assert iteration.parent_span_id == span_id(RUN_ID, n, 1, "step")
    # Everything else Megatron traces stays in its checkpoint-interval traces, as Megatron segments them.
    intervals = [s for s in spans if s.name == "megatron.train"]
    assert len(intervals) == -(-ITERATIONS // SAVE_INTERVAL)
    saves = [s for s in spans if s.name == "megatron.checkpoint.save"]
    assert saves and {s.trace_id for s in saves} <= {s.trace_id for s in intervals}
    assert not {s.trace_id for s in intervals} & {trace_id(RUN_ID, n) for n in range(ITERATIONS)}


def test_both_exporters_share_each_ranks_resource_identity(two_ranks):
    spans, _, outputs = two_ranks
    # Megatron's nemo-lens would draw a random run id per process: steptrace handed it its own.
    assert [o["megatron_run_id_env"] for o in outputs] == [RUN_ID, RUN_ID]
    megatron = {tuple(s.resource.get(k) for k in _IDENTITY) for s in spans if s.scope == "nemo.lens"}
    assert megatron == {("megatron-lm", f"{RUN_ID}-rank1", RUN_ID, 1, 2)}  # the last rank exports
    for rank in (0, 1):
        mine = {tuple(s.resource.get(k) for k in _IDENTITY) for s in spans
                if s.scope == "steptrace" and s.attributes["train.rank"] == rank}
        assert mine == {("megatron-lm", f"{RUN_ID}-rank{rank}", RUN_ID, rank, 2)}


def test_no_metric_name_is_exported_by_both(two_ranks):
    _, names, _ = two_ranks
    assert {"megatron.training.step_duration_ms", "megatron.training.tokens_per_sec",
            "megatron.training.throughput_tflops"} <= names["nemo.lens"]
    assert {"steptrace.step.interval", "steptrace.tokens_per_second", "steptrace.tflops_per_second"} \
        <= names["steptrace"]
    assert not names["nemo.lens"] & names["steptrace"]

    def prometheus(name: str) -> str:  # the collector's translation: dots to underscores
        return name.replace(".", "_")

    assert not {prometheus(n) for n in names["nemo.lens"]} & {prometheus(n) for n in names["steptrace"]}


# -- the rules, one by one --------------------------------------------------------------------------
@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"MEGATRON_OTEL_ENABLED": "0"}, None),
    ({"MEGATRON_OTEL_ENABLED": "1"}, ("megatron-lm", "st-run", "st-run-rank3")),
    ({"NEMO_LENS_ENABLED": "true"}, ("nemo", "st-run", "st-run-rank3")),
    ({"MEGATRON_OTEL_ENABLED": "", "NEMO_LENS_ENABLED": "yes"}, ("nemo", "st-run", "st-run-rank3")),
    ({"MEGATRON_OTEL_ENABLED": "1", "SLURM_JOB_ID": "4242"}, ("megatron-lm", "4242", "4242-rank3")),
    ({"MEGATRON_OTEL_ENABLED": "1", "SLURM_JOB_ID": "4242", "NEMO_LENS_RUN_ID": "lens"},
     ("megatron-lm", "lens", "lens-rank3")),
    ({"MEGATRON_OTEL_ENABLED": "on", "MEGATRON_OTEL_RUN_ID": "mega", "NEMO_LENS_RUN_ID": "lens",
      "OTEL_SERVICE_NAME": "pretrain"}, ("pretrain", "mega", "mega-rank3")),
])
def test_the_nemo_lens_resource_follows_nemo_lens_and_megatron(env, expected):
    found = nemo_lens_resource(env, "st-run", 3, 8, None)
    if expected is None:
        assert found is None
        return
    assert (found["service.name"], found["nemo.run.id"], found["service.instance.id"]) == expected
    assert (found["dl.rank"], found["dl.world_size"]) == (3, 8)
    # A service name given to steptrace in code wins, as everywhere else.
    assert nemo_lens_resource(env, "st-run", 3, 8, "mine")["service.name"] == "mine"


@pytest.mark.parametrize("env, handed", [
    ({"MEGATRON_OTEL_ENABLED": "1"}, "st-run"),
    ({"MEGATRON_OTEL_ENABLED": "1", "SLURM_JOB_ID": "4242"}, None),  # nemo-lens's own shared id stands
    ({"MEGATRON_OTEL_ENABLED": "1", "NEMO_LENS_RUN_ID": "lens"}, None),
    ({}, None),  # Megatron's export off: nothing to join
])
def test_steptrace_hands_its_run_id_to_megatron_only_where_nemo_lens_would_draw_one(env, handed, monkeypatch):
    for key in list(os.environ):
        if key.startswith("STEPTRACE_") or key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    with OtlpHttpReceiver() as receiver:
        steptrace.init(run_id="st-run", jsonl=False, otlp_endpoint=receiver.url)
        try:
            env = dict(env)
            assert megatron_otel.hand_run_id_to_megatron(env) == handed
            assert env.get("MEGATRON_OTEL_RUN_ID") == handed
        finally:
            steptrace.shutdown(timeout_s=2.0)


def test_megatrons_span_stays_in_its_own_trace_when_steptrace_does_not_export_otlp(monkeypatch):
    """Parenting Megatron's step span to a steptrace span that is never exported would orphan it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    sys.path.insert(0, str(SCRIPTS))
    import megatron_otel_standin as lens

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("nemo.lens")
    monkeypatch.setattr(lens, "_groups", lens.PRESETS["per_step"])
    training = type(sys)("training")
    training.get_telemetry = lambda: lens.Handle(tracer, None, True)
    hook = megatron_otel._hook_managed_span(lens.managed_span, training, lambda: 0)
    monkeypatch.setattr(megatron_otel, "_warned", set())
    for key in ("MEGATRON_OTEL_ENABLED", "NEMO_LENS_ENABLED"):
        monkeypatch.delenv(key, raising=False)
    for otlp in (False, True):
        with OtlpHttpReceiver() as receiver:
            steptrace.init(run_id="st-run", jsonl=False, otlp_endpoint=receiver.url if otlp else None)
            try:
                # Megatron's export turned on by --otel-enabled alone: steptrace's resource could not
                # join at init, and says how to make it.
                with pytest.warns(SteptraceWarning, match="Set MEGATRON_OTEL_ENABLED=1") if otlp else nullcontext():
                    with hook("step", "megatron.train.iteration", tracer=tracer, **{"megatron.iteration": 7}):
                        pass
                with hook("checkpoint", "megatron.checkpoint.save", tracer=tracer, **{"megatron.iteration": 7}):
                    pass
            finally:
                steptrace.shutdown(timeout_s=2.0)
    off, off_save, on, on_save = exporter.get_finished_spans()
    assert off.parent is None and off.context.trace_id != trace_id("st-run", 7)
    assert on.context.trace_id == trace_id("st-run", 7) and on.parent.span_id == span_id("st-run", 7, 0, "step")
    assert on.attributes["megatron.iteration"] == 7
    # Spans that are not per-step keep Megatron's placement either way.
    assert off_save.context.trace_id != trace_id("st-run", 7) and on_save.context.trace_id != trace_id("st-run", 7)
