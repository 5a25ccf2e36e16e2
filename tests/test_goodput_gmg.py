"""Goodput in ml-goodput-measurement's words (issue 39): every steptrace badput bucket under a GMG
``BadputType`` name, adding up to the same total, and GMG's ideal step time computed as GMG computes it
(``compute_ideal_step_time`` and ``GoodputCalculator._get_step_times`` in
AI-Hypercomputer/ml-goodput-measurement ``src/goodput_utils.py`` / ``src/goodput.py``)."""

from __future__ import annotations

import json
import random

import pytest

from steptrace.analysis import report
from steptrace.analysis.goodput import BUCKETS, job_accounting, job_goodput
from steptrace.analysis.goodput_gmg import (
    GMG_BADPUT_TYPES,
    GMG_NAME_OF_BUCKET,
    gmg_badput,
    gmg_badput_total,
    gmg_ideal_step_time,
    gmg_step_times,
)
from test_goodput import _step  # the same hand-built step records as the accounting tests


def _restarted_job():
    """Attempt 0 starts at 0 (init at 2), steps 0-3 of 1 s from 3 s (0.75 compute, 0.25 data); it crashes
    after a checkpoint [7, 7.5]; attempt 1 starts at 10 and resumes at step 2 after a 1 s restore; step 3
    of attempt 1 waits 0.25 s in collectives, compiles 0.125 s and runs a 0.125 s span of the user's own."""
    return [
        {"type": "attempt", "attempt": 0, "start_time": 0.0, "init_time": 2.0},
        _step(0, 0, 3.0, 1.0, 0.75, before_step_seconds=1.0, before_step_breakdown={"eval": 0.5, "startup": 0.5}),
        _step(0, 1, 4.0, 1.0, 0.75), _step(0, 2, 5.0, 1.0, 0.75), _step(0, 3, 6.0, 1.0, 0.75),
        {"type": "checkpoint", "attempt": 0, "step": 3, "start_time": 7.0, "end_time": 7.5},
        {"type": "attempt", "attempt": 1, "start_time": 10.0, "init_time": 11.0},
        _step(1, 2, 13.0, 1.0, 1.0, before_step_seconds=2.0, before_step_breakdown={"restore": 1.0, "startup": 0.5,
                                                                                    "sdc_check": 0.5}),
        _step(1, 3, 14.0, 1.0, 0.75, collective_wait_seconds=0.25,
              idle_breakdown={"compile": 0.125, "sdc_check": 0.125}),
        {"type": "run", "attempt": 1},
    ]


def test_every_steptrace_bucket_has_a_gmg_name():
    """A bucket added to steptrace's accounting without a GMG name fails here, not in a user's report."""
    assert set(GMG_NAME_OF_BUCKET) == set(BUCKETS)
    assert set(GMG_NAME_OF_BUCKET.values()) <= set(GMG_BADPUT_TYPES)


