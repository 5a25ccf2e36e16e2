"""FLOPs users can check: the transformer helper against MaxText's and Megatron-LM's own functions,
the peak table, MFU and HFU with their parts, and an unknown device (no MFU, one warning).

The reference functions are called where they can be: MaxText in ``.venv-maxtext`` (a subprocess:
it needs Python 3.12), Megatron-LM's ``megatron.training.training`` when it imports (it is not in
the megatron-core wheel). The tests that always run compare with transcriptions of the branches
these configurations take; the real-function tests check the same numbers, so a transcription that
drifts from its source fails there. Where the packages do not import, the function is run from its
source file without its package's imports: ``MAXTEXT_UTILS_PY`` (``maxtext/utils/maxtext_utils.py``
of a maxtext wheel) and the Megatron-LM checkout the Megatron tests use (``$MEGATRON_LM_PATH`` or
``.cache/Megatron-LM``: importing ``megatron.training`` needs triton and CUDA-side packages).
"""

from __future__ import annotations

import ast
import enum
import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import steptrace
from steptrace import _metadata
from steptrace.flops import PEAKS, peak, transformer, transformer_active_parameters
from steptrace.testing import SimulatedDevice, capture

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT_PYTHON = ROOT / ".venv-maxtext" / "bin" / "python"

# -- the three configurations each framework is checked on ---------------------------------------
# MaxText: config attributes read by calculate_tflops_training_per_device (per-device batch 2).
MAXTEXT_CASES = {
    "dense (Llama 2 7B)": dict(
        maxtext=dict(decoder_block="llama2", emb_dim=4096, num_query_heads=32, num_kv_heads=32, head_dim=128,
                     mlp_dim=11008, num_decoder_layers=32, vocab_size=32000, max_target_length=4096),
        ours=dict(mlp="gated", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096)),
    "GQA, 1024-token window in 5 of 6 layers (Gemma 3 4B)": dict(
        maxtext=dict(decoder_block="gemma3", emb_dim=2560, num_query_heads=8, num_kv_heads=4, head_dim=256,
                     mlp_dim=10240, num_decoder_layers=34, vocab_size=262144, max_target_length=4096,
                     sliding_window_size=1024, mlp_activations=["gelu", "linear"]),
        ours=dict(layers=34, hidden=2560, heads=8, kv_heads=4, head_dim=256, ffn_hidden=10240, vocab=262144,
                  seq_len=4096, sliding_window=1024, window_layers=34 - 34 // 6, mlp="gated")),
    "MoE, 8 experts, 2 per token (Mixtral 8x7B)": dict(
        maxtext=dict(decoder_block="mixtral", emb_dim=4096, num_query_heads=32, num_kv_heads=8, head_dim=128,
                     mlp_dim=14336, moe_mlp_dim=14336, num_decoder_layers=32, vocab_size=32000,
                     max_target_length=4096, num_experts=8, num_experts_per_tok=2),
        ours=dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn_hidden=14336, vocab=32000,
                  seq_len=4096, experts=8, experts_per_token=2, mlp="gated")),
}
MAXTEXT_DEFAULTS = dict(num_experts=1, per_device_batch_size=2, mlp_activations=["silu", "linear"],
                        attention_type="global", share_kv_projections=False, mtp_num_layers=0, engram_layers=None,
                        use_multimodal=False, gradient_accumulation_steps=1, use_dpo=False, num_experts_per_tok=1,
                        sliding_window_size=0)

# Megatron-LM: args read by num_floating_point_operations (global batch 4). It has no sliding-window
# term, so its second configuration is grouped-query attention alone.
MEGATRON_CASES = {
    "dense (Llama 2 7B)": dict(
        megatron=dict(hidden_size=4096, num_attention_heads=32, kv_channels=128, ffn_hidden_size=11008,
                      num_layers=32, padded_vocab_size=32000, seq_length=4096),
        ours=dict(mlp="gated", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096)),
    "GQA (Llama 3 8B)": dict(
        megatron=dict(hidden_size=4096, num_attention_heads=32, group_query_attention=True, num_query_groups=8,
                      kv_channels=128, ffn_hidden_size=14336, num_layers=32, padded_vocab_size=128256,
                      seq_length=8192),
        ours=dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, seq_len=8192,
                  mlp="gated")),
    "MoE, 8 experts, 2 per token (Mixtral 8x7B)": dict(
        megatron=dict(hidden_size=4096, num_attention_heads=32, group_query_attention=True, num_query_groups=8,
                      kv_channels=128, ffn_hidden_size=14336, num_layers=32, padded_vocab_size=32000,
                      seq_length=4096, num_experts=8, moe_router_topk=2),
        ours=dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn_hidden=14336, vocab=32000,
                  seq_len=4096, experts=8, experts_per_token=2, mlp="gated")),
}
MEGATRON_DEFAULTS = dict(group_query_attention=False, num_experts=None, mtp_num_layers=None, moe_ffn_hidden_size=None,
                         moe_latent_size=None, moe_shared_expert_intermediate_size=None, swiglu=True,
                         multi_latent_attention=False, attention_output_gate=False,
                         experimental_attention_variant=None, moe_layer_freq=1, moe_router_topk=2)
