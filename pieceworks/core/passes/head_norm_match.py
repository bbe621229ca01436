"""Finding a per-head RMSNorm in the graph Dynamo captures: ``head_norm_before``.

Qwen3 and Gemma 3 normalise each q and k head between the qkv split and the rotary:
``norm(q.reshape(-1, D)).view(-1, Hq * D)``, the norm being ``core.norm_quant.rms_norm`` or
``gemma_rms_norm`` as the layers call them. Dynamo records those functions as tensor methods and
operators, which this module matches step by step (what the two functions trace to):

    t = x.to(float32); r = rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps); n = t * r
    rms_norm:        n.to(dtype) * weight
    gemma_rms_norm:  (n * (1.0 + weight.to(float32))).to(dtype)

``tests/models/test_qk_norm_rope_fusion.py`` traces both models, so a change to the norms'
arithmetic that stops the match fails there.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from pieceworks.core.passes.graph_match import is_view


@dataclasses.dataclass(frozen=True)
class HeadNorm:
    """A matched head norm: ``source`` (the node whose (T, H * D) value it normalises, before
    the reshape to heads), its ``weight`` node, ``epsilon``, ``unit_offset`` (Gemma's form), and
    ``nodes``, everything from the reshape to the view after the norm (to erase once fused)."""

    source: torch.fx.Node
    weight: Any
    epsilon: float
    unit_offset: bool
    nodes: list[torch.fx.Node]


def _call(node: Any, target: Any, num_users: int = 1) -> bool:
    """``node`` calls ``target`` (a function, or a method name) and has ``num_users`` readers."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != num_users:
        return False
    kind = "call_method" if isinstance(target, str) else "call_function"
    return node.op == kind and node.target == target


def _to(node: Any, dtype: Any = None, num_users: int = 1) -> bool:
    """``node`` is ``.to(dtype)`` (any dtype where None) with ``num_users`` readers."""
    if not _call(node, "to", num_users) or len(node.args) != 2 or node.kwargs:
        return False
    return isinstance(node.args[1], torch.dtype) and dtype in (None, node.args[1])


def _scaled(node: torch.fx.Node) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """``(x, eps, steps)`` if ``node`` is ``t * rsqrt(t.pow(2).mean(-1, keepdim) + eps)``,
    ``t = x.to(float32)``; ``steps`` are the nodes from ``t`` to ``node``."""
    if not _call(node, operator.mul) or len(node.args) != 2:
        return None
    widened, rsqrt = node.args
    if not (_to(widened, torch.float32, num_users=2) and _call(rsqrt, torch.rsqrt)):
        return None
    add = rsqrt.args[0]  # type: ignore[union-attr]
    if not _call(add, operator.add) or not isinstance(add.args[1], float):  # type: ignore[union-attr]
        return None
    mean = add.args[0]  # type: ignore[union-attr]
    if not _call(mean, "mean") or mean.kwargs != {"dim": -1, "keepdim": True}:  # type: ignore[union-attr]
        return None
    square = mean.args[0]  # type: ignore[union-attr]
    if not _call(square, "pow") or square.args != (widened, 2):  # type: ignore[union-attr]
        return None
    steps = [node, rsqrt, add, mean, square, widened]
    return widened.args[0], add.args[1], steps  # type: ignore[union-attr, return-value]


def _norm_parts(out: torch.fx.Node) -> tuple[torch.fx.Node, Any, bool, list[torch.fx.Node]] | None:
    """``(scaled, weight, unit_offset, nodes)`` of the norm whose output is ``out``: ``scaled``
    the ``t * r`` node, ``nodes`` the steps after it (with ``out``)."""
    if _call(out, operator.mul) and len(out.args) == 2 and _to(out.args[0]):
        rounded: Any = out.args[0]  # rms_norm: n.to(dtype) * weight
        return rounded.args[0], out.args[1], False, [out, rounded]
    if not (_to(out) and _call(out.args[0], operator.mul)):
        return None
    product = out.args[0]  # gemma_rms_norm: (n * (1.0 + weight.to(float32))).to(dtype)
    scaled, offset = product.args  # type: ignore[union-attr]
    if not (_call(offset, operator.add) and offset.args[0] == 1.0):  # type: ignore[union-attr]
        return None  # (an FX node compares by identity: never equal to 1.0)
    widened_weight = offset.args[1]  # type: ignore[union-attr]
    if not _to(widened_weight, torch.float32):
        return None
    nodes = [out, product, offset, widened_weight]
    return scaled, widened_weight.args[0], True, nodes  # type: ignore[union-attr, return-value]


def head_norm_before(node: Any, head_size: int) -> HeadNorm | None:
    """The per-head norm whose output ``node`` is, viewed back to (T, H * D) and read only by
    the node after it; None where ``node`` is anything else."""
    if not (isinstance(node, torch.fx.Node) and is_view(node) and len(node.users) == 1):
        return None
    out = node.args[0]
    if not isinstance(out, torch.fx.Node) or len(out.users) != 1:
        return None
    parts = _norm_parts(out)
    if parts is None:
        return None
    scaled, weight, unit_offset, steps = parts
    matched = _scaled(scaled)
    if matched is None:
        return None
    heads, epsilon, scale_steps = matched
    if not (isinstance(heads, torch.fx.Node) and is_view(heads) and len(heads.users) == 1):
        return None
    value = heads.meta.get("example_value")
    if value is None or value.shape[-1] != head_size:
        return None
    nodes = [node, *steps, *scale_steps, heads]
    return HeadNorm(heads.args[0], weight, epsilon, unit_offset, nodes)  # type: ignore[arg-type]
