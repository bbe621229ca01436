"""The epilogue fusions on hand-built FX graphs: what they refuse, and the count they return.

``tests/models/test_gemv_fusion.py`` runs them on llama-tiny, whose linear layers have no bias and
whose attention always writes into a fresh ``torch.empty_like`` buffer. Here: a gate/up GEMV with a
bias (positional or keyword) is not fused with its activation (the fused op has no bias), one
without is; Gemma's ``gelu_and_mul`` after a plain GEMV becomes one GEMV with the GELU, its
``approximate`` kept, and is kept after a biased or an FP8 GEMV; an attention whose output buffer is
not a fresh ``empty_like`` is left alone and counted as no fusion. An attention followed by the
static FP8 quantization of its output allocates an FP8 buffer and takes the scale (a placeholder, or
a node before it), and ``o_proj`` reads its output directly; each difference from that sequence
(another allocation, no output argument, a scale already given, another step, another FP8 format, a
scale computed after the attention, another reader) leaves the graph as it was. A rotary of the
query and key of a qkv GEMV's split becomes one GEMV with the rotation, the number of rotated heads
derived from the split, and each difference (not neox, partial rotary, an unknown cache, another
split, items swapped or from two splits, a bias, another reader) leaves it. The FP8 gate/up GEMV
fuses with the next layer's quantization and is kept without one. ``fuse_epilogues`` runs the
enabled fusions, counts each, and logs the counts at debug level when one fused. The ops are
pieceworks' own, registered as the layers register them; the graphs are only rewritten, never run.
Run: pytest tests/core/passes/test_epilogue_graphs.py
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.fx

from pieceworks.core.config import PassConfig
from pieceworks.core.passes.attn_quant_fusion import AttnQuantFusionPass
from pieceworks.core.passes.gemv_fusion import (
    GemvActivationFusionPass,
    GemvRopeFusionPass,
    fuse_epilogues,
)
from pieceworks.core.passes.graph_match import op_name
from pieceworks.kernels.activation.triton_gelu_and_mul import gelu_and_mul_op
from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_op
from pieceworks.kernels.gemv.small_m_fp8 import register_small_m_fp8_ops
from pieceworks.kernels.gemv.triton_gemv import (
    small_m_gelu_and_mul_linear_op,
    small_m_linear_op,
    small_m_silu_and_mul_linear_op,
)
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear_op
from pieceworks.kernels.rope.torch_rotary import rotary_embedding_op
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


def gelu_graph(linear_op, *linear_extra) -> torch.fx.Graph:
    """``gelu_and_mul(linear_op(x, w, *linear_extra), "tanh")``, Gemma's GeGLU."""
    small_m_gelu_and_mul_linear_op()
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    linear = graph.call_function(linear_op, (x, weight, *linear_extra))
    graph.output(graph.call_function(gelu_and_mul_op(), (linear, "tanh")))
    return graph


def test_a_gate_up_gemv_before_gelu_and_mul_is_fused_with_its_approximation():
    graph = gelu_graph(small_m_linear_op())
    assert GemvActivationFusionPass()(graph) == 1
    (fused,) = [n for n in graph.nodes if n.op == "call_function"]
    assert op_name(fused) == "small_m_gelu_and_mul_linear"
    assert fused.args == (*(n for n in graph.nodes if n.op == "placeholder"), "tanh")


def test_gelu_and_mul_after_a_biased_or_an_fp8_gemv_is_kept():
    graph = torch.fx.Graph()
    x, weight, bias = (graph.placeholder(name) for name in ("x", "weight", "bias"))
    linear = graph.call_function(small_m_linear_op(), (x, weight, bias))
    graph.output(graph.call_function(gelu_and_mul_op(), (linear, "tanh")))
    assert GemvActivationFusionPass()(graph) == 0
    assert ops_of(graph) == ["small_m_linear", "gelu_and_mul"]
    fp8_linear, _ = register_small_m_fp8_ops()
    fp8 = torch.fx.Graph()
    args = [fp8.placeholder(name) for name in ("x", "w", "si", "sw")]
    linear = fp8.call_function(fp8_linear, (*args, None, torch.float32, False))
    fp8.output(fp8.call_function(gelu_and_mul_op(), (linear, "tanh")))
    assert GemvActivationFusionPass()(fp8) == 0  # no FP8 GeGLU epilogue
    assert ops_of(fp8) == ["small_m_fp8_linear", "gelu_and_mul"]