MEGATRON_BATCH = 4
TOLERANCE = 1e-3  # the 0.1 %


def _maxtext_config(case: dict) -> dict:
    return {**MAXTEXT_DEFAULTS, **case["maxtext"]}


def _megatron_args(case: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**MEGATRON_DEFAULTS, **case["megatron"]})


def _ours_maxtext(case: dict) -> float:
    """Our per-token count times MaxText's per-device tokens, in TFLOP."""
    config = _maxtext_config(case)
    return transformer(**case["ours"]) * config["per_device_batch_size"] * config["max_target_length"] / 1e12


# -- transcriptions of the reference branches these configurations take ---------------------------
def maxtext_transcribed(c: dict) -> float:
    """MaxText 0.2.5 ``calculate_tflops_training_per_device`` for the default/llama2/mixtral (MoE
    without shared experts) and gemma3 (1 global layer in 6) decoder blocks, in TFLOP per device."""
    b, t, e = c["per_device_batch_size"], c["max_target_length"], c["emb_dim"]
    hq, kv, hd, layers = c["num_query_heads"], c["num_kv_heads"], c["head_dim"], c["num_decoder_layers"]

    def ffn(mlp_dim: int) -> float:
        return 2 * b * t * mlp_dim * e * len(c["mlp_activations"]) + 2 * b * t * mlp_dim * e

    if c["num_experts"] > 1:
        total_ffn = 2 * b * t * e * c["num_experts"] + ffn(c["moe_mlp_dim"]) * c["num_experts_per_tok"]
    else:
        total_ffn = ffn(c["mlp_dim"])
    qkv = 2 * b * t * e * (hq + 2 * kv) * hd
    causal_attention = 4 * b * t ** 2 * hq * hd / 2
    projection = 2 * b * t * e * hq * hd
    embedding = 2 * b * t * e * c["vocab_size"]
    weights = (total_ffn * layers + (qkv + projection) * layers + embedding) * 3 / 1e12
    if c["decoder_block"] == "gemma3":
        global_layers = layers // 6
        window = min(c["sliding_window_size"], t)
        local = 4 * b * (t * window - 0.5 * window ** 2) * hq * hd
        attention = (global_layers * causal_attention + (layers - global_layers) * local) * 3 / 1e12
    else:
        attention = causal_attention * layers * 3 / 1e12
    return weights + attention


