"""DeepSpeed's decoupled checkpoint engine, for real, on CPU (1 process under torch.distributed.run, gloo).

Launched by tests/test_deepspeed.py. The config turns the engine on as DeepSpeed documents it
(``runtime/model_checkpointing/constants.py``, CHECKPOINT_FORMAT): ``"checkpoint": {"writer":
{"type": "python", "decoupled": true, "data_parallel": "replica"}}``; ``create_checkpoint_engine``
(``runtime/checkpoint_engine/utils.py``) then builds a ``DecoupledCheckpointEngine``, which starts a
writer subprocess (``torch.multiprocessing``, start method ``spawn``: hence this file's ``__main__``
guard; the child imports it). What this relies on, DeepSpeed 0.19.8:

- ``save_checkpoint`` (``runtime/engine.py``) calls ``checkpoint_engine.create(info)`` and, per file,
  ``checkpoint_engine.save(state_dict, path)``, which puts ``(state_dict, path)`` on the writer's
  queue and returns; with a decoupled engine it does not commit.
- ``step()`` on the gradient accumulation boundary calls ``_commit_decoupled_checkpoint`` before the
  update, which calls ``checkpoint_engine.commit(info)``: it queues a COMMIT_EVENT and waits for the
  writer's ``save_event``, set once every save queued before it was written (one FIFO queue).
- ``commit`` raises ``RuntimeError("... Cannot commit checkpoint: checkpoint process is not
  running.")`` when the writer is dead, and ``save`` then queues nothing (it returns when the writer
  is not alive): the save is lost without an error at save time.
- ``engine.destroy()`` calls ``checkpoint_engine.cleanup()``, which commits a pending save.

The writer is slowed by WRITE_S, deterministically and only in the writer: the client state holds an
object whose unpickling (in the writer process, when it takes the save off its queue) sleeps.

Sequence (gradient accumulation 2): steps 0, 1; saves "a" and "a2" (two saves before a commit);
steps 2, 3 (step 2's boundary commits both at once); save "b"; ``destroy()`` (commits "b", outside
any step); a new engine loads "b" and runs step 4; save "c"; the writer is killed; step 5 (its commit
raises: "c" is an error); save "d" (DeepSpeed queues nothing: the writer is dead);
``steptrace.shutdown()`` ("d" never committed). Writes
``<out>/decoupled.json``: each commit's own timing (measured around ``checkpoint_engine.commit`` on
the instance, outside steptrace's class-level hook), each tag's files and their mtimes, the errors seen.
"""

import argparse
import json
import os
import time


def _slow_restore(seconds):
    time.sleep(seconds)  # runs in the writer process: it unpickles the save it takes off its queue
    return seconds


class SlowToUnpickle:
    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return _slow_restore, (self.seconds,)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--write-s", type=float, default=1.0)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    import steptrace
    import steptrace.adapters.deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steptrace.adapters.deepspeed.install(run_dir=args.run_dir, run_id="decoupled", rank=rank, world_size=world,
                                         backend="host")
    os.makedirs(args.out, exist_ok=True)
    ckpt_dir = os.path.join(args.out, "ckpt")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": args.zero},
           "zero_allow_untested_optimizer": True,
           "steps_per_print": 10 ** 9,
           "checkpoint": {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}}
    commits = []  # each checkpoint_engine.commit call: the global step it ran in, its start and end
    errors = []

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        checkpoint_engine = engine.checkpoint_engine
        assert type(checkpoint_engine).__name__ == "DecoupledCheckpointEngine", type(checkpoint_engine)
        hooked_commit = checkpoint_engine.commit  # the class's (steptrace's hook), bound

        def commit(info):
            entry = {"tag": info.tag, "global_steps": int(engine.global_steps), "start": time.perf_counter()}
            try:
                return hooked_commit(info)
            finally:
                entry["end"] = time.perf_counter()
                commits.append(entry)

        checkpoint_engine.commit = commit
        return engine

    g = torch.Generator().manual_seed(0)

    def update(engine):
        for _ in range(2):
            x = torch.randn(2, 8, generator=g)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()

    def save(engine, tag):
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"slow": SlowToUnpickle(args.write_s)})

    engine = build()
    update(engine)
    update(engine)
    save(engine, "a")
    save(engine, "a2")  # queued behind "a": one commit (of "a2"'s info) waits for both
    update(engine)  # step 2: its boundary step() commits them
    update(engine)
    save(engine, "b")
    engine.destroy()  # commits "b"

    engine = build()
    engine.load_checkpoint(ckpt_dir, tag="b")
    update(engine)  # step 4: nothing to commit
    save(engine, "c")
    writer = engine.checkpoint_engine.ckpt_process
    writer.kill()
    writer.join()
    try:
        update(engine)  # step 5: its commit finds the writer dead
    except RuntimeError as exc:
        errors.append(str(exc))
    save(engine, "d")  # DeepSpeed queues nothing for a dead writer
    steptrace.shutdown()  # "d" is still uncommitted

    files = {}  # tag -> the files the writer wrote (model states; with ZeRO 1+ also optimizer states)
    for tag in ("a", "a2", "b", "c", "d"):
        folder = os.path.join(ckpt_dir, tag)
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        files[tag] = {name: os.stat(os.path.join(folder, name)).st_mtime for name in names}
    with open(os.path.join(args.out, "decoupled.json"), "w") as f:
        json.dump({"commits": commits, "errors": errors, "files": files, "write_s": args.write_s}, f)
    try:
        engine.destroy()  # its cleanup's commit of "d" fails (the writer is dead); DeepSpeed logs it
    except Exception:
        pass
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
