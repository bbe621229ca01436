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
"""

from __future__ import annotations

import torch
import triton

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels import triton_device
from pieceworks.kernels.gemv import triton_gemv_config
from pieceworks.kernels.gemv.triton_gemv import launch_gemv
from pieceworks.kernels.gemv.triton_gemv_config import RopeEpilogue
from pieceworks.kernels.triton_launch import launch, launch_options, programmatic_launch
from pieceworks.kernels.triton_rounding import TRITON_DTYPES
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import WARPGROUP_MMA

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
        X_ROWS: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        RESIDENT: gl.constexpr,
        ROPE: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # ROPE: a merged qkv weight; the program's first BLOCK_N / 2 rows are the first halves of
        # BLOCK_N / 2 pairs of one head, the others their partners half a head further (as the
        # Triton GEMV stacks them), and the epilogue rotates the pairs (_rope_epilogue)
        if PDL:  # the next kernel may be scheduled now; it waits for this one
            _pdl_release()
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
        x_chunks = gl.allocate_shared_memory(  # chunk c is rows c * BLOCK_T .. + BLOCK_T - 1
            gl.float8e4nv, [X_ROWS, BLOCK_K], slot_layout
        )
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
        weight_rows, row_valid = _weight_rows(rows, out_features, head_size, BLOCK_N, ROPE)
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, copy_layout))
        w_ptrs = weight_ptr + weight_rows.to(gl.int64)[:, None] * stride_weight + ks[None, :]
        row_mask = row_valid[:, None]
        for chunk in gl.static_range(RESIDENT):  # W does not depend on the kernel before
            _async_load(w_slots.index(chunk), w_ptrs + chunk * BLOCK_K, mask=row_mask)
            async_copy.commit_group()
        # x in one copy, chunk c's tokens in rows c * BLOCK_T ..: one copy per chunk, each into a
        # view of the buffer, puts a CTA barrier after every copy (16 between the PDL wait and the
        # first MMA with triton 3.6; one this way)
        # (X_ROWS: NUM_CHUNKS * BLOCK_T rounded up to a power of two, as a range must be; the
        # rows past the last chunk are never copied nor read)
        x_rows = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, copy_layout))
        tokens = x_rows % BLOCK_T
        x_ptrs = x_ptr + (tokens * stride_x + (x_rows // BLOCK_T) * BLOCK_K)[:, None] + ks[None, :]
        # pad tokens: zeros, never stored
        token_mask = ((tokens < num_tokens) & (x_rows < NUM_CHUNKS * BLOCK_T))[:, None]
        # The scales, and for ROPE the rotary factors at the tokens' positions, no kernel of the
        # step writes: read before the wait, so that no load round trip follows the MMAs
        scale = gl.load(x_scale_ptr) * gl.load(weight_scale_ptr)
        if ROPE:
            cos, sin = _rotary_factors(
                positions_ptr,
                cos_sin_ptr,
                num_tokens,
                stride_cos_sin,
                head_size,
                BLOCK_T,
                BLOCK_N,
                num_warps,
            )
        if PDL:
            _pdl_wait()  # x is the kernel before's output
        _async_load(x_chunks, x_ptrs, mask=token_mask)
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
            x_t = x_chunks.slice(chunk * BLOCK_T, BLOCK_T).permute((1, 0))  # (BLOCK_K, T)
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
        acc = (acc_even + acc_odd) * scale  # (BLOCK_N, T) = (W x^T) for this program's rows
        if ROPE:
            _rope_epilogue(
                acc,
                out_ptr,
                cos,
                sin,
                num_tokens,
                out_features,
                stride_out,
                head_size,
                num_rotary_heads,
                BLOCK_T,
                BLOCK_N,
                ROUND_DTYPE,
                num_warps,
            )
        else:
            columns = gl.program_id(0) * BLOCK_N + gl.arange(
                0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout)
            )
            out_tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, mma_layout))
            out_ptrs = out_ptr + out_tokens[None, :] * stride_out + columns[:, None]
            mask = (out_tokens < num_tokens)[None, :] & (columns < out_features)[:, None]
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _weight_rows(rows, out_features, head_size, BLOCK_N: gl.constexpr, ROPE: gl.constexpr):
        """The weight row each of the program's tile rows copies, and whether it exists
        (ROPE: ``out_features`` counts pairs)."""
        if ROPE:  # pair c of head h is row h * D + c % (D / 2); its partner D / 2 further
            HALF_N: gl.constexpr = BLOCK_N // 2
            columns = gl.program_id(0) * HALF_N + rows % HALF_N
            half = head_size // 2
            head = (gl.program_id(0) * HALF_N) // half
            weight_rows = columns + head * half + (rows // HALF_N) * half
        else:
            columns = gl.program_id(0) * BLOCK_N + rows
            weight_rows = columns
        return weight_rows, columns < out_features

    @gluon.constexpr_function
    def _rope_layout(block_t, num_warps):
        """The register layout of the rotary epilogue's (BLOCK_N / 2, BLOCK_T) halves (a
        constexpr function: triton 3.6 cannot return a layout from a jit function)."""
        return gl.BlockedLayout([1, 1], [32 // block_t, block_t], [num_warps, 1], [1, 0])

    @gluon.jit
    def _rope_pairs(head_size, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """The program's head, its pair columns (in the merged qkv output's pair count) and
        their pairs within the head."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        half = head_size // 2
        head = (gl.program_id(0) * HALF_N) // half
        columns = gl.program_id(0) * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, layout))
        return head, columns, columns - head * half

    @gluon.jit
    def _rotary_factors(
        positions_ptr,
        cos_sin_ptr,
        num_tokens,
        stride_cos_sin,
        head_size,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """cos and sin (BLOCK_N / 2, BLOCK_T) in float32 for the program's pairs at each token's
        position (pad tokens: zeros, never stored)."""
        layout: gl.constexpr = _rope_layout(BLOCK_T, num_warps)
        _, _, pairs = _rope_pairs(head_size, BLOCK_N, layout)
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        token_mask = tokens < num_tokens
        positions = gl.load(positions_ptr + tokens, mask=token_mask, other=0)
        cos_ptrs = cos_sin_ptr + positions.to(gl.int64)[None, :] * stride_cos_sin + pairs[:, None]
        cos = gl.load(cos_ptrs, mask=token_mask[None, :], other=0.0).to(gl.float32)
        sin = gl.load(cos_ptrs + head_size // 2, mask=token_mask[None, :], other=0.0)
        return cos, sin.to(gl.float32)

    @gluon.jit
    def _rope_epilogue(
        acc,
        out_ptr,
        cos,
        sin,
        num_tokens,
        out_features,
        stride_out,
        head_size,
        num_rotary_heads,
        BLOCK_T: gl.constexpr,
        BLOCK_N: gl.constexpr,
        ROUND_DTYPE: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """The pairs of ``acc``'s stacked halves rotated (neox) by ``cos`` and ``sin``
        (``_rotary_factors``) for the first ``num_rotary_heads`` heads, stored in the natural
        column order: from the halves rounded to ``ROUND_DTYPE`` first, as an unfused GEMM stores
        them, then in float32 and rounded once, as the Triton GEMV's epilogue computes it
        (``triton_gemv._rotate_pairs``)."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        scratch = gl.allocate_shared_memory(  # the halves: rows 0 .. HALF_N - 1 and the rest
            gl.float32, [BLOCK_N, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        )
        scratch.store(acc)
        _cta_barrier()
        layout: gl.constexpr = _rope_layout(BLOCK_T, num_warps)
        first = scratch.slice(0, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        second = scratch.slice(HALF_N, HALF_N).load(layout).to(ROUND_DTYPE).to(gl.float32)
        head, columns, pairs = _rope_pairs(head_size, BLOCK_N, layout)
        tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, layout))
        token_mask = tokens < num_tokens
        if head < num_rotary_heads:
            rotated_first = first * cos - second * sin
            second = (second * cos + first * sin).to(ROUND_DTYPE).to(gl.float32)
            first = rotated_first.to(ROUND_DTYPE).to(gl.float32)
        half = head_size // 2
        out_ptrs = out_ptr + tokens[None, :] * stride_out + (head * head_size + pairs)[:, None]
        mask = (columns < out_features)[:, None] & token_mask[None, :]
        element = out_ptr.dtype.element_ty
        gl.store(out_ptrs, first.to(element), mask=mask)
        gl.store(out_ptrs + half, second.to(element), mask=mask)


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
    if gluon is None or not triton_device.compiled_kernels_run_on(x.device):
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
        _resident_gemv_kernel,
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