def megatron_transcribed(args: types.SimpleNamespace, batch_size: int) -> float:
    """Megatron-LM (main, 2026-08) ``num_floating_point_operations`` for a standard transformer
    (MHA/GQA, dense or MoE in every layer, no MTP, no latent MoE), FLOPs of one global batch."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_experts is None:
        dense, moe, routed = args.num_layers, 0, 0
    else:
        dense, moe, routed = 0, args.num_layers, args.moe_router_topk
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    ffn_factor = 3 if args.swiglu else 2
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * groups
    self_attn = 3 * 2 * (args.hidden_size * (q + 2 * kv) + q * args.hidden_size)
    core = 3 * 2 * q / 2 * 2
    tokens = batch_size * args.seq_length
    return (tokens * (3 * 2 * args.hidden_size * (args.ffn_hidden_size * ffn_factor * dense
                                                  + moe_ffn * routed * ffn_factor * moe)
                      + self_attn * args.num_layers
                      + 3 * 2 * args.hidden_size * args.padded_vocab_size)
            + batch_size * args.seq_length ** 2 * core * args.num_layers)


@pytest.mark.parametrize("name", MAXTEXT_CASES)
def test_transformer_matches_maxtexts_formula(name):
    case = MAXTEXT_CASES[name]
    reference = maxtext_transcribed(_maxtext_config(case))
    assert _ours_maxtext(case) == pytest.approx(reference, rel=TOLERANCE)


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_transformer_matches_megatrons_formula(name):
    case = MEGATRON_CASES[name]
    args = _megatron_args(case)
    reference = megatron_transcribed(args, MEGATRON_BATCH)
    assert transformer(**case["ours"]) * MEGATRON_BATCH * args.seq_length == pytest.approx(reference, rel=TOLERANCE)


# -- the real functions -------------------------------------------------------------------------
def _function_from_source(path: str, name: str, namespace: dict, keep=lambda fn: False) -> object:
    """``name`` (and the top-level functions ``keep`` selects) from a source file, without its imports."""
    tree = ast.parse(Path(path).read_text())
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and (n.name == name or keep(n.name))]
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


_MAXTEXT_SCRIPT = textwrap.dedent("""
    import json, sys, types
    from maxtext.common.common_types import DecoderBlockType
    from maxtext.utils.maxtext_utils import calculate_tflops_training_per_device
    results = {}
    for name, config in json.loads(sys.stdin.read()).items():
        config["decoder_block"] = DecoderBlockType(config["decoder_block"])
        results[name] = calculate_tflops_training_per_device(types.SimpleNamespace(**config), log=False)[0]
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def maxtext_totals():
    configs = {name: _maxtext_config(case) for name, case in MAXTEXT_CASES.items()}
    if MAXTEXT_PYTHON.exists():
        proc = subprocess.run([str(MAXTEXT_PYTHON), "-c", _MAXTEXT_SCRIPT], input=json.dumps(configs),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    source = os.environ.get("MAXTEXT_UTILS_PY")
    if not source:
        pytest.skip("MaxText's calculate_tflops_training_per_device needs .venv-maxtext (make maxtext-env) or "
                    "MAXTEXT_UTILS_PY=<maxtext wheel>/maxtext/utils/maxtext_utils.py")
    decoder = enum.Enum("DecoderBlockType", {n.upper(): n for n in (
        "default", "llama2", "mistral", "mixtral", "deepseek", "gemma", "gemma2", "gemma3", "gemma4", "gemma4_small",
        "qwen3_custom_moe", "qwen3_next", "qwen3_5", "gpt_oss", "llama4", "deepseek4")})
    fn = _function_from_source(source, "calculate_tflops_training_per_device", {"DecoderBlockType": decoder},
                               keep=lambda n: n.startswith(("calculate_", "get_dense_moe", "get_shared_expert")))
    totals = {}
    for name, config in configs.items():
        config = {**config, "decoder_block": decoder(config["decoder_block"])}
        totals[name] = fn(types.SimpleNamespace(**config), log=False)[0]
    return totals


@pytest.mark.parametrize("name", MAXTEXT_CASES)
def test_transformer_matches_maxtexts_own_function(name, maxtext_totals):
    """MaxText's calculate_tflops_training_per_device itself, on the same configuration."""
    case = MAXTEXT_CASES[name]
    assert _ours_maxtext(case) == pytest.approx(maxtext_totals[name], rel=TOLERANCE)
    assert maxtext_transcribed(_maxtext_config(case)) == pytest.approx(maxtext_totals[name], rel=1e-9)


@pytest.fixture(scope="module")
def megatron_flops():
    try:
        return importlib.import_module("megatron.training.training").num_floating_point_operations
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    path = os.environ.get("MEGATRON_LM_PATH") or str(ROOT / ".cache" / "Megatron-LM")
    source = Path(path) / "megatron" / "training" / "training.py"
    if not source.is_file():
        pytest.skip(f"Megatron-LM's num_floating_point_operations does not import here ({reason}) and there is "
                    "no checkout: set MEGATRON_LM_PATH or put one at .cache/Megatron-LM")
    no = lambda *_: False  # noqa: E731 - the hybrid and linear-attention paths these configurations skip
    return _function_from_source(str(source), "num_floating_point_operations", {
        "is_hybrid_model": no, "is_linear_attention_variant": no, "is_gated_delta_net_variant": no})


@pytest.mark.parametrize("name", MEGATRON_CASES)
def test_transformer_matches_megatrons_own_function(name, megatron_flops):
    """Megatron-LM's num_floating_point_operations itself (what its TFLOP/s/GPU log line uses)."""
    case = MEGATRON_CASES[name]
    args = _megatron_args(case)
    reference = megatron_flops(args, MEGATRON_BATCH)
    ours = transformer(**case["ours"]) * MEGATRON_BATCH * args.seq_length
    assert ours == pytest.approx(reference, rel=TOLERANCE)
    assert megatron_transcribed(args, MEGATRON_BATCH) == pytest.approx(reference, rel=1e-9)


# -- the helper's own arithmetic ------------------------------------------------------------------
def test_transformer_is_palms_6n_plus_12lhqt_without_the_causal_halving():
    kw = dict(layers=4, hidden=256, heads=8, ffn_hidden=1024, vocab=1000, seq_len=512, mlp="plain")
    n = transformer_active_parameters(**{k: v for k, v in kw.items() if k != "seq_len"})
    assert n == 4 * (4 * 256 * 256 + 2 * 256 * 1024) + 256 * 1000
    assert transformer(**kw, causal=False) == 6 * n + 12 * 4 * 8 * 32 * 512
    assert transformer(**kw) == 6 * n + 6 * 4 * 8 * 32 * 512
    assert transformer(**kw, training=False) == pytest.approx((6 * n + 6 * 4 * 8 * 32 * 512) / 3)


def test_a_window_as_long_as_the_sequence_is_full_causal_attention_and_moe_counts_active_experts():
    kw = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=512, vocab=100, seq_len=256, mlp="gated")
    assert transformer(**kw, sliding_window=256) == pytest.approx(transformer(**kw))
    assert transformer(**kw, sliding_window=64) < transformer(**kw)
    dense = transformer_active_parameters(**{k: v for k, v in kw.items() if k != "seq_len"})
    moe = transformer_active_parameters(**{k: v for k, v in kw.items() if k != "seq_len"}, experts=8,
                                        experts_per_token=2)
    assert moe - dense == 2 * (128 * 8 + 3 * 128 * 512)  # per layer: the router and one more expert


