"""Accelerate hooks: a real ``accelerate.Accelerator`` loop on CPU, recorded by ``steptrace.adapters.accelerate``.

The model is a small linear layer whose forward sleeps FORWARD_S (a stand-in for device work on a
synchronous backend); each sample's fetch sleeps FETCH_S, so a batch of BATCH samples waits
BATCH × FETCH_S in the data loader. What the tests rely on, from accelerate 1.15.0's source:
``Accelerator.accumulate`` calls ``_do_sync`` on entry, which sets ``sync_gradients`` true on every
k-th call (``gradient_accumulation_steps=k``) and on the data loader's last batch;
``AcceleratedOptimizer.step`` steps the wrapped optimizer only when ``sync_gradients`` is true
(``optimizer.py``); ``DataLoaderShard.__iter__`` fetches one batch ahead (``data_loader.py``).
"""

import sys
import time
import warnings

import pytest

import steptrace
from steptrace import SteptraceWarning
from steptrace.testing import MemorySink

torch = pytest.importorskip("torch", reason="the Accelerate tests need torch: pip install 'steptrace[torch]'")
accelerate = pytest.importorskip("accelerate", reason="the Accelerate tests need accelerate: "
                                 "pip install 'steptrace[accelerate]'")

from steptrace.adapters import accelerate as acc_hooks  # noqa: E402

pytestmark = pytest.mark.integration  # real accelerate

FORWARD_S = 0.02
FETCH_S = 0.01
BATCH = 2
SAMPLES = 16


@pytest.fixture(autouse=True)
def _clean():
    yield
    acc_hooks.uninstall()
    steptrace.shutdown()
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


