"""The steptrace collector: receives OTLP from every rank and joins each step across ranks.

Run it as ``steptrace collector --world-size N --run-dir DIR`` (or ``python -m
steptrace.collector``), or from Python::

    from steptrace.collector import Collector, CollectorConfig

    with Collector(CollectorConfig(port=0, metrics_port=0, world_size=8, run_dir="runs")) as collector:
        ...  # ranks: steptrace.init(otlp_endpoint=collector.endpoint, ...)

Modules: ``_decode`` (OTLP requests in, step spans out; every bad input is a
counted 4xx), ``_join`` (the cross-rank join and the ``cluster_step`` record),
``_metrics`` (``/metrics``), ``_runlog`` (``cluster.jsonl``), ``_http`` and
``_grpc`` (the receivers), ``_app`` (:class:`Collector`), ``_cli``.
``Collector`` and ``CollectorConfig`` are imported on first use, so importing
this package (as ``steptrace --help`` does) costs nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Collector", "CollectorConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from steptrace.collector import _app

        return getattr(_app, name)
    raise AttributeError(f"module 'steptrace.collector' has no attribute {name!r}")
