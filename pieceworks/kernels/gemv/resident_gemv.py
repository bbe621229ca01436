"""The resident-weight FP8 GEMV: a decode GEMV that reads most of its weight slice before it waits.

Why: under programmatic dependent launch (PDL) a kernel is scheduled while the kernel before it
still runs and waits for it inside (``triton_launch.py``). The weights of a linear layer never
depend on the kernel before, only x does. The Triton GEMV (``triton_gemv.py``) waits before its
first load and streams all of W after x's producer ends. This kernel issues the copies of (most
of) its W slice into shared memory before the wait, so W streams while the kernels before it
run, and after the wait only x, the MMAs and the chunks that did not fit remain. That pays where
HBM would otherwise idle, or where SMs would:
- ``o_proj`` comes right after decode attention, whose split and reduce kernels are latency
  chains that leave HBM idle for several microseconds;
- ``qkv_proj`` (the rotary form) is scheduled while the previous layer's ``down_proj`` still
  streams on 64 of an H200's 132 SMs (``down_proj`` releases the next kernels at its start:
  ``triton_gemv.releases_at_start``), so its programs copy their weights on the idle SMs.

Why Gluon: a Triton ``tl.load`` lands in registers and its software pipeline issues W and x
together, so a plain Triton GEMV cannot hold W in shared memory across the wait (chunks held in
registers spill; a wait inside the pipelined loop moves only one chunk before it). Gluon
(``triton.experimental.gluon``) gives the kernel its shared memory, its asynchronous copies
(``cp.async``) and Hopper's warpgroup MMA directly.

Layout: each program owns ``BLOCK_N`` = 64 rows of W (the MMA's M, the smallest a warpgroup takes)
and all of K, in ``BLOCK_K`` = 256-byte chunks. ``RESIDENT`` chunks have a shared memory slot of
their own and are copied before the wait; the remaining chunks reuse slots as the MMAs free them. x
(at most 16 tokens, padded to ``BLOCK_T`` = 8 or 16, the MMA's N) is copied whole after the wait.
acc = W x^T in float32 with Hopper's FP8 fast accumulation (as the Triton GEMV), two accumulators
alternating by chunk so consecutive MMAs do not wait for each other; the result times both scales
is stored in the output dtype; the scales, and for the rotary form the cos and sin at the tokens'
positions, are read before the wait too. Deterministic: no atomics. The rotary form stacks each
head's first-half rows on their partners as the Triton GEMV does and rotates the pairs in its
epilogue; it copies at most ``ROPE_RESIDENT_CHUNKS`` chunks before the wait, which leaves shared
memory on its SMs for decode attention's split programs. The kernel lets the next kernel be
scheduled at its start.

Only for FP8 operands on Hopper (compute capability 9.x: the warpgroup MMA), never interpreted,
with 16-byte-aligned rows, where the slots hold at least ``MIN_RESIDENT_SHARE`` of the slice and
the grid fits the SMs at once (``uses_resident_gemv``); elsewhere, and on a Triton whose Gluon does
not compile it, the Triton GEMV (``fp8_decode_gemv``). Behind a short producer alone it gains
nothing, so ``gate_up_proj`` stays on the Triton GEMV (what it measured: ``docs/performance.md``).
The Gluon kernel is in ``resident_gemv_kernel.py``; this module decides where it runs and
launches it.
"""

from __future__ import annotations

import torch
import triton

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels import triton_device
from pieceworks.kernels.gemv import resident_gemv_kernel, triton_gemv_config
from pieceworks.kernels.gemv.triton_gemv import launch_gemv
from pieceworks.kernels.gemv.triton_gemv_config import RopeEpilogue
from pieceworks.kernels.triton_launch import launch, launch_options, programmatic_launch
from pieceworks.kernels.triton_rounding import TRITON_DTYPES
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import WARPGROUP_MMA

logger = init_logger(__name__)

BLOCK_N = 64  # weight rows per program: the warpgroup MMA's M
BLOCK_K = 256  # bytes of K per chunk (one FP8 element per byte)
NUM_WARPS = 4  # one warpgroup
MAX_TOKENS = 16
MIN_RESIDENT_SHARE = 0.75  # of the slice's chunks copied before the wait, or the Triton GEMV
# the rotary form (qkv_proj) copies at most this many chunks before its wait (the fastest of 4 to
# 12 on an H200, FP8 8B batch 1)
ROPE_RESIDENT_CHUNKS = 8
SHARED_RESERVE = 1024  # bytes of shared memory left for the compiler's own use
# the kernel variants (``_variant``) that did not run here, and why; never tried again
_COMPILE_FAILURES: dict[tuple[int, int, bool, torch.dtype], str] = {}


