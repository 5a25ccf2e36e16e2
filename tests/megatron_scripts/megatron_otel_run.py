"""One rank of a Megatron-style run with Megatron-LM's OpenTelemetry export (megatron_otel_standin) and
steptrace's both on, pointed at one OTLP receiver. Run by tests/test_megatron_otel.py in a subprocess
(each process sets the global OpenTelemetry providers once, as Megatron does).

argv: ENDPOINT RUN_DIR RANK WORLD_SIZE ITERATIONS SAVE_INTERVAL. Prints the hooks installed, as JSON.
"""

import json
import os
import sys
import time
from pathlib import Path

endpoint, run_dir = sys.argv[1], sys.argv[2]
rank, world_size, iterations, save_interval = (int(a) for a in sys.argv[3:7])
here = Path(__file__).parent
sys.path.insert(0, str(here))

import megatron  # noqa: E402

# A plain list, as tests/test_megatron.py sets it: megatron is a namespace package, and a _NamespacePath
# recomputes itself from sys.path when that changes, dropping an entry appended to it.
megatron.__path__ = list(megatron.__path__) + [str(here / "fake_megatron_lm" / "megatron")]
from megatron.core import num_microbatches_calculator  # noqa: E402

import megatron.training.training as training  # noqa: E402
import megatron_otel_standin as lens  # noqa: E402

num_microbatches_calculator.get_num_microbatches = lambda: training.NUM_MICROBATCHES
# Megatron-LM's training.py: `from megatron.training.global_vars import get_telemetry` and its
# `_otel_managed_span` (nemo-lens's managed_span), module globals the hooks find there.
training.get_telemetry = lens.get_telemetry
training._otel_managed_span = lens.managed_span

import steptrace  # noqa: E402
import steptrace.adapters.megatron as hooks  # noqa: E402

steptrace.init(run_dir=run_dir, run_id="megatron-run", rank=rank, world_size=world_size, otlp_endpoint=endpoint,
               otlp_metrics_interval_s=60.0)
names = hooks.install()
# initialize_megatron -> set_global_variables -> _set_telemetry: after the hooks, at the top of pretrain().
lens.set_telemetry(rank, world_size, endpoint + "/v1/traces", endpoint + "/v1/metrics")


def forward_backward(**kwargs):
    time.sleep(0.01)  # the schedule's device work, on the CPU here
    return []


lens.train(training, forward_backward, start_iteration=0, iterations=iterations, save_interval=save_interval)
steptrace.shutdown(timeout_s=10.0)
handle = lens.get_telemetry()
handle.shutdown()
print(json.dumps({"hooks": names, "megatron_run_id_env": os.environ.get("MEGATRON_OTEL_RUN_ID")}))
