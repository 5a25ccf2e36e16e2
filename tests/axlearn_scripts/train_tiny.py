"""A tiny real AXLearn SpmdTrainer on CPU: a two-layer MLP regression on synthetic batches.

    python train_tiny.py OUT_DIR [--hooked] [--max-step N]

Checkpoints every CHECKPOINT_EVERY steps (tensorstore, asynchronous commit), evaluates every
EVAL_EVERY steps, and traces steps with the JAX profiler from PROFILE_AFTER (AXLearn traces the
three steps after it). With --hooked, steptrace.adapters.axlearn.install() runs before the trainer
is built. Prints one JSON line: the losses by step AXLearn logged, and the last step's loss.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

# What AXLearn's launcher sets up (axlearn/common/utils_spmd.py, setup()): the trainer's state spec
# has a 4-word rbg key, so a checkpoint saved with the default 2-word key does not restore.
jax.config.update("jax_default_prng_impl", "rbg")

BATCH, DIM, HIDDEN = 256, 512, 2048
CHECKPOINT_EVERY = 2
EVAL_EVERY = 3
PROFILE_AFTER = 1


def build(out_dir: str, max_step: int):
    from axlearn.common import layers, learner, optimizers
    from axlearn.common.base_model import BaseModel
    from axlearn.common.checkpointer import every_n_steps_policy as ckpt_every_n
    from axlearn.common.config import REQUIRED, Required, config_class, config_for_function
    from axlearn.common.evaler import SpmdEvaler
    from axlearn.common.evaler import every_n_steps_policy as eval_every_n
    from axlearn.common.module import Module
    from axlearn.common.trainer import SpmdTrainer

    try:  # current AXLearn: inputs are input_base.Input (the trainer reads its partition_spec)
        from axlearn.common.input_base import Input as InputBase
    except ImportError:  # the PyPI releases: any Module that iterates batches
        InputBase = Module

    class SyntheticInput(InputBase):
        @config_class
        class Config(InputBase.Config):
            is_training: Required[bool] = REQUIRED
            num_batches: int = 1000
            seed: int = 0

        def dataset(self):
            cfg = self.config
            rng = np.random.default_rng(cfg.seed)
            target = np.random.default_rng(123).standard_normal((DIM,)).astype(np.float32)
            for _ in range(cfg.num_batches):
                x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
                yield {"x": x, "y": np.tanh(x @ target / np.sqrt(DIM)).astype(np.float32)}

        def __iter__(self):
            yield from self.dataset()

    class TinyModel(BaseModel):
        def __init__(self, cfg, *, parent):
            super().__init__(cfg, parent=parent)
            self._add_child("fc1", layers.Linear.default_config().set(input_dim=DIM, output_dim=HIDDEN))
            self._add_child("fc2", layers.Linear.default_config().set(input_dim=HIDDEN, output_dim=1))

        def forward(self, input_batch):  # pylint: disable=arguments-differ
            hidden = jax.nn.relu(self.fc1(input_batch["x"]))
            pred = self.fc2(hidden)[:, 0]
            loss = jnp.mean((pred - input_batch["y"]) ** 2)
            return loss, {}

    cfg = SpmdTrainer.default_config().set(name="tiny", dir=out_dir, max_step=max_step)
    cfg.mesh_axis_names = ("data", "model")
    cfg.mesh_shape = (1, 1)
    cfg.model = TinyModel.default_config().set(dtype=jnp.float32)
    cfg.input = SyntheticInput.default_config()
    cfg.learner = learner.Learner.default_config().set(
        optimizer=config_for_function(optimizers.sgd_optimizer).set(
            learning_rate=0.01, decouple_weight_decay=True, weight_decay=0.0))
    cfg.checkpointer.save_policy = config_for_function(ckpt_every_n).set(n=CHECKPOINT_EVERY)
    cfg.evalers = dict(tiny_eval=SpmdEvaler.default_config().set(
        input=SyntheticInput.default_config().set(num_batches=2, seed=1),
        eval_policy=config_for_function(eval_every_n).set(n=EVAL_EVERY)))
    cfg.start_trace_steps = [PROFILE_AFTER]
    return cfg


def main(argv):
    out_dir = argv[1]
    hooked = "--hooked" in argv
    max_step = int(argv[argv.index("--max-step") + 1]) if "--max-step" in argv else 6
    logging.set_verbosity(logging.INFO)
    if hooked:
        from steptrace.adapters import axlearn as adapter

        print("installed:", json.dumps(adapter.install()), flush=True)
    cfg = build(out_dir, max_step)
    trainer = cfg.instantiate(parent=None)
    output = trainer.run(prng_key=jax.random.PRNGKey(7))
    if hooked:
        import steptrace

        steptrace.shutdown()
    print("RESULT " + json.dumps({"last_step": int(trainer.step), "last_loss": float(output["loss"])}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv)
