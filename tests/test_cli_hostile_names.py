"""Names from run files are data, never markup (issue 25, defects 14 and 15).

A span named ``fetch[/tmp]`` (rich markup), ``cost $\\alpha_$`` (matplotlib
mathtext), a line of 100,000 ``[`` (RecursionError), raw ESC/BEL, and a run id
holding a backtick and newlines (markdown injection in ``compare --markdown``)
once crashed ``report``/``--plot``/``compare`` or reached the terminal or the
PR comment as markup. Each check below failed before the fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HOSTILE_RUN_ID = "x`\n# Heading\n![img](http://e.example/x.png) @someone !"
HOSTILE_SPANS = ("fetch[/tmp]", "cost $\\alpha_$", "bell\x07esc\x1b[31mred[/]", "[bold]b[/bold]")


def write_run(directory: Path, run_id: str, *, extra_lines: tuple[str, ...] = ()) -> Path:
    directory.mkdir(parents=True)
    lines = [{"type": "metadata", "run_id": run_id, "rank": 0, "world_size": 1, "start_time": 1000.0,
              "hostname": "host\x1b]0;pwned\x07", "versions": {}, "devices": {}, "git_commit": None,
              "tags": {"`tag`\n# h": "@someone ![x](y)"}}]
    t = 1000.0
    for n in range(4):
        for name in HOSTILE_SPANS:
            lines.append({"type": "span", "run_id": run_id, "rank": 0, "name": name, "step": None,
                          "start_time": t, "end_time": t + 0.01, "seconds": 0.01, "attrs": {}})
            t += 0.01
        lines.append({"type": "step", "run_id": run_id, "rank": 0, "step": n, "status": "ok",
                      "host_start_time": t, "start_time": t, "end_time": t + 0.1, "interval_seconds": 0.14,
                      "compute_seconds": 0.1, "idle_seconds": 0.04,
                      "idle_breakdown": {name: 0.01 for name in HOSTILE_SPANS}})
        t += 0.1
    text = "\n".join(json.dumps(line) for line in lines) + "\n" + "".join(x + "\n" for x in extra_lines)
    (directory / "rank-0.jsonl").write_text(text)
    return directory


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steptrace", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def runs(tmp_path):
    nested = "[" * 100_000
    a = write_run(tmp_path / "a", HOSTILE_RUN_ID, extra_lines=(nested, '{"a":' * 50_000 + "1" + "}" * 50_000))
    b = write_run(tmp_path / "b", "plain")
    return a, b


def assert_no_control_characters(text: str) -> None:
    bad = sorted({hex(ord(c)) for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) < 0xa0})
    assert not bad, f"raw control characters reach the terminal: {bad}"


def test_report_shows_hostile_names_as_text_and_skips_deep_lines(runs):
    out = cli("report", str(runs[0]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fetch[/tmp]" in out.stdout and "[bold]b[/bold]" in out.stdout
    assert_no_control_characters(out.stdout + out.stderr)
    assert "skipped 2 unreadable lines" in out.stdout + out.stderr


def test_report_plot_takes_mathtext_as_text(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = cli("report", str(runs[0]), "--plot", str(tmp_path / "p.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_compare_prints_no_control_characters(runs):
    out = cli("compare", str(runs[0]), str(runs[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert_no_control_characters(out.stdout + out.stderr)


def test_compare_markdown_cannot_inject_headings_images_or_mentions(runs):
    out = cli("compare", str(runs[0]), str(runs[1]), "--markdown")
    assert out.returncode == 0, out.stderr[-2000:]
    md = out.stdout
    assert_no_control_characters(md)
    for line in md.splitlines():
        assert not line.lstrip().startswith("#"), f"a heading was injected: {line!r}"
    # Outside code spans, no image, mention or raw backtick from the run files survives.
    outside = "".join(part for i, part in enumerate(_split_code_spans(md)) if i % 2 == 0)
    assert "![" not in outside and "@someone" not in outside


def _split_code_spans(md: str) -> list[str]:
    """Markdown split into [text, code, text, code, ...] by CommonMark's backtick-run rule."""
    import re

    parts, pos = [], 0
    for line in md.splitlines():
        out, i = [], 0
        while i < len(line):
            m = re.compile(r"`+").search(line, i)
            if not m:
                break
            close = re.compile(r"(?<!`)" + m.group() + r"(?!`)").search(line, m.end())
            if not close:
                break
            out += [line[i:m.start()], line[m.end():close.start()]]
            i = close.end()
        out.append(line[i:])
        if len(out) % 2 == 0:
            out.append("")
        parts += out
        pos += 1
    return parts
