"""``GemvNormFoldPass``: a fused add + RMSNorm + FP8 quant folded into the FP8 GEMV after it.

Runs after ``RMSNormQuantFusionPass`` (it needs the fused op that pass emits) and before
fix-functionalization. It looks for

    fused = auto_functionalized(fused_add_rms_norm_static_fp8_quant, result=..., residual_out=...,
                                input=x, residual=r, weight=w, scale=s, epsilon=eps)
    y = <small-M FP8 GEMV op>(fused[1], weight, s, weight_scale, ...)

where the quantized result has no reader but the GEMV and the GEMV quantizes with the same scale
``s``, and replaces both with one call of ``small_m_fp8_add_rms_norm_linear`` (its ``epilogue``
names the GEMV op replaced), whose two outputs take the places of ``y`` and of ``fused[2]`` (the
residual sum). The folded op runs the norm as the GEMV's prologue on the GPU and the two
original ops elsewhere (``models/layers/quantization/fp8_norm_linear.py``), so the values are
the same. The GEMV ops exist only in compiled graphs where the small-M GEMV is on; without them
the pass finds nothing. The residual-free form (the first layer's norm) is left as it is.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from pieceworks.core import norm_quant
from pieceworks.core.norm_quant import FUSED_ADD_RMS_NORM_QUANT_OP, GEMV_EPILOGUE_OPS, GEMV_NORM_OP
from pieceworks.core.passes.fusion import fused_op
from pieceworks.core.passes.inductor_pass import InductorPass, is_call
from pieceworks.logger import init_logger

logger = init_logger(__name__)

RESULT, RESIDUAL_OUT = 1, 2  # auto_functionalized outputs: (op's return, result, residual_out)


class GemvNormFoldPass(InductorPass):
    """Folds the fused add + RMSNorm + quant into the small-M FP8 GEMV that reads its result."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.num_rewrites = 0
        folded_op, norm_op = fused_op(GEMV_NORM_OP), fused_op(FUSED_ADD_RMS_NORM_QUANT_OP)
        if folded_op is None or norm_op is None:
            return
        epilogues = {
            op: epilogue
            for name, epilogue in GEMV_EPILOGUE_OPS.items()
            if (op := fused_op(name)) is not None
        }
        order = {node: position for position, node in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if is_call(node, auto_functionalized) and node.args[0] is norm_op:
                self.num_rewrites += _fold(graph, node, folded_op, epilogues, order)
        logger.debug("GEMV norm fold: %d folds", self.num_rewrites)

    def source_files(self) -> list[str]:
        return [inspect.getfile(type(self)), inspect.getfile(norm_quant)]


def _outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """``node``'s getitem users by index."""
    return {
        user.args[1]: user
        for user in node.users
        if is_call(user, operator.getitem) and isinstance(user.args[1], int)
    }


def bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call's arguments by their schema names (positional and keyword alike)."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    bound.update({arg.name: value for arg, value in zip(schema.arguments, node.args)})
    bound.update(node.kwargs)
    return bound


def _fold(
    graph: torch.fx.Graph,
    norm: torch.fx.Node,
    folded_op: torch._ops.OpOverload,
    epilogues: dict[Any, str],
    order: dict[torch.fx.Node, int],
) -> int:
    """Fold ``norm`` into its result's one reader if that is a GEMV op; 1 if folded, else 0."""
    outputs = _outputs(norm)
    result, residual_out = outputs.get(RESULT), outputs.get(RESIDUAL_OUT)
    if result is None or len(result.users) != 1:
        return 0
    (gemv,) = result.users
    if gemv.op != "call_function" or gemv.target not in epilogues:
        return 0
    gemv_args = bound_arguments(gemv)
    if gemv_args["x_fp8"] is not result or gemv_args["input_scale"] is not norm.kwargs["scale"]:
        return 0
    if residual_out is not None and any(order[user] < order[gemv] for user in residual_out.users):
        return 0  # the residual sum is read before the GEMV: the folded op would come too late
    epilogue = epilogues[gemv.target]
    kwargs = {
        "input": norm.kwargs["input"],
        "residual": norm.kwargs["residual"],
        "norm_weight": norm.kwargs["weight"],
        "epsilon": norm.kwargs["epsilon"],
        "weight": gemv_args["weight"],
        "input_scale": gemv_args["input_scale"],
        "weight_scale": gemv_args["weight_scale"],
        "epilogue": epilogue,
        "bias": gemv_args.get("bias"),
        "out_scale": gemv_args.get("out_scale"),
        "positions": gemv_args.get("positions"),
        "cos_sin_cache": gemv_args.get("cos_sin_cache"),
        "head_size": gemv_args.get("head_size", 0),
        "num_rotary_heads": gemv_args.get("num_rotary_heads", 0),
        "out_dtype": gemv_args["out_dtype"],
        "native": gemv_args["native"],
    }
    with graph.inserting_before(gemv):
        folded = graph.call_function(folded_op, kwargs=kwargs)
        output = graph.call_function(operator.getitem, (folded, 0))
        new_residual = graph.call_function(operator.getitem, (folded, 1))
    output.meta.update(gemv.meta)
    gemv.replace_all_uses_with(output)
    if residual_out is not None:
        new_residual.meta.update(residual_out.meta)
        residual_out.replace_all_uses_with(new_residual)
    folded.meta["val"] = (output.meta.get("val"), new_residual.meta.get("val"))
    buffers = [norm.kwargs["result"], norm.kwargs["residual_out"]]
    for dead in [gemv, result, *([residual_out] if residual_out is not None else []), norm]:
        graph.erase_node(dead)
    for buffer in buffers:  # the empty buffers the fusion allocated for the fused op
        if isinstance(buffer, torch.fx.Node) and not buffer.users:
            graph.erase_node(buffer)
    return 1
