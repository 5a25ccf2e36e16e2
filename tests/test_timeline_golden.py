"""The timeline's pictures do not move: the Perfetto JSON is byte-identical and the PNGs are
pixel-identical to goldens made by the code before the lane model moved to its own module
(issue 23).

Inputs are frozen runs under ``tests/golden/timeline/`` (``pp``: two pipeline ranks with spans,
compile, eval, a checkpoint with an async commit, an error step, a step without idle segments and
overlapping spans; ``sim``: a run recorded on the simulated device; see ``make_inputs.py``).  The
trace's only machine-dependent fields (the run's path and the steptrace version) are written as
placeholders before the bytes are compared.  PNGs are compared as decoded pixels (PNG metadata may
differ); a matplotlib other than the one that drew the goldens may antialias text differently, so
the pixel test then skips and says so.

When a change to the pictures is intended, regenerate with ``STEPTRACE_REGEN_GOLDEN=1`` and review
the new PNGs by eye.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from steptrace._version import __version__
from steptrace.analysis.runs import load_run
from steptrace.timeline import build_trace, render_png

GOLDEN = Path(__file__).resolve().parent / "golden" / "timeline"
REGEN = os.environ.get("STEPTRACE_REGEN_GOLDEN") == "1"

# name -> (run, ranks, steps)
CASES = {
    "pp": ("pp", None, None),
    "pp-rank1-steps1_3": ("pp", [1], "1:3"),
    "sim": ("sim", None, None),
}
DPI = 60  # below the default 100 to keep the goldens small; the layout code is the same


def _trace_bytes(run, ranks, steps) -> bytes:
    # What write_trace writes, with the two machine-dependent strings as placeholders.
    text = json.dumps(build_trace(run, ranks=ranks, steps=steps), separators=(",", ":"))
    text = text.replace(json.dumps(str(run.path)), '"<RUN_PATH>"', 1)
    text = text.replace(json.dumps(f"steptrace {__version__}"), '"steptrace <VERSION>"', 1)
    return text.encode("utf-8")


@pytest.mark.parametrize("name", sorted(CASES))
def test_perfetto_json_is_byte_identical_to_the_golden(name):
    run_name, ranks, steps = CASES[name]
    got = _trace_bytes(load_run(GOLDEN / run_name), ranks, steps)
    golden = GOLDEN / f"{name}.trace.json"
    if REGEN:
        golden.write_bytes(got)
    assert got == golden.read_bytes()


def _pixels(path: Path):
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    with image.open(path) as img:
        return np.asarray(img.convert("RGBA"))


def _check_png(got: Path, golden: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    drawn_with = GOLDEN / "matplotlib_version.txt"
    if REGEN:
        golden.write_bytes(got.read_bytes())
        drawn_with.write_text(matplotlib.__version__ + "\n")
    a, b = _pixels(got), _pixels(golden)
    if a.shape == b.shape and (a == b).all():
        return
    if drawn_with.read_text().strip() != matplotlib.__version__:
        pytest.skip(f"the goldens were drawn by matplotlib {drawn_with.read_text().strip()}, "
                    f"this is {matplotlib.__version__}: pixels may differ by antialiasing")
    assert a.shape == b.shape, f"{golden.name}: size {a.shape} != golden {b.shape}"
    diff = (a != b).any(axis=-1)
    raise AssertionError(f"{golden.name}: {int(diff.sum())} pixels differ from the golden")


@pytest.mark.parametrize("name", sorted(CASES))
def test_timeline_png_is_pixel_identical_to_the_golden(name, tmp_path):
    pytest.importorskip("matplotlib")
    run_name, ranks, steps = CASES[name]
    got = render_png(load_run(GOLDEN / run_name), tmp_path / "got.png", ranks=ranks, steps=steps,
                     dpi=DPI)
    _check_png(got, GOLDEN / f"{name}.png")


@pytest.mark.parametrize("run_name,rank", [("pp", 1)])
def test_report_plot_is_pixel_identical_to_the_golden(run_name, rank, tmp_path):
    pytest.importorskip("matplotlib")
    from steptrace.analysis.plotting import plot_timeline

    got = plot_timeline(load_run(GOLDEN / run_name), tmp_path / "got.png", rank=rank)
    _check_png(got, GOLDEN / f"{run_name}-rank{rank}.report.png")
