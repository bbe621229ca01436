"""The ``Attention`` layer and its opaque op ``unified_attention_with_output``: the split point.

The layer registers itself by prefix at construction, so the op (which Dynamo sees only as
``pieceworks::unified_attention_with_output(query, key, value, output, layer_name)``) can find it
and the step's metadata in the forward context at run time. The op stores K/V into the layer's
paged cache and writes attention into ``output`` in place; its fake implementation does nothing,
so tracing never runs a kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.forward_context import get_forward_context
from pieceworks.models.attention.backends import AttentionBackend
from pieceworks.platforms import current_platform

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    layer.attend(query, key, value, output, context.attn_metadata)


def unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def attention_op():
    """``torch.ops.pieceworks.unified_attention_with_output``, registered on first use."""
    return direct_register_custom_op(
        "unified_attention_with_output",
        unified_attention_with_output,
        mutates_args=["output"],
        fake_impl=unified_attention_with_output_fake,
    )


class Attention(nn.Module):
    """Paged causal attention over flattened tokens; K/V cache bound later by the runner."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        config: EngineConfig,
        prefix: str,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{prefix}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.layer_name = prefix
        self.backend: type[AttentionBackend] = current_platform().attention_backend()
        # (key_cache, value_cache), each (num_blocks, block_size, Hkv, D); bound by the runner.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op = attention_op()
        config.compilation_config.register_layer(prefix, self)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(query)  # (T, Hq * D)
        self.op(query, key, value, output, self.layer_name)
        return output

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        metadata,
    ) -> None:
        """The op's body: store this step's K/V, then attend over the paged cache."""
        if self.kv_cache is None:
            raise RuntimeError(
                f"{self.layer_name}: no KV cache bound; the model runner binds "
                "caches before the first forward"
            )
        key_cache, value_cache = self.kv_cache
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        self.backend.store_kv(key, value, key_cache, value_cache, metadata)
        self.backend.forward(
            query,
            key_cache,
            value_cache,
            output.view(num_tokens, self.num_heads, self.head_size),
            metadata,
            self.scale,
        )
