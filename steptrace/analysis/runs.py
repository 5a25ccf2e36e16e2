"""Loading steptrace run directories: each rank's JSONL file and the collector's ``cluster.jsonl``.

A run directory is ``<run_dir>/<run_id>/`` holding one ``rank-<rank>.jsonl`` file per rank (and the
files rotated out of it, ``rank-<rank>.<k>.jsonl``, read first in order of k) and,
when a steptrace collector joined the run, its ``cluster.jsonl`` (one ``cluster_step`` record per
step across ranks, plus ``late`` records). :func:`load_run` reads them into a :class:`Run`.
Only the standard library is imported.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from steptrace.analysis.collectives import join_device_collectives
from steptrace.analysis.summary import as_number

# rank-<r>.jsonl, and the files rotated out of it, rank-<r>.<k>.jsonl (k = 1, 2, ... in write order).
_RANK_FILE = re.compile(r"^rank-(\d+)(?:\.(\d+))?\.jsonl$")
#: Written by the steptrace collector (steptrace.collector): the cross-rank join.
CLUSTER_FILE = "cluster.jsonl"


class RunDirError(ValueError):
    """A run directory is missing, empty, or contains malformed records."""


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def _rank_files(directory: Path) -> dict[int, list[Path]]:
    """Map rank -> its files in write order, for every ``rank-<int>.jsonl`` directly in *directory*:
    the rotated ``rank-<r>.<k>.jsonl`` by k, then ``rank-<r>.jsonl`` (the one being written)."""
    found: dict[int, list[tuple[float, Path]]] = {}
    for child in directory.iterdir():
        match = _RANK_FILE.match(child.name)
        if match and child.is_file():
            segment = match.group(2)
            order = float(segment) if segment is not None else math.inf
            found.setdefault(int(match.group(1)), []).append((order, child))
    return {rank: [path for _, path in sorted(files)] for rank, files in found.items()}


def _run_files(directory: Path) -> list[Path]:
    """The rank files and the collector's cluster file of *directory*."""
    files = [file for files in _rank_files(directory).values() for file in files]
    cluster = directory / CLUSTER_FILE
    if cluster.is_file():
        files.append(cluster)
    return files


def find_run(path: str | Path) -> Path:
    """Resolve *path* to a run directory.

    *path* is either a run directory (it holds ``rank-*.jsonl`` files, or a
    collector's ``cluster.jsonl``) or a parent ``run_dir``; for a parent, the
    run whose files were written most recently is chosen.
    """
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"{path}: no such directory")
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    if _run_files(path):
        return path

    newest: tuple[float, Path] | None = None
    for child in path.iterdir():
        if not child.is_dir():
            continue
        files = _run_files(child)
        if not files:
            continue
        # Use the rank files' mtime rather than the directory's: appending
        # records updates the files but not the directory entry.
        mtime = max(f.stat().st_mtime for f in files)
        if newest is None or mtime > newest[0]:
            newest = (mtime, child)
    if newest is None:
        raise RunDirError(
            f"{path}: no rank-*.jsonl files (nor a collector's {CLUSTER_FILE}) here or in any run subdirectory"
        )
    return newest[1]


#: A line longer than this is skipped and counted, never read whole (a record is a few KiB).
MAX_LINE_BYTES = 16 << 20


def _read_rank_file(file: Path, warnings: list[str], skipped: dict[str, int] | None = None) -> list[dict]:
    """Parse one JSONL file, skipping every line that is not a JSON object, wherever it is.

    A crash mid-write leaves a torn last line; a restart with the same run_id, or a disk that
    filled up and was freed, can leave one in the middle. Neither may cost the rest of the run:
    each bad line is skipped and counted (``skipped[str(file)]``), and one warning per file
    names the count and the first bad line.
    """
    records: list[dict] = []
    bad = 0
    first: tuple[int, str] | None = None
    with file.open("rb") as handle:
        lineno = 0
        while True:
            raw = handle.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            problem = None
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the line, never held whole
                    raw = handle.readline(1 << 20)
                bad += 1
                first = first or (lineno, f"longer than {MAX_LINE_BYTES} bytes")
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                problem = "invalid UTF-8"
            except json.JSONDecodeError as exc:
                problem = f"invalid JSON ({exc.msg})"
            except RecursionError:
                problem = "nested too deeply"
            else:
                if not isinstance(record, dict):
                    problem = "not a JSON object"
            if problem is not None:
                bad += 1
                first = first or (lineno, problem)
                continue
            records.append(record)
    if bad:
        if skipped is not None:
            skipped[str(file)] = bad
        warnings.append(f"{file}: skipped {bad} unreadable line{'' if bad == 1 else 's'} "
                        f"(first: line {first[0]}, {first[1]})")
    return records


def _step_key(record: dict) -> tuple[int, float]:
    """Sort key by step number; records without a numeric step go last."""
    step = as_number(record.get("step"))
    return (0, step) if step is not None else (1, 0.0)


