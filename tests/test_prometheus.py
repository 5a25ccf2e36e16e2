"""The Prometheus exporter: what a scrape of one rank's /metrics reports for the records it was given."""

import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="the Prometheus exporter needs `pip install 'steptrace[prometheus]'`")
from prometheus_client.openmetrics import parser as openmetrics_parser  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import steptrace  # noqa: E402
from steptrace._config import ENV_PROMETHEUS_PORT  # noqa: E402
from steptrace._ids import trace_id_hex  # noqa: E402
from steptrace._buckets import STEP_BUCKETS_S as SECONDS_BUCKETS  # noqa: E402
from steptrace.prometheus import PrometheusSink  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

RUN = {"run_id": "r", "rank": "0"}


# -- helpers ---------------------------------------------------------------------------------------

def step_record(n, interval, compute, *, status="ok", idle=None, tokens=None, flops=None, mfu=None,
                bubble=None, backend="simulated"):
    """A step record as the resolver writes it (docs/records.md)."""
    record = {
        "type": "step", "run_id": "r", "rank": 0, "world_size": 1, "step": n,
        "trace_id": trace_id_hex("r", n), "status": status, "backend": backend,
        "interval_seconds": interval, "compute_seconds": compute, "idle_seconds": interval - compute,
        "idle_breakdown": idle if idle is not None else ({"other": interval - compute} if interval > compute else {}),
        "tokens": tokens, "samples": None, "flops": flops,
        "tokens_per_second": tokens / interval if tokens is not None else None,
        "samples_per_second": None,
        "tflops_per_second": flops / compute / 1e12 if flops is not None else None,
        "mfu": mfu, "attrs": {},
    }
    if bubble is not None:
        record["pipeline_bubble_ratio"] = bubble
    return record


def checkpoint_record(step, blocking, async_seconds=None, status="ok"):
    return {"type": "checkpoint", "run_id": "r", "rank": 0, "step": step, "status": status,
            "start_time": 1.0, "end_time": 2.0, "host_seconds": blocking + 0.1,
            "blocking_seconds": blocking, "async_seconds": async_seconds}


def microbatch_record(step, index, compute, *, stage=None, chunk=None, kind="forward"):
    return {"type": "microbatch", "run_id": "r", "rank": 0, "step": step, "microbatch": index,
            "stage": stage, "chunk": chunk, "kind": kind, "compute_seconds": compute}


def scrape(endpoint, openmetrics=False):
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    with urllib.request.urlopen(urllib.request.Request(endpoint, headers=headers), timeout=5) as response:
        return response.read().decode()


