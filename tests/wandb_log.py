"""The W&B transaction log reader the tests use: ``steptrace.analysis.wandb_log`` (what docs/trackers.md
tells users to read an offline run back with), and ``transaction_log``, which first ends W&B's service."""

from __future__ import annotations

from pathlib import Path

from steptrace.analysis.wandb_log import history, offline_runs, run_config

__all__ = ["history", "run_config", "transaction_log"]


def transaction_log(directory: str | Path) -> str:
    """The one offline run's transaction log under ``directory``, once W&B has written all of it.

    ``run.finish()`` returns before wandb-core (a process of its own) has written and closed the file:
    on a loaded machine a test read it with no run record or no history yet. ``wandb.teardown()`` ends
    the service, which closes every run's log first."""
    import wandb

    wandb.teardown()
    (path,) = offline_runs(Path(directory) / "wandb")
    return str(path)
