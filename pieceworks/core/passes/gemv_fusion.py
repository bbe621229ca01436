"""GEMV epilogue fusions: the gated activation into the gate/up GEMV, the rotary (and the q/k
head norms before it) into the qkv GEMV.

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
    rotary_embedding(p, norm_q(q), norm_k(k), cache, D, neox), q, k of split(small_m_linear(x, W))
                                        -> q, k of split(small_m_qk_norm_rope_linear(x, W, p,
                                           cache, D, Hq, Hkv, w_q, w_k, eps, unit_offset))

so the compiled decode graph runs one GEMV with the epilogue where the unfused graph runs a GEMV and
an elementwise kernel. In the last, ``norm_q`` and ``norm_k`` are per-head RMSNorms (Qwen3,
Gemma 3: ``q.reshape(-1, D)`` normalised, then viewed back) as ``head_norm_match.py`` finds them,
both of one form (``rms_norm``, or Gemma's ``gemma_rms_norm``: ``unit_offset``) and one eps; that
op runs the GEMV and then one kernel that normalises and rotates the q and k heads in place
(``kernels/gemv/triton_gemv_qk_norm_rope.py`` says why not one kernel); FP8 GEMVs keep the
unfused path there. The passes run on the whole graph Dynamo hands the level-3 backend, before it
is split (``core/backend.py``), for every compile backend (eager included), so the pieces Inductor
compiles hold the fused ops and nothing else changes. A match needs: no bias, every intermediate
read only by the next node of the sequence, and for the rotary neox style on every dim (what the
epilogue rotates). GeGLU is fused after an unquantized gate/up GEMV only: there is no FP8 GEMV with
the GELU and the next layer's quantization as its epilogue, so an FP8 Gemma's ``small_m_fp8_linear
-> gelu_and_mul`` stays as it is. The GeGLU epilogue computes the GELU as the ``gelu_and_mul``
kernel does, from the gate and up values rounded as the GEMV stores them.
``PassConfig.enable_gemv_act_fusion``, ``enable_rope_fusion`` and ``enable_qk_norm_rope_fusion``
switch them; level 0 runs the plain ops, so eager is the oracle of the fused graphs' numerics.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
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
from pieceworks.core.passes.head_norm_match import head_norm_before
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
QK_NORM_ROPE_LINEAR_OP = "small_m_qk_norm_rope_linear"
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


class _RotaryFusionPass(ABC):
    """A pass that replaces the qkv GEMV under each ``rotary_embedding`` it can match; each
    subclass's ``_fuse`` says what it matches under a neox rotation of every dim."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        num_fused = 0
        for rotary in list(graph.nodes):
            if op_name(rotary) == ROTARY_OP and _rotates_every_dim_neox(rotary):
                num_fused += self._fuse(graph, rotary)
        return num_fused

    @abstractmethod
    def _fuse(self, graph: torch.fx.Graph, rotary: torch.fx.Node) -> int:
        """Fuse the GEMV under ``rotary`` where the pattern matches; 1 if it did, else 0."""


class GemvRopeFusionPass(_RotaryFusionPass):
    """``rotary_embedding`` of the q and k a qkv GEMV produced -> the GEMV with the rotation."""

    def _fuse(self, graph: torch.fx.Graph, rotary: torch.fx.Node) -> int:
        positions, query, key, cos_sin_cache, head_size, _ = rotary.args
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
        _replace_linear_and_rotary(graph, rotary, linear, (fused_op, args), (query, key), [])
        return 1