def samples(text):
    """Every sample of a text-format exposition."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text, metric, /, **labels):
    """The value of the one sample called ``metric`` whose labels include ``labels`` (plus run_id, rank)."""
    want = {**RUN, **{k: str(v) for k, v in labels.items()}}
    found = [s.value for s in samples(text) if s.name == metric and want.items() <= s.labels.items()]
    assert len(found) == 1, f"{metric}{want}: {len(found)} samples"
    return found[0]


def bucket(text, name, le, **labels):
    return value(text, name + "_bucket", le=le, **labels)


def le_label(bound):
    return prometheus_client.utils.floatToGoString(bound)


@pytest.fixture
def sink():
    s = PrometheusSink(0, run_id="r", rank=0, goodput_window_steps=4)
    yield s
    s.shutdown(1)


@pytest.fixture
def hist_sink():
    """A sink with bucketed per-rank histograms (prometheus_histograms=True)."""
    s = PrometheusSink(0, run_id="r", rank=0, goodput_window_steps=4, histograms=True)
    yield s
    s.shutdown(1)


def connect_refused(endpoint):
    host_port = endpoint.split("//")[1].split("/")[0]
    host, port = host_port.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


# -- what one scrape reports -----------------------------------------------------------------------

def test_step_histograms_hold_one_observation_per_step_record(hist_sink):
    sink = hist_sink
    intervals = [0.004, 0.015, 0.015, 0.3, 7.0]
    computes = [0.003, 0.012, 0.011, 0.25, 0.5]
    sink.export([step_record(n, i, c) for n, (i, c) in enumerate(zip(intervals, computes))])
    text = scrape(sink.endpoint)
    for name, values in (("steptrace_step_interval_seconds", intervals),
                         ("steptrace_step_compute_seconds", computes)):
        assert value(text, name + "_count") == len(values)
        assert value(text, name + "_sum") == pytest.approx(sum(values))
        for bound in SECONDS_BUCKETS:
            assert bucket(text, name, le_label(bound)) == sum(v <= bound for v in values), (name, bound)
        assert bucket(text, name, "+Inf") == len(values)


def test_buckets_span_a_millisecond_to_ten_minutes_roughly_exponentially():
    assert SECONDS_BUCKETS[0] == 0.001 and SECONDS_BUCKETS[-1] == 600
    ratios = [b / a for a, b in zip(SECONDS_BUCKETS, SECONDS_BUCKETS[1:])]
    assert all(1.4 <= r <= 3 for r in ratios), ratios


def test_idle_seconds_per_reason_are_the_summed_breakdowns(sink):
    breakdowns = [{"data": 0.01, "other": 0.001}, {"checkpoint": 2.0}, {"data": 0.02, "compile": 3.5}, {}]
    sink.export([step_record(n, 5.0, 1.0, idle=b) for n, b in enumerate(breakdowns)])
    text = scrape(sink.endpoint)
    for reason, total in {"data": 0.03, "other": 0.001, "checkpoint": 2.0, "compile": 3.5}.items():
        assert value(text, "steptrace_step_idle_seconds_total", reason=reason) == pytest.approx(total)
    assert {s.labels["reason"] for s in samples(text) if s.name == "steptrace_step_idle_seconds_total"} == \
        {"data", "other", "checkpoint", "compile"}


def test_steps_total_by_status_and_last_step(sink):
    text = scrape(sink.endpoint)
    # Both statuses exist before the first step, so rate() and sum() work from the start.
    assert value(text, "steptrace_steps_total", status="ok") == 0
    assert value(text, "steptrace_steps_total", status="error") == 0
    sink.export([step_record(n, 0.1, 0.1, status="error" if n == 13 else "ok") for n in range(10, 16)])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_steps_total", status="ok") == 5
    assert value(text, "steptrace_steps_total", status="error") == 1
    assert value(text, "steptrace_last_step") == 15


def test_tokens_and_throughput_follow_the_records(sink):
    records = [step_record(n, 0.5, 0.4, tokens=1000 * (n + 1), flops=4e12) for n in range(3)]
    sink.export(records)
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_tokens_total") == 6000
    assert value(text, "steptrace_tokens_per_second") == pytest.approx(3000 / 0.5)
    assert value(text, "steptrace_tflops_per_second") == pytest.approx(10.0)


def test_goodput_is_own_compute_over_the_wall_from_the_process_start(sink):
    """docs/goodput.md's goodput for this process is productive (own compute) over the wall from the
    process start (the attempt record) to the latest record, two counters; the wall runs on after
    the last step (a checkpoint save)."""
    def timed(n, compute, **extra):
        return {**step_record(n, 1.0, compute), "host_start_time": 102.0 + n, "end_time": 103.0 + n, **extra}

    attempt = {"type": "attempt", "run_id": "r", "rank": 0, "attempt": 0, "start_time": 100.0, "init_time": 101.0}
    sink.export([attempt, timed(0, 0.5, before_step_seconds=1.0), timed(1, 0.5)])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_productive_seconds_total") == pytest.approx(1.0)
    assert value(text, "steptrace_wall_seconds_total") == pytest.approx(4.0)  # 100 -> 104
    # Waiting for other ranks in collectives is not productive: 0.2 s of step 2's 0.9 s compute.
    sink.export([timed(2, 0.9, collective_wait_seconds=0.2, own_seconds=0.8, own_compute_seconds=0.7,
                       collective_wait_idle_breakdown={}, collective_wait_source="ddp"),
                 timed(3, 0.5), {**checkpoint_record(3, 0.5), "start_time": 106.0, "end_time": 106.5}])
    text = scrape(sink.endpoint)
    # 0.5 + 0.5 + (0.9 - 0.2) + 0.5: the checkpoint's 0.5 s adds to the wall, not to the productive time.
    assert value(text, "steptrace_productive_seconds_total") == pytest.approx(2.2)
    assert value(text, "steptrace_wall_seconds_total") == pytest.approx(6.5)
    assert "steptrace_goodput_ratio" not in text  # two counters, not a ratio (docs/prometheus.md)


def test_exposed_communication_is_a_counter_only_where_the_steps_carry_it(sink):
    """NCCL's device-timed exposed communication (docs/records.md) adds up per rank, in seconds; a
    rank whose steps do not carry it (no NCCL, the gloo path, JAX) serves no series at all."""
    sink.export([step_record(0, 1.0, 0.5), step_record(1, 1.0, 0.5)])
    name = "steptrace_step_exposed_communication_seconds_total"
    assert not [s for s in samples(scrape(sink.endpoint)) if s.name == name]
    sink.export([{**step_record(2, 1.0, 0.9), "collectives": [["0", 1, 0.2, 0.15]],
                  "exposed_communication_seconds": 0.15},
                 step_record(3, 1.0, 0.5),  # a step without a collective leaves the total alone
                 {**step_record(4, 1.0, 0.9), "collectives": [["0", 2, 0.2, 0.05], ["0", 3, 0.1, 0.0]],
                  "exposed_communication_seconds": 0.05}])
    assert value(scrape(sink.endpoint), name) == pytest.approx(0.2)
    # A bad value skips its record whole (counted as invalid), never half-applied.
    sink.export([{**step_record(5, 1.0, 0.9), "exposed_communication_seconds": -1.0}])
    text = scrape(sink.endpoint)
    assert value(text, name) == pytest.approx(0.2)
    assert value(text, "steptrace_steps_total", status="ok") == 5


def test_without_an_attempt_record_the_wall_starts_at_the_first_steps_init(sink):
    sink.export([{**step_record(0, 1.0, 0.5), "host_start_time": 11.0, "end_time": 12.0, "before_step_seconds": 1.0}])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_wall_seconds_total") == pytest.approx(2.0)
    assert value(text, "steptrace_productive_seconds_total") == pytest.approx(0.5)


def test_mfu_and_hfu_are_exported_with_their_parts(sink):
    """MFU and HFU come with the FLOPs and the peak they divide; without a peak there is no ratio."""
    sink.export([step_record(0, 0.5, 0.4, flops=4e12)])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_step_flops", kind="model") == 4e12
    assert not [line for line in text.splitlines() if line.startswith(("steptrace_mfu{", "steptrace_hfu{",
                                                                       "steptrace_peak_flops{"))]
    record = step_record(1, 0.5, 0.4, flops=4e12, mfu=0.2)
    record.update(hardware_flops=6e12, flops_source="xla_cost_analysis", peak_flops=50e12, hfu=0.3)
    sink.export([record])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_step_flops", kind="hardware") == 6e12
    assert value(text, "steptrace_peak_flops") == 50e12
    assert value(text, "steptrace_mfu") == pytest.approx(0.2)
    assert value(text, "steptrace_hfu") == pytest.approx(0.3)


def test_a_sinks_own_peak_gives_mfu_to_records_without_one():
    with_peak = PrometheusSink(0, run_id="r", rank=0, peak_tflops=50.0)
    try:
        # A record without mfu (its run had no peak) gets one from this sink's peak.
        with_peak.export([step_record(1, 0.5, 0.4, flops=4e12)])
        text = scrape(with_peak.endpoint)
        assert value(text, "steptrace_mfu") == pytest.approx(10.0 / 50.0)
        assert value(text, "steptrace_peak_flops") == 50e12
    finally:
        with_peak.shutdown(1)


def test_pipeline_bubble_ratio_per_stage(sink):
    sink.export([step_record(0, 1.0, 1.0, bubble={"0": 0.25, "1": 0.5}),
                 step_record(1, 1.0, 1.0, bubble={"0": 0.125, "1": 0.375})])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_pipeline_bubble_ratio", stage=0) == 0.125
    assert value(text, "steptrace_pipeline_bubble_ratio", stage=1) == 0.375


def test_step_scalars_and_device_memory_are_gauges_of_the_last_step(sink):
    first = step_record(0, 1.0, 1.0)
    first["scalars"] = {"loss": 2.5, "grad_norm": 1.0}
    second = step_record(1, 1.0, 1.0)
    second["scalars"] = {"loss": 2.25}
    second["device_memory"] = {"in_use_bytes": 10, "peak_bytes": 30, "limit_bytes": 100, "peak_percent": 30.0}
    third = step_record(2, 1.0, 1.0)
    third["scalars"] = {f"s{i}": float(i) for i in range(80)}  # a user's unbounded names are capped
    sink.export([first, second, third])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_step_scalar", name="loss") == 2.25
    assert value(text, "steptrace_step_scalar", name="grad_norm") == 1.0
    assert len([s for s in samples(text) if s.name == "steptrace_step_scalar"]) == 64
    assert value(text, "steptrace_device_memory_bytes", kind="peak") == 30
    assert value(text, "steptrace_device_memory_bytes", kind="limit") == 100


@pytest.mark.parametrize("histograms", [True, False], ids=["histograms", "sum_count"])
def test_microbatch_histogram_is_labelled_by_kind_stage_and_chunk(histograms):
    sink = PrometheusSink(0, run_id="r", rank=0, histograms=histograms)
    sink.export([
        microbatch_record(0, 0, 0.01),
        microbatch_record(0, 1, 0.03),
        microbatch_record(0, 0, 0.02, stage=1, chunk=0, kind="backward"),
    ])
    text = scrape(sink.endpoint)
    name = "steptrace_microbatch_seconds"
    assert value(text, name + "_count", kind="forward", stage="", chunk="") == 2
    assert value(text, name + "_sum", kind="forward", stage="", chunk="") == pytest.approx(0.04)
    assert value(text, name + "_count", kind="backward", stage=1, chunk=0) == 1
    sink.shutdown(1)
    if histograms:
        assert bucket(text, name, "0.02", kind="backward", stage=1, chunk=0) == 1
    else:
        assert "_bucket" not in text and "# TYPE steptrace_microbatch_seconds summary" in text


def test_checkpoint_histograms_and_counts(sink):
    sink.export([checkpoint_record(10, 2.5), checkpoint_record(20, 0.5, async_seconds=30.0),
                 checkpoint_record(30, 0.25, status="incomplete")])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_checkpoint_blocking_seconds_count") == 3
    assert value(text, "steptrace_checkpoint_blocking_seconds_sum") == pytest.approx(3.25)
    assert value(text, "steptrace_checkpoint_async_seconds_count") == 1
    assert value(text, "steptrace_checkpoint_async_seconds_sum") == 30.0
    assert value(text, "steptrace_checkpoints_total", status="ok") == 2
    assert value(text, "steptrace_checkpoints_total", status="incomplete") == 1


def test_dropped_records_are_read_from_the_attached_counter_at_scrape_time(sink):
    drops = {"sink:jsonl": 3, "resolver_queue": 2, "misuse": 1}
    sink.attach_drop_counter(lambda: dict(drops))
    text = scrape(sink.endpoint)
    name = "steptrace_dropped_records_total"
    assert value(text, name, sink="jsonl", reason="queue_full_or_error") == 3
    assert value(text, name, sink="resolver", reason="resolver_queue") == 2
    assert value(text, name, sink="resolver", reason="misuse") == 1
    drops["sink:prometheus"] = 7
    assert value(scrape(sink.endpoint), name, sink="prometheus", reason="queue_full_or_error") == 7


def test_a_failing_drop_counter_does_not_break_the_scrape(sink, caplog):
    def broken():
        raise RuntimeError("boom")

    sink.attach_drop_counter(broken)
    sink.export([step_record(0, 0.1, 0.1)])
    for _ in range(2):
        text = scrape(sink.endpoint)
    assert value(text, "steptrace_steps_total", status="ok") == 1
    assert all(s.value == 0 for s in samples(text) if s.name == "steptrace_dropped_records_total")
    assert len([r for r in caplog.records if "drop counters" in r.getMessage()]) == 1  # logged once


def test_usual_drop_reasons_are_exported_at_zero_before_any_drop(sink):
    """increase() only sees a drop if the series existed before it: they start at 0. Without the
    names of the other sinks only this one's are seeded: no series claims an OTLP exporter."""
    sink.attach_drop_counter(lambda: {})
    text = scrape(sink.endpoint)
    name = "steptrace_dropped_records_total"
    assert value(text, name, sink="resolver", reason="misuse") == 0
    assert value(text, name, sink="prometheus", reason="invalid_record") == 0
    assert value(text, name, sink="prometheus", reason="queue_full_or_error") == 0
    assert {s.labels["sink"] for s in samples(text) if s.name == name} == {"resolver", "prometheus"}


