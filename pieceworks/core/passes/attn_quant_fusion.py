"""``AttnQuantFusionPass``: attention writes FP8 for the FP8 ``o_proj`` that reads it.

An FP8 linear layer quantizes its input with its static ``input_scale``
(``static_scaled_fp8_quant``). After attention that input is the attention's output, allocated by
``Attention.forward`` in the query's dtype and written in place by the op. This pass, on the
graph Dynamo captures before it is split (``core/backend.py``), finds

    output = empty_like(query); unified_attention_with_output(q, k, v, output, name)
    x_fp8 = static_scaled_fp8_quant(output.reshape(...), s)

and makes it

    output = empty_like(query, dtype=float8_e4m3fn)
    unified_attention_with_output(q, k, v, output, name, output_scale=s)
    x_fp8 = output.reshape(...)

so the attention quantizes in its own epilogue (the Triton decode reduce; other paths quantize a
scratch result inside the op) and no quantization kernel runs between it and ``o_proj``. Only
``float8_e4m3fn`` is written by the attention kernels, so a platform whose FP8 format is another
(MI300's e4m3fnuz) keeps the quantization in ``o_proj``. ``PassConfig.enable_attn_quant_fusion``
switches it; level 0 runs the plain sequence.
"""

from __future__ import annotations

import torch
import torch.fx

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.core.passes.graph_match import (
    erase_sequence,
    example_value,
    fp8_quant_after,
    op_name,
)

ATTENTION_OP = "unified_attention_with_output"
OUTPUT_INDEX = 3  # unified_attention_with_output(query, key, value, output, layer_name, ...)


class AttnQuantFusionPass:
    """Attention followed by the static FP8 quantization of its output -> attention writing FP8."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        num_fused = 0
        for attention in list(graph.nodes):
            if op_name(attention) == ATTENTION_OP:
                num_fused += self._fuse(graph, attention)
        return num_fused

    def _fuse(self, graph: torch.fx.Graph, attention: torch.fx.Node) -> int:
        output = attention.args[OUTPUT_INDEX] if len(attention.args) > OUTPUT_INDEX else None
        if not isinstance(output, torch.fx.Node) or output.target is not torch.empty_like:
            return 0
        if attention.kwargs.get("output_scale") is not None or len(attention.args) > 5:
            return 0  # already quantizes
        readers = [reader for reader in output.users if reader is not attention]
        if len(readers) != 1:
            return 0
        chain: list[torch.fx.Node] = []
        quantized = fp8_quant_after(output, chain, readers[0])
        if quantized is None:
            return 0
        narrow, scale = quantized
        value = example_value(narrow)
        if value.dtype != KERNEL_FP8_DTYPE or not _defined_before(scale, attention):
            return 0
        widen = chain[-3]  # .to(float32) of the (reshaped) output: what o_proj quantized
        output.kwargs = {**output.kwargs, "dtype": KERNEL_FP8_DTYPE}
        if example_value(output) is not None:
            output.meta["example_value"] = torch.empty_like(
                example_value(output), dtype=value.dtype
            )
        attention.kwargs = {**attention.kwargs, "output_scale": scale}
        narrow.replace_all_uses_with(widen.args[0])  # type: ignore[arg-type]
        erase_sequence(graph, [narrow, *chain[-3:]])
        return 1


def _defined_before(node: object, user: torch.fx.Node) -> bool:
    """Whether ``node`` (the scale) can be read by ``user``: a placeholder, or a node before it."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "placeholder":
        return True
    for earlier in user.graph.nodes:
        if earlier is user:
            return False
        if earlier is node:
            return True
    return False
