"""What the ``static_compiled`` peer changes in an HF Llama: grouped-query attention that reads
each KV head once, and one q/k/v matmul per layer.

HF's own SDPA path passes ``enable_gqa`` only without a mask, and a static cache always has one,
so under torch.compile it calls ``repeat_kv`` and copies K and V out to every query head over the
whole cache each step (at the 8B shape, batch 64, context 1k: tens of GB per step). The function
registered through transformers' ``AttentionInterface`` (``gqa_sdpa_attention``) reads each KV
head once instead: a one-token step runs ``flex_attention`` with ``enable_gqa`` over a causal
``BlockMask`` (gpt-fast's decode, which also skips the cache blocks past the position;
transformers' own ``flex_attention`` does not compile with ``fullgraph`` in transformers 5.17), a
prompt SDPA with the query heads of a KV head folded into the query length. Each layer's q, k and
v projections run as one matmul (``fuse_hf_qkv``, the recipe's fused ``wqkv``): HF's three
separate projections cost 0.40 ms of device time per step at the 8B shape, batch 1
(``benchmarks/profile_peers.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import flex_attention

from pieceworks.benchmarks.peers.gpt_fast_model import decode_mask
from pieceworks.benchmarks.peers.hf_model import import_transformers

GQA_ATTENTION = "pieceworks_gqa_sdpa"


def gqa_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Grouped-query attention over the static cache, reading each KV head once.

    A one-token step of a module carrying ``decode_block_mask`` (``StaticCacheDecoder`` sets it)
    runs ``flex_attention`` with ``enable_gqa`` over that mask's row for the step's position (from
    ``position_ids``), as gpt-fast's decode does: the cache split across programs and the blocks
    past the position skipped. Otherwise SDPA under the mask:

    ``query`` ``(B, H, T, D)``, ``key``/``value`` ``(B, H_kv, S, D)`` (the whole static cache),
    ``attention_mask`` ``(B, 1, T, S)`` or None. The ``n_rep = H / H_kv`` query heads of a KV head
    are folded into the query length, ``(B, H_kv, n_rep * T, D)``, and the mask repeated to
    match, so no ``repeat_kv`` copy of the cache is made. Returns ``(B, T, H, D)`` as HF expects.
    """
    batch, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    n_rep = num_heads // num_kv_heads
    block_mask = getattr(module, "decode_block_mask", None)
    if num_tokens == 1 and block_mask is not None:  # a one-token step: flex attention, as gpt-fast
        position = kwargs.get("position_ids")
        if position is None:
            raise RuntimeError(
                "this transformers version passes no position_ids to the attention function; "
                "the static_compiled loop needs them for its decode mask"
            )
        step_mask = decode_mask(block_mask, position.reshape(-1)[:1], key.shape[-2])
        output = flex_attention(
            query, key, value, block_mask=step_mask, scale=scaling, enable_gqa=n_rep > 1
        )
        return output.transpose(1, 2).contiguous(), None
    folded = query.reshape(batch, num_kv_heads, n_rep * num_tokens, head_dim)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        rows = (mask.shape[0], mask.shape[1], n_rep, num_tokens, mask.shape[-1])
        mask = mask[:, :, None].expand(rows).reshape(rows[0], rows[1], -1, rows[-1])
    elif num_tokens > 1:  # no mask given: causal over a prompt that fills the cache from 0
        mask = torch.ones(num_tokens, key.shape[-2], dtype=torch.bool, device=query.device)
        mask = mask.tril(key.shape[-2] - num_tokens).repeat(n_rep, 1)
    output = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    output = output.reshape(batch, num_heads, num_tokens, head_dim)
    return output.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: nn.Module) -> None:
    """Register ``gqa_sdpa_attention`` with transformers and make ``model`` use it (masks made
    as for SDPA)."""
    transformers = import_transformers()
    transformers.AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_attention)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        from transformers.masking_utils import sdpa_mask

        masks.register(GQA_ATTENTION, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(GQA_ATTENTION)  # type: ignore[operator]
    else:
        model.config._attn_implementation = GQA_ATTENTION  # type: ignore[union-attr]


class _QkvParts:
    """What the fused projection hands to ``k_proj`` and ``v_proj`` within one attention call."""

    parts: list[torch.Tensor] | None = None


class _FusedQkvProjection(nn.Module):
    """``q_proj``'s replacement: q, k and v in one matmul of the concatenated weights; the k and
    v columns wait in ``holder`` for the ``k_proj`` and ``v_proj`` calls that follow."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, holder: _QkvParts) -> None:
        super().__init__()
        projections = (q, k, v)
        self.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=False)
        biases = [p.bias for p in projections]
        self.bias = None
        if all(b is not None for b in biases):
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)  # type: ignore[arg-type]
        self.sizes = [p.weight.shape[0] for p in projections]
        self.holder = holder

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query, key, value = F.linear(hidden_states, self.weight, self.bias).split(self.sizes, -1)
        self.holder.parts = [key, value]
        return query


class _FusedQkvPart(nn.Module):
    """``k_proj`` (``index`` 0) or ``v_proj`` (1) after fusion: the part the fused q projection
    made for this call; ``v_proj`` empties the holder (nothing outlives the attention call)."""

    def __init__(self, holder: _QkvParts, index: int) -> None:
        super().__init__()
        self.holder = holder
        self.index = index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        parts = self.holder.parts
        if parts is None:
            raise RuntimeError(
                "the fused q/k/v projection of the static_compiled peer expects q_proj to be "
                "called before k_proj and v_proj (this transformers version calls them in "
                "another order); run the peer with fuse_qkv=False"
            )
        if self.index == 1:
            self.holder.parts = None
        return parts[self.index]


def fuse_hf_qkv(model: nn.Module) -> int:
    """Give every attention layer of an HF Llama-family ``model`` one q/k/v matmul, as the
    gpt-fast recipe's ``wqkv`` (Inductor does not merge matmuls of unequal widths itself, and a
    one-token step reads the input once instead of three times); how many layers were fused.
    The three projections keep their names and call order, so HF's attention code is unchanged."""
    fused = 0
    for module in model.modules():
        q, k, v = (getattr(module, name, None) for name in _QKV_NAMES)
        if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear)):
            continue
        holder = _QkvParts()
        module.q_proj = _FusedQkvProjection(q, k, v, holder)
        module.k_proj = _FusedQkvPart(holder, 0)
        module.v_proj = _FusedQkvPart(holder, 1)
        fused += 1
    return fused


_QKV_NAMES = ("q_proj", "k_proj", "v_proj")
