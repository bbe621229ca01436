"""Matching helpers the epilogue fusion passes share, on the FX graph Dynamo captures.

Dynamo's graph calls pieceworks' ops as ``torch.ops.pieceworks.<name>`` (packet or overload),
torch functions and tensor methods (``reshape``, ``to``, ``clamp``) as written in the layers, and
lifts parameters to placeholders. A fusion finds a sequence by following single readers, allows
reshapes between its steps, and erases the sequence once its result is replaced.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from pieceworks.core.config import LIBRARY_NAMESPACE

VIEW_METHODS = ("reshape", "view")


def op_name(node: torch.fx.Node) -> str | None:
    """The name of the pieceworks op ``node`` calls (packet or overload), else None."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", node.target)
    qualified = getattr(packet, "_qualified_op_name", "")
    namespace, _, name = qualified.partition("::")
    return name if namespace == LIBRARY_NAMESPACE else None


def pieceworks_op(name: str) -> Any:
    """``torch.ops.pieceworks.<name>.default``, or None while it is not registered."""
    namespace = getattr(torch.ops, LIBRARY_NAMESPACE)
    return getattr(namespace, name).default if hasattr(namespace, name) else None


def is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target in VIEW_METHODS


def sole_source(node: torch.fx.Node, chain: list[torch.fx.Node]) -> torch.fx.Node:
    """The node ``node`` views (through reshapes), each view read only by the next: appended to
    ``chain``. The node returned is not checked for other readers."""
    while is_view(node) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    return node


def calls(node: Any, target: Any, num_users: int | None = 1) -> bool:
    """``node`` calls ``target`` (a function, or a method name) and has ``num_users`` readers
    (any number where None)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if num_users is not None and len(node.users) != num_users:
        return False
    kind = "call_method" if isinstance(target, str) else "call_function"
    return node.op == kind and node.target == target


def is_to(node: Any, dtype: Any = None, num_users: int | None = 1) -> bool:
    """``node`` is ``.to(dtype)`` (any dtype where None) with ``num_users`` readers."""
    if not calls(node, "to", num_users) or len(node.args) != 2 or node.kwargs:
        return False
    return isinstance(node.args[1], torch.dtype) and dtype in (None, node.args[1])


def rsqrt_scaled(node: Any) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """``(t, eps, steps)`` if ``node`` is ``t * rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)``,
    the step RMSNorm's torch forms (``core.norm_quant``) trace to; ``steps`` are the nodes from
    ``node`` up to the square, each read only by the next. Who else reads ``t`` is the caller's
    to check."""
    if not calls(node, operator.mul) or len(node.args) != 2:
        return None
    widened, rsqrt = node.args
    if not (isinstance(widened, torch.fx.Node) and calls(rsqrt, torch.rsqrt)):
        return None
    add = rsqrt.args[0]  # type: ignore[union-attr]
    if not calls(add, operator.add) or not isinstance(add.args[1], float):  # type: ignore[union-attr]
        return None
    mean = add.args[0]  # type: ignore[union-attr]
    if not calls(mean, "mean") or mean.kwargs != {"dim": -1, "keepdim": True}:  # type: ignore[union-attr]
        return None
    square = mean.args[0]  # type: ignore[union-attr]
    if not calls(square, "pow") or square.args != (widened, 2):  # type: ignore[union-attr]
        return None
    return widened, add.args[1], [node, rsqrt, add, mean, square]  # type: ignore[union-attr, return-value]


def sole_reader(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def example_value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def erase_sequence(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase the replaced sequence ``nodes``: each once nothing reads it any more."""
    remaining = list(dict.fromkeys(nodes))
    while remaining:
        dead = [node for node in remaining if not node.users]
        if not dead:
            raise AssertionError(f"fused sequence still read: {[n.name for n in remaining]}")
        for node in dead:
            graph.erase_node(node)
            remaining.remove(node)


def fp8_quant_after(
    node: torch.fx.Node, chain: list[torch.fx.Node], reader: torch.fx.Node | None = None
) -> tuple[Any, Any] | None:
    """``(quantized node, scale)`` if what reads ``node`` (through reshapes; its sole reader, or
    ``reader``) is exactly ``static_scaled_fp8_quant``: ``.to(float32) / scale``, ``.clamp``,
    ``.to(float8)``. The views and the first three steps are appended to ``chain``."""
    reader = reader or sole_reader(node)
    while reader is not None and is_view(reader):
        chain.append(reader)
        reader = sole_reader(reader)
    steps: list[torch.fx.Node] = []
    for expected in ("to", operator.truediv, "clamp", "to"):
        if reader is None or reader.target != expected:
            return None
        if steps and reader.args[0] is not steps[-1]:
            return None
        steps.append(reader)
        reader = sole_reader(reader) if len(steps) < 4 else None
    widen, divide, _, narrow = steps
    value = example_value(narrow)
    if widen.args[1:] != (torch.float32,) or value is None or value.element_size() != 1:
        return None
    chain.extend(steps[:3])
    return narrow, divide.args[1]
