"""The qkv GEMV with rotary embedding as its epilogue: ``pieceworks::small_m_rope_linear``.

Why: in a compiled decode graph the qkv GEMV writes q, k and v, and Inductor then runs one more
kernel that reads q and k back, rotates them and writes them again. The GEMV's ``ROPE`` mode
(``triton_gemv.py``) stacks each head's first-half rows on their partners (the gated epilogue's
trick), so one program holds both values of a pair and stores them rotated: one kernel fewer per
decoder layer, and q and k reach memory once.

What is fused: neox-style rotary on every dim of a head (``RotaryEmbedding.is_full_neox``, Llama),
no bias, head sizes that are multiples of 16, at most ``max_gemv_tokens(weight)`` tokens on a device
the kernel runs on, with a cache in the output dtype. Everything else takes the fallback: the
unfused GEMM, then the rotation (``rotate_qk_heads``): one Triton launch that rotates the q and k
heads in place where the kernels run (inside the op Inductor cannot fuse the rotation, and as eager
torch ops it would be about ten launches per layer at batch 64 and in prefill), else
``rotate_leading_heads`` (the rotation ``RotaryEmbedding`` computes). The choice is made inside the
op at run time, like ``small_m_linear``'s. ``quantization/base.py`` registers the op and
``quantization/fp8.py`` the FP8 form; the rope fusion pass (``core/passes/gemv_fusion.py``) puts
them into compiled graphs in place of the qkv GEMV and the rotary op after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.kernels import triton_device
from pieceworks.kernels.gemv.triton_gemv import (
    MIN_ROPE_BLOCK_N,
    SUPPORTED_DTYPES,
    RopeEpilogue,
    launch_gemv,
    uses_kernel,
)
from pieceworks.kernels.rope.torch_rotary import rotate_leading_heads
from pieceworks.kernels.triton_launch import launch
from pieceworks.kernels.triton_rounding import round_to

ROTATE_BLOCK_TOKENS = 16  # tokens per program of the in-place rotation


@triton.jit
def _rotate_qk_heads_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_tokens,
    stride_qkv,
    stride_cos_sin,
    HEAD_SIZE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: head tl.program_id(1) of BLOCK_TOKENS tokens, rotated in place (neox, every
    # dim), in float32 and rounded once, as Inductor computes the unfused rotation.
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_mask = tokens < num_tokens
    half = HEAD_SIZE // 2
    pairs = tl.arange(0, BLOCK)
    mask = token_mask[:, None] & (pairs < half)[None, :]  # (BLOCK_TOKENS, BLOCK)
    rows = qkv_ptr + tokens.to(tl.int64)[:, None] * stride_qkv + tl.program_id(1) * HEAD_SIZE
    x1_ptrs = rows + pairs[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    cos_ptrs = cos_sin_ptr + positions[:, None] * stride_cos_sin + pairs[None, :]
    cos = tl.load(cos_ptrs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    tl.store(x1_ptrs, round_to(x1 * cos - x2 * sin, dtype).to(dtype), mask=mask)
    tl.store(x1_ptrs + half, round_to(x2 * cos + x1 * sin, dtype).to(dtype), mask=mask)


def rotate_qk_heads(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
) -> torch.Tensor:
    """``qkv (T, H * D)``, a fresh GEMM result, with its first ``num_rotary_heads`` heads rotated
    (neox, every dim): in place by one Triton launch where the kernels run on it, else
    ``rotate_leading_heads``."""
    num_tokens = qkv.shape[0]
    if (
        not triton_device.kernel_runs_on(qkv)
        or qkv.stride(1) != 1
        or cos_sin_cache.stride(1) != 1
        or cos_sin_cache.dtype != qkv.dtype  # the torch rotation casts the cache to qkv's
        or num_tokens == 0
    ):
        return rotate_leading_heads(
            positions, qkv, cos_sin_cache, head_size, num_rotary_heads, is_neox_style=True
        )
    grid = (triton.cdiv(num_tokens, ROTATE_BLOCK_TOKENS), num_rotary_heads)
    launch(
        _rotate_qk_heads_kernel,
        grid,
        qkv,
        positions.contiguous(),
        cos_sin_cache,
        num_tokens,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        HEAD_SIZE=head_size,
        BLOCK_TOKENS=ROTATE_BLOCK_TOKENS,
        BLOCK=triton.next_power_of_2(head_size // 2),
    )
    return qkv


def uses_rope_kernel(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    out_dtype: torch.dtype,
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
) -> bool:
    """Whether the rope ops run the kernel for these operands (else their fallback)."""
    return (
        uses_kernel(x, weight, dtypes)
        and head_size % (2 * MIN_ROPE_BLOCK_N) == 0  # a tile of whole pairs fits a head
        and weight.shape[0] % head_size == 0
        and cos_sin_cache.shape[1] == head_size  # every dim rotated
        and cos_sin_cache.dtype == out_dtype  # what the unfused rotation casts it to
        and cos_sin_cache.stride(1) == 1
    )


def rope_epilogue(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int, num_rotary_heads: int
) -> RopeEpilogue:
    """The epilogue's operands, ``positions`` as one contiguous int per token."""
    return RopeEpilogue(positions.contiguous(), cos_sin_cache, head_size, num_rotary_heads)


def small_m_rope_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
) -> torch.Tensor:
    """``F.linear(x, weight)`` for a merged qkv weight ((Hq + 2 Hkv) D, K), its first
    ``num_rotary_heads`` heads rotated (neox, every dim) at ``positions (T,)``: (T, (Hq + 2 Hkv) D).

    One GEMV with the rotation as its epilogue when ``uses_rope_kernel``, else ``F.linear`` and
    ``rotate_qk_heads``.
    """
    if not uses_rope_kernel(x, weight, cos_sin_cache, head_size, x.dtype):
        qkv = F.linear(x, weight)  # (T, (Hq + 2 Hkv) D)
        return rotate_qk_heads(positions, qkv, cos_sin_cache, head_size, num_rotary_heads)
    rope = rope_epilogue(positions, cos_sin_cache, head_size, num_rotary_heads)
    return launch_gemv(x, weight, rope=rope)


def small_m_rope_linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def small_m_rope_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_rope_linear``, registered on first use (never at import)."""
    return direct_register_custom_op(
        "small_m_rope_linear",
        small_m_rope_linear,
        mutates_args=[],
        fake_impl=small_m_rope_linear_fake,
    )
