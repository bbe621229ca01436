"""``FixFunctionalizationPass``: pieceworks' mutating ops back to in-place calls.

AOT autograd functionalizes a custom op that writes into its arguments: the post-grad graph holds
``auto_functionalized(op, **kwargs)``, whose outputs are the op's return followed by new values of
the mutated arguments. Left alone, Inductor decomposes that into a clone of every mutated argument
(unless its reinplacing proves the clone unneeded), then the op on the clone: for ops that write
into big buffers (KV cache, attention outputs, a fused norm's output) the clone is a full copy per
call. This pass rewrites each such node of an op registered through
``direct_register_custom_op`` into the op called on the original arguments, and points readers of
the new values at those arguments.

It only does so when that is safe: no node after the op reads a mutated argument (or a view of
it) expecting the old value. Otherwise the node stays, and Inductor clones as it would have.
The ``copy_`` that writes a mutated graph input back to itself afterwards is dropped.
Auto-functionalization v2 is turned off for pieces (``PostGradPassManager.config_patches``);
v2 nodes, if some other setting produces them, are left to Inductor.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, get_mutable_args

from pieceworks.core.custom_op import is_registered_custom_op
from pieceworks.core.passes.inductor_pass import InductorPass, is_call
from pieceworks.logger import init_logger

logger = init_logger(__name__)


def returns_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s output may alias an input (a view op: ``view``, ``slice``, ...)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


def aliases_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and every view taken of it, transitively."""
    found, stack = [node], [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "call_function" and returns_alias(user) and user not in found:
                found.append(user)
                stack.append(user)
    return found


def is_write_back(user: torch.fx.Node, tensor: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``copy_(tensor, node[i])``: a mutated graph input receiving its new value."""
    if not is_call(user, torch.ops.aten.copy_.default) or user.args[0] is not tensor:
        return False
    source = user.args[1]
    return isinstance(source, torch.fx.Node) and source.args[:1] == (node,)


def read_after(tensor: torch.fx.Node, node: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Whether a node after ``node`` reads the old value of ``tensor`` or of a view of it."""
    position = order[node]
    return any(
        order.get(user, position + 1) > position and not is_write_back(user, tensor, node)
        for alias in aliases_of(tensor)
        for user in alias.users
        if user is not node
    )


def safely_mutated_args(
    node: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> list[torch.fx.Node] | None:
    """The arguments an ``auto_functionalized`` node's op mutates, if the op may mutate them in
    place: a pieceworks op, tensor arguments, no old value read afterwards. Else None."""
    op = node.args[0]
    if not isinstance(op, torch._ops.OpOverload) or not is_registered_custom_op(op):
        return None
    mutable_names, _ = get_mutable_args(op)
    if not all(isinstance(node.kwargs[name], torch.fx.Node) for name in mutable_names):
        return None  # lists of tensors, None: left to Inductor
    mutated = [cast(torch.fx.Node, node.kwargs[name]) for name in mutable_names]
    if any(read_after(arg, node, order) for arg in mutated):
        return None
    return mutated


class FixFunctionalizationPass(InductorPass):
    """Rewrites ``auto_functionalized`` of pieceworks ops into in-place calls where safe."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.num_rewrites = 0
        order = {node: index for index, node in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if is_call(node, auto_functionalized) and self._defunctionalize(graph, node, order):
                self.num_rewrites += 1
        if self.num_rewrites:
            self._remove_self_copies(graph)
        logger.debug("fix functionalization: %d ops made in place", self.num_rewrites)

    @staticmethod
    def _defunctionalize(
        graph: torch.fx.Graph, node: torch.fx.Node, order: dict[torch.fx.Node, int]
    ) -> bool:
        mutated = safely_mutated_args(node, order)
        if mutated is None:
            return False
        op = cast(torch._ops.OpOverload, node.args[0])
        with graph.inserting_before(node):
            call = graph.call_function(op, kwargs=dict(node.kwargs))
        order[call] = order[node]  # a later op on the same buffer must see this one as before
        num_returns = max(len(op._schema.returns), 1)  # an op returning nothing yields None
        values = node.meta["val"]
        call.meta["val"] = values[0] if num_returns == 1 else tuple(values[:num_returns])
        for user in list(node.users):
            index = user.args[1] if is_call(user, operator.getitem) else None
            if not isinstance(index, int):
                raise AssertionError(f"unexpected user {user} of {node}")
            if index >= num_returns:  # a mutated argument's new value: the argument itself
                user.replace_all_uses_with(mutated[index - num_returns])
            elif num_returns == 1:
                user.replace_all_uses_with(call)
            else:
                user.args = (call, index)
                continue
            graph.erase_node(user)
        graph.erase_node(node)
        return True

    @staticmethod
    def _remove_self_copies(graph: torch.fx.Graph) -> None:
        """``copy_(x, x)`` (a mutated input written back to itself) does nothing."""
        for node in list(graph.nodes):
            if is_call(node, torch.ops.aten.copy_.default) and node.args[0] is node.args[1]:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
