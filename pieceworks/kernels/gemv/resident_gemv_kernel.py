"""The resident-weight GEMV's Gluon kernel (``_resident_gemv_kernel``) and its helpers.

NVIDIA Hopper code (``cp.async``, ``griddepcontrol``, the warpgroup MMA), defined only where the
installed Triton has Gluon (``gluon`` is None elsewhere). ``newer_copy_groups`` is the copy-group
arithmetic the kernel's waits use, a plain function so that it can be tested anywhere. The
algorithm, the layout and when the kernel runs are described in ``resident_gemv.py``, which
launches it.
"""

from __future__ import annotations

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
        (``triton_gemv_kernel._rotate_pairs``)."""
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