def test_an_attention_into_a_buffer_it_did_not_allocate_is_not_counted():
    graph = torch.fx.Graph()
    query, key, value, output = (graph.placeholder(name) for name in ("q", "k", "v", "out"))
    graph.call_function(attention_op(), (query, key, value, output, "layers.0.attn"))
    graph.output(output)
    assert AttnQuantFusionPass()(graph) == 0
    assert ops_of(graph) == ["unified_attention_with_output"]


# -- attention writing FP8 ----------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def attention_graph(
    *,
    allocate=torch.empty_like,
    output_scale=None,
    extra_args=(),
    quant=("to", operator.truediv, "clamp", "to"),
    narrow_dtype=FP8,
    scale_after=False,
    other_reader=False,
    num_args=5,
) -> torch.fx.Graph:
    """``out = allocate(q); attention(q, k, v, out, name); quant(out.reshape(4, 8), s)``, each
    keyword changing one part of the sequence the pass matches."""
    graph = torch.fx.Graph()
    q, k, v, s = (graph.placeholder(name) for name in ("q", "k", "v", "scale"))
    out = graph.call_function(allocate, (q,))
    out.meta["example_value"] = torch.empty(4, 2, 4)
    args = (q, k, v, out, "layers.0.attn", *extra_args)[:num_args]
    kwargs = {} if output_scale is None else {"output_scale": output_scale}
    attention = graph.call_function(attention_op(), args, kwargs)
    if scale_after:
        s = graph.call_function(operator.mul, (s, 1.0))  # computed after the attention
    node = graph.call_method("reshape", (out, 4, 8))
    for step in quant:
        if step == "to" and node.target == "clamp":
            node = graph.call_method("to", (node, narrow_dtype))
            node.meta["example_value"] = torch.empty(4, 8, dtype=narrow_dtype)
        elif step == "to":
            node = graph.call_method("to", (node, torch.float32))
        elif step == "clamp":
            node = graph.call_method("clamp", (node,), {"min": -448.0, "max": 448.0})
        else:
            node = graph.call_function(step, (node, s))
    outputs = (node, attention) if not other_reader else (node, out)
    graph.output(outputs)
    return graph


def test_an_attention_followed_by_the_fp8_quantization_writes_fp8_itself():
    graph = attention_graph()
    assert AttnQuantFusionPass()(graph) == 1
    allocate, attention, reshape = (n for n in graph.nodes if n.op.startswith("call"))
    assert allocate.target is torch.empty_like and allocate.kwargs == {"dtype": FP8}
    assert allocate.meta["example_value"].dtype == FP8
    assert allocate.meta["example_value"].shape == (4, 2, 4)
    assert op_name(attention) == "unified_attention_with_output"
    scale = next(n for n in graph.nodes if n.name == "scale")
    assert attention.kwargs == {"output_scale": scale}
    assert (reshape.target, reshape.args) == ("reshape", (allocate, 4, 8))
    (output,) = [n for n in graph.nodes if n.op == "output"]
    assert output.args[0][0] is reshape  # o_proj now reads the FP8 output directly
    graph.lint()


def test_a_scale_computed_before_the_attention_is_fused():
    graph = torch.fx.Graph()
    q, k, v, s = (graph.placeholder(name) for name in ("q", "k", "v", "scale"))
    doubled = graph.call_function(operator.mul, (s, 2.0))
    out = graph.call_function(torch.empty_like, (q,))
    attention = graph.call_function(attention_op(), (q, k, v, out, "layers.0.attn"))
    node = graph.call_method("to", (graph.call_method("reshape", (out, 4, 8)), torch.float32))
    node = graph.call_method("clamp", (graph.call_function(operator.truediv, (node, doubled)),))
    node = graph.call_method("to", (node, FP8))
    node.meta["example_value"] = torch.empty(4, 8, dtype=FP8)
    graph.output((node, attention))
    assert AttnQuantFusionPass()(graph) == 1
    assert attention.kwargs == {"output_scale": doubled}


