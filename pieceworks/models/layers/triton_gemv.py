"""A Triton GEMV for decode-sized linear layers: ``y = x W^T`` for 1 to 16 tokens.

Why: on an H200, decoding the Llama-3.1-8B shape at batch 1, cuBLAS runs ``qkv_proj``,
``o_proj`` and ``down_proj`` as split-K kernels, each followed by a ``splitKreduce`` kernel. A
decode GEMV only has to stream W once, so this kernel keeps many bytes of W in flight per SM and
needs no reduction afterwards. Measured inside a CUDA graph with one weight per layer
(``benchmarks/gemv_decode.py``): 109.5 against 115.6 us per 8B layer at one token, never slower
from 1 to 16 tokens (``docs/performance.md``, session 4).

Layout contract: ``x`` is (M, K) and ``weight`` is (N, K), both contiguous along K (a linear
layer's row-major weight), same dtype (float16, bfloat16 or float32); the result is (M, N) in
that dtype, accumulated in float32. Each program owns ``BLOCK_N`` output columns for all M rows
and walks K in ``BLOCK_K`` chunks, so loads of W are coalesced along K and no two programs write
the same output: no atomics, the result is deterministic. The M rows are padded to 16 (masked)
so the product runs on tensor cores; it is computed as ``W x^T`` (W as the left operand), which
leaves W in its natural K-major layout.

``small_m_linear`` is the entry point and the op ``pieceworks::small_m_linear``: the kernel when
there are at most ``MAX_GEMV_TOKENS`` tokens on a GPU Triton targets, else ``F.linear``. The
choice is made inside the op at run time, because the token count is symbolic when Dynamo
traces the op (inside a static graph it is fixed per capture size). Compiled graphs route
unquantized linear layers here where the platform runs pieceworks' Triton kernels
(``quantization/base.py``; ``PIECEWORKS_SMALL_M_GEMV`` overrides); eager calls keep ``F.linear``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.platforms import current_platform

MAX_GEMV_TOKENS = 16  # what small_m_linear routes to the kernel; above it, cuBLAS
MAX_KERNEL_TOKENS = 64  # what the kernel takes (benchmarks measure 32 and 64 against cuBLAS)
MIN_BLOCK_M = 16  # tokens padded to at least the smallest tensor-core tile
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch configuration: padded tokens, output columns and K chunk per program, warps,
    pipeline stages."""

    block_m: int = MIN_BLOCK_M
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=256)
def gemv_config(
    m: int, n: int, k: int, element_size: int = 2, max_shared_bytes: int | None = None
) -> GemvConfig:
    """The launch configuration for an (m, k) x (n, k)^T product, from shapes alone.

    From H200 sweeps (``benchmarks/gemv_decode.py``, bfloat16, the four 8B shapes, M 1 to 16,
    block_n 16/32/64 x block_k 128/256/512 x warps/stages 4x3, 4x4, 8x4, then the tiles again
    inside a CUDA graph): 4 warps and 4 stages were best or within 5% of it on every shape, and
    the tile depended on the shape, not on M:
    - N >= 16384 (gate_up_proj, 28672 x 4096): 64 x 128;
    - K >= 8192 (down_proj, 4096 x 14336): 32 x 512;
    - otherwise (qkv_proj, o_proj): 64 x 256.
    The first guess (16 columns per program) ran o_proj at half the speed of these. Tokens are
    padded to ``block_m``, the next power of two from 16 (32 and 64 tokens: not swept yet).
    Widths are for 16-bit types; float32 halves ``block_k`` to keep the bytes per chunk. A GPU
    with less shared memory per SM than ``stages x (block_n + 16) x block_k`` elements (smaller
    than an H200's 228 KiB) gets fewer stages, then narrower K chunks, instead of a launch error.
    """
    if n >= 16384:
        block_n, block_k = 64, 128
    elif k >= 8192:
        block_n, block_k = 32, 512
    else:
        block_n, block_k = 64, 256
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(m))
    block_k = min(block_k * 2 // element_size, max(triton.next_power_of_2(k), 16))
    num_stages = 4
    if max_shared_bytes is not None:
        stage_bytes = lambda: (block_n + block_m) * block_k * element_size  # W and x chunks
        while num_stages > 2 and num_stages * stage_bytes() > max_shared_bytes:
            num_stages -= 1
        while block_k > 16 and num_stages * stage_bytes() > max_shared_bytes:
            block_k //= 2
    return GemvConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=num_stages)