@dataclass
class Run:
    """All records of one run, grouped by rank (from the file name)."""

    path: Path
    records_by_rank: dict[int, list[dict]]
    warnings: list[str] = field(default_factory=list)
    #: file -> lines skipped because they were not a JSON object (torn or garbage lines)
    skipped_lines: dict[str, int] = field(default_factory=dict)
    #: The collector's records (``cluster.jsonl``), in file order; empty without a collector.
    cluster_records: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.records_by_rank)

    @property
    def default_rank(self) -> int:
        """Rank 0 if present, otherwise the lowest rank."""
        return 0 if 0 in self.records_by_rank else self.ranks[0]

    @property
    def run_id(self) -> str:
        for rank in self.ranks:
            for record in self.records_by_rank[rank]:
                if isinstance(record.get("run_id"), str):
                    return record["run_id"]
        for record in self.cluster_records:
            if isinstance(record.get("run_id"), str):
                return record["run_id"]
        return self.path.name

    @property
    def world_size(self) -> int:
        """World size as recorded, or the number of rank files if unrecorded."""
        for rank in self.ranks:
            for record in self.records_by_rank[rank]:
                size = record.get("world_size")
                if isinstance(size, int) and not isinstance(size, bool):
                    return size
        for record in self.cluster_records:
            size = record.get("world_size")
            if isinstance(size, int) and not isinstance(size, bool):
                return size
        return len(self.ranks)

    @property
    def dropped(self) -> dict[str, int]:
        """Dropped-record counts per reason, summed over all ranks."""
        totals: dict[str, int] = {}
        for record in self.records("run"):
            dropped = record.get("dropped")
            if isinstance(dropped, dict):
                for reason, count in dropped.items():
                    if as_number(count) is not None:
                        totals[reason] = totals.get(reason, 0) + int(count)
        return totals

    def resolve_rank(self, rank: int | None) -> int:
        """Validate *rank*; None means the default rank."""
        if not self.records_by_rank:
            raise RunDirError(f"{self.path}: no rank files")
        if rank is None:
            return self.default_rank
        if rank not in self.records_by_rank:
            have = ", ".join(str(r) for r in self.ranks)
            raise RunDirError(f"{self.path}: no rank {rank} (ranks: {have})")
        return rank

    def records(self, type_: str, rank: int | None = None) -> list[dict]:
        """Records of one type; *rank* None means all ranks."""
        ranks = self.ranks if rank is None else [self.resolve_rank(rank)]
        return [
            r
            for k in ranks
            for r in self.records_by_rank[k]
            if r.get("type") == type_
        ]

    def steps(self, rank: int | None = None) -> list[dict]:
        """The kept step records of *rank* (default: rank 0), sorted by step number: a step that a
        later attempt redid counts once, as the later attempt ran it (see :func:`split_attempts`)."""
        rank = self.resolve_rank(rank)
        kept, _ = kept_and_wasted(self.records_by_rank[rank])
        return sorted(kept, key=_step_key)

    def wasted_steps(self, rank: int | None = None) -> list[dict]:
        """Step records of *rank* whose progress a later attempt threw away (it resumed from an
        earlier step): wasted progress in the job's accounting."""
        _, wasted = kept_and_wasted(self.records_by_rank[self.resolve_rank(rank)])
        return wasted

    def checkpoints(self, rank: int | None = None) -> list[dict]:
        """Checkpoint records of *rank* (default: rank 0), sorted by step."""
        rank = self.resolve_rank(rank)
        return sorted(self.records("checkpoint", rank), key=_step_key)

    def cluster_steps(self) -> list[dict]:
        """The collector's ``cluster_step`` records, one per step, sorted by step.

        A step written twice (a collector restarted past the memory of what it
        emitted) keeps the record with the most ranks; on a tie, the later one.
        """
        best: dict[int, dict] = {}
        for record in self.cluster_records:
            step = record.get("step")
            if record.get("type") != "cluster_step" or isinstance(step, bool) or not isinstance(step, int):
                continue
            have = best.get(step)
            if have is None or ranks_reporting(record) >= ranks_reporting(have):
                best[step] = record
        return [best[k] for k in sorted(best)]

    def late_spans(self) -> list[dict]:
        """The collector's ``late`` records: a rank's step span that arrived after its step was written."""
        return [r for r in self.cluster_records if r.get("type") == "late"]


def attempt_of(record: dict) -> int:
    """The attempt a record belongs to (0 for records written before attempts were recorded)."""
    attempt = record.get("attempt")
    return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 0 else 0


def split_attempts(records: list[dict]) -> list[tuple[int, list[dict]]]:
    """One rank's records grouped by attempt, in the order the attempts appear in its file."""
    groups: dict[int, list[dict]] = {}
    for record in records:
        groups.setdefault(attempt_of(record), []).append(record)
    return list(groups.items())


#: How far one attempt's records may overlap in time the next one's and both still be believed: the
#: step times come from the host clock, and a rank moved to another host reads another (NTP-synced) one.
ATTEMPT_OVERLAP_TOLERANCE_S = 0.1


