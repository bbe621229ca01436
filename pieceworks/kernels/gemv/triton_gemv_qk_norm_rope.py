"""``pieceworks::small_m_qk_norm_rope_linear``: the qkv GEMV, then the q/k head norms and rotary.

Qwen3 and Gemma 3 normalise each q and k head (RMSNorm over ``head_dim``) between the qkv
projection and the rotary, so the rope epilogue of the GEMV (``triton_gemv_rope.py``) does not
apply: a program of that kernel holds ``block_n`` pairs of a head, not the whole head the norm
needs. Holding whole heads (``block_n = D / 2``) would leave one program per head: 48 for the
Qwen3-8B shape and 16 for Gemma-3-4B's (head_dim 256), too few to stream the weight at the GPU's
bandwidth. So this op runs the GEMV at its own tiling (``small_m_linear``), then one Triton launch
that normalises and rotates the q and k heads in place (``norm_rotate_qk_heads``,
``kernels/rope/triton_qk_norm_rope.py``): two kernels where the unfused graph runs the GEMV, the
norm kernels and the rotary op. Where the kernels do not run, ``F.linear`` and the torch forms
(the oracle). The rope fusion pass (``core/passes/gemv_fusion.py``,
``GemvQKNormRopeFusionPass``) puts it into compiled graphs; ``quantization/base.py`` registers it
with the other GEMV ops.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.kernels.gemv.triton_gemv import small_m_linear
from pieceworks.kernels.rope.triton_qk_norm_rope import norm_rotate_qk_heads


def small_m_qk_norm_rope_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    epsilon: float,
    unit_offset: bool,
) -> torch.Tensor:
    """``F.linear(x, weight)`` for a merged qkv weight ((Hq + 2 Hkv) D, K), then each of its q
    heads normalised by ``q_norm_weight`` and k heads by ``k_norm_weight`` (RMSNorm over D with
    ``epsilon``; Gemma's ``1 + weight`` where ``unit_offset``) and both rotated (neox, every dim)
    at ``positions (T,)``: (T, (Hq + 2 Hkv) D), the v heads as the GEMM made them."""
    qkv = small_m_linear(x, weight)  # (T, (Hq + 2 Hkv) D)
    norm = (q_norm_weight, k_norm_weight, epsilon, unit_offset)
    return norm_rotate_qk_heads(
        positions, qkv, cos_sin_cache, head_size, num_q_heads, num_kv_heads, norm
    )


def small_m_qk_norm_rope_linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    epsilon: float,
    unit_offset: bool,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def small_m_qk_norm_rope_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_qk_norm_rope_linear``, registered on first use (never at
    import)."""
    return direct_register_custom_op(
        "small_m_qk_norm_rope_linear",
        small_m_qk_norm_rope_linear,
        mutates_args=[],
        fake_impl=small_m_qk_norm_rope_linear_fake,
    )