@pytest.mark.parametrize("bad", [dict(layers=0), dict(kv_heads=0), dict(experts_per_token=3, experts=2),
                                 dict(sliding_window=16, causal=False), dict(window_layers=3, sliding_window=8)])
def test_transformer_rejects_bad_shapes_with_a_value_error(bad):
    kw = dict(layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=10, seq_len=32, mlp="gated")
    with pytest.raises(ValueError):
        transformer(**{**kw, **bad})


def test_the_mlp_kind_is_required_and_a_gated_mlp_has_one_more_matrix():
    """No default to get silently wrong: a gated MLP (SwiGLU, GeGLU) multiplies with three matrices, a
    plain one (GELU, ReLU: GPT-2, nanoGPT) with two; assuming gated inflates GPT-2 small's FLOPs by 21 %."""
    gpt2 = dict(layers=12, hidden=768, heads=12, ffn_hidden=3072, vocab=50304, seq_len=1024)
    for missing_or_bad in ({}, {"mlp": "swiglu"}, {"mlp": True}):
        with pytest.raises(ValueError, match=r"mlp must be 'gated' \(SwiGLU, GeGLU: three matrices\) or "
                                             r"'plain' \(GELU, ReLU: two\)"):
            transformer(**gpt2, **missing_or_bad)
        with pytest.raises(ValueError, match="mlp must be"):
            transformer_active_parameters(**{k: v for k, v in gpt2.items() if k != "seq_len"}, **missing_or_bad)
    plain = transformer_active_parameters(**{k: v for k, v in gpt2.items() if k != "seq_len"}, mlp="plain")
    gated = transformer_active_parameters(**{k: v for k, v in gpt2.items() if k != "seq_len"}, mlp="gated")
    assert gated - plain == 12 * 768 * 3072
    assert plain == 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 768 * 50304
    assert transformer(**gpt2, mlp="gated") - transformer(**gpt2, mlp="plain") == 6 * 12 * 768 * 3072
    assert transformer(**gpt2, mlp="gated") / transformer(**gpt2, mlp="plain") == pytest.approx(1.21, abs=0.005)


