"""What a comparison of two runs needs to be honest: versions, devices, host, code, tags.

Collected once per run by the resolver (off the training thread) at the first step, when the
frameworks the program uses are imported, and written as the run's ``metadata`` record. Only
frameworks already imported are asked; nothing here imports one, runs a subprocess, or blocks
on a device.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

from steptrace._version import __version__


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "steptrace": __version__}
    for name in ("jax", "jaxlib", "torch", "numpy", "megatron.core", "maxtext", "lightning", "transformers"):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version:
            found[name] = str(version)
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        found["cuda"] = str(cuda)
    return found


def devices(cuda_index: int | None = None) -> dict[str, Any]:
    """The accelerators this process uses: kind and count (JAX's, else torch CUDA's, else the CPU).
    ``cuda_index``: the GPU the rank's steps are timed on (else the calling thread's current device,
    which for a background thread is 0 whatever the rank uses)."""
    jax = sys.modules.get("jax")
    if jax is not None and cuda_index is None:  # a rank timed on a torch GPU says that GPU, jax imported or not
        try:
            local = jax.local_devices()
            return {"platform": local[0].platform, "kind": local[0].device_kind, "count": len(local),
                    "global_count": jax.device_count()}
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                index = torch.cuda.current_device() if cuda_index is None else cuda_index
                return {"platform": "gpu", "kind": torch.cuda.get_device_name(index), "index": index,
                        "count": torch.cuda.device_count()}
        except Exception:
            pass
    return {"platform": "cpu", "kind": platform.processor() or platform.machine(), "count": 1}


def git_commit(start: str | os.PathLike[str] | None = None) -> str | None:
    """The commit checked out in the working directory's git repository, read from ``.git``
    (no subprocess), or None outside a repository."""
    here = Path(start or os.getcwd()).resolve()
    for directory in (here, *here.parents):
        git = directory / ".git"
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            text = git.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            git = (directory / text.split(":", 1)[1].strip()).resolve()
        if git.is_dir():
            return _resolve_head(git)
    return None


def _resolve_head(git: Path) -> str | None:
    try:
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    common = git
    commondir = git / "commondir"
    if commondir.is_file():  # worktrees keep refs in the main repository
        common = (git / commondir.read_text().strip()).resolve()
    for base in (git, common):
        path = base / ref
        if path.is_file():
            return path.read_text().strip() or None
    for base in (git, common):
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split(" ", 1)[0]
    return None


def collect(tags: dict[str, str], cuda_index: int | None = None) -> dict[str, Any]:
    found = devices() if cuda_index is None else devices(cuda_index)
    return {"hostname": socket.gethostname(), "versions": versions(), "devices": found,
            "git_commit": git_commit(), "tags": dict(tags)}