def drop_series(text):
    return {(s.labels["sink"], s.labels["reason"]): s.value for s in samples(text)
            if s.name == "steptrace_dropped_records_total"}


def test_drop_series_name_only_the_sinks_that_exist_plus_reasons_that_occurred(tmp_path, device):
    """With OTLP off there is no sink="otlp" series; JSONL (on) is exported at 0; a reason
    that occurred for a sink shows up with its count."""
    steptrace.init(prometheus_port=0, run_dir=str(tmp_path), run_id="r")
    try:
        with steptrace.step(0) as s:
            s.wait_for(device.run(0.001))
        assert steptrace.flush(10)
        series = drop_series(scrape(steptrace.stats()["endpoints"]["prometheus"]))
    finally:
        steptrace.shutdown()
    assert {sink for sink, _ in series} == {"resolver", "jsonl", "prometheus"}
    assert series[("jsonl", "queue_full_or_error")] == 0
    assert series[("jsonl", "invalid_record")] == 0
    assert all(v == 0 for v in series.values())


def test_a_drop_of_an_unlisted_sink_still_shows_with_its_count(sink):
    from steptrace._sinks import DropCounter

    sink.attach_drop_counter(DropCounter(lambda: {"sink:mine": 2}, ["jsonl", "prometheus"]))
    series = drop_series(scrape(sink.endpoint))
    assert series[("mine", "queue_full_or_error")] == 2
    assert series[("jsonl", "invalid_record")] == 0
    assert ("mine", "invalid_record") not in series and not any(s == "otlp" for s, _ in series)


