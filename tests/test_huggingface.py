"""Hugging Face callback: a real ``transformers.Trainer`` on CPU, recorded by ``steptrace.adapters.huggingface``.

The model is a randomly initialised one-layer GPT-2 built here (nothing is downloaded). The run:
16 sequences of 8 tokens in micro-batches of 2, ``gradient_accumulation_steps=2`` (4 optimizer
steps), evaluation and a checkpoint every 2 optimizer steps, tokens counted by the Trainer.
"""

import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import steptrace  # noqa: E402
from steptrace import SteptraceWarning  # noqa: E402
from steptrace.testing import MemorySink  # noqa: E402

torch = pytest.importorskip("torch", reason="the Hugging Face tests need torch: pip install 'steptrace[torch]'")
transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need transformers: pip install 'steptrace[huggingface]'")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate: pip install 'steptrace[huggingface]'")

from steptrace.adapters import huggingface as hf_adapter  # noqa: E402

pytestmark = pytest.mark.integration  # real transformers Trainer

MICRO_BATCH = 2
ACCUMULATE = 2
SEQ = 8
SAMPLES = 16
OPTIMIZER_STEPS = SAMPLES // MICRO_BATCH // ACCUMULATE  # 4


@pytest.fixture(autouse=True)
def _hooks_removed():
    yield
    hf_adapter.uninstall()


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, callbacks, report_to="none"):
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=SEQ)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, seed=0, report_to=report_to, disable_tqdm=True,
        per_device_train_batch_size=MICRO_BATCH, per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE, max_steps=OPTIMIZER_STEPS, learning_rate=1e-2,
        logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        include_num_input_tokens_seen="all", dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(SAMPLES, 1),
                                   eval_dataset=Sequences(4, 2), callbacks=callbacks)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def test_training_records_one_step_per_optimizer_step_with_eval_data_and_checkpoints(tmp_path):
    sink = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteptraceWarning)  # a matching transformers warns nothing
        trainer, losses = _train(tmp_path, [hf_adapter.StepTrace(sinks=[sink], jsonl=False, run_id="hf",
                                                                 strict=True)])

    assert not steptrace.enabled() and sink.shut_down  # the callback started it, so it shut it down
    assert set(hf_adapter.installed()) == {name for name, *_ in hf_adapter._HOOKS}
    steps = sink.steps()
    assert [s["step"] for s in steps] == list(range(OPTIMIZER_STEPS)) and len(losses) == OPTIMIZER_STEPS
    for s in steps:
        assert s["status"] == "ok" and s["backend"] == "host"
        assert s["samples"] == MICRO_BATCH * ACCUMULATE and s["tokens"] == MICRO_BATCH * ACCUMULATE * SEQ
        assert s["compute_seconds"] > 0
    assert trainer.state.num_input_tokens_seen == OPTIMIZER_STEPS * MICRO_BATCH * ACCUMULATE * SEQ
    spans = sink.spans()
    # All of a step's micro-batches are fetched before on_step_begin: one data span per step, between steps.
    data = [sp for sp in spans if sp["name"] == "data"]
    assert len(data) == OPTIMIZER_STEPS and all(sp["step"] is None for sp in data)
    for s in steps[1:]:
        assert s["idle_breakdown"].get("data", 0) > 0, s["idle_breakdown"]
    # Evaluation and a save after global steps 2 and 4, i.e. after steptrace steps 1 and 3.
    evals = [sp for sp in spans if sp["name"] == "eval"]
    assert len(evals) == 2 and all(sp["step"] is None for sp in evals)
    ckpts = sink.checkpoints()
    assert [c["step"] for c in ckpts] == [1, 3]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    for c in ckpts:
        assert c["status"] == "ok" and c["blocking_seconds"] is not None and c["blocking_seconds"] > 0
        assert c["blocking_seconds"] <= c["host_seconds"] + 1e-9
    assert steps[2]["idle_breakdown"].get("eval", 0) > 0 and steps[2]["idle_breakdown"].get("checkpoint", 0) > 0
    # The checkpoint table and the step table agree: a save follows the step it names, and its blocking
    # time is the next step's `checkpoint` idle time.
    for c in ckpts:
        assert c["after_step"] == c["step"]
        if c["step"] + 1 < len(steps):
            assert steps[c["step"] + 1]["idle_breakdown"]["checkpoint"] == pytest.approx(c["blocking_seconds"],
                                                                                         abs=1e-6)


