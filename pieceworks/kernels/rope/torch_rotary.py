"""The rotary embedding in torch: the neox and GPT-J rotations by a cos/sin cache.

The arithmetic every rotary path shares: ``RotaryEmbedding`` (``models/layers/rotary_embedding.py``)
rotates with it, and so do the ops that receive the cache rather than the module (the qkv GEMV's
fallback and oracle, ``kernels/gemv/triton_gemv_rope.py``). Tokens are flattened: heads are
``(num_tokens, num_heads * head_size)``; the cache is ``(max_position, rotary_dim)``, cos in the
first half of each row and sin in the second (vLLM's layout).

``pieceworks::rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox_style)``
is the rotation of q and k as one opaque op (``rotary_embedding_op``): what ``RotaryEmbedding``
calls where the chooser gives ``rotary`` its kernel (the qkv GEMV's epilogue), so that the rope
fusion pass (``core/passes/gemv_fusion.py``) finds it in the graph; its implementation is this
torch form.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op


def apply_rotary_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    """Rotate ``x (T, H, R)`` by ``cos``/``sin (T, 1, R // 2)``.

    Neox style pairs dim ``i`` with ``i + R/2`` (HF ``rotate_half``); GPT-J style pairs adjacent
    dims ``2i, 2i + 1``.
    """
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotate_heads_by_cache(
    positions: torch.Tensor,
    heads: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
) -> torch.Tensor:
    """Every head of ``heads (T, H * D)`` with its first ``R = cos_sin_cache.shape[1]`` dims
    rotated by the cache rows at ``positions (T,)``, the rest unchanged: ``(T, H * D)``.

    cos and sin are cast to the heads' dtype first (the cache is stored in the model dtype).
    """
    rotary_dim = cos_sin_cache.shape[1]
    cos_sin = cos_sin_cache.index_select(0, positions)  # (T, R)
    cos, sin = cos_sin.to(heads.dtype).unsqueeze(1).chunk(2, dim=-1)  # (T, 1, R // 2) each
    num_tokens = heads.shape[0]
    x = heads.view(num_tokens, -1, head_size)  # (T, H, D)
    x_rot = apply_rotary_emb(x[..., :rotary_dim], cos, sin, is_neox_style)
    if rotary_dim < head_size:
        x_rot = torch.cat((x_rot, x[..., rotary_dim:]), dim=-1)
    return x_rot.reshape(num_tokens, -1)  # (T, H * D)


def rotate_leading_heads(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
    is_neox_style: bool,
) -> torch.Tensor:
    """``qkv (T, H * D)`` with its first ``num_rotary_heads`` heads rotated by
    ``rotate_heads_by_cache`` and the others as they are: ``(T, H * D)``."""
    rotary_size = num_rotary_heads * head_size
    heads, rest = qkv.split([rotary_size, qkv.shape[-1] - rotary_size], dim=-1)
    rotated = rotate_heads_by_cache(positions, heads, cos_sin_cache, head_size, is_neox_style)
    return torch.cat((rotated, rest), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query (T, Hq * D)`` and ``key (T, Hkv * D)`` rotated at ``positions (T,)``: new tensors."""
    return (
        rotate_heads_by_cache(positions, query, cos_sin_cache, head_size, is_neox_style),
        rotate_heads_by_cache(positions, key, cos_sin_cache, head_size, is_neox_style),
    )


def rotary_embedding_fake(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key)


def rotary_embedding_op() -> Any:
    """``torch.ops.pieceworks.rotary_embedding``, registered on first use (never at import)."""
    return direct_register_custom_op(
        "rotary_embedding", rotary_embedding, mutates_args=[], fake_impl=rotary_embedding_fake
    )