class GemvQKNormRopeFusionPass(_RotaryFusionPass):
    """``rotary_embedding`` of q and k heads normalised after a qkv GEMV's split -> one op that
    runs the GEMV, the norms and the rotation."""

    def _fuse(self, graph: torch.fx.Graph, rotary: torch.fx.Node) -> int:
        positions, query, key, cos_sin_cache, head_size, _ = rotary.args
        q_norm, k_norm = head_norm_before(query, head_size), head_norm_before(key, head_size)  # type: ignore[arg-type]
        if q_norm is None or k_norm is None or not _read_as_items(rotary):
            return 0
        if (q_norm.epsilon, q_norm.unit_offset) != (k_norm.epsilon, k_norm.unit_offset):
            return 0
        if len(q_norm.source.users) != 1 or len(k_norm.source.users) != 1:
            return 0  # q or k also read unnormalised: the fused op no longer gives them
        split = _qkv_split(q_norm.source, k_norm.source)
        chain: list[torch.fx.Node] = []
        linear = sole_source(split.args[0], chain) if split is not None else None  # type: ignore[arg-type]
        fused_op = pieceworks_op(QK_NORM_ROPE_LINEAR_OP)
        if linear is None or op_name(linear) != LINEAR_OP or not _plain_linear(linear):
            return 0
        produced, normed = example_value(linear), example_value(query)
        if fused_op is None or produced is None or normed is None or produced.dtype != normed.dtype:
            return 0
        q_size, kv_size, _ = split.args[1]  # type: ignore[union-attr, misc]
        norm = (q_norm.weight, k_norm.weight, q_norm.epsilon, q_norm.unit_offset)
        heads = (head_size, q_size // head_size, kv_size // head_size)  # type: ignore[operator]
        args = (*linear.args[:2], positions, cos_sin_cache, *heads, *norm)
        items = (q_norm.source, k_norm.source)
        _replace_linear_and_rotary(
            graph, rotary, linear, (fused_op, args), items, [*q_norm.nodes, *k_norm.nodes]
        )
        return 1


def _rotates_every_dim_neox(rotary: torch.fx.Node) -> bool:
    """What the fused rotations implement: neox style, on every dim of the head."""
    _, _, _, cos_sin_cache, head_size, is_neox_style = rotary.args
    cache = example_value(cos_sin_cache)
    return bool(is_neox_style) and cache is not None and cache.shape[1] == head_size


def _replace_linear_and_rotary(
    graph: torch.fx.Graph,
    rotary: torch.fx.Node,
    linear: torch.fx.Node,
    call: tuple[Any, tuple],
    items: tuple[Any, Any],
    also_erased: list[torch.fx.Node],
) -> None:
    """Put ``call`` (op, args: the same (T, (Hq + 2 Hkv) D) value with q and k done) where
    ``linear`` was; ``rotary``'s q and k outputs become the split's ``items``; erase the rest."""
    with graph.inserting_before(linear):
        fused = graph.call_function(call[0], tuple(call[1]))
    fused.meta = dict(linear.meta)
    linear.replace_all_uses_with(fused)
    for reader in list(rotary.users):  # getitem(rotary, 0 | 1): the split's q and k now
        reader.replace_all_uses_with(items[0] if reader.args[1] == 0 else items[1])
    erase_sequence(graph, [*rotary.users, rotary, *also_erased, linear])


def _split_of(query: Any, key: Any, rotary: torch.fx.Node) -> torch.fx.Node | None:
    """The ``qkv.split([q, kv, kv], dim=-1)`` whose items 0 and 1 are ``query`` and ``key``,
    read by ``rotary`` alone, and ``rotary``'s outputs read only as items."""
    split = _qkv_split(query, key)
    if split is None or not _read_as_items(rotary):
        return None
    if set(query.users) != {rotary} or set(key.users) != {rotary}:
        return None
    return split


def _qkv_split(query: Any, key: Any) -> torch.fx.Node | None:
    """The ``qkv.split([q, kv, kv], dim=-1)`` whose items 0 and 1 are ``query`` and ``key``."""
    for index, item in enumerate([query, key]):
        if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem):
            return None
        if item.args[1] != index:
            return None
    split = query.args[0]
    if key.args[0] is not split or split.op != "call_method" or split.target != "split":
        return None
    sizes = split.args[1] if len(split.args) > 1 else None
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 3:
        return None
    return split


def _read_as_items(rotary: torch.fx.Node) -> bool:
    return all(reader.target is operator.getitem for reader in rotary.users)


def fuse_epilogues(gm: torch.fx.GraphModule, pass_config: PassConfig) -> dict[str, int]:
    """Run the enabled epilogue fusions on Dynamo's graph ``gm`` (the GEMV ones, then attention
    writing FP8); how many of each were made."""
    from pieceworks.core.passes.attn_quant_fusion import AttnQuantFusionPass

    counts: dict[str, int] = {}
    if pass_config.enable_gemv_act_fusion:
        counts["gemv_act"] = GemvActivationFusionPass()(gm.graph)
    if pass_config.enable_rope_fusion:
        counts["rope"] = GemvRopeFusionPass()(gm.graph)
    if pass_config.enable_qk_norm_rope_fusion:
        counts["qk_norm_rope"] = GemvQKNormRopeFusionPass()(gm.graph)
    if pass_config.enable_attn_quant_fusion:
        counts["attn_quant"] = AttnQuantFusionPass()(gm.graph)
    if any(counts.values()):
        gm.graph.lint()
        gm.recompile()
        logger.debug("epilogue fusions: %s", counts)
    return counts