# -- the peak table -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA B200", 2250.0), ("AMD Instinct MI300X", 1307.4), ("TPU v4", 275.0), ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0), ("TPU v5p", 459.0), ("TPU v6 lite", 918.0),
    ("NVIDIA GeForce RTX 3090", None), ("cpu", None), ("TPU7x", None)])
def test_peak_table_by_the_device_kind_the_frameworks_report(kind, tflops):
    found = peak(kind)
    assert (found.tflops if found else None) == tflops
    if found:
        assert found.source and found.device


def test_every_peak_names_its_source_and_is_in_the_docs():
    text = (ROOT / "docs" / "flops.md").read_text()
    for entry in PEAKS:
        assert entry.source and f"`{entry.match}`" in text and f"{entry.tflops:g}" in text, entry


def test_the_megatron_hook_has_no_peak_table_of_its_own():
    source = (ROOT / "adapters" / "megatron.py").read_text()
    assert "989" not in source and "PEAK" not in source


# -- MFU and HFU in the record ---------------------------------------------------------------------
def _device_kind(monkeypatch, kind: str, platform: str = "gpu") -> None:
    real = _metadata.devices
    monkeypatch.setattr(_metadata, "devices", lambda: {**real(), "kind": kind, "platform": platform})


def test_a_known_device_gives_mfu_with_its_parts_from_the_table(monkeypatch):
    _device_kind(monkeypatch, "NVIDIA H100 80GB HBM3")
    device = SimulatedDevice()
    with capture(backend=device) as sink:
        with steptrace.step(0, flops=2e12) as s:
            s.wait_for(device.run(0.02))
    (step,) = sink.steps()
    assert step["peak_flops"] == 989e12 and step["model_flops"] == 2e12 and step["flops"] == 2e12
    assert step["hardware_flops"] is None and step["flops_source"] is None and step["hfu"] is None
    assert step["mfu"] == pytest.approx(2e12 / step["compute_seconds"] / 989e12)


def test_a_configured_peak_wins_over_the_table(monkeypatch):
    _device_kind(monkeypatch, "NVIDIA H100 80GB HBM3")
    with capture(peak_tflops=100.0) as sink:
        with steptrace.step(0, flops=1e9):
            pass
    (step,) = sink.steps()
    assert step["peak_flops"] == 100e12


def test_an_unknown_device_gives_no_mfu_and_one_warning(monkeypatch, caplog):
    _device_kind(monkeypatch, "NVIDIA GeForce RTX 3090")
    with caplog.at_level(logging.WARNING, logger="steptrace"):
        with capture() as sink:
            for n in range(3):
                with steptrace.step(n, flops=1e9):
                    pass
    steps = sink.steps()
    assert len(steps) == 3 and all(s["mfu"] is None and s["peak_flops"] is None for s in steps)
    assert all(s["tflops_per_second"] is not None for s in steps)  # the rate needs no peak
    warned = [r for r in caplog.records if "no peak FLOP/s" in r.getMessage()]
    assert len(warned) == 1 and "RTX 3090" in warned[0].getMessage()
    assert "in the precision the model trains in" in warned[0].getMessage()


def test_on_a_cpu_the_no_peak_warning_asks_for_the_cpus_peak_in_its_precision_not_a_bf16_one(monkeypatch, caplog):
    """CPU training is fp32: the warning says how to work out that peak (cores x GHz x FLOPs per cycle),
    never to look up a "dense bf16" figure a CPU does not have."""
    _device_kind(monkeypatch, "AMD EPYC", platform="cpu")
    with caplog.at_level(logging.WARNING, logger="steptrace"):
        with capture():
            with steptrace.step(0, flops=1e9):
                pass
    (warned,) = [r.getMessage() for r in caplog.records if "no peak FLOP/s" in r.getMessage()]
    assert "'AMD EPYC'" in warned and "fp32: physical cores x GHz x fp32 FLOPs per cycle" in warned
    assert "bf16" not in warned and "docs/flops.md" in warned


def test_no_warning_when_no_step_has_flops(monkeypatch, caplog):
    _device_kind(monkeypatch, "NVIDIA GeForce RTX 3090")
    with caplog.at_level(logging.WARNING, logger="steptrace"):
        with capture():
            with steptrace.step(0):
                pass
    assert not [r for r in caplog.records if "no peak" in r.getMessage()]