def test_the_badput_in_gmg_names_adds_up_to_the_same_total_bucket_by_bucket():
    job = job_accounting(_restarted_job())
    assert job["total_seconds"] == 15.0
    gmg = gmg_badput(job)
    assert gmg["total_seconds"] == 15.0 and gmg["productive_seconds"] == job["productive_seconds"] == 3.0
    assert gmg["badput_seconds"] == {
        "TPU_INITIALIZATION": None,  # in TRAINING_PREP: steptrace does not split start-up
        "TRAINING_PREP": 2.0 + 0.5 + 1.0 + 0.5,  # process start -> init, and before the first step, both attempts
        "PROGRAM_STARTUP": 0.125,  # compile
        "DATA_LOADING_SYNC": 0.5,  # the kept steps 0 and 1 of attempt 0
        "DATA_LOADING_ASYNC": None,
        "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME": 0.5,
        "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME": 1.0,
        "WASTED_PROGRESS_FROM_DISRUPTION": 2.0,  # steps 2 and 3 of attempt 0, redone by attempt 1
        "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION": 2.5,  # 7.5 -> 10
        "CUSTOM_BADPUT_EVENTS": {"EVAL_STEP": 0.5, "SDC_CHECK": 0.625},  # GMG upper-cases event types
        "OTHER": 0.25,  # the wait in collectives: GMG has no bucket for it
    }
    assert gmg["sources"]["OTHER"] == {"other": 0.0, "collective_wait": 0.25}
    assert gmg["sources"]["CUSTOM_BADPUT_EVENTS"] == {"eval": 0.5, "sdc_check": 0.625}
    assert gmg["productive_seconds"] + gmg_badput_total(gmg["badput_seconds"]) == pytest.approx(15.0, abs=1e-12)
    assert sum(job["badput"].values()) == pytest.approx(gmg_badput_total(gmg["badput_seconds"]), abs=1e-12)
    assert gmg["goodput_percent"] == pytest.approx(3.0 / 15.0 * 100)
    assert gmg["badput_percent"]["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == pytest.approx(1.0 / 15.0 * 100)
    assert gmg["badput_percent"]["CUSTOM_BADPUT_EVENTS"]["SDC_CHECK"] == pytest.approx(0.625 / 15.0 * 100)


def test_the_jobs_badput_summed_over_ranks_adds_up_in_gmg_names_too():
    records = _restarted_job()
    job = job_goodput({0: records, 1: records})
    gmg = gmg_badput(job)
    assert gmg["total_seconds"] == 30.0
    assert gmg["productive_seconds"] + gmg_badput_total(gmg["badput_seconds"]) == pytest.approx(30.0, abs=1e-12)
    assert gmg["badput_seconds"]["CUSTOM_BADPUT_EVENTS"] == {"EVAL_STEP": 1.0, "SDC_CHECK": 1.25}


# -- the ideal step time ----------------------------------------------------------------------------
def test_gmg_ideal_step_time_by_hand_with_outliers():
    # Under 1 s is dropped (0.4). Kept, sorted: 2.0 2.0 2.1 2.2 2.3 2.6 9.0 (seven): median 2.2.
    # |t - 2.2|: 0.2 0.2 0.1 0 0.1 0.4 6.8 -> sorted 0 0.1 0.1 0.2 0.2 0.4 6.8: MAD 0.2 (raw, unscaled).
    # Cut 2.2 + 3 * 0.2 = 2.8: 9.0 is out, 2.6 is in (a 1.4826-scaled MAD would cut at 3.09; the same here).
    # Mean of 2.0 2.0 2.1 2.2 2.3 2.6 = 13.2 / 6 = 2.2.
    assert gmg_ideal_step_time([2.0, 2.2, 0.4, 2.1, 9.0, 2.0, 2.3, 2.6]) == pytest.approx(2.2)


def test_gmg_ideal_step_time_uses_the_raw_mad_and_the_even_count_median():
    # Kept: 1.0 1.0 1.2 1.4 (even): median (1.0 + 1.2) / 2 = 1.1; |t - 1.1|: 0.1 0.1 0.1 0.3: MAD 0.1.
    # Raw cut 1.1 + 0.3 = 1.4 keeps 1.4 (mean 4.6 / 4 = 1.15); a lower-middle median (1.0, MAD 0) would
    # cut at 1.0 (mean 1.0).
    assert gmg_ideal_step_time([1.0, 1.2, 1.0, 1.4]) == pytest.approx(1.15)
    # Kept: 1.0 1.0 1.0 1.1 1.1 1.4: median 1.05, MAD 0.05, raw cut 1.2 drops 1.4 (mean 5.2 / 5 = 1.04);
    # a 1.4826-scaled MAD would cut at 1.272 and still drop it, a 3-sigma one from the standard
    # deviation (0.15) would keep it.
    assert gmg_ideal_step_time([1.0, 1.0, 1.0, 1.1, 1.1, 1.4]) == pytest.approx(1.04)


def test_gmg_ideal_step_time_edge_cases():
    assert gmg_ideal_step_time([]) is None
    assert gmg_ideal_step_time([0.02, 0.5, 0.999]) is None  # every step under GMG's 1 s: no figure
    assert gmg_ideal_step_time([3.0]) == 3.0
    # Two steps: median 2.5, MAD 1.5, cut 7.0: both kept.
    assert gmg_ideal_step_time([1.0, 4.0]) == pytest.approx(2.5)
    # MAD 0 (most steps equal the median): only steps at or below the median count.
    assert gmg_ideal_step_time([2.0, 2.0, 2.0, 2.5, 30.0]) == 2.0
    assert gmg_ideal_step_time([1.5, 2.0, 2.0, 2.0, 2.5]) == pytest.approx((1.5 + 6.0) / 4)
    # The threshold itself is GMG's argument too.
    assert gmg_ideal_step_time([0.2, 0.2, 0.3], min_step_seconds=0.0) == pytest.approx(0.2)


def test_gmg_ideal_step_time_matches_numpy_and_scipy_as_gmg_calls_them():
    """GMG: ``mad = stats.median_abs_deviation(t); med = np.median(t); mean(t <= med + 3 * mad)``."""
    np = pytest.importorskip("numpy")
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(39)
    for size in (1, 2, 3, 4, 5, 10, 51, 200):
        times = [rng.choice((1.0, 1.0, 1.25)) + rng.expovariate(4.0) * rng.choice((0, 1, 1, 8)) for _ in range(size)]
        times += [0.5] * (size % 3)  # under 1 s: GMG drops them first
        kept = [t for t in times if t >= 1.0]
        mad, med = stats.median_abs_deviation(kept), np.median(kept)
        expected = float(np.mean([t for t in kept if t <= med + mad * 3]))
        assert gmg_ideal_step_time(times) == pytest.approx(expected, rel=1e-12), times


def test_gmg_step_times_are_consecutive_host_starts_and_a_redone_step_replaces_the_first():
    records = [
        {"type": "attempt", "attempt": 0},
        _step(0, 0, 10.0, 1.0, 1.0), _step(0, 1, 13.0, 1.0, 1.0), _step(0, 2, 14.5, 1.0, 1.0),
        _step(0, 4, 20.0, 1.0, 1.0),  # 2 -> 4 is no pair
        _step(0, 5, 21.0, 1.0, 1.0),
        {"type": "attempt", "attempt": 1},
        _step(1, 1, 40.0, 1.0, 1.0), _step(1, 2, 42.0, 1.0, 1.0),  # redone: 1 -> 2 replaces 1.5 by 2.0
        {"type": "step", "step": 3},  # no host start: breaks the chain
        _step(1, 4, 50.0, 1.0, 1.0),
    ]
    assert gmg_step_times(records) == {0: 3.0, 1: 2.0, 4: 1.0}


# -- in the report ----------------------------------------------------------------------------------
@pytest.fixture
def restarted_run(tmp_path):
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    records = [dict(r, run_id="job", rank=0) for r in _restarted_job()]
    (run_dir / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_report_json_has_the_badput_in_gmg_names_and_the_ideal_step_time(restarted_run, capsys):
    assert report.main([str(restarted_run), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    gmg = payload["gmg"]
    assert gmg["rank"] == 0 and gmg["name_of_bucket"] == GMG_NAME_OF_BUCKET
    assert gmg["badput_seconds"]["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == 1.0
    assert gmg["badput_seconds"]["CUSTOM_BADPUT_EVENTS"] == {"EVAL_STEP": 0.5, "SDC_CHECK": 0.625}
    assert gmg["productive_seconds"] + gmg_badput_total(gmg["badput_seconds"]) == pytest.approx(
        payload["wall_seconds"], abs=1e-9)
    assert gmg["job"]["total_seconds"] == payload["job"]["total_seconds"]
    ideal = gmg["ideal_step_time"]
    # GMG's step times: host starts 3 4 5 6 (attempt 0), then 13 14 (attempt 1): 0->1 1 s, 1->2 1 s,
    # 2->3 replaced by attempt 1's 1 s; 3 -> (attempt 1's) 2 is no pair. All 1 s: ideal 1 s.
    assert ideal["steps"] == 3 and ideal["gmg_seconds"] == pytest.approx(1.0)
    assert ideal["gmg_rule_on_intervals_seconds"] == pytest.approx(1.0)
    assert ideal["steptrace_interval_p50_seconds"] == pytest.approx(1.0)


def test_report_vocabulary_gmg_prints_the_badput_under_both_vocabularies(restarted_run, capsys):
    assert report.main([str(restarted_run), "--vocabulary", "gmg", "--width", "220"]) == 0
    text = capsys.readouterr().out
    assert "idle: restore" in text  # steptrace's own words, in the summary
    assert "Badput in ml-goodput-measurement's words (rank 0)" in text
    line = next(line for line in text.splitlines() if "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME" in line)
    assert "1.000 s" in line and "restore 1.000" in line
    assert any("CUSTOM_BADPUT_EVENTS/SDC_CHECK" in line and "0.625 s" in line for line in text.splitlines())
    assert any(line.lstrip("│ ").startswith("TPU_INITIALIZATION") and "—" in line for line in text.splitlines())
    assert "ideal step time (GMG)" in text
    assert report.main([str(restarted_run), "--width", "220"]) == 0
    assert "ml-goodput-measurement" not in capsys.readouterr().out  # the default vocabulary is steptrace's
