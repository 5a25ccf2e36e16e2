"""Reads a W&B offline run back: its history rows, from the run's transaction log (``run-<id>.wandb``,
what offline mode writes and ``wandb sync`` uploads), with W&B's own record definitions
(``wandb.proto.wandb_internal_pb2.Record``). docs/trackers.md shows its use::

    from steptrace.analysis.wandb_log import history, offline_runs
    for row in history(offline_runs("wandb")[-1]):
        print(row["steptrace/step"], row.get("steptrace/scalars/loss"))

wandb >= 0.2x ships no Python reader of its own (the old ``wandb.sdk.internal.datastore`` is gone;
wandb-core, in Go, reads it), and ``wandb sync`` only uploads. The file is W&B's 7-byte header
(``:W&B``, magic 0xBEE1, version) followed by LevelDB's log format
(github.com/google/leveldb doc/log_format.md): 32 KiB blocks of records, each a 7-byte header (masked
CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last) and its payload; a block's tail shorter than
a header is zero padding. Needs the ``wandb`` package (``steptrace[wandb]``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

BLOCK = 32768
HEADER = struct.Struct("<IHB")


def _payloads(data: bytes) -> Iterator[bytes]:
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"not a W&B transaction log (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:
            pos += left
            continue
        _crc, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # pre-allocated zeros: the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + HEADER.size:pos + HEADER.size + length]
        pos += HEADER.size + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"unknown log record type {kind} at byte {pos}")


def offline_runs(directory: str | Path = "wandb") -> list[Path]:
    """The transaction logs (``run-<id>.wandb``) of the offline runs under a W&B directory (``./wandb``,
    or ``<WANDB_DIR>/wandb``), oldest first. Read them once the writing process has ended (or called
    ``wandb.teardown()``): ``run.finish()`` returns before W&B's service has closed the file."""
    base = Path(directory)
    if (base / "wandb").is_dir():
        base = base / "wandb"
    return sorted(base.glob("offline-run-*/run-*.wandb"))


def history(path: str | Path) -> list[dict]:
    """The run's history rows, in the order they were logged (key -> value)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_config(path: str | Path) -> dict:
    """The run's name, group and job type as its ``run`` record holds them."""
    from wandb.proto import wandb_internal_pb2

    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            return {"name": record.run.display_name, "group": record.run.run_group, "job_type": record.run.job_type}
    raise ValueError(f"{path}: no run record")
