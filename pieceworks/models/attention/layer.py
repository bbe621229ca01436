"""The ``Attention`` layer and its opaque op ``unified_attention_with_output``: the split point.

The layer registers itself by prefix at construction, so the op (which Dynamo sees only as
``pieceworks::unified_attention_with_output(query, key, value, output, layer_name)``) can find it
and the step's metadata in the forward context at run time. The op stores K/V into the layer's
paged cache and writes attention into ``output`` in place; its fake implementation does nothing,
so tracing never runs a kernel. The layer keeps what the backend derives from shapes (checks,
launch grids, split count, scratch) per shape signature, so a repeated shape costs only launches.

``forward`` allocates an output of the query's dtype. The op takes an optional ``output_scale``
(vLLM's signature): given it, the output is float8_e4m3fn and the op writes
``static_scaled_fp8_quant(attention, output_scale)``. The model never passes it; the attention
quant fusion pass (``core/passes/attn_quant_fusion.py``) does, where an FP8 ``o_proj`` quantizes
the attention output with its static input scale, and then allocates the output in FP8 and drops
that quantization from the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.forward_context import get_forward_context
from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.models.attention.backends import AttentionBackend
from pieceworks.models.attention.ops import DecodeWorkspace
from pieceworks.platforms import current_platform
from pieceworks.utils import IdentityMemo

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


def unified_attention_with_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
) -> None:
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    layer.attend(query, key, value, output, context.attn_metadata, output_scale)


def unified_attention_with_output_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    output_scale: torch.Tensor | None = None,
) -> None:
    return None


def attention_op():
    """``torch.ops.pieceworks.unified_attention_with_output``, registered on first use."""
    return direct_register_custom_op(
        "unified_attention_with_output",
        unified_attention_with_output,
        mutates_args=["output"],
        fake_impl=unified_attention_with_output_fake,
        dynamic=True,  # its plan follows the batch: a splitting op wherever pieces are captured
    )


# Plans kept per layer before the cache starts over: decode shapes are few (one per capture size),
# but prefill and mixed steps bring new (num_tokens, max_query_len) pairs for as long as they run.
MAX_CACHED_PLANS = 256


class Attention(nn.Module):
    """Paged causal attention over flattened tokens; K/V cache bound later by the runner.

    ``num_heads`` and ``num_kv_heads`` are this tensor-parallel rank's (the model divides the
    checkpoint's counts; KV heads fewer than ranks are replicated, one per rank), and so is the
    KV cache the runner binds: ``(num_blocks, block_size, num_kv_heads, head_size)``.
    ``sliding_window`` (Mistral's, Gemma's sliding layers') limits each query to the last that many
    positions, its own included; None attends to the whole context.

    ``attend`` (the op's body) keeps the backend's plan per shape signature: every shape and
    stride the plan is built from, the output dtype, plus ``max_query_len``. The first call of a
    signature checks the layouts and binds the launches (and raises there if they are wrong);
    later calls only launch. Binding a KV cache forgets every plan.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        config: EngineConfig,
        prefix: str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{prefix}: sliding_window {sliding_window} must be at least 1")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{prefix}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads} "
                "(per tensor-parallel rank)"
            )
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.layer_name = prefix
        self.backend: type[AttentionBackend] = current_platform().attention_backend()
        # Split-KV scratch: this layer's own until the runner binds one shared by every layer.
        self.workspace = DecodeWorkspace()
        self._plans: dict[tuple, Any] = {}
        # (max_query_len, plan) of the last call, by the identity of its tensors (``attend``)
        self._last_plan = IdentityMemo()
        self._kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op = attention_op()
        config.compilation_config.register_layer(prefix, self)

    @property
    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key_cache, value_cache), each (num_blocks, block_size, Hkv, D); bound by the runner."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.bind_kv_cache(kv_cache)

    def bind_kv_cache(
        self,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        workspace: DecodeWorkspace | None = None,
    ) -> None:
        """Bind the caches (and optionally a workspace shared across layers); forget the plans.

        Captured graphs hold the caches' and the workspace's addresses: bind before capturing.
        """
        self._kv_cache = kv_cache
        if workspace is not None:
            self.workspace = workspace
        self._plans.clear()
        self._last_plan.clear()

    def bound_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches, or a RuntimeError saying none are bound yet."""
        if self._kv_cache is None:
            raise RuntimeError(
                f"{self.layer_name}: no KV cache bound; the model runner binds "
                "caches before the first forward"
            )
        return self._kv_cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(query)  # (T, Hq * D)
        self.op(query, key, value, output, self.layer_name)
        return output

    def attend(
        self,
        query: torch.Tensor,  # (T, Hq * D)
        key: torch.Tensor,  # (T, Hkv * D)
        value: torch.Tensor,  # (T, Hkv * D)
        output: torch.Tensor,  # (T, Hq * D), written in place
        metadata,
        output_scale: torch.Tensor | None = None,  # 0-d float32: output is float8_e4m3fn
    ) -> None:
        """The op's body: store this step's K/V, then attend over the paged cache (and quantize
        the result with ``output_scale`` when given).

        Between replayed graph pieces the op gets the same tensor objects every step of a shape
        (the pieces' outputs, the runner's views), so the last call's plan is taken again for
        the very same objects and ``max_query_len`` without reading every shape and stride."""
        block_tables = metadata.block_tables
        tensors = (query, key, value, output, metadata.slot_mapping, block_tables)
        last = self._last_plan.get(tensors)
        if last is not None and last[0] == metadata.max_query_len:
            plan = last[1]
        else:
            plan = self._plan(query, key, value, output, metadata, output_scale)
            self._last_plan.put(tensors, (metadata.max_query_len, plan))
        if output_scale is None:
            self.backend.run(plan, self, query, key, value, output, metadata)
        else:
            self.backend.run(plan, self, query, key, value, output, metadata, output_scale)

    def _plan(self, query, key, value, output, metadata, output_scale) -> Any:
        """The plan of this call's shape signature: every shape and stride the plan is built
        from, the output dtype and ``max_query_len`` (planned the first time it is seen)."""
        block_tables = metadata.block_tables
        signature = (
            query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
            output.shape, output.stride(), output.dtype, metadata.slot_mapping.shape,
            block_tables.shape, block_tables.stride(), metadata.max_query_len,
        )  # fmt: skip
        try:
            return self._plans[signature]
        except KeyError:
            return self._new_plan(signature, query, key, value, output, metadata, output_scale)

    def _new_plan(self, signature: tuple, query, key, value, output, metadata, output_scale) -> Any:
        """Check and plan a shape signature seen for the first time (raises if it is invalid)."""
        self.bound_kv_cache()
        quantized = output_scale is not None
        if (output.dtype == KERNEL_FP8_DTYPE) != quantized:
            raise ValueError(
                f"{self.layer_name}: output dtype {output.dtype}, but the call "
                f"{'quantizes its output to' if quantized else 'does not quantize to'}"
                f" {KERNEL_FP8_DTYPE} (output_scale {'given' if quantized else 'None'}); the "
                "output is FP8 exactly when output_scale is given"
            )
        if len(self._plans) >= MAX_CACHED_PLANS:
            self._plans.clear()
        plan = self.backend.plan(self, query, key, value, output, metadata)
        self._plans[signature] = plan
        return plan