def test_losses_and_weights_are_identical_with_and_without_the_callback(tmp_path):
    plain, plain_losses = _train(tmp_path / "plain", [])
    traced, traced_losses = _train(tmp_path / "traced", [hf_adapter.StepTrace(sinks=[MemorySink()], jsonl=False)])
    assert traced_losses == plain_losses
    for a, b in zip(plain.model.parameters(), traced.model.parameters()):
        assert torch.equal(a, b)


def test_a_changed_save_checkpoint_signature_turns_checkpoints_off_with_one_warning(tmp_path, monkeypatch):
    original = transformers.Trainer._save_checkpoint

    def _save_checkpoint(self, model, run):  # `trial` renamed
        return original(self, model, run)

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", _save_checkpoint)
    sink = MemorySink()
    with pytest.warns(SteptraceWarning) as caught:
        trainer, _ = _train(tmp_path, [hf_adapter.StepTrace(sinks=[sink], jsonl=False)])
    messages = [str(w.message) for w in caught if issubclass(w.category, SteptraceWarning)]
    assert len(messages) == 1
    assert "_save_checkpoint" in messages[0] and "trial" in messages[0]
    assert hf_adapter.transformers_version() in messages[0]
    # Training and the other hooks go on; only the checkpoint records are missing.
    assert trainer.state.global_step == OPTIMIZER_STEPS and len(list((tmp_path / "out").iterdir())) == 2
    assert len(sink.steps()) == OPTIMIZER_STEPS and sink.checkpoints() == []
    assert len([sp for sp in sink.spans() if sp["name"] == "data"]) == OPTIMIZER_STEPS


def test_a_resumed_training_times_the_restore(tmp_path):
    """train(resume_from_checkpoint=...): the Trainer loads the model, optimizer, scheduler and RNG
    states before on_train_begin; the callback starts steptrace there instead, and the loads are a
    `restore` span before the first step (charged to `restore` in the job's accounting)."""
    _train(tmp_path, [])
    sink = MemorySink()
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64,
                                                                 n_positions=SEQ))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATE,
        max_steps=OPTIMIZER_STEPS, learning_rate=1e-2, save_strategy="no", dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(SAMPLES, 1),
                                   callbacks=[hf_adapter.StepTrace(sinks=[sink], jsonl=False, run_id="hf-resume",
                                                                   strict=True)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteptraceWarning)
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert not steptrace.enabled() and sink.shut_down  # started by the callback (early), shut down by it
    restores = [sp for sp in sink.spans() if sp["name"] == "restore"]
    assert len(restores) >= 2 and all(sp["step"] is None for sp in restores)
    steps = sink.steps()
    assert len(steps) == OPTIMIZER_STEPS - 2  # resumed after global step 2
    assert steps[0]["before_step_breakdown"]["restore"] == pytest.approx(sum(sp["seconds"] for sp in restores),
                                                                         abs=1e-6)


def test_with_the_trainer_reporting_to_mlflow_steptrace_writes_into_the_same_run(tmp_path, monkeypatch):
    """The one line of docs/trackers.md: ``StepTrace(trackers="mlflow")`` beside ``report_to="mlflow"``.
    The Trainer's MLflowCallback starts its run at train begin, before this callback (user callbacks come
    after the reporting ones) starts steptrace: steptrace's keys go into that run, at the optimizer step."""
    mlflow = pytest.importorskip("mlflow", reason="needs mlflow: pip install 'steptrace[mlflow]'")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    trainer, _ = _train(tmp_path, [hf_adapter.StepTrace(trackers="mlflow", run_dir=str(tmp_path / "runs"),
                                                        run_id="hf-mlflow")], report_to="mlflow")
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs(experiment_ids=["0"])  # one run, not a second one for steptrace
    assert "loss" in run.data.metrics and "steptrace/interval_seconds" in run.data.metrics
    history = client.get_metric_history(run.info.run_id, "steptrace/interval_seconds")
    assert sorted(m.step for m in history) == list(range(1, OPTIMIZER_STEPS + 1))
    # The Trainer logs its loss at global_step: the same axis.
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} <= {m.step for m in history}