def test_histogram_exemplars_carry_the_step_trace_id_in_openmetrics_only(hist_sink):
    sink = hist_sink
    # Different buckets, so each keeps its own (latest) exemplar.
    no_trace_id = step_record(2, 3.0, 3.0)
    no_trace_id["trace_id"] = "x" * 200  # unusable: the exemplar falls back to the id derived from (run_id, step)
    sink.export([step_record(0, 0.004, 0.003), step_record(1, 0.4, 0.3), no_trace_id,
                 checkpoint_record(1, 4.0), microbatch_record(1, 0, 0.015)])
    families = {f.name: f for f in openmetrics_parser.text_string_to_metric_families(
        scrape(sink.endpoint, openmetrics=True))}

    def exemplar(family, le):
        (s,) = [s for s in families[family].samples if s.name.endswith("_bucket") and s.labels["le"] == le]
        return s.exemplar

    assert exemplar("steptrace_step_compute_seconds", "0.005").labels == {"trace_id": trace_id_hex("r", 0)}
    assert exemplar("steptrace_step_compute_seconds", "0.005").value == 0.003
    assert exemplar("steptrace_step_compute_seconds", "0.5").labels == {"trace_id": trace_id_hex("r", 1)}
    assert exemplar("steptrace_step_compute_seconds", "5.0").labels == {"trace_id": trace_id_hex("r", 2)}
    assert exemplar("steptrace_step_interval_seconds", "0.5").labels == {"trace_id": trace_id_hex("r", 1)}
    assert exemplar("steptrace_checkpoint_blocking_seconds", "5.0").labels == {"trace_id": trace_id_hex("r", 1)}
    assert exemplar("steptrace_microbatch_seconds", "0.02").labels == {"trace_id": trace_id_hex("r", 1)}
    assert "trace_id" not in scrape(sink.endpoint)  # the Prometheus text format has no exemplars


