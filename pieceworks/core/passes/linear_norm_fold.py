"""``LinearNormFoldPass``: a fused add + RMSNorm + FP8 quant folded into the FP8 GEMV before it.

Runs after ``RMSNormQuantFusionPass`` (it needs the fused op that pass emits) and before
fix-functionalization. It looks for

    y = small_m_fp8_linear(x_fp8, W, input_scale, weight_scale, None, dtype, native)
    fused = auto_functionalized(fused_add_rms_norm_static_fp8_quant, result=..., residual_out=...,
                                input=y, residual=r, weight=w, scale=s, epsilon=eps)

where nothing else reads ``y`` (reading its token count does not count), and replaces both with

    folded = small_m_fp8_linear_add_rms_norm(x_fp8, W, input_scale, weight_scale, r, w, eps, s,
                                             dtype, native)

whose outputs take the places of ``fused[1]`` (the FP8 row) and ``fused[2]`` (the new residual). On
the GPU the norm then runs as the GEMV's epilogue and tail (``models/layers/triton_gemv_norm.py``);
elsewhere, and past a few tokens, the op runs the two ops it replaced
(``models/layers/quantization/fp8_linear_norm.py``). The GEMV op exists only in compiled graphs
where the small-M GEMV is on; without it the pass finds nothing. Left as it is: the first layer's
norm (its input is the embedding).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from pieceworks.core import norm_quant
from pieceworks.core.norm_quant import FUSED_ADD_RMS_NORM_QUANT_OP, LINEAR_NORM_OP, PRODUCER_OP
from pieceworks.core.passes.fusion import fused_op
from pieceworks.core.passes.inductor_pass import InductorPass, is_call
from pieceworks.logger import init_logger

logger = init_logger(__name__)

RESULT, RESIDUAL_OUT = 1, 2  # auto_functionalized outputs: (op's return, result, residual_out)


class LinearNormFoldPass(InductorPass):
    """Folds each fused add + RMSNorm + quant into the small-M FP8 GEMV that computes its input."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.num_rewrites = 0
        norm_op, producer_op = fused_op(FUSED_ADD_RMS_NORM_QUANT_OP), fused_op(PRODUCER_OP)
        folded_op = fused_op(LINEAR_NORM_OP)
        if norm_op is None or producer_op is None or folded_op is None:
            return
        for node in list(graph.nodes):
            if is_call(node, auto_functionalized) and node.args[0] is norm_op:
                producer = _producer(node, producer_op)
                if producer is not None:
                    _fold(graph, node, producer, folded_op)
                    self.num_rewrites += 1
        logger.debug("linear + norm fold: %d norms folded into their GEMVs", self.num_rewrites)

    def source_files(self) -> list[str]:
        return [inspect.getfile(type(self)), inspect.getfile(norm_quant)]


def bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call's arguments by their schema names (positional and keyword alike)."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    bound.update({arg.name: value for arg, value in zip(schema.arguments, node.args)})
    bound.update(node.kwargs)
    return bound


def _is_token_count(node: torch.fx.Node) -> bool:
    """``sym_size(y, 0)``: the symbolic token count read off the GEMV's output."""
    return is_call(node, torch.ops.aten.sym_size.int) and bool(node.args[1] == 0)


def _producer(norm: torch.fx.Node, producer_op: Any) -> torch.fx.Node | None:
    """The GEMV whose output is ``norm``'s input, if the fold applies to the pair."""
    producer = norm.kwargs["input"]
    if not isinstance(producer, torch.fx.Node) or not is_call(producer, producer_op):
        return None
    if bound_arguments(producer)["bias"] is not None:
        return None
    if any(user is not norm and not _is_token_count(user) for user in producer.users):
        return None  # y has another reader: it must stay
    residual = norm.kwargs["residual"]
    if not isinstance(residual, torch.fx.Node) or "val" not in residual.meta:
        return None
    if residual.meta["val"].dtype != bound_arguments(producer)["out_dtype"]:
        return None  # the epilogue stores the new residual in the GEMV's output dtype
    return producer


def _fold(
    graph: torch.fx.Graph, norm: torch.fx.Node, producer: torch.fx.Node, folded_op: Any
) -> None:
    produced = bound_arguments(producer)
    outputs = {
        user.args[1]: user
        for user in norm.users
        if is_call(user, operator.getitem) and isinstance(user.args[1], int)
    }
    with graph.inserting_before(norm):  # the GEMV's inputs and the residual exist here
        folded = graph.call_function(
            folded_op,
            kwargs={
                "x_fp8": produced["x_fp8"],
                "weight": produced["weight"],
                "input_scale": produced["input_scale"],
                "weight_scale": produced["weight_scale"],
                "residual": norm.kwargs["residual"],
                "norm_weight": norm.kwargs["weight"],
                "epsilon": norm.kwargs["epsilon"],
                "scale": norm.kwargs["scale"],
                "out_dtype": produced["out_dtype"],
                "native": produced["native"],
            },
        )
        result, residual_out = (
            graph.call_function(operator.getitem, (folded, index)) for index in range(2)
        )
    vals = []
    for new, old_index in ((result, RESULT), (residual_out, RESIDUAL_OUT)):
        buffer = norm.kwargs["result" if old_index == RESULT else "residual_out"]
        new.meta["val"] = buffer.meta["val"]  # the fused op's output buffers: same shape, dtype
        vals.append(new.meta["val"])
        if old_index in outputs:
            outputs[old_index].replace_all_uses_with(new)
    folded.meta["val"] = tuple(vals)
    for user in list(producer.users):  # the token count: the GEMV's input has it too
        if user is not norm:
            user.replace_input_with(producer, produced["x_fp8"])
    buffers = [norm.kwargs["result"], norm.kwargs["residual_out"]]
    for dead in [*outputs.values(), norm, producer]:
        graph.erase_node(dead)
    for buffer in buffers:  # the empty buffers the fusion allocated for the fused op
        if isinstance(buffer, torch.fx.Node) and not buffer.users:
            graph.erase_node(buffer)
