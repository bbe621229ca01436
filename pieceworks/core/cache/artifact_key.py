"""``artifact_key``: a hash of a piece's structure, equal for structurally identical pieces.

The middle layers of a model split into pieces that differ only in node names (``x_2`` vs
``x_4``, ``...layers_modules_1_parameters_weight_``): parameters are graph inputs, so the code is
the same. The key hashes each node's op, qualified target and arguments with nodes renamed by
position, plus each input's dtype, (symbolic) shape, stride and device, plus the runtime shape the
piece is compiled for. Two pieces with one key can run one compiled artifact. A piece that reads
attributes (``get_attr``: a constant tensor baked into the graph) or calls a target with no stable
name (a lambda or a local function, whose qualified name another function can share) is made
unique by its index: its twin may hold other constants or other code.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx
from torch.fx.node import _get_qualified_name, map_arg


def artifact_key(graph: torch.fx.GraphModule, runtime_shape: int | None, piece_index: int) -> str:
    """Hex key of ``graph`` compiled for ``runtime_shape`` (None: the dynamic shape)."""
    names: dict[torch.fx.Node, str] = {}
    lines = [f"runtime_shape={runtime_shape}"]
    for position, node in enumerate(graph.graph.nodes):
        names[node] = f"%{position}"
        target = _target_name(node)
        arguments = map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{node.op} {target} {arguments!r} {_input_description(node)}")
        if target is None or node.op == "get_attr":
            lines.append(f"not shared: piece {piece_index}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _target_name(node: torch.fx.Node) -> str | None:
    """The target without memory addresses (``torch.empty_like``, not ``<built-in ... 0x7f..>``);
    None for a target with no stable name (a lambda, a local function, a callable object)."""
    if node.op == "placeholder":
        return ""  # a placeholder's target is its (per-layer) name
    if not callable(node.target):
        return str(node.target)
    qualname = getattr(node.target, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        # FX would name it after its module and variable or ``__name__``, which another lambda
        # or local function of that module can share while running other code.
        return None
    try:
        return _get_qualified_name(node.target)
    except (AttributeError, RuntimeError):
        return None


def _input_description(node: torch.fx.Node) -> str:
    """dtype, shape, stride and device of a placeholder's example value; '' for other nodes."""
    if node.op != "placeholder":
        return ""
    value: Any = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} {value.stride()} {value.device}"
    if isinstance(value, torch.SymInt):
        return f"SymInt {value}"
    return type(value).__name__
