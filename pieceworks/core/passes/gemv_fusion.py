"""GEMV epilogue fusions: the gated activation into the gate/up GEMV, the rotary into the qkv GEMV.

The layers call plain ops: ``gate_up_proj -> act_fn -> down_proj`` and ``qkv_proj -> split ->
rotary_emb(positions, q, k)``. Where the chooser gave the linear layers the decode GEMV ops and the
activation and rotary their kernel forms, the graph Dynamo captures holds, per decoder layer,
``small_m_linear -> silu_and_mul`` (Gemma's GeGLU: ``gelu_and_mul``, tanh or erf) and
``small_m_linear -> split -> rotary_embedding`` (FP8:
``small_m_fp8_linear``, and between the activation and ``down_proj`` the static quantization of
``down_proj``'s input, ``core.norm_quant.static_scaled_fp8_quant``). These passes replace them
with the fused ops that exist for them:

    silu_and_mul(small_m_linear(x, W))  -> small_m_silu_and_mul_linear(x, W)
    gelu_and_mul(small_m_linear(x, W), a)
                                        -> small_m_gelu_and_mul_linear(x, W, a)
    quant(silu_and_mul(small_m_fp8_linear(x, W, si, sw)), s)
                                        -> small_m_fp8_silu_and_mul(x, W, si, sw, s)
    rotary_embedding(p, q, k, cache, D, neox), q, k of split(small_m_linear(x, W))
                                        -> q, k of split(small_m_rope_linear(x, W, p, cache, D, H))
                                        (H = Hq + Hkv rotated heads; FP8: small_m_fp8_rope_linear)

so the compiled decode graph runs one GEMV with the epilogue where the unfused graph runs a GEMV and
an elementwise kernel. They run on the whole graph Dynamo hands the level-3 backend, before it is
split (``core/backend.py``), for every compile backend (eager included), so the pieces Inductor
compiles hold the fused ops and nothing else changes. A match needs: no bias, every intermediate
read only by the next node of the sequence, and for the rotary neox style on every dim (what the
epilogue rotates). GeGLU is fused after an unquantized gate/up GEMV only: there is no FP8 GEMV with
the GELU and the next layer's quantization as its epilogue, so an FP8 Gemma's ``small_m_fp8_linear
-> gelu_and_mul`` stays as it is. The GeGLU epilogue computes the GELU as the ``gelu_and_mul``
kernel does, from the gate and up values rounded as the GEMV stores them.
``PassConfig.enable_gemv_act_fusion`` and ``enable_rope_fusion`` switch them; level 0 runs the plain
ops, so eager is the oracle of the fused graphs' numerics.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from pieceworks.core.config import PassConfig
from pieceworks.core.passes.graph_match import (
    erase_sequence,
    example_value,
    fp8_quant_after,
    op_name,
    pieceworks_op,
    sole_source,
)
from pieceworks.logger import init_logger

logger = init_logger(__name__)

# The ops the passes read and write, in pieceworks' library namespace. They are registered by
# the layers that use them (models/layers, kernels/); the passes only name them.
ACTIVATION_OP = "silu_and_mul"
GELU_ACTIVATION_OP = "gelu_and_mul"
ROTARY_OP = "rotary_embedding"
LINEAR_OP = "small_m_linear"
FP8_LINEAR_OP = "small_m_fp8_linear"
GATED_LINEAR_OP = "small_m_silu_and_mul_linear"
GELU_GATED_LINEAR_OP = "small_m_gelu_and_mul_linear"
FP8_GATED_LINEAR_OP = "small_m_fp8_silu_and_mul"
ROPE_LINEAR_OP = "small_m_rope_linear"
FP8_ROPE_LINEAR_OP = "small_m_fp8_rope_linear"
FP8_BIAS_INDEX = 4  # small_m_fp8_linear(x_fp8, weight, input_scale, weight_scale, bias, ...)


def _bias(linear: torch.fx.Node) -> Any:
    index = 2 if op_name(linear) == LINEAR_OP else FP8_BIAS_INDEX
    return linear.args[index] if len(linear.args) > index else linear.kwargs.get("bias")


def _plain_linear(node: torch.fx.Node) -> bool:
    """A GEMV op without bias whose output only one node reads."""
    return (
        op_name(node) in (LINEAR_OP, FP8_LINEAR_OP) and _bias(node) is None and len(node.users) == 1
    )


class GemvActivationFusionPass:
    """``silu_and_mul`` after a gate/up GEMV (and the next FP8 layer's quantization), or
    ``gelu_and_mul`` after an unquantized one -> one op."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        num_fused = 0
        for activation in list(graph.nodes):
            if op_name(activation) == ACTIVATION_OP:
                num_fused += self._fuse(graph, activation)
            elif op_name(activation) == GELU_ACTIVATION_OP:
                num_fused += self._fuse_gelu(graph, activation)
        return num_fused

    def _fuse_gelu(self, graph: torch.fx.Graph, activation: torch.fx.Node) -> int:
        """``gelu_and_mul(small_m_linear(x, W), approximate)`` -> ``small_m_gelu_and_mul_linear(x,
        W, approximate)``; an FP8 gate/up GEMV keeps its activation (no FP8 GeGLU epilogue)."""
        chain: list[torch.fx.Node] = []
        linear = sole_source(activation.args[0], chain)  # type: ignore[arg-type]
        fused_op = pieceworks_op(GELU_GATED_LINEAR_OP)
        if op_name(linear) != LINEAR_OP or not _plain_linear(linear) or fused_op is None:
            return 0
        approximate = (
            activation.args[1] if len(activation.args) > 1 else activation.kwargs["approximate"]
        )
        with graph.inserting_before(activation):
            fused = graph.call_function(fused_op, (*linear.args[:2], approximate))
        fused.meta = dict(activation.meta)  # the same (T, I) value
        activation.replace_all_uses_with(fused)
        erase_sequence(graph, [activation, *chain, linear])
        return 1

    def _fuse(self, graph: torch.fx.Graph, activation: torch.fx.Node) -> int:
        chain: list[torch.fx.Node] = [activation]
        linear = sole_source(activation.args[0], chain)  # type: ignore[arg-type]
        if not _plain_linear(linear):
            return 0
        if op_name(linear) == LINEAR_OP:
            fused_op, replaced, args = pieceworks_op(GATED_LINEAR_OP), activation, linear.args[:2]
        else:
            quantized = fp8_quant_after(activation, chain)
            if quantized is None:  # the next layer is not FP8: nothing to hand it quantized
                return 0
            replaced, out_scale = quantized
            x_fp8, weight, input_scale, weight_scale, _, out_dtype, native = linear.args
            fused_op = pieceworks_op(FP8_GATED_LINEAR_OP)
            args = (x_fp8, weight, input_scale, weight_scale, out_scale, out_dtype, native)
        if fused_op is None:
            return 0
        with graph.inserting_before(replaced):
            fused = graph.call_function(fused_op, tuple(args))
        fused.meta = dict(replaced.meta)  # the same (T, I) value
        replaced.replace_all_uses_with(fused)
        erase_sequence(graph, [replaced, *chain, linear])
        return 1


class GemvRopeFusionPass:
    """``rotary_embedding`` of the q and k a qkv GEMV produced -> the GEMV with the rotation."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        num_fused = 0
        for rotary in list(graph.nodes):
            if op_name(rotary) == ROTARY_OP:
                num_fused += self._fuse(graph, rotary)
        return num_fused

    def _fuse(self, graph: torch.fx.Graph, rotary: torch.fx.Node) -> int:
        positions, query, key, cos_sin_cache, head_size, is_neox_style = rotary.args
        cache = example_value(cos_sin_cache)
        if not is_neox_style or cache is None or cache.shape[1] != head_size:
            return 0
        split = _split_of(query, key, rotary)
        if split is None:
            return 0
        chain: list[torch.fx.Node] = []
        linear = sole_source(split.args[0], chain)  # type: ignore[arg-type]
        if not _plain_linear(linear):
            return 0
        sizes = split.args[1]
        num_rotary_heads = (sizes[0] + sizes[1]) // head_size  # type: ignore[index, operator]
        rope = (positions, cos_sin_cache, head_size, num_rotary_heads)
        if op_name(linear) == LINEAR_OP:
            fused_op, args = pieceworks_op(ROPE_LINEAR_OP), (*linear.args[:2], *rope)
        else:
            x_fp8, weight, input_scale, weight_scale, _, out_dtype, native = linear.args
            fused_op = pieceworks_op(FP8_ROPE_LINEAR_OP)
            args = (x_fp8, weight, input_scale, weight_scale, *rope, out_dtype, native)
        if fused_op is None:
            return 0
        with graph.inserting_before(linear):
            fused = graph.call_function(fused_op, tuple(args))
        fused.meta = dict(linear.meta)  # the same (T, (Hq + 2 Hkv) D) value, q and k rotated
        linear.replace_all_uses_with(fused)
        for reader in list(rotary.users):  # getitem(rotary, 0 | 1): the split's q and k now
            reader.replace_all_uses_with(query if reader.args[1] == 0 else key)  # type: ignore[arg-type]
        erase_sequence(graph, [*rotary.users, rotary, linear])
        return 1


def _split_of(query: Any, key: Any, rotary: torch.fx.Node) -> torch.fx.Node | None:
    """The ``qkv.split([q, kv, kv], dim=-1)`` whose items 0 and 1 are ``query`` and ``key``,
    read by ``rotary`` alone, and ``rotary``'s outputs read only as items."""
    items = [query, key]
    for index, item in enumerate(items):
        if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem):
            return None
        if item.args[1] != index or set(item.users) != {rotary}:
            return None
    split = query.args[0]
    if key.args[0] is not split or split.op != "call_method" or split.target != "split":
        return None
    sizes = split.args[1] if len(split.args) > 1 else None
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 3:
        return None
    if any(reader.target is not operator.getitem for reader in rotary.users):
        return None
    return split


def fuse_epilogues(gm: torch.fx.GraphModule, pass_config: PassConfig) -> dict[str, int]:
    """Run the enabled epilogue fusions on Dynamo's graph ``gm`` (the GEMV ones, then attention
    writing FP8); how many of each were made."""
    from pieceworks.core.passes.attn_quant_fusion import AttnQuantFusionPass

    counts: dict[str, int] = {}
    if pass_config.enable_gemv_act_fusion:
        counts["gemv_act"] = GemvActivationFusionPass()(gm.graph)
    if pass_config.enable_rope_fusion:
        counts["rope"] = GemvRopeFusionPass()(gm.graph)
    if pass_config.enable_attn_quant_fusion:
        counts["attn_quant"] = AttnQuantFusionPass()(gm.graph)
    if any(counts.values()):
        gm.graph.lint()
        gm.recompile()
        logger.debug("epilogue fusions: %s", counts)
    return counts
