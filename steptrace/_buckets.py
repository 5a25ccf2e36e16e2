"""Histogram bucket bounds, in seconds, shared by the Prometheus and OTLP exporters.

One set per kind of duration, so a dashboard reads the same buckets whichever
exporter fed it. About 2x apart (a 1-2-5 series), which keeps
``histogram_quantile`` within a factor of ~2; exact values stay in the JSONL
records. (The OpenTelemetry SDK's default buckets assume milliseconds.)
"""

#: Step interval and compute: 1 ms to 10 min.
STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                  1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Pipeline microbatches: 100 µs to 1 min.
MICROBATCH_BUCKETS_S = (0.0001, 0.0002, 0.0005) + STEP_BUCKETS_S[:STEP_BUCKETS_S.index(60.0) + 1]
#: Checkpoint blocking and async commit: 10 ms to 30 min.
CHECKPOINT_BUCKETS_S = STEP_BUCKETS_S[STEP_BUCKETS_S.index(0.01):] + (1200.0, 1800.0)
