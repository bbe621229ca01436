"""``GemvQKNormRopeFusionPass`` on graphs Dynamo captures from the torch forms the layers call.

A qkv GEMV, its split, ``rms_norm`` or ``gemma_rms_norm`` on the q and k heads and the rotary op
(as ``Qwen3Attention`` writes them) is fused into one ``small_m_qk_norm_rope_linear`` carrying the
norm weights, eps and form, and the fused graph computes what the eager function does. Each
difference leaves the graph as it was: q and k norms of different eps or forms, q also read before
its norm, a GEMV with a bias, a rotary on other tensors than the split's q and k.
Run: PIECEWORKS_PLATFORM=cpu pytest tests/core/passes/test_qk_norm_rope_graphs.py
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from pieceworks.core.norm_quant import gemma_rms_norm, rms_norm
from pieceworks.core.passes.gemv_fusion import GemvQKNormRopeFusionPass
from pieceworks.core.passes.graph_match import op_name
from pieceworks.kernels.gemv.triton_gemv import small_m_linear_op
from pieceworks.kernels.gemv.triton_gemv_qk_norm_rope import small_m_qk_norm_rope_linear_op
from pieceworks.kernels.rope.torch_rotary import rotary_embedding_op
from pieceworks.models.layers.rotary_embedding import get_rope

HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, HIDDEN = 16, 4, 2, 32
Q_SIZE, KV_SIZE = NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE


def attention_front(variant: str):
    """``qkv_proj -> split -> q/k head norms -> rotary`` as a function, changed as ``variant``
    says; returns q, k, v (and the raw q where it is read)."""
    linear, rotary = small_m_linear_op(), rotary_embedding_op()
    q_norm = gemma_rms_norm if variant in ("gemma", "mixed") else rms_norm
    k_norm = rms_norm if variant != "gemma" else gemma_rms_norm
    k_eps = 1e-5 if variant == "eps" else 1e-6

    def front(x, weight, bias, q_weight, k_weight, positions, cache):
        qkv = linear(x, weight, bias if variant == "bias" else None)
        q, k, v = qkv.split([Q_SIZE, KV_SIZE, KV_SIZE], dim=-1)
        raw_q = q
        q = q_norm(q.reshape(-1, HEAD_SIZE), q_weight, 1e-6).view(-1, Q_SIZE)
        k = k_norm(k.reshape(-1, HEAD_SIZE), k_weight, k_eps).view(-1, KV_SIZE)
        if variant == "swapped":
            q, k = rotary(positions, k, q, cache, HEAD_SIZE, True)
        else:
            q, k = rotary(positions, q, k, cache, HEAD_SIZE, True)
        return (q, k, v, raw_q) if variant == "raw_q_read" else (q, k, v)

    return front


def operands():
    generator = torch.Generator().manual_seed(0)
    rows = Q_SIZE + 2 * KV_SIZE
    x, weight = (
        torch.randn(3, HIDDEN, generator=generator),
        torch.randn(rows, HIDDEN, generator=generator),
    )
    bias = torch.randn(rows, generator=generator)
    q_weight, k_weight = (0.3 * torch.randn(HEAD_SIZE, generator=generator) for _ in range(2))
    cache = get_rope(HEAD_SIZE, HEAD_SIZE, 64, 10000.0, None, True, torch.float32).cos_sin_cache
    return x, weight, bias, q_weight, k_weight, torch.tensor([5, 9, 33]), cache


def fuse(variant: str):
    """The fusions made on Dynamo's graph of the variant, its ops after, and both results."""
    small_m_qk_norm_rope_linear_op()
    made: list[int] = []
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        made.append(GemvQKNormRopeFusionPass()(gm.graph))
        gm.recompile()
        graphs.append(gm)
        return gm

    args = operands()
    torch._dynamo.reset()
    front = attention_front(variant)
    fused = torch.compile(front, backend=backend, fullgraph=True)(*args)
    expected = front(*args)  # eager: the unfused torch forms
    ops = [op_name(node) for node in graphs[0].graph.nodes if op_name(node)]
    return made[0], ops, graphs[0], expected, fused


@pytest.mark.parametrize("variant", ["plain", "gemma"])
def test_the_head_norms_and_rotary_fold_into_one_op(variant):
    num_fused, ops, gm, expected, fused = fuse(variant)
    assert num_fused == 1
    assert ops == ["small_m_qk_norm_rope_linear"]
    (node,) = [node for node in gm.graph.nodes if op_name(node)]
    assert node.args[4:7] == (HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS)
    assert node.args[9:] == (1e-6, variant == "gemma")
    for actual, wanted in zip(fused, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["eps", "mixed", "raw_q_read", "bias", "swapped"])
def test_each_difference_leaves_the_graph(variant):
    num_fused, ops, _, _, _ = fuse(variant)
    assert num_fused == 0
    assert ops == ["small_m_linear", "rotary_embedding"]
