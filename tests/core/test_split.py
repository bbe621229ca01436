"""``split_graph`` on FX graphs of the silly op: where it cuts, what it names, what it returns.

A graph calling the splitting op L times splits into 2L+1 submodules in graph order, the op's
own submodules marked as splitting graphs; adjacent ops leave no empty piece between them; the
op matches by its packet name (``silly::attention``) or its overload name
(``silly::attention.default``), never by another overload's name or a plain function's; the
stitched module computes what the graph computed.
Run: pytest tests/core/test_split.py
"""

from __future__ import annotations

import pytest
import torch
import torch.fx

from pieceworks.core.split import is_splitting_node, op_qualified_name, split_graph
from tests.core.toy_model import SILLY_OP, silly_attention_op


def layers(x: torch.Tensor, target) -> torch.Tensor:
    """Two blocks of: scale, the silly op (out = 3x), add (as the toy's layers, no weights)."""
    for _ in range(2):
        x = x * 2.0
        out = torch.empty_like(x)
        target(x, x, x, out)
        x = out + x
    return x


def adjacent(x: torch.Tensor, target) -> torch.Tensor:
    """Two silly ops with nothing between them."""
    first, second = torch.empty_like(x), torch.empty_like(x)
    target(x, x, x, first)
    target(first, first, first, second)
    return second - 1.0


@pytest.fixture(autouse=True)
def _silly_op():
    silly_attention_op()  # registered on first use


def traced(fn, target) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: fn(x, target))


@pytest.mark.parametrize(
    "target, splitting_ops",
    [
        (lambda: torch.ops.silly.attention, [SILLY_OP]),  # the packet: its own name
        (lambda: torch.ops.silly.attention.default, [SILLY_OP]),  # an overload: the op's name
        (lambda: torch.ops.silly.attention.default, [f"{SILLY_OP}.default"]),  # or its own
    ],
)
def test_two_ops_give_five_pieces_in_graph_order(target, splitting_ops):
    graph = traced(layers, target())
    split_gm, items = split_graph(graph, splitting_ops)
    assert [item.submod_name for item in items] == [f"submod_{i}" for i in range(5)]
    assert [item.graph_id for item in items] == list(range(5))
    assert [item.is_splitting_graph for item in items] == [False, True, False, True, False]
    assert all(item.graph is getattr(split_gm, item.submod_name) for item in items)
    x = torch.randn(3, 4)
    assert torch.equal(split_gm(x), graph(x))  # ((2x * 3 + 2x) * 2 * 3 + ...): same arithmetic


def test_adjacent_ops_leave_no_empty_piece_between_them():
    _, items = split_graph(traced(adjacent, torch.ops.silly.attention.default), [SILLY_OP])
    assert [(item.graph_id, item.is_splitting_graph) for item in items] == [
        (0, False),
        (1, True),
        (3, True),
        (4, False),
    ]


def test_other_names_do_not_split():
    graph = traced(layers, torch.ops.silly.attention.default)
    for splitting_ops in ([], [f"{SILLY_OP}.out"], ["silly::other"], ["aten::mul"]):
        _, items = split_graph(graph, splitting_ops)
        # aten::mul would match an aten op; symbolic_trace records operator.mul, a plain function
        assert [(item.graph_id, item.is_splitting_graph) for item in items] == [(0, False)]


def test_qualified_names_of_op_targets_only():
    assert op_qualified_name(torch.ops.silly.attention) == SILLY_OP
    assert op_qualified_name(torch.ops.silly.attention.default) == SILLY_OP
    assert op_qualified_name(torch.relu) is None
    graph = traced(layers, torch.ops.silly.attention.default)
    placeholder = next(iter(graph.graph.nodes))
    assert placeholder.op == "placeholder"
    assert not is_splitting_node(placeholder, [SILLY_OP, "x"])
