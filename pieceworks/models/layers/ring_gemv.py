"""The persistent ring FP8 GEMV: one program per SM streams its tiles through a shared-memory ring.

Why: the Triton GEMV (``triton_gemv.py``) runs one program per 64-row tile and keeps about 96 KB
of each program's W in flight. gate_up_proj (448 tiles) then runs in three and a half waves whose
programs each start with an empty pipeline, and down_proj (64 tiles, K = 14336) keeps 64 SMs
busy at about 56 GB/s each; both read their weights at 3.6 to 3.9 TB/s on an H200. Here a program
owns a ring of ``SLOTS`` shared-memory slots and walks its tiles (``pid``, ``pid + grid``, ...)
chunk by chunk: the copy of step ``s + SLOTS - 1`` is issued as the MMA of step ``s`` retires, so
``SLOTS - 1`` chunks (about 190 KB) stay in flight across tile boundaries, and the first ``SLOTS``
steps' W is copied before the programmatic-dependent-launch wait (W never depends on the kernel
before; only x does).

Layout: a tile is ``BLOCK_N`` = 64 weight rows (the warpgroup MMA's M); a step is one
``BLOCK_K`` = 256-byte chunk of K of one tile, and its slot holds the W chunk (64 x 256) and the
x chunk (``BLOCK_T`` x 256, tokens padded to 8 or 16, the MMA's N). acc = W x^T in float32 with
Hopper's FP8 fast accumulation, two accumulators alternating by chunk. Epilogues: PLAIN stores
the product times both scales in the output dtype; GATED stacks 32 gate rows and their 32 up
rows in a tile, as the Triton GEMV does, and stores ``silu(gate) * up`` quantized to e4m3.

Copy groups (``cp.async.commit_group``): W of steps 0..SLOTS-1 before the wait, one group each;
x of those steps is loaded after the wait with plain loads and stored into the slots; then each
step s >= 1 commits one group holding W and x of step s - 1 + SLOTS (masked off past the
program's last step: an empty group keeps the count), so every step waits with the same count
(``ring_wait_groups``; ``tests/models/test_ring_gemv.py`` checks it against a simulation of the
commit order). A tile's chunks are unrolled, its tiles are a loop.

Only on Hopper with FP8 operands (``uses_ring_gemv``); elsewhere the Triton GEMV.
"""

from __future__ import annotations

import torch
import triton

from pieceworks.core.norm_quant import FP8_DTYPE, FP8_MAX
from pieceworks.logger import init_logger
from pieceworks.models.layers import triton_gemv_config, triton_launch
from pieceworks.models.layers.resident_gemv import copies_align
from pieceworks.models.layers.triton_gemv import launch_gemv
from pieceworks.models.layers.triton_launch import launch_options, programmatic_launch
from pieceworks.models.layers.triton_rounding import TRITON_DTYPES
from pieceworks.platforms import current_platform

try:  # Gluon is experimental; checked with Triton 3.6 and 3.9
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

BLOCK_N = 64  # weight rows per tile: the warpgroup MMA's M
BLOCK_K = 256  # bytes of K per step (one FP8 element per byte)
NUM_WARPS = 4  # one warpgroup
MAX_TOKENS = 16
MAX_SLOTS = 12
SHARED_RESERVE = 1024  # bytes of shared memory left for the compiler's own use
MAX_UNROLLED_CHUNKS = 32  # a tile's chunks are unrolled (K <= 8192)
PLAIN, GATED = 0, 1  # the epilogues (the kernel's EPILOGUE)
_COMPILE_FAILURES: list[str] = []  # why the kernel did not run here; once set, never tried again

logger = init_logger(__name__)


def ring_wait_groups(slots: int) -> int:
    """How many copy groups newer than the one a step needs may still be in flight when it waits
    (``cp.async.wait_group``'s count). Commits: W of steps 0..slots-1, then at each step s >= 1
    one group with W and x of step s - 1 + slots, so the group of step s has slots - 2 newer ones
    (step 0 waits for one group more than it needs: W of step 1 too)."""
    return slots - 2


