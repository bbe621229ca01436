"""The epilogue fusions on hand-built FX graphs: what they refuse, and the count they return.

``tests/models/test_gemv_fusion.py`` runs them on llama-tiny, whose linear layers have no bias and
whose attention always writes into a fresh ``torch.empty_like`` buffer. Here: a gate/up GEMV
with a bias (positional or keyword) is not fused with its activation (the fused op has no bias),
one without is; an attention whose output buffer is not a fresh ``empty_like`` is left alone and
counted as no fusion. The ops are pieceworks' own, registered as the layers register them; the
graphs are only rewritten, never run.
Run: pytest tests/core/passes/test_epilogue_graphs.py
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from pieceworks.core.passes.attn_quant_fusion import AttnQuantFusionPass
from pieceworks.core.passes.gemv_fusion import GemvActivationFusionPass
from pieceworks.core.passes.graph_match import op_name
from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_op
from pieceworks.kernels.gemv.triton_gemv import small_m_linear_op, small_m_silu_and_mul_linear_op
from pieceworks.models.attention.layer import attention_op


def gate_up_graph(bias: str | None) -> torch.fx.Graph:
    """``silu_and_mul(small_m_linear(x, w[, b]))``, the bias passed as ``bias`` says."""
    small_m_silu_and_mul_linear_op()  # the fused op exists, so only the bias can refuse it
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    args, kwargs = (x, weight), {}
    if bias == "positional":
        args = (x, weight, graph.placeholder("bias"))
    elif bias == "keyword":
        kwargs = {"bias": graph.placeholder("bias")}
    linear = graph.call_function(small_m_linear_op(), args, kwargs)
    graph.output(graph.call_function(silu_and_mul_op(), (linear,)))
    return graph


def ops_of(graph: torch.fx.Graph) -> list[str | None]:
    return [op_name(node) for node in graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("bias", ["positional", "keyword"])
def test_a_gate_up_gemv_with_a_bias_is_not_fused(bias):
    graph = gate_up_graph(bias)
    assert GemvActivationFusionPass()(graph) == 0
    assert ops_of(graph) == ["small_m_linear", "silu_and_mul"]


def test_a_gate_up_gemv_without_a_bias_is_fused():
    graph = gate_up_graph(None)
    assert GemvActivationFusionPass()(graph) == 1
    assert ops_of(graph) == ["small_m_silu_and_mul_linear"]


def test_an_attention_into_a_buffer_it_did_not_allocate_is_not_counted():
    graph = torch.fx.Graph()
    query, key, value, output = (graph.placeholder(name) for name in ("q", "k", "v", "out"))
    graph.call_function(attention_op(), (query, key, value, output, "layers.0.attn"))
    graph.output(output)
    assert AttnQuantFusionPass()(graph) == 0
    assert ops_of(graph) == ["unified_attention_with_output"]