class SlowSamples(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(FETCH_S)
        return self.x[i]


class SlowLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        time.sleep(FORWARD_S)
        return self.linear(x)


def _parts(accumulate: int):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = SlowLinear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(SlowSamples(SAMPLES), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def _train_accumulating(accumulate: int = 2):
    accelerator, model, optimizer, loader = _parts(accumulate)
    for x in loader:
        with accelerator.accumulate(model):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return accelerator, model, optimizer, loader


def _start(sink: MemorySink, run_id: str) -> list[str]:
    return acc_hooks.install(sinks=[sink], jsonl=False, run_id=run_id, backend="host", strict=True)


def test_accumulation_gives_one_step_per_optimizer_update_with_its_micro_batches_and_data_waits():
    sink = MemorySink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteptraceWarning)
        names = _start(sink, "acc")
        assert len(names) == 7, names
        _, hooked_model, _, _ = _train_accumulating(2)
        steptrace.shutdown()
    steps = sink.steps()
    updates = SAMPLES // BATCH // 2
    assert [s["step"] for s in steps] == list(range(updates))
    for s in steps:
        assert s["status"] == "ok" and s["attrs"]["micro_batches"] == 2
        # Two forwards in the step, their sleeps compute; the fetch between them is data, not compute.
        assert s["compute_seconds"] >= 2 * FORWARD_S
        assert s["compute_seconds"] < s["interval_seconds"]
    fetch = BATCH * FETCH_S
    for s in steps[1:-1]:
        # A step waits for two fetches: one before it (between updates), one between its micro-batches.
        # (Step 0 holds the loader's read-ahead too; the last step's second batch was read ahead.)
        assert 0.9 * 2 * fetch <= s["idle_breakdown"]["data"] < 2 * 2 * fetch, s["idle_breakdown"]
    assert 0.9 * fetch <= steps[-1]["idle_breakdown"]["data"] < 2 * fetch, steps[-1]["idle_breakdown"]
    data = [sp for sp in sink.spans() if sp["name"] == "data"]
    assert len(data) == SAMPLES // BATCH + 1  # one fetch per batch, and the last next() that ends the loop

    # The same loop without the hooks trains the same weights.
    acc_hooks.uninstall()
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    _, plain_model, _, _ = _train_accumulating(2)
    for (name, a), (_, b) in zip(hooked_model.named_parameters(), plain_model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_loop_without_accumulate_has_a_step_per_optimizer_step_from_the_forward_on_and_eval_opens_none():
    sink = MemorySink()
    _start(sink, "plain")
    accelerator, model, optimizer, loader = _parts(1)
    for x in loader:
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 4))  # an eval forward: no step
    model.train()
    with torch.no_grad():
        model(torch.zeros(1, 4))  # no gradients: no step either
    steptrace.shutdown()
    steps = sink.steps()
    assert [s["step"] for s in steps] == list(range(SAMPLES // BATCH))
    for s in steps:
        assert s["compute_seconds"] >= FORWARD_S and s["attrs"]["micro_batches"] == 1


def test_an_optimizer_step_after_the_accumulate_block_closes_the_step_itself():
    """``optimizer.step()`` called after ``with accelerator.accumulate(model):`` (not inside it): the
    block's exit sees no update yet, so the step stays open until the update, which closes it."""
    sink = MemorySink()
    _start(sink, "after")
    accelerator, model, optimizer, loader = _parts(2)
    updates = 0
    for x in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
        if accelerator.sync_gradients:
            assert steptrace.current_step() is not None  # still open: the update is part of the step
            optimizer.step()
            updates += 1
            assert steptrace.current_step() is None
            optimizer.zero_grad()
    steptrace.shutdown()
    steps = sink.steps()
    assert updates == SAMPLES // BATCH // 2 and [s["step"] for s in steps] == list(range(updates))
    assert all(s["attrs"]["micro_batches"] == 2 and s["compute_seconds"] >= 2 * FORWARD_S for s in steps)


def test_save_state_is_a_checkpoint_of_the_last_step_and_load_state_a_restore_before_the_first_step_after(
        tmp_path):
    sink = MemorySink()
    _start(sink, "ckpt")
    accelerator, model, optimizer, loader = _train_accumulating(2)
    accelerator.save_state(str(tmp_path / "state"))
    (ckpt,) = sink.checkpoints() if steptrace.flush() else []
    last = SAMPLES // BATCH // 2 - 1
    assert ckpt["step"] == last and ckpt["after_step"] == last and ckpt["blocking_seconds"] > 0

    # Resume: a new Accelerator loads the state, then trains one more update.
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    accelerator2, model2, optimizer2, loader2 = _parts(2)
    accelerator2.load_state(str(tmp_path / "state"))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)  # the restore really restored
    batches = iter(loader2)
    for _ in range(2):
        x = next(batches)
        with accelerator2.accumulate(model2):
            accelerator2.backward(model2(x).pow(2).mean())
            optimizer2.step()
            optimizer2.zero_grad()
    steptrace.shutdown()
    restores = [sp for sp in sink.spans() if sp["name"] == "restore"]
    assert len(restores) == 1 and restores[0]["seconds"] > 0 and "restored_step" not in restores[0].get("attrs", {})
    steps = sink.steps()
    assert [s["step"] for s in steps] == list(range(last + 2))
    assert steps[-1].get("first_after_restore") is True
    assert not any(s.get("first_after_restore") for s in steps[:-1])


def test_inside_the_users_own_step_the_hooks_open_none_but_still_time_data():
    sink = MemorySink()
    _start(sink, "own")
    accelerator, model, optimizer, loader = _parts(2)
    for n, x in enumerate(loader):
        with steptrace.step(100 + n):
            with accelerator.accumulate(model):
                accelerator.backward(model(x).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
    steptrace.shutdown()
    assert [s["step"] for s in sink.steps()] == [100 + n for n in range(SAMPLES // BATCH)]
    assert len([sp for sp in sink.spans() if sp["name"] == "data"]) == SAMPLES // BATCH + 1


def test_a_method_whose_signature_changed_disables_its_hook_with_one_warning(monkeypatch):
    def accumulate(self, *models, sync=True):
        raise AssertionError("not called")

    monkeypatch.setattr(accelerate.Accelerator, "accumulate", accumulate)
    with pytest.warns(SteptraceWarning, match=r"Accelerate hook accelerate.Accelerator.accumulate disabled .*"
                                              r"accelerate 1\.") as caught:
        names = _start(MemorySink(), "sig")
    assert len([w for w in caught if issubclass(w.category, SteptraceWarning)]) == 1
    assert "accelerate.Accelerator.accumulate" not in names and len(names) == 6
    assert accelerate.Accelerator.accumulate is accumulate


def test_install_without_accelerate_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ImportError, match=r"pip install 'steptrace\[accelerate\]'"):
        acc_hooks.install()
