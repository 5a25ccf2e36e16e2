"""FLOPs you can check: model FLOPs of a transformer, and the peak table MFU divides by.

``transformer(...)`` gives **model FLOPs per token** after PaLM (Chowdhery et al. 2022, appendix B):
``6·N + 12·L·H·Q·T`` for training, where ``N`` is the parameters a token passes through in a
matrix multiply (its *active* parameters: with mixture-of-experts only the experts it is routed
to), ``L`` layers, ``H`` query heads of size ``Q``, sequence length ``T``. Like MaxText
(``calculate_tflops_training_per_device``) and Megatron-LM (``num_floating_point_operations``),
attention is counted causally (half of PaLM's ``12·L·H·Q·T``; ``causal=False`` gives PaLM's), with
grouped-query attention in the key/value projections, and a sliding window of ``W`` tokens costing
``12·H·Q·(W − W²/2T)`` per token and layer instead of ``6·H·Q·T``.

Model FLOPs are what the model needs, whatever the implementation does: MFU divides them by
the peak. Hardware FLOPs (what the device executed, rematerialization included) come from the
compiler with ``step(n, flops="auto")``; HFU divides those.

``peak(device_kind)`` is the table of dense bf16 peaks steptrace uses (``steptrace._peaks``),
each with its source. Imports nothing but the standard library.
"""

from __future__ import annotations

from steptrace._peaks import PEAKS, Peak, lookup

__all__ = ["PEAKS", "Peak", "peak", "transformer", "transformer_active_parameters"]


def peak(device_kind: str) -> Peak | None:
    """The dense bf16 peak of a device kind as JAX (``device_kind``) or torch
    (``get_device_name()``) names it: ``.tflops``, ``.device``, ``.source``; None when unknown."""
    return lookup(device_kind)


#: ``mlp=``: the MLP's matrices per layer. Gated (SwiGLU in Llama, Mistral, Mixtral; GeGLU in Gemma)
#: multiplies with three (gate, up, down), plain (GELU or ReLU in GPT-2, BERT, nanoGPT) with two: the
#: difference is a fifth of a GPT-2's FLOPs, so there is no default to get it silently wrong.
MLP_MATRICES = {"gated": 3, "plain": 2}


def _mlp_matrices(mlp: object) -> int:
    if mlp not in MLP_MATRICES:
        raise ValueError(f"mlp must be 'gated' (SwiGLU, GeGLU: three matrices) or 'plain' (GELU, ReLU: two), "
                         f"got {mlp!r}")
    return MLP_MATRICES[str(mlp)]


