"""GPU health per step window (issue 38): the NVML sampler on the fake NVML (tests/fake_nvml.py), its
windows in the step records, the exporters, the report's per-rank health and the straggler verdict's
cause, the collector's join and alert. The real GPU's fields are read in tests/gpu/test_nvml.py."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("pynvml", reason="the health sampler needs nvidia-ml-py (steptrace[nvml])")

import fake_nvml  # noqa: E402
import steptrace  # noqa: E402
from steptrace import _health  # noqa: E402
from steptrace._config import resolve_config  # noqa: E402
from steptrace.testing import capture  # noqa: E402


def _sampler(fake, device="GPU-fake-0"):
    _health.init_nvml(fake)
    sampler = _health.HealthSampler(fake, device, period_s=1.0, unix_offset=0.0)
    sampler._open()
    return sampler


def _window(sampler, gap_s=0.02):
    """Take a sample, let the fake's counters run ``gap_s``, take another: the window between them."""
    sampler.sample()
    time.sleep(gap_s)
    sampler.sample()
    return sampler.window(time.perf_counter())


# -- the fake enforces NVML's rules --------------------------------------------------------------------


def test_fake_nvml_raises_before_init_and_after_shutdown_and_counts_inits(monkeypatch):
    gpu = fake_nvml.gpu(0)
    fake = fake_nvml.install(monkeypatch, [gpu])
    with pytest.raises(fake.NVMLError) as before:
        fake.nvmlDeviceGetPowerUsage(gpu)
    assert before.value.value == fake.NVML_ERROR_UNINITIALIZED
    fake.nvmlInit()
    assert fake.nvmlDeviceGetPowerUsage(gpu) == 350_000  # mW
    fake.nvmlShutdown()
    with pytest.raises(fake.NVMLError):
        fake.nvmlDeviceGetTotalEnergyConsumption(gpu)
    assert fake.init_calls == 1


def test_fake_nvml_coalesces_xids_and_counters_are_cumulative(monkeypatch):
    gpu = fake_nvml.gpu(0)
    fake = fake_nvml.install(monkeypatch, [gpu])
    fake.nvmlInit()
    events = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(gpu, fake.nvmlEventTypeXidCriticalError, events)
    gpu.xid(48)
    gpu.xid(79)
    assert fake.nvmlEventSetWait_v2(events, 0).eventData == 79  # only the latest
    with pytest.raises(fake.NVMLError) as none:
        fake.nvmlEventSetWait_v2(events, 0)
    assert none.value.value == fake.NVML_ERROR_TIMEOUT
    gpu.set_violation("thermal", 0.5)
    first = fake.nvmlDeviceGetViolationStatus(gpu, fake.NVML_PERF_POLICY_THERMAL).violationTime
    time.sleep(0.02)
    second = fake.nvmlDeviceGetViolationStatus(gpu, fake.NVML_PERF_POLICY_THERMAL).violationTime
    assert second - first >= 0.5 * 0.02 * 1e9 * 0.9  # ns, growing at half the wall time


# -- the sampler -----------------------------------------------------------------------------------------


def test_window_deltas_and_units_violation_ns_to_ms_and_percent_energy_mj_to_joules(monkeypatch):
    gpu = fake_nvml.gpu(0, power_mw=400_000)
    fake = fake_nvml.install(monkeypatch, [gpu])
    sampler = _sampler(fake)
    gpu.set_violation("thermal", 0.4)
    gpu.set_violation("power", 0.1)
    sampler.sample()
    time.sleep(0.05)
    sampler.window(time.perf_counter())  # counts a step, no window yet (one sample)
    sampler.sample()
    window = sampler.window(time.perf_counter())
    seconds = window["window_seconds"]
    assert window["window_steps"] == 2 and window["samples"] == 1
    # 40 % of the window's wall time under the thermal policy, 10 % under power.
    assert window["violation_percent"]["thermal"] == pytest.approx(40.0, abs=1.0)
    assert window["violation_ms"]["thermal"] == pytest.approx(0.4 * seconds * 1e3, rel=0.03)
    assert window["violation_percent"]["power"] == pytest.approx(10.0, abs=1.0)
    assert window["violation_percent"]["low_utilization"] == 0.0
    # 400 W for the window: mJ counter delta / 1000 J, half per step; power in W, not mW.
    assert window["energy_joules"] == pytest.approx(400.0 * seconds, rel=0.03)
    assert window["energy_joules_per_step"] == pytest.approx(window["energy_joules"] / 2)
    assert window["power_watts_mean"] == 400.0
    assert window["sm_clock_mhz_min"] == 1980 and window["temperature_c_max"] == 55
    assert window["xid_events"] == 0 and window["ecc_uncorrected_volatile_errors"] == 0
    assert window["nvlink_errors"] == 0 and window["unsupported"] == {}


