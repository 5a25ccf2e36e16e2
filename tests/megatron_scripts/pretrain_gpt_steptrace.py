"""Megatron-LM's pretrain_gpt.py with the steptrace hooks installed first (the one-line drop-in).

Usage (what tests/gpu/test_megatron_gpu.py runs)::

    MEGATRON_LM_PATH=/path/to/Megatron-LM STEPTRACE_RUN_DIR=runs STEPTRACE_RUN_ID=gpt \\
        torchrun --nproc_per_node=1 tests/megatron_scripts/pretrain_gpt_steptrace.py <pretrain_gpt.py args>
"""

import os
import runpy
import sys

source = os.environ["MEGATRON_LM_PATH"]
sys.path.insert(0, source)

import steptrace.adapters.megatron  # noqa: E402

import steptrace  # noqa: E402

steptrace.adapters.megatron.install()  # settings from STEPTRACE_* (run dir, run id); rank from torchrun
sys.argv = [os.path.join(source, "pretrain_gpt.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
steptrace.shutdown()