def _check(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def transformer_active_parameters(*, layers: int, hidden: int, heads: int, ffn_hidden: int, vocab: int,
                                  mlp: str | None = None, head_dim: int | None = None, kv_heads: int | None = None,
                                  experts: int = 0, experts_per_token: int = 1,
                                  expert_ffn_hidden: int | None = None, shared_expert_ffn_hidden: int = 0,
                                  moe_layers: int | None = None) -> int:
    """The parameters one token multiplies with (PaLM's ``N``), as the matrix multiplies count them:
    query/key/value and output projections, the MLP (``mlp="gated"``: three matrices, SwiGLU, GeGLU;
    ``mlp="plain"``: two, GELU, ReLU; required), for MoE layers the router and the ``experts_per_token`` experts a token
    is routed to (plus a shared expert of ``shared_expert_ffn_hidden``), and the output (unembedding)
    projection. The input embedding is a lookup, not a multiply, and is not counted (nor are norms
    and biases)."""
    _check("layers", layers)
    _check("hidden", hidden)
    _check("heads", heads)
    _check("vocab", vocab)
    _check("ffn_hidden", ffn_hidden, 0)
    q = _check("head_dim", hidden // heads if head_dim is None else head_dim)
    kv = _check("kv_heads", heads if kv_heads is None else kv_heads)
    _check("experts", experts, 0)
    moe = (layers if experts else 0) if moe_layers is None else _check("moe_layers", moe_layers, 0)
    if moe > layers or (moe and not experts):
        raise ValueError(f"moe_layers must be <= layers and needs experts > 0, got moe_layers={moe}, "
                         f"experts={experts}")
    matrices = _mlp_matrices(mlp)
    attention = hidden * (heads + 2 * kv) * q + heads * q * hidden
    dense_mlp = matrices * hidden * ffn_hidden
    moe_mlp = 0
    if moe:
        _check("experts_per_token", experts_per_token)
        if experts_per_token > experts:
            raise ValueError(f"experts_per_token must be <= experts, got {experts_per_token} > {experts}")
        expert_ffn = ffn_hidden if expert_ffn_hidden is None else _check("expert_ffn_hidden", expert_ffn_hidden)
        _check("shared_expert_ffn_hidden", shared_expert_ffn_hidden, 0)
        moe_mlp = (hidden * experts  # the router
                   + experts_per_token * matrices * hidden * expert_ffn
                   + matrices * hidden * shared_expert_ffn_hidden)
    return layers * attention + (layers - moe) * dense_mlp + moe * moe_mlp + hidden * vocab


def transformer(*, layers: int, hidden: int, heads: int, ffn_hidden: int, vocab: int, seq_len: int,
                mlp: str | None = None, head_dim: int | None = None, kv_heads: int | None = None,
                experts: int = 0, experts_per_token: int = 1, expert_ffn_hidden: int | None = None,
                shared_expert_ffn_hidden: int = 0, moe_layers: int | None = None,
                sliding_window: int | None = None, window_layers: int | None = None,
                causal: bool = True, training: bool = True) -> float:
    """Model FLOPs per token of a decoder-only transformer (PaLM appendix B; see the module).

    ``mlp`` (required): ``"gated"`` (SwiGLU, GeGLU: three matrices) or ``"plain"`` (GELU, ReLU: two).
    ``heads`` query heads of ``head_dim`` (default ``hidden // heads``), ``kv_heads`` key/value
    heads (grouped-query attention; default ``heads``). ``experts`` > 0: mixture-of-experts MLPs
    in ``moe_layers`` layers (default all), each token routed to ``experts_per_token`` experts of
    ``expert_ffn_hidden`` (default ``ffn_hidden``). ``sliding_window``: ``window_layers`` layers
    (default all) attend to the last ``sliding_window`` tokens only (Mistral; Gemma 3 has 5 local
    layers in 6, GPT-OSS 1 in 2). ``training``: forward and backward (3 passes), else forward only.

    Multiply by the tokens of a step for the step's model FLOPs:
    ``steptrace.step(n, flops=per_token * tokens)``.
    """
    n = transformer_active_parameters(
        layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden, vocab=vocab, mlp=mlp, head_dim=head_dim,
        kv_heads=kv_heads, experts=experts, experts_per_token=experts_per_token,
        expert_ffn_hidden=expert_ffn_hidden, shared_expert_ffn_hidden=shared_expert_ffn_hidden,
        moe_layers=moe_layers)
    t = _check("seq_len", seq_len)
    hq = heads * (hidden // heads if head_dim is None else head_dim)
    # Forward attention per token and layer: QK^T and AV, 2 FLOPs per multiply-add, over T keys
    # (4·T·H·Q); a causal mask halves it on average.
    full = 4.0 * t * hq
    global_layer = full / 2 if causal else full
    local = 0
    local_layer = global_layer
    if sliding_window is not None:
        w = _check("sliding_window", sliding_window)
        if not causal:
            raise ValueError("sliding_window counts causal local attention; it needs causal=True")
        w = min(w, t)
        local = layers if window_layers is None else _check("window_layers", window_layers, 0)
        if local > layers:
            raise ValueError(f"window_layers must be <= layers, got {local} > {layers}")
        # Query i sees min(i + 1, W) keys: summed over a sequence, T·W − W²/2 (MaxText's count).
        local_layer = 4.0 * (t * w - 0.5 * w * w) / t * hq
    attention = (layers - local) * global_layer + local * local_layer
    passes = 3.0 if training else 1.0  # backward: the gradients of the inputs and of the weights
    return passes * (2.0 * n + attention)