def test_no_sample_since_the_last_window_gives_no_window_and_the_step_shares_the_next():
    fake = fake_nvml.FakeNvml([fake_nvml.gpu(0)])
    sampler = _sampler(fake)
    sampler.sample()
    assert sampler.window(time.perf_counter()) is None
    sampler.sample()
    before = time.perf_counter()
    sampler.sample()  # taken after ``before``: not in a window that ends there
    window = sampler.window(before)
    assert window is not None and window["window_steps"] == 2 and window["samples"] == 1
    assert sampler.window(time.perf_counter())["window_steps"] == 1


def test_reasons_are_ored_gpu_idle_masked_unknown_bits_kept_and_a_lone_hw_slowdown_dropped():
    gpu = fake_nvml.gpu(0)
    fake = fake_nvml.FakeNvml([gpu])
    sampler = _sampler(fake)
    sampler.sample()
    gpu.reasons = fake_nvml.GPU_IDLE | fake_nvml.SW_THERMAL | 0x4000
    gpu.pstate_change()  # HwSlowdown in one read only
    window = _window(sampler)
    assert window["clocks_event_reasons"] == fake_nvml.SW_THERMAL | 0x4000
    assert window["clocks_event_reason_names"] == ["sw_thermal", "unknown_0x4000"]
    gpu.reasons = fake_nvml.HW_SLOWDOWN  # persists across samples: counted
    window = _window(sampler)
    assert window["clocks_event_reasons"] == fake_nvml.HW_SLOWDOWN
    assert window["clocks_event_reason_names"] == ["hw_slowdown"]


def test_unsupported_fields_are_null_with_the_nvml_error_never_zero():
    gpu = fake_nvml.gpu(0, unsupported={"energy", "violation:thermal", "remapped_rows", "nvlink", "xid", "ecc"})
    fake = fake_nvml.FakeNvml([gpu])
    sampler = _sampler(fake)
    window = _window(sampler)
    assert window["energy_joules"] is None and window["energy_joules_per_step"] is None
    assert window["violation_ms"]["thermal"] is None and window["violation_percent"]["thermal"] is None
    assert window["violation_ms"]["power"] == 0.0
    for field in ("remapped_rows_uncorrectable", "nvlink_errors", "xid_events", "ecc_uncorrected_volatile_errors"):
        assert window[field] is None, field
    assert window["unsupported"] == {"energy": "NVML_ERROR_NOT_SUPPORTED",
                                     "violation:thermal": "NVML_ERROR_NOT_SUPPORTED",
                                     "remapped_rows": "NVML_ERROR_NOT_SUPPORTED", "nvlink": "NVML_ERROR_NOT_SUPPORTED",
                                     "xid": "NVML_ERROR_NOT_SUPPORTED", "ecc": "NVML_ERROR_NOT_SUPPORTED"}
    calls = fake.calls
    sampler.sample()
    # A field the GPU does not support is not asked again (power, 5 policies, reasons, 2 clocks, temperature).
    assert fake.calls - calls == 10


def test_nvlink_links_whose_counters_nvml_does_not_give_are_null_not_zero():
    gpu = fake_nvml.gpu(0, unsupported={"nvlink_counters"})
    sampler = _sampler(fake_nvml.FakeNvml([gpu]))
    window = _window(sampler)
    assert window["nvlink_errors"] is None and window["unsupported"]["nvlink"] == "NVML_ERROR_NOT_SUPPORTED"


def test_an_old_driver_reads_reasons_under_the_throttle_name():
    gpu = fake_nvml.gpu(0)
    gpu.reasons = fake_nvml.SW_POWER_CAP
    fake = fake_nvml.FakeNvml([gpu], driver_version="525.60.13")
    sampler = _sampler(fake)
    window = _window(sampler)
    assert window["clocks_event_reason_names"] == ["sw_power_cap"] and "reasons" not in window["unsupported"]


