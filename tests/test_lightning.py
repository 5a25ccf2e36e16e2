"""Lightning callback: a real ``Trainer.fit`` on CPU, recorded by ``steptrace.adapters.lightning.StepTrace``.

The run: 16 samples in micro-batches of 2 (8 per epoch), ``accumulate_grad_batches=2`` (4
optimizer steps), validation every 4 micro-batches (after optimizer steps 1 and 3, plus the
sanity check), and a ``ModelCheckpoint`` saving every 2 optimizer steps.
"""

import warnings

import pytest

import steptrace
from steptrace import SteptraceWarning
from steptrace.testing import MemorySink

torch = pytest.importorskip("torch", reason="the Lightning tests need torch: pip install 'steptrace[torch]'")
pl = pytest.importorskip("lightning.pytorch",
                         reason="the Lightning tests need lightning: pip install 'steptrace[lightning]'")

from steptrace.adapters import lightning as lightning_adapter  # noqa: E402

pytestmark = pytest.mark.integration  # real Lightning training loop

MICRO_BATCH = 2
ACCUMULATE = 2
SAMPLES = 16
OPTIMIZER_STEPS = SAMPLES // MICRO_BATCH // ACCUMULATE  # 4


def _tiny_regression(namespace):
    class TinyRegression(namespace.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return TinyRegression()


def _loader(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO_BATCH)


def _fit(tmp_path, callbacks, namespace=pl):
    namespace.seed_everything(0, verbose=False)
    model = _tiny_regression(namespace)
    checkpoint = namespace.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                     save_top_k=-1)
    trainer = namespace.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=ACCUMULATE,
        val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=1,
        callbacks=[*callbacks, checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, _loader(1), _loader(2))
    return model, trainer


def test_a_fit_records_one_step_per_optimizer_step_with_eval_data_and_checkpoints(tmp_path):
    sink = MemorySink()
    callback = lightning_adapter.StepTrace(tokens_per_sample=8, sinks=[sink], jsonl=False, run_id="pl",
                                           strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteptraceWarning)  # a matching Lightning warns nothing
        model, trainer = _fit(tmp_path, [callback])

    # The callback started steptrace in setup, so it shut it down at on_fit_end.
    assert not steptrace.enabled() and sink.shut_down
    steps = sink.steps()
    assert [s["step"] for s in steps] == list(range(OPTIMIZER_STEPS)) and trainer.global_step == OPTIMIZER_STEPS
    assert len(model.losses) == OPTIMIZER_STEPS * ACCUMULATE  # 2 micro-batches per step record
    for s in steps:
        assert s["status"] == "ok" and s["backend"] == "host"
        assert s["samples"] == MICRO_BATCH * ACCUMULATE and s["tokens"] == MICRO_BATCH * ACCUMULATE * 8
        assert s["compute_seconds"] > 0
    # The fetch of each step's first micro-batch precedes the step: its idle time is `data`.
    for s in steps[1:]:
        assert s["idle_breakdown"].get("data", 0) > 0, s["idle_breakdown"]
    spans = sink.spans()
    data = [sp for sp in spans if sp["name"] == "data"]
    assert len(data) >= SAMPLES // MICRO_BATCH
    # Later micro-batches of a step are fetched inside it.
    assert sorted({sp["step"] for sp in data if sp["step"] is not None}) == list(range(OPTIMIZER_STEPS))
    # Sanity check, then validation after optimizer steps 1 and 3 (every 4 micro-batches).
    evals = [sp for sp in spans if sp["name"] == "eval"]
    assert len(evals) == 3 and all(sp["step"] is None for sp in evals)
    assert steps[2]["idle_breakdown"].get("eval", 0) > 0
    # ModelCheckpoint(every_n_train_steps=2) saves after global steps 2 and 4: steptrace steps 1 and 3.
    ckpts = sink.checkpoints()
    assert [c["step"] for c in ckpts] == [1, 3]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    for c in ckpts:
        assert c["status"] == "ok" and c["blocking_seconds"] is not None and c["blocking_seconds"] > 0
        assert c["blocking_seconds"] <= c["host_seconds"] + 1e-9
    assert steps[2]["idle_breakdown"].get("checkpoint", 0) > 0  # the save after step 1 stalls step 2
    # The checkpoint table and the step table agree: a save follows the step it names, and its blocking
    # time is the next step's `checkpoint` idle time.
    for c in ckpts:
        assert c["after_step"] == c["step"]
        if c["step"] + 1 < len(steps):
            assert steps[c["step"] + 1]["idle_breakdown"]["checkpoint"] == pytest.approx(c["blocking_seconds"],
                                                                                         abs=1e-6)
    # Steptrace's hooks are gone once the fit ended.
    assert lightning_adapter.installed() == [] and "start" not in vars(trainer.profiler)


def test_losses_and_weights_are_identical_with_and_without_the_callback(tmp_path):
    plain, _ = _fit(tmp_path / "plain", [])
    traced, _ = _fit(tmp_path / "traced", [lightning_adapter.StepTrace(sinks=[MemorySink()], jsonl=False)])
    assert traced.losses == plain.losses
    for a, b in zip(plain.parameters(), traced.parameters()):
        assert torch.equal(a, b)