def max_shared_bytes(device: torch.device) -> int | None:
    """Shared memory per block on ``device``'s GPU, or None where Triton runs interpreted."""
    if _INTERPRETED or device.type == "cpu":
        return None
    return _max_shared_bytes(device.index or 0)  # a GPU tensor's device always has its index


@functools.lru_cache(maxsize=16)
def _max_shared_bytes(device_index: int) -> int:
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(properties["max_shared_mem"])


@triton.jit
def _gemv_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    stride_x,
    stride_weight,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features of this program
    tokens = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    column_mask = columns < out_features
    token_mask = tokens < num_tokens
    weight_rows = weight_ptr + columns.to(tl.int64)[:, None] * stride_weight  # (BLOCK_N, 1)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # (N, M): y^T = W x^T
    for k_start in range(0, in_features, BLOCK_K):
        k_mask = (k_start + ks) < in_features
        w = tl.load(
            weight_rows + (k_start + ks)[None, :],
            mask=column_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        x = tl.load(
            x_rows + (k_start + ks)[None, :],
            mask=token_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    out = out_ptr + tokens.to(tl.int64)[None, :] * stride_out + columns[:, None]  # (N, M)
    mask = column_mask[:, None] & token_mask[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits
# (triton-lang/triton#11584, "not supported yet"): there the kernel widens them to float32 first.
# Exact (bfloat16 -> float32 loses nothing), so only the accumulation order can differ from a GPU.
_INTERPRETED = type(_gemv_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1


def launch_gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None
) -> torch.Tensor:
    """``x @ weight^T`` by the kernel, (M, N) in x's dtype; x (M <= 64, K), weight (N, K)."""
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    if num_tokens > MAX_KERNEL_TOKENS:
        raise ValueError(f"the GEMV takes at most {MAX_KERNEL_TOKENS} tokens, got {num_tokens}")
    if config is None:
        config = gemv_config(
            num_tokens, out_features, in_features, x.element_size(), max_shared_bytes(x.device)
        )
    if num_tokens > config.block_m:
        raise ValueError(f"{num_tokens} tokens do not fit block_m={config.block_m}")
    out = x.new_empty((num_tokens, out_features))
    grid = (triton.cdiv(out_features, config.block_n),)
    _gemv_kernel[grid](
        x,
        weight,
        out,
        num_tokens,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        # float32 stays float32 (as F.linear by default), not TF32; 16-bit: the backend default
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        UPCAST=_INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def kernel_runs_on(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on the platform's device and the platform runs pieceworks' Triton
    kernels (CUDA, ROCm)."""
    platform = current_platform()
    return platform.runs_triton_kernels() and x.device.type == platform.device_type


def uses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_m_linear`` runs the kernel for these operands (else ``F.linear``)."""
    return (
        0 < x.shape[0] <= MAX_GEMV_TOKENS
        and x.dtype == weight.dtype
        and x.dtype in SUPPORTED_DTYPES
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and kernel_runs_on(x)
    )


def small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D x (T, K); the Triton GEMV when ``uses_kernel``."""
    if not uses_kernel(x, weight):
        return F.linear(x, weight, bias)
    out = launch_gemv(x, weight)  # (T, N)
    return out if bias is None else out + bias


def small_m_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


_small_m_linear_op: Any = None


def small_m_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_linear``, registered on first use (never at import).

    ``UnquantizedLinearMethod`` calls this when it is built: registering cannot be traced, so
    the op must exist before Dynamo meets the first linear layer.
    """
    global _small_m_linear_op
    if _small_m_linear_op is None:
        _small_m_linear_op = direct_register_custom_op(
            "small_m_linear", small_m_linear, mutates_args=[], fake_impl=small_m_linear_fake
        )
    return _small_m_linear_op
