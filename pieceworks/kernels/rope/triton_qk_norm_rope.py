"""Per-head RMSNorm of q and k, then their rotary, in one launch: ``norm_rotate_qk_heads``.

Why: Qwen3 and Gemma 3 normalise every q and k head (over ``head_dim``) between the qkv projection
and the rotary. Unfused, a decode step runs per layer the qkv GEMV, the norm kernels Inductor makes
of the two norms, and the rotary op; here the GEMV's result is normalised and rotated in place by
one Triton kernel (``small_m_qk_norm_rope_linear``, ``kernels/gemv/triton_gemv_qk_norm_rope.py``,
launches the GEMV and then this).

Algorithm and layout: ``qkv (T, (Hq + 2 Hkv) D)``, a fresh GEMM result, row-major. One program
holds a whole head (its ``D / 2`` neox pairs ``(i, i + D/2)``) for ``BLOCK_TOKENS`` tokens: it
reads the head's values in float32, sums their squares per token, scales by
``rsqrt(mean + eps)`` and the norm weight (``q_weight`` for the first ``Hq`` heads, ``k_weight``
for the next ``Hkv``), rotates the pairs with the cos/sin cache row of each token's position and
writes the head back; the v heads are not touched. Under programmatic dependent launch it lets
the next kernel (decode attention) be scheduled at its start and reads the weights, positions and
cache before it waits for the GEMV. The rounding follows the torch forms the model
traces (``core.norm_quant``): ``rms_norm`` rounds the normalised value to the model dtype and
multiplies by the weight in the model dtype; ``gemma_rms_norm`` (``unit_offset``) multiplies by
``1 + weight`` in float32 and rounds once; the rotation is float32 math rounded once, as Inductor
computes the unfused rotation. Invariants: the cache is in qkv's dtype with every dim rotated
(neox), both weights are ``(D,)`` in qkv's dtype (the plain norm's product is in that dtype).
Elsewhere (no Triton device, CPU tensors, another layout) the torch forms run: ``rms_norm`` or
``gemma_rms_norm`` per head, then ``rotary_embedding`` (``torch_rotary.py``): the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.core.norm_quant import gemma_rms_norm, rms_norm
from pieceworks.kernels import triton_device
from pieceworks.kernels.nvidia_pdl import gdc_launch_dependents, gdc_wait
from pieceworks.kernels.rope.torch_rotary import rotary_embedding
from pieceworks.kernels.triton_launch import launch, launch_options, programmatic_launch
from pieceworks.kernels.triton_rounding import round_to

NORM_BLOCK_TOKENS = 16  # tokens per program


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    num_tokens,
    num_q_heads,
    stride_qkv,
    stride_cos_sin,
    epsilon,
    HEAD_SIZE: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program: head tl.program_id(1) (q, then k) of BLOCK_TOKENS tokens, in place.
    if PDL:  # decode attention comes next: it may be scheduled now and load its K/V (it waits
        gdc_launch_dependents()  # for this kernel before it reads q or k)
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_mask = tokens < num_tokens
    head = tl.program_id(1)
    half = HEAD_SIZE // 2
    pairs = tl.arange(0, BLOCK)
    pair_mask = pairs < half
    mask = token_mask[:, None] & pair_mask[None, :]  # (BLOCK_TOKENS, BLOCK)
    if head < num_q_heads:
        w1 = tl.load(q_weight_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        w2 = tl.load(q_weight_ptr + half + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    else:
        w1 = tl.load(k_weight_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        w2 = tl.load(k_weight_ptr + half + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    # what no kernel of the step writes (parameters, the cache, the positions the runner copied
    # before the step) is read before the wait; qkv, the GEMV's result, after it
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    cos_ptrs = cos_sin_ptr + positions[:, None] * stride_cos_sin + pairs[None, :]
    cos = tl.load(cos_ptrs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    rows = qkv_ptr + tokens.to(tl.int64)[:, None] * stride_qkv + head * HEAD_SIZE
    x1_ptrs = rows + pairs[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_SIZE  # (BLOCK_TOKENS,)
    inv_rms = (1.0 / tl.sqrt_rn(variance + epsilon))[:, None]  # IEEE sqrt, not the fast one
    if UNIT_OFFSET:  # gemma_rms_norm: (x * inv_rms) * (1 + w) in float32, rounded once
        x1 = round_to(x1 * inv_rms * (1.0 + w1[None, :]), dtype)
        x2 = round_to(x2 * inv_rms * (1.0 + w2[None, :]), dtype)
    else:  # rms_norm: x * inv_rms rounded, times w rounded
        x1 = round_to(round_to(x1 * inv_rms, dtype) * w1[None, :], dtype)
        x2 = round_to(round_to(x2 * inv_rms, dtype) * w2[None, :], dtype)
    tl.store(x1_ptrs, round_to(x1 * cos - x2 * sin, dtype).to(dtype), mask=mask)
    tl.store(x1_ptrs + half, round_to(x2 * cos + x1 * sin, dtype).to(dtype), mask=mask)


def uses_norm_rope_kernel(
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    head_size: int,
) -> bool:
    """Whether ``norm_rotate_qk_heads`` runs the kernel for these operands (else the torch
    forms)."""
    return (
        triton_device.kernel_runs_on(qkv)
        and qkv.shape[0] > 0
        and qkv.stride(1) == 1
        and cos_sin_cache.shape[1] == head_size  # every dim rotated
        and cos_sin_cache.stride(1) == 1
        and cos_sin_cache.dtype == qkv.dtype  # the torch rotation casts the cache to qkv's
        and all(w.shape == (head_size,) and w.is_contiguous() for w in (q_weight, k_weight))
        and q_weight.dtype == k_weight.dtype == qkv.dtype
    )


def norm_rotate_qk_heads_torch(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    norm: tuple[torch.Tensor, torch.Tensor, float, bool],
) -> torch.Tensor:
    """The torch forms the model traces: each q and k head normalised (``rms_norm``, or
    ``gemma_rms_norm`` where ``unit_offset``), then rotated (neox); a new ``(T, N)`` tensor."""
    q_weight, k_weight, epsilon, unit_offset = norm
    head_norm = gemma_rms_norm if unit_offset else rms_norm
    q_size, kv_size = num_q_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, qkv.shape[-1] - q_size - kv_size], dim=-1)
    q = head_norm(q.reshape(-1, head_size), q_weight, epsilon).view(-1, q_size)
    k = head_norm(k.reshape(-1, head_size), k_weight, epsilon).view(-1, kv_size)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, head_size, True)
    return torch.cat((q, k, v), dim=-1)


def norm_rotate_qk_heads(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    norm: tuple[torch.Tensor, torch.Tensor, float, bool],
) -> torch.Tensor:
    """``qkv (T, (Hq + 2 Hkv) D)``, a fresh GEMM result, with its q and k heads normalised and
    rotated at ``positions (T,)``: in place by one launch where ``uses_norm_rope_kernel``, else
    by ``norm_rotate_qk_heads_torch``. ``norm = (q_weight, k_weight, epsilon, unit_offset)``."""
    q_weight, k_weight, epsilon, unit_offset = norm
    if not uses_norm_rope_kernel(qkv, cos_sin_cache, q_weight, k_weight, head_size):
        return norm_rotate_qk_heads_torch(
            positions, qkv, cos_sin_cache, head_size, num_q_heads, num_kv_heads, norm
        )
    num_tokens = qkv.shape[0]
    grid = (triton.cdiv(num_tokens, NORM_BLOCK_TOKENS), num_q_heads + num_kv_heads)
    pdl = programmatic_launch(qkv.device)
    launch(
        _qk_norm_rope_kernel,
        grid,
        qkv,
        positions.contiguous(),
        cos_sin_cache,
        q_weight,
        k_weight,
        num_tokens,
        num_q_heads,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        epsilon,
        HEAD_SIZE=head_size,
        UNIT_OFFSET=unit_offset,
        BLOCK_TOKENS=NORM_BLOCK_TOKENS,
        BLOCK=triton.next_power_of_2(head_size // 2),
        PDL=pdl,
        **launch_options(pdl),
    )
    return qkv
