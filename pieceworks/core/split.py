"""``split_graph``: cut a Dynamo graph at the splitting ops, one linear pass over its nodes.

Every splitting op (attention, the Mamba2 mixer) gets a submodule of its own; the nodes between
them form the capturable pieces. A model with L separate splitting ops yields 2L+1 submodules,
L+1 of them capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.fx.passes.split_module import split_module


@dataclasses.dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: torch.fx.GraphModule


def op_qualified_name(target: object) -> str | None:
    """``ns::name`` of an OpOverload / OpOverloadPacket target, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_splitting_node(node: torch.fx.Node, splitting_ops: list[str]) -> bool:
    if node.op != "call_function":
        return False
    name = op_qualified_name(node.target)
    if name is None:
        return False
    overload_name = (
        f"{name}.{node.target._overloadname}"
        if isinstance(node.target, torch._ops.OpOverload)
        else name
    )
    return name in splitting_ops or overload_name in splitting_ops


def split_graph(
    graph: torch.fx.GraphModule, splitting_ops: list[str]
) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Split ``graph`` at ``splitting_ops``; returns the stitched module and its pieces in order."""
    subgraph_id = 0
    node_to_subgraph_id: dict[torch.fx.Node, int] = {}
    splitting_graph_ids: set[int] = set()
    for node in graph.graph.nodes:
        if node.op in ("output", "placeholder"):
            continue
        if is_splitting_node(node, splitting_ops):
            subgraph_id += 1
            node_to_subgraph_id[node] = subgraph_id
            splitting_graph_ids.add(subgraph_id)
            subgraph_id += 1
        else:
            node_to_subgraph_id[node] = subgraph_id

    # keep_original_order: the splitting ops mutate their output argument in place, so a reader
    # of that buffer must stay after the op although the graph shows no data dependency.
    split_gm = split_module(
        graph,
        None,  # type: ignore[arg-type]  # the root module is optional
        lambda node: node_to_subgraph_id[node],
        keep_original_order=True,
    )
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.removeprefix("submod_"))
        assert isinstance(module, torch.fx.GraphModule)
        items.append(SplitItem(name, graph_id, graph_id in splitting_graph_ids, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items
