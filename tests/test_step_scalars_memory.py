"""Step scalars (s.log) and device memory, read off the training thread after the step ended."""

import warnings

import pytest

import steptrace
from steptrace import SteptraceWarning
from steptrace.testing import SimulatedDevice, capture

from conftest import have


def test_host_numbers_and_numpy_scalars_are_logged_as_they_are(device):
    import numpy as np

    with capture(backend=device) as sink:
        with steptrace.step(0) as s:
            s.log(loss=2.5, lr=3e-4, tokens_seen=1024, grad_norm=np.float32(0.75), acc=np.array([0.5]))
            device.run(0.001)
    (step,) = sink.steps()
    assert step["scalars"] == {"loss": 2.5, "lr": 3e-4, "tokens_seen": 1024.0, "grad_norm": 0.75, "acc": 0.5}


def test_non_scalars_are_misuse_and_the_step_still_records(device):
    import numpy as np

    with capture(backend=device, strict=False) as sink:
        with steptrace.step(0) as s:
            with pytest.warns(SteptraceWarning, match="not a scalar"):
                s.log(loss=1.0, logits=np.zeros(3), flag=True, name="x")
    (step,) = sink.steps()
    assert step["scalars"] == {"loss": 1.0}
    with capture(backend=device, strict=False):
        with steptrace.step(0) as s, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.log(bad=[1, 2])
        assert steptrace.stats()["dropped"]["misuse"] == 1


def test_log_outside_a_step_is_misuse(device):
    with capture(backend=device, strict=False) as sink:
        with steptrace.step(0) as s:
            pass
        with pytest.warns(SteptraceWarning, match="outside its step"):
            s.log(loss=1.0)
    assert "scalars" not in sink.steps()[0]


def test_steps_without_scalars_or_memory_have_no_such_fields(device):
    with capture(backend=device) as sink:
        with steptrace.step(0):
            device.run(0.001)
    (step,) = sink.steps()
    assert "scalars" not in step and "device_memory" not in step  # absent, not zero


def test_device_memory_per_step_with_peak_since_the_previous_step():
    device = SimulatedDevice(memory_limit_bytes=1000)
    with capture(backend=device) as sink:
        for n, (peak, after) in enumerate([(600, 100), (300, 200)]):
            with steptrace.step(n):
                device.memory_in_use_bytes = peak
                device.run(0.001)
                device.memory_in_use_bytes = after
            steptrace.flush()  # memory is read when the resolver finalizes the step, shortly after its end
    steps = {r["step"]: r for r in sink.steps()}
    assert steps[0]["device_memory"] == {"in_use_bytes": 100, "peak_bytes": 600, "limit_bytes": 1000,
                                         "peak_percent": 60.0}
    assert steps[1]["device_memory"]["peak_bytes"] == 300


@pytest.mark.skipif(not have("jax"), reason="needs jax")
def test_jax_scalars_are_read_after_the_step_without_a_sync_on_the_training_thread():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def train_step(x):
        for _ in range(20):
            x = jnp.tanh(x @ x)
        return x, jnp.mean(x), jnp.sum(jnp.abs(x))

    x = jnp.ones((256, 256)) * 0.01
    train_step(x)[0].block_until_ready()
    expected = []
    with capture() as sink:
        for n in range(3):
            with steptrace.step(n) as s:
                x, loss, norm = train_step(x)
                s.log(loss=loss, grad_norm=norm)
                s.wait_for(loss)
            expected.append((float(loss), float(norm)))
    steps = sorted(sink.steps(), key=lambda r: r["step"])
    for record, (loss, norm) in zip(steps, expected):
        assert record["backend"] == "jax"
        assert record["scalars"]["loss"] == pytest.approx(loss)
        assert record["scalars"]["grad_norm"] == pytest.approx(norm)