def test_every_series_has_run_id_and_rank_and_none_a_step_label(sink):
    sink.attach_drop_counter(lambda: {"sink:jsonl": 1, "misuse": 2})
    sink.export([step_record(0, 0.5, 0.25, tokens=10, flops=1e12, bubble={"0": 0.5}, idle={"data": 0.25}),
                 microbatch_record(0, 0, 0.1, stage=0), checkpoint_record(0, 1.0, 2.0)])
    all_samples = samples(scrape(sink.endpoint))
    assert len({s.name for s in all_samples}) > 20
    for s in all_samples:
        assert "step" not in s.labels, s
        assert RUN.items() <= s.labels.items(), s
    assert not [s for s in all_samples if s.name.endswith("_created")]


def test_unknown_and_malformed_records_are_skipped_without_raising(sink, caplog):
    import time

    from steptrace._sinks import SinkWorker

    # Through a SinkWorker, as in a run: it counts the skipped records (invalid:prometheus) with
    # every other drop, and the metric reads them back from those counts.
    counts: dict[str, int] = {}
    worker = SinkWorker(sink, 1024, lambda reason, n=1: counts.__setitem__(reason, counts.get(reason, 0) + n))
    sink.attach_drop_counter(lambda: counts)
    missing = step_record(1, 0.1, 0.1)
    del missing["compute_seconds"]
    negative = step_record(2, -0.1, 0.1)
    bad_mb = microbatch_record(3, 0, "fast")
    worker.offer([step_record(0, 0.1, 0.1), {"type": "span", "name": "data"}, {"type": "new-kind"}, missing,
                  negative, bad_mb, {"no": "type"}, step_record(4, 0.2, 0.1)])
    assert worker.flush(time.monotonic() + 10)
    assert counts == {"invalid:prometheus": 3}
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_steps_total", status="ok") == 2  # nothing half-applied
    assert value(text, "steptrace_step_interval_seconds_sum") == pytest.approx(0.3)
    assert value(text, "steptrace_dropped_records_total", sink="prometheus", reason="invalid_record") == 3
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1  # logged once


def test_shutdown_frees_the_port_and_is_idempotent():
    s = PrometheusSink(0, run_id="r")
    assert value(scrape(s.endpoint), "steptrace_steps_total", status="ok") == 0
    s.shutdown(1)
    s.shutdown(1)
    assert connect_refused(s.endpoint)
    assert s.force_flush(1) is True


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="prometheus_port"):
        PrometheusSink(-1, run_id="r")
    with pytest.raises(ValueError, match="goodput_window_steps"):
        PrometheusSink(0, run_id="r", goodput_window_steps=0)
    with pytest.raises(ValueError, match="peak_tflops"):
        PrometheusSink(0, run_id="r", peak_tflops=0)


def test_interval_median_gauge_is_the_median_of_the_last_window_steps(sink):
    """The run's pace, which the stall alert scales: the window is goodput_window_steps (4 here)."""
    sink.export([step_record(n, interval, 0.1) for n, interval in enumerate([1.0, 2.0, 3.0, 10.0])])
    assert value(scrape(sink.endpoint), "steptrace_step_interval_median_seconds") == 2.5
    sink.export([step_record(4, 100.0, 0.1)])  # 1.0 leaves the window: [2, 3, 10, 100]
    assert value(scrape(sink.endpoint), "steptrace_step_interval_median_seconds") == 6.5