@pytest.mark.parametrize(
    "change",
    [
        {"allocate": torch.zeros_like},  # a buffer that holds values: not only the op's output
        {"num_args": 3},  # no output argument at all
        {"output_scale": 0.5},  # already quantizes
        {"extra_args": ("scale",), "num_args": 6},  # an output scale passed by position
        {"quant": ("to", operator.truediv, "to")},  # no clamp: not the static quantization
        {"quant": ("to", operator.mul, "clamp", "to")},
        {"narrow_dtype": torch.float8_e4m3fnuz},  # the attention kernels write e4m3fn only
        {"scale_after": True},  # the attention would read the scale before it exists
        {"other_reader": True},  # the unquantized output is read too
    ],
)
def test_the_attention_keeps_its_output_where_the_sequence_differs(change):
    graph = attention_graph(**change)
    before = [(n.op, n.target, n.args, dict(n.kwargs)) for n in graph.nodes]
    assert AttnQuantFusionPass()(graph) == 0
    assert [(n.op, n.target, n.args, dict(n.kwargs)) for n in graph.nodes] == before


# -- the rotary into the qkv GEMV -----------------------------------------------------------------

HEAD_SIZE = 8


def rope_graph(
    *,
    neox=True,
    cache_dims=HEAD_SIZE,
    sizes=(16, 8, 8),
    items=(0, 1),
    second_split=False,
    bias=None,
    query_read_elsewhere=False,
    rotary_read_whole=False,
) -> torch.fx.Graph:
    """``q, k, v = small_m_linear(x, w).split(sizes); q, k = rotary(p, q, k, cache, 8, neox)``."""
    small_m_rope_linear_op()  # the fused op exists, so only the graph can refuse it
    graph = torch.fx.Graph()
    x, w, positions, cache = (graph.placeholder(n) for n in ("x", "w", "positions", "cache"))
    if cache_dims is not None:
        cache.meta["example_value"] = torch.empty(64, cache_dims)
    linear_args = (x, w) if bias is None else (x, w, graph.placeholder("bias"))
    linear = graph.call_function(small_m_linear_op(), linear_args)
    split = graph.call_method("split", (linear, list(sizes)), {"dim": -1})
    query = graph.call_function(operator.getitem, (split, items[0]))
    source = split
    if second_split:
        source = graph.call_method("split", (linear, list(sizes)), {"dim": -1})
    key = graph.call_function(operator.getitem, (source, items[1]))
    value = graph.call_function(operator.getitem, (split, 2))
    rotary_args = (positions, query, key, cache, HEAD_SIZE, neox)
    rotary = graph.call_function(rotary_embedding_op(), rotary_args)
    outputs: list = [value]
    if rotary_read_whole:
        outputs.append(rotary)
    else:
        outputs += [graph.call_function(operator.getitem, (rotary, i)) for i in (0, 1)]
    if query_read_elsewhere:
        outputs.append(query)
    graph.output(tuple(outputs))
    return graph


def test_a_rotary_of_the_qkv_gemv_s_query_and_key_becomes_one_gemv():
    graph = rope_graph()
    assert GemvRopeFusionPass()(graph) == 1
    fused = next(n for n in graph.nodes if n.op == "call_function")
    assert op_name(fused) == "small_m_rope_linear"
    x, w, positions, cache = (n for n in graph.nodes if n.op == "placeholder")
    # (16 + 8) // 8 = 3 rotated heads: the query's two and the key's one.
    assert fused.args == (x, w, positions, cache, HEAD_SIZE, 3)
    assert [name for name in ops_of(graph) if name is not None] == ["small_m_rope_linear"]
    (output,) = [n for n in graph.nodes if n.op == "output"]
    value, query, key = output.args[0]
    assert [(n.target, n.args[1]) for n in (value, query, key)] == [
        (operator.getitem, 2),
        (operator.getitem, 0),
        (operator.getitem, 1),
    ]
    assert query.args[0].args[0] is fused  # the split of the fused GEMV's output
    graph.lint()


