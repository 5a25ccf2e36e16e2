"""Offline analysis of steptrace run directories, apart from the runtime.

=================  ==================================================================
``runs``           loading run directories (``load_run``, ``find_run``, ``Run``)
``summary``        summaries of step records (totals, percentiles, goodput, per rank)
``report``         ``steptrace report``: rich tables and JSON
``lanes``          the laid-out timeline (windows, bars, host lanes, tracks) both renderers draw
``timeline``       ``steptrace timeline``: the Chrome/Perfetto trace of all ranks
``plotting``       the PNG pictures (the report's plot, the timeline lanes)
``palette``        one colour per idle reason, everywhere
``wandb_log``      reading a W&B offline run's logged rows back (docs/trackers.md)
=================  ==================================================================

Nothing here is imported by the training-time code; ``steptrace.report`` and
``steptrace.timeline`` remain as import paths and commands.
"""