def test_error_counters_give_deltas_and_xids_the_latest_code():
    gpu = fake_nvml.gpu(0)
    fake = fake_nvml.FakeNvml([gpu])
    sampler = _sampler(fake)
    gpu.ecc_uncorrected_volatile = 3  # before the window: not this window's
    sampler.sample()
    gpu.ecc_uncorrected_volatile = 5
    gpu.remapped_rows = [0, 1, 1, 0]
    gpu.nvlink_errors[2][1] = 4
    gpu.xid(13)
    gpu.xid(79)
    sampler.sample()
    window = sampler.window(time.perf_counter())
    assert window["ecc_uncorrected_volatile_errors"] == 2
    assert window["remapped_rows_uncorrectable"] == 1 and window["remapped_rows_pending"] is True
    assert window["nvlink_errors"] == 4
    assert window["xid_events"] == 1 and window["last_xid"] == 79  # coalesced: the latest


# -- configuration and the runtime ---------------------------------------------------------------------


def test_health_config_validation_and_environment():
    assert resolve_config(environ={}).health == "off"
    config = resolve_config(environ={"STEPTRACE_HEALTH": "NVML", "STEPTRACE_HEALTH_DEVICE": "GPU-x",
                                     "STEPTRACE_HEALTH_PERIOD_S": "2"})
    assert (config.health, config.health_device, config.health_period_s) == ("nvml", "GPU-x", 2.0)
    with pytest.raises(ValueError, match="health must be one of off, nvml"):
        resolve_config(environ={}, health="dcgm")
    with pytest.raises(ValueError, match=r"health_period_s must be .* \[1,"):
        resolve_config(environ={}, health_period_s=0.1)


def test_missing_pynvml_is_a_setup_error_naming_the_pip_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'steptrace\[nvml\]'"):
        steptrace.init(health="nvml", run_dir=str(tmp_path), prometheus_port=None)
    assert not list(tmp_path.iterdir())  # nothing was opened


def test_steps_carry_their_window_and_nvml_is_initialised_once_per_process(monkeypatch):
    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    gpu = fake_nvml.gpu(1, power_mw=300_000)
    fake = fake_nvml.install(monkeypatch, [fake_nvml.gpu(0), gpu])
    gpu.set_violation("thermal", 0.25)
    for _ in range(2):  # init() twice in one process: one nvmlInit
        with capture(health="nvml", health_device="00000000:20:00.0", health_period_s=0.02) as sink:
            for n in range(12):
                with steptrace.step(n):
                    time.sleep(0.01)
        steps = sink.steps()
        windows = [s["health"] for s in steps if "health" in s]
        assert windows, "no step took a window"
        # Every finalized step is counted in exactly one window, but the steps after the last sample.
        assert sum(w["window_steps"] for w in windows) <= len(steps)
        assert all(w["device"] == "00000000:20:00.0" and w["power_watts_mean"] == 300.0 for w in windows)
        thermal = sum(w["violation_ms"]["thermal"] for w in windows)
        seconds = sum(w["window_seconds"] for w in windows)
        assert thermal / 1e3 / seconds == pytest.approx(0.25, abs=0.02)
    assert fake.init_calls == 1
    assert fake.calls > 0 and not any(t.name == "steptrace-health" for t in __import__("threading").enumerate())


