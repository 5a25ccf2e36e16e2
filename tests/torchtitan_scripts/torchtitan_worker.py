"""Run torchtitan 0.3.0's llama3 debug model through its real ``Trainer`` in one CPU process, hooked by
``steptrace.adapters.torchtitan`` (tests/test_torchtitan.py).

The Trainer, its loop (``Trainer.train``), its checkpointer (DCP, async saves), its data loader
(HuggingFace ``datasets`` over a JSON file, torchdata's StatefulDataLoader) and its metrics processor
are torchtitan's own. torchtitan 0.3.0 assumes an accelerator in three places; the shim below
replaces exactly those, on CPU only, each with the reason (on a CUDA machine nothing is shimmed):

1. Device selection at import. ``torchtitan/tools/utils.py`` sets
   ``device_type = _get_available_device_type() or "cuda"`` and ``device_module`` from it, so a
   CPU-only torch gets ``torch.cuda`` and ``Trainer.__init__``'s ``device_module.set_device`` fails
   (``torch._C`` has no ``_cuda_setDevice``). The shim makes ``torch._utils._get_available_device_type``
   answer ``"cpu"`` where it answers None, before torchtitan is imported.
2. The device memory monitor. ``DeviceMemoryMonitor`` (``components/metrics.py``) calls
   ``get_device_name``, ``get_device_properties``, ``memory_stats``, ``reset_peak_memory_stats`` and
   ``empty_cache`` on the device module; ``torch.cpu`` has none of them. The shim's ``cpu`` module
   is ``torch.cpu`` plus those five: name "CPU", total memory the machine's, empty memory stats
   (torchtitan then logs -1 for the peaks, as it does for any key its backend lacks). Only the
   memory columns of torchtitan's log depend on it.
3. Attention backward. The debug model's attention is FlexAttention (``sdpa`` is refused for
   language models in 0.3.0; ``varlen`` needs CUDA), and torch 2.13's ``flex_attention`` raises
   ``NotImplementedError("FlexAttention does not support backward on CPU")``. The shim replaces
   ``FlexAttention._compiled_flex_attn`` (the ``torch.compile``d kernel) by the same attention in
   eager PyTorch: the BlockMask's ``mask_mod`` made dense (``create_mask``) and
   ``scaled_dot_product_attention``. It refuses what it does not implement (a ``score_mod``, the
   log-sum-exp output). The kernel is slower than Flex, but it is the step's own compute, timed
   like any other.
4. ``set_pg_timeouts`` after the first step. It calls ``torch.distributed.barrier(device_ids=[
   device_module.current_device()])`` (a CUDA index; the CPU module answers "cpu") and then
   ``torch.distributed.set_timeout``, which torch 2.13 does not have. It only shortens the
   process groups' timeout once start-up is over; in one process nothing waits on it. The shim
   makes it a no-op.

One more, for pipeline parallelism and not about CPU (``pipeline_step_microbatches``): torchtitan
0.3.0's ``pp_forward_backward_step`` calls ``schedule.step(arg_mbs=..., kwarg_mbs=...,
target_mbs=..., losses=..., loss_kwargs=..., return_outputs=False)`` with its batch already split
into microbatches, an API of a torch newer than 2.13, whose ``step(*args, target=...)`` splits a
whole batch itself (``torch/distributed/pipelining/schedules.py``). Where ``step`` has no
``arg_mbs``, the shim hands those lists to the schedule's own ``_step_microbatches`` after the
per-iteration reset ``step`` does (``has_backward``, ``clear_runtime_states``); the schedule, its
stages and their ``forward_one_chunk``/``backward_one_chunk`` are torch's.

Writes ``<out>/torchtitan.json``: torchtitan's own logged metrics per step (the dict its
``MetricsProcessor`` hands its metric logger) and ``num_flops_per_token``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import types
from typing import Callable


def cpu_shim() -> list[str]:
    """Apply shims 1-4 (see the module docstring) when torch has no accelerator; returns their names."""
    import torch
    import torch._utils

    if torch._utils._get_available_device_type() is not None:
        return []
    real_device_type = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: real_device_type() or "cpu"
    cpu = types.ModuleType("torch_cpu_for_torchtitan")
    cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    cpu.get_device_name = lambda device=None: "CPU"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total, name="CPU")
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    real_device_module = torch._utils._get_device_module
    torch._utils._get_device_module = lambda device_type="cuda": (
        cpu if device_type == "cpu" else real_device_module(device_type))

    import torch.nn.functional as F
    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common.attention import FlexAttention

    def eager_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or (return_aux is not None and return_aux.lse):
            raise NotImplementedError("the CPU shim's attention has no score_mod and no lse output")
        mask = flex.create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[-2], k.shape[-2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, flex.AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(eager_flex_attention)

    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    return ["device_type", "memory_monitor", "flex_attention_backward", "set_pg_timeouts"]


def pipeline_shim() -> list[str]:
    """Apply the ``pipeline_step_microbatches`` shim (see the module docstring) where torch needs it."""
    import inspect

    from torch.distributed.pipelining import schedules

    if "arg_mbs" in inspect.signature(schedules.PipelineScheduleSingle.step).parameters:
        return []

    def make(original):
        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                 loss_kwargs=None, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return original(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                                **kwargs)
            for stage in getattr(self, "_stages", None) or [self._stage]:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            return None

        return step

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = make(cls.step)
    return ["pipeline_step_microbatches"]


def write_assets(work: str) -> tuple[str, str]:
    """A byte-level BPE tokenizer (vocabulary under the debug model's 2048) and a JSON text dataset in
    the ``c4_test`` layout (one ``{"text": ...}`` per line), made here: the repository's test assets
    are not in torchtitan's wheel."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "step", "trace", "device", "loss", "token", "model", "layer"]
    texts = [" ".join(rng.choice(words) for _ in range(400)) for _ in range(64)]
    tokenizer_dir, dataset_dir = os.path.join(work, "tokenizer"), os.path.join(work, "c4_test")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(dataset_dir, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Every rank writes the same files: each to its own name, then renamed over (atomic), so no rank
    # reads another's half-written file.
    def publish(path: str, write: Callable[[str], None]) -> None:
        mine = f"{path}.{os.getpid()}.tmp"
        write(mine)
        os.replace(mine, path)

    def write_text(text: str) -> Callable[[str], None]:
        def write(path: str) -> None:
            with open(path, "w") as f:
                f.write(text)
        return write

    publish(os.path.join(tokenizer_dir, "tokenizer.json"), tokenizer.save)
    publish(os.path.join(tokenizer_dir, "tokenizer_config.json"),
            write_text(json.dumps({"bos_token": bos, "eos_token": eos})))
    publish(os.path.join(dataset_dir, "data.json"), write_text("".join(json.dumps({"text": t}) + "\n" for t in texts)))
    return tokenizer_dir, dataset_dir


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, help="tokenizer, dataset and torchtitan's dump folder")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True, help="torchtitan's training.steps")
    parser.add_argument("--interval", type=int, default=2, help="checkpoint.interval")
    parser.add_argument("--async-mode", default="async", help="checkpoint.async_mode")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="parallelism.pipeline_parallel_degree (one rank each)")
    parser.add_argument("--pp-schedule", default="1F1B")
    args = parser.parse_args()

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    shims = cpu_shim() + pipeline_shim()

    import torch
    import torch.distributed
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import steptrace
    import steptrace.adapters.torchtitan

    tokenizer_dir, dataset_dir = write_assets(args.work)
    config = llama3_debugmodel()
    config.hf_assets_path = tokenizer_dir
    config.dataloader.dataset_path = dataset_dir
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.batch
    config.training.steps = args.steps
    config.dump_folder = os.path.join(args.work, "dump")
    config.checkpoint.enable = True
    config.checkpoint.interval = args.interval
    config.checkpoint.async_mode = args.async_mode
    config.validator.enable = False
    if args.pp > 1:  # one microbatch per sample: batch / 1 microbatches a step
        config.parallelism.pipeline_parallel_degree = args.pp
        config.parallelism.pipeline_parallel_schedule = args.pp_schedule
        config.parallelism.pipeline_parallel_microbatch_size = 1
        config.training.disable_cuda_graphs = True  # torchtitan 0.3.0 refuses CUDA graphs with PP

    hooks = steptrace.adapters.torchtitan.install(run_dir=args.run_dir, run_id=args.run_id)
    trainer = config.build()
    logged: dict[str, dict] = {}
    metric_logger = trainer.metrics_processor.logger
    log = metric_logger.log

    def keep(metrics: dict, step: int) -> None:  # what torchtitan logs, as it logs it
        logged[str(step)] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        return log(metrics, step)

    metric_logger.log = keep
    try:
        trainer.train()
        trainer.checkpointer.maybe_wait_for_saving()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    steptrace.shutdown()
    os.makedirs(args.out, exist_ok=True)
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.out, "torchtitan.json" if rank == 0 else f"torchtitan-rank{rank}.json"), "w") as f:
        json.dump({"metrics": logged, "num_flops_per_token": trainer.metrics_processor.num_flops_per_token,
                   "non_data_parallel_size": trainer.parallel_dims.non_data_parallel_size,
                   "hooks": hooks, "shims": shims}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
