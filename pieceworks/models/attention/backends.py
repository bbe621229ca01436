"""Attention backends: the kernels a platform picks for the attention layer.

``current_platform().attention_backend()`` returns one of these classes (by qualname); the layer
never branches on hardware. Per call it runs ``run(plan, ...)``, where ``plan`` is what the
backend's ``plan`` returned the first time the layer saw this shape signature (the layer caches
it). A backend with nothing to precompute keeps the defaults: no plan, and ``run`` calls
``store_kv`` then ``forward`` on (T, H, D) views. Both take the step's ``AttentionMetadata`` and
write into tensors they are given.

A call with an ``output_scale`` (the attention quant fusion pass gives the op one) hands ``run``
a float8_e4m3fn output and that static scale. The Triton decode plan quantizes in its reduce
kernel; every other path attends into a scratch tensor of the query dtype and writes
``static_scaled_fp8_quant(scratch, scale)``, as the FP8 ``o_proj`` would have quantized it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, static_scaled_fp8_quant
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.attention.ops import (
    DecodeLaunch,
    DecodeWorkspace,
    KernelLaunch,
    PagedAttentionLaunch,
    paged_attention_reference,
    plan_paged_attention,
    plan_store_kv_cache,
    store_kv_cache_torch,
)


class AttentionLayer(Protocol):
    """What a backend reads of the layer it runs for (``models.attention.layer.Attention``):
    this rank's head counts, the softmax scale, the split-KV workspace and the bound caches."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None  # attend to the last this many positions; None: all of them
    workspace: DecodeWorkspace

    def bound_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionBackend:
    """Interface: store this step's K/V in the paged cache, then attend."""

    name = "base"

    @staticmethod
    def store_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        raise NotImplementedError

    @staticmethod
    def forward(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        raise NotImplementedError

    @classmethod
    def plan(
        cls, layer: AttentionLayer, query, key, value, output, metadata: AttentionMetadata
    ) -> Any:
        """Host work that follows from this call's shapes alone; the layer reuses it per shape."""
        return None

    @classmethod
    def run(
        cls,
        plan: Any,
        layer: AttentionLayer,
        query,
        key,
        value,
        output,
        metadata: AttentionMetadata,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """One call on the layer's flat (T, H * D) tensors: store K/V, then attend (FP8 output:
        quantized with ``output_scale``)."""
        key_cache, value_cache = layer.bound_kv_cache()
        # FP8 output: attend into a scratch tensor of the query dtype, then quantize it
        result = output if output_scale is None else query.new_empty(query.shape)  # (T, Hq * D)
        query, key, value, result_heads = head_views(layer, query, key, value, result)
        cls.store_kv(key, value, key_cache, value_cache, metadata)
        cls.forward(
            query, key_cache, value_cache, result_heads, metadata, layer.scale, layer.sliding_window
        )
        if output_scale is not None:
            output.copy_(static_scaled_fp8_quant(result, output_scale, output.dtype))


def head_views(layer: AttentionLayer, query, key, value, output) -> tuple[torch.Tensor, ...]:
    """The layer's flat (T, H * D) tensors as (T, H, D) views, in the order given."""
    num_tokens, head_size = query.shape[0], layer.head_size
    return (
        query.view(num_tokens, layer.num_heads, head_size),
        key.view(num_tokens, layer.num_kv_heads, head_size),
        value.view(num_tokens, layer.num_kv_heads, head_size),
        output.view(num_tokens, layer.num_heads, head_size),
    )


class TorchAttentionBackend(AttentionBackend):
    """The float32 torch reference: CPU, and the oracle in tests."""

    name = "torch"

    @staticmethod
    def store_kv(key, value, key_cache, value_cache, metadata) -> None:
        store_kv_cache_torch(key, value, key_cache, value_cache, metadata.slot_mapping)

    @staticmethod
    def forward(
        query, key_cache, value_cache, output, metadata, scale, sliding_window=None
    ) -> None:
        paged_attention_reference(
            query,
            key_cache,
            value_cache,
            output,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            scale=scale,
            sliding_window=sliding_window,
        )


@dataclasses.dataclass(frozen=True)
class TritonAttentionPlan:
    """The launches of one shape signature (None: nothing to launch) and the caches.

    A decode plan stores the step's K/V inside its split-KV kernel, so its ``store`` is None;
    prefill and mixed steps store with the separate kernel first.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    store: KernelLaunch | None
    attend: PagedAttentionLaunch | None

    @property
    def stores_kv(self) -> bool:
        """The decode launch writes the step's K/V itself (no separate store)."""
        return isinstance(self.attend, DecodeLaunch) and self.attend.stores_kv


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels (CUDA and ROCm): prefill, decode and mixed batches, FULL-graph capturable.

    The first call of a shape signature checks the layouts, picks the split count and takes the
    split-KV scratch from the layer's (shared) workspace; later calls only launch.
    """

    name = "triton"

    @classmethod
    def plan(cls, layer, query, key, value, output, metadata) -> TritonAttentionPlan:
        key_cache, value_cache = layer.bound_kv_cache()
        query, key, value, output = head_views(layer, query, key, value, output)
        attend = plan_paged_attention(
            query,
            key_cache,
            value_cache,
            output,
            block_tables=metadata.block_tables,
            scale=layer.scale,
            max_query_len=metadata.max_query_len,
            workspace=layer.workspace,
            new_kv=(key, value),  # a decode plan stores them itself: one launch fewer
            quantize_output=output.dtype
            == KERNEL_FP8_DTYPE,  # a decode plan quantizes in its reduce
            sliding_window=layer.sliding_window,
        )
        # Planned either way: it checks the K/V and slot layouts for both paths.
        store = plan_store_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        plan = TritonAttentionPlan(key_cache, value_cache, store, attend)
        return dataclasses.replace(plan, store=None) if plan.stores_kv else plan

    @classmethod
    def run(cls, plan, layer, query, key, value, output, metadata, output_scale=None) -> None:
        # The launches were bound from the (T, H, D) views of tensors with exactly these shapes
        # and strides, and a kernel reads only a tensor's base pointer: the flat tensors go in
        # as they are, without building the views again.
        if plan.store is not None:
            plan.store(key, value, plan.key_cache, plan.value_cache, metadata.slot_mapping)
        if plan.attend is None:
            return
        args = (query, plan.key_cache, plan.value_cache, output, metadata.query_start_loc,
                metadata.seq_lens, metadata.block_tables)  # fmt: skip
        # the scale comes with each call: a plan keeps no tensor value
        quantized = {} if output_scale is None else {"output_scale": output_scale}
        if plan.stores_kv:
            plan.attend(*args, new_kv=(key, value, metadata.slot_mapping), **quantized)
        else:
            plan.attend(*args, **quantized)
