"""The one hook mechanism every framework adapter uses (steptrace.adapters._hooks)."""

import types
import warnings

import pytest

import steptrace
from steptrace import SteptraceWarning
from steptrace.adapters._hooks import Hooks, installed_version, start_steptrace, start_steptrace_for_trainer


def _framework():
    module = types.ModuleType("fakeframework")

    def train_step(state, batch, *, rng=None):
        return state + batch

    class Saver:
        def save(self, step, state):
            return ("saved", step)

    module.train_step, module.Saver = train_step, Saver
    user = types.ModuleType("user_code")
    user.train_step = train_step  # `from fakeframework import train_step`
    return module, user


def _counting(calls):
    def make(original):
        def hooked(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)
        return hooked
    return make


def test_patch_rebinds_importers_and_uninstall_restores_everything():
    module, user = _framework()
    originals = (module.train_step, module.Saver.save)
    calls = []
    hooks = Hooks("Fake", lambda: "fake 1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hooks.patch("train_step", module, "train_step", _counting(calls), requires=("batch",),
                           rebind_in=(user,))
        assert hooks.patch("Saver.save", module, "Saver.save", _counting(calls), exact=("self", "step", "state"))
    assert user.train_step(1, 2) == 3 and module.Saver().save(5, None) == ("saved", 5)
    assert calls == ["train_step", "save"]
    assert module.train_step.__name__ == "train_step" and module.train_step.__steptrace_original__ is originals[0]
    assert hooks.patch("train_step", module, "train_step", _counting(calls))  # idempotent
    assert hooks.installed() == ["train_step", "Saver.save"]
    hooks.uninstall()
    assert (module.train_step, module.Saver.save, user.train_step) == (originals[0], originals[1], originals[0])
    assert hooks.installed() == []


def test_a_changed_signature_turns_the_hook_off_with_one_warning_naming_the_version():
    module, _ = _framework()
    hooks = Hooks("Fake", lambda: "fake 2.0")
    with pytest.warns(SteptraceWarning) as caught:
        assert not hooks.patch("train_step", module, "train_step", _counting([]), requires=("batch", "mesh"))
        assert not hooks.patch("Saver.save", module, "Saver.save", _counting([]), exact=("self", "step"))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "mesh" in messages[0] and "fake 2.0" in messages[0] and "train_step" in messages[0]
    assert "Saver.save" in messages[1]
    assert module.train_step(1, 1) == 2  # training unaffected


def test_missing_targets_warn_unless_they_are_optional():
    hooks = Hooks("Fake", lambda: "fake 1.0")
    with pytest.warns(SteptraceWarning, match="not found"):
        assert not hooks.patch("gone", "fakeframework_that_does_not_exist", "f", _counting([]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hooks.patch("optional", "fakeframework_that_does_not_exist", "f", _counting([]), missing_ok=True)


def test_install_contract_starts_steptrace_once(tmp_path):
    start_steptrace({"jsonl": False, "run_id": "hooks"})
    assert steptrace.enabled() and steptrace.config().run_id == "hooks"
    start_steptrace({})  # already running, no settings: the run goes on
    assert steptrace.config().run_id == "hooks"
    steptrace.shutdown()


def test_a_trainer_callback_fills_in_the_trainers_rank_unless_told(monkeypatch):
    for name in ("STEPTRACE_RANK", "RANK", "STEPTRACE_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert start_steptrace_for_trainer({"jsonl": False, "run_id": "cb"}, rank=2, world_size=4)
    assert (steptrace.config().rank, steptrace.config().world_size) == (2, 4)
    # Running already and no settings: the callback leaves the run alone (and will not stop it).
    assert not start_steptrace_for_trainer({}, rank=3, world_size=4)
    assert steptrace.config().rank == 2
    steptrace.shutdown()
    # The launcher's RANK wins over the trainer's idea of it.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert start_steptrace_for_trainer({"jsonl": False, "run_id": "cb"}, rank=3, world_size=4)
    assert steptrace.config().rank == 1
    steptrace.shutdown()


def test_installed_version_reads_package_metadata_and_is_none_when_absent():
    assert installed_version("pytest") == pytest.__version__
    assert installed_version("no-such-distribution-steptrace") is None
