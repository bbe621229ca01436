"""The resident-weight FP8 GEMV: a decode GEMV that reads its whole weight slice before it waits.

Why: under programmatic dependent launch (PDL) a kernel is scheduled while the kernel before it
still runs and waits for it inside (``triton_launch.py``). The weights of a linear layer never
depend on the kernel before, only x does. ``o_proj`` comes right after decode attention, whose
split and reduce kernels are latency chains that leave HBM idle for several microseconds; the
Triton GEMV (``triton_gemv.py``) waits before its first load and streams all of W after the
attention ends. This kernel issues the copies of (most of) its W slice into shared memory before
the wait, so W streams during the attention, and after the wait only x, the MMAs and the few
chunks that did not fit remain.

Why Gluon: a Triton ``tl.load`` lands in registers and its software pipeline issues W and x
together, so a plain Triton GEMV cannot hold W in shared memory across the wait (session 10: two
chunks in registers cost 255 registers and spills; session 11: a wait inside the pipelined loop
moved only one chunk before it). Gluon (``triton.experimental.gluon``) gives the kernel its
shared memory, its asynchronous copies (``cp.async``) and Hopper's warpgroup MMA directly.

Layout: each program owns ``BLOCK_N`` = 64 rows of W (the MMA's M, the smallest a warpgroup
takes) and all of K, in ``BLOCK_K`` = 256-byte chunks. ``RESIDENT`` chunks have a shared memory
slot of their own and are copied before the wait; the remaining chunks reuse slots as the MMAs
free them. x (at most 16 tokens, padded to ``BLOCK_T`` = 8 or 16, the MMA's N) is copied whole
after the wait. acc = W x^T in float32 with Hopper's FP8 fast accumulation (as the Triton GEMV),
two accumulators alternating by chunk so consecutive MMAs do not wait for each other; the result
times both scales is stored in the output dtype. Deterministic: no atomics.

Only for FP8 operands on Hopper (compute capability 9.x: the warpgroup MMA), never interpreted,
where the slots hold at least ``MIN_RESIDENT_SHARE`` of the slice and the grid fits the SMs at
once (``uses_resident_gemv``); elsewhere the Triton GEMV.
"""

from __future__ import annotations

import torch
import triton

from pieceworks.core.norm_quant import FP8_DTYPE, FP8_MAX
from pieceworks.logger import init_logger
from pieceworks.models.layers import triton_gemv_config, triton_launch
from pieceworks.models.layers.triton_gemv import launch_gemv
from pieceworks.models.layers.triton_gemv_config import RopeEpilogue
from pieceworks.models.layers.triton_launch import launch_options, programmatic_launch
from pieceworks.models.layers.triton_rounding import TRITON_DTYPES

try:  # Gluon ships with Triton 3.4 and newer
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

logger = init_logger(__name__)

BLOCK_N = 64  # weight rows per program: the warpgroup MMA's M
BLOCK_K = 256  # bytes of K per chunk (one FP8 element per byte)
NUM_WARPS = 4  # one warpgroup
MAX_TOKENS = 16
MIN_RESIDENT_SHARE = 0.75  # of the slice's chunks copied before the wait, or the Triton GEMV
PLAIN, GATED, ROPE = 0, 1, 2  # the epilogues (the kernel's EPILOGUE)
SHARED_RESERVE = 1024  # bytes of shared memory left for the compiler's own use
_COMPILE_FAILURES: list[str] = []  # why the kernel did not run here; once set, never tried again


def newer_copy_groups(chunk: int, resident: int, num_chunks: int) -> int:
    """How many copy groups were committed after the ones chunk ``chunk`` needs, when the
    kernel's iteration for it waits (``cp.async.wait_group`` takes that count). Commit order: W
    chunks 0..resident-1, then x, then chunk c >= resident at iteration c - resident + 1 (into
    the slot chunk c - resident freed)."""
    streamed = max(0, min(chunk - 1, num_chunks - resident))  # in iterations 1..chunk-1
    if chunk < resident:  # needs x, committed after every resident chunk
        return streamed
    return max(0, streamed - (chunk - resident + 1))


