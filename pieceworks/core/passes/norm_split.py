"""``NormSplitPass``: a fused add + RMSNorm + FP8 quant split between the GEMVs around it.

Runs after ``RMSNormQuantFusionPass`` (it needs the fused op that pass emits) and before
fix-functionalization. It looks for

    y = small_m_fp8_linear(x_fp8, W1, s1, ws1, None, dtype, native)      # y read only here
    fused = auto_functionalized(fused_add_rms_norm_static_fp8_quant, result=..., residual_out=...,
                                input=y, residual=r, weight=w, scale=s, epsilon=eps)
    z = <small-M FP8 GEMV op>(fused[1], W2, s, ...)                       # fused[1] read only here

and replaces the three with

    residual_out, sums, partials = small_m_fp8_linear_add(x_fp8, W1, s1, ws1, r, dtype, native)
    z = small_m_fp8_normed_linear(sums, partials, w, eps, W2, s, ..., epilogue, ...)

where ``residual_out`` takes the place of ``fused[2]``. On the GPU the norm then runs inside the
two GEMVs (``models/layers/triton_gemv_norm.py``); elsewhere the ops compute the same values
with torch (``models/layers/quantization/fp8_norm_split.py``). The GEMV ops exist only in
compiled graphs where the small-M GEMV is on; without them the pass finds nothing. Left as they
are: the first layer's norm (its input is the embedding) and any norm whose input or result has
another reader (reading the token count off the input does not count).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from pieceworks.core import norm_quant
from pieceworks.core.norm_quant import (
    CONSUMER_OPS,
    FUSED_ADD_RMS_NORM_QUANT_OP,
    LINEAR_ADD_OP,
    NORMED_LINEAR_OP,
    PRODUCER_OP,
    num_partials,
)
from pieceworks.core.passes.fusion import fused_op
from pieceworks.core.passes.inductor_pass import InductorPass, is_call
from pieceworks.logger import init_logger

logger = init_logger(__name__)

RESULT, RESIDUAL_OUT = 1, 2  # auto_functionalized outputs: (op's return, result, residual_out)


class NormSplitPass(InductorPass):
    """Splits each fused add + RMSNorm + quant between the FP8 GEMVs before and after it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.num_rewrites = 0
        ops = [fused_op(name) for name in (FUSED_ADD_RMS_NORM_QUANT_OP, PRODUCER_OP)]
        ops += [fused_op(name) for name in (LINEAR_ADD_OP, NORMED_LINEAR_OP)]
        norm_op, producer_op, linear_add_op, normed_linear_op = ops
        if any(op is None for op in ops):
            return
        consumers = {
            op: epilogue
            for name, epilogue in CONSUMER_OPS.items()
            if (op := fused_op(name)) is not None
        }
        for node in list(graph.nodes):
            if is_call(node, auto_functionalized) and node.args[0] is norm_op:
                rewritten = _split(graph, node, producer_op, consumers)
                if rewritten is not None:
                    _rewrite(graph, node, *rewritten, linear_add_op, normed_linear_op)
                    self.num_rewrites += 1
        logger.debug("norm split: %d norms split between their GEMVs", self.num_rewrites)

    def source_files(self) -> list[str]:
        return [inspect.getfile(type(self)), inspect.getfile(norm_quant)]


def bound_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """A call's arguments by their schema names (positional and keyword alike)."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    bound.update({arg.name: value for arg, value in zip(schema.arguments, node.args)})
    bound.update(node.kwargs)
    return bound


def _outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """``node``'s getitem users by index."""
    return {
        user.args[1]: user
        for user in node.users
        if is_call(user, operator.getitem) and isinstance(user.args[1], int)
    }


def _split(
    graph: torch.fx.Graph,
    norm: torch.fx.Node,
    producer_op: Any,
    consumers: dict[Any, str],
) -> tuple[torch.fx.Node, torch.fx.Node, str] | None:
    """``(producer, consumer, epilogue)`` around ``norm`` if the split applies, else None."""
    producer = norm.kwargs["input"]
    if not isinstance(producer, torch.fx.Node) or not is_call(producer, producer_op):
        return None
    if bound_arguments(producer)["bias"] is not None:
        return None
    if any(user is not norm and not _is_token_count(user) for user in producer.users):
        return None  # y has another reader: it must stay
    residual = norm.kwargs["residual"]
    residual_val = residual.meta.get("val") if isinstance(residual, torch.fx.Node) else None
    if residual_val is None or residual_val.dtype != bound_arguments(producer)["out_dtype"]:
        return None  # the producer's epilogue stores the new residual in its output dtype
    result = _outputs(norm).get(RESULT)
    if result is None or len(result.users) != 1:
        return None
    (consumer,) = result.users
    if consumer.op != "call_function" or consumer.target not in consumers:
        return None
    consumer_args = bound_arguments(consumer)
    if (
        consumer_args["x_fp8"] is not result
        or consumer_args["input_scale"] is not norm.kwargs["scale"]
    ):
        return None
    if consumer_args.get("bias") is not None:
        return None
    return producer, consumer, consumers[consumer.target]


