"""The RMSNorm (with its residual add) before a decode GEMV, fused into the GEMV as its prologue.

The decoder layers call ``input_layernorm(x, residual) -> qkv_proj`` and
``post_attention_layernorm(x, residual) -> gate_up_proj``; ``RMSNorm`` calls
``core.norm_quant.rms_norm`` or ``add_rms_norm``, which Dynamo records as tensor methods and
operators (matched step by step here, as ``head_norm_match.py`` matches the head norms):

    h = x.to(float32) + residual.to(float32); new_residual = h.to(dtype)   (add_rms_norm)
    h = x.to(float32)                                                      (rms_norm)
    normed = (h * rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype) * w

Where ``normed`` is read only by a GEMV op (through reshapes read only by the next), the pass
replaces the norm and the GEMV with the op that runs both (``kernels/gemv/triton_gemv_norm.py``),
given the norm's operands before the GEMV's own arguments after its x:

    small_m_linear(normed, W, b)           -> small_m_rms_norm_linear(x, residual, w, eps, W, b)
    small_m_silu_and_mul_linear(normed, W) -> small_m_rms_norm_silu_and_mul_linear(x, ..., W)
    small_m_rope_linear(normed, W, ...)    -> small_m_rms_norm_rope_linear(x, ..., W, ...)
    small_m_qk_norm_rope_linear(normed, W, ...)
                                           -> small_m_rms_norm_qk_norm_rope_linear(x, ..., W, ...)

(``residual`` None for ``rms_norm``). The fused op returns ``(result, new_residual)``; the
residual's readers (any number, e.g. the next layer's norm) read its second item. It runs after
the GEMV epilogue fusions (``gemv_fusion.py``), whose fused ops it takes, on the whole graph
Dynamo hands the level-3 backend, before the split. Not matched: Gemma's norm (the sum rounded
before the norm, ``1 + w`` in float32), a platform's own ``rms_norm``, FP8 GEMVs (their input is
quantized after the norm; the RMSNorm + quant fusion takes those), a normed tensor read by
anything else, a residual read before the GEMV. ``PassConfig.enable_norm_gemv_fusion``
switches it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from pieceworks.core.passes.graph_match import (
    calls,
    erase_sequence,
    example_value,
    is_to,
    op_name,
    pieceworks_op,
    rsqrt_scaled,
    sole_source,
)

# The GEMV ops the pass takes -> their form with the norm as a prologue.
NORM_GEMV_OPS = {
    "small_m_linear": "small_m_rms_norm_linear",
    "small_m_silu_and_mul_linear": "small_m_rms_norm_silu_and_mul_linear",
    "small_m_rope_linear": "small_m_rms_norm_rope_linear",
    "small_m_qk_norm_rope_linear": "small_m_rms_norm_qk_norm_rope_linear",
}


@dataclasses.dataclass(frozen=True)
class HiddenNorm:
    """A matched ``rms_norm`` / ``add_rms_norm``: its operands (``residual`` None for
    ``rms_norm``), the node of the new residual (None where nothing reads it) and ``nodes``,
    the steps to erase once fused (the output first)."""

    input: torch.fx.Node
    residual: torch.fx.Node | None
    weight: Any
    epsilon: float
    new_residual: torch.fx.Node | None
    nodes: list[torch.fx.Node]


def hidden_norm_before(normed: torch.fx.Node) -> HiddenNorm | None:
    """The ``rms_norm`` or ``add_rms_norm`` whose normalised output ``normed`` is, rounded to its
    input's dtype (``n.to(dtype) * weight``); None where it is anything else."""
    if not (calls(normed, operator.mul, num_users=None) and len(normed.args) == 2):
        return None
    rounded, weight = normed.args
    matched = rsqrt_scaled(rounded.args[0]) if is_to(rounded) else None  # type: ignore[union-attr]
    if matched is None:
        return None
    widened, epsilon, steps = matched
    dtype = rounded.args[1]  # type: ignore[union-attr]
    nodes: list[torch.fx.Node] = [normed, rounded, *steps, widened]  # type: ignore[list-item]
    if is_to(widened, torch.float32, num_users=2):  # rms_norm
        parts: tuple[Any, Any, Any] | None = (widened.args[0], None, None)
    else:
        parts = _residual_sum(widened, dtype, nodes)
    if parts is None or getattr(example_value(parts[0]), "dtype", None) != dtype:
        return None  # the norm is rounded to its input's dtype, as the fused op rounds it
    return HiddenNorm(parts[0], parts[1], weight, epsilon, parts[2], nodes)  # type: ignore[arg-type]


