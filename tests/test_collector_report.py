"""``steptrace report`` with a collector's ``cluster.jsonl``: the cluster view next to the per-rank view."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from steptrace import report
from steptrace.report import RunDirError, find_run, load_run, summarize_cluster


def cluster_step(step, computes, *, world_size=3, reason=None, interval=1.0):
    """A cluster_step record as the collector writes it; ``computes`` maps rank -> compute seconds."""
    ranks = sorted(computes)
    values = [computes[r] for r in ranks]
    missing = [r for r in range(world_size) if r not in computes]
    complete = not missing
    ordered = sorted(values)
    return {
        "type": "cluster_step", "run_id": "r1", "step": step, "trace_id": f"{step:032x}",
        "world_size": world_size, "ranks_reporting": len(ranks), "missing_ranks": missing,
        "complete": complete, "reason": reason or ("all_ranks" if complete else "window"),
        "first_seen_time": 1.7e9 + step, "joined_time": 1.7e9 + step + 0.01, "join_seconds": 0.01,
        "end_time": 1.7e9 + step,
        "rank_compute_seconds": {str(r): computes[r] for r in ranks},
        "rank_interval_seconds": {str(r): interval for r in ranks},
        "compute_min_seconds": ordered[0], "compute_median_seconds": ordered[len(ordered) // 2],
        "compute_max_seconds": ordered[-1], "interval_min_seconds": interval,
        "interval_median_seconds": interval, "interval_max_seconds": interval,
        "skew_seconds": ordered[-1] - ordered[0],
        "straggler_rank": max(ranks, key=lambda r: (computes[r], -r)) if complete else None,
        "compute_sum_seconds": sum(values), "interval_sum_seconds": interval * len(ranks),
        "pipeline_bubble_ratio": {}, "status": {"ok": len(ranks)},
    }


def step_record(step, rank, compute, interval=1.0):
    return {"type": "step", "run_id": "r1", "rank": rank, "world_size": 3, "step": step, "status": "ok",
            "interval_seconds": interval, "compute_seconds": compute, "idle_seconds": interval - compute,
            "idle_breakdown": {"other": interval - compute}}


def write_jsonl(path: Path, records, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


COMPUTES = [
    {0: 0.25, 1: 0.5, 2: 0.75},   # straggler 2, skew 0.5
    {0: 0.5, 1: 0.25, 2: 0.875},  # straggler 2, skew 0.625
    {0: 1.0, 1: 0.5, 2: 0.5},     # straggler 0, skew 0.5
    {0: 0.5, 2: 0.5},             # rank 1 missing: no straggler
]


@pytest.fixture
def joined_run(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    for rank in range(3):
        write_jsonl(run_dir / f"rank-{rank}.jsonl",
                    [step_record(s, rank, c[rank]) for s, c in enumerate(COMPUTES) if rank in c])
    records = [cluster_step(s, c) for s, c in enumerate(COMPUTES)]
    late = {"type": "late", "run_id": "r1", "step": 3, "rank": 1, "trace_id": f"{3:032x}",
            "received_time": 1.7e9 + 20, "compute_seconds": 0.25, "interval_seconds": 1.0}
    write_jsonl(run_dir / "cluster.jsonl", records + [late])
    return run_dir


def render(run, **kwargs) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    report.render_report(run, console=console, **kwargs)
    return console.export_text()


def test_cluster_file_is_not_a_rank_and_is_loaded_as_the_cluster_view(joined_run):
    run = load_run(joined_run)
    assert run.ranks == [0, 1, 2]
    assert [r["step"] for r in run.cluster_steps()] == [0, 1, 2, 3]
    assert len(run.late_spans()) == 1
    assert run.steps(0)[0]["compute_seconds"] == 0.25


def test_summarize_cluster_values(joined_run):
    run = load_run(joined_run)
    s = summarize_cluster(run.cluster_steps(), run.late_spans())
    assert (s["steps"], s["complete_steps"], s["incomplete_steps"], s["late_spans"]) == (4, 3, 1, 1)
    assert s["world_size"] == 3
    assert s["straggler_steps"] == {"2": 2, "0": 1}
    assert list(s["straggler_steps"]) == ["2", "0"]  # most often first
    assert s["missing_rank_steps"] == {"1": 1}
    # skews of the complete steps: 0.5, 0.625, 0.5
    assert s["skew_p50"] == pytest.approx(0.5)
    assert s["skew_max"] == pytest.approx(0.625)
    assert s["skew_p90"] == pytest.approx(0.6)
    # Σcompute 1.5 + 1.625 + 2.0 + 1.0 over Σinterval 3 + 3 + 3 + 2 (no waits measured: own compute is
    # compute); not goodput, under its own name
    assert s["compute_share_of_steps"] == pytest.approx(6.125 / 11) and "goodput" not in s
    assert summarize_cluster([])["skew_p50"] is None


def test_report_shows_the_cluster_view_next_to_the_rank_view(joined_run):
    text = render(load_run(joined_run))
    assert "Steps (rank 0)" in text and "Per-rank summary" in text
    assert "Cluster view" in text
    table = text[text.index("Cluster view"):text.index("Cluster summary")]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    # step, ranks, slowest rank, skew, compute min/median/max, interval, missing
    assert rows[0][:4] == ["0", "3/3", "2", "0.500"]
    assert rows[1][:4] == ["1", "3/3", "2", "0.625"]
    assert rows[2][:4] == ["2", "3/3", "0", "0.500"]
    assert rows[3][:3] == ["3", "2/3", "—"] and rows[3][-1] == "1"
    summary = text[text.index("Cluster summary"):]
    assert "straggler: rank 2" in summary and "2 steps" in summary and "67% of complete steps" in summary
    assert "straggler: rank 0" in summary
    assert "late spans" in summary and "3 complete, 1 incomplete" in summary
    assert "0.500 / 0.600 s" in summary  # skew p50 / p90


def test_report_json_has_a_cluster_key(joined_run, capsys):
    assert report.main([str(joined_run), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["steps"] == 4 and payload["rank"] == 0
    assert payload["cluster"]["straggler_steps"] == {"2": 2, "0": 1}
    assert payload["cluster"]["complete_steps"] == 3


def test_report_json_cluster_is_null_without_a_collector(tmp_path, capsys):
    write_jsonl(tmp_path / "r1" / "rank-0.jsonl", [step_record(0, 0, 0.5)])
    assert report.main([str(tmp_path / "r1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] is None
    assert "Cluster view" not in render(load_run(tmp_path / "r1"))


def test_a_collector_only_run_dir_reports_the_cluster_view(tmp_path, capsys):
    # The collector's host may hold no rank files at all.
    write_jsonl(tmp_path / "runs" / "r1" / "cluster.jsonl", [cluster_step(s, c) for s, c in enumerate(COMPUTES)])
    assert find_run(tmp_path / "runs") == tmp_path / "runs" / "r1"
    run = load_run(tmp_path / "runs")
    assert run.ranks == [] and run.run_id == "r1" and run.world_size == 3
    text = render(run)
    assert "Cluster view" in text and "straggler: rank 2" in text and "Steps (rank" not in text
    assert report.main([str(tmp_path / "runs"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["rank"] is None and payload["cluster"]["steps"] == 4
    assert report.main([str(tmp_path / "runs"), "--rank", "0"]) == 2
    assert report.main([str(tmp_path / "runs"), "--plot", str(tmp_path / "x.png")]) == 2


def test_duplicate_steps_keep_the_fullest_record_and_a_torn_line_is_skipped(tmp_path):
    records = [cluster_step(0, {0: 0.5}, reason="shutdown"), cluster_step(0, {0: 0.5, 1: 0.25, 2: 0.75}),
               cluster_step(1, {0: 0.5, 1: 0.5, 2: 0.5}), cluster_step(1, {2: 0.5})]
    write_jsonl(tmp_path / "r1" / "cluster.jsonl", records, tail='{"type": "cluster_st')
    run = load_run(tmp_path / "r1")
    assert [(r["step"], r["ranks_reporting"]) for r in run.cluster_steps()] == [(0, 3), (1, 3)]
    assert any("cluster.jsonl: skipped 1 unreadable line (first: line 5" in w for w in run.warnings)


def test_empty_dir_error_still_names_rank_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"no rank-\*\.jsonl files"):
        find_run(tmp_path / "empty")


def _cluster_rows(text: str) -> list[int]:
    table = text[text.index("Cluster view"):text.index("Cluster summary")]
    return [int(line.split("│")[1]) for line in table.splitlines() if line.startswith("│")]


def test_cluster_table_rows_are_the_first_failed_incomplete_largest_skew_and_slowest_steps(tmp_path):
    """Issue 33: a cluster_step's ``status`` counts ranks per status ({"ok": 3}); compared with "ok" as a
    step's status, every step read as failed and the rows were the first ones by position. 60 complete
    steps, skew and interval rising with the step but for the planted ones: the rows kept are the first,
    the step a rank failed, the incomplete ones, the largest skews and the slowest, as docs/report.md says."""
    records = []
    for step in range(60):
        computes = {0: 0.5, 1: 0.5, 2: 0.5 + step / 1000}
        records.append(cluster_step(step, computes, interval=1.0 + step / 10000))
    for step in (7, 8):  # a rank missing: incomplete
        records[step] = cluster_step(step, {0: 0.5, 2: 0.5})
    records[12]["status"] = {"ok": 2, "error": 1}  # a rank's step failed
    records[20] = cluster_step(20, {0: 0.5, 1: 0.5, 2: 0.9})  # the largest skew (0.4)
    records[30] = cluster_step(30, {0: 0.5, 1: 0.5, 2: 0.5}, interval=5.0)  # the slowest step, no skew
    write_jsonl(tmp_path / "r1" / "cluster.jsonl", records)
    text = render(load_run(tmp_path / "r1"), max_rows=12)
    shown = _cluster_rows(text)
    assert shown == sorted(shown) and len(shown) == 12
    assert {0, 12, 7, 8, 20, 30} <= set(shown), shown
    assert {59, 58, 57, 56} <= set(shown), shown  # the next largest skews (they grow with the step)
    note = text[text.index("of 60 steps shown"):].splitlines()[0]
    assert "(first 1, failed 1, incomplete 2, largest skew 5, slowest" in note, note
    # No step failed: none is called failed.
    clean = [cluster_step(step, {0: 0.5, 1: 0.5, 2: 0.5}) for step in range(50)]
    write_jsonl(tmp_path / "r2" / "cluster.jsonl", clean)
    assert "failed" not in render(load_run(tmp_path / "r2"), max_rows=6)