def test_flops_setting_is_auto_or_nothing():
    with pytest.raises(ValueError, match="flops"):
        steptrace.init(flops="compiler", jsonl=False)
    from steptrace._config import resolve_config

    assert resolve_config(environ={"STEPTRACE_FLOPS": "AUTO"}).flops == "auto"
    assert resolve_config(environ={}).flops is None


# -- flops="auto" on real frameworks ------------------------------------------------------------------
def test_jax_matmul_step_reads_2mnk_hardware_flops_from_xla():
    jax = pytest.importorskip("jax", reason="the JAX FLOPs test needs jax")
    jnp = jax.numpy
    m, k, n = 384, 256, 128
    matmul = jax.jit(lambda a, b: a @ b)
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    with capture(flops="auto", peak_tflops=1.0) as sink:
        for i in range(3):
            with steptrace.step(i, flops=1.0) as s:  # a number with init(flops="auto"): the model FLOPs
                s.wait_for(matmul(a, b))
    steps = sink.steps()
    for step in steps:
        assert step["hardware_flops"] == pytest.approx(2 * m * n * k, rel=0.01)
        assert step["flops_source"] == "xla_cost_analysis" and step["model_flops"] == 1.0
        assert step["flops"] == step["hardware_flops"]
        assert step["hfu"] == pytest.approx(step["hardware_flops"] / step["compute_seconds"] / 1e12)
        assert step["mfu"] == pytest.approx(1.0 / step["compute_seconds"] / 1e12)


def test_jax_auto_per_step_and_a_recompilation_replaces_the_program():
    jax = pytest.importorskip("jax", reason="the JAX FLOPs test needs jax")
    jnp = jax.numpy
    matmul = jax.jit(lambda a, b: a @ b)
    small, big = (jnp.ones((64, 32)), jnp.ones((32, 16))), (jnp.ones((128, 32)), jnp.ones((32, 16)))
    with capture() as sink:
        with steptrace.step(0) as s:  # not auto: nothing counted
            s.wait_for(matmul(*small))
        for i, args in enumerate((small, big, big), start=1):
            with steptrace.step(i, flops="auto") as s:
                s.wait_for(matmul(*args))
    steps = sink.steps()
    assert steps[0]["hardware_flops"] is None
    # step 1 compiles nothing (the program was compiled in step 0, not an auto step): not seen
    assert steps[1]["hardware_flops"] is None
    assert [s["hardware_flops"] for s in steps[2:]] == [2 * 128 * 32 * 16] * 2


def test_torch_linear_stack_reads_its_known_count_from_one_steady_step():
    torch = pytest.importorskip("torch", reason="the torch FLOPs test needs torch")
    batch, d, h = 16, 32, 64
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, d))
    x = torch.randn(batch, d)
    forward = 2 * batch * (d * h + h * d)
    # backward: weight gradients of both layers, the input gradient of the second only (x needs none)
    expected = forward + 2 * forward - 2 * batch * d * h
    with capture(flops="auto") as sink:
        for n in range(4):
            with steptrace.step(n):
                model(x).square().mean().backward()
    steps = sink.steps()
    assert steps[0]["hardware_flops"] is None  # the first auto step is not counted (warm-up)
    assert [s["hardware_flops"] for s in steps[1:]] == [expected] * 3
    assert {s["flops_source"] for s in steps[1:]} == {"torch_flop_counter"}
    assert steps[1]["model_flops"] is None and steps[1]["mfu"] is None


_SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import steptrace
    from steptrace.testing import capture
    mesh = Mesh(np.array(jax.devices()), ("d",))
    a = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P("d", None)))
    b = jnp.ones((256, 128))
    matmul = jax.jit(lambda a, b: a @ b)
    with capture(flops="auto") as sink:
        for n in range(2):
            with steptrace.step(n) as s:
                s.wait_for(matmul(a, b))
    print(json.dumps([r["hardware_flops"] for r in sink.steps()]))
""")


def test_jax_sharded_program_counts_one_devices_share(tmp_path):
    """An SPMD program's cost analysis is its per-device partition: 4 devices, a quarter each."""
    pytest.importorskip("jax", reason="the JAX FLOPs test needs jax")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [2 * 512 * 256 * 128 / 4] * 2