def _residual_sum(
    widened: torch.fx.Node, dtype: Any, nodes: list[torch.fx.Node]
) -> tuple[Any, Any, Any] | None:
    """``(x, residual, new_residual)`` if ``widened`` is ``x.to(float32) + residual.to(float32)``
    read by the norm's two steps and at most its rounding to ``dtype`` (the new residual); its
    nodes are appended to ``nodes``."""
    if not calls(widened, operator.add, num_users=None) or len(widened.args) != 2:
        return None
    if not all(is_to(operand, torch.float32) for operand in widened.args):
        return None
    others = [reader for reader in widened.users if reader not in nodes]
    if len(widened.users) - len(others) != 2 or len(others) > 1:
        return None  # read by the square and the scaling, and at most the new residual
    new_residual = others[0] if others else None
    if new_residual is not None and not is_to(new_residual, dtype, num_users=None):
        return None
    x, residual = (operand.args[0] for operand in widened.args)  # type: ignore[union-attr]
    nodes.extend([*widened.args, *([new_residual] if new_residual is not None else [])])  # type: ignore[list-item]
    return x, residual, new_residual


class NormGemvFusionPass:
    """``rms_norm`` / ``add_rms_norm`` read only by a GEMV op -> the GEMV with the norm as its
    prologue (see the module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        num_fused = 0
        for gemv in list(graph.nodes):
            if op_name(gemv) in NORM_GEMV_OPS:
                num_fused += self._fuse(graph, gemv)
        return num_fused

    def _fuse(self, graph: torch.fx.Graph, gemv: torch.fx.Node) -> int:
        chain: list[torch.fx.Node] = []
        normed = sole_source(gemv.args[0], chain)  # type: ignore[arg-type]
        if not isinstance(normed, torch.fx.Node) or len(normed.users) != 1:
            return 0  # the normalised tensor is read by something else too
        norm = hidden_norm_before(normed)
        fused_op = pieceworks_op(NORM_GEMV_OPS[op_name(gemv)])  # type: ignore[index]
        if norm is None or fused_op is None or not _rows_like(norm.input, gemv.args[0]):
            return 0
        if norm.new_residual is not None and _read_before(norm.new_residual, gemv):
            return 0  # the fused op gives the residual where the GEMV was: too late for it
        args = (norm.input, norm.residual, norm.weight, norm.epsilon, *gemv.args[1:])
        with graph.inserting_before(gemv):
            fused = graph.call_function(fused_op, args, dict(gemv.kwargs))  # (result, residual)
            result = graph.call_function(operator.getitem, (fused, 0))
            if norm.new_residual is not None:
                new_residual = graph.call_function(operator.getitem, (fused, 1))
                new_residual.meta = dict(norm.new_residual.meta)
                norm.new_residual.replace_all_uses_with(new_residual)
        result.meta = dict(gemv.meta)
        gemv.replace_all_uses_with(result)
        erase_sequence(graph, [gemv, *chain, *norm.nodes])
        return 1


def _rows_like(x: torch.fx.Node, gemv_input: Any) -> bool:
    """Whether the norm's input is the (T, K) rows the GEMV reads (views of them aside)."""
    value, read = example_value(x), example_value(gemv_input)
    if value is None or read is None or value.dim() != 2 or read.dim() != 2:
        return False
    return value.shape[-1] == read.shape[-1]


def _read_before(value: torch.fx.Node, stop: torch.fx.Node) -> bool:
    """Whether a reader of ``value`` comes before ``stop`` in the graph's order."""
    readers = set(value.users)
    node = value.next
    while node is not stop and node.op != "root":
        if node in readers:
            return True
        node = node.next
    return False