def test_a_changed_save_checkpoint_signature_turns_checkpoints_off_with_one_warning(tmp_path, monkeypatch):
    original = pl.Trainer.save_checkpoint

    def save_checkpoint(self, path, weights_only=None, storage_options=None):  # `filepath` renamed
        return original(self, path, weights_only, storage_options)

    monkeypatch.setattr(pl.Trainer, "save_checkpoint", save_checkpoint)
    sink = MemorySink()
    with pytest.warns(SteptraceWarning) as caught:
        _, trainer = _fit(tmp_path, [lightning_adapter.StepTrace(sinks=[sink], jsonl=False)])
    messages = [str(w.message) for w in caught if issubclass(w.category, SteptraceWarning)]
    assert len(messages) == 1
    assert "save_checkpoint" in messages[0] and "filepath" in messages[0]
    assert lightning_adapter.lightning_version() in messages[0]
    # Training and the rest of the recording go on; only checkpoint records are missing.
    assert trainer.global_step == OPTIMIZER_STEPS and len(list((tmp_path / "ckpt").iterdir())) == 2
    assert len(sink.steps()) == OPTIMIZER_STEPS and sink.checkpoints() == []
    assert any(sp["name"] == "data" for sp in sink.spans())


def test_a_loop_that_never_reports_its_data_fetches_turns_data_spans_off_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(lightning_adapter, "DATA_ACTION", "an_action_this_lightning_never_reports")
    sink = MemorySink()
    with pytest.warns(SteptraceWarning) as caught:
        _fit(tmp_path, [lightning_adapter.StepTrace(sinks=[sink], jsonl=False)])
    messages = [str(w.message) for w in caught if issubclass(w.category, SteptraceWarning)]
    assert len(messages) == 1 and "data spans" in messages[0]
    assert len(sink.steps()) == OPTIMIZER_STEPS and not [sp for sp in sink.spans() if sp["name"] == "data"]


def test_a_running_steptrace_is_used_and_left_running(tmp_path):
    sink = MemorySink()
    steptrace.init(sinks=[sink], jsonl=False, run_id="outer")
    _fit(tmp_path, [lightning_adapter.StepTrace()])
    assert steptrace.enabled() and steptrace.config().run_id == "outer"
    steptrace.shutdown()
    assert len(sink.steps()) == OPTIMIZER_STEPS


def test_the_same_callback_works_with_the_pytorch_lightning_package(tmp_path):
    pytorch_lightning = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    sink = MemorySink()
    _, trainer = _fit(tmp_path, [lightning_adapter.StepTrace(sinks=[sink], jsonl=False)], pytorch_lightning)
    assert isinstance(trainer, pytorch_lightning.Trainer)
    assert [s["step"] for s in sink.steps()] == list(range(OPTIMIZER_STEPS))
    assert [c["step"] for c in sink.checkpoints()] == [1, 3]


def test_bad_tokens_per_sample_fails_at_construction():
    with pytest.raises(ValueError, match="tokens_per_sample"):
        lightning_adapter.StepTrace(tokens_per_sample=0)


def test_a_fit_resumed_from_a_checkpoint_times_the_restore(tmp_path):
    """fit(ckpt_path=...): loading the model, callbacks, optimizer and loops is a `restore` span before
    the first step (the job's accounting charges it to `restore`, docs/goodput.md); the resumed fit's
    steps continue the run's numbering."""
    _fit(tmp_path / "first", [])
    ckpt = tmp_path / "first" / "ckpt" / "epoch=0-step=2.ckpt"
    sink = MemorySink()
    callback = lightning_adapter.StepTrace(sinks=[sink], jsonl=False, run_id="pl-resume", strict=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=ACCUMULATE,
                         limit_val_batches=0, callbacks=[callback], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path / "second",
                         enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.simplefilter("error", SteptraceWarning)
        trainer.fit(_tiny_regression(pl), _loader(1), ckpt_path=ckpt)
    restores = [sp for sp in sink.spans() if sp["name"] == "restore"]
    assert len(restores) == 2 and all(sp["step"] is None for sp in restores)  # modules, then training state
    steps = sink.steps()
    assert steps and steps[0]["before_step_breakdown"]["restore"] == pytest.approx(
        sum(sp["seconds"] for sp in restores), abs=1e-6)
    assert lightning_adapter.installed() == []


def test_with_lightnings_mlflow_logger_steptrace_writes_into_its_run_on_its_step_axis(tmp_path, monkeypatch):
    """docs/trackers.md: ``StepTrace(sinks=[MlflowSink(run_id=logger.run_id)])`` beside ``MLFlowLogger``.
    With gradient accumulation Lightning logs a training-step metric at the optimizer steps taken
    before it (0, 1, 2, 3 here), which is steptrace's ``n = global_step`` at the step's start: no
    offset (the HF Trainer needs 1)."""
    pytest.importorskip("mlflow", reason="needs mlflow: pip install 'steptrace[mlflow]'")
    from mlflow.tracking import MlflowClient

    from steptrace.trackers import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = pl.loggers.MLFlowLogger(experiment_name="pl", tracking_uri=uri)

    class Logged(type(_tiny_regression(pl))):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_step=True)
            return loss

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=ACCUMULATE,
                         limit_val_batches=0, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=False,
                         callbacks=[lightning_adapter.StepTrace(
                             jsonl=False, run_id="pl-mlflow",
                             sinks=[MlflowSink(run_id=logger.run_id, tracking_uri=uri)])])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(Logged(), _loader(1))
    client = MlflowClient(tracking_uri=uri)
    ours = {m.step for m in client.get_metric_history(logger.run_id, "steptrace/interval_seconds")}
    theirs = {m.step for m in client.get_metric_history(logger.run_id, "train_loss")}
    assert ours == set(range(OPTIMIZER_STEPS))
    assert theirs == ours