def _is_token_count(node: torch.fx.Node) -> bool:
    """``sym_size(y, 0)``: the symbolic token count read off the producer's output."""
    return is_call(node, torch.ops.aten.sym_size.int) and bool(node.args[1] == 0)


def _rewrite(
    graph: torch.fx.Graph,
    norm: torch.fx.Node,
    producer: torch.fx.Node,
    consumer: torch.fx.Node,
    epilogue: str,
    linear_add_op: Any,
    normed_linear_op: Any,
) -> None:
    produced, consumed = bound_arguments(producer), bound_arguments(consumer)
    outputs = _outputs(norm)
    residual = norm.kwargs["residual"]
    assert isinstance(residual, torch.fx.Node)  # _split checked it
    residual_val = residual.meta["val"]
    with graph.inserting_before(norm):  # the producer's inputs and the residual exist here
        linear_add = graph.call_function(
            linear_add_op,
            kwargs={
                "x_fp8": produced["x_fp8"],
                "weight": produced["weight"],
                "input_scale": produced["input_scale"],
                "weight_scale": produced["weight_scale"],
                "residual": norm.kwargs["residual"],
                "out_dtype": produced["out_dtype"],
                "native": produced["native"],
            },
        )
        residual_out, sums, partials = (
            graph.call_function(operator.getitem, (linear_add, index)) for index in range(3)
        )
    with graph.inserting_before(consumer):
        normed_linear = graph.call_function(
            normed_linear_op,
            kwargs={
                "sums": sums,
                "partials": partials,
                "norm_weight": norm.kwargs["weight"],
                "epsilon": norm.kwargs["epsilon"],
                "weight": consumed["weight"],
                "input_scale": consumed["input_scale"],
                "weight_scale": consumed["weight_scale"],
                "epilogue": epilogue,
                "out_scale": consumed.get("out_scale"),
                "positions": consumed.get("positions"),
                "cos_sin_cache": consumed.get("cos_sin_cache"),
                "head_size": consumed.get("head_size", 0),
                "num_rotary_heads": consumed.get("num_rotary_heads", 0),
                "out_dtype": consumed["out_dtype"],
                "native": consumed["native"],
            },
        )
    _set_vals(linear_add, (residual_out, sums, partials), residual_val)
    normed_linear.meta["val"] = consumer.meta["val"]  # not the rest: it describes the old args
    consumer.replace_all_uses_with(normed_linear)
    if RESIDUAL_OUT in outputs:
        outputs[RESIDUAL_OUT].replace_all_uses_with(residual_out)
    for user in list(producer.users):  # the token count: the producer's input has it too
        if user is not norm:
            user.replace_input_with(producer, produced["x_fp8"])
    buffers = [norm.kwargs["result"], norm.kwargs["residual_out"]]
    for dead in [consumer, *outputs.values(), norm, producer]:
        graph.erase_node(dead)
    for buffer in buffers:  # the empty buffers the fusion allocated for the fused op
        if isinstance(buffer, torch.fx.Node) and not buffer.users:
            graph.erase_node(buffer)


def _set_vals(
    linear_add: torch.fx.Node, outputs: tuple[torch.fx.Node, ...], residual_val: torch.Tensor
) -> None:
    """Fake values of the producer's outputs, as its fake implementation gives them."""
    num_tokens, hidden_size = residual_val.shape
    with residual_val.fake_mode:  # type: ignore[attr-defined]
        vals = (
            torch.empty_like(residual_val),
            residual_val.new_empty((num_tokens, hidden_size), dtype=torch.float32),
            residual_val.new_empty((num_tokens, num_partials(hidden_size)), dtype=torch.float32),
        )
    for node, val in zip(outputs, vals):
        node.meta["val"] = val
    linear_add.meta["val"] = vals