def _attempt_window(records: list[dict]) -> tuple[float, float] | None:
    """(first moment, last moment) that an attempt's records cover, None when they carry no time."""
    starts, ends = [], []
    for record in records:
        end = as_number(record.get("end_time"))
        start = as_number(record.get("start_time"))
        if start is None and end is not None and record.get("type") == "step":
            start = end - (as_number(record.get("interval_seconds")) or 0.0)
        if start is not None:
            starts.append(start)
        if end is not None:
            ends.append(end)
    if not starts and not ends:
        return None
    return min(starts or ends), max(ends or starts)


def believed_attempts(records: list[dict], *,
                      tolerance_s: float = ATTEMPT_OVERLAP_TOLERANCE_S) -> tuple[list[dict], list[str]]:
    """One rank's records with the attempts that cannot be real left out, and why, one line each.

    An attempt is a process start of the rank, so two attempts of one rank cannot run at the same
    time, and the higher number starts later. Records that reach a reader from a shared store
    (ClickHouse: any holder of the ingest token can write rows) may claim any ``attempt``; believed
    blindly, one forged "later attempt" makes the real steps after its step wasted progress and
    rewrites the job's goodput. So the attempts are checked against their own times: the attempt
    with the most steps is believed first, then the others in turn, each only when it neither
    overlaps a believed attempt (beyond ``tolerance_s``) nor is out of order with one. The ones left
    out are named in the returned lines. Attempt numbers that skip (attempt 0 then 5) are believed
    (an attempt that crashed before its first step sent nothing) and named in a line as well.
    """
    groups = split_attempts(records)
    if len(groups) < 2:
        return records, []
    windows = {attempt: _attempt_window(group) for attempt, group in groups}
    step_count = {attempt: sum(1 for r in group if r.get("type") == "step") for attempt, group in groups}
    believed: dict[int, tuple[float, float]] = {}
    refused: list[int] = []
    # Most steps first; on a tie the lower number (a forger cannot outnumber the real steps cheaply).
    for attempt in sorted(windows, key=lambda a: (-step_count[a], a)):
        window = windows[attempt]
        if window is None:
            refused.append(attempt)
            continue
        start, end = window
        fits = all((other < attempt and start >= other_end - tolerance_s)
                   or (other > attempt and end <= other_start + tolerance_s)
                   for other, (other_start, other_end) in believed.items())
        if fits:
            believed[attempt] = window
        else:
            refused.append(attempt)
    lines = []
    rank = next((r.get("rank") for r in records if r.get("rank") is not None), "?")
    for attempt in sorted(refused):
        lines.append(f"rank {rank} attempt {attempt} ({step_count[attempt]} step(s)) overlaps or precedes in time "
                     f"an attempt of the same rank numbered otherwise: not believed, left out of every table and "
                     f"of the goodput (two process starts of one rank cannot overlap; docs/goodput.md)")
    numbers = sorted(believed)
    for low, high in zip(numbers, numbers[1:]):
        if high > low + 1:
            lines.append(f"rank {rank}: attempt {high} follows attempt {low}; attempts {low + 1}-{high - 1} sent "
                         f"no step (crashed before their first step, or the numbers were set by hand)")
    if not refused:
        return records, lines
    return [r for r in records if attempt_of(r) not in refused], lines


def kept_and_wasted(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """One rank's step records split into those kept and those whose progress was thrown away.

    A step of attempt *k* is wasted when a later attempt's first step is at or before it: the
    later attempt resumed from a checkpoint older than that step, so everything from there on was
    lost, whether the later attempt got to redo it or not. A clean save-exit-resume (the next
    attempt starts after the last step) wastes nothing. Independent of step numbers repeating.
    """
    attempts = [[r for r in group if r.get("type") == "step"] for _, group in split_attempts(records)]
    kept: list[dict] = []
    wasted: list[dict] = []
    for i, steps in enumerate(attempts):
        resumed_at = min((as_number(s.get("step")) for later in attempts[i + 1:] for s in later[:1]
                          if as_number(s.get("step")) is not None), default=None)
        for step in steps:
            number = as_number(step.get("step"))
            if resumed_at is not None and number is not None and number >= resumed_at:
                wasted.append(step)
            else:
                kept.append(step)
    return kept, wasted


def ranks_reporting(record: dict) -> int:
    value = as_number(record.get("ranks_reporting"))
    return int(value) if value is not None else 0


def load_run(path: str | Path) -> Run:
    """Load a run directory (or the newest run under a parent run_dir)."""
    run_path = find_run(path)
    warnings: list[str] = []
    skipped: dict[str, int] = {}
    records_by_rank = {
        rank: [record for file in files for record in _read_rank_file(file, warnings, skipped)]
        for rank, files in sorted(_rank_files(run_path).items())
    }
    # NCCL ranks timed their collectives on the device: their wait for peers is known only joined.
    join_device_collectives(records_by_rank)
    cluster_file = run_path / CLUSTER_FILE
    # The same torn-last-line tolerance as the rank files: a killed collector leaves one too.
    cluster = _read_rank_file(cluster_file, warnings, skipped) if cluster_file.is_file() else []
    return Run(path=run_path, records_by_rank=records_by_rank, warnings=warnings, cluster_records=cluster,
               skipped_lines=skipped)
