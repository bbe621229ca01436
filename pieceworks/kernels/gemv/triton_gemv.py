"""A Triton GEMV for decode-sized linear layers: ``y = x W^T`` for 1 to 16 tokens (64 for small
weights).

Why: on an H200, decoding the Llama-3.1-8B shape at batch 1, cuBLAS runs ``qkv_proj``,
``o_proj`` and ``down_proj`` as split-K kernels, each followed by a ``splitKreduce`` kernel. A
decode GEMV only has to stream W once, so this kernel keeps many bytes of W in flight per SM and
needs no reduction afterwards (how it compares with cuBLAS: ``benchmarks/gemv_decode.py``,
``docs/performance.md``).

Layout contract: ``x`` is (M, K) and ``weight`` is (N, K), both contiguous along K (a linear
layer's row-major weight), same dtype (float16, bfloat16, float32, or float8_e4m3fn with a
per-tensor scale each); the result is (M, N), accumulated in float32. Each program owns
``BLOCK_N`` output columns for all M rows and walks K in ``BLOCK_K`` chunks, so loads of W are
coalesced along K and no two programs write the same output: no atomics, the result is
deterministic. The M rows are padded to 16 (masked) so the product runs on tensor cores; it is
computed as ``W x^T`` (W as the left operand), which leaves W in its natural K-major layout.
Three epilogues, applied after the K loop so they cost the pipelined loads nothing
(an epilogue before the ``tl.dot`` would stall the pipelined loads):
- gated: for a merged [gate; up] weight each program stacks the up rows of its columns under the
  gate rows (one ``tl.dot`` of a full tile; two half-height dots were 40% slower), splits the
  accumulator and stores ``act(gate) * up``, so the (M, 2N) product never reaches memory; the
  activation is a constexpr: ``silu`` (Llama's SwiGLU), or GELU, tanh or erf (Gemma's GeGLU),
  computed as the ``gelu_and_mul`` kernel computes it (``triton_gelu_and_mul.gelu``);
- rope: for a merged qkv weight each program owns ``block_n`` pairs (i, i + D/2) of one head and
  stacks the first-half rows on their partners (the gated tile); the halves, rounded to the
  output dtype as an unfused GEMM stores them, are rotated with the cos/sin cache at each token's
  position (neox style, every dim, float32 math rounded once) for the q and k heads and stored
  as they are for the v heads, in the natural column order (``triton_gemv_rope.py``);
- static FP8 quantization of the result (the next FP8 layer's input), as
  ``core.norm_quant.static_scaled_fp8_quant`` computes it (not combined with rope).
FP8 operands on Hopper: Triton's default lets the MMA add products in reduced precision over the
whole K loop (FP8 "fast accumulation", as CUTLASS's FP8FastAccum kernels do): errors up to 2e-3
on outputs near 1, below the bfloat16 rounding of the result. Folding every instruction's sum into
float32 (``max_num_imprecise_acc=32``) is much slower, so the kernel keeps the default.

``small_m_linear`` is the entry point and the op ``pieceworks::small_m_linear``: the kernel when
there are at most ``max_gemv_tokens(weight)`` tokens (16, or 64 for a weight of at most
``SMALL_WEIGHT_BYTES``) on a GPU Triton targets, else ``F.linear``. The
choice is made inside the op at run time, because the token count is symbolic when Dynamo
traces the op (inside a static graph it is fixed per capture size). Linear layers route
here where the kernel chooser picks the GEMV for the platform (``quantization/base.py``,
``kernels/chooser.py``; ``PIECEWORKS_SMALL_M_GEMV`` overrides), eager and compiled alike.
``pieceworks::small_m_silu_and_mul_linear`` and ``pieceworks::small_m_gelu_and_mul_linear`` are
the gated forms (the MLP's gate/up projection, SwiGLU and GeGLU),
``pieceworks::small_m_rope_linear`` (``triton_gemv_rope.py``) the rope form (the attention's qkv
projection), and ``small_m_fp8.py`` registers the FP8 forms of all three. Beside this
module: the jitted kernel (``triton_gemv_kernel.py``), the launch configurations
(``triton_gemv_config.py``), the gated epilogue as a kernel of
its own for the token counts the GEMV does not take (``triton_silu_and_mul.py``) and
programmatic dependent launch (``triton_launch.py``; the kernel reads its scales and rotary
factors, then waits before its K loop, and releases the next after it, or at its start where
``releases_at_start`` says so).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels import triton_device
from pieceworks.kernels.activation.triton_gelu_and_mul import gelu_and_mul_2d
from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_epilogue
from pieceworks.kernels.gemv import triton_gemv_config
from pieceworks.kernels.gemv.triton_gemv_config import (
    MAX_KERNEL_TOKENS,
    MIN_ROPE_BLOCK_N,
    GemvConfig,
    RopeEpilogue,
    gemv_config,
    launch_config,
    max_shared_bytes,
    rope_config,
)
from pieceworks.kernels.gemv.triton_gemv_kernel import GATED_ACTIVATIONS, _gemv_kernel
from pieceworks.kernels.triton_launch import launch, launch_options, programmatic_launch
from pieceworks.kernels.triton_rounding import TRITON_DTYPES

__all__ = [  # the configuration names are re-exported: callers and tests import them from here
    "MAX_GEMV_TOKENS",
    "MAX_KERNEL_TOKENS",
    "MIN_ROPE_BLOCK_N",
    "GemvConfig",
    "RopeEpilogue",
    "gemv_config",
    "launch_gemv",
    "max_gemv_tokens",
    "max_shared_bytes",
    "releases_at_start",
    "rope_config",
    "silu_and_mul_epilogue",
    "small_m_gelu_and_mul_linear",
    "small_m_linear",
    "small_m_silu_and_mul_linear",
    "uses_kernel",
]

MAX_GEMV_TOKENS = 16  # what small_m_linear routes to the kernel for any weight; above it, cuBLAS
SMALL_WEIGHT_BYTES = 12 * 2**20  # up to this size a weight takes the kernel to MAX_KERNEL_TOKENS
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GELU_ACTIVATIONS = {"tanh": "gelu_tanh", "none": "gelu"}  # F.gelu's approximate -> the epilogue's


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    gated: bool = False,
    activation: str = "silu",
    rope: RopeEpilogue | None = None,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight^T`` by the kernel, (M, N); x (M <= 64, K), weight (N, K).

    ``scales=(x_scale, weight_scale)`` (0-d float32): FP8 operands, the product times both
    scales. ``gated``: the weight is ``[gate; up]`` (2N, K) and the result ``act(gate) * up`` (M,
    N), the gate and up values rounded to ``out_dtype`` first, as an unfused GEMM stores them;
    ``activation`` names ``act``: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (erf). ``rope``: the
    weight is a merged qkv weight ((Hq + 2 Hkv) D, K) and the result (M, N) has its first
    ``rope.num_rotary_heads`` heads rotated (neox, every dim), from values rounded to ``out_dtype``
    first. ``out_scale``: the result is quantized to float8_e4m3fn with that static scale.
    ``out_dtype`` (default x's dtype): the dtype of the unquantized result.
    """
    num_tokens, in_features = x.shape
    stacked = gated or rope is not None  # 2 weight rows per column (ROPE: per pair)
    out_features = weight.shape[0] // 2 if stacked else weight.shape[0]
    if scales is not None and out_dtype is None:
        raise ValueError("FP8 operands (scales=...) need the out_dtype of the scaled product")
    if rope is not None and (gated or out_scale is not None):
        raise ValueError("the rotary epilogue takes neither gated=True nor out_scale")
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; supported: {GATED_ACTIVATIONS}")
    out_dtype = out_dtype or x.dtype
    config = launch_config(x, weight, config, stacked, rope)
    pdl = programmatic_launch(x.device)
    grid = (triton.cdiv(out_features, config.block_n),)
    store_dtype = KERNEL_FP8_DTYPE if out_scale is not None else out_dtype
    out_shape = (num_tokens, weight.shape[0] if rope is not None else out_features)
    out = torch.empty(out_shape, dtype=store_dtype, device=x.device)
    x_scale, weight_scale = scales if scales is not None else (x, x)  # unread unless SCALED
    positions, cos_sin = (rope.positions, rope.cos_sin_cache) if rope is not None else (x, x)
    launch(
        _gemv_kernel,
        grid,
        x,
        weight,
        out,
        x_scale,
        weight_scale,
        out_scale if out_scale is not None else x,
        positions,
        cos_sin,
        num_tokens,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        cos_sin.stride(0),
        rope.head_size if rope is not None else 0,
        rope.num_rotary_heads if rope is not None else 0,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        # float32 stays float32 (as F.linear by default), not TF32; 16-bit: the backend default
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        # Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits
        # (triton-lang/triton#11584): there the kernel widens them to float32 first, exactly
        UPCAST=triton_device.INTERPRETED and x.dtype == torch.bfloat16,
        SCALED=scales is not None,
        GATED=gated,
        ACTIVATION=activation,
        ROPE=rope is not None,
        ROUND_DTYPE=TRITON_DTYPES[out_dtype],
        QUANT_OUT=out_scale is not None,
        PDL=pdl,
        RELEASE_AT_START=pdl and releases_at_start(grid[0], rope is not None, x.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out


def releases_at_start(num_programs: int, rope: bool, device: torch.device) -> bool:
    """Whether a GEMV launched with PDL lets the next kernel be scheduled at its start instead of
    after its K loop. The rotary qkv GEMV does: decode attention's split kernel comes next and
    loads its K/V while the GEMV streams (``triton_attention.py``). So does a GEMV whose programs
    fit on the SMs at once with SMs to spare (the 8B ``down_proj``: 64 programs on an H200's 132),
    so that the next kernels' programs settle on the idle SMs while it streams: the norm, then
    the next layer's qkv GEMV, whose resident form copies its weights there
    (``resident_gemv.py``). A GEMV of several waves keeps the release after its K loop: programs
    scheduled early would take the SMs its later waves need."""
    num_sms = triton_gemv_config.num_sms(device)
    return rope or (num_sms is not None and num_programs < num_sms)


def max_gemv_tokens(weight: torch.Tensor) -> int:
    """The most tokens the small-M ops give the kernel for ``weight``: ``MAX_KERNEL_TOKENS`` (64)
    for a weight of at most ``SMALL_WEIGHT_BYTES``, else ``MAX_GEMV_TOKENS`` (16).

    Why the weight's size: padded to 32 or 64 tokens the GEMV reads each token's row of x once
    per program, so where the weight is large it is slower than cuBLAS's batch-64 kernels (the
    8B and 1B ``down_proj`` 2 and 2.5x, an 8B layer 42 % on an H200). Where the weight is small
    the product is short and what lies around it decides: the GEMV starts while the kernel before
    it ends (programmatic dependent launch, which cuBLAS takes no part in) and runs the gate/up
    activation and the rotary as its epilogues, one kernel instead of two. On an H100 that made
    a batch-64 decode step of llama-125m 12 % and of the SmolLM2-135M shape 20 % faster, although
    in isolation the GEMV at 64 tokens ran their ``down_proj`` up to 22 % slower than cuBLAS
    (``docs/performance.md``, ``benchmarks/gemv_decode.py --model``). The line lies above those
    models' largest projection (llama-125m's gate_up, 9 MiB) and below the smallest 8B one (the
    FP8 ``o_proj``, 16 MiB), so the 8B shapes keep cuBLAS above 16 tokens.
    """
    small = weight.numel() * weight.element_size() <= SMALL_WEIGHT_BYTES
    return MAX_KERNEL_TOKENS if small else MAX_GEMV_TOKENS


def uses_kernel(
    x: torch.Tensor, weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
) -> bool:
    """Whether the small-M ops run the kernel for these operands (else their fallback)."""
    return (
        0 < x.shape[0] <= max_gemv_tokens(weight)
        and x.dtype == weight.dtype
        and x.dtype in dtypes
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and triton_device.kernel_runs_on(x)
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


def small_m_gelu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, approximate: str
) -> torch.Tensor:
    """``gelu_and_mul(F.linear(x, weight), approximate)`` for a merged [gate; up] weight (2N, K):
    (T, N). ``approximate``: ``"tanh"`` or ``"none"`` (erf), as ``F.gelu``'s.

    The GEMV with the GELU as its epilogue when ``uses_kernel``, else ``F.linear`` and the
    ``gelu_and_mul`` kernel (the torch form where that does not run either).
    """
    if not uses_kernel(x, weight):
        return gelu_and_mul_2d(F.linear(x, weight), approximate)
    if approximate not in GELU_ACTIVATIONS:
        raise ValueError(f"gelu approximate={approximate!r}; supported: {tuple(GELU_ACTIVATIONS)}")
    return launch_gemv(x, weight, gated=True, activation=GELU_ACTIVATIONS[approximate])


def small_m_gelu_and_mul_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, approximate: str
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def small_m_gelu_and_mul_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_gelu_and_mul_linear``, registered on first use."""
    return direct_register_custom_op(
        "small_m_gelu_and_mul_linear",
        small_m_gelu_and_mul_linear,
        mutates_args=[],
        fake_impl=small_m_gelu_and_mul_linear_fake,
    )