@pytest.mark.parametrize(
    "change",
    [
        {"neox": False},  # the epilogue rotates neox style only
        {"cache_dims": 4},  # rotary on part of each head
        {"cache_dims": None},  # the cache's shape unknown
        {"sizes": (16, 16)},  # not a [q, kv, kv] split
        {"items": (1, 0)},  # the key and query swapped
        {"second_split": True},  # query and key from two different splits
        {"bias": True},  # the fused op has no bias
        {"query_read_elsewhere": True},  # the unrotated query is needed too
        {"rotary_read_whole": True},  # the rotary's result read other than as its items
    ],
)
def test_the_rotary_is_kept_where_the_graph_differs(change):
    graph = rope_graph(**change)
    before = ops_of(graph)
    assert GemvRopeFusionPass()(graph) == 0
    assert ops_of(graph) == before


# -- the FP8 gate/up GEMV into the next layer's quantization ---------------------------------------


def fp8_gate_up_graph(quantized: bool) -> torch.fx.Graph:
    """``silu_and_mul(small_m_fp8_linear(x, w, si, sw, None, float32, False))``, then the
    static quantization of ``down_proj``'s input when ``quantized``."""
    linear_op, _ = register_small_m_fp8_ops()
    graph = torch.fx.Graph()
    x, w, si, sw, s = (graph.placeholder(n) for n in ("x", "w", "si", "sw", "s"))
    linear = graph.call_function(linear_op, (x, w, si, sw, None, torch.float32, False))
    node = graph.call_function(silu_and_mul_op(), (linear,))
    if quantized:
        node = graph.call_method("to", (node, torch.float32))
        node = graph.call_method("clamp", (graph.call_function(operator.truediv, (node, s)),))
        node = graph.call_method("to", (node, FP8))
        node.meta["example_value"] = torch.empty(4, 8, dtype=FP8)
    graph.output(node)
    return graph


def test_an_fp8_gate_up_gemv_fuses_with_the_next_layer_s_quantization():
    graph = fp8_gate_up_graph(quantized=True)
    assert GemvActivationFusionPass()(graph) == 1
    (fused,) = [n for n in graph.nodes if n.op == "call_function"]
    assert op_name(fused) == "small_m_fp8_silu_and_mul"
    x, w, si, sw, s = (n for n in graph.nodes if n.op == "placeholder")
    assert fused.args == (x, w, si, sw, s, torch.float32, False)
    assert fused.meta["example_value"].dtype == FP8  # the quantized value it now returns


def test_an_fp8_gate_up_gemv_whose_next_layer_is_not_fp8_is_kept():
    graph = fp8_gate_up_graph(quantized=False)
    assert GemvActivationFusionPass()(graph) == 0
    assert ops_of(graph) == ["small_m_fp8_linear", "silu_and_mul"]


# -- the passes together ---------------------------------------------------------------------------


def test_fuse_epilogues_counts_each_enabled_fusion_and_logs_them(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.passes.gemv_fusion")
    gm = torch.fx.GraphModule(torch.nn.Module(), gate_up_graph(None))
    counts = {"gemv_act": 1, "rope": 0, "qk_norm_rope": 0, "attn_quant": 0}
    assert fuse_epilogues(gm, PassConfig()) == counts
    assert "small_m_silu_and_mul_linear" in gm.code  # recompiled
    messages = {r.getMessage() for r in caplog.records if r.name.endswith("gemv_fusion")}
    assert messages == {f"epilogue fusions: {counts}"}
    caplog.clear()
    only_rope = PassConfig(
        enable_gemv_act_fusion=False,
        enable_qk_norm_rope_fusion=False,
        enable_attn_quant_fusion=False,
    )
    unfused = torch.fx.GraphModule(torch.nn.Module(), gate_up_graph(None))
    assert fuse_epilogues(unfused, only_rope) == {"rope": 0}
    assert not [r for r in caplog.records if r.name.endswith("gemv_fusion")]  # nothing fused
    assert ops_of(unfused.graph) == ["small_m_linear", "silu_and_mul"]
    off = PassConfig(
        enable_gemv_act_fusion=False,
        enable_rope_fusion=False,
        enable_qk_norm_rope_fusion=False,
        enable_attn_quant_fusion=False,
    )
    assert fuse_epilogues(unfused, off) == {}