def test_position_is_read_at_scrape_time_with_the_open_span(sink):
    position = [(7, True, 12.5, None)]
    sink.attach_position(lambda: position[0])
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_current_step") == 7
    assert value(text, "steptrace_open_seconds", span="step") == 12.5
    position[0] = (7, True, 30.0, "data")
    text = scrape(sink.endpoint)
    assert value(text, "steptrace_open_seconds", span="data") == 30.0
    assert [s.labels["span"] for s in samples(text) if s.name == "steptrace_open_seconds"] == ["data"]
    position[0] = (7, False, 2.0, None)
    assert value(scrape(sink.endpoint), "steptrace_open_seconds", span="between_steps") == 2.0
    position[0] = None  # before the first step: nothing to say
    text = scrape(sink.endpoint)
    assert not [s for s in samples(text) if s.name in ("steptrace_open_seconds", "steptrace_current_step")]


def test_position_span_names_past_the_first_32_read_other(sink):
    position = [None]
    sink.attach_position(lambda: position[0])
    for i in range(32):
        position[0] = (1, True, 1.0, f"mine{i}")
        assert value(scrape(sink.endpoint), "steptrace_open_seconds", span=f"mine{i}") == 1.0
    position[0] = (1, True, 1.0, "one_too_many")
    assert value(scrape(sink.endpoint), "steptrace_open_seconds", span="other") == 1.0
    position[0] = (1, True, 1.0, "mine0")  # a name already seen keeps its own value
    assert value(scrape(sink.endpoint), "steptrace_open_seconds", span="mine0") == 1.0


def test_a_failing_position_does_not_break_the_scrape(sink, caplog):
    def broken():
        raise RuntimeError("boom")

    sink.attach_position(broken)
    sink.export([step_record(0, 0.5, 0.25)])
    for _ in range(2):
        text = scrape(sink.endpoint)
        assert value(text, "steptrace_steps_total", status="ok") == 1
        assert "steptrace_open_seconds" not in text
    assert sum("position failed" in r.getMessage() for r in caplog.records) == 1


# -- through the public API ------------------------------------------------------------------------

def test_init_serves_the_run_on_the_endpoint_in_stats(device):
    memory = MemorySink()
    steptrace.init(prometheus_port=0, jsonl=False, run_id="r", sinks=[memory])
    endpoint = steptrace.stats()["endpoints"]["prometheus"]
    assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/metrics")
    for n in range(4):
        with steptrace.step(n, tokens=100) as s:
            s.wait_for(device.run(0.01))
    assert steptrace.flush(10)
    text = scrape(endpoint)
    steps = memory.steps()
    assert len(steps) == 4
    assert value(text, "steptrace_steps_total", status="ok") == 4
    assert value(text, "steptrace_last_step") == 3
    assert value(text, "steptrace_tokens_total") == 400
    assert value(text, "steptrace_step_compute_seconds_count") == 4
    assert value(text, "steptrace_step_compute_seconds_sum") == pytest.approx(
        math.fsum(r["compute_seconds"] for r in steps))
    assert value(text, "steptrace_step_interval_seconds_sum") == pytest.approx(
        math.fsum(r["interval_seconds"] for r in steps))
    assert value(text, "steptrace_info", backend="simulated", version=steptrace.__version__) == 1
    steptrace.shutdown()
    assert connect_refused(endpoint)


def test_init_serves_where_the_training_thread_is_and_for_how_long(device):
    """A hung rank is visible on its own /metrics: the step it is in, the span, and the seconds."""
    steptrace.init(prometheus_port=0, jsonl=False, run_id="r")
    endpoint = steptrace.stats()["endpoints"]["prometheus"]

    def where():
        text = scrape(endpoint)
        opened = [s for s in samples(text) if s.name == "steptrace_open_seconds"]
        current = [s.value for s in samples(text) if s.name == "steptrace_current_step"]
        assert len(opened) <= 1 and len(current) == len(opened)
        return (current[0], opened[0].labels["span"], opened[0].value) if opened else None

    assert where() is None  # before the first step: start-up is not a stall
    with steptrace.step(0) as s:
        s.wait_for(device.run(0.001))
    with steptrace.step(1):
        time.sleep(0.05)
        step, span, seconds = where()
        assert (step, span) == (1, "step") and seconds >= 0.05
        with steptrace.span("data"):
            assert where()[:2] == (1, "data")
            with steptrace.span("my_span"):
                assert where()[:2] == (1, "my_span")
            assert where()[:2] == (1, "data")
        assert where()[:2] == (1, "step")
    time.sleep(0.05)
    step, span, seconds = where()
    assert (step, span) == (1, "between_steps") and seconds >= 0.05
    with steptrace.checkpoint(1):
        assert where()[:2] == (1, "checkpoint")
    with steptrace.span("data"):
        assert where()[:2] == (1, "data")
    before_step_2 = time.perf_counter()
    with steptrace.step(2):
        step, span, seconds = where()
        # Counted from step 2's entry, not from step 1's exit.
        assert (step, span) == (2, "step") and seconds <= time.perf_counter() - before_step_2
    # A span around the loop encloses the steps: inside one, the thread is in the step.
    with steptrace.span("train"):
        assert where()[:2] == (2, "train")  # opened after step 2 ended: where the thread is
        with steptrace.step(3):
            assert where()[:2] == (3, "step")
            with steptrace.span("data"):
                assert where()[:2] == (3, "data")
        assert where()[:2] == (3, "between_steps")
    steptrace.shutdown()


