"""One palette for every picture steptrace draws (the report's plot, the timeline PNG, the
Chrome trace): the same idle reason has the same colour everywhere and across runs."""

from __future__ import annotations

import zlib
from typing import Iterable

# Fixed colours for the idle reasons the SDK emits itself, so the same reason
# looks the same across runs and plots.  User span names get a colour derived
# from a stable hash of the name (see reason_colour).
REASON_COLOURS = {
    "compute": "#2ca02c",
    "checkpoint": "#d62728",
    "data": "#1f77b4",
    "compile": "#9467bd",
    "eval": "#ff7f0e",
    "other": "#7f7f7f",
    "startup": "#c7c7c7",  # before the first step: what no span covers
    "restore": "#8c564b",
    # Not an idle reason: a rank's time waiting for other ranks in collectives (report --plot).
    "collective_wait": "#e7ba52",
}
_KNOWN_REASON_ORDER = ["checkpoint", "data", "compile", "eval"]
_USER_PALETTE = [
    "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#aec7e8", "#ffbb78",
    "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
]


def reason_colour(reason: str) -> str:
    """A colour that depends only on the reason name (stable across runs)."""
    if reason in REASON_COLOURS:
        return REASON_COLOURS[reason]
    # crc32 rather than hash(): str hashes are salted per process.
    return _USER_PALETTE[zlib.crc32(reason.encode("utf-8")) % len(_USER_PALETTE)]


def reason_order(reasons: Iterable[str]) -> list[str]:
    """Known reasons first in a fixed order, user reasons sorted, 'other' on top."""
    reasons = set(reasons)
    ordered = [r for r in _KNOWN_REASON_ORDER if r in reasons]
    ordered += sorted(reasons - set(_KNOWN_REASON_ORDER) - {"other"})
    if "other" in reasons:
        ordered.append("other")
    return ordered


# Timeline colours not covered by the reason colours.
STEP_COLOUR = "#d5dbe3"
STEP_EDGE = "#7d8796"
ERROR_COLOUR = "#f4a3a3"
ERROR_EDGE = "#b00000"
BLOCKING_COLOUR = "#7a0d0d"
FORWARD_COLOUR = "#9ecae1"
BACKWARD_COLOUR = "#08519c"
SEPARATE = {"edgecolor": "white", "linewidth": 0.6}