def resident_chunks(
    num_tokens: int, in_features: int, shared_bytes: int, rope: bool = False
) -> int:
    """How many of a program's W chunks get a shared memory slot of their own, beside x's
    (``_x_rows`` x ``BLOCK_K`` bytes) and, for the rotary epilogue, its float32 scratch."""
    x_bytes = _x_rows(num_tokens, in_features) * BLOCK_K
    scratch_bytes = rope * BLOCK_N * _block_tokens(num_tokens) * 4
    used = SHARED_RESERVE + x_bytes + scratch_bytes
    return max(0, (shared_bytes - used) // (BLOCK_N * BLOCK_K))


def fp8_decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    rope: RopeEpilogue | None = None,
) -> torch.Tensor:
    """The FP8 GEMV of a decode-sized product (``rope``: with ``launch_gemv``'s rotary
    epilogue): the resident one where ``uses_resident_gemv``, else the Triton GEMV
    (``launch_gemv``). If the Gluon kernel fails to compile (Gluon's API changes between Triton
    releases; checked with 3.6 and 3.9), a warning says so once for that variant of the kernel
    (``_variant``), and the Triton GEMV takes its later products; other variants still run."""
    variant = _variant(x, rope, out_dtype)
    if variant not in _COMPILE_FAILURES and uses_resident_gemv(x, weight, rope):
        try:
            return launch_resident_gemv(x, weight, scales, out_dtype, rope)
        except Exception as error:  # noqa: BLE001 - reported, then the Triton GEMV runs
            _COMPILE_FAILURES[variant] = f"{type(error).__name__}: {error}"[:500]
            logger.warning(
                "the resident-weight FP8 GEMV does not run with Triton %s for K = %d, %d padded "
                "tokens, %s epilogue, %s output (%s); these products use the Triton GEMV "
                "instead (on an H200 the resident one makes FP8 decode a few percent faster). "
                "Please report it.",
                triton.__version__,
                *variant[:2],
                "rotary" if rope is not None else "plain",
                out_dtype,
                _COMPILE_FAILURES[variant],
            )
    return launch_gemv(x, weight, scales=scales, out_dtype=out_dtype, rope=rope)


def _variant(
    x: torch.Tensor, rope: RopeEpilogue | None, out_dtype: torch.dtype
) -> tuple[int, int, bool, torch.dtype]:
    """What a launch compiles the kernel for, besides the GPU: K, the padded token count, the
    epilogue and the output dtype (the chunk counts follow from them)."""
    num_tokens, in_features = x.shape
    return in_features, _block_tokens(num_tokens), rope is not None, out_dtype


def copies_align(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every 16-byte copy of a row of x and W starts 16-byte aligned (rows contiguous,
    base pointers and row strides multiples of 16 bytes): the kernel's copies need it, and with
    Triton 3.6 a launch without it does not compile."""
    return all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in (x, weight)
    )


def uses_resident_gemv(
    x: torch.Tensor, weight: torch.Tensor, rope: RopeEpilogue | None = None
) -> bool:
    """Whether ``launch_resident_gemv`` takes these operands (else the Triton GEMV)."""
    num_tokens, in_features = x.shape
    if resident_gemv_kernel.gluon is None or not triton_device.compiled_kernels_run_on(x.device):
        return False
    if (
        x.dtype != KERNEL_FP8_DTYPE
        or weight.dtype != KERNEL_FP8_DTYPE
        or not 0 < num_tokens <= MAX_TOKENS
    ):
        return False
    if not copies_align(x, weight):
        return False
    if in_features % BLOCK_K or in_features < 2 * BLOCK_K:
        return False
    if rope is not None and (rope.head_size // 2) % (BLOCK_N // 2):
        return False  # a program's pairs must lie in one head
    if not current_platform().device_capability().has(WARPGROUP_MMA):
        return False  # the kernel is written for Hopper's MMA
    num_chunks = in_features // BLOCK_K
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    resident = resident_chunks(num_tokens, in_features, shared, rope is not None)
    fits = resident >= MIN_RESIDENT_SHARE * num_chunks
    num_sms = triton_gemv_config.num_sms(x.device) or 0
    return fits and triton.cdiv(weight.shape[0], BLOCK_N) <= num_sms  # one wave


def launch_resident_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    rope: RopeEpilogue | None = None,
) -> torch.Tensor:
    """``(x * x_scale) @ (weight * weight_scale)^T`` in ``out_dtype``, (M, N); FP8 x (M, K) and
    weight (N, K), where ``uses_resident_gemv``. ``rope``: the weight is a merged qkv weight and
    its first ``rope.num_rotary_heads`` heads are rotated, as ``launch_gemv`` does."""
    num_tokens, in_features = x.shape
    num_chunks = in_features // BLOCK_K
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    resident = min(num_chunks, resident_chunks(num_tokens, in_features, shared, rope is not None))
    if rope is not None:  # room beside it for decode attention's split programs
        resident = min(resident, ROPE_RESIDENT_CHUNKS)
    if resident < 2:  # a streamed chunk takes the slot the previous MMA read (newer_copy_groups)
        raise ValueError(f"the resident GEMV needs two chunk slots, has {resident}: {x.shape}")
    out = torch.empty((num_tokens, weight.shape[0]), dtype=out_dtype, device=x.device)
    out_features = weight.shape[0] // 2 if rope is not None else weight.shape[0]  # ROPE: pairs
    block_columns = BLOCK_N // 2 if rope is not None else BLOCK_N
    positions, cos_sin = (rope.positions, rope.cos_sin_cache) if rope is not None else (x, x)
    pdl = programmatic_launch(x.device)
    launch(
        resident_gemv_kernel._resident_gemv_kernel,
        (triton.cdiv(out_features, block_columns),),
        x,
        weight,
        out,
        scales[0],
        scales[1],
        positions,
        cos_sin,
        num_tokens,
        out_features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        cos_sin.stride(0),
        rope.head_size if rope is not None else 0,
        rope.num_rotary_heads if rope is not None else 0,
        K=in_features,
        BLOCK_T=_block_tokens(num_tokens),
        X_ROWS=_x_rows(num_tokens, in_features),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        RESIDENT=resident,
        ROPE=rope is not None,
        ROUND_DTYPE=TRITON_DTYPES[out_dtype],
        PDL=pdl,
        num_warps=NUM_WARPS,
        **launch_options(pdl),
    )
    return out


def _block_tokens(num_tokens: int) -> int:
    return 8 if num_tokens <= 8 else 16


def _x_rows(num_tokens: int, in_features: int) -> int:
    """Rows of x's shared buffer: a row per (chunk, padded token), rounded up to a power of two
    (K = 768, three chunks, does not compile unrounded)."""
    return triton.next_power_of_2(in_features // BLOCK_K * _block_tokens(num_tokens))
