"""One rank of a run for tests/test_alerts_e2e.py: steps forever, serving /metrics on a free port.

    python tests/alert_rank.py RUN_ID RANK WORLD_SIZE BEHAVIOUR STEP_SECONDS

BEHAVIOUR: ``ok``; ``slow`` (each step takes 3x as long: a straggler); ``hang`` (at step 20 it
enters a ``data`` span that never ends, as a rank whose input pipeline hangs inside a step).
Prints the /metrics URL on its first line, then runs until it is killed.
"""

from __future__ import annotations

import itertools
import sys
import time

import steptrace

HANG_AT_STEP = 20


def main() -> None:
    run_id, rank, world_size, behaviour, step_seconds = sys.argv[1:]
    seconds = float(step_seconds) * (3 if behaviour == "slow" else 1)
    steptrace.init(run_id=run_id, rank=int(rank), world_size=int(world_size), local_rank=0, prometheus_port=0,
                   backend="host", jsonl=False, goodput_window_steps=20)
    print(steptrace.stats()["endpoints"]["prometheus"], flush=True)
    for n in itertools.count():
        with steptrace.step(n):
            if behaviour == "hang" and n == HANG_AT_STEP:
                with steptrace.span("data"):
                    time.sleep(3600)
            time.sleep(seconds)


if __name__ == "__main__":
    main()
