"""``megatron.training.training``'s hooked functions, reduced to their shape (see __init__)."""

import time

from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: F401 (as Megatron-LM)
from megatron.training import async_utils, checkpointing, get_args
from megatron.training.checkpointing import load_checkpoint  # by name, as Megatron-LM's training.py

# A process's first iteration: warm-up (allocator, NCCL, CUDA graphs) the later ones do not pay.
# 0 unless a test sets it.
FIRST_ITERATION_S = 0.0

OPTIMIZER_S = 0.05  # gradient finalization + optimizer.step() after the schedule


def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None):
    return 24 * batch_size * args.seq_length * args.num_layers * args.hidden_size ** 2


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
    args = get_args()
    losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                   num_microbatches=NUM_MICROBATCHES, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, forward_only=False)
    time.sleep(OPTIMIZER_S)
    global _warm
    if not _warm and FIRST_ITERATION_S:
        time.sleep(FIRST_ITERATION_S)
        _warm = True
    return losses


_warm = False


NUM_MICROBATCHES = 3


def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                             checkpointing_context, non_persistent_ckpt=False, train_data_iterator=None):
    checkpointing.save(iteration, num_floating_point_operations_so_far)
    if get_args().async_save:
        async_utils.schedule_async_save()


def setup_model_and_optimizer(model, optimizer=None, opt_param_scheduler=None):
    """The restore part of Megatron-LM's ``setup_model_and_optimizer``: with ``--load`` (or a
    pretrained checkpoint), ``load_checkpoint`` by its imported name sets ``args.iteration``
    (the real one inside ``timers('load-checkpoint')`` with barriers and one_logger)."""
    args = get_args()
    if args.load is not None:
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler, checkpointing_context={})
    else:
        args.iteration, args.num_floating_point_operations_so_far = 0, 0
    return model, optimizer, opt_param_scheduler