def ring_slots(num_tokens: int, shared_bytes: int, gated: bool, num_chunks: int) -> int:
    """Ring slots that fit ``shared_bytes`` beside the gated epilogue's float32 scratch, at most
    ``MAX_SLOTS`` and the chunks of one tile."""
    block_tokens = _block_tokens(num_tokens)
    used = SHARED_RESERVE + gated * BLOCK_N * block_tokens * 4
    slot = (BLOCK_N + block_tokens) * BLOCK_K
    return max(0, min(MAX_SLOTS, num_chunks, (shared_bytes - used) // slot))


if gluon is not None:
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _PLAIN, _GATED = gl.constexpr(PLAIN), gl.constexpr(GATED)
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
    def _copy_step(
        w_slots,
        x_slots,
        weight_ptr,
        x_ptr,
        step,
        total_steps,
        out_features,
        stride_weight,
        stride_x,
        num_tokens,
        copy_layout: gl.constexpr,
        NUM_CHUNKS: gl.constexpr,
        SLOTS: gl.constexpr,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        EPILOGUE: gl.constexpr,
        COPY_W: gl.constexpr,
        COPY_X: gl.constexpr,
    ):
        """Issue the copies of ``step``'s W and/or x chunk into its slot (masked off past the
        program's last step)."""
        tile = gl.program_id(0) + (step // NUM_CHUNKS) * gl.num_programs(0)
        k0 = (step % NUM_CHUNKS) * BLOCK_K
        slot = step % SLOTS
        exists = step < total_steps
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
        if COPY_W:
            rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
            weight_rows, row_valid = _weight_rows(tile, rows, out_features, BLOCK_N, EPILOGUE)
            w_ptrs = (
                weight_ptr + weight_rows.to(gl.int64)[:, None] * stride_weight + k0 + ks[None, :]
            )
            _async_load(w_slots.index(slot), w_ptrs, mask=(row_valid & exists)[:, None])
        if COPY_X:
            tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, copy_layout))
            x_ptrs = x_ptr + tokens[:, None] * stride_x + k0 + ks[None, :]
            x_mask = ((tokens < num_tokens) & exists)[:, None]  # pad tokens: zeros, never stored
            _async_load(x_slots.index(slot), x_ptrs, mask=x_mask)

    @gluon.jit
    def _weight_rows(tile, rows, out_features, BLOCK_N: gl.constexpr, EPILOGUE: gl.constexpr):
        """The weight row each of a tile's rows reads, and whether its output column exists."""
        if EPILOGUE == _PLAIN:
            columns = tile * BLOCK_N + rows
            weight_rows = columns
        else:  # GATED: 32 gate rows, then their up rows (out_features further)
            HALF_N: gl.constexpr = BLOCK_N // 2
            columns = tile * HALF_N + rows % HALF_N
            weight_rows = columns + (rows // HALF_N) * out_features
        return weight_rows, columns < out_features

    @gluon.jit
    def _ring_gemv_kernel(
        x_ptr,
        weight_ptr,
        out_ptr,
        x_scale_ptr,
        weight_scale_ptr,
        out_scale_ptr,
        num_tokens,
        out_features,
        num_tiles,
        stride_x,
        stride_weight,
        stride_out,
        K: gl.constexpr,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        SLOTS: gl.constexpr,
        EPILOGUE: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        if PDL:  # every program is resident (grid <= SMs): the next kernel may be scheduled;
            _pdl_release()  # it waits for this one to finish before reading anything
        NUM_CHUNKS: gl.constexpr = K // BLOCK_K
        THREADS_K: gl.constexpr = BLOCK_K // 16  # 16-byte copies along K
        copy_layout: gl.constexpr = gl.BlockedLayout(
            [1, 16], [32 // THREADS_K, THREADS_K], [num_warps, 1], [1, 0]
        )
        slot_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=8, rank=2
        )
        w_slots = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BLOCK_N, BLOCK_K], slot_layout)
        x_slots = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BLOCK_T, BLOCK_K], slot_layout)
        scratch = gl.allocate_shared_memory(  # the gated epilogue's gate and up halves
            gl.float32,
            [BLOCK_N if EPILOGUE == _GATED else 1, BLOCK_T],
            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
        )
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        my_tiles = (num_tiles - pid + grid - 1) // grid
        total_steps = my_tiles * NUM_CHUNKS
        for early in gl.static_range(SLOTS):  # W does not depend on the kernel before
            _copy_step(w_slots, x_slots, weight_ptr, x_ptr, early, total_steps, out_features,
                       stride_weight, stride_x, num_tokens, copy_layout, NUM_CHUNKS, SLOTS,
                       BLOCK_T, BLOCK_N, BLOCK_K, EPILOGUE, True, False)  # fmt: skip
            async_copy.commit_group()
        if PDL:
            _pdl_wait()  # x is the kernel before's output
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, copy_layout))
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
        x_mask = (tokens < num_tokens)[:, None]  # pad tokens: zeros, never stored
        for early in gl.static_range(SLOTS):  # x of the first steps: plain loads, no copy group
            x_ptrs = (
                x_ptr + tokens[:, None] * stride_x + (early % NUM_CHUNKS) * BLOCK_K + ks[None, :]
            )
            x_slots.index(early).store(gl.load(x_ptrs, mask=x_mask, other=0.0))
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_T, 32]
        )
        scale = gl.load(x_scale_ptr) * gl.load(weight_scale_ptr)
        for tile_step in range(my_tiles):
            acc_even = gl.zeros((BLOCK_N, BLOCK_T), dtype=gl.float32, layout=mma_layout)
            acc_odd = gl.zeros((BLOCK_N, BLOCK_T), dtype=gl.float32, layout=mma_layout)
            for chunk in gl.static_range(NUM_CHUNKS):  # unrolled: a tile's chunks
                step = tile_step * NUM_CHUNKS + chunk
                async_copy.wait_group(SLOTS - 2)  # ring_wait_groups
                _cta_barrier()  # every thread's copies of this step have landed
                fence_async_shared()  # and are visible to the MMA (the async proxy)
                w = w_slots.index(step % SLOTS)
                x_t = x_slots.index(step % SLOTS).permute((1, 0))  # (BLOCK_K, T), K-major
                if chunk % 2 == 0:
                    acc_even = warpgroup_mma(w, x_t, acc_even, is_async=True)
                else:
                    acc_odd = warpgroup_mma(w, x_t, acc_odd, is_async=True)
                acc_even, acc_odd = warpgroup_mma_wait(num_outstanding=1, deps=(acc_even, acc_odd))
                if chunk >= 1 or tile_step >= 1:  # step - 1's MMA is done: its slot takes
                    _cta_barrier()  # step - 1 + SLOTS
                    _copy_step(w_slots, x_slots, weight_ptr, x_ptr, step - 1 + SLOTS,
                               total_steps, out_features, stride_weight, stride_x, num_tokens,
                               copy_layout, NUM_CHUNKS, SLOTS, BLOCK_T, BLOCK_N, BLOCK_K,
                               EPILOGUE, True, True)  # fmt: skip
                    async_copy.commit_group()
            acc_even, acc_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc_even, acc_odd))
            acc = (acc_even + acc_odd) * scale  # (BLOCK_N, T) = W x^T for this tile's rows
            tile = pid + tile_step * grid
            if EPILOGUE == _PLAIN:
                columns = tile * BLOCK_N + gl.arange(
                    0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout)
                )
                out_tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma_layout))
                out_ptrs = out_ptr + out_tokens[None, :] * stride_out + columns[:, None]
                mask = (out_tokens < num_tokens)[None, :] & (columns < out_features)[:, None]
                gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                _gated_epilogue(acc, scratch, tile, out_ptr, out_scale_ptr, num_tokens,
                                out_features, stride_out, BLOCK_T, BLOCK_N, ROUND_DTYPE,
                                num_warps)  # fmt: skip
        async_copy.wait_group(0)  # the masked copies past the last step

    @gluon.jit
    def _gated_epilogue(
        acc,
        scratch,
        tile,
        out_ptr,
        out_scale_ptr,
        num_tokens,
        out_features,
        stride_out,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """``silu(gate) * up`` quantized to e4m3 with ``out_scale``, from the gate and up halves
        rounded to ``ROUND_DTYPE`` first (as an unfused GEMM stores them), computed as the
        Triton GEMV's gated epilogue computes it."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        scratch.store(acc)  # gate rows 0..HALF_N-1, up rows HALF_N..BLOCK_N-1
        _cta_barrier()
        layout: gl.constexpr = gl.BlockedLayout(
            [1, 1], [32 // BLOCK_T, BLOCK_T], [num_warps, 1], [1, 0]
        )
        gate = scratch.slice(0, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        up = scratch.slice(HALF_N, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        columns = tile * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, layout))
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        mask = (columns < out_features)[:, None] & (tokens < num_tokens)[None, :]
        activated = gate / (1.0 + gl.exp(-gate)) * up
        quantized = activated / gl.load(out_scale_ptr)
        quantized = gl.minimum(gl.maximum(quantized, -_FP8_MAX), _FP8_MAX)
        out_ptrs = out_ptr + tokens[None, :] * stride_out + columns[:, None]
        gl.store(out_ptrs, quantized.to(gl.float8e4nv), mask=mask)
        _cta_barrier()  # the scratch is read before the next tile stores into it


def launch_ring_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    *,
    out_scale: torch.Tensor | None = None,
    gated: bool = False,
    num_programs: int | None = None,
) -> torch.Tensor:
    """``(x * x_scale) @ (weight * weight_scale)^T``, (M, N) in ``out_dtype``, for FP8 x (M, K)
    and weight (N, K); ``gated`` (with ``out_scale``): the weight is ``[gate; up]`` (2N, K) and
    the result ``silu(gate) * up`` quantized to e4m3, (M, N). ``num_programs`` (default: one per
    SM, at most one per tile) sets the grid."""
    num_tokens, in_features = x.shape
    if gated != (out_scale is not None):
        raise ValueError(
            "the ring GEMV quantizes the gated epilogue's output: pass gated with out_scale"
        )
    num_chunks = in_features // BLOCK_K
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    slots = ring_slots(num_tokens, shared, gated, num_chunks)
    if slots < 2 or in_features % BLOCK_K or num_tokens > MAX_TOKENS:
        raise ValueError(
            f"the ring GEMV takes at most {MAX_TOKENS} tokens, K a multiple of {BLOCK_K} and two "
            f"slots of shared memory; got x {tuple(x.shape)}, {slots} slots"
        )
    out_features = weight.shape[0] // 2 if gated else weight.shape[0]
    store_dtype = FP8_DTYPE if gated else out_dtype
    out = torch.empty((num_tokens, out_features), dtype=store_dtype, device=x.device)
    num_tiles = triton.cdiv(out_features, BLOCK_N // 2 if gated else BLOCK_N)
    grid = min(num_tiles, num_programs or triton_gemv_config.num_sms(x.device) or 1)
    pdl = programmatic_launch(x.device)
    _ring_gemv_kernel[(grid,)](
        x,
        weight,
        out,
        scales[0],
        scales[1],
        out_scale if out_scale is not None else scales[0],
        num_tokens,
        out_features,
        num_tiles,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K=in_features,
        BLOCK_T=_block_tokens(num_tokens),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        SLOTS=slots,
        EPILOGUE=GATED if gated else PLAIN,
        ROUND_DTYPE=TRITON_DTYPES[out_dtype],
        PDL=pdl,
        num_warps=NUM_WARPS,
        **launch_options(pdl),
    )
    return out


def _block_tokens(num_tokens: int) -> int:
    return 8 if num_tokens <= 8 else 16


def uses_ring_gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> bool:
    """Whether ``launch_ring_gemv`` takes these operands (else the Triton GEMV): FP8 on Hopper,
    1 to 16 tokens, 16-byte-aligned rows, K a multiple of 256 up to 8192, and more tiles than
    SMs (where every tile has an SM of its own, the Triton GEMV measured faster: down_proj)."""
    num_tokens, in_features = x.shape
    if gluon is None or _COMPILE_FAILURES or triton_launch.INTERPRETED:
        return False
    if not triton_launch.kernel_runs_on(x):
        return False
    if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE or not 0 < num_tokens <= MAX_TOKENS:
        return False
    num_chunks = in_features // BLOCK_K
    if in_features % BLOCK_K or not 2 <= num_chunks <= MAX_UNROLLED_CHUNKS:
        return False
    if not copies_align(x, weight) or not current_platform().supports_warpgroup_mma():
        return False
    num_tiles = triton.cdiv(weight.shape[0], BLOCK_N)
    shared = triton_gemv_config.max_shared_bytes(x.device) or 0
    fits = ring_slots(num_tokens, shared, gated, num_chunks) >= 2
    return fits and num_tiles > (triton_gemv_config.num_sms(x.device) or num_tiles)


def fp8_decode_gated_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out_dtype: torch.dtype,
    out_scale: torch.Tensor,
) -> torch.Tensor:
    """The gated FP8 GEMV of a decode-sized product (``silu(gate) * up`` quantized with
    ``out_scale``): the ring one where ``uses_ring_gemv``, else the Triton GEMV. If the Gluon
    kernel fails to compile, a warning says so once and the Triton GEMV takes every later
    product."""
    if uses_ring_gemv(x, weight, gated=True):
        try:
            return launch_ring_gemv(x, weight, scales, out_dtype, gated=True, out_scale=out_scale)
        except Exception as error:  # noqa: BLE001 - reported, then the Triton GEMV runs
            _COMPILE_FAILURES.append(f"{type(error).__name__}: {error}"[:500])
            logger.warning(
                "the ring FP8 GEMV does not run with Triton %s (%s); gate_up_proj uses the "
                "Triton GEMV instead. Please report it.",
                triton.__version__,
                _COMPILE_FAILURES[-1],
            )
    return launch_gemv(
        x, weight, scales=scales, gated=True, out_dtype=out_dtype, out_scale=out_scale
    )
