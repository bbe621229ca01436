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