if gluon is not None:
    # Triton 3.6 names these async_copy_global_to_shared and thread_barrier; later ones async_load
    # and barrier (the old names remain and raise)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    _newer_groups = gluon.constexpr_function(newer_copy_groups)
    _PLAIN, _GATED, _ROPE = gl.constexpr(PLAIN), gl.constexpr(GATED), gl.constexpr(ROPE)
    _FP8_MAX = gl.constexpr(FP8_MAX)

    @gluon.jit
    def _pdl_wait():
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _pdl_release():
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; mov.u32 $0, 0;",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _resident_gemv_kernel(
        x_ptr,
        weight_ptr,
        out_ptr,
        x_scale_ptr,
        weight_scale_ptr,
        out_scale_ptr,
        positions_ptr,
        cos_sin_ptr,
        num_tokens,
        out_features,
        stride_x,
        stride_weight,
        stride_out,
        stride_cos_sin,
        head_size,
        num_rotary_heads,
        K: gl.constexpr,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        RESIDENT: gl.constexpr,
        EPILOGUE: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # EPILOGUE: PLAIN stores W x^T. GATED and ROPE stack two weight rows per output column,
        # as the Triton GEMV does: the program's first BLOCK_N / 2 rows are the gate rows (ROPE:
        # the first halves of BLOCK_N / 2 pairs of one head), the others their up rows (the
        # partners, half a head further); "columns" count gate/up columns or pairs.
        if PDL and EPILOGUE == _ROPE:  # decode attention may be scheduled now: it loads its
            _pdl_release()  # K/V while this GEMV streams, and waits for it
        NUM_CHUNKS: gl.constexpr = K // BLOCK_K
        THREADS_K: gl.constexpr = BLOCK_K // 16  # 16-byte copies along K
        copy_layout: gl.constexpr = gl.BlockedLayout(
            [1, 16], [32 // THREADS_K, THREADS_K], [num_warps, 1], [1, 0]
        )
        slot_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=8, rank=2
        )
        w_slots = gl.allocate_shared_memory(
            gl.float8e4nv, [RESIDENT, BLOCK_N, BLOCK_K], slot_layout
        )
        x_chunks = gl.allocate_shared_memory(
            gl.float8e4nv, [NUM_CHUNKS, BLOCK_T, BLOCK_K], slot_layout
        )
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
        weight_rows, row_valid = _weight_rows(rows, out_features, head_size, BLOCK_N, EPILOGUE)
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
        w_ptrs = weight_ptr + weight_rows.to(gl.int64)[:, None] * stride_weight + ks[None, :]
        row_mask = row_valid[:, None]
        for chunk in gl.static_range(RESIDENT):  # W does not depend on the kernel before
            _async_load(w_slots.index(chunk), w_ptrs + chunk * BLOCK_K, mask=row_mask)
            async_copy.commit_group()
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, copy_layout))
        x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]  # (T, BLOCK_K)
        token_mask = (tokens < num_tokens)[:, None]  # pad tokens: zeros, never stored
        if PDL:
            _pdl_wait()  # x is the kernel before's output
        for chunk in gl.static_range(NUM_CHUNKS):
            _async_load(x_chunks.index(chunk), x_ptrs + chunk * BLOCK_K, mask=token_mask)
        async_copy.commit_group()
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_T, 32]
        )
        acc_even = gl.zeros((BLOCK_N, BLOCK_T), dtype=gl.float32, layout=mma_layout)
        acc_odd = gl.zeros((BLOCK_N, BLOCK_T), dtype=gl.float32, layout=mma_layout)
        for chunk in gl.static_range(NUM_CHUNKS):
            async_copy.wait_group(_newer_groups(chunk, RESIDENT, NUM_CHUNKS))
            _cta_barrier()  # every thread's copies of this chunk have landed
            fence_async_shared()  # and are visible to the MMA (the async proxy)
            w = w_slots.index(chunk % RESIDENT)
            x_t = x_chunks.index(chunk).permute((1, 0))  # (BLOCK_K, T), K-major
            if chunk % 2 == 0:
                acc_even = warpgroup_mma(w, x_t, acc_even, is_async=True)
            else:
                acc_odd = warpgroup_mma(w, x_t, acc_odd, is_async=True)
            acc_even, acc_odd = warpgroup_mma_wait(num_outstanding=1, deps=(acc_even, acc_odd))
            if chunk >= 1 and chunk - 1 + RESIDENT < NUM_CHUNKS:  # chunk - 1's MMA is done: its
                _cta_barrier()  # slot takes a chunk still in HBM (a constexpr condition)
                _async_load(
                    w_slots.index((chunk - 1) % RESIDENT),
                    w_ptrs + (chunk - 1 + RESIDENT) * BLOCK_K,
                    mask=row_mask,
                )
                async_copy.commit_group()
        acc_even, acc_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc_even, acc_odd))
        if PDL and EPILOGUE != _ROPE:
            _pdl_release()  # W is read: the next kernel may be scheduled
        scale = gl.load(x_scale_ptr) * gl.load(weight_scale_ptr)
        acc = (acc_even + acc_odd) * scale  # (BLOCK_N, T) = (W x^T) for this program's rows
        if EPILOGUE == _PLAIN:
            columns = gl.program_id(0) * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout)
            )
            out_tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma_layout))
            out_ptrs = out_ptr + out_tokens[None, :] * stride_out + columns[:, None]
            mask = (out_tokens < num_tokens)[None, :] & (columns < out_features)[:, None]
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            _stacked_epilogue(
                acc,
                out_ptr,
                out_scale_ptr,
                positions_ptr,
                cos_sin_ptr,
                num_tokens,
                out_features,
                stride_out,
                stride_cos_sin,
                head_size,
                num_rotary_heads,
                BLOCK_T,
                BLOCK_N,
                EPILOGUE,
                ROUND_DTYPE,
                num_warps,
            )

    @gluon.jit
    def _weight_rows(rows, out_features, head_size, BLOCK_N: gl.constexpr, EPILOGUE: gl.constexpr):
        """The weight row each tile row copies, and whether it exists."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        if EPILOGUE == _PLAIN:
            columns = gl.program_id(0) * BLOCK_N + rows
            weight_rows = columns
        elif EPILOGUE == _GATED:  # up rows are out_features further
            columns = gl.program_id(0) * HALF_N + rows % HALF_N
            weight_rows = columns + (rows // HALF_N) * out_features
        else:  # pair c of head h is row h * D + c % (D / 2); its partner D / 2 further
            columns = gl.program_id(0) * HALF_N + rows % HALF_N
            half = head_size // 2
            head = (gl.program_id(0) * HALF_N) // half
            weight_rows = columns + head * half + (rows // HALF_N) * half
        return weight_rows, columns < out_features

    @gluon.jit
    def _stacked_epilogue(
        acc,
        out_ptr,
        out_scale_ptr,
        positions_ptr,
        cos_sin_ptr,
        num_tokens,
        out_features,
        stride_out,
        stride_cos_sin,
        head_size,
        num_rotary_heads,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        EPILOGUE: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """GATED: ``silu(gate) * up`` quantized to e4m3 with ``out_scale``; ROPE: the pairs
        rotated (neox) at each token's position for the first ``num_rotary_heads`` heads. Both
        from the two halves rounded to ``ROUND_DTYPE`` first, as an unfused GEMM stores them, and
        computed as the Triton GEMV's epilogues compute them."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        scratch = gl.allocate_shared_memory(
            gl.float32, [BLOCK_N, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )
        scratch.store(acc)  # the halves are rows 0..HALF_N-1 and HALF_N..BLOCK_N-1
        _cta_barrier()
        layout: gl.constexpr = gl.BlockedLayout(
            [1, 1], [32 // BLOCK_T, BLOCK_T], [num_warps, 1], [1, 0]
        )
        first = scratch.slice(0, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        second = scratch.slice(HALF_N, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        pairs = gl.arange(0, HALF_N, layout=gl.SliceLayout(1, layout))  # (N / 2,) in the tile
        columns = gl.program_id(0) * HALF_N + pairs
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        token_mask = tokens < num_tokens
        mask = (columns < out_features)[:, None] & token_mask[None, :]
        out_rows = out_ptr + tokens[None, :] * stride_out  # (1, T)
        if EPILOGUE == _GATED:
            activated = first / (1.0 + gl.exp(-first)) * second
            quantized = activated / gl.load(out_scale_ptr)
            quantized = gl.minimum(gl.maximum(quantized, -_FP8_MAX), _FP8_MAX)
            gl.store(out_rows + columns[:, None], quantized.to(gl.float8e4nv), mask=mask)
        else:
            half = head_size // 2
            head = (gl.program_id(0) * HALF_N) // half
            pairs_in_head = columns - head * half
            if head < num_rotary_heads:
                positions = gl.load(positions_ptr + tokens, mask=token_mask, other=0)
                cos_ptrs = (
                    cos_sin_ptr
                    + positions.to(gl.int64)[None, :] * stride_cos_sin
                    + pairs_in_head[:, None]
                )
                cos = gl.load(cos_ptrs, mask=token_mask[None, :], other=0.0).to(gl.float32)
                sin = gl.load(cos_ptrs + half, mask=token_mask[None, :], other=0.0).to(gl.float32)
                rotated_first = first * cos - second * sin
                second = (second * cos + first * sin).to(ROUND_DTYPE).to(gl.float32)
                first = rotated_first.to(ROUND_DTYPE).to(gl.float32)
            out_columns = head * head_size + pairs_in_head  # the partner's: half further
            element = out_ptr.dtype.element_ty
            gl.store(out_rows + out_columns[:, None], first.to(element), mask=mask)
            gl.store(out_rows + out_columns[:, None] + half, second.to(element), mask=mask)


def resident_chunks(num_tokens: int, in_features: int, shared_bytes: int, stacked: bool) -> int:
    """How many of a program's W chunks get a shared memory slot of their own, beside x's
    (``BLOCK_T`` x ``in_features`` bytes) and, for a stacked epilogue, its float32 scratch."""
    block_tokens = _block_tokens(num_tokens)
    used = SHARED_RESERVE + block_tokens * in_features + stacked * BLOCK_N * block_tokens * 4
    return max(0, (shared_bytes - used) // (BLOCK_N * BLOCK_K))


def fp8_decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    *,
    gated: bool = False,
    out_scale: torch.Tensor | None = None,
    rope: RopeEpilogue | None = None,
) -> torch.Tensor:
    """The FP8 GEMV of a decode-sized product, with ``launch_gemv``'s epilogues (``gated`` with
    ``out_scale``; ``rope``): the resident one where ``uses_resident_gemv``, else the Triton GEMV.
    If the Gluon kernel fails to compile (Gluon's API changes between Triton releases; checked
    with 3.6 and 3.9), a warning says so once and the Triton GEMV takes every later product."""
    epilogue = dict(gated=gated, out_scale=out_scale, rope=rope)
    if uses_resident_gemv(x, weight, gated or rope is not None, rope):
        try:
            return launch_resident_gemv(x, weight, scales, out_dtype, **epilogue)
        except Exception as error:  # noqa: BLE001 - reported, then the Triton GEMV runs
            _COMPILE_FAILURES.append(f"{type(error).__name__}: {error}"[:500])
            logger.warning(
                "the resident-weight FP8 GEMV does not run with Triton %s (%s); FP8 decode uses "
                "the Triton GEMV instead, a few percent slower per step on an H200. Please "
                "report it.",
                triton.__version__,
                _COMPILE_FAILURES[-1],
            )
    return launch_gemv(x, weight, scales=scales, out_dtype=out_dtype, **epilogue)


def uses_resident_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    stacked: bool = False,
    rope: RopeEpilogue | None = None,
) -> bool:
    """Whether ``launch_resident_gemv`` takes these operands (``stacked``: the gated or rotary
    epilogue), else the Triton GEMV."""
    num_tokens, in_features = x.shape
    if gluon is None or _COMPILE_FAILURES or triton_launch.INTERPRETED:
        return False
    if not triton_launch.kernel_runs_on(x):
        return False
    if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE or not 0 < num_tokens <= MAX_TOKENS:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if in_features % BLOCK_K or in_features < 2 * BLOCK_K:
        return False
    if rope is not None and (rope.head_size // 2) % (BLOCK_N // 2):
        return False  # a program's pairs must lie in one head
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False  # the warpgroup MMA is Hopper's
    num_chunks = in_features // BLOCK_K
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    resident = resident_chunks(num_tokens, in_features, shared, stacked)
    return resident >= max(2, MIN_RESIDENT_SHARE * num_chunks)


def launch_resident_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    *,
    gated: bool = False,
    out_scale: torch.Tensor | None = None,
    rope: RopeEpilogue | None = None,
) -> torch.Tensor:
    """``(x * x_scale) @ (weight * weight_scale)^T``, (M, N) in ``out_dtype``, FP8 x (M, K) and
    weight (N, K), where ``uses_resident_gemv``; ``gated`` (with ``out_scale``) and ``rope`` as
    ``launch_gemv`` takes them: ``silu(gate) * up`` quantized to e4m3, (M, N / 2); the first
    ``rope.num_rotary_heads`` heads rotated, (M, N)."""
    num_tokens, in_features = x.shape
    if gated and out_scale is None:
        raise ValueError("the resident GEMV's gated epilogue quantizes: pass out_scale")
    if not gated and out_scale is not None:
        raise ValueError("the resident GEMV quantizes only the gated epilogue's output")
    epilogue = GATED if gated else ROPE if rope is not None else PLAIN
    stacked = epilogue != PLAIN
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    resident = resident_chunks(num_tokens, in_features, shared, stacked)
    resident = min(in_features // BLOCK_K, resident)
    if resident < 2:  # a streamed chunk takes the slot the previous MMA read (newer_copy_groups)
        raise ValueError(f"the resident GEMV needs two chunk slots, has {resident}: {x.shape}")
    out_features = weight.shape[0] // 2 if stacked else weight.shape[0]  # columns (pairs)
    if gated:
        out = torch.empty((num_tokens, out_features), dtype=FP8_DTYPE, device=x.device)
    else:
        out = torch.empty((num_tokens, weight.shape[0]), dtype=out_dtype, device=x.device)
    block_columns = BLOCK_N // 2 if stacked else BLOCK_N
    positions, cos_sin = (rope.positions, rope.cos_sin_cache) if rope is not None else (x, x)
    pdl = programmatic_launch(x.device)
    _resident_gemv_kernel[(triton.cdiv(out_features, block_columns),)](
        x,
        weight,
        out,
        scales[0],
        scales[1],
        out_scale if out_scale is not None else x,
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
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        RESIDENT=resident,
        EPILOGUE=epilogue,
        ROUND_DTYPE=TRITON_DTYPES[out_dtype],
        PDL=pdl,
        num_warps=NUM_WARPS,
        **launch_options(pdl),
    )
    return out


def _block_tokens(num_tokens: int) -> int:
    return 8 if num_tokens <= 8 else 16
