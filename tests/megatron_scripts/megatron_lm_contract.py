"""Check the Megatron hooks' contracts against Megatron-LM's real source, on CPU.

Run by tests/test_megatron.py in a subprocess with the Megatron-LM checkout first on
PYTHONPATH (its ``megatron.core`` replaces the installed wheel's). Prints one JSON object:
``{"skip": reason}`` when the source does not import here (say, a missing dependency such as
triton), else what was checked. Exit status 0 unless a check fails.

The one shim: Megatron-LM main uses ``typing.override`` (Python 3.12); on 3.11 it is given the
identity decorator it is at runtime.
"""

import inspect
import json
import sys
import typing
import warnings

if not hasattr(typing, "override"):
    typing.override = lambda f: f

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.package_info as package_info
        import megatron.training.async_utils as async_utils
        import megatron.training.checkpointing as checkpointing
        import megatron.training.training as training
        from megatron.core.dist_checkpointing.strategies.async_utils import (
            AsyncCallsQueue,
        )
        from megatron.core.pipeline_parallel import schedules
except Exception as exc:  # the checkout is there but cannot run here
    print(json.dumps({"skip": f"Megatron-LM does not import here: {type(exc).__name__}: {exc}"}))
    sys.exit(0)

import steptrace.adapters.megatron as hooks  # noqa: E402

import steptrace  # noqa: E402
from steptrace import SteptraceWarning  # noqa: E402

result = {"version": package_info.__version__, "checked": []}


def check(what, ok):
    if not ok:
        print(json.dumps({**result, "failed": what}))
        sys.exit(1)
    result["checked"].append(what)


steptrace.init(jsonl=False)
with warnings.catch_warnings():
    warnings.simplefilter("error", SteptraceWarning)  # every hook matches: no warning
    names = hooks.install()
expected = {f"{schedules.__name__}.{n}" for n in ("forward_step", "backward_step", "get_forward_backward_func")}
expected |= {"megatron.training.training.train_step", "megatron.training.training.save_checkpoint_and_time",
             "megatron.training.async_utils.maybe_finalize_async_save",
             "megatron.training.checkpointing.load_checkpoint"}
check("all seven hooks install without a warning", expected <= set(names))
result["hooked"] = sorted(names)
check("training's get_forward_backward_func (imported by name) is rebound to the hook",
      getattr(training.get_forward_backward_func, "__steptrace_hook__", False))
check("training's maybe_finalize_async_save (imported by name) is rebound to the hook",
      getattr(training.maybe_finalize_async_save, "__steptrace_hook__", False))
version = hooks._megatron_version()
check("warnings name the imported megatron-core's version", f"megatron-core {package_info.__version__}" in version)

train_src = inspect.getsource(training.train)
check("train() passes iteration=iteration to train_step", "iteration=iteration" in train_src)
check("train() sets args.curr_iteration before train_step",
      "args.curr_iteration = iteration" in train_src
      and train_src.index("args.curr_iteration = iteration") < train_src.index("= train_step("))
check("train() increments iteration after train_step (logs and saves iteration + 1)",
      train_src.index("= train_step(") < train_src.index("iteration += 1", train_src.index("= train_step(")))
check("train() counts FLOPs with num_floating_point_operations(args, batch_size, ...)",
      "num_floating_point_operations(\n            args,\n            batch_size" in train_src
      or "num_floating_point_operations(args, batch_size" in train_src)
params = list(inspect.signature(training.num_floating_point_operations).parameters)
check("num_floating_point_operations(args, batch_size, ...)", params[:2] == ["args", "batch_size"])
check("the FLOPs hook uses it", hooks._throughput.flops_fn is training.num_floating_point_operations)
check("train_step takes iteration", "iteration" in inspect.signature(training.train_step.__wrapped__).parameters)
fb_src = inspect.getsource(training.train_step.__wrapped__)
check("train_step runs the schedule with num_microbatches, seq_length, micro_batch_size",
      all(f"{k}=" in fb_src for k in ("num_microbatches", "seq_length", "micro_batch_size")))

finalize_src = inspect.getsource(async_utils.maybe_finalize_async_save.__wrapped__)
check("maybe_finalize_async_save finalizes through _async_calls_queue.maybe_finalize_async_calls before close()",
      "maybe_finalize_async_calls(" in finalize_src and ".close()" in finalize_src
      and finalize_src.index("maybe_finalize_async_calls(") < finalize_src.index(".close()"))
check("async_utils keeps the queue in _async_calls_queue", hasattr(async_utils, "_async_calls_queue"))
queue = AsyncCallsQueue()
check("AsyncCallsQueue counts unfinalized calls", queue.get_num_unfinalized_calls() == 0)
undo = hooks._timed_finalize(queue)
check("an AsyncCallsQueue's maybe_finalize_async_calls can be timed per call", undo is not None)
check("...and called through the timing", queue.maybe_finalize_async_calls(False, no_dist=True) == [])
undo()
check("...and undone", "maybe_finalize_async_calls" not in vars(queue))

check("training's load_checkpoint (imported by name) is rebound to the hook",
      getattr(training.load_checkpoint, "__steptrace_hook__", False))
setup_src = inspect.getsource(training.setup_model_and_optimizer)
check("setup_model_and_optimizer sets args.iteration from load_checkpoint(model, optimizer, ...)",
      "args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(" in setup_src)
load_src = inspect.getsource(checkpointing.load_checkpoint.__wrapped__)
check("load_checkpoint returns (0, 0) when no checkpoint was loaded", "return 0, 0" in load_src)
check("load_checkpoint returns (iteration, num_floating_point_operations_so_far)",
      "return iteration, num_floating_point_operations_so_far" in load_src)

fwd_src = inspect.getsource(schedules.forward_step.__wrapped__)
check("forward_step returns (output, num_tokens)", "return output_tensor, num_tokens" in fwd_src
      or "return [output_tensor], num_tokens" in fwd_src)
# Megatron's own OpenTelemetry export (adapters/megatron_otel.py), where this Megatron-LM has it.
if hasattr(training, "_otel_managed_span"):
    check("training._otel_managed_span is hooked (the per-step spans join steptrace's step traces)",
          getattr(training._otel_managed_span, "__steptrace_hook__", False))
    train_src = inspect.getsource(training.train)
    opened = [train_src.find(f"'{name}'") for name in ("megatron.train.first_iteration", "megatron.train.iteration")]
    check("train() opens megatron.train.first_iteration and megatron.train.iteration with _otel_managed_span, "
          "megatron.iteration=iteration, before train_step(..., iteration=iteration)",
          min(opened) >= 0 and "_otel_managed_span(" in train_src
          and "'megatron.iteration': iteration" in train_src[opened[1]:train_src.index("= train_step(", opened[1])])
    check("training imports get_telemetry (the export handle)", callable(getattr(training, "get_telemetry", None)))
hooks.uninstall()
steptrace.shutdown()
print(json.dumps(result))
