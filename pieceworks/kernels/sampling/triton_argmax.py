"""``launch_row_argmax``: the greedy rows' argmax in two Triton launches, straight from the logits.

Why: the torch form (the logits cast to float32, then ``sampler.chunked_argmax``: padded, the
max of each chunk, the argmax of the chunk maxima, a gather and the index arithmetic) runs as a
chain of small kernels after the LM head (what it costs: ``docs/performance.md``). These read
the logits in their own dtype (the cast to float32 is exact and keeps the order, so the argmax is
the same) and write the index.

Two launches, so that a row is read by many SMs at once. Stage 1, one program per ``BLOCK``
columns of a row: each value becomes an int32 key that orders as the float does (negative values
have their magnitude bits flipped; -0.0 counts as +0.0; every NaN is above everything, as torch's
argmax returns the first NaN), one integer reduction gives the block's largest key and its first
column, and the two are packed into one int64 that orders as (key, -column). Stage 2, one
program per row: the largest packed value of the row's blocks, so ties go to the first column,
as in ``torch.argmax``. (A single program walking a row would read its blocks one after the
other.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.kernels import triton_device
from pieceworks.kernels.kernel_launch import KernelLaunch

__all__ = ["launch_row_argmax", "uses_kernel"]

ARGMAX_BLOCK = 4096  # columns per program of stage 1 (the fastest measured on an H200)
ARGMAX_WARPS = 4
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)
_UINT32_MAX = tl.constexpr(2**32 - 1)
_INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _ordered_key(values):
    """int32 keys that order as the float32 ``values`` do (NaN above all, -0.0 equal to +0.0)."""
    bits = values.to(tl.int32, bitcast=True)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative: larger magnitude, smaller key
    keys = tl.where(values == 0.0, 0, keys)  # -0.0 == +0.0, as torch compares them
    return tl.where(values != values, _INT32_MAX, keys)


@triton.jit
def _block_argmax_kernel(
    logits_ptr, packed_ptr, vocab_size, stride_row, num_blocks, BLOCK: tl.constexpr
):
    """Stage 1, one program per (row, block): the block's largest key and its first column,
    packed into one int64 that orders as (key, -column) does."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    columns = block * BLOCK + tl.arange(0, BLOCK)
    mask = columns < vocab_size
    values = tl.load(logits_ptr + row * stride_row + columns, mask=mask, other=0.0)
    keys = _ordered_key(values.to(tl.float32))
    keys = tl.where(mask, keys, _INT32_MIN)  # no real value has a key this low
    key, index = tl.max(keys, axis=0, return_indices=True, return_indices_tie_break_left=True)
    column = block.to(tl.int64) * BLOCK + index
    low_half = tl.full((), _UINT32_MAX, tl.int64) - column  # larger for an earlier column
    packed = (key.to(tl.int64) << 32) | low_half
    tl.store(packed_ptr + row * num_blocks + block, packed)


@triton.jit
def _row_argmax_kernel(packed_ptr, out_ptr, num_blocks, BLOCK_BLOCKS: tl.constexpr):
    """Stage 2, one program per row: the largest packed value of the row's blocks (the largest
    key, and of equal keys the first column) and its column."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCK_BLOCKS)
    packed = tl.load(
        packed_ptr + row * num_blocks + blocks, mask=blocks < num_blocks, other=_INT64_MIN
    )
    low_half = tl.max(packed, axis=0) & tl.full((), _UINT32_MAX, tl.int64)
    tl.store(out_ptr + row, tl.full((), _UINT32_MAX, tl.int64) - low_half)


def launch_row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` by the kernels: (S,) int64 for (S, V) logits, rows contiguous."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            "the argmax kernel takes (S, V) logits with contiguous rows, not shape "
            f"{tuple(logits.shape)} with strides {logits.stride()}"
        )
    num_rows = logits.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    key = (num_rows, logits.shape[1], logits.stride(0), logits.device)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_CACHED_PLANS:
            _plans.clear()
        plan = _plans[key] = _plan(*key)
    block_launch, row_launch, num_blocks = plan
    packed = torch.empty(num_rows, num_blocks, dtype=torch.int64, device=logits.device)
    block_launch(logits, packed)
    row_launch(packed, out)
    return out


# The two launches per logits shape (rows, vocabulary, row stride, device): a decode batch size
# each, so few; they are bound after their first launch (``kernel_launch.KernelLaunch``).
MAX_CACHED_PLANS = 64
_plans: dict[tuple, tuple[KernelLaunch, KernelLaunch, int]] = {}


def _plan(
    num_rows: int, vocab_size: int, row_stride: int, device: torch.device
) -> tuple[KernelLaunch, KernelLaunch, int]:
    block = min(ARGMAX_BLOCK, triton.next_power_of_2(vocab_size))
    num_blocks = triton.cdiv(vocab_size, block)
    block_launch = KernelLaunch(
        _block_argmax_kernel,
        (num_rows, num_blocks),
        (vocab_size, row_stride, num_blocks),
        {"BLOCK": block, "num_warps": ARGMAX_WARPS},
    )
    row_launch = KernelLaunch(
        _row_argmax_kernel,
        (num_rows,),
        (num_blocks,),
        {"BLOCK_BLOCKS": triton.next_power_of_2(num_blocks), "num_warps": 1},
    )
    return block_launch, row_launch, num_blocks


def uses_kernel(logits: torch.Tensor) -> bool:
    """Whether ``sampler.row_argmax`` runs the kernel for these logits (else its torch form)."""
    return (
        logits.dim() == 2
        and logits.dtype in KERNEL_DTYPES
        and logits.stride(1) == 1
        and 0 < logits.shape[1] < 2**31
        and triton_device.kernel_runs_on(logits)
    )
