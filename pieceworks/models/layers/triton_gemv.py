"""A Triton GEMV for decode-sized linear layers: ``y = x W^T`` for 1 to 16 tokens.

Why: on an H200, decoding the Llama-3.1-8B shape at batch 1, cuBLAS runs ``qkv_proj``,
``o_proj`` and ``down_proj`` as split-K kernels, each followed by a ``splitKreduce`` kernel. A
decode GEMV only has to stream W once, so this kernel keeps many bytes of W in flight per SM and
needs no reduction afterwards. Measured inside a CUDA graph with one weight per layer
(``benchmarks/gemv_decode.py``): 109.5 against 115.6 us per 8B layer at one token, never slower
from 1 to 16 tokens (``docs/performance.md``, session 4).

Layout contract: ``x`` is (M, K) and ``weight`` is (N, K), both contiguous along K (a linear
layer's row-major weight), same dtype (float16, bfloat16, float32, or float8_e4m3fn with a
per-tensor scale each); the result is (M, N), accumulated in float32. Each program owns
``BLOCK_N`` output columns for all M rows and walks K in ``BLOCK_K`` chunks, so loads of W are
coalesced along K and no two programs write the same output: no atomics, the result is
deterministic. The M rows are padded to 16 (masked) so the product runs on tensor cores; it is
computed as ``W x^T`` (W as the left operand), which leaves W in its natural K-major layout.
Two epilogues, applied after the K loop so they cost the pipelined loads nothing
(``docs/performance.md``, session 4, says why not before the ``tl.dot``):
- gated: for a merged [gate; up] weight each program stacks the up rows of its columns under the
  gate rows (one ``tl.dot`` of a full tile; two half-height dots were 40% slower), splits the
  accumulator and stores ``silu(gate) * up``, so the (M, 2N) product never reaches memory;
- static FP8 quantization of the result (the next FP8 layer's input), as
  ``core.norm_quant.static_scaled_fp8_quant`` computes it.
FP8 operands on Hopper: Triton's default lets the MMA add products in reduced precision over the
whole K loop (FP8 "fast accumulation", as CUTLASS's FP8FastAccum kernels do). On an H200 that
left errors up to 2e-3 on outputs near 1, below the bfloat16 rounding of the result; folding
every instruction's sum into float32 (``max_num_imprecise_acc=32``) made qkv, o and down 23 to
59% slower (``docs/benchmarks.md``, session 5), so the kernel keeps the default.

``small_m_linear`` is the entry point and the op ``pieceworks::small_m_linear``: the kernel when
there are at most ``MAX_GEMV_TOKENS`` tokens on a GPU Triton targets, else ``F.linear``. The
choice is made inside the op at run time, because the token count is symbolic when Dynamo
traces the op (inside a static graph it is fixed per capture size). Compiled graphs route
unquantized linear layers here where the platform runs pieceworks' Triton kernels
(``quantization/base.py``; ``PIECEWORKS_SMALL_M_GEMV`` overrides); eager calls keep ``F.linear``.
``pieceworks::small_m_silu_and_mul_linear`` is the gated form (the MLP's gate/up projection), and
``quantization/fp8.py`` registers the FP8 forms of both.
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
from pieceworks.core.norm_quant import FP8_DTYPE, FP8_MAX, static_scaled_fp8_quant
from pieceworks.models.layers.activation import silu_and_mul
from pieceworks.models.layers.triton_launch import launch_options, programmatic_launch
from pieceworks.models.layers.triton_rounding import TRITON_DTYPES, round_to, round_to_e4m3
from pieceworks.platforms import current_platform

MAX_GEMV_TOKENS = 16  # what small_m_linear routes to the kernel; above it, cuBLAS
MAX_KERNEL_TOKENS = 64  # what the kernel takes (benchmarks measure 32 and 64 against cuBLAS)
MIN_BLOCK_M = 16  # tokens padded to at least the smallest tensor-core tile
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MAX = tl.constexpr(FP8_MAX)


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
    m: int,
    n: int,
    k: int,
    element_size: int = 2,
    max_shared_bytes: int | None = None,
    gated: bool = False,
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
    FP8 (one byte) was swept separately (H200, in a graph, m = 1, 64/32/16/128 columns x 256 to
    1024 bytes of K x 3/4/6 stages): 64 x 256 with 6 stages was best or within 1% on qkv, o and
    down (down: 16.9 against 19.8 us for the bfloat16 rule's 32 x 1024), and with 4 on gate_up.
    ``gated`` (``n`` counts the gate and the up rows): a program stacks ``block_n`` rows of each,
    so ``block_n`` is halved to keep the rows per program (one tensor-core tile) of the plain one.
    """
    num_stages = 4
    if element_size == 1:  # FP8: 64 x 256 everywhere, 6 stages except for gate_up
        block_n, block_k = 64, 128
        num_stages = 4 if n >= 16384 else 6
    elif n >= 16384:
        block_n, block_k = 64, 128
    elif k >= 8192:
        block_n, block_k = 32, 512
    else:
        block_n, block_k = 64, 256
    weight_rows = block_n
    if gated:
        block_n //= 2
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(m))
    block_k = min(block_k * 2 // element_size, max(triton.next_power_of_2(k), 16))
    if max_shared_bytes is not None:
        stage_bytes = lambda: (weight_rows + block_m) * block_k * element_size  # W and x chunks
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
    x_scale_ptr,
    weight_scale_ptr,
    out_scale_ptr,
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
    SCALED: tl.constexpr,
    GATED: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    # GATED: the weight is [gate; up] (2 * out_features rows) and the program's tile stacks the
    # gate rows of its BLOCK_N columns on their up rows, so one tl.dot of 2 * BLOCK_N rows (a
    # full tensor-core tile) serves both; the accumulator is split in the epilogue.
    BLOCK_ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    first_column = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_ROWS)
    row_columns = first_column + rows % BLOCK_N  # the output column each weight row feeds
    weight_rows = row_columns + (rows // BLOCK_N) * out_features  # up rows: out_features further
    row_mask = row_columns < out_features
    tokens = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    weight_ptrs = weight_ptr + weight_rows.to(tl.int64)[:, None] * stride_weight  # (ROWS, 1)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_M), dtype=tl.float32)  # (N, M): y^T = W x^T
    k_begin = 0
    if PDL:  # launched early, while the kernel before (x's producer) may still run: W does
        # not depend on it, so the first W chunk is loaded before the wait and its HBM latency
        # overlaps that kernel (never interpreted, so no UPCAST here)
        first_mask = ks < in_features
        w = tl.load(weight_ptrs + ks[None, :], mask=row_mask[:, None] & first_mask[None, :])
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_rows + ks[None, :], mask=token_mask[:, None] & first_mask[None, :])
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
        k_begin = BLOCK_K
    for k_start in range(k_begin, in_features, BLOCK_K):
        k_mask = (k_start + ks) < in_features
        w = tl.load(
            weight_ptrs + (k_start + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_ROWS, BLOCK_K)
        x = tl.load(
            x_rows + (k_start + ks)[None, :],
            mask=token_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    if PDL:  # W is streamed: the next kernel may be scheduled now (it waits for this one)
        tl.extra.cuda.gdc_launch_dependents()
    if SCALED:  # FP8: y = (x_fp8 W_fp8^T) * x_scale * weight_scale
        acc = acc * (tl.load(x_scale_ptr) * tl.load(weight_scale_ptr))
    if GATED:  # silu(gate) * up, from gate and up as the unfused GEMM would have stored them
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        gate = round_to(gate, ROUND_DTYPE)
        up = round_to(up, ROUND_DTYPE)
        acc = gate / (1.0 + tl.exp(-gate)) * up  # (BLOCK_N, BLOCK_M)
    if QUANT_OUT:  # static FP8 quantization, rounded as static_scaled_fp8_quant rounds
        acc = round_to_e4m3(acc / tl.load(out_scale_ptr), _FP8_MAX)
    columns = first_column + tl.arange(0, BLOCK_N)
    column_mask = columns < out_features
    out = out_ptr + tokens.to(tl.int64)[None, :] * stride_out + columns[:, None]  # (N, M)
    mask = column_mask[:, None] & token_mask[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits
# (triton-lang/triton#11584, "not supported yet"): there the kernel widens them to float32 first.
# Exact (bfloat16 -> float32 loses nothing), so only the accumulation order can differ from a GPU.
_INTERPRETED = type(_gemv_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    out_scale_ptr,
    out_features,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    QUANT_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < out_features
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + out_features + columns, mask=mask, other=0.0).to(tl.float32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    if QUANT_OUT:
        result = round_to_e4m3(result / tl.load(out_scale_ptr), _FP8_MAX)
    tl.store(out_ptr + token * stride_out + columns, result.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_epilogue(gate_up: torch.Tensor, out_scale: torch.Tensor | None) -> torch.Tensor:
    """The gated GEMV's epilogue alone, for products the GEMV does not take (more than 16
    tokens): ``silu_and_mul(gate_up)``, quantized with ``out_scale`` if given, in one kernel where
    ``kernel_runs_on`` (inside the op Inductor cannot fuse it), else in torch."""
    if not kernel_runs_on(gate_up) or gate_up.stride(1) != 1:
        activated = silu_and_mul(gate_up.float() if out_scale is not None else gate_up)
        return activated if out_scale is None else static_scaled_fp8_quant(activated, out_scale)
    num_tokens, out_features = gate_up.shape[0], gate_up.shape[1] // 2
    dtype = FP8_DTYPE if out_scale is not None else gate_up.dtype
    out = torch.empty((num_tokens, out_features), dtype=dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(out_features, block))](
        gate_up,
        out,
        out_scale if out_scale is not None else gate_up,
        out_features,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        QUANT_OUT=out_scale is not None,
    )
    return out


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` by the kernel, (M, N); x (M <= 64, K), weight (N, K).

    ``scales=(x_scale, weight_scale)`` (0-d float32): FP8 operands, the product times both
    scales. ``gated``: the weight is ``[gate; up]`` (2N, K) and the result ``silu(gate) * up``
    (M, N), the gate and up values rounded to ``out_dtype`` first, as an unfused GEMM stores
    them. ``out_scale``: the result is quantized to float8_e4m3fn with that static scale.
    ``out_dtype`` (default x's dtype): the dtype of the unquantized result.
    """
    num_tokens, in_features = x.shape
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    if scales is not None and out_dtype is None:
        raise ValueError("FP8 operands (scales=...) need the out_dtype of the scaled product")
    out_dtype = out_dtype or x.dtype
    if num_tokens > MAX_KERNEL_TOKENS:
        raise ValueError(f"the GEMV takes at most {MAX_KERNEL_TOKENS} tokens, got {num_tokens}")
    if config is None:
        config = gemv_config(
            num_tokens,
            weight.shape[0],
            in_features,
            x.element_size(),
            max_shared_bytes(x.device),
            gated,
        )
    if num_tokens > config.block_m:
        raise ValueError(f"{num_tokens} tokens do not fit block_m={config.block_m}")
    pdl = programmatic_launch(x.device)
    grid = (triton.cdiv(out_features, config.block_n),)
    store_dtype = FP8_DTYPE if out_scale is not None else out_dtype
    out = torch.empty((num_tokens, out_features), dtype=store_dtype, device=x.device)
    x_scale, weight_scale = scales if scales is not None else (x, x)  # unread unless SCALED
    _gemv_kernel[grid](
        x,
        weight,
        out,
        x_scale,
        weight_scale,
        out_scale if out_scale is not None else x,
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
        SCALED=scales is not None,
        GATED=gated,
        ROUND_DTYPE=TRITON_DTYPES[out_dtype],
        QUANT_OUT=out_scale is not None,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def kernel_runs_on(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on the platform's device and the platform runs pieceworks' Triton
    kernels (CUDA, ROCm)."""
    platform = current_platform()
    return platform.runs_triton_kernels() and x.device.type == platform.device_type


def uses_kernel(
    x: torch.Tensor, weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
) -> bool:
    """Whether the small-M ops run the kernel for these operands (else their fallback)."""
    return (
        0 < x.shape[0] <= MAX_GEMV_TOKENS
        and x.dtype == weight.dtype
        and x.dtype in dtypes
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


def small_m_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_linear``, registered on first use (never at import).

    ``UnquantizedLinearMethod`` calls this when it is built: registering cannot be traced, so
    the op must exist before Dynamo meets the first linear layer.
    """
    return direct_register_custom_op(
        "small_m_linear", small_m_linear, mutates_args=[], fake_impl=small_m_linear_fake
    )


def small_m_silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight))`` for a merged [gate; up] weight (2N, K): (T, N).

    The GEMV with the activation as its epilogue when ``uses_kernel`` (one launch, and the
    (T, 2N) product never reaches memory), else ``F.linear`` and ``silu_and_mul_epilogue``.
    """
    if not uses_kernel(x, weight):
        return silu_and_mul_epilogue(F.linear(x, weight), None)
    return launch_gemv(x, weight, gated=True)


def small_m_silu_and_mul_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def small_m_silu_and_mul_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_silu_and_mul_linear``, registered on first use."""
    return direct_register_custom_op(
        "small_m_silu_and_mul_linear",
        small_m_silu_and_mul_linear,
        mutates_args=[],
        fake_impl=small_m_silu_and_mul_linear_fake,
    )