@pytest.mark.skipif(not have("jax"), reason="needs jax")
def test_reading_a_jax_scalar_does_not_wait_for_later_steps():
    """A logged loss is read without dispatching anything, so the step's end is not observed late.

    A read that dispatched (``loss.reshape(())``, say) had to get through JAX's dispatch while the
    loop kept dispatching steps; the resolver then observed several steps' ends at once and every
    few steps one read as ~free (0.1 ms against 20 ms of matmuls).
    """
    import statistics

    import jax
    import jax.numpy as jnp

    @jax.jit
    def work(x, reps):
        return jax.lax.fori_loop(0, reps, lambda i, y: jnp.cos(y @ y) * 0.5, x)

    x = jnp.full((256, 256), 0.01, jnp.float32)
    work(x, 1).block_until_ready()
    jnp.mean(x).block_until_ready()
    losses = []
    with capture() as sink:
        for n in range(40):
            with steptrace.step(n) as s:
                x = work(x, 40)
                loss = jnp.mean(x)
                s.log(loss=loss)
                s.wait_for(x)
            losses.append(loss)
    steps = sorted(sink.steps(), key=lambda r: r["step"])[1:]
    assert [r["scalars"]["loss"] for r in steps] == pytest.approx([float(v) for v in losses[1:]], rel=1e-6)
    # Structural, not a speed limit: the same work never reads as (almost) none.
    compute = [r["compute_seconds"] for r in steps]
    assert min(compute) > 0.2 * statistics.median(compute), compute


@pytest.mark.skipif(not have("torch"), reason="needs torch")
def test_cpu_torch_scalars():
    import torch

    with capture() as sink:
        with steptrace.step(0) as s:
            loss = torch.tensor(1.25)
            s.log(loss=loss, vec_ok=torch.ones(1))
            with pytest.raises(ValueError, match="not a scalar"):
                s.log(bad=torch.ones(2))  # strict capture: misuse raises
    assert sink.steps()[0]["scalars"] == {"loss": 1.25, "vec_ok": 1.0}


def test_the_run_starts_with_a_metadata_record(device, tmp_path, monkeypatch):
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    (tmp_path / "repo" / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "sub")
    with capture(backend=device, tags={"branch": "exp-1", "lr": 3e-4}) as sink:
        for n in range(2):
            with steptrace.step(n):
                device.run(0.001)
    assert [r["type"] for r in sink.records[:2]] == ["attempt", "metadata"]
    (meta,) = sink.of_type("metadata")
    assert meta["git_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert meta["tags"] == {"branch": "exp-1", "lr": "0.0003"}
    assert meta["versions"]["steptrace"] == steptrace.__version__ and "python" in meta["versions"]
    assert meta["hostname"] and meta["devices"]["count"] >= 1
    assert meta["start_time"] <= sink.steps()[0]["end_time"]


def test_git_commit_from_packed_refs_and_a_detached_head(tmp_path):
    from steptrace._metadata import git_commit

    git = tmp_path / ".git"
    git.mkdir()
    (git / "HEAD").write_text("ref: refs/heads/dev\n")
    (git / "packed-refs").write_text("# pack-refs with: peeled\nfeedface" + "0" * 32 + " refs/heads/dev\n")
    assert git_commit(tmp_path) == "feedface" + "0" * 32
    (git / "HEAD").write_text("c0ffee" + "1" * 34 + "\n")
    assert git_commit(tmp_path) == "c0ffee" + "1" * 34


def test_tags_are_validated_at_init():
    from steptrace._config import resolve_config

    assert resolve_config({"STEPTRACE_TAGS": "a=1, b = two"}).tags == (("a", "1"), ("b", "two"))
    for bad in ({"x": object()}, {"": "v"}, "novalue", {"k": "a\nb"}):
        with pytest.raises(ValueError, match="tags|STEPTRACE_TAGS"):
            resolve_config({}, tags=bad) if not isinstance(bad, str) else resolve_config({"STEPTRACE_TAGS": bad})
