"""``megatron.training.checkpointing.load_checkpoint`` reduced to what the restore hook relies on.

Megatron-LM (NVIDIA/Megatron-LM d98e8a6, Aug 2026, ``megatron/training/checkpointing.py``):

* ``load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True,
  checkpointing_context=None, ...)`` reads the directory ``getattr(args, load_arg)``; its
  ``latest_checkpointed_iteration.txt`` names the iteration to load (``get_checkpoint_tracker_filename``).
* It returns ``(iteration, num_floating_point_operations_so_far)``; with no checkpoint there, it
  returns ``(0, 0)`` ("Checkpoint not loaded"), and ``get_loaded_iteration()`` stays None.
* A checkpoint that cannot be read raises (the real one: ``FileNotFoundError``, ``RuntimeError``).
* It is synchronous: the state is in the model and optimizer when it returns.

The save side writes the tracker file as ``save_checkpoint`` does (``training.save_checkpoint_and_time``).
"""

import json
import os
import time

from megatron.training import get_args

LOAD_S = 0.08  # reading the checkpoint
_LOADED_ITERATION = None


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, "latest_checkpointed_iteration.txt")


def get_loaded_iteration():
    return _LOADED_ITERATION


def save(iteration, num_floating_point_operations_so_far):
    path = get_args().save
    if path:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f"iter_{iteration:07d}.json"), "w") as f:
            json.dump({"iteration": iteration, "flops": num_floating_point_operations_so_far}, f)
        with open(get_checkpoint_tracker_filename(path), "w") as f:
            f.write(str(iteration))


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None, pp_group=None,
                    dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    global _LOADED_ITERATION
    load_dir = getattr(get_args(), load_arg)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return 0, 0
    iteration = int(open(tracker).read())
    with open(os.path.join(load_dir, f"iter_{iteration:07d}.json")) as f:  # missing: raises, as the real one
        state = json.load(f)
    time.sleep(LOAD_S)
    _LOADED_ITERATION = iteration
    return state["iteration"], state["flops"]
