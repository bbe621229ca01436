"""``NormGemvFusionPass`` on graphs Dynamo captures from the torch forms the layers call.

``add_rms_norm`` (or ``rms_norm``) followed by each GEMV op it takes (the plain GEMV with and
without a bias, the gated one, the rotary one, the q/k head-norm one) becomes one
``small_m_rms_norm_*`` op given the norm's input, residual, weight and eps before the GEMV's own
arguments; the new residual's readers read its second item, and the fused graph computes
bit for bit what the eager function does (on the CPU the fused ops run the torch forms). A sum
nobody reads as a residual is fused too. Each difference leaves the graph as it was: the
normalised tensor also read by something else, the residual read before the GEMV, Gemma's norm
(the sum rounded before it is normalised, ``1 + w`` in float32).
Run: PIECEWORKS_PLATFORM=cpu pytest tests/core/passes/test_norm_gemv_graphs.py
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from pieceworks.core.norm_quant import add_rms_norm, gemma_rms_norm, rms_norm
from pieceworks.core.passes.graph_match import op_name
from pieceworks.core.passes.norm_gemv_fusion import NormGemvFusionPass
from pieceworks.kernels.gemv.triton_gemv import (
    small_m_linear_op,
    small_m_silu_and_mul_linear_op,
)
from pieceworks.kernels.gemv.triton_gemv_norm import register_norm_gemv_ops
from pieceworks.kernels.gemv.triton_gemv_qk_norm_rope import small_m_qk_norm_rope_linear_op
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear_op
from pieceworks.models.layers.rotary_embedding import get_rope

HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, EPS = 32, 16, 2, 1, 1e-6
QKV_ROWS = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE


def gemv_call(form: str):
    """``gemv(normed, weights, positions, cache)``: the GEMV op ``form`` as the layers call it."""
    if form == "rope":
        op = small_m_rope_linear_op()
        return lambda n, w, p, c: op(n, w["qkv"], p, c, HEAD_SIZE, NUM_HEADS + NUM_KV_HEADS)
    if form == "qk_norm_rope":
        op = small_m_qk_norm_rope_linear_op()
        heads = (HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS)
        return lambda n, w, p, c: op(n, w["qkv"], p, c, *heads, w["q"], w["k"], EPS, False)
    if form == "gated":
        op = small_m_silu_and_mul_linear_op()
        return lambda n, w, p, c: op(n, w["gate_up"])
    op = small_m_linear_op()
    bias = form == "bias"
    return lambda n, w, p, c: op(n, w["gate_up"], w["bias"] if bias else None)


def decoder_front(variant: str, form: str):
    """The norm, then the GEMV op ``form`` on its output reshaped to rows, changed as
    ``variant`` says; returns what a decoder layer would pass on."""
    gemv = gemv_call(form)

    def front(x, residual, norm_weight, weights, positions, cache):
        if variant == "plain":
            normed = rms_norm(x, norm_weight, EPS)
            return gemv(normed.reshape(-1, HIDDEN), weights, positions, cache), x
        if variant == "gemma":  # the sum in the dtype, (1 + w) in float32
            residual = x + residual
            normed = gemma_rms_norm(residual, norm_weight, EPS)
        else:
            normed, residual = add_rms_norm(x, residual, norm_weight, EPS)
        early = residual * 2 if variant == "residual_read_first" else None
        out = gemv(normed.reshape(-1, HIDDEN), weights, positions, cache)
        if variant == "sum_unread":
            return (out,)
        if variant == "normed_read":
            return out, residual, normed
        return (out, residual) if early is None else (out, residual, early)

    return front


def operands(dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    weights = {
        "gate_up": randn(2 * HIDDEN, HIDDEN) / HIDDEN**0.5,
        "bias": randn(2 * HIDDEN),
        "qkv": randn(QKV_ROWS, HIDDEN) / HIDDEN**0.5,
        "q": 1 + 0.3 * randn(HEAD_SIZE),
        "k": 1 + 0.3 * randn(HEAD_SIZE),
    }
    cache = get_rope(HEAD_SIZE, HEAD_SIZE, 64, 10000.0, None, True, dtype).cos_sin_cache
    x, residual, norm_weight = randn(3, HIDDEN), randn(3, HIDDEN), 1 + 0.3 * randn(HIDDEN)
    return x, residual, norm_weight, weights, torch.tensor([5, 9, 33]), cache


def fuse(variant: str, form: str):
    """The fusions made on Dynamo's graph, its pieceworks ops after, the graph and both results
    (the compiled one and eager's)."""
    register_norm_gemv_ops()
    made: list[int] = []
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        made.append(NormGemvFusionPass()(gm.graph))
        gm.graph.lint()
        gm.recompile()
        graphs.append(gm)
        return gm

    args = operands()
    torch._dynamo.reset()
    front = decoder_front(variant, form)
    fused = torch.compile(front, backend=backend, fullgraph=True)(*args)
    expected = front(*args)
    ops = [op_name(node) for node in graphs[0].graph.nodes if op_name(node)]
    return made[0], ops, graphs[0], expected, fused


@pytest.mark.parametrize(
    "variant,form",
    [
        ("add", "linear"),
        ("add", "bias"),
        ("add", "gated"),
        ("add", "rope"),
        ("add", "qk_norm_rope"),
        ("plain", "linear"),
        ("sum_unread", "gated"),
    ],
)
def test_the_norm_folds_into_the_gemv_op(variant, form):
    num_fused, ops, gm, expected, fused = fuse(variant, form)
    assert num_fused == 1
    name = {"bias": "linear", "linear": "linear", "gated": "silu_and_mul_linear"}.get(
        form, f"{form}_linear"
    )
    assert ops == [f"small_m_rms_norm_{name}"]
    (node,) = [node for node in gm.graph.nodes if op_name(node)]
    inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    residual = None if variant == "plain" else inputs["l_residual_"]
    assert node.args[:4] == (inputs["l_x_"], residual, inputs["l_norm_weight_"], EPS)
    assert not [n for n in gm.graph.nodes if n.target in ("pow", "mean")]  # the norm is gone
    for actual, wanted in zip(fused, expected, strict=True):
        assert torch.equal(actual, wanted)


@pytest.mark.parametrize("variant", ["normed_read", "residual_read_first", "gemma"])
def test_each_difference_leaves_the_graph(variant):
    num_fused, ops, _, _, _ = fuse(variant, "gated")
    assert num_fused == 0
    assert ops == ["small_m_silu_and_mul_linear"]