def test_health_off_never_imports_nvml(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with capture() as sink:
        with steptrace.step(0):
            pass
    assert "health" not in sink.steps()[0] and "pynvml" not in sys.modules


def test_a_device_nvml_does_not_know_is_said_and_steps_go_on(monkeypatch, caplog):
    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    fake_nvml.install(monkeypatch, [fake_nvml.gpu(0)])
    with caplog.at_level("WARNING", logger="steptrace"):
        with capture(health="nvml", health_device="GPU-nope", health_period_s=0.02) as sink:
            for n in range(3):
                with steptrace.step(n):
                    time.sleep(0.02)
    assert len(sink.steps()) == 3 and not any("health" in s for s in sink.steps())
    assert "cannot open GPU 'GPU-nope' in NVML: NVML_ERROR_NOT_FOUND" in caplog.text


# -- the report and the straggler verdict ------------------------------------------------------------------


def _train_rank(tmp_path, rank, gpu_index, *, slow, steps=24, **settings):
    """One rank of a synchronous 4-rank job, run here with its own init(): the straggler's steps take
    as long as the others' (they wait for it in the collective) but it barely waits."""
    steptrace.init(run_dir=str(tmp_path), run_id="job", rank=rank, world_size=4, health="nvml",
                   health_device=f"GPU-fake-{gpu_index}", health_period_s=0.05, stall_watch=False, **settings)
    try:
        for n in range(steps):
            with steptrace.step(n) as s:
                time.sleep(0.03)
                s.collective_wait += 0.001 if slow else 0.02
                s.collective_source = "torch.distributed"
    finally:
        steptrace.shutdown()


def _job(tmp_path, monkeypatch, gpus, straggler=2, **settings):
    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    fake_nvml.install(monkeypatch, gpus)
    for rank in range(4):
        _train_rank(tmp_path, rank, rank, slow=rank == straggler, **settings)
    return tmp_path / "job"


def test_a_thermal_straggler_is_named_with_its_gpu_cause_in_the_report(tmp_path, monkeypatch, capsys):
    from steptrace.analysis.report import main

    gpus = [fake_nvml.gpu(i, power_mw=350_000) for i in range(4)]
    gpus[2].sm_clock_mhz = 1410
    gpus[2].temperature_c = 87
    gpus[2].set_violation("thermal", 0.45)
    run = _job(tmp_path, monkeypatch, gpus)
    assert main([str(run), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    stragglers = payload["stragglers"]
    assert stragglers["top"] == "2"
    gpu = stragglers["gpu"]
    assert gpu["rank"] == 2 and gpu["gpu_anomaly"] is True
    assert gpu["causes"][0].startswith("thermal violation in 100 % of its steps")
    assert "SM clock 1410 vs 1980 MHz on the others" in gpu["causes"]
    assert stragglers["sentence"].startswith("rank 2 cost the job")
    assert stragglers["sentence"].endswith("; its GPU: thermal violation in 100 % of its steps, "
                                           "SM clock 1410 vs 1980 MHz on the others")
    health = payload["health"]
    assert set(health) == {"0", "1", "2", "3"}
    assert health["2"]["violation_percent"]["thermal"] == pytest.approx(45.0, abs=3.0)
    assert health["0"]["violation_percent"]["thermal"] == 0.0
    assert health["2"]["temperature_c_max"] == 87 and health["0"]["power_watts_mean"] == 350.0
    assert main([str(run)]) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    assert "its GPU: thermal violation in 100 % of its steps" in " ".join(text.split())


def test_a_slow_host_straggler_is_reported_as_no_gpu_anomaly(tmp_path, monkeypatch, capsys):
    from steptrace.analysis.report import main

    run = _job(tmp_path, monkeypatch, [fake_nvml.gpu(i) for i in range(4)], straggler=1)
    assert main([str(run), "--json"]) == 0
    stragglers = json.loads(capsys.readouterr().out)["stragglers"]
    assert stragglers["top"] == "1" and stragglers["gpu"]["gpu_anomaly"] is False
    assert stragglers["sentence"].endswith("; its GPU shows no throttling or errors (no GPU anomaly): look at its "
                                           "host (data, CPU)")


def test_the_report_prints_power_in_watts_never_milliwatts(tmp_path, monkeypatch, capsys):
    """Megatron's straggler log printed "601796W" for NVML's milliwatts (issue 38)."""
    from steptrace.analysis.report import main

    gpus = [fake_nvml.gpu(i, power_mw=601_796) for i in range(4)]
    run = _job(tmp_path, monkeypatch, gpus)
    assert main([str(run), "--width", "400"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("GPU health rank")]
    assert len(lines) == 4
    assert all("power 601.8 W mean" in line for line in lines)
    assert "601796" not in text and "601796.0" not in text


def test_unsupported_fields_are_null_in_the_report_json_and_named(tmp_path, monkeypatch, capsys):
    from steptrace.analysis.report import main

    gpus = [fake_nvml.gpu(i, unsupported={"energy", "remapped_rows"}) for i in range(4)]
    run = _job(tmp_path, monkeypatch, gpus, straggler=0)
    records = [json.loads(line) for line in (run / "rank-0.jsonl").read_text().splitlines()]
    windows = [r["health"] for r in records if r.get("type") == "step" and "health" in r]
    assert windows and all(w["energy_joules"] is None and w["remapped_rows_uncorrectable"] is None for w in windows)
    assert main([str(run), "--json"]) == 0
    health = json.loads(capsys.readouterr().out)["health"]["0"]
    assert health["energy_joules_per_step"] is None and health["errors"]["remapped_rows_uncorrectable"] is None
    assert health["unsupported"] == {"energy": "NVML_ERROR_NOT_SUPPORTED", "remapped_rows": "NVML_ERROR_NOT_SUPPORTED"}


def test_the_cause_is_claimed_only_above_the_other_ranks():
    from steptrace.analysis.health import straggler_cause, summarize_health

    def window(thermal, clock, steps=1):
        return {"window_seconds": 1.0, "window_steps": steps, "violation_percent": {"thermal": thermal, "power": 0.0},
                "clocks_event_reasons": 0, "sm_clock_mhz_mean": clock, "sm_clock_mhz_min": clock,
                "xid_events": 0, "ecc_uncorrected_volatile_errors": 0}

    # Every rank throttles in a hot room: the straggler's share is no higher than the others'.
    hot = {r: summarize_health([window(30.0, 1700)] * 10) for r in range(4)}
    assert straggler_cause("1", hot)["gpu_anomaly"] is False
    # 3 % lower clock than the others: within the deficit the rule needs.
    close = {r: summarize_health([window(0.0, 1980 if r else 1921)] * 10) for r in range(4)}
    assert straggler_cause("0", close)["causes"] == []
    # Thermal in 3 of 10 steps (others none), and an Xid: both named.
    mixed = {r: summarize_health([window(0.0, 1980)] * 10) for r in range(4)}
    mine = [window(20.0 if i < 3 else 0.0, 1980) for i in range(10)]
    mine[5]["xid_events"], mine[5]["last_xid"] = 1, 79
    mixed[3] = summarize_health(mine)
    assert straggler_cause("3", mixed)["causes"] == ["thermal violation in 30 % of its steps",
                                                     "1 Xid event (latest Xid 79)"]
    # Window steps weigh the share: one window of 8 steps throttled, two of 1 step not.
    weighted = summarize_health([window(50.0, 1980, steps=8), window(0.0, 1980), window(0.0, 1980)])
    assert weighted["throttled_share_of_steps"]["thermal"] == pytest.approx(0.8)
    assert straggler_cause(None, mixed) is None and straggler_cause("7", mixed) is None


# -- the exporters and the collector ---------------------------------------------------------------------


def test_a_thermal_straggler_flows_through_the_collector_to_its_sentence_and_gauges(tmp_path, monkeypatch, capsys):
    """Ranks export OTLP (health as train.health.*) to a real collector, which joins the windows
    (cluster_step ``rank_health``, kept without --cluster-per-rank), publishes the straggler's GPU
    gauges, and whose cluster.jsonl alone gives the report's sentence with the cause."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs steptrace[otlp]")
    pytest.importorskip("prometheus_client", reason="the collector needs steptrace[prometheus]")
    from collector_helpers import scrape, value
    from collector_process import CollectorProcess
    from steptrace.analysis.report import main

    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    gpus = [fake_nvml.gpu(i) for i in range(4)]
    gpus[3].sm_clock_mhz = 1410
    gpus[3].set_violation("thermal", 0.45)
    fake_nvml.install(monkeypatch, gpus)
    run_dir = tmp_path / "cluster"
    collector = CollectorProcess(run_dir, 4, window_s=60.0)
    steps = 24
    try:
        for rank in range(4):
            steptrace.init(run_id="job", rank=rank, world_size=4, jsonl=False, health="nvml",
                           health_device=f"GPU-fake-{rank}", health_period_s=0.05, stall_watch=False,
                           otlp_endpoint=f"http://127.0.0.1:{collector.port}", otlp_batch_delay_s=0.05)
            try:
                for n in range(steps):
                    with steptrace.step(n) as s:
                        time.sleep(0.03)
                        s.collective_wait += 0.001 if rank == 3 else 0.02
                        s.collective_source = "torch.distributed"
                        if rank == 3 and n == 5:
                            gpus[3].xid(79)
            finally:
                assert steptrace.shutdown(timeout_s=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = scrape(collector.metrics_url)
            if value(text, "steptrace_cluster_persistent_straggler_gpu_errors", run_id="job", rank="3") is not None \
                    and value(text, "steptrace_cluster_steps_joined_total", run_id="job") == steps:
                break
            time.sleep(0.2)
    finally:
        assert collector.stop() == 0
    job = {"run_id": "job", "rank": "3"}
    assert value(text, "steptrace_cluster_persistent_straggler_gpu_throttled_ratio", **job) == 1.0
    assert value(text, "steptrace_cluster_persistent_straggler_gpu_others_throttled_ratio", **job) == 0.0
    assert value(text, "steptrace_cluster_persistent_straggler_gpu_errors", **job) == 1  # the Xid

    clusters = [json.loads(line) for line in (run_dir / "job" / "cluster.jsonl").read_text().splitlines()]
    health = [r["rank_health"] for r in clusters if r.get("type") == "cluster_step" and r.get("rank_health")]
    assert health and all(set(h["3"]["violation_percent"]) == {"power", "thermal", "sync_boost", "board_limit",
                                                               "low_utilization", "reliability"}
                          for h in health if "3" in h)
    assert not any((run_dir / "job").glob("rank-*.jsonl"))  # the sentence below is the collector's alone
    capsys.readouterr()
    assert main([str(run_dir / "job"), "--json"]) == 0
    stragglers = json.loads(capsys.readouterr().out)["stragglers"]
    assert stragglers["top"] == "3"
    assert stragglers["gpu"]["causes"][:2] == ["thermal violation in 100 % of its steps",
                                               "SM clock 1410 vs 1980 MHz on the others"]
    assert stragglers["gpu"]["causes"][2] == "1 Xid event (latest Xid 79)"


def _recorded_windows(monkeypatch, gpu):
    """Step records with health windows from the real runtime on ``gpu``."""
    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    fake_nvml.install(monkeypatch, [gpu])
    with capture(health="nvml", health_device=gpu.uuid, health_period_s=0.02) as sink:
        for n in range(10):
            with steptrace.step(n):
                time.sleep(0.015)
    return [s for s in sink.steps() if "health" in s]


def test_prometheus_serves_health_in_base_units_within_sixteen_series(monkeypatch):
    pytest.importorskip("prometheus_client", reason="needs steptrace[prometheus]")
    from collector_helpers import scrape, value
    from prometheus_client.parser import text_string_to_metric_families
    from steptrace.prometheus import PrometheusSink

    gpu = fake_nvml.gpu(0, power_mw=601_796, sm_clock_mhz=1410, temperature_c=83)
    gpu.set_violation("thermal", 0.3)
    gpu.reasons = fake_nvml.SW_THERMAL
    steps = _recorded_windows(monkeypatch, gpu)
    steps[-1]["health"]["xid_events"] = 2
    sink = PrometheusSink(0, run_id="r", rank=0)
    try:
        sink.export(steps)
        text = scrape(sink.endpoint)
    finally:
        sink.shutdown(1)
    run = {"run_id": "r", "rank": "0"}
    windows = [s["health"] for s in steps]
    assert value(text, "steptrace_gpu_power_watts", **run) == pytest.approx(601.796)  # mW -> W
    assert value(text, "steptrace_gpu_sm_clock_hertz", **run) == 1410e6
    assert value(text, "steptrace_gpu_temperature_celsius", **run) == 83
    assert value(text, "steptrace_gpu_clocks_event_reasons", **run) == fake_nvml.SW_THERMAL
    assert value(text, "steptrace_gpu_violation_seconds_total", policy="thermal", **run) == pytest.approx(
        sum(w["violation_ms"]["thermal"] for w in windows) / 1e3)
    assert value(text, "steptrace_gpu_energy_joules_total", **run) == pytest.approx(
        sum(w["energy_joules"] for w in windows))
    assert value(text, "steptrace_gpu_errors_total", kind="xid", **run) == 2
    gpu_series = [s for family in text_string_to_metric_families(text) if family.name.startswith("steptrace_gpu_")
                  for s in family.samples if not s.name.endswith("_created")]
    assert len(gpu_series) == 16


def test_otlp_step_span_carries_health_flat_and_leaves_nulls_out(monkeypatch):
    pytest.importorskip("opentelemetry.sdk", reason="needs steptrace[otlp]")
    from otlp_receiver import OtlpHttpReceiver

    gpu = fake_nvml.gpu(0, unsupported={"energy"})
    gpu.set_violation("power", 0.2)
    monkeypatch.setattr("steptrace._config.MIN_HEALTH_PERIOD_S", 0.01)
    fake_nvml.install(monkeypatch, [gpu])
    with OtlpHttpReceiver() as receiver:
        with capture(health="nvml", health_device=gpu.uuid, health_period_s=0.02, otlp_endpoint=receiver.url,
                     otlp_batch_delay_s=0.05) as sink:
            for n in range(10):
                with steptrace.step(n):
                    time.sleep(0.015)
        spans = {s.attributes["train.step"]: s.attributes for s in receiver.spans() if s.name == "train.step"}
    records = [s for s in sink.steps() if "health" in s]
    assert records
    for record in records:
        attrs, health = spans[record["step"]], record["health"]
        assert attrs["train.health.violation_percent.power"] == health["violation_percent"]["power"]
        assert attrs["train.health.power_watts_mean"] == health["power_watts_mean"]
        assert attrs["train.health.window_steps"] == health["window_steps"]
        assert "train.health.energy_joules" not in attrs  # null: unsupported, never 0
        assert attrs["train.health.unsupported.energy"] == "NVML_ERROR_NOT_SUPPORTED"


def test_a_forked_child_inits_nvml_for_itself_once_and_its_copy_of_the_sampler_reads_nothing():
    import os

    fake = fake_nvml.FakeNvml([fake_nvml.gpu(0)])
    sampler = _sampler(fake)  # nvmlInit in this process
    sampler.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the parent's init is not its own; the sampler's thread did not follow
            code = 0
            try:
                sampler.forked()
                _health.init_nvml(fake)
                _health.init_nvml(fake)
                code = fake.init_calls * 10 + (1 if sampler._stop.is_set() else 0)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 21  # one more init in the child (2 in its copy), its sampler stopped
        _health.init_nvml(fake)
        assert fake.init_calls == 1  # the parent's stays one
    finally:
        sampler.close()


def test_report_from_clickhouse_names_the_same_gpu_cause_as_the_jsonl_report(tmp_path, monkeypatch, capsys):
    """The GPU health windows travel on the step spans (train.health.*) into otel_traces; ``report
    --clickhouse`` reads them back and says the straggler's GPU cause in the JSONL report's words."""
    pytest.importorskip("chdb", reason="the ClickHouse path runs on chDB: pip install 'steptrace[clickhouse]'")
    from otlp_receiver import OtlpHttpReceiver

    from steptrace.analysis import clickhouse as ch
    from steptrace.analysis.report import main

    gpus = [fake_nvml.gpu(i, power_mw=350_000) for i in range(4)]
    gpus[2].sm_clock_mhz = 1410
    gpus[2].set_violation("thermal", 0.45)
    with OtlpHttpReceiver() as receiver:
        run = _job(tmp_path, monkeypatch, gpus, otlp_endpoint=receiver.url, otlp_timeout_s=2)
        requests = receiver.trace_requests()
    client = ch.connect("chdb://")
    database = f"health_{int(time.time() * 1e6)}"
    client.command(f"CREATE DATABASE {database}")
    client = ch.connect(f"chdb://?database={database}")
    client.command(ch.otel_traces_ddl(database))
    ch.insert_rows(client, [row for request in requests for row in ch.rows_from_otlp(request)])

    assert main([str(run), "--json"]) == 0
    from_jsonl = json.loads(capsys.readouterr().out)["stragglers"]
    assert main(["--clickhouse", f"chdb://?database={database}", "--run", "job", "--json"]) == 0
    from_clickhouse = json.loads(capsys.readouterr().out)
    stragglers = from_clickhouse["stragglers"]
    assert stragglers["top"] == from_jsonl["top"] == "2"
    assert stragglers["gpu"]["causes"] == from_jsonl["gpu"]["causes"]
    assert stragglers["gpu"]["causes"][0].startswith("thermal violation in 100 % of its steps")
    assert stragglers["sentence"].endswith("; its GPU: " + ", ".join(from_jsonl["gpu"]["causes"]))
    assert from_clickhouse["health"]["2"]["sm_clock_mhz_mean"] == 1410
