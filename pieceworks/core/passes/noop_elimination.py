"""``NoOpEliminationPass``: drop reshapes and slices that do nothing, fold reshape chains.

Layers flatten and restore shapes around their kernels (the FP8 linear reshapes its input to 2-D
for the GEMM); on the 2-D activations of a decoder these reshapes are identities, but they sit
between ops a fusion pattern must see adjacent (RMSNorm -> quant). Three rewrites:

1. a chain of reshapes becomes one reshape of the chain's base (the last shape wins);
2. a reshape or slice whose output has its input's shape is replaced by its input;
3. a ``slice_scatter`` whose source has the destination's shape is replaced by the source.

Shapes are compared on the nodes' fake values, where the token dimension is a SymInt. Equality
is asked with ``statically_known_true``: "provably equal for every token count", which never
records a guard; a dimension that is only sometimes equal is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from pieceworks.core.passes.inductor_pass import InductorPass, is_call
from pieceworks.logger import init_logger

logger = init_logger(__name__)

aten = torch.ops.aten
# View-like reshapes; ``reshape`` itself may copy, so a chain containing it stays a reshape.
RESHAPE_OPS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
SLICE_OPS = (aten.slice.Tensor,)


def dims_equal(dim: int | torch.SymInt, other: int | torch.SymInt) -> bool:
    """Whether two sizes are equal for every value of their symbols (no guard is recorded)."""
    return statically_known_true(dim == other)


def shapes_equal(shape: Sequence[int | torch.SymInt], other: Sequence[int | torch.SymInt]) -> bool:
    return len(shape) == len(other) and all(map(dims_equal, shape, other))


def fake_shape(node: object) -> torch.Size | None:
    """The shape of a node's fake value; None for non-tensor nodes or nodes without one."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.shape if isinstance(value, torch.Tensor) else None


class NoOpEliminationPass(InductorPass):
    """Removes identity reshapes / slices / slice_scatters and folds reshape chains."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.num_rewrites = 0
        for node in list(graph.nodes):
            if is_call(node, *RESHAPE_OPS):
                self.num_rewrites += self._fold_reshape_chain(graph, node)
            if is_call(node, *RESHAPE_OPS, *SLICE_OPS):
                self.num_rewrites += self._remove_if_identity(graph, node, node.args[0])
            elif is_call(node, aten.slice_scatter.default):  # output: base's shape
                self.num_rewrites += self._remove_if_identity(graph, node, node.args[1])
        logger.debug("no-op elimination: %d rewrites", self.num_rewrites)

    @staticmethod
    def _fold_reshape_chain(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
        """``reshape(reshape(x, a), b)`` -> ``reshape(x, b)``; the inner one is erased if dead.

        Nodes are visited in order, so the inner reshape was already folded onto its own base.
        """
        inner = node.args[0]
        if not (isinstance(inner, torch.fx.Node) and is_call(inner, *RESHAPE_OPS)):
            return 0
        if inner.target is aten.reshape.default:
            node.target = aten.reshape.default  # the inner one may copy: keep that ability
        node.update_arg(0, inner.args[0])
        if inner.users:
            return 0
        graph.erase_node(inner)
        return 1

    @staticmethod
    def _remove_if_identity(graph: torch.fx.Graph, node: torch.fx.Node, source: object) -> int:
        """Replace ``node`` by ``source`` when both provably have the same shape."""
        shape, source_shape = fake_shape(node), fake_shape(source)
        if shape is None or source_shape is None or not shapes_equal(shape, source_shape):
            return 0
        assert isinstance(source, torch.fx.Node)
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        return 1