def test_port_in_use_is_a_value_error_from_init_that_leaves_nothing_behind(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        threads = set(threading.enumerate())
        with pytest.raises(ValueError) as info:
            steptrace.init(prometheus_port=port, run_dir=str(tmp_path), run_id="r")
    message = str(info.value)
    assert str(port) in message and ENV_PROMETHEUS_PORT in message and "local_rank" not in message
    assert not steptrace.enabled()
    assert set(threading.enumerate()) <= threads
    if os.path.isdir("/proc/self/fd"):  # the JSONL file opened before the port failed was closed
        open_files = {os.path.realpath(os.path.join("/proc/self/fd", fd)) for fd in os.listdir("/proc/self/fd")
                      if os.path.islink(os.path.join("/proc/self/fd", fd))}
        assert not [f for f in open_files if f.startswith(os.path.realpath(tmp_path))]


def test_port_in_use_leaves_no_jsonl_file_behind(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError):
            steptrace.init(prometheus_port=taken.getsockname()[1], run_dir=str(tmp_path), run_id="r")
    assert list(tmp_path.iterdir()) == []


def free_port_pair():
    """A base port P with P and P + 1 both free just now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    pytest.skip("no two adjacent free ports on 127.0.0.1")


def test_each_local_rank_serves_port_plus_local_rank():
    base = free_port_pair()
    steptrace.init(prometheus_port=base, local_rank=1, rank=1, world_size=2, jsonl=False, run_id="r")
    endpoint = steptrace.stats()["endpoints"]["prometheus"]
    assert endpoint == f"http://127.0.0.1:{base + 1}/metrics"
    assert value(scrape(endpoint), "steptrace_steps_total", status="ok", rank=1, run_id="r") == 0


def test_port_error_names_local_rank_when_it_moved_the_port():
    base = free_port_pair()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        with pytest.raises(ValueError) as info:
            steptrace.init(prometheus_port=base, local_rank=1, rank=1, world_size=2, jsonl=False, run_id="r")
    message = str(info.value)
    assert str(base + 1) in message and "local_rank 1" in message and ENV_PROMETHEUS_PORT in message


def test_env_variable_sets_the_port(monkeypatch):
    monkeypatch.setenv(ENV_PROMETHEUS_PORT, "0")
    steptrace.init(jsonl=False, run_id="r")
    assert value(scrape(steptrace.stats()["endpoints"]["prometheus"]), "steptrace_steps_total", status="ok") == 0


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_import_steptrace_does_not_import_prometheus_client():
    result = run_python("import sys, steptrace; steptrace.init(jsonl=False); "
                        "print('prometheus_client' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_missing_prometheus_client_says_which_pip_install_fixes_it():
    result = run_python(
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import steptrace\n"
        "try:\n"
        "    steptrace.init(prometheus_port=0, jsonl=False)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n")
    assert result.returncode == 0, result.stderr
    assert "pip install 'steptrace[prometheus]'" in result.stdout


# -- promtool --------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not found: install the Debian package `prometheus` to lint the exposition")
def test_promtool_check_metrics_is_clean(sink):
    sink.attach_drop_counter(lambda: {"sink:jsonl": 1, "resolver_queue": 2})
    with_peak = PrometheusSink(0, run_id="r", peak_tflops=100.0)
    try:
        for s in (sink, with_peak):
            s.export([
                step_record(0, 0.5, 0.25, tokens=10, flops=1e12, mfu=0.04, bubble={"0": 0.5, "1": 0.25},
                            idle={"data": 0.2, "other": 0.05}),
                step_record(1, 0.5, 0.5, status="error"),
                microbatch_record(0, 0, 0.1, stage=0), microbatch_record(0, 0, 0.1, stage=1, kind="backward"),
                checkpoint_record(0, 1.0, 2.0), {"type": "step"},
            ])
            text = scrape(s.endpoint)
            result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                                    text=True, timeout=30)
            assert result.returncode == 0, result.stdout + result.stderr
            assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr
        assert "steptrace_mfu" in text
    finally:
        with_peak.shutdown(1)


def test_idle_connections_to_the_ranks_metrics_keep_its_threads_bounded_500_made_500():
    """Issue 25, defect 12: prometheus_client's server kept one thread per idle connection, no timeout:
    2,000 idle connections made 2,005 threads and a pids limit killed the training process."""
    sink = PrometheusSink(0, run_id="r")
    idle = []
    try:
        before = threading.active_count()
        for _ in range(500):  # from another address than the scraper
            try:
                idle.append(socket.create_connection(("127.0.0.1", sink.port), timeout=5,
                                                      source_address=("127.0.0.2", 0)))
            except OSError:
                break
        time.sleep(0.5)
        assert threading.active_count() - before <= 8, f"{threading.active_count() - before} threads more"
        with urllib.request.urlopen(sink.endpoint, timeout=10) as response:  # a scrape still works
            assert b"steptrace_dropped_records_total" in response.read()
    finally:
        for sock in idle:
            sock.close()
        sink.shutdown(5)


# -- the series budget per rank (issue 28: 16k ranks) ------------------------------------------------

def rank_series(device, *, pipeline, **settings):
    """Series one rank serves on a real /metrics after a realistic run: tokens, FLOPs with a peak (MFU),
    a data span, an async checkpoint; with ``pipeline``, 32 microbatches x 4 chunks x forward/backward
    on its stage per step."""
    steptrace.init(prometheus_port=0, jsonl=False, run_id="r", peak_tflops=100.0, **settings)
    endpoint = steptrace.stats()["endpoints"]["prometheus"]
    for n in range(3):
        with steptrace.span("data"):
            time.sleep(0.001)
        with steptrace.step(n, tokens=1000, flops=1e12) as s:
            if pipeline:
                for kind in ("forward", "backward"):
                    for chunk in range(4):
                        for i in range(32):
                            with steptrace.microbatch(i, stage=1, chunk=chunk, kind=kind) as mb:
                                mb.wait_for(device.run(0.0001))
            s.wait_for(device.run(0.002))
        if n == 1:
            with steptrace.checkpoint(n, async_save=True) as ckpt:
                time.sleep(0.001)
            ckpt.async_done()
    assert steptrace.flush(10)
    text = scrape(endpoint)
    steptrace.shutdown()
    return samples(text)


#: The idle reasons this run's host time can be charged to: its data span, its save, and time no span names.
RANK_SERIES_IDLE_REASONS = {"data", "checkpoint", "other"}


@pytest.mark.parametrize("pipeline, budget", [(False, 39), (True, 56)], ids=["plain", "pipeline"])
def test_a_rank_serves_at_most_its_series_budget_by_default(device, pipeline, budget):
    """<= 39 series on a plain rank, <= 56 on a pipeline rank, plus one per idle reason its steps had:
    _sum/_count instead of ~20 buckets each. Which idle reasons a step has depends on whether the device
    went idle in it (on 2 loaded cores all three did: 42 series), so they are counted apart from the rest."""
    series = rank_series(device, pipeline=pipeline)
    assert not [s for s in series if s.name.endswith("_bucket")]
    names = {s.name for s in series}
    assert {"steptrace_step_interval_seconds_sum", "steptrace_step_interval_seconds_count",
            "steptrace_step_compute_seconds_count", "steptrace_checkpoint_blocking_seconds_count"} <= names
    if pipeline:
        mb = [s for s in series if s.name == "steptrace_microbatch_seconds_count"]
        assert len(mb) == 8 and sum(s.value for s in mb) == 3 * 256
    idle = [s.labels["reason"] for s in series if s.name == "steptrace_step_idle_seconds_total"]
    assert len(idle) == len(set(idle)) and set(idle) <= RANK_SERIES_IDLE_REASONS, idle
    rest = [s for s in series if s.name != "steptrace_step_idle_seconds_total"]
    assert len(rest) <= budget, f"{len(rest)} series besides idle: {sorted(names)}"


def test_prometheus_histograms_brings_the_buckets_back(device, monkeypatch):
    monkeypatch.setenv("STEPTRACE_PROMETHEUS_HISTOGRAMS", "1")
    series = rank_series(device, pipeline=True)
    buckets = {s.name for s in series if s.name.endswith("_bucket")}
    assert buckets == {"steptrace_step_interval_seconds_bucket", "steptrace_step_compute_seconds_bucket",
                       "steptrace_microbatch_seconds_bucket", "steptrace_checkpoint_blocking_seconds_bucket",
                       "steptrace_checkpoint_async_seconds_bucket"}
    assert len(series) > 200  # what a pipeline rank cost before the budget
