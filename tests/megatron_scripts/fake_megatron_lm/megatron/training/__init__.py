"""A stand-in for Megatron-LM's ``megatron.training`` (not on PyPI) with the shapes the hooks read.

Only what steptrace's hooks touch, written after Megatron-LM main (megatron-core 0.20.0):
``get_args()``, ``training.train_step`` / ``save_checkpoint_and_time`` / ``setup_model_and_optimizer``
(its ``load_checkpoint`` call; ``checkpointing.py``) /
``num_floating_point_operations`` and ``async_utils.maybe_finalize_async_save`` with its
``_async_calls_queue``. The contract tests against the real source are in tests/test_megatron.py.
"""

import types

ARGS = types.SimpleNamespace(seq_length=16, micro_batch_size=2, data_parallel_size=1, world_size=1,
                             hidden_size=8, num_layers=2, async_save=False, curr_iteration=0, save=None, load=None,
                             iteration=0, num_floating_point_operations_so_far=0)


def get_args():
    return ARGS
